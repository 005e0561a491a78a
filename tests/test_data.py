"""Data loaders: torchvision's real on-disk formats (files written here), and the offline digits."""
import pickle
import struct

import numpy as np
import pytest
import torch
import torchvision.datasets.cifar

import ray_dp
from helpers import IMPORTED_BEFORE_PRELOAD, run_distributed


def write_idx(path, array):
    """IDX, the MNIST file format: magic (0, 0, dtype 0x08 = uint8, ndim), big-endian sizes, raw bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(struct.pack(">BBBB", 0, 0, 0x08, array.ndim))
        f.write(struct.pack(f">{array.ndim}I", *array.shape))
        f.write(array.astype(np.uint8).tobytes())


def test_fashion_mnist_loader_reads_idx_files(tmp_path):
    rng = np.random.default_rng(0)
    raw = tmp_path / "FashionMNIST" / "raw"
    images = {"train": rng.integers(0, 256, (20, 28, 28)), "t10k": rng.integers(0, 256, (7, 28, 28))}
    labels = {"train": rng.integers(0, 10, 20), "t10k": rng.integers(0, 10, 7)}
    for split in images:
        write_idx(raw / f"{split}-images-idx3-ubyte", images[split])
        write_idx(raw / f"{split}-labels-idx1-ubyte", labels[split])
    # download=True: present files must be used as they are (no network is touched here).
    train, test = ray_dp.load_dataset(ray_dp.Config(dataset="fashion-mnist", data_dir=str(tmp_path)))
    assert train.tensors[0].shape == (20, 1, 28, 28) and test.tensors[0].shape == (7, 1, 28, 28)
    torch.testing.assert_close(test.tensors[0][3, 0], torch.tensor(images["t10k"][3], dtype=torch.float32) / 255)
    assert test.tensors[1].tolist() == labels["t10k"].tolist()


def test_cifar10_loader_reads_python_pickles(tmp_path, monkeypatch):
    # torchvision checks each file's MD5 against the real CIFAR-10; these files are in the real format
    # but not the real content, so only the checksum is waived.
    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda path, md5=None: True)
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    rng = np.random.default_rng(1)
    batches = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batches[name] = {"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), "labels": list(rng.integers(0, 10, 4))}
        (folder / name).write_bytes(pickle.dumps(batches[name]))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{i}" for i in range(10)]}))
    train, test = ray_dp.load_dataset(ray_dp.Config(dataset="cifar10", data_dir=str(tmp_path), download=False))
    assert train.tensors[0].shape == (20, 3, 32, 32) and test.tensors[0].shape == (4, 3, 32, 32)
    # CIFAR rows are channel-major 32x32 planes: pixel (c=2, y=1, x=5) is byte 2*1024 + 1*32 + 5.
    assert test.tensors[0][0, 2, 1, 5].item() == pytest.approx(batches["test_batch"]["data"][0, 2 * 1024 + 37] / 255)
    assert test.tensors[1].tolist() == [int(v) for v in batches["test_batch"]["labels"]]


def test_digits_is_a_fixed_28x28_split_of_all_1797_digits():
    (train, test), (train2, test2) = ray_dp.load_digits(), ray_dp.load_digits()
    assert train.tensors[0].shape == (1437, 1, 28, 28) and test.tensors[0].shape == (360, 1, 28, 28)
    assert torch.equal(test.tensors[0], test2.tensors[0]) and torch.equal(train.tensors[1], train2.tensors[1])
    assert 0.0 <= train.tensors[0].min() and train.tensors[0].max() <= 1.0
    assert set(test.tensors[1].tolist()) == set(range(10))


def sklearn_imported_by_load_digits():
    import sys
    for name in [name for name in sys.modules if name.partition(".")[0] == "sklearn"]:
        del sys.modules[name]  # (whatever the ranks' server had imported)
    ray_dp.load_digits()
    return "sklearn" in sys.modules


def test_digits_are_scikit_learns_own_read_without_importing_it():
    from sklearn.datasets import load_digits
    pixels, labels = ray_dp.sklearn_digits_file()
    digits = load_digits()
    assert (pixels.reshape(-1, 8, 8) == digits.images).all() and (labels == digits.target).all()
    assert len(labels) == 1797
    # nor does importing ray_dp (what this process had imported when its tests were collected, before this test
    # imported scikit-learn), and reading them does not either (in a process that then forgets scikit-learn)
    assert "ray_dp" in IMPORTED_BEFORE_PRELOAD and "sklearn" not in IMPORTED_BEFORE_PRELOAD
    assert run_distributed(sklearn_imported_by_load_digits, 1) == [False]


def test_models_map_images_to_10_logits():
    for name, shape in [("lenet", (1, 28, 28)), ("lenet", (3, 32, 32)), ("mlp", (1, 28, 28)), ("resnet18", (3, 32, 32))]:
        assert ray_dp.build_model(name, shape)(torch.zeros(2, *shape)).shape == (2, 10)
    lenet = ray_dp.build_model("lenet", (1, 28, 28))
    assert lenet.classifier[0].in_features == 800  # the lesson's 50 x 4 x 4
