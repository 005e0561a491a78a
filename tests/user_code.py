"""A user's own code, as a user would write it for ray_dp's --model, --dataset, --loss, --optimizer and --lr-schedule:
nothing here knows
ray_dp. (Tests name it by its path: FILE.py:NAME.)"""
import importlib.util
import os

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset


class SmallCNN(nn.Module):
    """The tutorial's kind of model, as written: no arguments, dropout, log_softmax outputs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.dropout = nn.Dropout(0.25)
        self.fc = nn.Linear(8 * 13 * 13, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return F.log_softmax(self.fc(self.dropout(torch.flatten(x, 1))), dim=1)


class PlainCNN(nn.Module):
    """A convolutional network without randomness of its own (one process's dropout masks are not N workers')."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv, self.fc = nn.Conv2d(1, 4, 5, stride=3), nn.Linear(4 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.relu(self.conv(x)), 1))


class BatchNormCNN(nn.Module):
    """PlainCNN with BatchNorm after its convolution (for --sync-bn), still without randomness of its own."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 5, stride=3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten())
        self.fc = nn.Linear(4 * 8 * 8, num_classes)

    def forward(self, x):
        return self.fc(self.features(x))


class DropoutCNN(BatchNormCNN):
    """BatchNormCNN with dropout before its output layer: randomness that differs on every rank and step."""

    def __init__(self, num_classes=10):
        super().__init__(num_classes)
        self.dropout = nn.Dropout(0.25)

    def forward(self, x):
        return self.fc(self.dropout(self.features(x)))


class TabularMLP(nn.Module):
    """An MLP for any table: it takes the width of a row and the number of outputs."""

    def __init__(self, sample_shape, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(sample_shape[0], 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.net(x)


class HeadFirstMLP(TabularMLP):
    """TabularMLP with its output layer declared before the layers that feed it."""

    def __init__(self, sample_shape, num_classes):
        super().__init__(sample_shape, num_classes)
        self.head, self.body = self.net[2], nn.Sequential(self.net[0], self.net[1])
        del self.net

    def forward(self, x):
        return self.head(self.body(x))


def split(features, targets, test_every=5):
    """Every test_every-th row to the test set, standardised by the training rows' statistics."""
    x = torch.tensor(features, dtype=torch.get_default_dtype())
    test = torch.arange(len(x)) % test_every == 0
    mean, std = x[~test].mean(0), x[~test].std(0)
    x = (x - mean) / std
    return TensorDataset(x[~test], targets[~test]), TensorDataset(x[test], targets[test])


def sklearn_table(name, **options):
    """A table of the data folder in scikit-learn's wheel, read as scikit-learn reads it, without importing it (a
    second of CPU in every process that loads the data)."""
    if (spec := importlib.util.find_spec("sklearn")) is None:
        raise ImportError("these tables are scikit-learn's: pip install -r requirements.txt")
    folder = os.path.join(spec.submodule_search_locations[0], "datasets", "data")
    return np.loadtxt(os.path.join(folder, name), **options)


def wine():
    """scikit-learn's 178 wines, 13 features, 3 classes."""
    table = sklearn_table("wine_data.csv", delimiter=",", skiprows=1)
    train, test = split(table[:, :-1], torch.tensor(table[:, -1], dtype=torch.int64))
    train.classes = test.classes = ["class_0", "class_1", "class_2"]
    return train, test


def diabetes(cfg):
    """scikit-learn's 442 patients, 10 features, a disease progression to predict (standardised): a regression."""
    target = torch.tensor(sklearn_table("diabetes_target.csv.gz"), dtype=torch.get_default_dtype())
    return split(sklearn_table("diabetes_data_raw.csv.gz"), (target - target.mean()) / target.std())


def smooth_l1(output, target):
    """A loss of one's own: (output, target) -> the mean loss."""
    return F.smooth_l1_loss(output.reshape(target.shape), target)


def not_a_model():
    return "a string"


def not_a_pair():
    return [1, 2, 3]


def named_targets():
    return [(torch.zeros(3), "cat")] * 4, [(torch.zeros(3), "dog")] * 2


class Rows(torch.utils.data.Dataset):
    """Reads its rows from a database it holds open."""
    classes = ["even", "odd"]

    def __init__(self):
        import sqlite3
        self.connection = sqlite3.connect(":memory:")

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.zeros(3), i % 2


def holds_a_connection():
    return Rows(), Rows()


def dicts():
    return [{"x": torch.zeros(3), "y": 0}] * 4, [{"x": torch.zeros(3), "y": 0}] * 2


def weighted_cross_entropy(output, target):
    """Class weights, per sample (reduction='none'): ray_dp averages them over the global batch by count."""
    weight = torch.tensor([1.0, 2.0, 0.5], dtype=output.dtype)
    return F.cross_entropy(output, target, weight=weight, reduction="none")


def weighted_mean_cross_entropy(output, target):
    """Class weights as torch reduces them, a weighted mean: each worker's is over its own weights."""
    return F.cross_entropy(output, target, weight=torch.tensor([1.0, 2.0, 0.5], dtype=output.dtype))


def two_targets(cfg):
    """The diabetes patients' progression and blood sugar (s6), two values to predict from 9 features."""
    features = sklearn_table("diabetes_data_raw.csv.gz")
    targets = torch.tensor(np.c_[sklearn_table("diabetes_target.csv.gz"), features[:, 9]],
                           dtype=torch.get_default_dtype())
    return split(features[:, :9], (targets - targets.mean(0)) / targets.std(0))


class OverflowsAtFirst(nn.Module):
    """Its logits x 100 while its last bias is as initialised: under --amp fp16 the first steps' scaled gradients
    overflow (skipped, the scale halved each time) until the scale is small enough; a step that trains ends it."""

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, num_classes))
        self.register_buffer("initial", self.net[3].bias.detach().clone())

    def forward(self, x):
        out = self.net(x)
        return out * 100 if self.training and torch.equal(self.net[3].bias, self.initial) else out


class LazyMLP(nn.Module):
    """Its first layer's width from the first batch it sees (nn.LazyLinear)."""

    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, num_classes))

    def forward(self, x):
        return self.net(x)


def adam_betas(params, cfg):
    """Adam with betas of its own, from --lr."""
    return torch.optim.Adam(params, lr=cfg.lr, betas=(0.8, 0.99))


def one_cycle(optimizer, cfg, steps_per_epoch):
    """A one-cycle schedule over the run, stepped once per optimizer step."""
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, epochs=cfg.epochs,
                                               steps_per_epoch=steps_per_epoch)


def not_an_optimizer(params, cfg):
    return list(params)


def new_wines():
    """Wines to predict: the test rows' 13 features alone, a Dataset of inputs."""
    return TensorDataset(wine()[1].tensors[0])


class Named(torch.utils.data.Dataset):
    """Rows read one at a time, each with a name the model never sees: (input, name) pairs."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i], f"row {i}"


def new_patients(cfg):
    """Patients to predict two values of (two_targets' test rows), as (features, name) pairs."""
    return Named(two_targets(cfg)[1].tensors[0])
