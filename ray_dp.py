#!/usr/bin/env python
"""ray-dp: the DDP tutorial's training loop on N Ray workers (or torchrun's processes), one file.

    python ray_dp.py --workers 2 --dataset digits         # offline quick start, CPU
    python ray_dp.py --workers 8 --model resnet18         # Fashion-MNIST, downloaded to ./data
    python ray_dp.py --dataset cifar10 --model resnet18 --sync-bn --accum-steps 2
    python ray_dp.py --name myrun ...                     # the same --name again resumes it
    python ray_dp.py --mode scratch --dataset digits      # d2l's hand-written all-reduce LeNet
    python ray_dp.py compare --workers 2 --dataset digits # ddp vs scratch, 1 vs N workers
    python ray_dp.py --eval-only runs/myrun --workers 3 --predict-out preds.csv
    python ray_dp.py predict runs/myrun --inputs photos/ --workers 3 --out preds.csv
    python ray_dp.py --address auto --gpu ...             # a cluster: ray up cluster.yaml
    python ray_dp.py doctor --address auto --workers 8    # check that cluster first
    torchrun --nproc_per_node 4 ray_dp.py ...             # the tutorial's launcher, same flags
    tensorboard --logdir runs/tensorboard

Part I, the lesson: Config, Data, Models, Distributed helpers, Train & evaluate, Teaching mode,
    The worker loop, The launch.
Part II, operations: Command line, The driver's plumbing, Worker set-up, Pre-flight checks, Your own
    model, data and loss, Image folders and torchvision models, Checkpoints, Resume, Run-directory
    files, result.json, Failure records, Operations, Mid-epoch saves and SIGTERM, Health, Console
    and monitoring, Inference, compare, Object storage, Data on disk and on many nodes, Launchers
    and torchrun, The cluster, Ray internals, doctor.
"""
from __future__ import annotations

import time

STARTED_AT = time.time()  # the run's ledger counts the imports

import argparse
import contextlib
import copy
import copyreg
import ctypes
import difflib
import errno
import functools
import gc
import hashlib
import importlib
import importlib.util
import inspect
import io
import json
import logging
import math
import os
import re
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import traceback
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Optional, get_args, get_type_hints

import ray

__version__ = "0.6.0"
SUPPORTED_RAY = ("2.59", "2.61")  # Ray Train's V2 API: from, up to but not including


def ray_version_problem(version: str) -> Optional[str]:
    from packaging.version import Version
    low, high = SUPPORTED_RAY
    if Version(low) <= Version(version) < Version(high):
        return None
    return (f"ray_dp needs Ray >= {low} and < {high} (Ray Train's V2 API), but Ray {version} is "
            f"installed: pip install -r requirements.txt (ray[train]==2.60.0), on every node of "
            f"the cluster too")


if (_problem := ray_version_problem(ray.__version__)):
    if __name__ == "__main__":  # one line in 0.1 s, not a traceback after torch's imports
        print(f"ray_dp.py: error: {_problem}", file=sys.stderr)
        sys.exit(2)
    raise ImportError(_problem)

_COLLECTING = gc.isenabled()  # torch's and Ray's imports leave no garbage: 0.5 s of collecting
gc.disable()
try:
    import numpy as np
    import psutil
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, Subset, TensorDataset

    import ray.cloudpickle
    import ray.train
    import ray.train.torch
    from pyarrow import ArrowException, fs
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    from PIL import Image
    from tqdm import tqdm
finally:
    if _COLLECTING:
        gc.enable()


# ==================================================================================================
# PART I: THE LESSON
# ==================================================================================================
# Config: every field is a command-line flag (--field-name), declared with its help and its facts.
# ==================================================================================================

MODES = ("ddp", "scratch", "dp")
OPTIMIZERS, SCHEDULES = ("sgd", "adamw"), ("cosine", "constant")
ALLREDUCE_ALGORITHMS = ("naive", "ring", "library")
NUM_CLASSES = 10
MODEL_IMAGE_SIZE = {"lenet": 28, "mlp": 28, "resnet18": 32}


def option(default, help, *, rerun: str = "fixed", evaluation: str = "train", doctor: bool = False,
           lesson=None, path: bool = False, store: str = "", scratch: str = "",
           bounds: str = "", code: bool = False, **argparse_kwargs):
    """A flag with its facts. rerun: "fixed" (another typed value is refused), "adopt" (the run's
    unless typed), "free"; evaluation: "train" (refused), "checkpoint", "adopt", "free"; doctor:
    it takes it; lesson: scratch's default; path: made absolute; store: a URI "read" or "write";
    scratch: why scratch mode refuses any value but the default; bounds: an interval, "[0, 1)";
    code: it may name your code (FILE.py:NAME), which travels with the job."""
    return field(default=default, metadata={
        "help": help, "rerun": rerun, "evaluation": evaluation, "doctor": doctor, "lesson": lesson,
        "path": path, "store": store, "scratch": scratch, "bounds": bounds, "code": code,
        "argparse": argparse_kwargs})


def setting(default, help, **facts):
    """A flag of how to run, not of what is trained: a rerun or --eval-only may change it."""
    return option(default, help, rerun="free", evaluation="free", **facts)


BEST_BY = ("val_loss", "val_acc", "test_loss", "test_acc", "train_loss", "samples_per_second",
           "epoch_seconds")


@dataclass(frozen=True)
class Config:
    mode: str = option("ddp", "ddp: DistributedDataParallel, a process per worker; scratch: "
                       "d2l's functional LeNet, hand-written all-reduce and SGD; dp: "
                       "nn.DataParallel over --workers GPUs of one process", choices=MODES)
    workers: int = setting(2, "training processes, a GPU each on a GPU cluster; MIN:MAX: elastic, "
                           "from the last checkpoint as workers come or go", metavar="N|MIN:MAX",
                           doctor=True, bounds="[1, inf)")
    min_workers: int = setting(0, "", cli=False)
    cpus_per_worker: Optional[float] = setting(
        None, "CPU cores per worker, fractions allowed (default 1; more workers than a machine's "
        "cores share them)", type=float, metavar="CPUS", doctor=True, bounds="(0, inf)")
    gpu: Optional[bool] = setting(None, "GPU workers (default: when the cluster has GPUs)",
                                  doctor=True)
    epochs: int = option(10, "passes over the training set", metavar="N", rerun="adopt",
                         lesson=20, bounds="[1, inf)")
    batch_size: int = option(64, "GLOBAL batch: samples per optimizer step over all workers "
                             "(a worker's micro-batch: batch-size / (workers x accum-steps))",
                             metavar="N", lesson=32, bounds="[1, inf)")
    amp: Optional[str] = option(None, "autocast of the forward pass: bf16 (--amp alone), or fp16 "
                                "with a GradScaler (GPUs without bf16: T4, V100)", type=str,
                                nargs="?", const="bf16", choices=("bf16", "fp16"),
                                evaluation="adopt", scratch="the lesson's plain fp32 code")
    compile: bool = option(False, "torch.compile the model", rerun="free",
                           scratch="the lesson's plain fp32 code")
    lr: float = option(0.05, "peak learning rate", metavar="LR", lesson=0.2, bounds="(0, inf)")
    lr_schedule: str = option("cosine", "cosine decay to 0 over --epochs, constant, or yours: "
                              "FILE.py:NAME, (optimizer, cfg, steps_per_epoch) -> an LRScheduler "
                              "stepped every step", metavar="SCHEDULE", lesson="constant",
                              code=True)
    momentum: float = option(0.9, "SGD momentum", metavar="M", lesson=0.0, bounds="[0, 1)")
    accum_steps: int = option(1, "micro-batches per optimizer step (gradients all-reduced on the "
                              "last)", metavar="K", bounds="[1, inf)",
                              scratch="no gradient accumulation")
    allreduce: str = option("naive", "scratch: naive (the lesson's: into rank 0 and back), ring, "
                            "or library (dist.all_reduce)", choices=ALLREDUCE_ALGORITHMS)
    sync_bn: bool = option(False, "BatchNorm statistics over every worker's batch",
                           scratch="a LeNet without BatchNorm")
    model: str = option("lenet", "lenet, mlp, resnet18 (the lessons'), any torchvision "
                        "classification model (--model list), or yours: FILE.py:NAME or "
                        "module:NAME, an nn.Module class or a function", metavar="NAME",
                        evaluation="checkpoint", scratch="the lesson's functional LeNet", code=True)
    weights: str = option("", "start from this state_dict (e.g. torchvision's .pth); tensors that "
                          "do not fit stay new; a file or a URI", metavar="PATH", path=True,
                          store="read", scratch="the lesson's plain SGD")
    image_size: Optional[int] = option(
        None, "resize images to N x N (default: the set's own; a folder: 28 for lenet and mlp, 32 "
        "for resnet18, else 224)", type=int, metavar="N", evaluation="checkpoint",
        bounds="[1, inf)", scratch="the lesson's LeNet on 28 x 28 images")
    augment: bool = option(True, "--dataset folder: random resized crops and flips in training")
    optimizer: str = option("sgd", "sgd (with --momentum), adamw, or yours: FILE.py:NAME, an "
                            "optimizer class (params, lr=) or (params, cfg) -> an optimizer",
                            metavar="OPTIMIZER", scratch="the lesson's plain SGD", code=True)
    weight_decay: float = option(0.0, "weight decay, on weights only", metavar="WD",
                                 bounds="[0, inf)", scratch="the lesson's plain SGD")
    warmup_epochs: int = option(0, "epochs of linear learning-rate warm-up", metavar="N")
    clip_grad_norm: float = option(0.0, "clip the gradients' global norm (0: off)", metavar="NORM",
                                   bounds="[0, inf)", scratch="the lesson's plain SGD")
    label_smoothing: float = option(0.0, "label smoothing of the training loss", metavar="EPS",
                                    bounds="[0, 1)", scratch="the lesson's plain SGD")
    find_unused_parameters: bool = option(False, "DDP's: for a model of yours whose parameters "
                                          "are not all used in every step", rerun="free",
                                          scratch="no DDP")
    loss: str = option("cross_entropy", "cross_entropy, mse, or your own: FILE.py:NAME or "
                       "module:NAME, a function or nn.Module class: (output, target) -> the mean "
                       "or per-sample losses", metavar="LOSS", evaluation="checkpoint",
                       scratch="the lesson's cross-entropy", code=True)
    loader_workers: Optional[int] = setting(
        None, "loader processes per worker (0: in-memory data indexed on the device; default: 0 "
        "in memory, 2 read per sample)", type=int, metavar="N", bounds="[0, inf)",
        scratch="the lesson's in-memory batches")
    normalize: Optional[tuple] = option(None, "", cli=False, evaluation="checkpoint")
    synthetic_size: int = option(512, "--dataset synthetic: training images (100 test)",
                                 metavar="N", evaluation="checkpoint", bounds="[1, inf)")
    dataset: str = option("fashion-mnist", "fashion-mnist, cifar10, digits (no download), "
                          "synthetic; folder: --data-dir holding train/<class>/* and "
                          "val/<class>/*; or yours: FILE.py:NAME, a function returning (train, "
                          "test)", evaluation="checkpoint", doctor=True, code=True)
    data_dir: str = option("./data", "where data sets are, or are downloaded to; a folder's on "
                           "every node or in object storage", metavar="DIR", rerun="adopt",
                           evaluation="adopt", doctor=True, path=True, store="read")
    download: bool = setting(True, "download a missing Fashion-MNIST or CIFAR-10", doctor=True)
    val_split: float = option(0.0, "this fraction of the training set held out (by --seed, each "
                              "class alike), scored each epoch", metavar="FRAC", bounds="[0, 1)")
    seed: int = option(0, "initial weights and data order; each sample's augmentation and each "
                       "worker's dropout draw streams of their own", metavar="N",
                       evaluation="checkpoint", bounds="[0, 4294967295]")
    storage_path: str = setting("./runs", "checkpoints and result.json (a directory, or "
                                "s3://...)", metavar="PATH", doctor=True, path=True, store="write")
    name: str = setting("", "run name under --storage-path: the same name resumes (default: "
                        "mode-model-dataset-date-time-pid)", metavar="NAME")
    logdir: str = setting("./runs/tensorboard", "TensorBoard events go to LOGDIR/<name>/",
                          metavar="LOGDIR", path=True)
    log_every: int = option(10, "the train loss to TensorBoard every this many steps",
                            metavar="STEPS", rerun="free", bounds="[1, inf)")
    quiet: bool = setting(False, "no progress bar")
    worker_output: bool = setting(False, "show what Ray's workers print (your code's print() "
                                  "calls, Ray's own lines): else they go to Ray's logs "
                                  "(docs/monitoring.md)")
    max_failures: int = setting(0, "restart the workers this many times from the last checkpoint "
                                "(-1: no limit)", metavar="K", bounds="[-1, inf)")
    max_preemptions: int = setting(-1, "restart the workers this many times after nodes reclaimed "
                                   "with Ray's notice, apart from --max-failures (-1: no limit)",
                                   metavar="K", bounds="[-1, inf)")
    spot_notices: bool = setting(True, "on Ray's notice that a node is reclaimed (spot): save at "
                                 "once, and again before its deadline (under torchrun, SIGTERM's "
                                 "save does)")
    checkpoint_every: str = option(
        "10m", "also checkpoint within an epoch every STEPS steps or Nm minutes (0: at epochs' "
        "ends only)", metavar="STEPS|Nm", rerun="free", lesson="0")
    keep_checkpoints: int = option(3, "epoch checkpoints kept: the latest K (0: all), and the "
                                   "best (--best-by) beside them", metavar="K", rerun="free",
                                   bounds="[0, inf)")
    best_by: str = option("test_loss", "the epoch metric checkpoint_best and --early-stop go by: "
                          "the lowest loss or seconds, else the highest (with --val-split: "
                          "val_loss)", choices=BEST_BY)
    early_stop: int = option(0, "stop after PATIENCE epochs without a better --best-by value (0: "
                             "never)", metavar="PATIENCE", rerun="adopt", bounds="[0, inf)")
    check_replicas: str = setting("auto", "compare the workers' replicas (every parameter and "
                                  "buffer) at each save and every STEPS steps (auto: as often as "
                                  "costs 0.5%% of training; off: never)", metavar="off|auto|STEPS")
    timeout: float = setting(1800.0, "seconds a collective waits for the slowest worker",
                             metavar="SECONDS", bounds="[1, inf)")
    start_timeout: float = setting(60.0, "seconds to wait for the workers to start",
                                   metavar="SECONDS", doctor=True, bounds="[1, inf)")
    keep_freed_memory: bool = setting(True, "keep what a step frees for the next (glibc): faster "
                                      "steps, a higher peak of memory (bench/memory.md)")
    fresh: bool = option(False, "delete the run --name and start it over", rerun="free")
    address: str = setting("", "the Ray cluster ('auto' or host:port; default: a local one)",
                           metavar="ADDRESS", doctor=True)
    eval_only: str = setting("", "evaluate a checkpoint instead of training: a run directory, a "
                             "checkpoint directory or file (a URI too)", metavar="PATH",
                             store="read")
    predict_out: str = setting("", "with --eval-only: each test sample's prediction to this CSV",
                               metavar="FILE.csv", path=True, store="write")

    @property
    def processes(self) -> int:  # --mode dp: one process drives --workers GPUs
        return 1 if self.mode == "dp" else self.workers

    @property
    def micro_batch(self) -> int:
        return self.batch_size // (self.processes * self.accum_steps)

    @property
    def threads(self) -> int:
        return max(1, int(self.cpus_per_worker or 1))

    @property
    def run_dir(self) -> str:
        return os.path.join(self.storage_path, self.name)


class ConfigError(ValueError):
    """Bad input: one line, before any cluster starts."""


class DataError(RuntimeError):
    """The data are missing, or differ where they must not."""


# ==================================================================================================
# Data: a data set is a function of the config returning (train, test); the lessons' come first.
# ==================================================================================================

DATASETS: dict = {}


@dataclass(frozen=True)
class Source:
    """A --dataset's loader and facts: read per sample by loader processes (else held in memory),
    downloaded if missing, the same samples on every rank, allowed in object storage, image files
    that ray_dp sizes, normalises and augments. Your FILE.py:NAME has the defaults."""
    load: object = None
    per_sample: bool = False
    downloadable: bool = False
    same_on_every_rank: bool = False
    object_storage: bool = False
    image_files: bool = False


def dataset(name: str, **facts):
    """Register `load(cfg) -> (train, test)` under --dataset NAME, with its facts (Source's). A
    TensorDataset takes the in-memory fast path; any other Dataset is read per sample."""
    def register(load):
        DATASETS[name] = Source(load, **facts)
        return load
    return register


def data_source(name: str) -> Source:
    return DATASETS.get(name, Source())


def load_dataset(cfg: Config) -> tuple:
    """(train, test) of --dataset: a built-in's, or your own function's, called with the config if
    its first argument has no default (or is named cfg)."""
    if cfg.dataset in DATASETS:
        return DATASETS[cfg.dataset].load(cfg)
    return your_datasets(cfg)


class NamedTensors(TensorDataset):

    def __init__(self, *tensors, classes: Optional[list] = None):
        super().__init__(*tensors)
        self.classes = [str(c) for c in range(NUM_CLASSES)] if classes is None else classes


@dataset("fashion-mnist", downloadable=True, same_on_every_rank=True)
def load_fashion_mnist(cfg: Config) -> tuple:
    from torchvision.datasets import FashionMNIST
    return load_torchvision(FashionMNIST, cfg.data_dir, cfg.download)


@dataset("cifar10", downloadable=True, same_on_every_rank=True)
def load_cifar10(cfg: Config) -> tuple:
    from torchvision.datasets import CIFAR10
    return load_torchvision(CIFAR10, cfg.data_dir, cfg.download)


@dataset("synthetic", same_on_every_rank=True)
def load_synthetic(cfg: Config) -> tuple:
    return make_synthetic(cfg.seed, cfg.synthetic_size)


@dataset("digits", same_on_every_rank=True)
def load_digits(cfg: Optional[Config] = None) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1,797 real 8x8 digits (in its wheel), resized to 28x28 like MNIST; a fixed
    split, whatever --seed, so every run is scored on the same digits."""
    pixels, target = sklearn_digits_file()
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.tensor(target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:360], order[360:]
    return NamedTensors(images[train], labels[train]), NamedTensors(images[test], labels[test])


def sklearn_digits_file() -> tuple:
    """(pixels, labels) read as scikit-learn reads digits.csv.gz, without its 1 s import."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise DataError("--dataset digits needs scikit-learn: pip install -r requirements.txt")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise DataError(f"--dataset digits: scikit-learn's {path} is missing: reinstall it "
                        f"(pip install -r requirements.txt)")
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def make_synthetic(seed: int, n_train: int = 512, n_test: int = 100) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n_train + n_test, 1, 28, 28, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (n_train + n_test,), generator=gen)
    return NamedTensors(x[:n_train], y[:n_train]), NamedTensors(x[n_train:], y[n_train:])


def images_to_tensors(split) -> TensorDataset:
    images = torch.as_tensor(split.data)
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    return NamedTensors(images.float().div(255), torch.as_tensor(split.targets, dtype=torch.int64),
                        classes=class_names(split))


def class_names(data) -> list:
    if getattr(data, "classes", None):
        return [str(name) for name in data.classes]
    if not isinstance(data, TensorDataset) and not hasattr(data, "targets"):
        raise DataError(f"a data set read per sample ({type(data).__name__}) needs a `classes` "
                        f"attribute (the class names) or `targets` (every sample's label)")
    return [str(c) for c in range(max(labels_of(data)) + 1)]


def labels_of(data) -> list:
    if isinstance(data, TensorDataset):
        return data.tensors[1].tolist()
    if hasattr(data, "targets"):  # without decoding a sample
        return [int(label) for label in data.targets]
    return [int(data[i][1]) for i in range(len(data))]


def classifies(data) -> bool:
    """Targets that are class indices (accuracy, per-class tables), not values (a regression)."""
    target = torch.as_tensor(data.tensors[1][0] if isinstance(data, TensorDataset) else data[0][1])
    return target.ndim == 0 and not (target.is_floating_point() or target.is_complex())


def is_image(shape: tuple) -> bool:
    return len(shape) == 3


def outputs(data, classes: list) -> int:
    return len(classes) or torch.as_tensor(data[0][1]).numel()


def input_shape(cfg: Config, data) -> tuple:
    shape = tuple(data[0][0].shape)
    sized = cfg.image_size and is_image(shape)
    return (shape[0], cfg.image_size, cfg.image_size) if sized else shape


def resized(images: torch.Tensor, size: Optional[int]) -> torch.Tensor:
    """In-memory images at --image-size, on their device (the data set keeps its own size)."""
    if not size or images.shape[-1] == size == images.shape[-2]:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False,
                         antialias=size < images.shape[-1])


# ==================================================================================================
# Models: a model is a function of (sample_shape, num_classes) returning an nn.Module: the lessons'
# LeNet and ResNet-18, an MLP; then yours and torchvision's (build_model).
# ==================================================================================================


class LeNet(nn.Module):
    """d2l's LeNet: conv 3x3, avg-pool, conv 5x5, avg-pool, 128, 10 (800 features on 28x28)."""

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = NUM_CLASSES):
        super().__init__()
        side = ((image_size - 2) // 2 - 4) // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 20, kernel_size=3), nn.ReLU(), nn.AvgPool2d(2),
            nn.Conv2d(20, 50, kernel_size=5), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(50 * side * side, 128), nn.ReLU(),
                                        nn.Linear(128, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))


class Residual(nn.Module):
    """ResNet's basic block: two 3x3 convs with BatchNorm, a 1x1 shortcut when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.bn1, self.bn2 = nn.BatchNorm2d(out_channels), nn.BatchNorm2d(out_channels)
        self.shortcut = (nn.Conv2d(in_channels, out_channels, 1, stride=stride)
                         if stride != 1 or in_channels != out_channels else nn.Identity())

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18(in_channels: int = 1, num_classes: int = NUM_CLASSES) -> nn.Sequential:
    """d2l's small-image ResNet-18: a 3x3 stem, no max-pool, 4 stages of 2 blocks."""
    def stage(c_in, c_out, first):
        return nn.Sequential(Residual(c_in, c_out, stride=1 if first else 2),
                             Residual(c_out, c_out))
    return nn.Sequential(
        nn.Conv2d(in_channels, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        stage(64, 64, True), stage(64, 128, False), stage(128, 256, False), stage(256, 512, False),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))


MODELS: dict = {}


def model(name: str):
    def register(build):
        MODELS[name] = build
        return build
    return register


@model("lenet")
def build_lenet(sample_shape: tuple, num_classes: int) -> nn.Module:
    return LeNet(sample_shape[0], sample_shape[-1], num_classes)


@model("resnet18")
def build_resnet18(sample_shape: tuple, num_classes: int) -> nn.Module:
    return resnet18(sample_shape[0], num_classes)


@model("mlp")
def build_mlp(sample_shape: tuple, num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(sample_shape), 256), nn.ReLU(),
                         nn.Linear(256, num_classes))


def build_model(name: str, sample_shape: tuple, num_classes: int = NUM_CLASSES) -> nn.Module:
    """A built-in; else yours or torchvision's (named_model)."""
    if name in MODELS:
        return MODELS[name](tuple(sample_shape), num_classes)
    return named_model(name, tuple(sample_shape), num_classes)


# ==================================================================================================
# Distributed helpers: who this worker is, the collectives, SyncBatchNorm on CPU, DDP, the samplers.
# ==================================================================================================


@dataclass
class Worker:
    rank: int
    world: int
    device: torch.device
    node_rank: int = 0
    marks: dict = field(default_factory=dict)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def current(cls, cfg: Config) -> "Worker":
        torch.set_num_threads(cfg.threads)  # Ray sets OMP_NUM_THREADS=1 in workers
        rank, world = rank_and_world()
        try:
            context = ray.train.get_context()
            return cls(rank, world, ray.train.torch.get_device(), context.get_node_rank())
        except (RuntimeError, AttributeError):
            return cls(rank, world, torch.device("cpu"))


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if rank_and_world()[1] > 1:
        dist.all_reduce(tensor)
    return tensor


def from_rank_0(value, device: torch.device):
    """Rank 0's object on every rank; your code's classes go by value (the other ranks have not
    imported your file)."""
    if rank_and_world()[1] == 1:
        return value
    shared = [ray.cloudpickle.dumps(value) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0, device=device)
    return ray.cloudpickle.loads(shared[0])


def broadcast_from_rank_0(tensors: list) -> None:
    """Rank 0's values of these tensors on every rank, one broadcast per dtype."""
    by_dtype: dict = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([tensor.reshape(-1) for tensor in same])
        dist.broadcast(flat, src=0)
        for tensor, values in zip(same, flat.split([tensor.numel() for tensor in same])):
            tensor.copy_(values.view_as(tensor))


class SyncBatchNormCPU(nn.modules.batchnorm._BatchNorm):
    """BatchNorm (1d, 2d or 3d) over all workers' batches on CPU, where torch's SyncBatchNorm will
    not run: each rank's (count, mean, M2), one autograd-aware all-reduce, Chan's formula."""

    def _check_input_dim(self, x):
        if x.ndim < 2:
            raise ValueError(f"expected at least 2D input (got {x.ndim}D input)")

    def forward(self, x):
        rank, world = rank_and_world()
        if not self.training or world == 1:
            return super().forward(x)
        dims, shape = (0, *range(2, x.ndim)), (1, x.shape[1], *(1,) * (x.ndim - 2))
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        count = torch.full((1,), x.numel() / x.shape[1], dtype=x32.dtype, device=x.device)
        mean = x32.mean(dims)
        m2 = (x32 - mean.view(shape)).square().sum(dims)
        rows = torch.zeros(world, 1 + 2 * x.shape[1], dtype=x32.dtype, device=x.device)
        rows = rows.index_copy(0, torch.tensor([rank], device=x.device),
                               torch.cat([count, mean, m2]).unsqueeze(0))
        rows = differentiable_all_reduce(rows)  # the gradients of every rank's rows, summed too
        mean, var, n = combine_statistics(rows[:, 0], *rows[:, 1:].chunk(2, dim=1))
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                weight = (1 / self.num_batches_tracked.item() if self.momentum is None
                          else self.momentum)  # None: torch's cumulative average
                dtype = self.running_mean.dtype
                self.running_mean.lerp_(mean.detach().to(dtype), weight)
                self.running_var.lerp_((var.detach() * n / (n - 1)).to(dtype), weight)
        x_hat = (x32 - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            x_hat = x_hat * self.weight.view(shape) + self.bias.view(shape)
        return x_hat.to(x.dtype)


def combine_statistics(counts, means, m2s) -> tuple:
    """Chan et al.: the global mean, biased variance and count from each rank's (n, mean, M2)."""
    n = counts.sum()
    mean = (counts[:, None] * means).sum(0) / n
    m2 = m2s.sum(0) + (counts[:, None] * (means - mean).square()).sum(0)
    return mean, m2 / n, n


def convert_sync_bn(model: nn.Module, device: torch.device) -> nn.Module:
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if (isinstance(child, nn.modules.batchnorm._BatchNorm)
                and not isinstance(child, SyncBatchNormCPU)):
            synced = SyncBatchNormCPU(child.num_features, child.eps, child.momentum, child.affine,
                                      child.track_running_stats)
            for tensor in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
                setattr(synced, tensor, getattr(child, tensor))  # the very tensors, as torch's
            setattr(model, name, synced.train(child.training))
        else:
            convert_sync_bn(child, device)
    return model


class NamingDDP(DDP):
    """DDP whose error for parameters left without a gradient says so in its last line."""

    def forward(self, *inputs, **kwargs):
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            if "find_unused_parameters=True" not in str(exc):
                raise
            raise RuntimeError("parameters of the model got no gradient in a step (DDP needs each "
                               "one's): train with --find-unused-parameters") from exc


def wrap_model(model: nn.Module, device: torch.device, cfg: Optional[Config] = None) -> nn.Module:
    if cfg and cfg.mode == "dp":
        return nn.DataParallel(model)
    if rank_and_world()[1] == 1:
        return model
    return NamingDDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                     gradient_as_bucket_view=True,
                     find_unused_parameters=bool(cfg and cfg.find_unused_parameters))


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under torch.compile's and DDP's wrappers: what checkpoints hold."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, (DDP, nn.DataParallel)) else model


def no_sync(model: nn.Module, skip: bool):
    """DDP's model.no_sync() where `skip`: this micro-batch's gradients stay local."""
    ddp = getattr(model, "_orig_mod", model)
    return ddp.no_sync() if isinstance(ddp, DDP) and skip else contextlib.nullcontext()


def on_device(model: nn.Module, device: torch.device, name: str) -> nn.Module:
    """The model on its device in channels_last, the layout convolutions run fastest in
    (bench/step.md); the LeNet's few channels stay NCHW on GPU, 5-D weights (Conv3d) as they are."""
    if device.type == "cuda" and name == "lenet" or any(p.ndim == 5 for p in model.parameters()):
        return model.to(device)
    return model.to(device, memory_format=torch.channels_last)


class ResumableSampler(DistributedSampler):
    """DistributedSampler whose set_epoch(epoch, start) leaves out the epoch's first `start`
    samples (what saved steps consumed, on any number of workers) and shards the rest alike."""

    start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def __len__(self) -> int:
        return (len(self.dataset) - self.start) // self.num_replicas

    def __iter__(self):  # from start 0: DistributedSampler's order and shards, drop_last
        order = torch.randperm(len(self.dataset),
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        rest = order[self.start:self.start + len(self) * self.num_replicas]
        return iter(rest[self.rank::self.num_replicas].tolist())


def train_sampler(data, rank: int, world: int, seed: int) -> ResumableSampler:
    return ResumableSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed,
                            drop_last=True)


class InMemoryBatches:
    """Data in memory indexed on the worker's device by the sampler's micro-batches, no loader."""

    def __init__(self, data: TensorDataset, sampler: ResumableSampler, micro_batch: int):
        self.data, self.sampler = data, sampler
        self.batch_sampler = BatchSampler(sampler, micro_batch, drop_last=True)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self):
        images, labels = self.data.tensors
        for index in self.batch_sampler:
            index = torch.tensor(index, device=images.device)
            yield images[index], labels[index]


# What must be equal on every rank (initial weights, data order) is drawn from --seed; what must
# differ gets a stream of its own: each sample's augmentation, each rank's dropout in each step.
AUGMENTATION_STREAM, RANK_STREAM, VALIDATION_STREAM = 1, 2, 3


def stream_seed(seed: int, stream: int, *keys: int) -> int:
    return int(np.random.SeedSequence([seed, stream, *keys]).generate_state(1, np.uint64)[0])


def seed_generators(seed: int, device: torch.device, every_gpu: bool = False) -> None:
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        (torch.cuda.manual_seed_all if every_gpu else torch.cuda.manual_seed)(seed)


def train_batches(data, cfg: Config, rank: int, world: int, device: torch.device):
    sampler, workers = train_sampler(data, rank, world, cfg.seed), loader_workers(cfg, data)
    if not workers and isinstance(data, TensorDataset):
        return InMemoryBatches(data, sampler, cfg.micro_batch)
    if not isinstance(data, TensorDataset):  # each sample's augmentation: a stream of its own
        data, sampler = per_sample(data, sampler, cfg.seed)
    return DataLoader(data, batch_size=cfg.micro_batch, sampler=sampler, drop_last=True,
                      num_workers=workers, pin_memory=device.type == "cuda",
                      persistent_workers=workers > 0, worker_init_fn=leave_sigterm_to_the_rank)


def leave_sigterm_to_the_rank(loader_id: int) -> None:
    """A shutdown's SIGTERM reaches every process: a loader's rank saves, then its stop ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def loader_workers(cfg: Config, data) -> int:
    if cfg.loader_workers is not None:
        return cfg.loader_workers
    return 0 if isinstance(data, TensorDataset) else 2


def shard_indices(n: int, rank: int, world: int) -> torch.Tensor:
    return torch.arange(min(rank, n), n, world)


# ==================================================================================================
# Train & evaluate (on every worker): one epoch, exact evaluation.
# ==================================================================================================


def autocast(cfg: Config, device: torch.device):
    dtype = torch.float16 if cfg.amp == "fp16" else torch.bfloat16
    return torch.autocast(device.type, dtype=dtype, enabled=bool(cfg.amp))


def learning_rate(cfg: Config, epoch: int, lr: Optional[float] = None) -> float:
    """A pure function of the epoch, which a resume continues; `lr`: a group's own peak, or --lr."""
    lr = cfg.lr if lr is None else lr
    if epoch < cfg.warmup_epochs:
        return lr * (epoch + 1) / (cfg.warmup_epochs + 1)
    if cfg.lr_schedule == "constant":
        return lr
    done = (epoch - cfg.warmup_epochs) / (cfg.epochs - cfg.warmup_epochs)
    return lr * 0.5 * (1 + math.cos(math.pi * done))


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with --momentum, or AdamW; --weight-decay on weights, not on biases or norm layers."""
    params = list(model.parameters())
    groups = params if not cfg.weight_decay else [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    if (own := own_optimizer(cfg, groups)) is not None:
        return own
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


LOSSES = {"cross_entropy": lambda cfg: lambda output, target: F.cross_entropy(
              output, target if target.is_floating_point() else target.long(),
              label_smoothing=cfg.label_smoothing),
          "mse": lambda cfg: lambda output, target: F.mse_loss(output.reshape(target.shape),
                                                               target)}


def loss_function(cfg: Config, training: bool = True):
    """--loss as (output, target) -> the mean over samples (label smoothing in training only)."""
    if cfg.loss in LOSSES:
        return LOSSES[cfg.loss](cfg if training else replace(cfg, label_smoothing=0.0))
    return own_loss(cfg)


def train_epoch(model, optimizer, batches, cfg: Config, worker: Worker, epoch: int,
                ops: "Operations", schedule=None, scaler=None) -> dict:
    """One pass over this rank's shard (the rest of one, from a mid-epoch checkpoint)."""
    criterion, tic = loss_function(cfg), time.perf_counter()
    scaler = scaler or torch.amp.GradScaler(worker.device.type, enabled=False)
    model.train()
    for group in optimizer.param_groups if schedule is None else ():
        group["lr"] = learning_rate(cfg, epoch, group.get("initial_lr"))
    first, losses = ops.start_epoch(epoch)
    batches.sampler.set_epoch(epoch, losses.done)  # 5. set_epoch: a new shuffle each epoch
    steps, micro_batches = first + len(batches) // cfg.accum_steps, TimedBatches(batches)
    for step in range(first, steps):
        # this rank's own dropout: a stream of (seed, rank, epoch, step), which a resume redraws
        seed_generators(stream_seed(cfg.seed, RANK_STREAM, worker.rank, epoch, step),
                        worker.device, every_gpu=cfg.mode == "dp")
        for micro in range(cfg.accum_steps):
            x, y = (t.to(worker.device, non_blocking=True) for t in next(micro_batches))
            # 6. no_sync on all but the last micro-batch: one all-reduce of gradients per step
            with no_sync(model, skip=micro < cfg.accum_steps - 1), autocast(cfg, worker.device):
                loss = criterion(model(resized(x, cfg.image_size)), y)
                scaler.scale(loss / cfg.accum_steps).backward()  # K micro-batches: one mean
            losses.add(loss.detach() * len(y), len(y))
        if cfg.clip_grad_norm:  # after the all-reduce: every rank clips the same gradients
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
        scale, lr = scaler.get_scale(), optimizer.param_groups[0]["lr"]
        scaler.step(optimizer)  # fp16: a step whose gradients overflowed is skipped
        scaler.update()
        losses.skipped += scaler.get_scale() < scale
        optimizer.zero_grad(set_to_none=True)
        if schedule is not None:
            schedule.step()
        if ops.after_step(epoch, step, steps, losses):  # saved, and every rank stops
            break
    # 7. the loss all-reduced, for logging: a mean over every worker's samples of the epoch
    loss_sum, samples = all_reduce_sum(losses.sums.clone()).tolist()
    seconds = time.perf_counter() - tic
    return {"train_loss": loss_sum / samples, "lr": lr, "train_samples": int(samples),
            "epoch_seconds": seconds, "samples_per_second": (samples - losses.done) / seconds,
            "data_seconds": micro_batches.seconds, "step_log": losses.logged,
            **({"resumed_at_step": first} if first else {}),
            **({"skipped_steps": losses.skipped} if scaler.is_enabled() else {})}


class TimedBatches:
    """The next batch, and the seconds spent waiting for them."""

    def __init__(self, batches):
        self.batches, self.seconds = iter(batches), 0.0

    def __next__(self):
        tic, batch = time.perf_counter(), next(self.batches)
        self.seconds += time.perf_counter() - tic
        return batch


class EpochLoss:
    """This rank's [loss sum, samples] of an epoch (and fp16's skipped steps), and since the last
    logged point (`window`); a mid-epoch checkpoint's totals of every rank count once, on rank 0."""

    def __init__(self, device: torch.device, partial: Optional[dict] = None, rank_0: bool = True):
        partial = partial or {}
        self.done, self.skipped = partial.get("samples", 0), partial.get("skipped_steps", 0)
        self.logged = [list(entry) for entry in partial.get("step_log", [])]
        sums, window = [partial.get("loss_sum", 0.0), self.done], partial.get("pending", [0, 0])
        self.sums = torch.tensor(sums if rank_0 else [0, 0], dtype=torch.float64, device=device)
        self.window = torch.tensor(window if rank_0 else [0, 0], dtype=torch.float64, device=device)

    def add(self, loss_sum: torch.Tensor, samples: int) -> None:
        added = torch.stack([loss_sum.double(), self.sums.new_tensor(samples)])
        self.sums += added
        self.window += added


@torch.no_grad()
def evaluate(net, data, device: torch.device, batch_size: int = 1000, details: bool = False,
             num_classes: int = NUM_CLASSES, workers: int = 0, image_size: Optional[int] = None,
             criterion=None, split: str = "test") -> dict:
    """Exact metrics of a split: each rank scores a disjoint shard, then ONE all-reduce adds up
    [loss sum, count, confusion matrix] (details: each prediction). num_classes 0: a regression."""
    rank, world = rank_and_world()
    criterion = criterion or F.cross_entropy
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
    width = 2 if num_classes or not details else outputs(data, [])
    predictions = torch.zeros(len(data) * details, width, dtype=torch.float64, device=device)
    for index, x, y in eval_batches(data, shard_indices(len(data), rank, world), batch_size,
                                    workers):
        x, y = resized(x.to(device), image_size), y.to(device)
        output = net(x)
        sums += torch.stack([criterion(output, y).double() * len(y), sums.new_tensor(len(y))])
        if num_classes:
            probability, predicted = output.softmax(1).max(1)
            confusion.index_put_((y.long(), predicted), torch.ones_like(y, dtype=torch.float64),
                                 accumulate=True)
            values = torch.stack([predicted.double(), probability.double()], 1)
        else:
            values = output.reshape(len(y), -1).double()
        if details:  # other ranks leave these rows at 0: the sum is each rank's own rows
            predictions[index.to(device)] = values
    totals = all_reduce_sum(torch.cat([sums, confusion.flatten(), predictions.flatten()]))
    count = totals[1].item()
    metrics = {f"{split}_loss": totals[0].item() / count, f"{split}_count": int(count)}
    confusion = totals[2:2 + num_classes ** 2].view(num_classes, num_classes)
    if num_classes:
        metrics[f"{split}_acc"] = confusion.trace().item() / count
    if details:
        metrics["confusion"] = confusion.long().tolist()
        metrics["predictions"] = totals[2 + num_classes ** 2:].view(-1, width).tolist()
    return metrics


def eval_batches(data, indices: torch.Tensor, batch_size: int, workers: int):
    if isinstance(data, TensorDataset):
        inputs, labels = data.tensors
        for index in indices.split(batch_size):
            yield index, inputs[index], labels[index]
        return
    loader = DataLoader(Subset(data, indices.tolist()), batch_size=batch_size, num_workers=workers,
                        worker_init_fn=leave_sigterm_to_the_rank)
    yield from ((index, x, y) for index, (x, y) in zip(indices.split(batch_size), loader))


def evaluate_as_saved(model: nn.Module, test_set, cfg: Config, device: torch.device,
                      num_classes: int = NUM_CLASSES, split: str = "test") -> dict:
    """Score the model the checkpoint will hold: rank 0's BatchNorm statistics on every rank
    (without SyncBatchNorm each rank's drift apart)."""
    if rank_and_world()[1] > 1:
        broadcast_from_rank_0(list(unwrap(model).buffers()))
    net = unwrap(model).eval()  # DDP's own forward would sync buffers on every batch
    try:
        with autocast(cfg, device):
            return evaluate(net, test_set, device, eval_batch_size(test_set),
                            num_classes=num_classes, workers=loader_workers(cfg, test_set),
                            image_size=cfg.image_size, criterion=loss_function(cfg, False),
                            split=split)
    finally:
        net.train()


def eval_batch_size(data) -> int:
    return 1000 if isinstance(data, TensorDataset) else 64


# ==================================================================================================
# Teaching mode (--mode scratch): d2l's "multi-GPU from scratch", one worker per GPU of the lesson.
# Everything DDP does for us is written out by hand here, on purpose.
# ==================================================================================================


def init_lenet_params(seed: int, in_channels: int = 1, image_size: int = 28) -> list:
    """The lesson's parameters: W ~ randn * 0.01, zero biases; the seed makes every copy equal."""
    gen = torch.Generator().manual_seed(seed)
    side = ((image_size - 2) // 2 - 4) // 2  # 4 on 28x28: 50 x 4 x 4 = 800 features
    shapes = [(20, in_channels, 3, 3), (20,), (50, 20, 5, 5), (50,),
              (50 * side * side, 128), (128,), (128, 10), (10,)]
    return [torch.randn(s, generator=gen) * 0.01 if len(s) > 1 else torch.zeros(s) for s in shapes]


def lenet(X: torch.Tensor, params: list) -> torch.Tensor:
    h1 = F.avg_pool2d(F.relu(F.conv2d(X, params[0], params[1])), kernel_size=2, stride=2)
    h2 = F.avg_pool2d(F.relu(F.conv2d(h1, params[2], params[3])), kernel_size=2, stride=2)
    h3 = F.relu(h2.reshape(h2.shape[0], -1) @ params[4] + params[5])
    return h3 @ params[6] + params[7]


def get_params(params: list, device: torch.device) -> list:
    """The parameters on this worker's device, tracking gradients (convolutions NHWC on a CPU, as
    on_device places ray-dp's LeNet: compare's rows differ by the lesson's code, not layout)."""
    nhwc = device.type == "cpu"  # a restored classifier (a transposed view) made contiguous too
    return [p.to(device).clone(memory_format=torch.channels_last if nhwc and p.ndim == 4
                               else torch.contiguous_format).requires_grad_() for p in params]


def split_batch(X: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> tuple:
    return X.chunk(world)[rank], y.chunk(world)[rank]


def allreduce_naive(buffer: torch.Tensor) -> None:
    """The lesson's algorithm: everything into rank 0 ("GPU 0"), then the sum back to all."""
    rank, world = rank_and_world()
    if rank == 0:
        incoming = torch.empty_like(buffer)
        for source in range(1, world):
            dist.recv(incoming, src=source)
            buffer += incoming
        for target in range(1, world):
            dist.send(buffer, dst=target)
    else:
        dist.send(buffer, dst=0)
        dist.recv(buffer, src=0)


def allreduce_ring(buffer: torch.Tensor) -> None:
    """Ring all-reduce: reduce-scatter, then all-gather; each rank sends 2(N-1)/N of the buffer."""
    rank, world = rank_and_world()
    chunks = buffer.tensor_split(world)
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])

    def exchange(send, receive):  # both ways at once: blocking both would deadlock
        for request in (dist.isend(send, dst=right), dist.irecv(receive, src=left)):
            request.wait()
    for step in range(world - 1):  # after step s, chunk (rank - s - 1) holds s + 2 ranks' sums
        target = chunks[(rank - step - 1) % world]
        exchange(chunks[(rank - step) % world], incoming[:target.numel()])
        target += incoming[:target.numel()]
    for step in range(world - 1):  # rank r holds chunk (r + 1)'s total: pass them round
        exchange(chunks[(rank + 1 - step) % world], chunks[(rank - step) % world])


# library: what DDP calls, in buckets, overlapped with the backward pass
ALLREDUCE = {"naive": allreduce_naive, "ring": allreduce_ring, "library": dist.all_reduce}


def allreduce(grads: list, algorithm: str) -> int:
    """Sum every worker's gradients in place through one flat buffer; returns the bytes reduced."""
    if rank_and_world()[1] == 1:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    ALLREDUCE[algorithm](flat)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))
    return flat.numel() * flat.element_size()


def sgd(params: list, lr: float, batch_size: int) -> None:
    """The lesson's SGD. The gradients are SUMS over the global batch: sum of gradients / global
    batch = the mean gradient, the step DDP takes with a mean loss."""
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad / batch_size
            p.grad.zero_()


def train_batch(X, y, params, lr: float, algorithm: str, worker: Worker) -> tuple:
    """One global mini-batch: forward/backward on this worker's slice, all-reduce, SGD;
    (sum loss of the slice, all-reduce seconds, bytes reduced)."""
    X_slice, y_slice = split_batch(X, y, worker.rank, worker.world)
    loss = F.cross_entropy(lenet(X_slice.to(worker.device), params), y_slice.to(worker.device),
                           reduction="sum")
    loss.backward()
    synchronize(worker.device)
    tic = time.perf_counter()
    with torch.no_grad():
        nbytes = allreduce([p.grad for p in params], algorithm)
    synchronize(worker.device)
    seconds = time.perf_counter() - tic
    sgd(params, lr, batch_size=len(y))
    return loss.item(), seconds, nbytes


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # a clock read after queued GPU work means what it says
        torch.cuda.synchronize(device)


def scratch_train_epoch(params, data: TensorDataset, cfg: Config, worker: Worker, epoch: int,
                        ops: "Operations") -> dict:
    images, labels = data.tensors
    # every worker draws the same global batches (same seed, same order) and keeps its slice
    order = torch.randperm(len(labels),
                           generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch))
    steps, lr = len(labels) // cfg.batch_size, learning_rate(cfg, epoch)
    (first, losses), comm_seconds, nbytes = ops.start_epoch(epoch), 0.0, 0
    tic = time.perf_counter()
    for step in range(first, steps):
        index = order[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        loss, seconds, nbytes = train_batch(images[index], labels[index], params, lr,
                                            cfg.allreduce, worker)
        comm_seconds += seconds
        losses.add(torch.tensor(loss, device=worker.device), cfg.batch_size // worker.world)
        if ops.after_step(epoch, step, steps, losses):
            break
    loss_sum, samples = all_reduce_sum(losses.sums.clone()).tolist()
    per_step, seconds = comm_seconds / max(steps, 1), time.perf_counter() - tic
    # NCCL-tests' bus bandwidth: what each link carried, comparable across worker counts
    busbw = 2 * (worker.world - 1) / worker.world * nbytes / per_step / 1e9 if nbytes else 0.0
    return {"train_loss": loss_sum / samples, "lr": lr, "train_samples": int(samples),
            "epoch_seconds": seconds, "samples_per_second": samples / seconds,
            "data_seconds": 0.0, "step_log": losses.logged, "allreduce_seconds_per_step": per_step,
            "allreduce_bytes": nbytes, "allreduce_busbw_gbps": busbw}


# the keys of LeNet's state_dict: checkpoints of both modes load into ray_dp.LeNet
LENET_KEYS = ["features.0.weight", "features.0.bias", "features.3.weight", "features.3.bias",
              "classifier.0.weight", "classifier.0.bias",
              "classifier.2.weight", "classifier.2.bias"]


def params_to_state_dict(params: list) -> dict:
    # the lesson multiplies X @ W; nn.Linear keeps W transposed
    return {key: (p.detach().T if key.startswith("classifier") and p.ndim == 2
                  else p.detach()).cpu().clone()
            for key, p in zip(LENET_KEYS, params)}


def state_dict_to_params(state: dict) -> list:
    return [state[key].T if key.startswith("classifier") and state[key].ndim == 2 else state[key]
            for key in LENET_KEYS]


def scratch_loop_per_worker(config: dict) -> dict:
    """--mode scratch on every worker: the functional LeNet, hand-written all-reduce and SGD."""
    ops = operations(config)
    if ops.data is None:
        return ops.result()
    cfg, worker, (train_set, test_set, val_set) = ops.cfg, ops.worker, ops.data
    state, shape = ops.restore(), train_set.tensors[0].shape
    params = get_params(init_lenet_params(cfg.seed, shape[1], shape[-1]) if state is None
                        else state_dict_to_params(state["model"]), worker.device)

    def checkpoint_of(epoch: int, history: list, partial: Optional[dict] = None) -> dict:
        return ops.checkpoint(params_to_state_dict(params), {}, epoch, history, partial)
    history = ops.track(params, None, checkpoint_of, state)
    with ops:
        for epoch in ops.epochs():
            trained = scratch_train_epoch(params, train_set, cfg, worker, epoch, ops)
            if ops.stopped:
                break
            net = functools.partial(lenet, params=params)
            scores = evaluate(net, test_set, worker.device)
            if val_set is not None:
                scores.update(evaluate(net, val_set, worker.device, split="val"))
            history.append({"epoch": epoch + 1, **trained, **scores})
            ops.end_epoch(checkpoint_of if worker.is_main else None)
    return ops.result()


# ==================================================================================================
# The worker loop: what every worker runs, whoever started it (Ray, torchrun, a test's processes).
# ==================================================================================================


def train_loop_per_worker(config: dict) -> dict:
    """--mode ddp (and dp): the DDP tutorial's loop, its distributed lines numbered."""
    # 1. this rank of the process group Ray Train (or torchrun) started, with its data; the rest of
    # what is not the tutorial's (resume, saves, stops, checks, progress) is asked of `ops`
    ops = operations(config)
    if ops.data is None:
        return ops.result()
    cfg, worker, (train_set, test_set, val_set) = ops.cfg, ops.worker, ops.data
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    model = build_model(cfg.model, ops.inputs, ops.outputs)
    state = ops.restore(model)  # one checkpoint, the same on every rank (else --weights, if any)
    if worker.device.type == "cuda":
        train_set, test_set, val_set = cuda_fast_paths(cfg, ops.data, worker.device)
    if cfg.sync_bn:  # 2. SyncBatchNorm: converted before DDP sees the modules
        model = convert_sync_bn(model, worker.device)
    model = wrap_model(on_device(model, worker.device, cfg.model), worker.device, cfg)  # 3.
    model = torch.compile(model) if cfg.compile else model
    optimizer = build_optimizer(cfg, model)
    # 4. DistributedSampler: this rank's shard of the data, as micro-batches
    batches = train_batches(train_set, cfg, worker.rank, worker.world, worker.device)
    schedule = own_schedule(cfg, optimizer, len(batches) // cfg.accum_steps)
    scaler = torch.amp.GradScaler(worker.device.type, enabled=cfg.amp == "fp16")
    steppers = {"schedule": schedule, "scaler": scaler} if schedule else {"scaler": scaler}
    if state is not None:  # after DDP, into the bare module: the same state on every rank
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        for name, stepper in steppers.items():
            stepper.load_state_dict(state["optimizer"].get(name, {}))

    def checkpoint_of(epoch: int, history: list, partial: Optional[dict] = None) -> dict:
        # the bare model (model.module), not DDP's wrapper: what 9. saves
        optimized = {**optimizer.state_dict(), **{n: s.state_dict() for n, s in steppers.items()}}
        return ops.checkpoint(unwrap(model).state_dict(), optimized, epoch, history, partial)
    history = ops.track(model, optimizer, checkpoint_of, state)
    with ops:
        for epoch in ops.epochs():
            trained = train_epoch(model, optimizer, batches, cfg, worker, epoch, ops, schedule,
                                  scaler)
            if ops.stopped:
                break
            # 8. exact evaluation: each test (and validation) sample scored once over all ranks
            scores = evaluate_as_saved(model, test_set, cfg, worker.device, len(ops.classes))
            if val_set is not None:
                scores.update(evaluate_as_saved(model, val_set, cfg, worker.device,
                                                len(ops.classes), "val"))
            history.append({"epoch": epoch + 1, **trained, **scores})
            # 9. every rank reports; rank 0 alone hands its checkpoint over, to be saved once
            ops.end_epoch(checkpoint_of if worker.is_main else None)
    return ops.result()


# ==================================================================================================
# The launch: Ray Train's TorchTrainer starts the workers (under torchrun, this very process).
# ==================================================================================================


def fit(cfg: Config, loop, options: "LoopOptions", done: int = 0) -> ray.train.Result:
    """Run `loop` on the run's workers (Ray's, or under torchrun this very process) and wait."""
    with launched(cfg, loop, options, done) as (options, scaling, run_config):
        # the launch: Ray Train starts the workers, init_process_group (TorchConfig), `loop`
        trainer = TorchTrainer(loop, train_loop_config={"config": cfg, "options": options},
                               scaling_config=scaling, run_config=run_config,
                               torch_config=TorchConfig(backend="nccl" if cfg.gpu else "gloo",
                                                        timeout_s=int(cfg.timeout)))
        return trainer.fit()


# ==================================================================================================
# PART II: OPERATIONS
# ==================================================================================================
# Command line: the flags' facts, the parser, the commands' configurations, ray_dp.train().
# ==================================================================================================

# pickle cannot ship torch.classes, and cloudpickle takes it with any function naming `classes`
copyreg.pickle(type(torch.classes), lambda module: (importlib.import_module, (module.__name__,)))
CLOCK: dict = {}
RAY_STARTED: dict = {}


def fields_where(role: str, *values) -> set:
    return {f.name for f in fields(Config) if f.metadata[role] in values}


LESSON_DEFAULTS = {f.name: f.metadata["lesson"] for f in fields(Config)
                   if f.metadata["lesson"] is not None}
RERUN_MAY_CHANGE = fields_where("rerun", "free", "adopt")
RERUN_ADOPTS = fields_where("rerun", "fixed", "adopt")
EVAL_REFUSES = fields_where("evaluation", "train")
EVAL_FROM_CHECKPOINT = fields_where("evaluation", "checkpoint", "adopt")
EVAL_FIXED = fields_where("evaluation", "checkpoint")
PREDICT_OWN = {"dataset", "data_dir", "loss"}
PREDICT_FLAGS = fields_where("evaluation", "free", "adopt") - PREDICT_OWN - {
    "download", "eval_only", "predict_out"} | {"model"}
PREDICT_WORDS = {"--eval-only": "predict", "--predict-out": "--out", "--data-dir": "--inputs",
                 "--dataset": "--inputs"}
DOCTOR_FLAGS, PATH_FIELDS = fields_where("doctor", True), fields_where("path", True)
CODE_FLAGS = tuple(f.name for f in fields(Config) if f.metadata["code"])
STORE_ACCESS = {f.name: f.metadata["store"] for f in fields(Config) if f.metadata["store"]}
FIELD_TYPES = {name: hint | int if float in (hint, *get_args(hint)) else hint
               for name, hint in get_type_hints(Config, globals()).items()}
CONFIG_FIELDS = [f.name for f in fields(Config)]
CLI_FIELDS = {f.name for f in fields(Config) if f.metadata["argparse"].get("cli", True)}


def checkpoint_interval(every: str) -> Optional[tuple[int, float]]:
    """--checkpoint-every as (steps, seconds), one of them 0; None if it is neither."""
    if match := re.fullmatch(r"\s*(\d{1,9})\s*", every):
        return int(match[1]), 0.0
    if match := re.fullmatch(r"\s*(\d{1,6}(?:\.\d*)?|\.\d+)\s*m\s*", every):
        return (0, float(match[1]) * 60) if float(match[1]) > 0 else None
    return None


class _WorkersAction(argparse.Action):
    def __call__(self, parser, namespace, text, option_string=None):
        low, colon, high = text.partition(":")
        said = f"--workers takes N or MIN:MAX in whole numbers, got {text!r}"
        with failing(ConfigError, lambda _: said, ValueError):
            namespace.workers, least = (int(high), int(low)) if colon else (int(low), 0)
        namespace.min_workers = -1 if colon and least < 1 else least  # validate(): MIN must be >= 1


class _ModelAction(argparse.Action):
    def __call__(self, parser, namespace, name, option_string=None):
        if name == "list":
            list_models()
            parser.exit()
        namespace.model = name


ACTIONS = {"workers": _WorkersAction, "model": _ModelAction}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConfigError(f"{message} (see --help)")


COMMANDS: dict = {}


@dataclass(frozen=True)
class Command:
    """A command: its handler, --help's words, the Config flags it takes, arguments of its own, and
    its steps of the configuration before and after the Config is made."""
    run: object  # (cfg, **options) -> its outcome; False exits 1
    help: str
    prog: str
    flags: set
    arguments: dict  # its own: argparse's name -> keywords
    given: object  # (args) -> (args, options): its own arguments taken out
    completed: object  # (cfg, options) -> cfg: after the checkpoint's flags are adopted
    configure: object = None  # (command, args, typed) -> (cfg, options), in place of configured's
    sets: frozenset = frozenset()  # Config fields it sets itself (predict's --inputs)
    words: Optional[dict] = None  # its own words for flags an error names
    resumes: bool = False  # it trains in a run directory, which a rerun resumes
    usage: Optional[str] = None
    epilog: Optional[str] = None


def command(name: str, help: str, flags: set = CLI_FIELDS, arguments: Optional[dict] = None,
            given=None, completed=None, **facts):
    """Register `run(cfg, **options)` as `ray_dp.py NAME [flags]`, with its facts."""
    def register(run):
        COMMANDS[name] = Command(
            run, help, facts.pop("prog", f"ray_dp.py {name}"), flags, arguments or {},
            given or (lambda args: (args, {})), completed or (lambda cfg, options: cfg), **facts)
        return run
    return register


def build_parser(command: str = "train") -> argparse.ArgumentParser:
    """A flag not typed is left out of what it parses (Config's default): what was typed."""
    spec = COMMANDS[command]
    parser = _Parser(prog=spec.prog, usage=spec.usage, description=spec.help, epilog=spec.epilog,
                     argument_default=argparse.SUPPRESS, allow_abbrev=False)
    for name, kwargs in spec.arguments.items():
        parser.add_argument(name, **kwargs)
    parser.add_argument("--version", action="version", version=f"ray_dp {__version__}")
    sections = {title: parser.add_argument_group(title) for title in HELP_SECTIONS}
    for f in (f for f in fields(Config) if f.name in spec.flags & CLI_FIELDS):
        flag = "--" + f.name.replace("_", "-")
        section = sections[next(title for title, names in HELP_SECTIONS.items() if f.name in names)]
        kwargs = {"help": f.metadata["help"], **f.metadata["argparse"]}
        if f.name in LESSON_DEFAULTS:
            kwargs["help"] += f" (scratch and compare: {LESSON_DEFAULTS[f.name]})"
        if f.default not in ("", None):
            kwargs["help"] += f" (default: {f.default})"
        if f.name in ACTIONS:
            section.add_argument(flag, action=ACTIONS[f.name], **kwargs)
        elif f.name == "gpu":
            group = section.add_mutually_exclusive_group()
            group.add_argument("--gpu", action="store_const", const=True, help=kwargs["help"])
            group.add_argument("--cpu", dest="gpu", action="store_const", const=False,
                               help="use CPU workers (gloo backend)")
        elif isinstance(f.default, bool):
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            section.add_argument(flag, action=action, **kwargs)
        else:
            section.add_argument(flag, **{"type": type(f.default), **kwargs})
    return parser


HELP_SECTIONS = {title: names.split() for title, names in {
    "data": "dataset data_dir download synthetic_size val_split image_size augment loader_workers",
    "model": "mode model weights loss sync_bn allreduce find_unused_parameters compile",
    "optimisation": "epochs batch_size accum_steps lr lr_schedule warmup_epochs optimizer momentum "
                    "weight_decay clip_grad_norm label_smoothing amp seed",
    "workers and cluster": "workers cpus_per_worker gpu address start_timeout keep_freed_memory",
    "checkpoints": "storage_path name fresh checkpoint_every keep_checkpoints best_by early_stop "
                   "max_failures max_preemptions spot_notices eval_only predict_out",
    "health": "check_replicas timeout", "output": "logdir log_every quiet worker_output"}.items()}


def with_absolute_paths(cfg: Config) -> Config:
    """Ray's workers run in directories of their own; your code's file is named by its path."""
    paths = {name: os.path.abspath(getattr(cfg, name)) for name in PATH_FIELDS
             if getattr(cfg, name) and not is_uri(getattr(cfg, name))}
    for name in CODE_FLAGS:
        where, colon, what = getattr(cfg, name).rpartition(":")
        if colon and where.endswith(".py") and "://" not in where:
            paths[name] = f"{os.path.abspath(where)}:{what}"
    return replace(cfg, **paths)


def main(argv=None) -> int:
    CODE.clear()
    command, cfg = "train", None
    if threading.current_thread() is threading.main_thread():  # SIGUSR1's default would kill
        signal.signal(signal.SIGUSR1, lambda *_: tqdm.write(
            "ray-dp: SIGUSR1: no rank trains now, so none writes its stacks"))
    try:
        command, cfg, options = parse_command(argv)
        return 1 if COMMANDS[command].run(cfg, **options) is False else 0
    except (ConfigError, DataError) as exc:
        message, status = f"error: {exc}", 2
    except RunFailed as exc:
        message, status = f"training failed: {exc}", 1
    except RunStopped as exc:
        message, status = str(exc), 128 + signal.SIGTERM
    except ray.train.TrainingFailedError as exc:
        message, status = f"evaluation failed: {describe_training_error(exc, {})}", 1
    except OSError as exc:
        if not disk_full(exc):
            raise
        message, status = f"error: {storage_full(cfg, exc)}", 1
    except KeyboardInterrupt:
        if trains(command, cfg) and "checked" in CLOCK:
            with contextlib.suppress(Exception):
                record_ledger(cfg, None, None)
        message, status = interrupted(command, cfg), 130
    print(f"ray_dp.py: {message}", file=sys.stderr)
    return status


def trains(command: str, cfg: Optional[Config]) -> bool:
    return command == "train" and cfg is not None and not cfg.eval_only


def parse_command(argv) -> tuple[str, Config, dict]:
    """(command, final config, its options) of argv, validated once; the command's clock starts."""
    CLOCK.clear()
    CLOCK["imported"] = STARTED_AT if __name__ == "__main__" else time.time()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv[:1] and argv[0] in COMMANDS else "train"
    spec = COMMANDS[command]
    args = vars(build_parser(command).parse_args(argv[1:] if argv[:1] == [command] else argv))
    try:
        return command, *(spec.configure or configured)(command, args, set(args))
    except ConfigError as exc:
        if not spec.words:
            raise
        named = re.sub("|".join(spec.words), lambda word: spec.words[word[0]], str(exc))
        raise ConfigError(named) from None


def configured(command: str, args: dict, typed: set) -> tuple[Config, dict]:
    """(cfg, options) of the flags typed (args), with the lesson's, torchrun's, a run's."""
    spec = COMMANDS[command]
    args, options = spec.given(args)
    typed = typed | spec.sets
    if args.get("mode") == "scratch":
        args = {**LESSON_DEFAULTS, **args}
    if under_torchrun():
        args = torchrun_launch(command, args, typed)
    cfg = with_absolute_paths(Config(**args))
    if cfg.val_split and "best_by" not in typed:  # the held-out set chooses, not the test set
        cfg = replace(cfg, best_by="val_loss")
    if cfg.eval_only:
        cfg, options["checkpoint"] = eval_config(cfg, typed, spec.sets)
    cfg = spec.completed(cfg, options)
    model, data = (flag.rpartition(":")[2] for flag in (cfg.model, cfg.dataset))
    kind = ("eval" if cfg.eval_only else cfg.mode) if spec.resumes else command
    cfg = replace(cfg, name=cfg.name or f"{kind}-{model}-{data}-{time.strftime('%Y%m%d-%H%M%S')}"
                  f"-{os.getpid()}")
    if torchrun_follower():  # rank 0 resolves and checks the run for every rank
        return cfg, {"resume": Resume()}
    check_run_name(cfg)
    check_store("storage-path", cfg.storage_path)
    adopted = []
    if trains(command, cfg):
        typed_cfg, options["typed"] = cfg, typed
        cfg, options["resume"] = check_run_dir(cfg, typed)
        adopted = [as_flag(f, getattr(cfg, f)) for f in CONFIG_FIELDS
                   if getattr(cfg, f) != getattr(typed_cfg, f) and f in CLI_FIELDS]
    try:
        validate(cfg, resuming=options.get("resume", Resume()).resumes)
    except ConfigError as exc:  # the value at fault may be one the user never typed
        words = re.findall(r"(?<![\w-])(?:--)?([\w-]+)", str(exc))
        if named := [flag for flag in adopted if flag.partition("--")[2].split()[0] in words]:
            raise ConfigError(f"{exc}; run '{cfg.name}' trained with {', '.join(named)}, which "
                              f"this rerun takes from it") from None
        raise
    return cfg, options


@command("train", __doc__.split("\n\n")[0], prog="ray_dp.py", resumes=True,
         usage="%(prog)s [compare | doctor | predict] [flags]", epilog=(
             "other commands: 'ray_dp.py compare [flags]' trains ddp and the scratch LeNet at 1 "
             "and N workers side by side and prints the lesson's table; 'ray_dp.py doctor "
             "[flags]' checks a Ray cluster before training on it; 'ray_dp.py predict RUN "
             "--inputs DIR|FILE.py:NAME' predicts on new data (each takes --help)"))
def train_or_evaluate(cfg: Config, **options) -> Optional[dict]:
    if cfg.eval_only:
        return run_eval(cfg, **options)
    resume = options["resume"]
    if not under_torchrun() and (summary := finished_result(cfg, resume)):
        return finished(cfg, summary, resume.done)
    return run(cfg, **options)


def train(**settings) -> dict:
    """ray_dp.py's flags as keywords: result.json's dict, or ConfigError, RunFailed, RunStopped."""
    CODE.clear()
    command, cfg, options = parse_command(settings_as_flags(settings))
    return COMMANDS[command].run(cfg, **options)


def settings_as_flags(settings: dict) -> list:
    if settings.get("model") == "list":
        raise ConfigError("model='list' is the command line's listing (python ray_dp.py --model "
                          "list); from Python, name a model")
    flags = []
    for name, value in settings.items():
        if name not in CLI_FIELDS:
            close = difflib.get_close_matches(name, sorted(CLI_FIELDS), n=1, cutoff=0)[0]
            raise ConfigError(f"ray_dp.train() has no setting {name!r}; did you mean {close}? (its "
                              f"settings are the flags of ray_dp.py --help, with _ for -)")
        flag = "--" + name.replace("_", "-")
        if name in CODE_FLAGS and not isinstance(value, (str, type(None))):
            value = as_spec(value, name)
        if name == "gpu":
            flags += [] if value is None else ["--gpu" if value else "--cpu"]
        elif isinstance(value, bool):
            flags += [flag] if value else [f"--no-{flag[2:]}"] if getattr(Config, name) else []
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def list_models() -> None:
    print("ray_dp: " + " ".join(MODELS))
    print("torchvision (ImageNet-size; --weights to start from a downloaded .pth): "
          + " ".join(torchvision_names()))


# ==================================================================================================
# The driver's plumbing: Ray started or attached, what the workers are handed, how a run ends.
# ==================================================================================================

def run(cfg: Config, resume: "Resume", data: Optional["DataInfo"] = None,
        typed: tuple = ()) -> Optional[dict]:
    """Train cfg from `resume`; under torchrun every process runs this, rank 0 alone checks."""
    torchrun = under_torchrun()
    if ray.is_initialized():  # no start-up of Ray's to count: the run's clock starts here
        CLOCK.clear()
        CLOCK["imported"] = time.time()
    if not torchrun_follower():
        cfg, data, notes = preflight(cfg, resume, data, typed)
        CLOCK["checked"] = time.time()
        cfg = cfg if torchrun else connect(cfg)
        start_fresh(cfg)  # under torchrun before rank 0's loop looks for checkpoints
        remove_stored(f"{cfg.run_dir}/hang")
        print(describe(cfg, data, torchrun), *notes, sep="\nnote: ", flush=True)
    progress = sys.stdout.isatty() and not cfg.quiet
    options = LoopOptions(progress=progress, torchrun=True) if torchrun else LoopOptions(
        progress=progress, board=new_board() if ray.is_initialized() else None,
        weights=ray.put(read_weights(cfg.weights)) if cfg.weights and not resume.resumes else None,
        data=ray.put(data.datasets),
        resume_from=ray.put(load_checkpoint(resume.unlisted)) if resume.unlisted else None)
    loop = scratch_loop_per_worker if cfg.mode == "scratch" else train_loop_per_worker
    with failures_said(cfg, options):
        return summary_of(cfg, fit(cfg, loop, options, resume.done), options)


@contextlib.contextmanager
def failures_said(cfg: Config, options: "LoopOptions"):
    """A run that failed for good as RunFailed, its one line (rank 0 records it)."""
    try:
        yield
    except ray.train.TrainingFailedError as exc:
        raise RunFailed(describe_training_error(exc, {}) if torchrun_follower()
                        else record_failure(cfg, exc, options.board)) from None
    except OSError as exc:
        raise RunFailed(storage_full(cfg, exc)) if disk_full(exc) else exc from None
    except RuntimeError as exc:
        timed_out, lost = COLLECTIVE_TIMEOUT.search(str(exc)), PEER_LOST.search(str(exc))
        ours = isinstance(exc, (DataError, RunFailed))
        if ours or not (under_torchrun() and (timed_out or lost)):
            raise
        raise RunFailed(hang_report(cfg, exc) or f"rank {os.environ['RANK']} " + (
            first_line(exc) if timed_out else "lost its peers: another rank failed, and its own "
            "line says why")) from None


@contextlib.contextmanager
def launched(cfg: Config, loop, options: "LoopOptions", done: int):
    """What fit hands Ray Train besides the loop; around the fit: the console, SIGTERM, SIGUSR1."""
    follower, training = torchrun_follower(), loop is not eval_loop_per_worker
    set_ray_train_knobs(cfg)
    for registered in (MODELS.get(cfg.model), data_source(cfg.dataset).load):
        travels(sys.modules.get(getattr(registered, "__module__", None)))
    if options.torchrun:  # Ray Train's local mode: the loop in this process, its reports at INFO
        quiet_ray_train()
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        board, code, workers = None, None, 0
    else:
        board, code = options.board or new_board(), ray.put(code_for_workers(cfg))
        workers = (cfg.min_workers, cfg.workers) if cfg.min_workers else cfg.processes
    options = replace(options, board=board, code=code)
    run_config = RunConfig(
        name=cfg.name, storage_path=cfg.storage_path,
        checkpoint_config=CheckpointConfig() if options.torchrun else checkpoint_config(cfg),
        logging_config=ray.train.LoggingConfig(log_level="WARNING"),
        callbacks=[*([TensorBoardWriter(cfg)] if training and not options.torchrun else []),
                   *([FailureLog(cfg, local_run_dir(cfg), board, done)] if training and not follower
                     else [])],
        failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures,
                                               max_preemption_failures=cfg.max_preemptions),
        worker_runtime_env=worker_env(cfg))
    stop = graceful_stop() if training and board else None
    if stop is not None:
        stop.on_ask = functools.partial(ask_board, board, "ask_stop", timeout=10)
    contexts = [contextlib.redirect_stdout(io.StringIO()) if follower else None,
                stop, board and relayed(board),
                training and dumps_asked(cfg, board), stop and own_ray_watched(cfg, stop)]
    try:
        with contextlib.ExitStack() as stack:  # own_ray_watched sees fit()'s error
            for context in filter(None, contexts):
                stack.enter_context(context)
            try:
                yield options, scaling_config(cfg, workers), run_config
            finally:
                CLOCK["fitted"] = time.time()
    except SystemExit:  # Ray Train's own Ctrl-C handler, which fit() installs, exits
        raise KeyboardInterrupt from None


def summary_of(cfg: Config, result: ray.train.Result, options: "LoopOptions") -> Optional[dict]:
    """A finished run's result.json and last lines (rank 0's); a run that stopped, one line."""
    if torchrun_follower():
        return None
    if "data_error" in result.return_value:
        raise DataError(result.return_value["data_error"])
    if (stopped := result.return_value["stopped"]) and stopped.get("error"):
        raise RunFailed(stopped["error"])
    if stopped:
        record_ledger(cfg, result.return_value, options.board)
        raise RunStopped(f"stopped at {position_of(stopped)} (SIGTERM), its checkpoint saved: "
                         f"the same command resumes from there")
    summary = summarize(cfg, result, options.board)
    dp = (f"nn.DataParallel normalised each GPU's 1/{cfg.workers} of the batch with its own "
          f"BatchNorm statistics; only DDP can synchronise them (--mode ddp --sync-bn)")
    notes = (near_chance(cfg, summary), cfg.mode == "dp" and dp, checkpoint_advice(cfg, summary))
    print(format_summary(summary, ", torchrun" if options.torchrun else ""),
          f"ray-dp: {format_ledger(summary['ledger'])}", *(f"note: {n}" for n in notes if n),
          wrote_run(cfg, summary), sep="\n", flush=True)
    return summary


def preflight(cfg: Config, resume: "Resume", data: Optional[DataInfo], typed) -> tuple:
    if data is None:
        cfg, data = check_data(cfg)
    check_images_only(cfg, data, typed)
    check_model_fits(cfg, data)
    if resume.classes:
        check_same_classes(cfg, resume.classes, data.classes, "resume it on")
    check_same_samples(cfg, resume, data)
    if resume.resumes and is_code(cfg.model):
        check_state_fits(cfg, data, load_checkpoint(resume.latest))
    notes = [None if resume.resumes else check_weights(cfg, data)] + [
        f"--early-stop goes by --best-by {cfg.best_by}, of the test set: --val-split holds out "
        f"part of the training set to stop by"] * bool(cfg.early_stop and "test" in cfg.best_by)
    check_training_choices(cfg, data)
    return cfg, data, [note for note in notes if note]


def scaling_config(cfg: Config, workers) -> ScalingConfig:
    return ScalingConfig(num_workers=workers, use_gpu=cfg.gpu,
                         resources_per_worker=resources_per_worker(cfg))


def resources_per_worker(cfg: Config) -> dict:
    gpus = cfg.workers if cfg.mode == "dp" else 1
    return {"CPU": cfg.cpus_per_worker or 1.0, **({"GPU": gpus} if cfg.gpu else {})}


def connect(cfg: Config) -> Config:
    """Start (or attach to) Ray once the run is known to fit; the config with its device."""
    if not ray.is_initialized() and not cfg.address:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        cfg = settle_device(cfg, Cluster({"CPU": cpus, "GPU": torch.cuda.device_count()}, None))
        start_ray("", cpus, cfg.worker_output)
        return cfg
    start_ray(cfg.address, worker_output=cfg.worker_output)
    if cfg.address == "auto":
        print(f"ray-dp: attached to the Ray cluster at {ray.get_runtime_context().gcs_address}")
    return settle_device(cfg, cluster_of(cfg))


def start_ray(address: str, cpus: Optional[int] = None, worker_output: bool = False) -> None:
    """This machine's own Ray (no address) or the cluster at address; workers' output if asked."""
    if ray.is_initialized():
        if worker_output and not RAY_STARTED.get("worker_output"):
            print("note: --worker-output applies where ray_dp starts Ray; this Ray was running "
                  "already (ray.shutdown() first)", flush=True)
        if "py_modules" in RUNTIME_ENV and "py_modules" not in (
                ray.get_runtime_context().runtime_env):
            raise ConfigError("this Ray was started without ray_dp's runtime environment, so its "
                              "workers cannot import ray_dp: ray.shutdown(), then ray.init("
                              "runtime_env=ray_dp.RUNTIME_ENV) (or let ray_dp start Ray)")
        return
    settings = dict(runtime_env=fresh_runtime_env(), logging_level=logging.ERROR,
                    log_to_driver=worker_output)
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    RAY_STARTED.update(worker_output=worker_output, local=not address)
    if worker_output and not address and (others := [
            str(p.pid) for p in psutil.process_iter(["name"]) if p.info["name"] == "gcs_server"]):
        print(f"note: another Ray runs on this machine (its GCS: pid {', '.join(others)}); ray_dp "
              f"starts its own beside it", flush=True)
    if not address:
        ray.init(address="local", num_cpus=cpus, include_dashboard=False, **settings)
        return
    check_reachable(address)
    with failing(ConfigError, lambda why: f"cannot attach to the Ray cluster at {address}: {why}",
                 (ConnectionError, ray.exceptions.AuthenticationError)):
        ray.init(address=address, **settings)


def fresh_runtime_env() -> dict:
    """RUNTIME_ENV anew for each ray.init (which writes into it); the store's endpoint, no keys."""
    env_vars = {**RUNTIME_ENV["env_vars"],
                **{k: os.environ[k] for k in STORE_SETTINGS if k in os.environ}}
    return {**RUNTIME_ENV, "env_vars": env_vars, "worker_process_setup_hook": own_ray_worker}


def own_ray_worker() -> None:
    """ray_dp's own Ray's setup hook: Ray's State API asks this Ray (a scan fails where two run)."""
    os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    graceful_sigterm_in_ray_worker()


# ==================================================================================================
# Worker set-up: the options and data a worker is handed, the GPU's fast paths, the allocator.
# ==================================================================================================


@dataclass(frozen=True)
class LoopOptions:
    progress: bool = False
    torchrun: bool = False
    board: Optional[object] = None
    data: Optional[object] = None
    resume_from: Optional[object] = None  # ref of a checkpoint Ray never listed
    weights: Optional[object] = None  # --weights' state_dict (training), the checkpoint's (eval)
    classes: tuple = ()
    outputs: int = 0
    code: Optional[object] = None


def worker_data(cfg: Config, options: LoopOptions, worker: Worker):
    """(train, test, val) as the driver decided; a DataError is returned, not raised (no retry)."""
    try:
        if options.data is not None:
            data = ray.get(options.data)
        elif options.torchrun and not data_source(cfg.dataset).same_on_every_rank:
            data = from_rank_0(held_out(cfg, loaded(cfg)) if worker.is_main else None,
                               worker.device)
        else:
            data = held_out(cfg, loaded(cfg))
            check_classes_agree(class_names(data[0]) if classifies(data[0]) else [], worker.device)
        check_node_holds(data, cfg, worker, Console(options, worker))
    except DataError as exc:
        return exc
    worker.marks["data"] = time.time()
    return data


def starting_weights(cfg: Config, options: LoopOptions) -> dict:
    return read_weights(cfg.weights) if options.weights is None else ray.get(options.weights)


def node_ranks(worker: Worker) -> list:
    ranks = torch.zeros(worker.world, dtype=torch.int64, device=worker.device)
    ranks[worker.rank] = worker.node_rank
    return all_reduce_sum(ranks).tolist()


def bound_collectives(seconds: float) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.set_timeout(timedelta(seconds=seconds))


def cuda_fast_paths(cfg: Config, data: tuple, device: torch.device) -> tuple:
    importlib.import_module("torch.backends.cudnn").benchmark = True  # by name: ships by value
    moved = [isinstance(split, TensorDataset) for split in data]
    moved[0] = moved[0] and not loader_workers(cfg, data[0])  # loader processes read from the host
    return tuple(on_device_tensors(split, device) if move else split
                 for split, move in zip(data, moved))


def on_device_tensors(split: TensorDataset, device: torch.device) -> TensorDataset:
    """The data set with its tensors on `device`, its other attributes (classes) kept."""
    moved = TensorDataset(*(t.to(device) for t in split.tensors))
    vars(moved).update({k: v for k, v in vars(split).items() if k != "tensors"})
    return moved


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, KEPT_FREED_BYTES = -1, -3, 1 << 30
MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                   "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES")
memory_kept = False


def keep_freed_memory() -> None:
    """glibc keeps what a step frees for the next (bench/memory.md), trimmed before each fork."""
    global memory_kept
    if memory_kept or any(name in os.environ for name in MALLOC_SETTINGS):
        return
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
        libc = ctypes.CDLL(None)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (ValueError, OSError, AttributeError):
        return
    if mallopt(M_MMAP_THRESHOLD, KEPT_FREED_BYTES) and mallopt(M_TRIM_THRESHOLD, KEPT_FREED_BYTES):
        os.register_at_fork(before=lambda: malloc_trim(0))
        memory_kept = True


def worker_env(cfg: Config) -> dict:
    """Unless the user set them: torch's flight recorder; one glibc arena (a thread's mmaps); the
    trainers at nice 0 as under torchrun, not Ray workers' 15 (bench/ray_tax.md), or the user's."""
    env = {"TORCH_FR_BUFFER_SIZE": "2000"}
    if cfg.keep_freed_memory and not any(name in os.environ for name in MALLOC_SETTINGS):
        env["MALLOC_ARENA_MAX"] = "1"
    return {"env_vars": {**{name: value for name, value in env.items() if name not in os.environ},
                         "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0")}}


# ==================================================================================================
# Pre-flight checks: the configuration, the data and the model, before any cluster starts.
# ==================================================================================================

DP_NEEDS_GPUS = "--mode dp needs CUDA GPUs (it is nn.DataParallel)"


@contextlib.contextmanager
def failing(error: type, said, caught=Exception):
    """An exception in the block, not ray_dp's own, as `error` of one line: said(its first line)."""
    try:
        yield
    except (ConfigError, DataError):
        raise
    except caught as exc:
        raise error(said(first_line(exc))) from None


def validate(cfg: Config, doctor: bool = False, resuming: bool = False) -> None:
    """The final configuration's first fault in one line (a resumed run reads no --weights)."""
    check_declared(cfg)
    checks = [
        (cfg.min_workers == 0 or 1 <= cfg.min_workers <= cfg.workers,
         f"--workers MIN:MAX needs 1 <= MIN <= MAX, got {max(cfg.min_workers, 0)}:{cfg.workers}"),
        (not (cfg.min_workers and cfg.mode == "dp"),
         "--mode dp runs one worker; it cannot be elastic"),
        (all((cfg.storage_path, cfg.logdir, cfg.data_dir)),
         "--storage-path, --logdir and --data-dir cannot be empty"),
        (not is_uri(cfg.data_dir) or data_source(cfg.dataset).object_storage,
         f"--data-dir {cfg.data_dir}: only {sources_with('object_storage')} reads its data from "
         f"object storage; {cfg.dataset} is kept in a local directory"),
        (re.fullmatch(r"off|auto|0*[1-9][0-9]*", cfg.check_replicas),
         f"--check-replicas must be off, auto or a number of steps, got {cfg.check_replicas}"),
        (checkpoint_interval(cfg.checkpoint_every) is not None,
         f"--checkpoint-every must be a number of steps (200), minutes (10m) or 0 (at epochs' "
         f"ends only), got {cfg.checkpoint_every}"),
        (not cfg.label_smoothing or cfg.loss == "cross_entropy",
         f"--label-smoothing is cross_entropy's; --loss {cfg.loss} does not smooth (drop it)"),
        (not (cfg.mode == "scratch" and data_source(cfg.dataset).per_sample),
         f"--dataset {cfg.dataset} needs --mode ddp (scratch mode: the lesson's in-memory "
         f"batches)"),
        (cfg.image_size is None or cfg.model not in ("lenet", "mlp") or cfg.image_size >= 14,
         f"--image-size {cfg.image_size} is too small for {cfg.model} (at least 14)"),
        (cfg.val_split or not cfg.best_by.startswith("val_"),
         f"--best-by {cfg.best_by} needs --val-split (the part of the training set it scores)"),
        (not is_code(cfg.lr_schedule) or not cfg.warmup_epochs,
         f"--lr-schedule {cfg.lr_schedule} sets every step's rate: it takes no --warmup-epochs"),
        (not is_code(cfg.lr_schedule) or cfg.mode != "scratch",
         f"--lr-schedule {cfg.lr_schedule} needs --mode ddp (scratch mode: the lesson's own)"),
        (0 <= cfg.warmup_epochs < cfg.epochs,
         f"--warmup-epochs must be 0 to --epochs - 1 = {cfg.epochs - 1}, got {cfg.warmup_epochs}"),
        (not (cfg.mode == "dp" and cfg.sync_bn),
         "--sync-bn needs --mode ddp: nn.DataParallel keeps BatchNorm statistics per GPU replica"),
        (not (cfg.mode == "dp" and cfg.gpu is False),
         f"{DP_NEEDS_GPUS}; drop --cpu, or use --mode ddp"),
        (cfg.mode != "dp" or cfg.gpu is not None or cfg.address or ray.is_initialized()
         or torch.cuda.device_count(), f"{DP_NEEDS_GPUS}; this machine has none: use --mode ddp"),
        (not cfg.predict_out or cfg.eval_only,
         "--predict-out needs --eval-only PATH (predictions of a saved model)"),
        (not cfg.predict_out or cfg.predict_out.lower().endswith(".csv"),
         f"--predict-out must name a .csv file, got {cfg.predict_out}"),
        (not os.path.isdir(cfg.predict_out),
         f"--predict-out {cfg.predict_out} is a directory; name a .csv file"),
        (not cfg.predict_out or cfg.predict_out != cfg.eval_only,
         f"--predict-out {cfg.predict_out} is the checkpoint being evaluated"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    validate_names_and_places(cfg, doctor, resuming)


def sources_with(fact: str) -> str:
    return " or ".join(f"--dataset {name}" for name, facts in DATASETS.items()
                       if getattr(facts, fact))


def check_declared(cfg: Config) -> None:
    for f in fields(Config):
        value, interval = getattr(cfg, f.name), f.metadata["bounds"]
        flag = "--" + f.name.replace("_", "-")
        if cfg.mode == "scratch" and f.metadata["scratch"] and value not in (f.default, 0, ""):
            raise ConfigError(f"{flag} needs --mode ddp (scratch mode: {f.metadata['scratch']})")
        if not interval or value is None:
            continue
        low, high = interval[1:-1].split(", ")
        if not ((value > float(low) if interval[0] == "(" else value >= float(low))
                and (value < float(high) if interval[-1] == ")" else value <= float(high))):
            words = ("a positive number" if interval == "(0, inf)" else f"at least {low}"
                     if high == "inf" else f"{low} to {high}" if interval[-1] == "]"
                     else f"in {interval}")
            raise ConfigError(f"{flag} must be {words}, got {value}")


def validate_names_and_places(cfg: Config, doctor: bool, resuming: bool) -> None:
    for flag, ours in (("model", MODELS), ("dataset", DATASETS), ("loss", LOSSES),
                       ("optimizer", OPTIMIZERS), ("lr_schedule", SCHEDULES)):
        if is_code(spec := getattr(cfg, flag)):
            user_code(spec, flag)
        elif spec not in ours and (flag != "model"
                                   or spec.removeprefix(TORCHVISION) not in torchvision_models()):
            known = [*MODELS, *torchvision_names()] if flag == "model" else sorted(ours)
            close = difflib.get_close_matches(spec, known, n=3, cutoff=0.5)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            listed = "--model list shows them" if flag == "model" else ", ".join(known)
            what = {"optimizer": "an optimizer", "lr_schedule": "a schedule"}.get(flag, f"a {flag}")
            raise ConfigError(f"--{flag.replace('_', '-')} {spec} is not {what} of ray_dp{hint} "
                              f"({listed}, or your own: FILE.py:NAME)")
    if cfg.sync_bn and not is_code(cfg.model) and not has_batchnorm(cfg.model):
        raise ConfigError(f"--sync-bn needs a model with BatchNorm (e.g. resnet18); "
                          f"{cfg.model} has none")
    stores = (PATH_FIELDS | STORE_ACCESS.keys()) - {"storage_path", "eval_only"}
    stores = (stores & DOCTOR_FLAGS if doctor else stores) - ({"weights"} if resuming else set())
    for name in sorted(stores):
        check_store(name.replace("_", "-"), getattr(cfg, name))
    if cfg.weights and not resuming and stored_type(cfg.weights) != "file":
        raise ConfigError(f"--weights {cfg.weights} is not a file")
    for flag in ("data-dir", "logdir", "storage-path", "predict-out"):
        typed = getattr(cfg, flag.replace("-", "_"))
        path = os.path.dirname(typed) if flag == "predict-out" else typed
        if (doctor and flag != "data-dir") or not path or is_uri(path):
            continue
        existing = next(part for part in [Path(path), *Path(path).parents] if part.exists())
        if not existing.is_dir():
            raise ConfigError(f"--{flag} {typed}: {existing} is a file, not a directory")
        try:  # a file made there, as root too (for whom os.access says yes)
            tempfile.TemporaryFile(dir=existing).close() if flag != "data-dir" else None
        except OSError:
            raise ConfigError(f"--{flag} {typed}: {existing} is not writable") from None
    if not doctor and not cfg.eval_only:
        check_batch_split(cfg)


def check_batch_split(cfg: Config) -> None:
    sizes = range(cfg.min_workers or cfg.workers, cfg.workers + 1)
    step = math.lcm(*(workers * cfg.accum_steps for workers in sizes))
    if not cfg.batch_size % step:
        return
    lower, upper = cfg.batch_size // step * step, (cfg.batch_size // step + 1) * step
    near = f"e.g. {lower} or {upper}" if lower else f"e.g. {upper}"
    if upper > 16 * cfg.batch_size:
        near = f"narrow the range: no batch near {cfg.batch_size} divides by all of them"
    every = f" at every size --workers {sizes[0]}:{sizes[-1]} may take" if len(sizes) > 1 else ""
    raise ConfigError(f"--batch-size {cfg.batch_size} must divide by workers x accum-steps{every} "
                      f"= {step} (the global batch is split evenly into per-worker micro-batches; "
                      f"{near})")


def check_run_name(cfg: Config) -> None:
    if not cfg.storage_path:
        raise ConfigError("--storage-path, --logdir and --data-dir cannot be empty")
    if ((name := cfg.name) in (".", "..") or "/" in name or "\\" in name or not name.isprintable()
            or (name and not name.strip()) or len(name.encode()) > 255):
        raise ConfigError(f"--name must be one directory name (printable; no '/', '\\', '.' or "
                          f"'..'; at most 255 bytes), got {cfg.name!r}")
    if is_uri(cfg.storage_path) and (marks := sorted(set(cfg.name) & set("?#%"))):
        raise ConfigError(f"--name {cfg.name}: '{marks[0]}' would change what the run's URI "
                          f"({cfg.run_dir}) names; choose a name without '?', '#' or '%'")


@dataclass(frozen=True)
class DataInfo:
    sizes: tuple
    sample_shape: tuple
    classes: list
    per_sample: bool
    datasets: tuple = field(default=(), repr=False, compare=False)
    fingerprint: Optional[str] = None
    outputs: int = NUM_CLASSES


def check_data(cfg: Config) -> tuple[Config, DataInfo]:
    """The data loaded on the driver, before any worker starts: (config normalised, DataInfo)."""
    train_set, test_set = loaded(cfg)
    if data_source(cfg.dataset).image_files:
        cfg = with_data_statistics(cfg, train_set)
        train_set.transform, test_set.transform = image_transforms(cfg)
    train_set, test_set, val_set = held_out(cfg, (train_set, test_set))
    if len(train_set) // cfg.processes < cfg.micro_batch * cfg.accum_steps:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the {len(train_set)} "
                          f"training samples of {cfg.dataset} allow for one step")
    with failing(DataError, lambda why: f"--dataset {cfg.dataset}: a target is a class index or "
                 f"a tensor of values: {why}", (TypeError, ValueError, RuntimeError)):
        classes = class_names(train_set) if classifies(train_set) else []
    target = torch.as_tensor(train_set[0][1])
    if cfg.loss == "cross_entropy" and not classes and target.ndim == 0:
        raise DataError(f"--dataset {cfg.dataset}'s targets are {target.dtype} values (e.g. "
                        f"{target.item():g}): class indices are integers (torch.long); a "
                        f"regression takes --loss mse or your own")
    if cfg.loss == "mse" and classes:
        raise DataError(f"--loss mse is a regression's; {cfg.dataset}'s targets are integers, "
                        f"class indices to ray_dp ({plural(len(classes), 'class')}): make them "
                        f"floats (torch.float32) to regress on them, or drop --loss")
    for split, which in zip((train_set, test_set), ("training", "test")):
        listed = which == "test" or isinstance(split, TensorDataset) or hasattr(split, "targets")
        if not (classes and listed and len(split)):
            continue
        if not 0 <= min(labels := labels_of(split)) <= max(labels) < len(classes):
            raise DataError(f"--dataset {cfg.dataset}'s {which} labels run from {min(labels)} to "
                            f"{max(labels)}; its classes are 0 to {len(classes) - 1} (the training "
                            f"set's `classes` names them all)")
    check_sendable(cfg, (train_set, test_set))
    splits = tuple(shared(split) for split in (train_set, test_set, val_set))
    return cfg, DataInfo(tuple(len(split) for split in splits if split is not None),
                         input_shape(cfg, train_set), classes,
                         not isinstance(train_set, TensorDataset), splits,
                         samples_fingerprint(train_set), outputs(train_set, classes))


def held_out(cfg: Config, data: tuple) -> tuple:
    """(train, test, val): --val-split held out by --seed, by class where the labels are known."""
    train, test = data
    if not cfg.val_split:
        return train, test, None
    seed = stream_seed(cfg.seed, VALIDATION_STREAM)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    if classifies(train) and (isinstance(train, TensorDataset) or hasattr(train, "targets")):
        order = order[torch.as_tensor(labels_of(train))[order].argsort(stable=True)]
    marks = torch.arange(len(order) + 1, dtype=torch.float64).mul(cfg.val_split).ceil()
    kept, val = (order[part].sort().values for part in (marks[1:] == marks[:-1],
                                                          marks[1:] > marks[:-1]))
    if isinstance(train, TensorDataset):
        named = class_names(train) if classifies(train) else None
        kept, val = (NamedTensors(*(t[part] for t in train.tensors), classes=named)
                     for part in (kept, val))
        return kept, test, val
    scored = copy.copy(train)  # read as the test set is read: no augmentation
    scored.transform = getattr(test, "transform", getattr(train, "transform", None))
    return Part(train, kept.tolist()), test, Part(scored, val.tolist())


class Part(Subset):
    def __getattr__(self, name: str):
        if name.startswith("__") or name == "dataset":  # (unpickling: not set yet)
            raise AttributeError(name)
        found = getattr(self.dataset, name)
        if name == "prefetch":
            return lambda indices: found([self.indices[i] for i in indices])
        return found


def check_sendable(cfg: Config, data: tuple) -> None:
    if is_code(cfg.dataset) and not isinstance(data[0], TensorDataset):
        with failing(DataError, lambda why: f"--dataset {cfg.dataset}: its data sets cannot be "
                     f"sent to the workers ({why}): open files and connections in __getitem__, "
                     f"not __init__"):
            ray.cloudpickle.dumps(data)


class SharedTensors(TensorDataset):
    """Tensors sent as numpy arrays, which Ray's workers read in place (bench/data_memory.md)."""

    def __init__(self, *arrays):
        import warnings
        with warnings.catch_warnings(action="ignore", category=UserWarning):
            super().__init__(*map(torch.as_tensor, arrays))

    def __reduce__(self):
        return (SharedTensors, tuple(t.numpy(force=True) for t in self.tensors),
                {k: v for k, v in vars(self).items() if k != "tensors"})


def shared(data):
    if type(data) not in (TensorDataset, NamedTensors) or any(t.dtype == torch.bfloat16
                                                                for t in data.tensors):
        return data
    made = SharedTensors(*data.tensors)
    vars(made).update(vars(data))
    return made


def check_images_only(cfg: Config, data: DataInfo, typed) -> None:
    if "image_size" in typed and not is_image(data.sample_shape):
        raise ConfigError(f"--image-size is for images; {cfg.dataset}'s inputs have the shape "
                          f"{tuple(data.sample_shape)}: not applicable (drop it)")
    if "augment" in typed and cfg.augment and not data_source(cfg.dataset).image_files:
        raise ConfigError(f"--augment is for --dataset folder's images; {cfg.dataset} is not "
                          f"augmented by ray_dp: not applicable (drop it)")
    if cfg.mode == "scratch" and not (is_image(data.sample_shape) and not data.per_sample
                                      and data.outputs == NUM_CLASSES):
        raise ConfigError(f"--mode scratch trains the lesson's LeNet on images of 10 classes held "
                          f"in memory; {cfg.dataset} has none (use --mode ddp)")


@functools.lru_cache(maxsize=64)
def image_size_problem(name: str, sample_shape: tuple, num_classes: int) -> Optional[str]:
    try:  # torchvision's are built alike for any size: one outline serves a size search
        net = outline_of(name, sample_shape if name in MODELS else sample_shape[:1], num_classes)
        with torch.no_grad():
            net(next(net.parameters()).new_zeros(2, *sample_shape))
    except Exception as exc:
        return first_line(exc)
    return None


@functools.lru_cache(maxsize=2)
def outline_of(name: str, sample_shape: tuple, num_classes: int) -> nn.Module:
    net = model_outline(name, sample_shape, num_classes).to("meta").eval()
    for path, layer in list(net.named_modules()):  # these keep shapes, and are slow on meta
        if isinstance(layer, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.ReLU, nn.ReLU6,
                              nn.GELU, nn.SiLU, nn.Hardswish, nn.Hardsigmoid)):
            net.set_submodule(path, nn.Identity())
    return net


def smallest_image_size(name: str, channels: int, num_classes: int, fails: int) -> Optional[int]:
    """The smallest square size over `fails` the model takes (to 512 px): doubling, bisecting."""
    def takes(size: int) -> bool:
        return image_size_problem(name, (channels, size, size), num_classes) is None
    import bisect
    if not takes(512):
        return next((size for size in (224, 299, 384) if size > fails and takes(size)), None)
    low, step = min(fails, 511), 1
    while low + step < 512 and not takes(low + step):
        low, step = low + step, step * 2
    sizes = range(low + 1, min(low + step, 512) + 1)
    return sizes[bisect.bisect_left(sizes, True, key=takes)]


def check_training_choices(cfg: Config, data: DataInfo) -> None:
    if cfg.best_by.endswith("_acc") and not data.classes:
        raise ConfigError(f"--best-by {cfg.best_by}: {cfg.dataset} is a regression, whose epochs "
                          f"have no accuracy; choose {cfg.best_by[:-3]}loss")
    if not (is_code(cfg.optimizer) or is_code(cfg.lr_schedule)):
        return
    net, flag = build_model(cfg.model, data.sample_shape, data.outputs), "optimizer"
    with failing(ConfigError, lambda why: f"--{flag.replace('_', '-')} {getattr(cfg, flag)} "
                 f"fails on --model {cfg.model}: {why}"):
        optimizer = build_optimizer(cfg, net)
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not held & {id(p) for p in net.parameters()}:
            raise ConfigError(f"--optimizer {cfg.optimizer} holds none of --model {cfg.model}'s "
                              f"parameters, so it would train nothing: build it from the params "
                              f"it is given")
        flag, steps = "lr_schedule", data.sizes[0] // cfg.batch_size
        schedule = own_schedule(cfg, optimizer, steps)
        flag = "optimizer"
        sum(p.sum() for p in net.parameters()).backward()
        optimizer.step()
    with failing(ConfigError, lambda why: f"--lr-schedule {cfg.lr_schedule} cannot step the run's "
                 f"--epochs {cfg.epochs} x {steps} steps: {why}"):
        for _ in range(cfg.epochs * steps if schedule is not None else 0):
            schedule.step()


def check_model_fits(cfg: Config, data: DataInfo) -> None:
    shape = tuple(data.sample_shape)
    if cfg.sync_bn and is_code(cfg.model) and not has_batchnorm(cfg.model, shape, data.outputs):
        raise ConfigError(f"--sync-bn needs a model with BatchNorm (e.g. resnet18); "
                          f"{cfg.model} has none")
    built_in = not is_code(cfg.model) and is_image(shape)
    if built_in and (problem := image_size_problem(cfg.model, shape, data.outputs)):
        side, size = shape[-1], smallest_image_size(cfg.model, shape[0], data.outputs, shape[-1])
        takes = (f"the smallest size it takes is {size} x {size} px: add --image-size {size}"
                 if size else "nor does any size up to 512 px")
        raise ConfigError(f"--model {cfg.model} cannot take {cfg.dataset}'s images as given "
                          f"({side} x {side} px): {problem}; {takes}")
    if not built_in or cfg.loss != "cross_entropy" or is_code(cfg.dataset):
        return check_on_a_sample(cfg, data)
    if cfg.micro_batch == 1:
        check_single_sample_steps(cfg, model_outline(cfg.model, shape, data.outputs),
                                  torch.zeros(1, *shape))


def check_on_a_sample(cfg: Config, data: DataInfo) -> None:
    """Your model and loss on 16 samples: a tensor, a mean over samples, every parameter trained."""
    split = data.datasets[0]
    picked = [split[i * (len(split) - 1) // 15] for i in range(16)]
    x, y = (torch.stack([torch.as_tensor(sample[j]) for sample in picked]) for j in (0, 1))
    x = resized(x, cfg.image_size)
    wrong = x.is_floating_point() and x.dtype != torch.get_default_dtype()
    hint = f" (inputs must be {torch.get_default_dtype()}, not {x.dtype})" if wrong else ""
    with failing(ConfigError, lambda why: f"--model {cfg.model} fails on {len(x)} samples of "
                 f"{cfg.dataset} (inputs {tuple(x.shape)}): {why}{hint}"):
        net = build_model(cfg.model, data.sample_shape, data.outputs)
        with torch.no_grad():
            output = net.eval()(x)
    states = [*net.named_parameters(), *net.named_buffers()]
    unsent = [n for n, t in states if t.layout != torch.strided or t.dtype not in GLOO_TAKES]
    if unsent and cfg.workers > 1 and not (cfg.eval_only or cfg.gpu):
        raise ConfigError(f"--model {cfg.model}: gloo cannot send its {unsent[0]} (sparse, or of a "
                          f"dtype it lacks) to CPU workers: make it dense, int32, int64 or a float")
    if not torch.is_tensor(output):
        raise ConfigError(f"--model {cfg.model} returns {type(output).__name__} in eval mode: "
                          f"ray_dp scores a tensor (logits, or a regression's values)")
    criterion = loss_function(cfg)
    with failing(ConfigError, lambda why: f"--loss {cfg.loss} fails on the model's outputs "
                 f"{tuple(output.shape)} and targets {tuple(y.shape)}: {why}"):
        loss = criterion(output, y)
        each = [criterion(output[i:i + 1], y[i:i + 1]) for i in range(len(y))]
    if not (torch.is_tensor(loss) and loss.ndim == 0):
        raise ConfigError(f"--loss {cfg.loss} returned {type(loss).__name__}, not a tensor")
    if not torch.allclose(loss, mean := torch.stack(each).mean(), rtol=1e-4, atol=1e-6):
        raise ConfigError(f"--loss {cfg.loss} is not a mean over samples ({loss.item():.6g} on "
                          f"{len(y)}, their own {mean.item():.6g}: weights, a mask?), which N "
                          f"workers cannot add up: return per-sample values (reduction='none')")
    check_single_sample_steps(cfg, net, x[:1])
    if cfg.eval_only:
        return
    with failing(ConfigError, lambda why: f"--model {cfg.model} fails to train on 2 samples of "
                 f"{cfg.dataset} (in training mode, forward and backward): {why}"):
        criterion(net.train()(x[:2]), y[:2]).backward()
    unused = [name for name, p in net.named_parameters() if p.requires_grad and p.grad is None]
    if unused and is_code(cfg.model) and not (cfg.find_unused_parameters or cfg.workers == 1):
        raise ConfigError(f"--model {cfg.model}: {', '.join(unused[:3])}"
                          f"{' and more' if len(unused) > 3 else ''} get no gradient from the "
                          f"loss: use them in forward, or add --find-unused-parameters")


def check_single_sample_steps(cfg: Config, net: nn.Module, x: torch.Tensor) -> None:
    """BatchNorm cannot train on one value per channel, unless --sync-bn spans the workers."""
    if cfg.eval_only or cfg.sync_bn or cfg.mode == "scratch" or cfg.micro_batch != 1:
        return
    with failing(ConfigError, lambda why: f"--model {cfg.model} cannot train on micro-batches of "
                 f"one sample ({why}): raise --batch-size to 2 per worker or more, or use "
                 f"--sync-bn"):
        net.train()(x.to(next(net.parameters()).device))


def read_weights(path: str) -> dict:
    try:
        source = io.BytesIO(read_stored(path)) if is_uri(path) else path
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"--weights {path} is not a state_dict torch can load safely "
                          f"({first_words(exc, 160)})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--weights {path} is not a state_dict (names to tensors)")
    return state


def check_state_fits(cfg: Config, data: DataInfo, state: dict) -> None:
    net = model_outline(cfg.model, data.sample_shape, data.outputs)
    try:
        net.load_state_dict(state["model"], assign=True)
    except RuntimeError as exc:
        where = f" ({cfg.model.rpartition(':')[0]} as it is now)" if is_code(cfg.model) else ""
        raise ConfigError(f"the checkpoint's weights do not fit --model {cfg.model}{where}: "
                          f"{str(exc).strip().splitlines()[-1].strip()[:200]}") from None


def check_weights(cfg: Config, info: DataInfo) -> Optional[str]:
    """--weights must fit the model; the header's note says what is kept and what is new."""
    if not cfg.weights:
        return None
    weights = read_weights(cfg.weights)
    kept, new = load_weights(build_model(cfg.model, info.sample_shape, info.outputs), weights)
    if not kept:
        twin = TORCHVISION + cfg.model
        fits_twin = twin in torchvision_names() and load_weights(
            build_model(twin, info.sample_shape, info.outputs), weights)[0]
        hint = f"; they fit torchvision's {cfg.model}: use --model {twin}" if fits_twin else ""
        raise ConfigError(f"--weights {cfg.weights} does not fit {cfg.model}: none of its "
                          f"{len(weights)} tensors has the name and shape of one of the "
                          f"model's{hint}")
    listed = ", ".join(new[:4]) + (f" and {len(new) - 4} more" if len(new) > 4 else "")
    return (f"--weights {cfg.weights}: kept {len(kept)} of the model's {len(kept) + len(new)} "
            f"tensors" + (f"; new (fine-tuned from scratch): {listed}" if new else ""))


# ==================================================================================================
# Your own model, data and loss: FILE.py:NAME, module:NAME or train()'s objects, sent by value.
# ==================================================================================================

CODE: dict = {}


def is_code(spec: str) -> bool:
    return ":" in spec and "://" not in spec


def user_code(spec: str, flag: str):
    """The object FILE.py:NAME or module:NAME names, loaded once; one line for what is wrong."""
    if spec in CODE:
        return CODE[spec]
    typed = "--" + flag.replace("_", "-")
    where, _, name = spec.rpartition(":")
    if where == "__main__":
        raise ConfigError(f"{typed} {spec} names an object of the script that called "
                          f"ray_dp.train(): pass it ({flag}=...), or name a file: FILE.py:NAME")
    if where.endswith(".py") and not os.path.isfile(where):
        raise ConfigError(f"{typed} {spec}: there is no file {where}")
    try:
        module = load_module(where)
    except Exception as exc:
        if isinstance(exc, ModuleNotFoundError) and f"{where}.".startswith(f"{exc.name}."):
            raise ConfigError(f"{typed} {spec}: no module {exc.name} (a file's path ends in "
                              f".py)") from None
        raise ConfigError(f"{typed} {spec}: {where} fails to import: {first_line(exc)}") from None
    if not hasattr(module, name):
        names = {n.lower(): n for n, value in vars(module).items()
                 if n[0] != "_" and not inspect.ismodule(value)}
        close = [names[n] for n in difflib.get_close_matches(name.lower(), names, n=1)]
        raise ConfigError(f"{typed} {spec}: {where} has no {name}"
                          + (f"; did you mean {close[0]}?" if close else ""))
    CODE[spec] = getattr(module, name)
    travels(sys.modules.get(getattr(CODE[spec], "__module__", None)))
    return CODE[spec]


def load_module(where: str):
    if not where.endswith(".py"):
        return travels(importlib.import_module(where))
    path, before = os.path.abspath(where), set(sys.modules)
    folder, name = os.path.dirname(path), "ray_dp_code_" + re.sub(r"\W", "_", path)
    loader = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(loader)
    sys.path.insert(0, folder)
    try:
        loader.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    for imported in {name} | set(sys.modules) - before:
        travels(sys.modules[imported])
    return module


def travels(module):
    """Your module (not an installed one, nor __main__) pickled by value: its nodes need no copy."""
    import site
    import sysconfig
    installed = {os.path.realpath(path) for path in (
        *site.getsitepackages(), site.getusersitepackages(),
        *(sysconfig.get_paths()[key] for key in ("purelib", "platlib", "stdlib")))}
    where = getattr(module, "__file__", None)
    if where and module.__name__ not in ("__main__", __name__) and not any(
            os.path.commonpath([os.path.realpath(where), path]) == path for path in installed):
        ray.cloudpickle.register_pickle_by_value(module)
    return module


def as_spec(value, flag: str) -> str:
    """ray_dp.train()'s object as module:NAME, the object itself kept under that name."""
    if not hasattr(value, "__qualname__"):
        raise ConfigError(f"{flag}= takes a class or a function, not an instance of "
                          f"{type(value).__name__}, which a rerun could not make again")
    spec = f"{value.__module__}:{value.__qualname__}"
    if CODE.setdefault(spec, value) is not value:
        raise ConfigError(f"{flag}= is another object of the name {spec} than one given before: "
                          f"give each its own name (def)")
    travels(sys.modules.get(value.__module__))
    return spec


def your_data(spec: str, flag: str, cfg: Config):
    """Your data function's return, given cfg if its first argument has no default (or is cfg)."""
    load = user_code(spec, flag)
    with failing(DataError, lambda why: f"--{flag} {spec} failed: {why}"):
        first = next(iter(inspect.signature(load).parameters.values()), None)
        given = first and (first.name == "cfg" or first.default is first.empty
                           and first.kind <= first.POSITIONAL_OR_KEYWORD)
        return load(cfg) if given else load()


def your_datasets(cfg: Config) -> tuple:
    data = your_data(cfg.dataset, "dataset", cfg)
    if not (isinstance(data, (tuple, list)) and len(data) == 2
            and all(hasattr(split, "__getitem__") and hasattr(split, "__len__") for split in data)):
        raise DataError(f"--dataset {cfg.dataset} returned {type(data).__name__}, not a pair "
                        f"(train, test) of data sets")
    if not all(isinstance(sample := split[0], (tuple, list)) and len(sample) == 2
               for split in data if len(split)):
        raise DataError(f"--dataset {cfg.dataset}: a sample is {type(sample).__name__}, not an "
                        f"(input, target) pair")
    return tuple(data)


def own_optimizer(cfg: Config, groups: list) -> torch.optim.Optimizer:
    if not is_code(cfg.optimizer):
        return None
    made = user_code(cfg.optimizer, "optimizer")
    optimizer = made(groups, lr=cfg.lr) if isinstance(made, type) else made(groups, cfg)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"--optimizer {cfg.optimizer} returned {type(optimizer).__name__}, not "
                          f"a torch.optim.Optimizer")
    for group in optimizer.param_groups:  # the peak that --lr-schedule cosine|constant scales
        group.setdefault("initial_lr", group["lr"])
    return optimizer


def own_loss(cfg: Config):
    loss = user_code(cfg.loss, "loss")
    with failing(ConfigError, lambda why: f"--loss {cfg.loss} cannot be made without arguments "
                 f"({why}): give its arguments defaults, or name a function"):
        loss = loss() if isinstance(loss, type) else loss

    def mean_loss(output, target):  # torch's MSELoss would broadcast (B, 1) against (B,)
        if torch.is_tensor(output) and target.is_floating_point() and output.numel() == len(target):
            output = output.reshape(target.shape)
        value = loss(output, target)
        return value.mean() if torch.is_tensor(value) and value.ndim else value
    return mean_loss


def own_schedule(cfg: Config, optimizer, steps_per_epoch: int):
    if not is_code(cfg.lr_schedule):
        return None
    schedule = user_code(cfg.lr_schedule, "lr_schedule")(optimizer, cfg, steps_per_epoch)
    if not isinstance(schedule, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigError(f"--lr-schedule {cfg.lr_schedule} returned {type(schedule).__name__}, "
                          f"not a torch.optim.lr_scheduler.LRScheduler")
    return schedule


def code_file(spec: str) -> Optional[dict]:
    """What the run directory records of your code: its spec, its file's (else source's) hash."""
    if not is_code(spec):
        return None
    where = spec.rpartition(":")[0]
    path = os.path.abspath(where) if where.endswith(".py") else None
    text = (Path(path).read_bytes() if os.path.isfile(path) else None) if path else (
        source_text(CODE[spec]) if spec in CODE else None)
    return {"spec": spec, **({"file": path} if path else {}),
            **({"sha256": hashlib.sha256(text).hexdigest()[:16]} if text is not None else {})}


def source_text(value) -> bytes:
    """A class's or function's code, defaults and attributes, as every process that unpickles it."""
    def made(part):
        part = getattr(part, "__wrapped__", getattr(part, "__func__", part))
        if isinstance(part, functools.cached_property):
            part = part.func
        if isinstance(part, property):
            return [made(f) for f in (part.fget, part.fset, part.fdel) if f]
        if inspect.iscode(part):
            return part.co_code, part.co_names, part.co_varnames, made(part.co_consts)
        if hasattr(part, "__code__"):
            return made(part.__code__), made((part.__defaults__, part.__kwdefaults__))
        if isinstance(part, (set, frozenset)):  # in an order of hashes, which differ per process
            return sorted(map(repr, map(made, part)))
        if isinstance(part, (list, tuple, dict)):
            return [made(item) for item in (part.items() if isinstance(part, dict) else part)]
        try:
            return re.sub(r" at 0x[0-9a-f]+", "", repr(part))
        except Exception:
            return type(part).__qualname__
    if not isinstance(value, type):
        return repr(made(value)).encode()
    return repr([[base.__qualname__ for base in value.__bases__], *(
        (name, made(part)) for name, part in sorted(vars(value).items())
        if callable(part) or isinstance(part, property) or not name.startswith("__"))]).encode()


def code_for_workers(cfg: Config) -> list:
    """CODE and MODELS for Ray's workers: not the data set's function, nor what it read."""
    return [{spec: CODE[spec] for spec in (cfg.model, cfg.loss, cfg.optimizer, cfg.lr_schedule)
             if spec in CODE}, {cfg.model: MODELS[cfg.model]} if cfg.model in MODELS else {}]


# ==================================================================================================
# Image folders and torchvision models: --dataset folder, per-sample streams, --weights.
# ==================================================================================================


@dataset("folder", per_sample=True, object_storage=True, image_files=True)
def load_folder(cfg: Config) -> tuple:
    from torchvision.datasets import ImageFolder
    root = cfg.data_dir.rstrip("/") if is_uri(cfg.data_dir) else cfg.data_dir
    for split, other in (("train", "val"), ("val", "train")):
        if stored_type(f"{root}/{split}") != "directory":
            raise DataError(f"--dataset folder needs {root}/{split}/<class>/<images> (and "
                            f"{root}/{other}/ beside it)")
    folder = (functools.partial(StoredImageFolder, data_dir=root) if is_uri(root) else
              functools.partial(ImageFolder, loader=functools.partial(read_image, data_dir=root)))
    with failing(DataError, lambda why: f"--data-dir {root}: {why}"):
        train, val = (folder(f"{root}/{split}", transform)
                      for split, transform in zip(("train", "val"), image_transforms(cfg)))
    if train.classes != val.classes:
        only = [sorted(set(one.classes) - set(other.classes)) or "none"
                for one, other in ((train, val), (val, train))]
        raise DataError(f"--data-dir {root}: train/ and val/ must hold the same classes; only in "
                        f"train/: {only[0]}, only in val/: {only[1]}")
    return train, val


def read_image(path: str, data_dir: str, data: Optional[bytes] = None):
    """ImageFolder's loader (PIL, RGB) of a file or an object's bytes; a bad one: one line."""
    try:
        with Image.open(path if data is None else io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        reason = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", " ".join(str(exc).split()))
        raise DataError(f"{path} is not a readable image ({reason or type(exc).__name__}): remove "
                        f"or replace it in {path.rsplit('/', 1)[0]}/ (and any other such file in "
                        f"--data-dir {data_dir})") from None


IMAGENET_STATISTICS = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def loaded(cfg: Config) -> tuple:
    """load_dataset's (train, test); image files sized, normalised and augmented as cfg says."""
    data = load_dataset(cfg)
    for split, transform in zip(data, image_transforms(cfg)) if data_source(
            cfg.dataset).image_files else ():
        split.transform = transform
    return data


def image_transforms(cfg: Config) -> tuple:
    from torchvision import transforms as T
    size = cfg.image_size or MODEL_IMAGE_SIZE.get(cfg.model, 224)
    fixed = [T.Resize(size), T.CenterCrop(size)]
    train = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()] if cfg.augment else fixed
    normalize = [T.Normalize(*cfg.normalize)] if cfg.normalize else []
    return tuple(T.Compose([*steps, T.ToTensor(), *normalize]) for steps in (train, fixed))


def with_data_statistics(cfg: Config, train_set) -> Config:
    """--dataset folder's normalisation for the config: ImageNet's with --weights, else its own."""
    if cfg.normalize or cfg.weights:
        return replace(cfg, normalize=cfg.normalize or IMAGENET_STATISTICS)
    picked = torch.linspace(0, len(train_set) - 1, 500).long().unique().tolist()
    with torch.random.fork_rng():  # the same crops every run: from --seed, not a loader's seed
        torch.manual_seed(cfg.seed)
        loader = DataLoader(train_set, batch_size=len(picked), sampler=picked,
                            generator=torch.Generator())
        sample = next(iter(loader))[0]
    mean, std = sample.mean((0, 2, 3)), sample.std((0, 2, 3)).clamp_min(1e-3)
    return replace(cfg, normalize=tuple([round(v, 4) for v in t.tolist()] for t in (mean, std)))


class EpochKeys(ResumableSampler):
    """`sampler`'s indices as (epoch, index) keys: the epoch rides along to the loader processes."""

    def __iter__(self):
        return ((self.epoch, index) for index in super().__iter__())


class SampleStreams(torch.utils.data.Dataset):
    """Sample i's augmentation in epoch e from its own stream (--seed, e, i), whoever reads it."""

    def __init__(self, data, seed: int):
        self.data, self.seed = data, seed

    def __getitems__(self, keys: list) -> list:
        if hasattr(self.data, "prefetch"):
            self.data.prefetch([index for _, index in keys])
        return [self[key] for key in keys]

    def __getitem__(self, key: tuple):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(stream_seed(self.seed, AUGMENTATION_STREAM, *key))
            return self.data[key[1]]


def per_sample(data, sampler: ResumableSampler, seed: int) -> tuple:
    return SampleStreams(data, seed), EpochKeys(sampler.dataset, sampler.num_replicas, sampler.rank,
                                                sampler.shuffle, sampler.seed, sampler.drop_last)


TORCHVISION = "torchvision."  # torchvision.resnet18: torchvision's, which ray_dp's name shadows
# without the auxiliary classifiers only their own recipes use (a tuple in training mode)
TORCHVISION_OPTIONS = {"googlenet": {"aux_logits": False, "init_weights": True},
                       "inception_v3": {"aux_logits": False, "init_weights": True}}


def torchvision_models() -> list:
    import torchvision.models
    return torchvision.models.list_models(module=torchvision.models)


def torchvision_names() -> list:
    return [TORCHVISION + name if name in MODELS else name for name in torchvision_models()]


def named_model(name: str, sample_shape: tuple, num_classes: int) -> nn.Module:
    if is_code(name):
        build = user_code(name, "model")
        given = {"num_classes": num_classes, "sample_shape": sample_shape}
        takes = inspect.signature(build).parameters.values()
        net = build(**{key: value for key, value in given.items()
                       if any(p.kind == p.VAR_KEYWORD or p.name == key for p in takes)})
        if not isinstance(net, nn.Module):
            raise ConfigError(f"--model {name} returned {type(net).__name__}, not an nn.Module")
        if any(nn.parameter.is_lazy(p) for p in net.parameters()):
            with torch.no_grad():
                net.eval()(torch.zeros(2, *sample_shape))
            net.train()
        return net
    import torchvision.models
    name = name.removeprefix(TORCHVISION)
    net = torchvision.models.get_model(name, weights=None, num_classes=num_classes,
                                       **TORCHVISION_OPTIONS.get(name, {}))
    first = sample_shape[0] != 3 and next(
        ((parent, attr, conv) for parent in net.modules() for attr, conv in parent.named_children()
         if isinstance(conv, nn.Conv2d) and conv.in_channels == 3), None)
    if first:
        parent, attr, conv = first
        setattr(parent, attr, nn.Conv2d(sample_shape[0], conv.out_channels, conv.kernel_size,
                                        conv.stride, conv.padding, conv.dilation, conv.groups,
                                        conv.bias is not None))
    return net


def model_outline(name: str, sample_shape: tuple, num_classes: int) -> nn.Module:
    try:
        with torch.device("meta"):
            return build_model(name, sample_shape, num_classes)
    except (NotImplementedError, RuntimeError):  # RegNets, timm's: a layout computed from values
        return build_model(name, sample_shape, num_classes)


def has_batchnorm(name: str, sample_shape: tuple = (3, 32, 32), outputs: int = NUM_CLASSES) -> bool:
    net = model_outline(name, sample_shape, outputs)
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


def load_weights(net: nn.Module, weights: dict) -> tuple[list, list]:
    own = net.state_dict()
    kept = [k for k, v in weights.items() if k in own and own[k].shape == v.shape]
    net.load_state_dict({k: weights[k] for k in kept}, strict=False)
    return kept, [k for k in own if k not in kept]


# ==================================================================================================
# Checkpoints: the one place their format lives: build, write, read, list, keep-K and the best.
# ==================================================================================================

CHECKPOINT_FILE = "checkpoint.pt"
CHECKPOINT_FORMAT = 2  # epochs numbered from 1 wherever a user reads them
CHECKPOINT_DIR = re.compile(r"checkpoint_epoch_(\d+)(?:_step_(\d+))?")
BEST_CHECKPOINT = f"checkpoint_best/{CHECKPOINT_FILE}"
RUN_MARKERS = ("checkpoint_manager_snapshot.json", "result.json", "recovery.json")


def best_epoch(history: list, metric: str) -> Optional[dict]:
    """The epoch best by `metric` (least loss or seconds, else most), the earliest of ties."""
    sign = 1 if metric.endswith(("loss", "seconds")) else -1
    return min((e for e in history if math.isfinite(e.get(metric, math.nan))),
               key=lambda e: (sign * e[metric], e["epoch"]), default=None)


def early_stop(history: list, cfg: Config) -> Optional[dict]:
    """--early-stop: the epoch that makes PATIENCE with no better --best-by value, and the best."""
    best = best_epoch(history, cfg.best_by)
    if not (cfg.early_stop and best and history[-1]["epoch"] - best["epoch"] >= cfg.early_stop):
        return None
    return {"epoch": history[-1]["epoch"], "best_epoch": best["epoch"], "metric": cfg.best_by,
            "value": best[cfg.best_by]}


def early_stopped(cfg: Config, early: dict) -> str:
    return ("early stop after epoch {epoch}: {metric} not better than epoch {best_epoch}'s "
            "{value:.4g} for {0} (--early-stop)".format(plural(cfg.early_stop, "epoch"), **early))


def checkpoint_dir_name(epoch: int, step: int = 0) -> str:
    """checkpoint_epoch_003: after epoch 3; checkpoint_epoch_003_step_000040: 40 steps into it."""
    return f"checkpoint_epoch_{epoch:03d}" + (f"_step_{step:06d}" if step else "")


def checkpoint_order(name: str) -> Optional[tuple[int, int]]:
    if not (match := CHECKPOINT_DIR.fullmatch(name)):
        return None
    epoch, step = int(match[1]), int(match[2] or 0)
    return (epoch - 1, step) if step else (epoch, 0)


def checkpoint_state(model_state: dict, optimizer_state: dict, epoch: int, cfg: Config,
                     history: list, classes: list, partial: Optional[dict] = None,
                     samples: Optional[str] = None, outputs: int = 0, inputs: tuple = ()) -> dict:
    """The state after `epoch` epochs (and `partial`'s steps of the next), certified."""
    state = {"model": {key: value.contiguous() if value.layout == torch.strided else value
                       for key, value in model_state.items()},
             "optimizer": optimizer_state, "epoch": epoch, "config": asdict(cfg),
             "history": list(history), "classes": list(classes), "inputs": list(inputs),
             "outputs": outputs or len(classes), "format": CHECKPOINT_FORMAT,
             **({"partial": partial} if partial else {}),
             **({"samples": samples} if samples else {}), "code": code_record(cfg)}
    return {**state, "certificate": certificate(state)}


def code_record(cfg: Config) -> dict:
    return {flag: record for flag in CODE_FLAGS if (record := code_file(getattr(cfg, flag)))}


def keep_score(epoch: int, step: int = 0, steps: int = 1) -> float:
    """What Ray keeps checkpoints by: every epoch's above any mid-epoch one, later above earlier."""
    return 1e9 + epoch if not step else epoch - 1 + step / (steps + 1)


def write_checkpoint(file, state: dict) -> None:
    torch.save(state, file)


def checkpoint_bytes(state: dict) -> bytes:
    saved = io.BytesIO()
    write_checkpoint(saved, state)
    return saved.getvalue()


def save_checkpoint(run_dir: str, state: dict, epoch: int, step: int = 0, keep: int = 0,
                    best: bool = False) -> None:
    """Rank 0's checkpoint where Ray would commit it (and as the best); older ones Ray drops go."""
    name, data = checkpoint_dir_name(epoch, step), checkpoint_bytes(state)
    for target in [os.path.join(name, CHECKPOINT_FILE)] + [BEST_CHECKPOINT] * best:
        write_stored(os.path.join(run_dir, target), data)
    folders = [PurePosixPath(older).parent.name for older in epoch_checkpoints(run_dir)]
    whole = [folder for folder in folders if not checkpoint_order(folder)[1]]
    gone = [folder for folder in folders if folder != name and (
        checkpoint_order(folder)[1] or keep and folder in whole[:-keep])]
    for folder in gone:
        remove_stored(f"{run_dir}/{folder}")
    if gone:  # Ray's next run resumes from the highest
        remove_stored(f"{run_dir}/{RAY_SNAPSHOT}")


def load_checkpoint(path: str) -> dict:
    """The one reader of checkpoint files, local or a URI; one line for anything else."""
    try:
        source = io.BytesIO(read_stored(str(path))) if is_uri(str(path)) else path
        state = torch.load(source, map_location="cpu", weights_only=True)  # data, never code
    except Exception as exc:
        raise ConfigError(f"{path} is not a readable checkpoint ({first_words(exc, 200)})"
                          ) from None
    config = state.get("config") if isinstance(state, dict) and "model" in state else None
    if not (isinstance(config, dict) and isinstance(config.get("model"), str)
            and isinstance(config.get("dataset"), str)):
        raise ConfigError(f"{path} is not a ray-dp checkpoint (it holds no model, or its config "
                          f"names no model and data set)")
    if state.get("format", 1) < CHECKPOINT_FORMAT:
        raise ConfigError(f"{path} is a format-1 checkpoint (epochs counted from 0), which this "
                          f"ray_dp.py no longer reads: train the run again")
    return state


def epoch_checkpoints(run_dir: str) -> list[str]:
    """A run's checkpoint files in the order they were trained (by number, not as text)."""
    storage, path = files_at(str(run_dir))
    found = sorted((order, info.path, info.base_name) for info in storage.get_file_info(
        fs.FileSelector(path, allow_not_found=True)) if info.type == fs.FileType.Directory
        and (order := checkpoint_order(info.base_name)))
    kinds = storage.get_file_info([f"{folder}/{CHECKPOINT_FILE}" for _, folder, _ in found])
    return [f"{str(run_dir).rstrip('/')}/{name}/{CHECKPOINT_FILE}"
            for (_, _, name), kind in zip(found, kinds) if kind.type == fs.FileType.File]


def checkpoint_config(cfg: Config) -> CheckpointConfig:
    """Ray keeps the best by keep_score (the latest --keep-checkpoints epochs'), and the latest."""
    committed = (ray_snapshot(cfg.run_dir) or {}).get("checkpoint_results", [])
    if not all("keep" in entry["metrics"] for entry in committed):
        if cfg.keep_checkpoints:
            print(f"note: run '{cfg.name}' began before --keep-checkpoints: Ray keeps every "
                  f"checkpoint it lists (--fresh starts it over with the latest "
                  f"{cfg.keep_checkpoints} kept)", flush=True)
        return CheckpointConfig(num_to_keep=None)
    return CheckpointConfig(num_to_keep=cfg.keep_checkpoints or cfg.epochs + 1,
                            checkpoint_score_attribute="keep", checkpoint_score_order="max")


# ==================================================================================================
# Resume: the checkpoint a rerun starts from, what a rerun may change, --fresh.
# ==================================================================================================


def note_code_changed(cfg: Config, state: dict, since: str) -> None:
    """A note for each of your files (objects, where none) whose text changed since then."""
    for flag in CODE_FLAGS:
        if is_code(spec := getattr(cfg, flag)):
            user_code(spec, flag)
    changed = {now.get("file", now["spec"]) for flag, now in code_record(cfg).items()
               if ((state.get("code") or {}).get(flag) or {}).get("sha256")
               not in (None, now.get("sha256"))}
    for path in sorted(changed):
        print(f"note: {path} changed since {since}", flush=True)


def check_code_named(stored: dict, typed: set, what: str, flags=CODE_FLAGS) -> None:
    """A checkpoint never decides which code runs: your code's flags are typed again."""
    unnamed = [as_flag(name, stored[name]) for name in CODE_FLAGS
               if name in flags and is_code(stored[name]) and name not in typed]
    if unnamed:
        raise ConfigError(f"{what} trained your own code: name it again, {', '.join(unnamed)} "
                          f"(ray_dp.train(): the same objects); a checkpoint never names the code")


def latest_committed(run_dir: str) -> Optional[str]:
    return resume_point(run_dir)[0]


def resume_point(run_dir: str) -> tuple[Optional[str], bool]:
    """The checkpoint a rerun resumes from (Ray's latest, else the highest) and whether Ray did."""
    state = None if under_torchrun() else ray_snapshot(run_dir)
    if state is None:
        return (epoch_checkpoints(run_dir) or [None])[-1], False
    latest = state.get("latest_checkpoint_result")
    return (f"{run_dir}/{latest['checkpoint_dir_name']}/{CHECKPOINT_FILE}" if latest else None,
            True)


@dataclass(frozen=True)
class Resume:
    done: int = 0
    classes: Optional[list] = None
    unlisted: Optional[str] = None
    samples: Optional[str] = None
    latest: Optional[str] = None

    @property
    def resumes(self) -> bool:
        return self.latest is not None


def check_run_dir(cfg: Config, typed: Optional[set] = None) -> tuple[Config, Resume]:
    """A rerun before validation: its checkpoint, trained as the command says, fills in the rest."""
    if (kind := stored_type(cfg.run_dir)) == "file":
        raise ConfigError(f"{cfg.run_dir} is a file, not a run directory: choose another --name")
    if cfg.fresh and kind == "directory":
        check_deletable(cfg)
    if kind == "none" or cfg.fresh:
        return cfg, Resume()
    try:
        latest, listed = resume_point(cfg.run_dir)
        state = load_checkpoint(latest) if latest else None
        if state and (differ := uncertified(state)):
            raise ConfigError(f"its checkpoint {latest} holds another {' and '.join(differ)} than "
                              f"it certifies (it was altered since it was saved)")
    except ConfigError as exc:
        ways = "" if isinstance(exc, BrokenSnapshot) else f"; {SNAPSHOT_WAYS_ON}"
        raise ConfigError(f"run '{cfg.name}' cannot resume: {exc}{ways}") from None
    highest = (epoch_checkpoints(cfg.run_dir) or [None])[-1] if listed else latest
    if highest != latest:  # Ray's latest loaded: it is one of the run's checkpoints
        start = Path(latest).parent.name if latest else "the start"
        print(f"note: run '{cfg.name}' has {Path(highest).parent.name}, beyond the latest "
              f"checkpoint Ray lists: Ray resumes from {start} and trains those epochs again "
              f"(under torchrun the run resumes from the highest epoch)", flush=True)
    if state is None:
        return cfg, Resume()
    stored = stored_config(state)
    cfg = follow_stored(cfg, stored, typed)
    check_same_training(cfg, stored, state.get("code"))
    note_code_changed(cfg, state, f"run '{cfg.name}' saved its checkpoint")
    done = state["epoch"]
    if is_code(cfg.lr_schedule) and stored["epochs"] != cfg.epochs:
        raise ConfigError(f"run '{cfg.name}' made --lr-schedule {cfg.lr_schedule} for --epochs "
                          f"{stored['epochs']}, and its saved state resumes as it was: rerun with "
                          f"--epochs {stored['epochs']}, or start over with --fresh")
    if cfg.lr_schedule == "cosine" and stored["epochs"] != cfg.epochs and done < cfg.epochs:
        lr = (f"{learning_rate(cfg, done) / cfg.lr:.4g} x your optimizer's lr"
              if is_code(cfg.optimizer) else f"lr {learning_rate(cfg, done):.4g}")
        print(f"note: the cosine schedule now spans --epochs {cfg.epochs} (it was "
              f"{stored['epochs']}): epoch {done + 1} trains at {lr}", flush=True)
    return cfg, Resume(done, state.get("classes"), None if listed else latest, state.get("samples"),
                       latest)


def stored_config(state: dict) -> dict:
    """A checkpoint's config as today's fields: a newer field at its default, values checked."""
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in state["config"].items()
             if k in CONFIG_FIELDS}
    if isinstance(saved.get("amp"), bool):  # --amp was bf16's alone
        saved["amp"] = "bf16" if saved["amp"] else None
    for name, value in saved.items():
        if not isinstance(value, FIELD_TYPES[name]):
            raise ConfigError(f"a checkpoint's config holds {name} = {value!r}, which is not a "
                              f"value of --{name.replace('_', '-')}: not a ray-dp checkpoint")
    return {**{f.name: f.default for f in fields(Config)}, **saved}


def follow_stored(cfg: Config, stored: dict, typed: Optional[set]) -> Config:
    """A rerun's untyped settings come from the run it resumes, whatever today's defaults."""
    if typed is None:
        return cfg
    check_code_named(stored, typed, f"run '{cfg.name}'")
    adopt = {name: stored[name] for name in CONFIG_FIELDS if name in RERUN_ADOPTS - typed
             if stored[name] != getattr(cfg, name)}
    if stored["mode"] == "scratch":
        adopt.update({name: value for name, value in LESSON_DEFAULTS.items()
                      if name not in typed | RERUN_ADOPTS and getattr(cfg, name) != value})
    if (shown := [as_flag(k, v) for k, v in adopt.items() if k in CLI_FIELDS]):
        print(f"note: run '{cfg.name}' resumes with its own {', '.join(shown)}", flush=True)
    return replace(cfg, **adopt)


def check_same_training(cfg: Config, stored: dict, code: Optional[dict] = None) -> None:
    ignored = RERUN_MAY_CHANGE | ({"momentum"} if cfg.mode == "scratch" else set())
    changed = [name for name, now in asdict(cfg).items() if name not in ignored
               and not same_setting(name, stored[name], now, (code or {}).get(name))]
    if changed:
        was = ", ".join(as_flag(name, stored[name]) for name in changed)
        says = ", ".join(as_flag(name, getattr(cfg, name)) for name in changed)
        raise ConfigError(f"run '{cfg.name}' was trained with {was}; this command says {says}: "
                          f"rerun it with its values to resume it, or start over with --fresh or "
                          f"a new --name")


def same_setting(name: str, stored, now, code: Optional[dict] = None) -> bool:
    if stored == now:
        return True
    if name == "weights" and stored and now and os.path.exists(stored) and os.path.exists(now):
        return os.path.samefile(stored, now)
    if code and "file" in code and stored.rpartition(":")[2] == now.rpartition(":")[2]:
        sha256 = code.get("sha256")
        return sha256 is not None and sha256 == (code_file(now) or {}).get("sha256")
    return False


def as_flag(name: str, value) -> str:
    flag = name.replace("_", "-")
    if value is None or value is False or value == "":
        return f"no --{flag}"
    return f"--{flag}" if value is True else f"--{flag} {value}"


def check_same_samples(cfg: Config, resume: Resume, data: DataInfo) -> None:
    if resume.samples and data.fingerprint and resume.samples != data.fingerprint:
        raise ConfigError(f"run '{cfg.name}' trained on another list of images than --data-dir "
                          f"{cfg.data_dir} holds now ({data.sizes[0]} train images): restore the "
                          f"folder as it was, or start over with --fresh or a new --name")


def samples_fingerprint(data) -> Optional[str]:
    """16 hex digits of a data set's classes and (file in its folder, label) list; else None."""
    try:
        root = os.fspath(data.root).rstrip("/")
        lines = [",".join(map(str, data.classes))] + [
            f"{os.fspath(path)[len(root) + 1:]}\t{label}" for path, label in data.samples]
    except (AttributeError, TypeError, ValueError):
        return None
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def check_deletable(cfg: Config) -> None:
    """--fresh deletes only a ray-dp run inside --storage-path that holds no other path flag's."""
    storage, run_dir = files_at(cfg.run_dir)
    names = {Path(info.path).name for info in storage.get_file_info(fs.FileSelector(run_dir))}
    if not (names & set(RUN_MARKERS) or any(checkpoint_order(n) for n in names)):
        raise ConfigError(f"--fresh: {cfg.run_dir} is not a ray-dp run (no checkpoints, no "
                          f"result.json); not deleting it")
    target = location(cfg.run_dir)
    if target[0] == "local" and os.path.dirname(target[1]) != location(cfg.storage_path)[1]:
        raise ConfigError(f"--fresh: {cfg.run_dir} leads to {target[1]}, outside --storage-path; "
                          f"not deleting it")
    for name in sorted((PATH_FIELDS | STORE_ACCESS.keys()) - {"storage_path"}):
        place = location(path) if (path := getattr(cfg, name)) else ("", "")
        if place[0] == target[0] and f"{place[1]}/".startswith(f"{target[1]}/"):
            raise ConfigError(f"--fresh: {cfg.run_dir} holds --{name.replace('_', '-')} {path}; "
                              f"not deleting it")


def location(path: str) -> tuple:
    storage, where = files_at(path)
    local = storage.type_name == "local"
    return storage.type_name, os.path.realpath(where) if local else where.rstrip("/")


def start_fresh(cfg: Config) -> None:
    """--fresh, once every check has passed: delete the run (vetted) and its TensorBoard events."""
    if not cfg.fresh:
        return
    events = sorted(Path(cfg.logdir, cfg.name).glob("events.out.tfevents.*"))
    deleted = [cfg.run_dir] if stored_type(cfg.run_dir) == "directory" else []
    deleted += [f"the run's TensorBoard events in {Path(cfg.logdir, cfg.name)}"] if events else []
    for path in events:
        path.unlink()
    remove_stored(cfg.run_dir)
    if deleted:
        print(f"--fresh: deleted {' and '.join(deleted)}; starting run '{cfg.name}' over")


# ==================================================================================================
# Run-directory files: written whole or not at all, on a disk or in object storage.
# ==================================================================================================


def write_json(path: str, data: dict) -> None:
    write_stored(path, json.dumps(data, indent=2).encode())


def write_csv(path: str, rows: list) -> None:
    import csv
    text = io.StringIO()
    csv.writer(text).writerows(rows)
    write_stored(path, text.getvalue().encode())


def write_stored(path: str, data: bytes) -> None:
    """One object; on a disk written beside, flushed, renamed over (a failure leaves the old)."""
    storage, path = files_at(path)
    if storage.type_name != "local":
        with storage.open_output_stream(path) as f:
            f.write(data)
        return
    folder = os.path.dirname(path)
    made = [part for part in [folder, *Path(folder).parents] if not os.path.isdir(part)]
    os.makedirs(folder, exist_ok=True)
    try:
        with open(path + ".tmp", "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path + ".tmp")
        raise
    for part in [folder, *(os.path.dirname(str(new)) for new in made)]:
        with contextlib.suppress(OSError), contextlib.ExitStack() as opened:
            descriptor = os.open(part, os.O_RDONLY)
            opened.callback(os.close, descriptor)
            os.fsync(descriptor)


def read_stored(path: str) -> bytes:
    storage, key = files_at(path)
    with storage.open_input_stream(key) as f:
        return f.read()


def append_log(folder: str, text: str) -> None:
    with contextlib.suppress(OSError):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "ray.log"), "a") as f:
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")


# ==================================================================================================
# result.json: a finished run's record and its last lines.
# ==================================================================================================


def run_record(cfg: Config, final: Optional[dict], out: dict, checkpoint: Optional[str],
               **more) -> dict:
    return {"config": asdict(cfg), "final": final, "world_size": out.get("world_size"),
            "device": out.get("device"), "checkpoint": checkpoint, "format": CHECKPOINT_FORMAT,
            "code": code_record(cfg), **more}


def summarize(cfg: Config, result: ray.train.Result, board=None) -> dict:
    """result.json of a finished run: medians of the epochs after the first (stalls skew means)."""
    out = result.return_value
    history, last = out["history"], out["history"][-1]["epoch"]
    timed = history[1:] or history
    whole = [m for m in timed if not m.get("resumed_at_step")] or timed
    recovery = recovery_summary(os.path.join(local_run_dir(cfg), "recovery.json"))
    if recovery and board is not None:
        recovery["steps_redone"] = ray.get(board.steps_redone.remote())
        events = recovery["events"]  # this command's, from its mark: each restart's steps redone
        mark = max((i for i, e in enumerate(events) if e["event"] == "command"), default=0)
        ended = [e for e in events[mark:] if e["event"] in ("failed", "preempted")]
        redone = ray.get(board.redone_at_restarts.remote())
        for event, steps in zip(ended, redone) if len(ended) == len(redone) else ():
            event["steps_redone"] = steps
    ledger = record_ledger(cfg, out, board)
    write_ledger_events(cfg, ledger, last)
    checkpoint = os.path.join(cfg.run_dir, checkpoint_dir_name(last), CHECKPOINT_FILE)
    best = best_epoch(history, cfg.best_by)
    best = best and {"epoch": best["epoch"], "metric": cfg.best_by, "value": best[cfg.best_by],
                     "checkpoint": os.path.join(cfg.run_dir, BEST_CHECKPOINT)}
    summary = run_record(
        cfg, history[-1], out, checkpoint, epochs=history, best=best,
        sec_per_epoch=statistics.median(m["epoch_seconds"] for m in whole),
        samples_per_second=statistics.median(m["samples_per_second"] for m in timed),
        **{key: out[key] for key in ("started_at_epoch", "node_ranks", "first_step_at")},
        recovery=recovery, resumed=out["resumed"], ledger=ledger, startup=out["startup"],
        early_stopped=out["early_stopped"], replica_checks=out["replica_checks"])
    write_json(os.path.join(cfg.run_dir, "result.json"), summary)
    return summary


def finished_result(cfg: Config, resume: Resume) -> Optional[dict]:
    """The result.json of a run that trained --epochs, or stopped early as --early-stop says now."""
    if resume.done < cfg.epochs and not cfg.early_stop:
        return None
    try:
        summary = json.loads(read_stored(os.path.join(cfg.run_dir, "result.json")))
        ended = resume.done >= cfg.epochs or early_stop(summary["epochs"], cfg)
        return summary if ended and summary["epochs"][-1]["epoch"] == resume.done else None
    except (OSError, ValueError, AttributeError, KeyError, IndexError, TypeError):
        return None


def finished(cfg: Config, summary: dict, done: int) -> dict:
    print(f"ray-dp: {finished_run(cfg, done)}", flush=True)
    return summary


def finished_run(cfg: Config, done: int) -> str:
    said = (f"has trained {done} epochs, more than --epochs {cfg.epochs}" if done > cfg.epochs
            else f"already finished its {plural(done, 'epoch')}" if done == cfg.epochs
            else f"stopped early after epoch {done} (--early-stop {cfg.early_stop})")
    further = ("a larger --early-stop, or 0, trains it further" if done < cfg.epochs else
               f"--epochs {done + 10} trains it further" if not is_code(cfg.lr_schedule)
               else "its own --lr-schedule spans its epochs: --fresh starts it over")
    return f"run '{cfg.name}' {said}; nothing to train ({further})"


def wrote_run(cfg: Config, summary: dict) -> str:
    first, last = summary["started_at_epoch"], summary["epochs"][-1]["epoch"]
    result = os.path.join(cfg.run_dir, "result.json")
    if first > last:
        return f"wrote {result} (no epoch left to train)"
    first = max(first, last - cfg.keep_checkpoints + 1) if cfg.keep_checkpoints else first
    checkpoints = checkpoint_dir_name(first) + (f" to {checkpoint_dir_name(last)}" * (last > first))
    best = summary.get("best")
    best = (f", checkpoint_best (epoch {best['epoch']}, {best['metric']} {best['value']:.4g})"
            if best else "")
    return (f"wrote {result} and {checkpoints}{best} beside it; TensorBoard events in "
            f"{os.path.join(cfg.logdir, cfg.name)}")


# ==================================================================================================
# Failure records: one line for how a run ended, recovery.json, a full disk, Ctrl-C.
# ==================================================================================================


class RunStopped(RuntimeError):
    """A graceful stop (SIGTERM): where, and how to go on (a worker's: for Ray to restart it)."""


class RunFailed(RuntimeError):
    """Training failed for good: one line."""


def record_failure(cfg: Config, error: ray.train.TrainingFailedError, board=None) -> str:
    logs = local_run_dir(cfg)
    recovery = recovery_summary(os.path.join(logs, "recovery.json"))
    failed = [e for e in recovery.get("events", []) if e["event"] == "failed"]
    node_ips = {int(rank): ip for rank, ip in (failed[-1]["node_ips"] if failed else {}).items()}
    if disk_full(error):
        reason = storage_full(cfg)
    else:
        append_log(logs, str(error))
        reason = (f"{hang_report(cfg, error) or describe_training_error(error, node_ips)}; the "
                  f"full errors are in {os.path.join(logs, 'ray.log')}")
    record_ledger(cfg, None, board)
    with contextlib.suppress(OSError):  # the disk that failed the run may refuse its record too
        write_json(os.path.join(cfg.run_dir, "result.json"),
                   run_record(cfg, None, {}, None, error=reason, recovery=recovery))
    return reason


def disk_full(error: BaseException) -> bool:
    """A write failed for want of space, here or (as text) on a worker or Ray's controller."""
    texts = [error, *getattr(error, "worker_failures", {}).values()]
    return (isinstance(error, OSError) and error.errno == errno.ENOSPC
            or any("No space left on device" in str(text) for text in texts))


def storage_full(cfg: Config, error: Optional[BaseException] = None) -> str:
    """The full disk (the error's file's, or the fuller run disk), the last save, the way on."""
    places = ([("", error.filename)] if getattr(error, "filename", None) else
              [("--storage-path ", cfg.storage_path), ("--logdir ", cfg.logdir)])
    free = []
    for flag, path in [(flag, path) for flag, path in places if not is_uri(str(path))]:
        with contextlib.suppress(OSError, StopIteration):
            existing = next(p for p in [Path(path), *Path(path).parents] if p.exists())
            free.append((shutil.disk_usage(existing).free, flag, path))
    left, flag, path = min(free, key=lambda item: item[0], default=(None, *places[0]))
    where = f"no space left on the device of {flag}{path}"  # --storage-path's on a tie
    where += f" ({tqdm.format_sizeof(left, 'B')} free)" if free else ""
    try:
        latest, place = last_saved(cfg)
    except BrokenSnapshot as exc:  # cut short by the full disk as Ray rewrote it
        return f"{where}; {exc.fact}: once there is space, {SNAPSHOT_WAYS_ON}"
    except OSError:
        latest = None
    if latest is None:
        return (f"{where}; no checkpoint was saved, so the same command starts it over once there "
                f"is space")
    return (f"{where}; the last checkpoint that is safe is {os.path.dirname(latest)} ({place}): "
            f"once there is space, the same command resumes from it")


def last_saved(cfg: Config) -> tuple[Optional[str], str]:
    """The checkpoint a rerun resumes from, and where its name says ("after epoch 3 of 10")."""
    latest = latest_committed(cfg.run_dir)
    done, step = checkpoint_order(Path(latest or "").parent.name) or (0, 0)
    return latest, (f"at epoch {done + 1} of {cfg.epochs}, step {step}" if step
                    else f"after epoch {done} of {cfg.epochs}")


def interrupted(command: str, cfg: Optional[Config]) -> str:
    """Ctrl-C: what was kept, and the command that continues."""
    if command == "compare" and cfg:
        return (f"interrupted; the same command with --name {cfg.name} resumes the rows "
                f"(finished ones are kept)")
    try:
        latest, place = last_saved(cfg) if trains(command, cfg) else (None, "")
    except BrokenSnapshot as exc:
        return f"interrupted; {exc}"
    if latest is None:
        return "interrupted; nothing was saved"
    return (f"interrupted {place} (saved in {cfg.run_dir}); the same command"
            f"{' without --fresh' * cfg.fresh} with --name {cfg.name} resumes it")


def first_line(error: BaseException) -> str:
    """An error in one line: a traceback's last line (which names its type), else Type: message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    last = re.sub(r"^(__main__|ray_dp)\.(?=\w+Error\b)", "", lines[-1] if lines else "")
    if re.match(r"[\w.]+(Error|Exception|Interrupt)\b", last):
        return last[:400]
    return f"{type(error).__name__}: {last[:160]}" if last else type(error).__name__


def first_words(error: BaseException, most: int) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:most] if text else type(error).__name__


PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|remote process exited"
                       r"|communicator was aborted")


def describe_worker_failures(failures: dict, node_ips: dict) -> str:
    """The ranks lost (if every error is a lost peer: those that raised none), else the first."""
    stopped = [re.search(f"{SIGTERM_STOPPED}; saved .* and stopped", str(error))
               for error in failures.values()]
    if not failures or all(stopped):
        return stopped[0][0] if failures else ""

    def on_node(rank: int) -> str:
        found = re.search(r"node_ip='([^']+)'", str(failures.get(rank, "")))
        return f" on {ip}" if (ip := node_ips.get(rank) or (found[1] if found else "")) else ""
    lost = {rank for rank, error in failures.items() if type(error).__name__ == HEALTH_CHECK_ERROR}
    if not lost and all(PEER_LOST.search(str(error)) for error in failures.values()):
        lost = set(node_ips) - set(failures)
    if lost:
        where = ", ".join(f"rank {rank}{on_node(rank)}" for rank in sorted(lost))
        memory = any(RAY_OOM_KILLED.search(str(failures.get(rank, ""))) for rank in lost)
        return (f"lost worker {where} "
                f"({'killed: out of memory' if memory else 'its process or node died'})")
    rank = min(failures)
    return f"worker rank {rank}{on_node(rank)} failed: {first_line(failures[rank])}"


def describe_training_error(error: ray.train.TrainingFailedError, node_ips: dict) -> str:
    return (describe_worker_failures(getattr(error, "worker_failures", {}), node_ips)
            or first_line(getattr(error, "controller_failure", None) or error))


def recovery_summary(record_path: str) -> dict:
    """The last command's failures and restarts (the events after its mark); all the events."""
    try:
        events = json.loads(Path(record_path).read_text())["events"]
    except (OSError, ValueError):  # none yet, or one that cannot be read: from here on
        return {}
    ours = events[max((i for i, e in enumerate(events) if e["event"] == "command"), default=-1):]
    starts = [e for e in ours if e["event"] == "started"]
    return {"failures": sum(e["event"] == "failed" for e in ours),
            "preemptions": [e for e in ours if e["event"] == "preempted"],
            "restarts": max(len(starts) - 1, 0),
            "world_sizes": [[e["at"], e["workers"]] for e in starts],
            "epochs_redone": [epoch for e in ours for epoch in e.get("redone", [])],
            "events": events}


class FailureLog(ray.train.UserCallback):
    """In Ray Train's controller: a line per failure and restart, recovery.json, ray.log."""

    def __init__(self, cfg: Config, logs: str, board=None, done: int = 0):
        self.cfg, self.logs, self.board, self.done, self.save_failed = cfg, logs, board, done, False
        self.events, self.failures, self.node_ips, self.seen, self.began = [], 0, {}, None, -1.0
        self.before = recovery_summary(os.path.join(logs, "recovery.json")).get("events", [])
        self.add(None, event="command")  # the earlier commands' events kept, this one's marked

    def __setstate__(self, state: dict) -> None:  # unpickled in Ray Train's controller
        self.__dict__.update(state)
        quiet_ray_train()

    def after_report(self, run_context, metrics: list, checkpoint) -> None:
        first, epoch, last = metrics[0], metrics[0]["epoch"], self.events[-1]
        notice, saved = first.get("preempted"), checkpoint_dir_name(epoch, first.get("step", 0))
        noticed = last["event"] == "preempted" and last["began"] == first.get("began")
        fresh, self.began = first.get("began") != self.began, first.get("began")  # a new attempt's
        if not noticed and (fresh or last["event"] in ("command", "failed")):
            for failure in [e for e in self.events if e["event"] == "failed" and "redone" not in e]:
                failure["redone"] = list(range(epoch, failure["during_epoch"] + 1))
            self.node_ips = {rank: m.get("node") for rank, m in enumerate(metrics)}
            nodes = sorted(set(self.node_ips.values()) - {None})
            self.add(f"{plural(len(metrics), 'worker')} started on {', '.join(nodes)}"
                     if last["event"] != "command" else None, event="started",
                     workers=len(metrics), nodes=nodes)
        if notice and noticed:  # the notice's last save
            last["saved"].append(saved)
            self.write()
        elif notice:
            self.add(None, event="preempted", began=first.get("began"), during_epoch=epoch,
                     **notice, saved=[saved])
        self.done = epoch - 1 if "step" in metrics[0] else epoch

    def after_exception(self, run_context, worker_exceptions: dict) -> None:
        seen = (self.began, sorted((rank, first_line(e)) for rank, e in worker_exceptions.items()))
        if seen == self.seen or not worker_exceptions:  # the controller polls the same errors again
            return
        self.seen = seen
        if any(getattr(error, "preempted", False) for error in worker_exceptions.values()):
            if self.events[-1]["event"] != "preempted":  # a reclaim whose notice ray-dp missed
                self.add(None, event="preempted", began=self.began, during_epoch=self.done + 1,
                         nodes={}, saved=[])
            return  # Ray counts it against --max-preemptions, not --max-failures
        self.failures += 1
        limit = self.cfg.max_failures
        append_log(self.logs, "\n".join(f"rank {rank}: {''.join(traceback.format_exception(error))}"
                                        for rank, error in sorted(worker_exceptions.items())))
        of = "no limit" if limit == -1 else f"{limit} allowed"
        then = (f"failure {self.failures}, more than --max-failures {limit} allows: stopping"
                if limit != -1 and self.failures > limit else f"failure {self.failures} "
                f"(--max-failures: {of}): restarting the workers from the last checkpoint")
        what = describe_worker_failures(worker_exceptions, self.node_ips)
        self.add(f"{what} during epoch {self.done + 1}; {then}", event="failed",
                 failure=self.failures, during_epoch=self.done + 1, what=what,
                 node_ips=self.node_ips, errors={rank: first_line(error)
                                                 for rank, error in worker_exceptions.items()})

    def add(self, message: Optional[str], **event) -> None:
        if message:
            self.say(f"ray-dp: {message}")
        self.events.append({"at": time.time(), **event})
        self.write()

    def write(self) -> None:
        try:
            write_json(f"{self.logs}/recovery.json", {"events": self.before + self.events})
        except OSError as exc:
            if not self.save_failed:
                self.say(f"ray-dp: cannot write {self.logs}/recovery.json ({exc}); training goes "
                         f"on without it")
            self.save_failed = True

    def say(self, line: str) -> None:
        self.board.say.remote(line) if self.board is not None else print(line, flush=True)


# ==================================================================================================
# Operations: the one object the lesson's loop asks (its # 1.), and the ranks' agreement behind it.
# ==================================================================================================

VOTES = (SIGTERM_VOTE, DRIVER_VOTE, DUE_VOTE, LAST_VOTE, READ_VOTE) = (
    "sigterm", "driver", "due", "last", "read")
SAVES = {DUE_VOTE, LAST_VOTE}  # votes that are no stop
SIGTERM_STOPPED = "a worker got SIGTERM"


def operations(config: dict) -> "Operations":
    """This process's operations (the loop's # 1.): its rank and launcher, the allocator, the
    collectives' timeout, its data (under torchrun rank 0's config is the run's). A test hands its
    own worker and launcher."""
    cfg, options = config["config"], config["options"]
    worker = config.get("worker") or Worker.current(cfg)
    worker.marks["loop"] = time.time()
    if options.code is not None:
        for registry, entries in zip((CODE, MODELS, DATASETS), ray.get(options.code)):
            registry.update(entries)
    if cfg.keep_freed_memory:
        keep_freed_memory()
    bound_collectives(cfg.timeout)
    if options.torchrun and "worker" not in config:
        cfg = from_rank_0(cfg, worker.device)
    if cfg.min_workers:  # elastic: the same global batch over the workers there are now
        cfg = replace(cfg, workers=worker.world)
    launcher = config.get("launcher") or (TorchrunLauncher(cfg, worker) if options.torchrun
                                          else RayLauncher(cfg.run_dir, options.resume_from))
    return Operations(cfg, worker, launcher, options, worker_data(cfg, options, worker))


class Operations:
    """What the lesson's loop asks, in its order (restore, track, epochs, start_epoch, after_step,
    end_epoch, result); behind it: Agreement, Progress, Health's checks, Store, SpotNotice."""

    def __init__(self, cfg: Config, worker: Worker, launcher=None, options=LoopOptions(),
                 data=None):
        self.cfg, self.worker, self.options = cfg, worker, options
        self.store = Store(launcher, worker)
        self.notice = SpotNotice(cfg, worker, isinstance(launcher, RayLauncher))
        self.data, self.failed = (None, data) if isinstance(data, DataError) else (data, None)
        if self.data and (train := self.data[0]) is not None:  # what the model is built for
            self.classes, self.outputs, self.inputs, self.samples = built_for(cfg, train)
        self.progress, self.agreement = Progress(cfg, worker, options), Agreement(cfg, worker)
        self.first_epoch, self.resumed_at, self.early = 0, {}, None
        self.history, self.resume_record, self.stopped, self.stop_votes = [], None, None, set()

    def __enter__(self) -> "Operations":
        return self.progress.__enter__() and self

    def __exit__(self, *error) -> None:
        self.progress.__exit__(*error)

    def restore(self, model: Optional[nn.Module] = None) -> Optional[dict]:
        """The run's latest checkpoint, the same on every rank; else None (--weights in `model`)."""
        state = self.store.launcher.latest_checkpoint()
        if state is None and self.cfg.weights and model is not None:
            load_weights(model, starting_weights(self.cfg, self.options))
        return state

    def checkpoint(self, model_state: dict, optimizer_state: dict, epoch: int, history: list,
                   partial: Optional[dict] = None) -> dict:
        """The state to save after `epoch` epochs (and `partial`'s steps of the next)."""
        return checkpoint_state(model_state, optimizer_state, epoch, self.cfg, history,
                                self.classes, partial, self.samples,
                                self.outputs, self.inputs)

    def track(self, model, optimizer, checkpoint_of, state: Optional[dict]) -> list:
        """What Health checks and rank 0 saves; the run's history so far, certified."""
        self.store.checkpoint_of = checkpoint_of
        self.agreement.track(self.cfg, model, optimizer)
        self.progress.started(getattr(self.store.launcher, "restore_seconds", 0.0))
        if state is not None:
            self.first_epoch, self.resumed_at = state["epoch"], state.get("partial") or {}
            self.history = list(state["history"])
            if self.first_epoch >= self.cfg.epochs or early_stop(self.history, self.cfg):
                self.progress.say(f"ray-dp: {finished_run(self.cfg, self.first_epoch)}")
            else:
                line, self.resume_record = resumed(self.cfg, self.worker, state, checkpoint_of)
                self.progress.say(f"ray-dp: {line}")
            self.progress.ledger.charge("restores")
        return self.history

    def epochs(self):
        """The epochs left to train, until a stop: SIGTERM's, a check's, --early-stop's."""
        for epoch in range(self.first_epoch, self.cfg.epochs):
            if self.cfg.early_stop and not self.stopped:
                self.early = from_rank_0(early_stop(self.history, self.cfg), self.worker.device)
            if self.early:
                self.progress.say(f"ray-dp: {early_stopped(self.cfg, self.early)}")
            if self.stopped or self.early:
                return
            yield epoch

    def start_epoch(self, epoch: int) -> tuple[int, EpochLoss]:
        """The epoch's first step and its loss so far: 0 and none, or a mid-epoch save's."""
        partial = self.resumed_at if epoch == self.first_epoch else {}
        self.store.count, self.store.seconds = 0, 0.0
        self.progress.start_epoch(partial.get("step", 0))
        return partial.get("step", 0), EpochLoss(self.worker.device, partial, self.worker.is_main)

    def after_step(self, epoch: int, step: int, steps: int, losses: EpochLoss) -> bool:
        """True once every rank has agreed to stop after this step (its checkpoint saved)."""
        done, last, agreement = epoch * steps + step + 1, step + 1 == steps, self.agreement
        where = f"after step {step + 1} of epoch {epoch + 1} (the run's step {done})"
        self.progress.stepped(where)
        checking = agreement.stepped(done, steps, losses)
        logged = done % self.cfg.log_every == 0
        due = agreement.due(step + 1) and not last and self.store.checkpoint_of is not None
        votes = (self.agree(losses, done if logged else 0, last, checking, where, steps - step - 1)
                 if logged or due or last or checking or agreement.waited() else set())
        self.progress.shown((epoch, step + 1, steps, losses, self.cfg.epochs))
        if stop := votes - SAVES:
            self.progress.watchdog.dump(f"a stop was agreed ({', '.join(sorted(stop))})")
        if self.stopped is None and (due or votes) and not last and self.store.checkpoint_of:
            if self.checked("save", f"at the save after step {step + 1} of epoch {epoch + 1}"):
                self.store.save_within(epoch, step + 1, steps, losses, agreement, self.history,
                                       self.worker.is_main, **self.notice.tag(votes))
                agreement.saved(), self.progress.saved()
                self.notice.saved(votes, epoch + 1, step + 1, self.progress)
            if stop and self.stopped is None:  # not over a check's stop, which saved nothing
                self.stopped = {"epoch": epoch + 1, "step": step + 1, "steps": steps,
                                "by": sorted(stop)}
        self.stop_votes |= stop
        if self.stopped is not None:
            self.progress.shown(None)
        return self.stopped is not None

    def agree(self, losses: EpochLoss, logged_step: int, epoch_end: bool, checking: bool,
              where: str, left: int = 0) -> set:
        """The ranks agree on their votes (Agreement.agree); a check's error stops the run."""
        mine = self.progress.votes(epoch_end, self.agreement.since_save)
        mine |= {DUE_VOTE} if self.store.checkpoint_of and self.agreement.time_due() else set()
        mine |= self.notice.votes(self.agreement, self.progress.ledger, left, self.store)
        votes, error, notes = self.agreement.agree(mine, losses, logged_step,
                                                   self.progress.ledger, checking, where)
        votes |= self.notice.read(votes, self.agreement, self.progress)
        for note in notes:
            self.progress.say(f"ray-dp: note: {note}")
        self.stopped = self.stopped or error
        return votes - {READ_VOTE}  # (a reading, agreed)

    def checked(self, stage: str, where: str) -> bool:
        """At a save (none stopped), before rank 0 writes: every rank's replicas and optimizer."""
        self.stopped = self.stopped or self.agreement.at_save(stage, where)
        return self.stopped is None

    def end_epoch(self, checkpoint_of) -> None:
        """History's last epoch ends on every rank: its line, rank 0's checkpoint, a stop."""
        metrics, marks = self.history[-1], self.worker.marks
        self.progress.ended(metrics)
        metrics.update(checkpoints_within=self.store.count, checkpoint_seconds=self.store.seconds,
                       first_step_at=marks.get("first_step"), ended_at=time.time())
        if metrics["epoch"] == self.first_epoch + 1:
            metrics["startup"] = dict(marks)
        self.progress.say(format_epoch(metrics, self.cfg.epochs))
        if not self.checked("epoch", f"at the end of epoch {metrics['epoch']}"):
            return
        best = best_epoch(self.history, self.cfg.best_by) is metrics
        self.store.save({**metrics, "best": best}, self.history, checkpoint_of)
        self.agreement.saved(), self.progress.saved()
        if self.stop_votes and metrics["epoch"] < self.cfg.epochs:
            self.stopped = {"epoch": metrics["epoch"] + 1, "step": 0, "steps": None,
                            "by": sorted(self.stop_votes)}

    def result(self) -> dict:
        """What the loop returns (rank 0's is the Result's), or RunStopped for Ray to restart it."""
        if self.failed is not None:  # a run that cannot start is not retried
            return {"data_error": str(self.failed)}
        marks, worker = self.worker.marks, self.worker
        out = {"history": self.history, "world_size": worker.world, "device": worker.device.type,
               "started_at_epoch": self.first_epoch + 1, "first_step_at": marks.get("first_step"),
               "startup": marks, "node_ranks": node_ranks(worker), "stopped": self.stopped,
               "resumed": self.resume_record, "early_stopped": self.early,
               "ledger": {**self.progress.snapshot(), "ended": time.time()},
               "replica_checks": sum(check.count for check in self.agreement.checks)}
        self.progress.console.flush()
        if (self.stopped and self.stopped["by"] == [SIGTERM_VOTE] and not self.options.torchrun
                and self.cfg.max_failures):
            raise RunStopped(f"{SIGTERM_STOPPED}; saved {position_of(self.stopped)} and stopped")
        return out


def built_for(cfg: Config, train) -> tuple[list, int, tuple, Optional[str]]:
    """The model's classes, outputs and input shape, and the samples' fingerprint."""
    classes = class_names(train) if classifies(train) else []
    return classes, outputs(train, classes), input_shape(cfg, train), samples_fingerprint(train)


def resumed(cfg: Config, worker: Worker, state: dict, checkpoint_of) -> tuple[str, dict]:
    """The resume's line and record: where it resumes, and whether what was restored is what the
    checkpoint certifies (checkpoint_of made anew; a difference stops the run)."""
    partial = state.get("partial") or {}
    epoch, step = state["epoch"] + 1, partial.get("step", 0)
    at = f", step {step + 1} of {partial['steps']}," if step else ""
    since = f"at epoch {epoch}, step {step}" if step else f"of epoch {epoch - 1}"
    line = (f"resuming at epoch {epoch} of {cfg.epochs}{at} with "
            f"{plural(worker.world, 'worker')}, from the checkpoint {since}")
    record = {"from": since.split(" ", 1)[1], "certified": False}
    if checkpoint_of is None:
        return line, record
    now = checkpoint_of(state["epoch"], list(state["history"]), partial or None)
    if (differ := uncertified(state, now["certificate"])) is None:
        return f"{line}; it carries no certificate: what was restored is not checked", record
    if differ:  # the file was certified on the driver: this ray_dp restores it otherwise
        raise RuntimeError(f"the checkpoint {since} did not restore as saved: "
                           f"{', '.join(differ)} differ from what it certifies")
    return f"{line}: the same model, optimizer, history and data position as saved", {
        **record, "certified": True}


class Store:
    """A worker's way to the checkpoint store: its launcher (the latest checkpoint; where a save
    goes), rank 0's checkpoint_of, and this epoch's saves (count, seconds)."""

    def __init__(self, launcher, worker: Worker):
        self.launcher, self.checkpoint_of, self.count, self.seconds = launcher, None, 0, 0.0
        self.began = worker.marks.get("loop", 0.0)  # the attempt's start, on its saves' metrics
        self.last = 1.0  # the last save's seconds

    def save(self, metrics: dict, history: list, checkpoint_of, partial=None) -> None:
        """Report an epoch's (or partial's steps') metrics with checkpoint_of's state (rank 0's),
        kept by keep_score."""
        tic, epoch, step = time.perf_counter(), metrics["epoch"], metrics.get("step", 0)
        state = checkpoint_of(epoch - 1 if partial else epoch, history, partial) if (
            checkpoint_of) else None
        metrics = {**metrics, "keep": keep_score(epoch, step, metrics.get("steps", 1)),
                   "node": node_name(), "began": self.began}
        self.launcher.report(metrics, state, epoch, step)
        self.last = time.perf_counter() - tic
        self.count, self.seconds = self.count + 1, self.seconds + self.last

    def save_within(self, epoch: int, step: int, steps: int, losses: EpochLoss,
                    agreement: Agreement, history: list, rank_0: bool, **more) -> None:
        """The epoch so far (its agreed losses), after `step` of `steps`."""
        partial = {"epoch": epoch, "step": step, "steps": steps,
                   "samples": int(agreement.totals[1]), "loss_sum": agreement.totals[0],
                   "step_log": [list(e) for e in losses.logged], "pending": agreement.pending,
                   "skipped_steps": losses.skipped}
        self.save({"epoch": epoch + 1, "step": step, "steps": steps, **more}, history,
                  self.checkpoint_of if rank_0 else None, partial)


class Agreement:
    """When the ranks agree (every AGREE_S of training at rank 0's pace, or a log step, a save, a
    check, an epoch's end), what they agreed on, and when a save is due (--checkpoint-every)."""

    AGREE_S = 1.0  # seconds of training between two agreements (each step, if steps are slower)

    def __init__(self, cfg: Config, worker: Worker):
        self.worker, self.totals, self.pending = worker, [0, 0], [0, 0]
        self.every_steps, self.every_seconds = checkpoint_interval(cfg.checkpoint_every)
        self.steps_done, self.next, self.agreed_steps, self.agreed_at = 0, 1, 0, 0.0
        self.since_save, self.last_save, self.trained, self.checks = 0, time.monotonic(), 0.0, []
        self.every_step = False  # a reclaim's notice: an agreement after each step

    def track(self, cfg: Config, model, optimizer) -> None:
        self.checks = [check(cfg, self.worker, model, optimizer) for check in HEALTH_CHECKS]

    def stepped(self, done: int, steps: int, losses: EpochLoss) -> bool:
        """A step ended; whether a check is due at the next agreement."""
        self.steps_done, self.since_save = self.steps_done + 1, self.since_save + 1
        for check in self.checks:
            check.stepped(done, steps, losses)
        return any(check.due(self.steps_done) for check in self.checks)

    def waited(self) -> bool:
        return self.steps_done >= self.next

    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def time_due(self) -> bool:
        return bool(self.worker.is_main and self.every_seconds
                    and time.monotonic() - self.last_save >= self.every_seconds)

    def step_seconds(self, ledger: "Ledger") -> float:
        """Seconds a step took since the last agreement, as the ledger timed its training."""
        self.trained = ledger.seconds.get("training steps", 0.0)
        steps = max(self.steps_done - self.agreed_steps, 1)
        return max(self.trained - self.agreed_at, 1e-6) / steps

    def ahead(self, step_seconds: float) -> list:
        pace = 1 if self.every_step else min(max(int(self.AGREE_S / step_seconds), 1), 10_000)
        return [pace if self.worker.is_main else 0]

    def agree(self, votes: set, losses: EpochLoss, logged_step: int, ledger: "Ledger",
              checking: bool, where: str) -> tuple[set, Optional[dict], list]:
        """ONE all-reduce of named slots (votes, rank 0's pace, the losses, each check's own): the
        votes agreed on, the first check's error ({"by", "error"}) and their notes."""
        if checking:  # the step's own GPU work is not the check's
            synchronize(self.worker.device)
        tic, step_seconds = time.perf_counter(), self.step_seconds(ledger)
        slots = {"votes": [vote in votes for vote in VOTES], "ahead": self.ahead(step_seconds),
                 "window": losses.window, "sums": losses.sums}
        for check in self.checks:
            slots.update(check.slots(checking, step_seconds, self))
        totals = all_reduced(slots, self.worker.device)
        self.next, self.agreed_steps = self.steps_done + int(totals["ahead"][0]), self.steps_done
        self.totals, self.pending = totals["sums"], totals["window"] if not logged_step else [0, 0]
        self.agreed_at = self.trained
        if logged_step:
            losses.logged.append([logged_step, totals["window"][0] / totals["window"][1]])
            losses.window.zero_()
        read = [(check.name, *check.read(totals, where, tic, self)) for check in self.checks]
        errors = [{"by": [name], "error": error} for name, error, _ in read if error]
        return ({vote for vote, count in zip(VOTES, totals["votes"]) if count},
                (errors or [None])[0], [note for _, _, note in read if note])

    def at_save(self, stage: str, where: str) -> Optional[dict]:
        """Every check at a save, on every rank; the first error ({"by", "error"})."""
        errors = [{"by": [check.name], "error": error} for check in self.checks
                  if (error := check.at_save(stage, where))]
        return (errors or [None])[0]

    def saved(self) -> None:
        self.since_save, self.last_save = 0, time.monotonic()


def all_reduced(slots: dict, device: torch.device) -> dict:
    """ONE all-reduce (a sum) of named float64 vectors, each given back by its name."""
    parts = {name: torch.as_tensor(value, dtype=torch.float64, device=device).reshape(-1)
             for name, value in slots.items()}
    totals = iter(all_reduce_sum(torch.cat(list(parts.values()))).tolist())
    return {name: [next(totals) for _ in range(len(part))] for name, part in parts.items()}


# ==================================================================================================
# Mid-epoch saves and SIGTERM: where a stop was, what Ray keeps, a stop within seconds.
# ==================================================================================================


def position_of(stopped: dict) -> str:
    if stopped["step"]:
        return f"epoch {stopped['epoch']}, step {stopped['step']} of {stopped['steps']}"
    return f"the end of epoch {stopped['epoch'] - 1}"


class GracefulStop:
    """SIGTERM while training (a spot node reclaimed): save within seconds, stop; else as before."""

    def __init__(self, before):
        self.before, self.asked, self.training, self.heard = before, False, False, False
        self.on_ask = None  # the driver's: tell the workers (False: none trains to hear it)

    def __enter__(self) -> "GracefulStop":
        self.training, self.asked, self.heard = True, False, False
        return self

    def __exit__(self, *error) -> None:
        self.training, self.on_ask = False, None

    def __call__(self, signum, frame) -> None:
        self.heard = self.heard or self.training  # before on_ask, which may wait on a dying Ray
        if self.training and not self.asked and (self.on_ask is None or self.on_ask()):
            self.asked = True  # the driver's promise (a rank's own may be torchrun's teardown):
            if self.on_ask is not None:  # not print(), the signal may have come inside one
                os.write(sys.__stdout__.fileno(), b"ray-dp: SIGTERM: saving a checkpoint within "
                         b"seconds of training, then stopping (a second SIGTERM stops at once)\n")
            return
        if callable(self.before):
            self.before(signum, frame)
        elif self.before == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def graceful_stop() -> Optional[GracefulStop]:
    """This process's GracefulStop, installed from its main thread (Ray's workers: at set-up)."""
    handler = signal.getsignal(signal.SIGTERM)
    if hasattr(handler, "asked"):
        return handler
    if threading.current_thread() is not threading.main_thread():
        return None
    stop = GracefulStop(handler)
    signal.signal(signal.SIGTERM, stop)
    return stop


@contextlib.contextmanager
def own_ray_watched(cfg: Config, stop: GracefulStop):
    """SIGTERM to the driver's process group (timeout, scancel) stops ray_dp's own Ray too: once
    its GCS is gone and the workers had seconds to save, one line and exit 143 (not Ray's 60 s)."""
    me, done, ending = psutil.Process(), threading.Event(), threading.Lock()
    host, port = ray.get_runtime_context().gcs_address.rsplit(":", 1)

    def gcs_answers() -> bool:  # its process may linger after a SIGTERM; its port closes
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), timeout=2):
            return True
        return False

    def stopped() -> None:
        with ending:
            ours = []  # Ray Train's processes (its controller, its workers) that have not gone
            for process in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if "Train" in process.name():
                        ours.append(process)
            psutil.wait_procs(ours, timeout=10)
            latest, place = last_saved(cfg)
            with contextlib.suppress(Exception):  # its time counted, as "other": the
                record_ledger(cfg, None, None)  # workers' clocks went with the Board
            print(f"ray_dp.py: stopped {place} (SIGTERM, to ray_dp's own Ray too); the same "
                  f"command resumes from {latest}", file=sys.stderr, flush=True)
            os._exit(143)  # 128 + SIGTERM, as a shell reports one

    def watch(until: float = math.inf) -> None:
        while not done.is_set() and time.monotonic() < until:
            if stop.heard and not gcs_answers():
                stopped()
            done.wait(0.5)
    own = RAY_STARTED.get("local")
    if own:
        asked = stop.on_ask  # the Board gone with its Ray: the workers had the signal too
        stop.on_ask = lambda: asked() or not gcs_answers()
        threading.Thread(target=watch, daemon=True).start()
    try:
        yield
    except BaseException:  # fit() raised: its controller may have gone before the GCS did
        if own and stop.heard:
            watch(time.monotonic() + 5)
        raise
    finally:
        done.set()


@contextlib.contextmanager
def dumps_asked(cfg: Config, board):
    """SIGUSR1 to the driver while it trains: every rank writes its stacks (Watchdog)."""
    if board is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def ask(*_):  # (rank N's watchdog, started later, answers it then)
        board.ask_dump.remote()
        tqdm.write(f"ray-dp: SIGUSR1: each rank writes its stacks to {cfg.run_dir}/hang/"
                   f"rank<N>.txt (and torch's flight recorder to rank<N>.json)")
        sys.stdout.flush()
    before = signal.signal(signal.SIGUSR1, ask)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, before)


class SpotNotice:
    """Ray's notice that nodes of the run are reclaimed (spot), read every NOTICE_S when rank 0
    votes so (get_preemption_info is a barrier: every rank reads at the same agreement): a save at
    once; the last save before the deadline; then the workers wait for Ray's restart."""

    NOTICE_S, GRACE_S = 5.0, 60.0  # Ray's own watcher's period; a wait past the deadline

    def __init__(self, cfg: Config, worker: Worker, on_ray: bool):
        self.reading, self.worker, self.read_at = on_ray and cfg.spot_notices, worker, time.time()
        self.heard, self.deadline, self.at, self.first, self.last = None, 0.0, 0.0, False, False
        self.nodes, self.named, self.tagged = {}, {}, {}  # Ray's node IDs; their IPs; a save's

    def read(self, votes: set, agreement: "Agreement", progress: "Progress") -> set:
        """Every rank alike, where rank 0 voted READ: a notice (or a node more) is a save now."""
        if READ_VOTE not in votes:
            return set()
        self.read_at, info = time.time(), ray.train.get_preemption_info()
        nodes = dict(info.preempted_node_to_ranks) if info is not None else {}
        if not set(nodes) - set(self.nodes):
            return set()
        self.heard, agreement.every_step, progress.preempted = info, True, True
        self.at, self.first, self.nodes = self.at or time.time(), False, {**self.nodes, **nodes}
        ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
        self.named = {ips.get(node, node): sorted(ranks) for node, ranks in self.nodes.items()}
        self.deadline = min(info.deadline_ms / 1000 if info.deadline_ms else time.time() + 115,
                            self.deadline or math.inf)  # (no deadline: Ray Train waits 120 s)
        return {DUE_VOTE}

    def votes(self, agreement: "Agreement", ledger: "Ledger", left: int, store) -> set:
        """Rank 0's: READ every NOTICE_S; the notice's first save if still owed; the last one when
        the next chance to save (after one more step; at the epoch's end, after the rest of it and
        its evaluation) would come, with two saves of this run's, past the deadline."""
        if not (self.reading and self.worker.is_main):
            return set()
        read = {READ_VOTE} if time.time() - self.read_at >= self.NOTICE_S else set()
        if not self.heard or self.last or not left:
            return read
        step, saves = agreement.step_seconds(ledger), 2 * store.last + 1.0
        after = 2 * step if left > 1 else left * step + ledger.seconds.get("evaluation", 0.0)
        if time.time() + after + saves >= self.deadline:
            return read | {DUE_VOTE, LAST_VOTE}
        return read if self.first else read | {DUE_VOTE}

    def tag(self, votes: set) -> dict:
        """The notice on the metrics of its first and last saves (recovery.json's record)."""
        self.tagged = {}
        if not (self.heard and self.worker.is_main and (not self.first or LAST_VOTE in votes)):
            return {}
        self.tagged = {"nodes": self.named, "notice_at": self.at, "deadline": self.deadline,
                       "last": LAST_VOTE in votes}
        return {"preempted": self.tagged}

    def saved(self, votes: set, epoch: int, step: int, progress: "Progress") -> None:
        """The notice's line after its first save; after the last (or SIGTERM's, once noticed),
        the wait for Ray's restart."""
        if self.heard and not self.first and self.tagged:
            named = ", ".join(f"{node} (rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))})"
                              for node, ranks in self.named.items())
            whose = f"nodes {named} are" if len(self.named) > 1 else f"node {named} is"
            by = time.strftime("%H:%M:%S", time.localtime(self.deadline))
            progress.say(f"ray-dp: {whose} being reclaimed by {by}: saved epoch {epoch}, "
                         f"step {step}")
        self.first = self.first or bool(self.heard)
        if LAST_VOTE in votes or (self.heard and SIGTERM_VOTE in votes):
            self.last = True
            while time.time() < self.deadline + self.GRACE_S:  # Ray stops the workers at it
                progress.watchdog.progress("waiting for the reclaim")
                time.sleep(0.5)
            progress.ledger.charge("preemptions")
            progress.say(f"ray-dp: note: {self.GRACE_S:.0f} s past the reclaim's deadline the "
                         f"workers were not restarted: training goes on")


class DriverLink:
    """Rank 0's beat to the driver's Board every BEAT_S, from a thread of its own (the driver
    knows a worker trains, however long a step takes); its answer carries the driver's stop."""

    BEAT_S = 2.0

    def __init__(self, board):
        self.board, self.asked, self.done = board, False, threading.Event()
        self.thread = threading.Thread(target=self.beating, daemon=True, name="ray-dp heartbeat")

    def __enter__(self) -> "DriverLink":
        self.beat(timeout=30)
        self.thread.start()
        return self

    def __exit__(self, *error) -> None:
        self.done.set()
        self.thread.join()

    def beating(self) -> None:
        while not self.done.wait(self.BEAT_S):
            self.beat(timeout=self.BEAT_S)

    def beat(self, timeout: float) -> None:
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            self.asked = ray.get(self.board.beat.remote(), timeout=timeout) or self.asked


# ==================================================================================================
# Health: replicas that agree, a certified resume, where the time went, a record of a hang.
# ==================================================================================================

CHECK_SHARE = 0.005  # --check-replicas auto aims its checks at this share of training (at most 1%)
STRAGGLER = 1.5  # a rank whose forward passes take this much of the ranks' median, or more
INT_OF_SIZE = {8: torch.int32, 4: torch.int32, 2: torch.int16, 1: torch.int8}  # 8: two words
GLOO_TAKES = (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128,
              torch.complex64, torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)


def tensor_hashes(named: list, device: torch.device) -> torch.Tensor:
    """Each tensor's torch.hash_tensor (an xor of its words) and position_sum: int64 (n, 2)."""
    rows = torch.zeros(len(named), 2, dtype=torch.int64, device=device)
    for row, (_, tensor) in zip(rows, named):
        bits = (tensor.dequantize() if tensor.is_quantized else tensor).detach().to_dense().ravel()
        bits = torch.view_as_real(bits).reshape(-1) if bits.is_complex() else bits
        bits = bits.view(INT_OF_SIZE[bits.element_size()])  # floats, unsigned: as signed integers
        if bits.numel():
            row[0], row[1] = torch.hash_tensor(bits).view(torch.int64), position_sum(bits)
    return rows


def position_sum(bits: torch.Tensor) -> torch.Tensor:
    """The sum of w(i) x bits[i] in int64 (it wraps alike on every device and in any order), w(i)
    splitmix64's finalizer of i: pseudo-random, where a linear w misses a tensor negated whole."""
    total, chunk = 0, 1 << (16 if bits.is_cpu else 24)  # what a CPU's cache holds
    for start, part in zip(range(0, bits.numel(), chunk), bits.split(chunk)):
        w = (torch.arange(len(part), device=bits.device) + start + 1) * -7046029254386353131
        w = (w ^ (w >> 30)) * -4658895280553007687
        w = (w ^ (w >> 27)) * -7723592293110705685
        total = total + (part * (w ^ (w >> 31))).sum()
    return total


def digest(hashes: torch.Tensor, extra: str = "") -> bytes:
    return hashlib.blake2b(hashes.cpu().numpy().tobytes() + extra.encode(), digest_size=12).digest()


def replica_state(model, optimizer, stage: str) -> list:
    """(name, tensor) every replica holds alike at `stage`: "step" the parameters; "epoch" the
    buffers too (DDP broadcasts them before each forward); "save" the optimizer's state too."""
    if isinstance(model, list):
        return list(zip(LENET_KEYS, model))
    named = [*model.named_parameters(), *(model.named_buffers() if stage == "epoch" else ())]
    if stage != "step" and optimizer is not None:
        named += [(f"optimizer state {key} of parameter {index}", value)
                  for index, state in optimizer.state_dict()["state"].items()
                  for key, value in state.items() if torch.is_tensor(value)]
    return named


def replicas_digest(named: list, worker: Worker) -> tuple:
    """This rank's tensor hashes, and its digest in its two slots of 2 x world (zeros elsewhere)."""
    hashes = tensor_hashes(named, worker.device)
    folded = digest(hashes)  # as two 48-bit integers: exact in the agreement's float64 all-reduce
    slots = torch.zeros(worker.world, 2, dtype=torch.float64, device=worker.device)
    slots[worker.rank] = torch.tensor([int.from_bytes(folded[i:i + 6], "big") for i in (0, 6)])
    return hashes, slots.ravel()


def compare_replicas(named: list, hashes: torch.Tensor, slots: list, worker: Worker, where: str,
                     then: str = "nothing is saved from them, and the same command resumes from "
                                 "the last checkpoint") -> None:
    """RunFailed for ranks whose digest is not the most common, naming the first that differs."""
    prints = [tuple(slots[i:i + 2]) for i in range(0, len(slots), 2)]
    if len(set(prints)) == 1:
        return
    common = max(prints, key=lambda p: (prints.count(p), p == prints[0]))
    odd, reference = [r for r, p in enumerate(prints) if p != common], prints.index(common)
    rows = all_reduce_sum(torch.stack([hashes * (r == worker.rank) for r in range(worker.world)]))
    first = next((name for (name, _), mine, theirs in zip(named, rows[odd[0]], rows[reference])
                  if not torch.equal(mine, theirs)), "a tensor")
    ranks = f"rank{'s' * (len(odd) > 1)} {', '.join(map(str, odd))}"
    who = (f"{ranks} of {worker.world} hold other values than rank {reference}"
           if 2 * prints.count(common) > len(prints) else f"rank {reference} and {ranks} differ, "
           f"and no majority of the {worker.world} ranks tells which drifted")
    raise RunFailed(f"the replicas differ {where}: {who}, first in {first}; {then}")


CERTIFIED = ("model", "optimizer", "history", "data position")


def certificate(state: dict) -> dict:
    """A digest of each part of a checkpoint a resume restores (CERTIFIED); the data position: the
    epoch, --seed, a mid-epoch save's step, samples and loss sums (the random streams follow)."""
    def flat(tree, prefix: str = "") -> list:
        items = dict(enumerate(tree)) if isinstance(tree, (list, tuple)) else tree
        if not isinstance(items, dict):
            return [(prefix, tree)]
        return [item for key, value in items.items() for item in flat(value, f"{prefix}/{key}")]

    def of(tree) -> str:
        tensors, values = [], []
        for key, value in sorted(flat(tree), key=lambda item: item[0]):
            (tensors if torch.is_tensor(value) else values).append((key, value))
        return digest(tensor_hashes(tensors, torch.device("cpu")), repr(values)).hex()
    position = {"epoch": state["epoch"], "seed": state["config"].get("seed", 0),
                **(state.get("partial") or {})}
    return dict(zip(CERTIFIED, map(of, (state["model"], state["optimizer"], state["history"],
                                        position))))


def uncertified(state: dict, now: Optional[dict] = None) -> Optional[list]:
    """The parts of a checkpoint not as its certificate says (`now`: the certificate of what was
    restored from it); None if it carries no certificate (or an older ray_dp's)."""
    saved = state.get("certificate")
    if not (isinstance(saved, dict) and set(saved) == set(CERTIFIED)):
        return None
    now = now or certificate({"optimizer": {}, "history": [], **state})
    return [part for part in CERTIFIED if saved[part] != now[part]]


class ForwardClock:
    """This rank's seconds in its model's forward passes (its steps wait for the slowest rank)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.cuda, self.spans = device.type == "cuda", []
        model.register_forward_pre_hook(lambda *_: self.spans.append([self.now()]))
        model.register_forward_hook(lambda *_: self.spans[-1].append(self.now()))

    def now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take(self) -> float:
        spans, self.spans = self.spans, []
        return sum(span[-1] - span[0] if not self.cuda else span[0].elapsed_time(span[-1]) / 1e3
                   for span in spans if len(span) > 1)


def straggler_note(window: list, worker_ranks: int) -> Optional[str]:
    """A rank slower than the other ranks' median by STRAGGLER at each agreement of the window."""
    def others(times: list, rank: int) -> float:
        return statistics.median(times[:rank] + times[rank + 1:])
    means = [statistics.mean(times[r] for times in window) for r in range(worker_ranks)]
    slow = [r for r in range(worker_ranks)
            if all(times[r] > STRAGGLER * others(times, r) > 0 for times in window)]
    if not slow:
        return None
    return (f"rank {slow[0]} is a straggler: its forward passes take {means[slow[0]]:.3g} s a "
            f"step, the other ranks' median {others(means, slow[0]):.3g} s (a slower device, or "
            f"one shared with other work): every step waits for it")


class Check:
    """A health check in the ranks' agreement: slots() its named slots in each one, read() them
    back by name: (a stop's one-line error, a note). The other methods' default: nothing."""

    name, count = "check", 0

    def stepped(self, done: int, steps: int, losses: EpochLoss) -> None:
        return None

    def due(self, steps_done: int) -> bool:
        return False

    def at_save(self, stage: str, where: str) -> Optional[str]:
        return None


class ReplicaCheck(Check):
    """--check-replicas: every rank's digest of its replicas in the agreement's slots, compared
    (auto: as often as costs CHECK_SHARE of training); and a straggler, by its forward seconds."""

    name = "replicas"

    def __init__(self, cfg: Config, worker: Worker, model, optimizer):
        self.cfg, self.worker, self.optimizer = cfg, worker, optimizer
        self.model = unwrap(model) if isinstance(model, nn.Module) else model
        self.forward = (ForwardClock(self.model, worker.device)
                        if isinstance(self.model, nn.Module) and not cfg.compile else None)
        every = {"off": "0", "auto": "1"}.get(cfg.check_replicas, cfg.check_replicas)
        self.every = int(every) if worker.world > 1 else 0
        self.seconds, self.last, self.slow, self.noted, self.named = 0.0, 0, [], False, None

    def due(self, steps_done: int) -> bool:
        return bool(self.every) and steps_done - self.last >= self.every

    def slots(self, checking: bool, step_seconds: float, agreement: "Agreement") -> dict:
        steps = max(agreement.steps_done - agreement.agreed_steps, 1)
        forward = torch.zeros(self.worker.world, dtype=torch.float64, device=self.worker.device)
        forward[self.worker.rank] = self.forward.take() / steps if self.forward else 0.0
        interval = (max(math.ceil(self.seconds / (CHECK_SHARE * step_seconds)), 1)
                    if self.cfg.check_replicas == "auto" else self.every)
        self.named = replica_state(self.model, self.optimizer, "step") if checking else None
        self.hashes, digests = replicas_digest(self.named, self.worker) if checking else (None, [])
        return {"forward seconds": forward, "digests": digests,
                "check interval": [interval if self.worker.is_main else 0]}

    def read(self, totals: dict, where: str, tic: float, agreement: "Agreement") -> tuple:
        self.every = int(totals["check interval"][0]) if self.every else 0
        forward, note = totals["forward seconds"], None
        if self.forward and not self.noted and self.worker.world > 1 and all(forward):
            self.slow = [*self.slow[-4:], forward]
            note = len(self.slow) == 5 and straggler_note(self.slow, self.worker.world)
            self.noted = bool(note)
        if self.named is None:
            return None, note
        self.last, self.seconds = agreement.steps_done, time.perf_counter() - tic  # auto's cost
        return self.compared(self.named, self.hashes, totals["digests"], where), note

    def at_save(self, stage: str, where: str) -> Optional[str]:
        """At a save, before rank 0 writes: what replica_state holds alike at `stage`."""
        if not self.every:
            return None
        named = replica_state(self.model, self.optimizer, stage)
        hashes, digests = replicas_digest(named, self.worker)
        return self.compared(named, hashes, all_reduce_sum(digests).tolist(), where)

    def compared(self, named: list, hashes: torch.Tensor, digests: list, where: str):
        try:
            compare_replicas(named, hashes, digests, self.worker, where)
        except RunFailed as exc:
            return str(exc)
        self.count += 1
        return None


class NonFiniteLoss(Check):
    """A loss that is not finite (NaN, inf) stops the run at the next agreement on every rank,
    naming where it first appeared, and weights that are not finite at a save: nothing is saved
    from them on (Lightning's terminate-on-NaN)."""

    name = "loss"

    def __init__(self, cfg: Config, worker: Worker, model, optimizer):
        self.worker, self.steps = worker, 1
        self.params = (list(unwrap(model).named_parameters()) if isinstance(model, nn.Module)
                       else [(f"params[{i}]", p) for i, p in enumerate(model or [])])
        self.first = torch.zeros((), dtype=torch.float64, device=worker.device)

    def stepped(self, done: int, steps: int, losses: EpochLoss) -> None:
        """The step's losses, looked at on the device: no wait for it here."""
        self.steps, window = steps, losses.window[0]
        self.first = torch.where((self.first > 0) | window.isfinite(), self.first, float(done))

    def slots(self, checking: bool, step_seconds: float, agreement: "Agreement") -> dict:
        firsts = torch.zeros(self.worker.world, dtype=torch.float64, device=self.worker.device)
        firsts[self.worker.rank] = self.first
        return {"first non-finite loss": firsts}

    def read(self, totals: dict, where: str, tic: float, agreement: "Agreement") -> tuple:
        done, rank = min(((int(done), rank) for rank, done in
                          enumerate(totals["first non-finite loss"]) if done), default=(0, 0))
        if not done:
            return None, None
        return (f"the loss is not finite from step {(done - 1) % self.steps + 1} of epoch "
                f"{(done - 1) // self.steps + 1} (the run's step {done}) on rank {rank}: nothing "
                f"is saved from it, and the same command resumes from the last checkpoint"), None

    def at_save(self, stage: str, where: str) -> Optional[str]:
        """Weights that are not finite (a gradient that was, with a finite loss) are not saved:
        each rank's first such tensor (its index + 1) in its own slot; the lowest rank's named."""
        finite = torch.stack([p.detach().isfinite().all() for _, p in self.params] or [
            torch.tensor(True, device=self.worker.device)])
        firsts = torch.zeros(self.worker.world, dtype=torch.float64, device=self.worker.device)
        firsts[self.worker.rank] = (~finite).double().argmax() + 1 if not finite.all() else 0
        found = [(rank, int(i)) for rank, i in enumerate(all_reduce_sum(firsts).tolist()) if i]
        if not found:
            return None
        rank, index = found[0]
        return (f"the weights are not finite {where} on rank {rank}, first "
                f"{self.params[index - 1][0]}: nothing is saved from them, and the same command "
                f"resumes from the last checkpoint")


HEALTH_CHECKS = (NonFiniteLoss, ReplicaCheck)  # each one's slots ride on every agreement


LEDGER = ("driver", "cluster", "data", "model", "restores", "training steps", "waits for data",
          "evaluation", "saves", "preemptions", "failures", "other")


class Ledger:
    """Rank 0's seconds by what they went to, each span charged from the last mark to now."""

    def __init__(self, **seconds):
        self.seconds, self.mark = dict(seconds), time.perf_counter()

    def charge(self, what: str, moved: float = 0.0) -> float:
        now = time.perf_counter()
        spent, self.mark = now - self.mark, now
        self.seconds[what] = self.seconds.get(what, 0.0) + spent + moved
        return spent


def run_ledger(clock: dict, attempts: list, failed: int, ended: float,
               before: Optional[dict] = None) -> dict:
    """The run's wall clock in LEDGER's categories, over every attempt and earlier command."""
    begun, fitted = clock.get("started") or clock["imported"], clock.get("fitted", ended)
    seconds = dict.fromkeys(LEDGER, 0.0)
    seconds["driver"] = clock["checked"] - begun + ended - fitted
    if attempts:
        seconds["cluster"] = attempts[0]["began"] - clock["checked"]
        seconds["cluster"] += fitted - attempts[-1].get("ended", fitted)
    for attempt, after in zip(attempts, attempts[1:] + [None]):
        for what, spent in attempt["seconds"].items():
            seconds[what] += spent
        if after is not None:  # it failed: from its last word to the next's first step
            lost = "preemptions" if attempt.get("preempted") else "failures"
            seconds["training steps"] -= attempt["since_save"]
            seconds[lost] += attempt["since_save"] + after["began"] - attempt["at"]
            for what in ("data", "model", "restores"):  # the next's set-up
                seconds[lost] += after["seconds"].get(what, 0.0)
                seconds[what] -= after["seconds"].get(what, 0.0)
    wall, before = ended - begun, before or {}
    seconds["other"] = wall - sum(seconds.values())
    totals = {what: seconds[what] + before.get(what, 0.0) for what in LEDGER}
    this, wall = wall, wall + before.get("wall", 0.0)
    return {**{what: round(spent, 3) for what, spent in totals.items()}, "wall": round(wall, 3),
            "this_command": round(this, 3), "commands": before.get("commands", bool(before)) + 1,
            "goodput": round(totals["training steps"] / wall, 4) if wall else 0.0,
            "failed": failed + before.get("failed", 0),
            "saved": sum(attempt.get("saves", 0) for attempt in attempts) + before.get("saved", 0)}


def format_ledger(ledger: dict) -> str:
    parts = ", ".join(f"{what} {ledger[what]:.1f} s" for what in LEDGER[2:]
                      if what != "training steps" and ledger[what] >= 0.05)
    over = (f" (the run over its {ledger['commands']} commands; this one "
            f"{ledger['this_command']:.1f} s)" if ledger.get("commands", 1) > 1 else "")
    return (f"time{over}: {ledger['wall']:.1f} s, {ledger['training steps']:.1f} s of it training "
            f"steps (goodput {ledger['goodput']:.0%}); driver {ledger['driver']:.1f} s, cluster "
            f"{ledger['cluster']:.1f} s" + (f", {parts}" if parts else ""))


def checkpoint_advice(cfg: Config, summary: dict) -> Optional[str]:
    """Young/Daly: checkpoints every sqrt(2 x save cost x time between failures) lose least."""
    ledger = summary["ledger"]
    if not (ledger["failed"] and ledger["saved"] and ledger["saves"]):
        return None
    cost, between = ledger["saves"] / ledger["saved"], ledger["wall"] / ledger["failed"]
    best, epoch = math.sqrt(2 * cost * between), summary["sec_per_epoch"]
    per_step = epoch * cfg.batch_size / summary["final"]["train_samples"]
    steps, seconds = checkpoint_interval(cfg.checkpoint_every)
    now = min(steps * per_step if steps else seconds or epoch, epoch)
    if 0.5 <= now / best <= 2:
        return None

    def span(s: float) -> str:
        return f"{s:.2g} s" if s < 60 else f"{s / 60:.1f}".removesuffix(".0") + " min"
    flag = (max(round(best / per_step), 1) if best < 60 else f"{min(best / 60, 999999):.1f}m")
    return (f"saves cost {cost:.2g} s and a failure came every {span(between)}: checkpoints "
            f"every {span(best)} would lose the least (Young/Daly), not every {span(now)}: "
            f"--checkpoint-every {flag}")


def record_ledger(cfg: Config, out: Optional[dict], board) -> dict:
    """This command's ledger plus its run's earlier commands' (ledger.json, written back)."""
    failed = recovery_summary(os.path.join(local_run_dir(cfg), "recovery.json")).get("failures", 0)
    attempts = ask_board(board, "ledgers") or []
    attempts = attempts if out is None else [*attempts[:-1], out["ledger"]]
    path, before = os.path.join(cfg.run_dir, "ledger.json"), None
    with contextlib.suppress(OSError, ValueError):
        before = json.loads(read_stored(path))
    ledger = run_ledger(CLOCK, attempts, failed, time.time(), before)
    with contextlib.suppress(OSError):
        write_json(path, ledger)
    return ledger


def write_ledger_events(cfg: Config, ledger: dict, epoch: int) -> None:
    """The ledger's scalars in an events file whose name sorts after rank 0's: TensorBoard reads a
    run's files in name order (second, host, pid) and never reads one that sorts before its last."""
    from torch.utils.tensorboard import SummaryWriter
    names = [p.name.split(".") for p in Path(cfg.logdir, cfg.name).glob("events.out.tfevents.*")]
    newest = max((int(name[3]) for name in names if name[3].isdigit()), default=0)
    while 0 <= newest - int(time.time()) < 2:  # rank 0's last second (or its clock 1 s ahead)
        time.sleep(0.1)
    with SummaryWriter(os.path.join(cfg.logdir, cfg.name)) as writer:
        for what in LEDGER:
            writer.add_scalar(f"ledger/{what.replace(' ', '_')}_seconds", ledger[what], epoch)
        writer.add_scalar("ledger/goodput", ledger["goodput"], epoch)


class Watchdog:
    """A thread of each rank's: stuck for --timeout / 2 s, or asked, it writes <run dir>/hang/."""

    def __init__(self, cfg: Config, worker: Worker, board=None):
        self.cfg, self.worker, self.board, self.asked, self.answered = cfg, worker, board, False, 0
        self.alive, self.where, self.dumped = time.monotonic(), "starting", False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.watching, daemon=True, name="ray-dp watchdog")

    def __enter__(self) -> "Watchdog":
        if threading.current_thread() is threading.main_thread():  # torchrun's: SIGUSR1 to it
            self.before = signal.signal(signal.SIGUSR1, lambda *_: setattr(self, "asked", True))
        self.thread.start()
        return self

    def __exit__(self, *error) -> None:
        self.done.set()
        self.thread.join()
        if hasattr(self, "before"):
            signal.signal(signal.SIGUSR1, self.before)

    def progress(self, where: str) -> None:
        self.alive, self.where, self.dumped = time.monotonic(), where, False

    def watching(self) -> None:
        while not self.done.wait(2.0):
            if not self.dumped and time.monotonic() - self.alive > self.cfg.timeout / 2:
                self.dump(f"no progress for {self.cfg.timeout / 2:g} s (--timeout / 2)")
            asks = ask_board(self.board, "dumps_asked", timeout=5) or 0
            if self.asked or asks > self.answered:
                self.asked, self.answered = False, max(asks, self.answered)
                self.dump("asked (SIGUSR1)")

    def dump(self, why: str) -> None:
        self.dumped = True
        import faulthandler
        with tempfile.TemporaryFile("w+") as stacks:
            faulthandler.dump_traceback(stacks, all_threads=True)
            stacks.seek(0)
            text = (f"rank {self.worker.rank} of {self.worker.world} on {node_name()}, process "
                    f"{os.getpid()}: {why}; its last progress: {self.where}\n\n{stacks.read()}")
        stem = f"{self.cfg.run_dir}/hang/rank{self.worker.rank}"
        with contextlib.suppress(OSError):
            write_stored(f"{stem}.txt", text.encode())
            c10d = importlib.import_module("torch._C._distributed_c10d")  # its flight recorder
            with contextlib.suppress(AttributeError, RuntimeError):  # (TORCH_FR_BUFFER_SIZE)
                write_stored(f"{stem}.json", c10d._dump_fr_trace_json(True, False))


COLLECTIVE_TIMEOUT = re.compile(r"(?i)timed out|timing out")  # gloo's; NCCL's watchdog's


def hang_report(cfg: Config, error: BaseException) -> Optional[str]:
    """For a collective that timed out: the ranks that did not come to it, as the records written
    when the ranks made no progress say (not those a SIGUSR1 asked for)."""
    folder, reached = f"{cfg.run_dir}/hang", {}
    for rank in range(cfg.workers) if COLLECTIVE_TIMEOUT.search(str(error)) else ():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            if ": no progress for " not in read_stored(f"{folder}/rank{rank}.txt").decode()[:500]:
                continue
            status = json.loads(read_stored(f"{folder}/rank{rank}.json"))["pg_status"]
            reached[rank] = int(status["0"]["last_enqueued_collective"])
    if len(set(reached.values())) < 2:
        return None
    behind = [rank for rank, count in reached.items() if count == min(reached.values())]
    return (f"rank {', '.join(map(str, behind))} did not come to collective "
            f"{min(reached.values()) + 1}, which the other ranks waited in for --timeout "
            f"{cfg.timeout:g} s: its stacks are in {folder}/rank{behind[0]}.txt (every rank's "
            f"beside it, and torch's flight recorder in rank<N>.json)")


# ==================================================================================================
# Console and monitoring: the header, rank 0's lines through the driver's Board, TensorBoard.
# ==================================================================================================


class Board:
    """An actor on the driver's node: lines to print, rank 0's beats, the driver's stop."""

    def __init__(self):
        self.lines, self.said, self.bar, self.attempts, self.dumps = [], set(), None, [], 0
        self.since, self.redone, self.stop, self.heard_at = 0, [], False, 0.0  # redone: per attempt

    def say(self, line: str) -> None:
        if not (line.startswith("ray-dp: note:") and line in self.said):  # notes once, restarts too
            self.said.add(line)
            self.lines.append(line)

    def show(self, bar: Optional[tuple]) -> None:
        self.bar = bar

    def take(self) -> tuple:
        lines, self.lines = self.lines, []
        return lines, self.bar

    def stepped(self, since: int, snapshot: dict) -> None:
        self.since, self.attempts[-1] = since, snapshot  # rank 0 said restarted() first

    def beat(self) -> bool:
        self.heard_at = time.time()
        return self.stop

    def restarted(self) -> bool:
        self.redone, self.since = [*self.redone, self.since], 0
        self.attempts.append(None)
        return True

    def ledgers(self) -> list:
        return [attempt for attempt in self.attempts if attempt]

    def ask_dump(self) -> None:
        self.dumps += 1

    def dumps_asked(self) -> int:
        return self.dumps

    def ask_stop(self) -> bool:
        """The driver's SIGTERM; whether rank 0 will hear of it (it beat in the last 10 s)."""
        self.stop = True
        return time.time() - self.heard_at < 10.0

    def steps_redone(self) -> int:
        return sum(self.redone)

    def redone_at_restarts(self) -> list:
        return self.redone[1:]


def new_board():
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0, scheduling_strategy=here)(Board).remote()


def ask_board(board, method: str, timeout: float = 30):
    """The Board's answer to `method`; None without a Board or when it does not answer."""
    if board is not None:
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            return ray.get(getattr(board, method).remote(), timeout=timeout)
    return None


class Console:
    """Rank 0's lines and progress bar: to the driver's Board under Ray, here under torchrun."""

    def __init__(self, options: LoopOptions, worker: Worker):
        self.board, self.main, self.shown, self.bar = options.board, worker.is_main, 0.0, Bar()
        self.progress_wanted = options.progress and worker.is_main

    def say(self, line: str) -> None:
        if self.main:
            self.board.say.remote(line) if self.board is not None else self.bar.write(line)

    def progress(self, state: Optional[tuple]) -> None:
        """(epoch, steps done, steps, loss, samples/s, epochs), at most twice a second."""
        if not self.progress_wanted or (state and time.monotonic() - self.shown < 0.5):
            return
        self.shown = time.monotonic()
        self.board.show.remote(state) if self.board is not None else self.bar.show(state)

    def flush(self) -> None:
        if self.main:
            ask_board(self.board, "beat")


class Progress(contextlib.ExitStack):
    """Rank 0's lines and bar, the ledger's clock; held: SIGTERM's stop, the beat, the watchdog."""

    def __init__(self, cfg: Config, worker: Worker, options: LoopOptions):
        super().__init__()
        self.cfg, self.worker, self.console = cfg, worker, Console(options, worker)
        board = options.board if worker.is_main and ask_board(options.board, "restarted") else None
        self.link, self.stop = DriverLink(board) if board is not None else None, graceful_stop()
        self.watchdog = Watchdog(cfg, worker, options.board)
        self.ledger, self.lost, self.saved_count, self.tic, self.first_step = Ledger(), 0.0, 0, 0, 0
        self.preempted = False  # a reclaim's notice heard: what this attempt loses is its

    def __enter__(self) -> "Progress":
        for context in filter(None, (self.stop, self.link, self.watchdog)):
            self.enter_context(context)
        return self

    def say(self, line: str) -> None:
        self.console.say(line)

    def started(self, restored: float) -> None:
        """The model built (and restored: `restored` seconds): the ledger's set-up charged."""
        marks = self.worker.marks
        marks["model"] = time.time()
        self.ledger = Ledger(data=marks["data"] - marks["loop"] if "data" in marks else 0.0,
                             model=marks["model"] - marks.get("data", marks["model"]) - restored,
                             restores=restored)

    def start_epoch(self, first_step: int) -> None:
        self.tic, self.first_step = time.perf_counter(), first_step
        self.ledger.charge("training steps")

    def stepped(self, where: str) -> None:
        self.worker.marks.setdefault("first_step", time.time())
        self.lost += self.ledger.charge("training steps")
        self.watchdog.progress(where)

    def shown(self, state: Optional[tuple]) -> None:
        """After a step (its agreement charged as training): the bar; None: the bar closed."""
        if state is None:
            return self.console.progress(None)
        self.lost += self.ledger.charge("training steps")
        epoch, step, steps, losses, epochs = state
        rate = (step - self.first_step) * self.cfg.batch_size / (time.perf_counter() - self.tic)
        loss = losses.logged[-1][1] if losses.logged else None
        self.console.progress((epoch, step, steps, loss, rate, epochs))

    def votes(self, epoch_end: bool, since_save: int) -> set:
        """This rank's stop votes (SIGTERM's; the driver's, by rank 0's heartbeat), and rank 0's
        steps since its last save for the driver's ledger."""
        mine = {SIGTERM_VOTE} if self.stop is not None and self.stop.asked else set()
        if self.link is not None:
            if epoch_end:
                self.link.beat(timeout=10)
            mine |= {DRIVER_VOTE} if self.link.asked else set()
            self.link.board.stepped.remote(since_save, self.snapshot())
        return mine

    def saved(self) -> None:
        self.ledger.charge("saves")
        self.saved_count, self.lost = self.saved_count + 1, 0.0
        if self.link is not None:
            self.link.board.stepped.remote(0, self.snapshot())

    def ended(self, metrics: dict) -> None:
        """An epoch's training ended: its evaluation and waits for data charged; the bar closed."""
        self.ledger.charge("evaluation")
        self.watchdog.progress(f"at the end of epoch {metrics['epoch']}")
        self.ledger.seconds["training steps"] -= metrics["data_seconds"]
        self.ledger.charge("waits for data", metrics["data_seconds"])
        self.console.progress(None)

    def snapshot(self) -> dict:
        """What the driver's ledger takes from this attempt (since_save: a failure's loss)."""
        marks = self.worker.marks
        return {"seconds": dict(self.ledger.seconds), "began": marks.get("loop", 0.0),
                "first_step": marks.get("first_step"), "at": time.time(),
                "since_save": self.lost, "saves": self.saved_count, "preempted": self.preempted}


class Bar:
    def __init__(self):
        self.tqdm, self.epoch = None, None

    def show(self, state: Optional[tuple]) -> None:
        if state is None:
            return self.close()
        epoch, done, steps, loss, rate, epochs = state
        if self.tqdm is None or epoch != self.epoch:
            self.close()
            self.tqdm, self.epoch = tqdm(total=steps, leave=False), epoch
        shown = f", loss {loss:.4f}" if loss is not None else ""
        self.tqdm.n = done
        self.tqdm.set_description(f"epoch {epoch + 1}/{epochs}{shown}, {rate:.0f} samples/s")

    def write(self, line: str) -> None:
        tqdm.write(line) if self.tqdm is not None else print(line, flush=True)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
        self.tqdm = None


@contextlib.contextmanager
def relayed(board):
    """A thread of the driver's that prints what the Board holds, twice a second: as often as
    rank 0 sends the bar (Console.progress)."""
    bar, done = Bar(), threading.Event()

    def relay() -> None:
        stopping = False
        while not stopping:  # a last take begun once the run ended
            stopping = done.wait(0.5)
            if (taken := ask_board(board, "take", timeout=2 if stopping else 10)):
                for line in taken[0]:
                    bar.write(line)
                bar.show(taken[1])
    thread = threading.Thread(target=relay, daemon=True, name="ray-dp console")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
        bar.close()


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{('es' if noun.endswith('s') else 's') * (count != 1)}"


def describe(cfg: Config, data: DataInfo, torchrun: bool = False) -> str:
    """The run's header: what trains on what, and every switch that changes the maths or speed."""
    kind = "GPU" if cfg.gpu else "CPU"
    workers = (f"1 worker driving {cfg.workers} GPUs (nn.DataParallel)" if cfg.mode == "dp" else
               f"{cfg.min_workers}-{cfg.workers} {kind} workers (elastic)" if cfg.min_workers else
               plural(cfg.workers, f"{kind} worker"))
    extra = f", {cfg.allreduce} all-reduce" if cfg.mode == "scratch" else ""
    own = "; your optimizer's own where it sets one" if is_code(cfg.optimizer) else ""
    dropped = data.sizes[0] % cfg.batch_size  # check_batch_split: every rank's share is whole
    left_out = (f" ({plural(dropped, 'train sample')} left out per epoch: whole global batches "
                f"only)" if dropped else "")
    plain = cfg.mode == "scratch" or (cfg.optimizer == "sgd" and not cfg.momentum)
    loaders = cfg.loader_workers if cfg.loader_workers is not None else 2 * data.per_sample
    switches = [(True, "plain SGD" if plain else "AdamW" if cfg.optimizer == "adamw"
                 else f"SGD momentum {cfg.momentum}" if cfg.optimizer == "sgd"
                 else f"optimizer {cfg.optimizer.rpartition(':')[2]}"),
                (cfg.weight_decay, f"weight decay {cfg.weight_decay}"),
                (cfg.warmup_epochs, plural(cfg.warmup_epochs, "warm-up epoch")),
                (cfg.clip_grad_norm, f"gradient norm clipped at {cfg.clip_grad_norm}"),
                (cfg.label_smoothing, f"label smoothing {cfg.label_smoothing}"),
                (True, f"{plural(loaders, 'loader process')} per worker" if loaders
                 else "batches indexed in memory"),
                (cfg.accum_steps > 1,
                 f"gradients all-reduced every {cfg.accum_steps} micro-batches (no_sync)"),
                (cfg.sync_bn, "SyncBatchNorm" + ("" if cfg.gpu else " (ray_dp's, for gloo)")),
                (cfg.amp, f"{cfg.amp} autocast" + " with a GradScaler" * (cfg.amp == "fp16")),
                (cfg.compile, "torch.compile"),
                (True, plural(cfg.threads, "thread") + " per worker")]
    return (f"ray-dp{' (torchrun)' if torchrun else ''}: {cfg.mode} {cfg.model} on {cfg.dataset} "
            f"({data.sizes[0]} train{''.join(f' + {n} val' for n in data.sizes[2:])} / "
            f"{data.sizes[1]} test{images(cfg, data)}), {workers}{extra}, "
            f"global batch {cfg.batch_size} = {cfg.micro_batch} per worker x "
            f"{plural(cfg.processes, 'worker')} x {cfg.accum_steps} accum{left_out}, lr {cfg.lr} "
            f"({cfg.lr_schedule.rpartition(':')[2]}{own}), "
            f"{', '.join(text for on, text in switches if on)}, "
            f"{plural(cfg.epochs, 'epoch')}, run dir {cfg.run_dir}")


def images(cfg: Config, data: DataInfo) -> str:
    size = data.sample_shape[-1]
    kind = (plural(len(data.classes), "class") if data.classes
            else f"a regression of {plural(data.outputs, 'value')} (loss alone)")
    if not is_image(data.sample_shape):
        return f", inputs of shape {tuple(data.sample_shape)}, {kind}"
    if not data.per_sample:
        resized = f", images resized to {size} x {size} px" if cfg.image_size else ""
        return resized + ("" if data.classes else f", {kind}")
    mean, std = cfg.normalize or ([], [])
    folder = (f", {'' if cfg.augment else 'not '}augmented, normalised with mean {mean} std {std}"
              if data_source(cfg.dataset).image_files else "")
    return f", {kind}, images {size} x {size} px{folder}"


def format_epoch(m: dict, epochs: int) -> str:
    resumed = f" (from step {m['resumed_at_step'] + 1})" if m.get("resumed_at_step") else ""
    scores = "".join(f", {split} {what} {m[f'{split}_{what}']:.4f}" for split in ("val", "test")
                     for what in ("loss", "acc") if f"{split}_{what}" in m)
    skipped = f", {plural(m.get('skipped_steps', 0), 'step')} skipped (fp16 overflow)"
    return (f"epoch {m['epoch']}/{epochs}: train loss {m['train_loss']:.4f}{scores}, "
            f"{m['epoch_seconds']:.1f} s{resumed}, {m['samples_per_second']:.0f} samples/s"
            f"{skipped * bool(m.get('skipped_steps'))}")


def format_summary(summary: dict, launcher: str = "") -> str:
    """`test acc: 0.97, 0.3 sec/epoch on 2 workers (cpu)`, the replica checks, what it survived."""
    final, checks = summary["final"], summary.get("replica_checks")
    score = (f"test acc: {final['test_acc']:.2f}" if "test_acc" in final
             else f"test loss: {final['test_loss']:.4g}")
    line = (f"{score}, {summary['sec_per_epoch']:.1f} sec/epoch on "
            f"{plural(summary['world_size'], 'worker')} ({summary['device']}{launcher})"
            + (f", replicas alike at all {plural(checks, 'check')}" if checks else ""))
    if (recovery := summary.get("recovery") or {}).get("failures"):
        line += (f"; survived {plural(recovery['failures'], 'failure')}, "
                 f"{plural(recovery['restarts'], 'restart')} (workers "
                 f"{' -> '.join(str(size) for _, size in recovery['world_sizes'])}), epochs "
                 f"redone: {', '.join(map(str, recovery['epochs_redone'])) or 'none'}")
    if preempted := recovery.get("preemptions"):
        redone = sum(event.get("steps_redone", 0) for event in preempted)
        line += (f"; survived {plural(len(preempted), 'preemption')}, "
                 f"{plural(redone, 'step')} redone")
    return line


def near_chance(cfg: Config, summary: dict) -> Optional[str]:
    """A run that ended where guessing would: what most likely happened, and what to try."""
    final, acc = summary["final"], summary["final"].get("test_acc", 1.0)
    if acc > 1.5 / NUM_CLASSES or cfg.dataset == "synthetic" or is_code(cfg.dataset):
        return None
    steps = sum(m["train_samples"] for m in summary["epochs"]) // cfg.batch_size
    head = f"test acc {acc:.2f} is near chance (1/{NUM_CLASSES} = {1 / NUM_CLASSES:.2f})"
    if not math.isfinite(final["train_loss"]) or final["train_loss"] > 3 * math.log(NUM_CLASSES):
        return (f"{head}: the loss grew to {final['train_loss']:.3g}, so lr {cfg.lr} is too "
                f"large; try --lr {cfg.lr / 5:g}")
    if cfg.mode == "scratch":
        constant = (" or a constant lr of 0.2 to 0.3 (--lr 0.2 --lr-schedule constant)"
                    if cfg.lr_schedule != "constant" or cfg.lr < 0.2 else "")
        return (f"{head}: the lesson's init (randn * 0.01) sits at chance for hundreds of steps "
                f"and this run took {steps} at lr {cfg.lr} ({cfg.lr_schedule}); give it more "
                f"steps (more --epochs, or a smaller --batch-size){constant}")
    return (f"{head} after {steps} steps at lr {cfg.lr} ({cfg.lr_schedule}): try more --epochs "
            f"or another --lr (train loss {final['train_loss']:.3f}; ln 10 = 2.303 is the loss "
            f"of a uniform guess)")


EPOCH_SCALARS = {"train/loss": "train_loss", "train/lr": "lr", "test/loss": "test_loss",
                 "test/acc": "test_acc", "val/loss": "val_loss", "val/acc": "val_acc",
                 "time/epoch_seconds": "epoch_seconds", "time/data_seconds": "data_seconds",
                 "time/samples_per_second": "samples_per_second",
                 "comm/allreduce_seconds_per_step": "allreduce_seconds_per_step",
                 "comm/allreduce_busbw_gbps": "allreduce_busbw_gbps"}


class TensorBoardWriter(ray.train.UserCallback):
    """An epoch's metrics as TensorBoard events in LOGDIR/<name>/, written on the driver's node."""

    def __init__(self, cfg: Config):
        self.cfg, self.writer = cfg, None

    def after_report(self, run_context, metrics: list, checkpoint) -> None:
        if "step" not in metrics[0]:  # a mid-epoch checkpoint's report has no epoch's metrics
            self.write(metrics[0])

    def write(self, m: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter
        if self.writer is None:
            self.writer = SummaryWriter(os.path.join(self.cfg.logdir, self.cfg.name))
            config = json.dumps(asdict(self.cfg), indent=2).replace("\n", "\n    ")
            self.writer.add_text("config", "    " + config)
        for step, loss in m["step_log"]:
            self.writer.add_scalar("train/loss_step", loss, step)
        for tag, key in EPOCH_SCALARS.items():
            if key in m:
                self.writer.add_scalar(tag, m[key], m["epoch"])
        if m["epoch"] == self.cfg.epochs:
            hparams = {k: v for k, v in asdict(self.cfg).items()
                       if isinstance(v, (int, float, str, bool))}
            final = {f"hparam/{key}": m[key] for key in ("test_acc", "test_loss", "train_loss")
                     if key in m}
            self.writer.add_hparams(hparams, final, run_name=".")
        self.writer.flush()


def local_run_dir(cfg: Config) -> str:
    """Where the driver's node keeps a run's logs: the run directory, for a URI LOGDIR/<name>."""
    return os.path.join(cfg.logdir, cfg.name) if is_uri(cfg.run_dir) else cfg.run_dir


# ==================================================================================================
# Inference (--eval-only): a saved model scored exactly on N workers, per class, each prediction.
# ==================================================================================================


def eval_config(cfg: Config, typed: set, own: set = frozenset()) -> tuple[Config, dict]:
    """--eval-only's config (what the checkpoint fixes comes from it; a typed training flag that
    contradicts it is refused) and checkpoint. `own`: fields the command sets (predict's inputs)."""
    checkpoint = load_checkpoint(path := checkpoint_file(cfg.eval_only))
    if "model" in (uncertified(checkpoint) or []):
        raise ConfigError(f"--eval-only {path}: its weights are not those its certificate says "
                          f"(the file was altered since it was saved)")
    trained = stored_config(checkpoint)
    if refused := [as_flag(name, True) for name in CONFIG_FIELDS if name in typed & EVAL_REFUSES]:
        are = "is a training flag and has" if len(refused) == 1 else "are training flags and have"
        raise ConfigError(f"{', '.join(refused)} {are} no effect with --eval-only")
    check_code_named(trained, typed, "the checkpoint", EVAL_FROM_CHECKPOINT)
    code = {flag: kept for flag, kept in (checkpoint.get("code") or {}).items() if flag not in own}
    contradicting = [name for name in CONFIG_FIELDS if name in typed & EVAL_FIXED - own
                     and not same_setting(name, trained[name], getattr(cfg, name), code.get(name))]
    if contradicting:
        was = ", ".join(as_flag(name, trained[name]) for name in contradicting)
        says = ", ".join(as_flag(name, getattr(cfg, name)) for name in contradicting)
        fix = f"name it again: {was}" if set(contradicting) & set(CODE_FLAGS) else "drop it"
        raise ConfigError(f"the checkpoint holds a {trained['model']} trained on "
                          f"{trained['dataset']} with {was}; {says} contradicts it ({fix})")
    taken = {name: trained[name] for name in EVAL_FROM_CHECKPOINT if name not in typed}
    note_code_changed(replace(cfg, **taken), {"code": code}, f"{path} was saved")
    return replace(cfg, **taken, mode="ddp", eval_only=path), checkpoint  # scratch's: a LeNet too


def checkpoint_file(path: str) -> str:
    """The checkpoint file PATH means: the file, DIR/checkpoint.pt, a run's best, else latest."""
    check_store("eval-only", path)
    if stored_type(path) == "none":
        raise ConfigError(f"--eval-only {path} does not exist")
    full = path.rstrip("/") if is_uri(path) else os.path.abspath(path)
    for file in (full, f"{full}/{CHECKPOINT_FILE}", f"{full}/{BEST_CHECKPOINT}"):
        if stored_type(file) == "file":
            return file
    try:
        latest = latest_committed(full)
    except BrokenSnapshot as exc:
        raise ConfigError(f"--eval-only {path}: {exc.fact}; if its run is still training, try "
                          f"again, or --eval-only one of its checkpoint_epoch_* directories"
                          ) from None
    if latest is None:
        raise ConfigError(f"--eval-only {path} holds no checkpoint ({CHECKPOINT_FILE} or "
                          f"checkpoint_epoch_*/{CHECKPOINT_FILE})")
    return latest if is_uri(latest) else str(Path(latest).resolve())


def checkpoint_classes(cfg: Config, checkpoint: dict, train_set, test_set) -> list:
    """The checkpoint's class names; refused where the test set's names or labels disagree."""
    names = checkpoint.get("classes") or class_names(train_set)
    if getattr(test_set, "classes", None):
        check_same_classes(cfg, names, class_names(test_set), "evaluate it on")
    if (labels := labels_of(test_set)) and not 0 <= min(labels) <= max(labels) < len(names):
        raise ConfigError(f"{cfg.dataset}'s test labels run from {min(labels)} to {max(labels)}, "
                          f"but the checkpoint has {plural(len(names), 'class')} (0 to "
                          f"{len(names) - 1})")
    return names


def check_same_classes(cfg: Config, trained: list, found: list, then: str) -> None:
    if found != trained:
        folder = data_source(cfg.dataset).image_files
        where = f"--data-dir {cfg.data_dir}" if folder else cfg.dataset
        raise ConfigError(f"the checkpoint's classes are {', '.join(trained)}; {where} has "
                          f"{', '.join(found)}: {then} the data it was trained on")


def eval_loop_per_worker(config: dict) -> dict:
    """--eval-only on every worker: the checkpoint's model scored on this rank's shard."""
    ops = operations(config)
    if ops.data is None:
        return ops.result()
    cfg, worker, options, test_set = ops.cfg, ops.worker, ops.options, ops.data[1]
    classes = len(options.classes)  # the checkpoint's, not what the test labels reach
    model = build_model(cfg.model, input_shape(cfg, test_set), classes or options.outputs)
    model.load_state_dict(ray.get(options.weights))  # from Ray's object store: no shared disk
    on_device(model, worker.device, cfg.model).eval()
    hashes, slots = replicas_digest(named := replica_state(model, None, "epoch"), worker)
    compare_replicas(named, hashes, all_reduce_sum(slots).tolist(), worker, "before scoring",
                     "nothing is scored")
    with autocast(cfg, worker.device):
        metrics = evaluate(model, test_set, worker.device, eval_batch_size(test_set), details=True,
                           num_classes=classes, workers=loader_workers(cfg, test_set),
                           image_size=cfg.image_size, criterion=loss_function(cfg, False))
    return {"metrics": metrics, "world_size": worker.world, "device": worker.device.type}


def run_eval(cfg: Config, checkpoint: dict) -> dict:
    """--eval-only: the test metrics, per class, the confusion matrix; what result.json holds."""
    train_set, test_set = loaded(cfg)
    names = checkpoint_classes(cfg, checkpoint, train_set, test_set) if classifies(test_set) else []
    best = (f"; the run's best: epoch {checkpoint['epoch']} by --best-by "
            f"{checkpoint['config'].get('best_by', 'test_loss')}"
            if cfg.eval_only.endswith(BEST_CHECKPOINT) else "")
    cfg, out = scored(cfg, checkpoint, test_set, names, outputs(test_set, names),
                      f"evaluating {cfg.eval_only} ({cfg.model} on {cfg.dataset}, "
                      f"{len(test_set)} test samples{best})")
    metrics, predictions = out["metrics"], out["metrics"].pop("predictions")
    confusion = metrics["confusion"] if names else metrics.pop("confusion")
    per_class = [{"class": c, "name": names[c], "count": sum(row), "correct": row[c],
                  "acc": row[c] / max(sum(row), 1)} for c, row in enumerate(confusion)]
    record = run_record(cfg, metrics, out, cfg.eval_only, per_class=per_class)
    write_json(os.path.join(cfg.run_dir, "result.json"), record)
    wrote = [os.path.join(cfg.run_dir, "result.json")]
    if cfg.predict_out:
        write_predictions(cfg.predict_out, test_set, predictions, names)
        wrote.append(f"{cfg.predict_out} ({plural(len(predictions), 'prediction')})")
    print(format_eval(metrics, per_class, out), flush=True)
    print(f"wrote {' and '.join(wrote)}", flush=True)
    return record


def scored(cfg: Config, checkpoint: dict, test_set, names: list, width: int,
           doing: str) -> tuple[Config, dict]:
    """The checkpoint's model on test_set, each sample once over the workers: (cfg, rank 0's)."""
    info = DataInfo((len(test_set), len(test_set)), input_shape(cfg, test_set), names,
                    not isinstance(test_set, TensorDataset), (test_set, test_set), outputs=width)
    if (trained := tuple(checkpoint.get("inputs") or ())) and trained != info.sample_shape:
        raise ConfigError(f"the inputs are {info.sample_shape} where the run trained on {trained}")
    check_model_fits(cfg, info)
    check_state_fits(cfg, info, checkpoint)
    if stored_type(cfg.run_dir) == "file" or epoch_checkpoints(cfg.run_dir):
        raise ConfigError(f"--name {cfg.name}: {cfg.run_dir} is a file or holds a training run, "
                          f"which this command would write over; choose another --name")
    cfg = connect(cfg)
    kind = "GPU" if cfg.gpu else "CPU"
    print(f"ray-dp: {doing} on {plural(cfg.workers, f'{kind} worker')}", flush=True)
    options = LoopOptions(weights=ray.put(checkpoint["model"]), classes=tuple(names),
                          outputs=width, data=ray.put((None, shared(test_set))))
    out = fit(cfg, eval_loop_per_worker, options).return_value
    if "data_error" in out:
        raise DataError(out["data_error"])
    return cfg, out


def write_predictions(path: str, test_set, predictions: list, names: list) -> None:
    """--predict-out: a row per test sample, its target and prediction (docs/own-data.md)."""
    files = [file for file, _ in test_set.samples] if hasattr(test_set, "samples") else None
    width = len(predictions[0]) if predictions and not names else 1
    head = (["label", "predicted", "probability", "label_name", "predicted_name"] if names
            else ["target", "predicted"] if width == 1
            else [f"{kind}_{j}" for kind in ("target", "predicted") for j in range(width)])
    rows = [["index", *head, *(["path"] if files else [])]]
    targets = labels_of(test_set) if names else [test_set[i][1] for i in range(len(test_set))]
    for i, (target, values) in enumerate(zip(targets, predictions)):
        row = ([target, int(values[0]), f"{values[1]:.6f}", names[target], names[int(values[0])]]
               if names else [*torch.as_tensor(target).reshape(-1).tolist(),
                              *(f"{value:.6g}" for value in values)])
        rows.append([i, *row, *([files[i]] if files else [])])
    write_csv(path, rows)


def predict(run: str, inputs, out: Optional[str] = None, **settings) -> list[dict]:
    """ray_dp.predict("runs/myrun", inputs="photos/", workers=3): predict's rows (and its CSV, if
    `out`); inputs: a folder, FILE.py:NAME, your function or Dataset; settings as train()'s."""
    CODE.clear()
    if isinstance(inputs, torch.utils.data.Dataset):  # its class's module travels as yours do
        dataset, inputs = inputs, lambda: dataset
        travels(sys.modules.get(type(dataset).__module__))
    if not (callable(inputs) or isinstance(inputs, (str, os.PathLike))):
        raise ConfigError(f"inputs= takes a folder, FILE.py:NAME, a function or a Dataset, not "
                          f"a {type(inputs).__name__}")
    inputs = as_spec(inputs, "inputs") if callable(inputs) else os.fspath(inputs)
    flags = ["predict", os.fspath(run), "--inputs", inputs, "--out", str(out or "")]
    _, cfg, options = parse_command(flags + settings_as_flags(settings))
    return run_predict(cfg, **options, rows_alone=not out)


def predict_flags(args: dict) -> tuple[dict, dict]:
    """predict's --inputs as the data set: a folder of images, or your function."""
    inputs = args.pop("inputs")
    if is_code(inputs):
        return {**args, "dataset": inputs}, {}
    return {**args, "dataset": "folder", "data_dir": inputs}, {}


def predict_checked(cfg: Config, options: dict) -> Config:
    """The inputs exist; a built-in loss of stand-in targets, scored but never shown."""
    if not (is_code(cfg.dataset) or os.path.exists(cfg.data_dir)):
        raise ConfigError(f"--inputs {cfg.data_dir} is neither a folder nor FILE.py:NAME")
    return replace(cfg, loss="cross_entropy" if options["checkpoint"]["classes"] else "mse")


@command("predict", "predict: a run's model on new inputs, each scored once over --workers "
         "workers; a row per input: its path or index, its class (number, name, probability) or "
         "values", PREDICT_FLAGS, given=predict_flags, completed=predict_checked,
         sets=frozenset(PREDICT_OWN), words=PREDICT_WORDS, arguments={
             "eval_only": dict(metavar="RUN", help="a run or checkpoint (--eval-only's)"),
             "--inputs": dict(required=True, metavar="DIR|FILE.py:NAME", help="images, any "
                              "layout; or your function (as --dataset's) returning a Dataset of "
                              "inputs or of (input, anything) pairs"),
             "--out": dict(dest="predict_out", required=True, metavar="FILE.csv",
                           help="the CSV file its rows go to")})
def run_predict(cfg: Config, checkpoint: dict, rows_alone: bool = False) -> list[dict]:
    """predict: a row per input in their order (its path or index, its prediction); to --out."""
    if not (cfg.predict_out or rows_alone):  # ray_dp.predict() may return rows alone
        raise ConfigError("--out must name a .csv file, got ''")
    names = list(checkpoint["classes"])  # a checkpoint from before "outputs": its last bias's width
    width = checkpoint.get("outputs") or len(names) or [
        t for t in checkpoint["model"].values() if t.ndim][-1].shape[0]
    inputs, keys = predict_inputs(cfg, torch.tensor(0) if names else torch.zeros(width), checkpoint)
    cfg, out = scored(cfg, checkpoint, inputs, names, width, f"predicting "
                      f"{plural(len(inputs), 'input')} with {cfg.eval_only} ({cfg.model})")
    columns = ["predicted"] if width == 1 else [f"predicted_{j}" for j in range(width)]
    rows = [{**key, **({"predicted": int(values[0]), "predicted_name": names[int(values[0])],
                        "probability": values[1]} if names else dict(zip(columns, values)))}
            for key, values in zip(keys, out["metrics"]["predictions"])]
    with contextlib.suppress(OSError):  # Ray's folder for the job, holding Ray's marker alone
        os.unlink(os.path.join(cfg.run_dir, ".validate_storage_marker"))
        os.rmdir(cfg.run_dir)
    if cfg.predict_out:
        shown = [[f"{v:.6f}" if k == "probability" else f"{v:.6g}" if isinstance(v, float) else v
                  for k, v in row.items()] for row in rows]  # as --predict-out writes them
        write_csv(cfg.predict_out, [list(rows[0]), *shown])
        print(f"wrote {cfg.predict_out} ({plural(len(rows), 'prediction')})", flush=True)
    return rows


def predict_inputs(cfg: Config, target: torch.Tensor, checkpoint: dict) -> tuple:
    """predict's inputs (a folder's images, sorted, or your Dataset) with stand-in targets; keys.
    Images for a run of another data set are read as its inputs were: channels, size, [0, 1]."""
    from torchvision import transforms as T
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
    trained, shape = checkpoint["config"]["dataset"], tuple(checkpoint.get("inputs") or ())
    facts = data_source(trained)
    if is_code(where := cfg.dataset):
        data = your_data(where, "inputs", cfg)
        if not (isinstance(data, torch.utils.data.Dataset) and hasattr(data, "__len__")):
            raise DataError(f"--inputs {where} returned {type(data).__name__}, not a Dataset")
        keys = [{"index": i} for i in range(len(data))]
        inputs = (TensorDataset(data.tensors[0], target.expand(len(data), *target.shape).clone())
                  if isinstance(data, TensorDataset) else Unlabelled(data, None, target))
    else:
        where = cfg.data_dir
        files = sorted(os.path.relpath(os.path.join(folder, name), where) for folder, _, names
                       in os.walk(where) for name in names  # linked folders: not walked
                       if has_file_allowed_extension(name, IMG_EXTENSIONS))
        if not facts.image_files and (not facts.same_on_every_rank or not shape):
            raise DataError(f"--inputs {where}: images are read as --dataset folder and the "
                            f"lessons' sets read theirs, and this run trained on --dataset "
                            f"{trained}: give --inputs FILE.py:NAME returning inputs as it trained "
                            f"on them")
        read = image_transforms(cfg)[1] if facts.image_files else T.Compose(
            [*[T.Grayscale()] * (shape[0] == 1), T.Resize(shape[1:]), T.ToTensor()])
        read.transforms.insert(0, functools.partial(read_image, data_dir=where))
        keys = [{"path": file} for file in files]
        inputs = Unlabelled([os.path.join(where, file) for file in files], read, target)
    if not keys:
        raise DataError(f"--inputs {where} holds no inputs" if is_code(where) else
                        f"--inputs {where} holds no image ({', '.join(IMG_EXTENSIONS)})")
    if not is_code(where) and not facts.image_files:
        print(f"note: --inputs {where}: images read as the run's inputs were, {shape} in [0, 1]")
    check_sendable(cfg, (inputs,))
    return inputs, keys


class Unlabelled(torch.utils.data.Dataset):
    """predict's inputs (a file read, or your pair's input), each with a stand-in target."""

    def __init__(self, items, read, target: torch.Tensor):
        self.items, self.read, self.target = items, read, target

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple:
        item = self.items[index]
        item = item[0] if isinstance(item, (tuple, list)) else item
        return (self.read(item) if self.read else item), self.target


def format_eval(metrics: dict, per_class: list, out: dict) -> str:
    workers = f"on {plural(out['world_size'], 'worker')} ({out['device']})"
    if not per_class:
        return f"test loss {metrics['test_loss']:.4f} ({metrics['test_count']} samples) {workers}"
    lines = [f"test loss {metrics['test_loss']:.4f}, test acc {metrics['test_acc']:.4f} "
             f"({sum(c['correct'] for c in per_class)}/{metrics['test_count']}) {workers}", "",
             "class  count  correct  acc     name"]
    lines += [f"{c['class']:>5}  {c['count']:>5}  {c['correct']:>7}  {c['acc']:.4f}  {c['name']}"
              for c in per_class]
    lines += ["", "confusion matrix (rows: true class, columns: predicted class)",
              "      " + "".join(f"{c:>6}" for c in range(len(per_class)))]
    lines += [f"{c:>6}" + "".join(f"{n:>6}" for n in row)
              for c, row in enumerate(metrics["confusion"])]
    return "\n".join(lines)


# ==================================================================================================
# compare: the lesson's table, measured side by side.
# ==================================================================================================


def compare_configs(base: Config, scale_lr: bool) -> list[Config]:
    """ddp and scratch LeNet at 1 worker and at --workers N (scratch with each all-reduce)."""
    n = base.workers
    rows = [("ddp", "library", 1), ("ddp", "library", n), ("scratch", "naive", 1)]
    rows += [("scratch", algorithm, n) for algorithm in ALLREDUCE_ALGORITHMS]
    return [replace(base, mode=mode, allreduce=algorithm, workers=workers,
                    name=f"{mode}{'-' + algorithm if mode == 'scratch' else ''}-{workers}w",
                    checkpoint_every="0" if mode == "scratch" else base.checkpoint_every,
                    storage_path=base.run_dir, logdir=os.path.join(base.logdir, base.name),
                    batch_size=base.batch_size * (workers if scale_lr else 1),
                    lr=round(base.lr * (workers if scale_lr else 1), 10))
            for mode, algorithm, workers in (rows if n > 1 else rows[:1] + rows[2:3])]


def compare_flags(args: dict) -> tuple[dict, dict]:
    """compare's own --scale-lr taken out, the lesson's defaults under what was typed; what its
    rows cannot honour refused."""
    options = {"typed": set(args), "scale_lr": args.pop("scale_lr", False)}
    if args.get("eval_only") or args.get("min_workers"):
        raise ConfigError("compare trains its own rows at 1 and --workers N workers: give a fixed "
                          "--workers N, and run --eval-only on its own")
    if (args.get("model", Config.model), args.get("loss", Config.loss)) != ("lenet",
                                                                             "cross_entropy"):
        raise ConfigError("compare trains the lesson's LeNet with cross-entropy (its scratch rows: "
                          "d2l's functional one): drop --model and --loss")
    return {**LESSON_DEFAULTS, **args}, options


@command("compare", "compare: train ddp and scratch LeNet at 1 and --workers N workers (scratch "
         "with each all-reduce), same global batch and seed, and print the lesson's table; writes "
         "compare.csv and .md to <storage-path>/<name>/. Its rows set --mode and --allreduce and "
         "train the lesson's LeNet with plain SGD in fp32: flags of --mode ddp alone (--model, "
         "--optimizer, --amp, ...) are refused", given=compare_flags, arguments={"--scale-lr": dict(
             action="store_true", help="N-worker rows keep the per-worker batch (global batch x "
             "N, as the lesson did) and scale the learning rate by N with it")})
def compare(base: Config, scale_lr: bool, typed=()) -> list[dict]:
    configs, resolved = compare_configs(base, scale_lr), []
    for cfg in configs:  # every row resolved and checked before any cluster starts
        cfg, resume = check_run_dir(cfg)
        summary, data = finished_result(cfg, resume), None
        if summary is None:
            validate(cfg, resuming=resume.resumes)
            cfg, data, _ = preflight(cfg, resume, None, typed)  # its notes print as the row runs
        resolved.append((cfg, resume, data, summary))
    if any(summary is None for *_, summary in resolved):
        connect(max(configs, key=lambda c: c.workers))
    summaries = [run(cfg, resume, data) if summary is None else finished(cfg, summary, resume.done)
                 for cfg, resume, data, summary in resolved]
    rows = compare_rows(configs, summaries)
    print(write_compare(base.run_dir, rows))
    print(f"wrote compare.csv and compare.md to {base.run_dir} (TensorBoard draws every row: "
          f"tensorboard --logdir {os.path.join(base.logdir, base.name)})", flush=True)
    return rows


def compare_rows(configs: list[Config], summaries: list[dict]) -> list[dict]:
    baseline = {c.mode: s["sec_per_epoch"] for c, s in zip(configs, summaries) if c.workers == 1}
    rows = []
    for cfg, s in zip(configs, summaries):
        speedup, final = baseline[cfg.mode] / s["sec_per_epoch"], s["final"]
        comm = final.get("allreduce_seconds_per_step") if final.get("allreduce_bytes") else None
        rows.append({"run": cfg.name, "mode": cfg.mode,
                     "allreduce": cfg.allreduce if cfg.mode == "scratch" else "ddp",
                     "workers": cfg.workers, "global_batch": cfg.batch_size, "lr": cfg.lr,
                     "test_acc": round(final["test_acc"], 4),
                     "sec_per_epoch": round(s["sec_per_epoch"], 3),
                     "samples_per_s": round(s["samples_per_second"]), "speedup": round(speedup, 2),
                     "efficiency": round(speedup / cfg.workers, 2),
                     "allreduce_ms_per_step": round(comm * 1e3, 3) if comm else "",
                     "busbw_GBps": round(final["allreduce_busbw_gbps"], 3) if comm else ""})
    return rows


def write_compare(out_dir: str, rows: list[dict]) -> str:
    write_csv(os.path.join(out_dir, "compare.csv"), [list(rows[0]), *map(dict.values, rows)])
    table = "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])] +
                      ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows])
    write_stored(os.path.join(out_dir, "compare.md"), (table + "\n").encode())
    return table


# ==================================================================================================
# Object storage: every path flag that may name s3://, gs://, ... reaches it through pyarrow.
# ==================================================================================================

STORE_SETTINGS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION")


def is_uri(path: str) -> bool:
    return "://" in str(path)


def files_at(path: str):
    return fs.FileSystem.from_uri(path) if is_uri(path) else (fs.LocalFileSystem(),
                                                               os.path.abspath(path))


def stored_type(path: str) -> str:
    storage, where = files_at(path)
    return {fs.FileType.File: "file", fs.FileType.Directory: "directory"}.get(
        storage.get_file_info(where).type, "none")


def check_store(flag: str, uri: str) -> None:
    takers = {name.replace("_", "-"): access for name, access in STORE_ACCESS.items()}
    if is_uri(uri) and flag not in takers:
        raise ConfigError(f"--{flag} {uri}: a local path, not a URI (only --"
                          f"{', --'.join(list(takers)[:-1])} and --{list(takers)[-1]} take one)")
    if is_uri(uri) and (problem := store_problem(uri, takers[flag])):
        raise ConfigError(f"--{flag} {uri}: {problem}")


def store_problem(uri: str, access: str) -> Optional[str]:
    """Why `uri`'s store cannot be used for `access` ("read"/"write"), what to check; or None."""
    scheme, _, rest = uri.partition("://")
    bucket = rest.split("/")[0]
    if (marks := sorted(set(uri) & set("?#%"))):
        return (f"'{marks[0]}' in a URI would change what it names (options, fragments and escapes "
                f"are not taken; say where an S3-compatible store is with AWS_ENDPOINT_URL)")
    if "@" in bucket:
        return ("credentials in a URI would be printed and kept in result.json: give them as "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the node's IAM role)")
    if "" in rest.rstrip("/").split("/")[1:]:
        return "an empty path component ('//')"
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    at = f" at {endpoint} (AWS_ENDPOINT_URL)" if endpoint and scheme == "s3" else ""
    aws = " (and for a store other than AWS's, set AWS_ENDPOINT_URL)" if scheme == "s3" else ""
    try:  # GCS's client retries for minutes by default
        storage, path = fs.FileSystem.from_uri(uri + "?retry_limit_seconds=20" * (scheme == "gs"))
        if isinstance(storage, fs.LocalFileSystem):
            return None
        if not bucket:
            return f"names no bucket (write {scheme}://BUCKET/path)"
        if storage.get_file_info(bucket).type == fs.FileType.NotFound:
            raise FileNotFoundError(f"Bucket '{bucket}' not found")
        if access == "read" and storage.get_file_info(path).type == fs.FileType.NotFound:
            return f"bucket '{bucket}' holds nothing at '{path[len(bucket) + 1:]}'"
        return None
    except ValueError as exc:
        return str(exc).splitlines()[0]
    except (OSError, ArrowException) as exc:
        reason = " ".join(str(exc).split())
    text = (re.findall(r"AWS Error.*|(?<=underlying error message was: ).*", reason) or [reason])[0]
    error = re.split(r" \(Request ID|; Details| error_info=", text)[0][:200].rstrip(": .")
    if re.search(r"ACCESS_DENIED|INVALID_ACCESS_KEY|SIGNATURE|FORBIDDEN|(?<![:\d])403(?!\d)",
                 reason):  # HTTP 403, not the digits of a port
        return (f"the store{at} refused access to bucket '{bucket}' ({error}): "
                f"check the credentials this machine uses (AWS_ACCESS_KEY_ID and "
                f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or its IAM role) and that they may "
                f"{'read and write' if access == 'write' else 'read'} the bucket")
    if f"Bucket '{bucket}' not found" in reason:
        return (f"bucket '{bucket}' does not exist{at}: create it, or check its name"
                f"{' and AWS_ENDPOINT_URL' if at else aws}")
    check = ("that the store runs there" if at else f"this machine's network{aws}" if aws
             else "this machine's network and credentials")
    return f"bucket '{bucket}'{at} cannot be reached ({error}): check {check}"


class StoredImageFolder(torch.utils.data.Dataset):
    """torchvision's ImageFolder (attributes, order) in object storage; a batch fetched at once."""

    def __init__(self, root: str, transform, data_dir: str):
        from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
        storage, path = files_at(root)
        found = storage.get_file_info(fs.FileSelector(path, recursive=True, allow_not_found=True))
        parted = [(info, info.path[len(path) + 1:].split("/")) for info in found]
        entries = [(parts[0], "/".join(parts[:-1]), parts[-1]) for info, parts in parted
                   if len(parts) > 1 and info.type == fs.FileType.File]
        self.classes = sorted({parts[0] for info, parts in parted
                               if len(parts) > 1 or info.type == fs.FileType.Directory})
        if not self.classes:
            raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples = [(f"{root}/{folder}/{name}", self.class_to_idx[class_name])
                        for class_name, folder, name in sorted(entries)
                        if has_file_allowed_extension(name, IMG_EXTENSIONS)]
        self.targets = [target for _, target in self.samples]
        if (empty := set(self.classes) - {self.classes[t] for t in set(self.targets)}):
            raise FileNotFoundError(f"Found no valid file for the classes "
                                    f"{', '.join(sorted(empty))}. Supported extensions are: "
                                    f"{', '.join(IMG_EXTENSIONS)}")
        self.root, self.transform, self.data_dir, self.fetched = root, transform, data_dir, {}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple:
        path, target = self.samples[index]
        data = self.fetched.pop(path, None) or stored_image(path, self.data_dir)
        return self.transform(read_image(path, self.data_dir, data)), target

    def __getitems__(self, indices: list) -> list:
        self.prefetch(indices)
        return [self[index] for index in indices]

    def prefetch(self, indices: list) -> None:
        """A batch's objects at once, a request each: the slowest decides, not the sum."""
        from concurrent.futures import ThreadPoolExecutor
        paths = [self.samples[index][0] for index in indices]
        with ThreadPoolExecutor(max_workers=min(16, len(paths) or 1)) as pool:
            self.fetched.update(zip(paths, pool.map(
                functools.partial(stored_image, data_dir=self.data_dir), paths)))


STORE_CONNECTIONS = {}


def stored_image(uri: str, data_dir: str) -> bytes:
    if (key := (data_dir, os.getpid())) not in STORE_CONNECTIONS:  # a client dies with a fork
        STORE_CONNECTIONS[key] = files_at(data_dir)
    storage, root = STORE_CONNECTIONS[key]
    with storage.open_input_file(root + uri[len(data_dir):]) as f:
        return f.read()


def remove_stored(path: str) -> None:
    storage, where = files_at(path)
    if (kind := storage.get_file_info(where).type) in (fs.FileType.File, fs.FileType.Directory):
        (storage.delete_dir if kind == fs.FileType.Directory else storage.delete_file)(where)


# ==================================================================================================
# Data on disk and on many nodes: downloads, one list of samples for the run, each node checked.
# ==================================================================================================

def load_torchvision(dataset_class, root: str, download: bool) -> tuple:
    """A torchvision data set as tensors, downloaded into root if missing; a failure undone."""
    before = set(os.listdir(root)) if os.path.isdir(root) else None
    try:
        with download_lock(root, dataset_class.__name__) if download else contextlib.nullcontext():
            try:
                splits = [dataset_class(root, train=train, download=download)
                          for train in (True, False)]
            except (RuntimeError, OSError) as exc:
                for name in set(own_entries(dataset_class)) - (before or set()):
                    with contextlib.suppress(OSError):
                        remove_stored(os.path.join(root, name))
                raise DataError(missing_dataset(dataset_class, root, download, exc)) from None
    except DataError:
        if before is None and os.path.isdir(root) and all(
                re.fullmatch(r"\.\w+\.lock", name) for name in os.listdir(root)):
            shutil.rmtree(root, ignore_errors=True)
        raise
    return tuple(images_to_tensors(split) for split in splits)


def missing_dataset(dataset_class, root: str, download: bool, error: Exception) -> str:
    reason = " ".join(str(error).split())
    tried = (f" and could not be downloaded ({reason})" if "download=True" not in reason
             else " and could not be downloaded") if download else " (--no-download)"
    folder = os.path.join(root, own_entries(dataset_class)[0])
    if hasattr(dataset_class, "resources"):
        folder, names = os.path.join(folder, "raw"), [
            os.path.splitext(os.path.basename(url))[0] for url, _ in dataset_class.resources]
    else:
        names = ([name for name, _ in dataset_class.train_list + dataset_class.test_list]
                 + [dataset_class.meta["filename"]])
    source = getattr(dataset_class, "url", None) or dataset_class.mirrors[0]
    return (f"{dataset_class.__name__} is not in {root}{tried}: put its files there ({folder}/ "
            f"holding {', '.join(names)}, from {source}) or --data-dir where they are, or use "
            f"--dataset digits (offline)")


def own_entries(dataset_class) -> tuple:
    folder = getattr(dataset_class, "base_folder", dataset_class.__name__)
    return (folder, *filter(None, [getattr(dataset_class, "filename", None)]))


def download_lock(root: str, name: str):
    """Held (a context manager): workers sharing a node would download the same files at once."""
    from filelock import FileLock
    try:
        os.makedirs(root, exist_ok=True)
        return FileLock(os.path.join(root, f".{name}.lock")).acquire()
    except OSError as exc:
        raise DataError(f"--data-dir {root}: cannot create the download's lock file there "
                        f"({exc.strerror or exc}); use a writable --data-dir, or --no-download "
                        f"where the files already are") from None


def check_node_holds(data: tuple, cfg: Config, worker: Worker, console: "Console") -> None:
    """A DataError on all ranks if a node's folder lacks one of the run's images; extras: a note."""
    if not data_source(cfg.dataset).image_files or is_uri(cfg.data_dir):
        return
    from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
    lacks, extra = [], 0
    for split, listed in zip(("train", "val"), data):
        if not hasattr(listed, "class_to_idx"):  # --eval-only reads val/ alone; predict, no class
            continue
        root = os.path.join(cfg.data_dir, split)
        here = {os.path.relpath(os.path.join(folder, name), root)
                for folder, _, names in os.walk(root, followlinks=True)
                for name in names if has_file_allowed_extension(name, IMG_EXTENSIONS)}
        wanted = [path[len(listed.root.rstrip("/")) + 1:] for path, _ in listed.samples]
        lacks += [f"{split}/{name}" for name in wanted if name not in here]
        extra += len(here - set(wanted))
    found = [(node_name(), lacks[:1], len(lacks), extra)] * worker.world
    if worker.world > 1:
        dist.all_gather_object(found, found[0])
    for rank, (node, first, lacking, _) in enumerate(found):
        if lacking:
            raise DataError(f"node {node} (rank {rank}) lacks {plural(lacking, 'image')} of the "
                            f"run's list in --data-dir {cfg.data_dir}, e.g. {first[0]}: copy the "
                            f"same folder to every node (cluster.yaml's file_mounts), or keep it "
                            f"in object storage (s3://...)")
    for node, _, _, extra in found:
        if extra:
            console.say(f"ray-dp: note: node {node} holds {plural(extra, 'image')} in --data-dir "
                        f"{cfg.data_dir} that the run's list does not: they are left out")


def node_name() -> str:
    return ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()


def check_classes_agree(classes: list, device: torch.device) -> None:
    differs = torch.tensor([int(from_rank_0(classes, device) != classes)], device=device)
    if all_reduce_sum(differs).item():
        raise DataError("the workers' data sets hold different classes: the same folder must be "
                        "on every node that trains (ray_dp.py doctor checks it)")


# ==================================================================================================
# Launchers and torchrun: where a worker's checkpoint comes from and where its reports go.
# ==================================================================================================

class RayLauncher:
    """Ray Train's workers: Ray finds and commits checkpoints; its controller writes TensorBoard."""

    def __init__(self, run_dir: str, resume_from: Optional[object]):
        self.run_dir, self.resume_from, self.restore_seconds = run_dir, resume_from, 0.0

    def latest_checkpoint(self) -> Optional[dict]:
        tic, checkpoint = time.perf_counter(), ray.train.get_checkpoint()
        try:
            if checkpoint is None:
                return ray.get(self.resume_from) if self.resume_from is not None else None
            with checkpoint.as_directory() as directory:
                return load_checkpoint(os.path.join(directory, CHECKPOINT_FILE))
        finally:
            self.restore_seconds = time.perf_counter() - tic

    def report(self, metrics: dict, state: Optional[dict], epoch: int, step: int = 0) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            if state is not None:
                write_checkpoint(os.path.join(tmp, CHECKPOINT_FILE), state)
            ray.train.report(metrics, checkpoint_dir_name=checkpoint_dir_name(epoch, step),
                             checkpoint=None if state is None else ray.train.Checkpoint(tmp))
            if state is not None and metrics.get("best"):  # once Ray holds the epoch's
                write_stored(os.path.join(self.run_dir, BEST_CHECKPOINT),
                             Path(tmp, CHECKPOINT_FILE).read_bytes())


class TorchrunLauncher:
    """torchrun's processes (no controller): rank 0 keeps checkpoints as Ray would; TensorBoard."""

    def __init__(self, cfg: Config, worker: Worker):
        self.cfg, self.worker, self.restore_seconds = cfg, worker, 0.0
        self.tensorboard = TensorBoardWriter(cfg) if worker.is_main else None

    def latest_checkpoint(self) -> Optional[dict]:
        tic = time.perf_counter()
        latest = self.worker.is_main and latest_committed(self.cfg.run_dir)
        state = from_rank_0(load_checkpoint(latest) if latest else None, self.worker.device)
        self.restore_seconds = time.perf_counter() - tic
        return state

    def report(self, metrics: dict, state: Optional[dict], epoch: int, step: int = 0) -> None:
        if state is not None:
            save_checkpoint(self.cfg.run_dir, state, epoch, step, self.cfg.keep_checkpoints,
                            metrics.get("best", False))
        if not step:
            ray.train.report(metrics)
            if self.tensorboard:
                self.tensorboard.write(metrics)


def torchrun_follower() -> bool:
    return under_torchrun() and os.environ.get("RANK") != "0"


def torchrun_launch(command: str, args: dict, typed: set) -> dict:
    if not (world := os.environ["WORLD_SIZE"]).isdigit() or int(world) < 1:
        raise ConfigError(f"torchrun's WORLD_SIZE must be a positive whole number, got {world!r}")
    world = int(world)
    if args.get("mode") == "dp":
        raise ConfigError("--mode dp drives all GPUs in one process; under torchrun use --mode ddp")
    if not COMMANDS[command].resumes or args.get("eval_only"):
        raise ConfigError("under torchrun ray_dp trains; run compare and --eval-only with python "
                          "ray_dp.py, whose Ray workers need no torchrun")
    if "workers" in typed and (args["workers"], args.get("min_workers", 0)) != (world, 0):
        raise ConfigError(f"torchrun starts {world} processes (WORLD_SIZE={world}) and they are "
                          f"the workers: drop --workers (or change --nproc_per_node)")
    cuda = torch.cuda.is_available()
    if args.get("gpu") is not None and args["gpu"] != cuda:
        raise ConfigError(f"under torchrun the workers use {'CUDA' if cuda else 'the CPU'} "
                          f"when the machine {'has' if cuda else 'has no'} GPUs: "
                          f"drop --{'cpu' if cuda else 'gpu'}")
    return {**args, "workers": world, "min_workers": 0, "gpu": cuda}


# ==================================================================================================
# The cluster: GPU or CPU workers, whether they fit (now or once autoscaled).
# ==================================================================================================


@dataclass(frozen=True)
class Cluster:
    """Resources now; an attached cluster's autoscaler node types (a node's resources, most)."""
    now: dict
    node_types: Optional[list]

    @property
    def most(self) -> Optional[dict]:
        if self.node_types is None:
            return None
        kinds = dict.fromkeys(kind for resources, count in self.node_types if count
                              for kind, amount in resources.items() if amount)
        return {kind: sum(resources.get(kind, 0) * count for resources, count in self.node_types)
                for kind in kinds}


def fits(need: dict, have: dict) -> bool:
    return all(amount <= have.get(kind, 0) for kind, amount in need.items())


def cluster_of(cfg: Config) -> Cluster:
    return Cluster(ray.cluster_resources(), autoscaler_node_types() if cfg.address else None)


def decide_gpu(cfg: Config, cluster: Cluster) -> bool:
    """GPU workers (nccl) or CPU workers (gloo), when --gpu / --cpu did not say."""
    if cfg.gpu is not None:
        return cfg.gpu
    if cfg.mode == "dp" or cluster.now.get("GPU", 0) > 0:
        return True
    if cluster.most is not None or not cfg.address:  # what the autoscaler, or this machine, has
        return (cluster.most or {}).get("GPU", 0) > 0
    raise ConfigError(f"the cluster at {cfg.address} has no GPU now and ray_dp cannot tell "
                      f"whether it can add GPU nodes (no autoscaler configuration found): "
                      f"pass --gpu or --cpu")


def settle_device(cfg: Config, cluster: Cluster) -> Config:
    """The config with its device, once the workers are known to fit (Ray would wait forever)."""
    cfg, cores = replace(cfg, gpu=decide_gpu(cfg, cluster)), cluster.now.get("CPU", 0)
    if not cfg.address and cfg.cpus_per_worker is None and cfg.processes > cores and not cfg.gpu:
        share = math.floor(cores / cfg.processes * 10_000) / 10_000  # Ray counts in 0.0001 CPU
        if not share:
            raise ConfigError(f"{cfg.processes} workers cannot share {cores:g} cores (Ray's "
                              f"smallest share is 0.0001 CPU): lower --workers")
        print(f"note: {cfg.processes} workers share this machine's {cores:g} cores: {share:g} CPU "
              f"and 1 thread each (--cpus-per-worker sets it)", flush=True)
        cfg = replace(cfg, cpus_per_worker=share)
    fewest, per_worker = cfg.min_workers or cfg.processes, resources_per_worker(cfg)
    need = {kind: amount * fewest for kind, amount in per_worker.items()}
    if fits(need, cluster.now):
        return cfg
    have = f"{cluster.now.get('CPU', 0):g} CPUs and {cluster.now.get('GPU', 0):g} GPUs"
    if not cfg.address and cfg.gpu and not cluster.now.get("GPU"):
        raise ConfigError("--gpu was given but this machine has no GPU (use --cpu)")
    if cluster.most is None or not fits(need, cluster.most):
        limit = (f"its node types add up to at most {cluster.most}" if cluster.most is not None
                 else f"the cluster has {have}" if not cfg.address else
                 f"the cluster has {have} and no autoscaler configuration that could add more")
        raise ConfigError(f"{fewest} workers need {need['CPU']:g} CPUs and {need.get('GPU', 0)} "
                          f"GPUs but {limit} (lower --workers or --cpus-per-worker)")
    if not any(count and fits(per_worker, resources) for resources, count in cluster.node_types):
        raise ConfigError(f"one worker needs {per_worker} and no node type of the cluster has "
                          f"that much (lower --cpus-per-worker)")
    print(f"note: waiting for the cluster to grow to {need} (it has {have} now)", flush=True)
    return cfg


def autoscaler_node_types(bootstrap_path: str = "~/ray_bootstrap_config.yaml") -> Optional[list]:
    """The node types `ray up` left on this head node for its autoscaler; None if none."""
    if not (path := Path(bootstrap_path).expanduser()).is_file():
        return None
    import yaml
    cluster_yaml = yaml.safe_load(path.read_text())
    head = cluster_yaml.get("head_node_type")
    return [(node_type.get("resources", {}), node_type.get("max_workers", 0) + (name == head))
            for name, node_type in cluster_yaml.get("available_node_types", {}).items()]


# ==================================================================================================
# Ray internals: the bets ray_dp makes on Ray's non-public API, each checked with Ray 2.60 and
# guarded: a Ray that moved one costs a note (or, for torchrun, a refusal), never wrong numbers.
#   1. Ray Train's torchrun test                  5. set_sigterm_handler (a worker's SIGTERM)
#   2. its health check's error name              6. canonicalize_bootstrap_address (auto)
#   3. its memory monitor's wording               7. its environment knobs (set_ray_train_knobs)
#   4. its checkpoint list's file and keys        8. its placement-group cleaner's waits and logger
# ==================================================================================================

RAY_CHECKED, _noted = "2.60.0", set()


def ray_internal(module: str, name: str):
    with contextlib.suppress(ImportError, AttributeError):
        return getattr(importlib.import_module(module), name)
    return None


def internal_note(what: str, lost: str) -> None:
    """One line, once per process: which of this Ray's internals ray_dp cannot use, what is lost."""
    if (what, lost) in _noted:
        return
    _noted.add((what, lost))  # not functools.cache: run as a script, functions travel by value
    checked = "" if ray.__version__ == RAY_CHECKED else f" (ray_dp was checked with {RAY_CHECKED})"
    print(f"note: ray_dp cannot use {what} of Ray {ray.__version__}{checked}: {lost}", flush=True)


def under_torchrun() -> bool:
    """Started by torchrun (its run ID; Ray's workers have RANK too), as Ray Train's test says."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    has_torchrun_env = ray_internal("ray.train.v2._internal.execution.local_mode.torch",
                                    "has_torchrun_env")
    if has_torchrun_env is None:
        low, high = SUPPORTED_RAY
        raise ConfigError(f"under torchrun ray_dp needs Ray Train's local mode as Ray >= {low} and "
                          f"< {high} has it (Ray {ray.__version__} is installed): pip install -r "
                          f"requirements.txt, or run without torchrun "
                          f"(python ray_dp.py --workers N)")
    return has_torchrun_env()


HEALTH_CHECK_ERROR = "WorkerHealthCheckFailedError"
# the memory monitor's words (every unexpected exit lists "the OOM killer" as a possible cause)
RAY_OOM_KILLED = re.compile(r"low on memory|memory pressure|OUT_OF_MEMORY")
RAY_SNAPSHOT, SNAPSHOT_REREAD_S = "checkpoint_manager_snapshot.json", 1.0
SNAPSHOT_WAYS_ON = ("--eval-only one of the run's checkpoint_epoch_* directories, or rerun with "
                    "--fresh to start over")


class BrokenSnapshot(ConfigError):
    """A snapshot that does not read as Ray writes it: the fact, and the ways on."""

    def __init__(self, path: str):
        self.fact = f"{path} is not Ray's list of checkpoints"
        super().__init__(f"{self.fact}: {SNAPSHOT_WAYS_ON}")


def ray_snapshot(run_dir: str) -> Optional[dict]:
    """The run's snapshot as Ray wrote it, or None. On a disk Ray rewrites it in place (empty,
    then whole): a reader mid-rewrite reads again for up to SNAPSHOT_REREAD_S."""
    storage, path = files_at(run_dir)
    snapshot, deadline = f"{path}/{RAY_SNAPSHOT}", time.monotonic() + SNAPSHOT_REREAD_S
    while storage.get_file_info(snapshot).type != fs.FileType.NotFound:
        with contextlib.suppress(ValueError), storage.open_input_stream(snapshot) as f:
            if snapshot_shape(state := json.loads(f.read())):
                return state
        if time.monotonic() > deadline:
            raise BrokenSnapshot(f"{run_dir}/{RAY_SNAPSHOT}")
        time.sleep(0.05)
    return None


def snapshot_shape(state) -> bool:
    """Ray's _CheckpointManagerState as ray_dp reads it: names and metrics; the latest (or None)."""
    def listed(entry) -> bool:
        return (isinstance(entry, dict) and isinstance(entry.get("checkpoint_dir_name"), str)
                and isinstance(entry.get("metrics"), dict))
    committed = state.get("checkpoint_results") if isinstance(state, dict) else None
    if not isinstance(committed, list) or not all(map(listed, committed)):
        return False
    latest = state.get("latest_checkpoint_result")
    return latest is None or (listed(latest) and latest["checkpoint_dir_name"] in {
        entry["checkpoint_dir_name"] for entry in committed})


SIGTERM_SETTER = ("ray._private.utils", "set_sigterm_handler")
SIGTERM_LOST = ("SIGTERM to a Ray worker stops it at once (no graceful stop): its workers redo the "
                "steps since the last checkpoint")
PG_CLEANER = "ray.train.v2._internal.callbacks.placement_group_callback"


def graceful_sigterm_in_ray_worker() -> None:
    """Ray workers' setup hook: set_sigterm_handler wrapped to put Ray's handler in GracefulStop."""
    module, name = SIGTERM_SETTER
    setter = ray_internal(module, name)
    if setter is None or getattr(setter, "graceful", False):
        return

    def set_graceful(handler):
        setter(GracefulStop(handler))
    set_graceful.graceful = True
    setattr(sys.modules[module], name, set_graceful)


def check_reachable(address: str) -> None:
    """The cluster's GCS answers before ray.init, which would retry for minutes ('auto': Ray's)."""
    canonicalize = ray_internal("ray._private.services", "canonicalize_bootstrap_address")
    if canonicalize is None and address == "auto":
        return internal_note("ray._private.services.canonicalize_bootstrap_address",
                             "--address auto goes unchecked to Ray, which may retry for minutes")
    try:
        resolved = (canonicalize(address) or "") if canonicalize else address
    except ConnectionError:  # 'auto', and none is recorded
        resolved = ""
    except ValueError:
        raise ConfigError(f"--address {address}: give 'auto' or host:port "
                          f"(e.g. 10.0.0.5:6379)") from None
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError):
        where = (address if address != "auto" else "auto (none is recorded on this machine)"
                 if not resolved else f"{resolved} (--address auto found it on this machine)")
        raise ConfigError(f"no Ray cluster answers at {where}: start one (ray start --head, or ray "
                          f"up cluster.yaml), or drop --address to run on this machine") from None


def set_ray_train_knobs(cfg: Config) -> None:
    """Ray Train's knobs: reports every 0.2 s (not 2 s), --start-timeout, prints not logged too."""
    if ray_internal(*SIGTERM_SETTER) is None:
        internal_note(".".join(SIGTERM_SETTER), SIGTERM_LOST)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(cfg.start_timeout)
    cleaner = ray_internal(PG_CLEANER, "PlacementGroupCleanerCallback")
    parameters = list(inspect.signature(cleaner.__init__).parameters) if cleaner else []
    if parameters != ["self", "check_interval_s", "get_actor_timeout_s", "stop_timeout"]:
        return internal_note("PlacementGroupCleanerCallback(check_interval_s, get_actor_timeout_s, "
                             "stop_timeout)", "each run may take seconds longer to end")
    cleaner.__init__.__defaults__ = (1.0, 1.0, 0.1)  # its waits: 12 s a run without a dashboard


def quiet_ray_train() -> None:
    """Ray Train's chatter at WARNING; the cleaner's traceback for its 0.1 s stop (above), off."""
    logging.getLogger("ray.train").setLevel(logging.WARNING)
    logging.getLogger(PG_CLEANER).setLevel(logging.CRITICAL)


# imported, its functions reach Ray's processes by reference: Ray ships them this file
RUNTIME_ENV = {"env_vars": {}, "worker_process_setup_hook": graceful_sigterm_in_ray_worker,
               **({"py_modules": [sys.modules[__name__]]} if __name__ != "__main__" else {})}


# ==================================================================================================
# doctor: a pre-flight check of a Ray cluster, one line per check, what to do on a failure.
# ==================================================================================================


class Doctor:
    """Each check returns what it found or raises its failure's line; a node's question: a task."""

    def __init__(self, cfg: Config, hang_timeout: float):
        self.cfg, self.hang_timeout, self.nodes = cfg, hang_timeout, {}
        self.logs = tempfile.mkdtemp(prefix="ray-dp-doctor-")

    def ray(self) -> str:
        begun, address = time.time(), self.cfg.address
        start_ray(address)
        self.nodes = node_names([node for node in ray.nodes() if node["Alive"]])
        where = f"at {address}, attached" if address else "started on this machine"
        return f"Ray {ray.__version__} {where} in {time.time() - begun:.1f} s"

    def versions(self) -> str:
        here, nodes = node_software(), self.on_every_node(node_software)
        for node, found in nodes.items():
            if isinstance(found, Exception):
                raise ConfigError(f"node {node} did not answer: {first_line(found)}")
            if (differ := [f"{key} {found[key]} (the driver {here[key]})"
                           for key in here if key != "host" and found[key] != here[key]]):
                raise ConfigError(f"node {node} ({found['host']}) has {', '.join(differ)}: "
                                  f"install requirements.txt into the same Python on every "
                                  f"node (cluster.yaml's setup_commands)")
        same = ", ".join(f"{key} {here[key]}" for key in here if key != "host")
        return f"{plural(len(nodes), 'node')}, the same as the driver's: {same}"

    def resources(self) -> str:
        cluster = cluster_of(self.cfg)
        have = (f"{plural(len(self.nodes), 'node')}, {cluster.now.get('CPU', 0):g} CPUs, "
                f"{cluster.now.get('GPU', 0):g} GPUs now")
        grows = (f"; its node types add up to {cluster.most}" if cluster.most is not None else
                 "" if not self.cfg.address else "; no autoscaler configuration found")
        try:
            with contextlib.redirect_stdout(notes := io.StringIO()):
                self.cfg = settle_device(self.cfg, cluster)
        except ConfigError as exc:
            raise ConfigError(f"{have}{grows}; {exc}") from None
        noted = " ".join(line.removeprefix("note: ") for line in notes.getvalue().splitlines())
        kind = "GPU workers (nccl)" if self.cfg.gpu else "CPU workers (gloo)"
        each = " + ".join(f"{amount:g} {resource}" for resource, amount in
                          resources_per_worker(self.cfg).items())
        return (f"{have}{grows}; --workers {self.cfg.processes}: {kind}, {each} each"
                f"{'; ' + noted if noted else ''}")

    def storage(self) -> str:
        path = self.cfg.storage_path
        check_store("storage-path", path)
        folder = f"{path.rstrip('/')}/.ray-dp-doctor-{os.getpid()}-{time.time():.0f}"
        written = self.on_every_node(write_marker, folder)
        seen = self.on_every_node(read_markers, folder)
        self.on_every_node(remove_markers, folder, {self.nodes[name]: made for name, made in
                                                    written.items() if isinstance(made, str)})
        return storage_verdict(path, written, seen, self.nodes)

    def workers(self) -> str:
        cfg, begun = self.cfg, time.time()
        set_ray_train_knobs(cfg)
        trainer = TorchTrainer(
            doctor_loop_per_worker, train_loop_config={"hang_timeout": self.hang_timeout},
            scaling_config=scaling_config(cfg, cfg.processes),
            run_config=RunConfig(name="probe", storage_path=self.logs,
                                 logging_config=ray.train.LoggingConfig(log_level="WARNING")),
            torch_config=TorchConfig(timeout_s=int(math.ceil(self.hang_timeout))))  # nccl on GPUs
        try:
            probe = trainer.fit().return_value
        except SystemExit:
            raise KeyboardInterrupt from None
        except ray.train.TrainingFailedError as exc:
            append_log(self.logs, str(exc))
            raise ConfigError(f"{probe_failure(exc, self.hang_timeout)}; a rank that never "
                              f"answers is most often bound to a network interface the others "
                              f"cannot reach: set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) on "
                              f"every node") from None
        ranks = probe["ranks"]
        up = max(rank["started"] for rank in ranks) - begun
        where = ", ".join(f"rank {r['rank']} on {r['node']}" for r in ranks)
        return (f"{plural(len(ranks), 'worker')} up in {up:.1f} s (placed, started, "
                f"{probe['backend']} process group); {where}")

    def data(self) -> str:
        cfg = replace(self.cfg, download=False)
        try:
            here = data_files(cfg)
        except DataError:
            if self.cfg.download and data_source(cfg.dataset).downloadable:
                return (f"{cfg.dataset} is not in {cfg.data_dir} yet: a run downloads it there "
                        f"first (not tried here)")
            raise
        if not here["per_sample"]:
            return (f"{cfg.dataset}: {here['train']} train / {here['test']} test samples on the "
                    f"driver, which sends them to the workers (their nodes need no files)")
        for node, found in self.on_every_node(data_files, cfg).items():
            if isinstance(found, Exception):
                raise DataError(f"node {node}: {first_line(found)} (every node that trains reads "
                                f"the images itself)")
            if found != here:
                raise DataError(f"node {node} sees {found['train']} train / {found['test']} val "
                                f"images in {classes_of(found, here)}, the driver "
                                f"{here['train']} / {here['test']} in {classes_of(here, found)}")
        return (f"{cfg.dataset} {cfg.data_dir}: {here['train']} train / {here['test']} val images "
                f"in {plural(len(here['classes']), 'class')}, the same on every node")

    def on_every_node(self, function, *args) -> dict:
        """function(*args) on every node at once, by name: its value or exception (TimeoutError)."""
        remote = ray.remote(num_cpus=0, max_retries=0)(function)
        calls = {name: remote.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id, soft=False)).remote(*args) for name, node_id in self.nodes.items()}
        ready, _ = ray.wait(list(calls.values()), num_returns=len(calls),
                            timeout=self.cfg.start_timeout)
        answers = {}
        for name, call in calls.items():
            try:
                answers[name] = (ray.get(call) if call in ready else TimeoutError(
                    f"no answer within {self.cfg.start_timeout:g} s (--start-timeout)"))
            except Exception as exc:
                answers[name] = exc
        return answers


def doctor_config(command: str, args: dict, typed: set) -> tuple[Config, dict]:
    """The doctor's flags checked as a run's, but --storage-path, which it tries on every node."""
    hang = args.pop("hang_timeout")
    if not (math.isfinite(hang) and hang >= 1):
        raise ConfigError(f"--hang-timeout must be a number of seconds, at least 1, got {hang}")
    cfg = with_absolute_paths(replace(Config(**args), min_workers=0))  # MIN:MAX: MAX must start
    validate(cfg, doctor=True)
    return cfg, {"hang_timeout": hang}


@command("doctor", "doctor: check a Ray cluster before training on it, one line per check: Ray "
         "reachable, the same Python/Ray/torch/torchvision on every node, resources for "
         "--workers, storage every node shares, a worker group of --workers started, the data. "
         "Exits 0 only if every check passed.", DOCTOR_FLAGS, configure=doctor_config,
         arguments={"--hang-timeout": dict(
             type=float, default=30.0, metavar="SECONDS", help="seconds every rank has to come to "
             "each probe collective before the ones that did not are named; also the longest one "
             "probe collective may take (the process group's timeout; default: 30)")})
def doctor(cfg: Config, hang_timeout: float) -> bool:
    """The checks in order, a line each; one is skipped if one it needs failed."""
    where = f"the cluster at {cfg.address}" if cfg.address else "this machine (a local Ray)"
    print(f"ray-dp doctor: {where}, --workers {cfg.workers}, storage {cfg.storage_path}, "
          f"data {cfg.dataset}", flush=True)
    check = Doctor(cfg, hang_timeout)
    checks = [("Ray", check.ray, None), ("versions", check.versions, "Ray"),
              ("resources", check.resources, "Ray"), ("storage", check.storage, "Ray"),
              ("workers", check.workers, "resources"), ("data", check.data, "Ray")]
    started, passed, log = time.time(), set(), os.path.join(check.logs, "ray.log")
    for name, run, needs in checks:
        if needs and needs not in passed:
            print(f"skipped {name:<10} (needs {needs})", flush=True)
            continue
        try:
            says, passed = run(), passed | {name}
        except (ConfigError, DataError) as exc:
            says = str(exc)
        except Exception as exc:
            says = f"{first_line(exc)} (the check itself failed)"
        print(f"{'ok' if name in passed else 'FAILED':<7} {name:<10} {says}", flush=True)
    failed, seconds = len(checks) - len(passed), time.time() - started
    if not os.path.isfile(log):  # only a failed workers check writes it
        shutil.rmtree(check.logs, ignore_errors=True)
    print(f"doctor: all {len(checks)} checks passed in {seconds:.1f} s" if not failed else
          f"doctor: {failed} of {len(checks)} checks failed or were skipped ({seconds:.1f} s)"
          + (f"; Ray's errors are in {log}" if os.path.isfile(log) else ""), flush=True)
    return not failed


def node_software() -> dict:
    import torchvision
    return {"host": socket.gethostname(), "python": sys.version.split()[0], "ray": ray.__version__,
            "torch": torch.__version__, "torchvision": torchvision.__version__}


def node_names(nodes: list) -> dict:
    addresses = [node["NodeManagerAddress"] for node in nodes]
    return {(f"{address} ({node['NodeID'][:8]})" if addresses.count(address) > 1 else address):
            node["NodeID"] for node, address in zip(nodes, addresses)}


def write_marker(folder: str) -> Optional[str]:
    """On one node: a file named after its node ID in folder; the first directory it made."""
    files, path = files_at(folder)
    created = next((part for part in [*map(str, reversed(PurePosixPath(path).parents)), path]
                    if part != "." and files.get_file_info(part).type == fs.FileType.NotFound),
                   None)
    write_stored(f"{folder}/{ray.get_runtime_context().get_node_id()}", b"ray_dp.py doctor\n")
    return created


def read_markers(folder: str) -> list:
    files, path = files_at(folder)
    return [info.base_name for info in
            files.get_file_info(fs.FileSelector(path, allow_not_found=True))]


def remove_markers(folder: str, created: dict) -> None:
    with contextlib.suppress(OSError, ArrowException, ValueError):
        if (made := created.get(ray.get_runtime_context().get_node_id())):
            files_at(folder)[0].delete_dir(made)


def storage_verdict(storage: str, written: dict, seen: dict, node_ids: dict) -> str:
    """Each node's answers (the first directory it made, the markers it saw) or its exception."""
    for node, answer in written.items():
        if isinstance(answer, BaseException):
            raise ConfigError(f"node {node} cannot write under {storage}: {first_line(answer)}; "
                              f"choose a --storage-path every node can write (s3://... or a "
                              f"shared file system)")
    for reader, markers in seen.items():
        if isinstance(markers, BaseException):
            raise ConfigError(f"node {reader} cannot read {storage}: {first_line(markers)}")
        if (missing := [writer for writer in written if node_ids[writer] not in markers]):
            raise ConfigError(f"node {reader} cannot see what node {missing[0]} wrote under "
                              f"{storage}: use s3:// or a shared file system (rank 0 saves the "
                              f"checkpoints wherever it runs; every node reads them to resume)")
    if len(written) == 1:
        return f"{storage}: the node wrote a marker and read it back"
    return (f"{storage}: {len(written)} nodes each wrote a marker and each read all "
            f"{len(written)} back (shared)")


def data_files(cfg: Config) -> dict:
    train, test = loaded(cfg)
    train[0]
    named = isinstance(train, TensorDataset) or getattr(train, "classes", None)
    return {"train": len(train), "test": len(test), "classes": class_names(train) if named else [],
            "per_sample": not isinstance(train, TensorDataset)}


def classes_of(seen: dict, other: dict) -> str:
    only = [name for name in seen["classes"] if name not in other["classes"]]
    names = plural(len(seen["classes"]), "class")
    return f"{names} (only here: {', '.join(only)})" if only else names


def doctor_loop_per_worker(config: dict) -> Optional[dict]:
    """A doctor's worker: where it runs, after a barrier that names the ranks that do not come."""
    started, backend = time.time(), dist.get_backend()  # TorchConfig has set the CUDA device
    # torch's monitored_barrier is gloo's alone: an NCCL run gets a gloo group beside its own
    watch = None if backend == "gloo" else dist.new_group(backend="gloo")
    dist.monitored_barrier(watch, timeout=timedelta(seconds=config["hang_timeout"]),
                           wait_all_ranks=True)  # rank 0's error names the ranks that did not come
    me = {"rank": dist.get_rank(), "node": ray.util.get_node_ip_address(), "started": started}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, me)
    return {"ranks": ranks, "backend": backend} if dist.get_rank() == 0 else None


def probe_failure(error: ray.train.TrainingFailedError, seconds: float) -> str:
    for _, failure in sorted(getattr(error, "worker_failures", {}).items()):
        if (absent := re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(failure))):
            return (f"rank {absent[1]} did not come to the first collective within {seconds:g} s "
                    f"(--hang-timeout)")
    return describe_training_error(error, {})


if __name__ == "__main__":
    gc.freeze()  # the imports' objects out of every collection: most of a second of a short run
    sys.exit(main())
