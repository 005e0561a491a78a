#!/usr/bin/env python
"""ray-dp: data-parallel PyTorch training on N Ray workers, in one file.

The DDP tutorial's loop (DistributedDataParallel, DistributedSampler + set_epoch,
gradient accumulation with no_sync, loss all-reduced for logging, optional
SyncBatchNorm, rank-0-only checkpoints, exact multi-worker evaluation), started
on N workers by Ray Train's TorchTrainer: GPU workers (nccl) when the cluster
has GPUs, CPU workers (gloo) otherwise.

Run it:
    python ray_dp.py --workers 2 --dataset digits        # offline quick start (CPU)
    python ray_dp.py --workers 8 --cpus-per-worker 0.25  # 8 workers on a 2-core laptop
    python ray_dp.py --workers 8 --model resnet18        # Fashion-MNIST, downloaded to ./data
    python ray_dp.py --dataset cifar10 --model resnet18 --sync-bn --accum-steps 2
    python ray_dp.py --name myrun ...                    # run it again with the same name to resume
    python ray_dp.py --address auto ...                  # attach to a running cluster (ray up cluster.yaml)
    python ray_dp.py --help                              # every flag, with units and defaults

Outputs go to <storage-path>/<name>/: one checkpoint_epoch_NNN/ per epoch and result.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DistributedSampler, TensorDataset

import ray
import ray.train
import ray.train.torch
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer

# ============================================================================
# Config: every field is a command-line flag (--field-name), with its help.
# ============================================================================

MODES = ("ddp",)
MODELS = ("lenet", "resnet18", "mlp")
DATASETS = ("fashion-mnist", "cifar10", "digits", "synthetic")
NUM_CLASSES = 10


def option(default, help, **argparse_kwargs):
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass
class Config:
    mode: str = option("ddp", "training mode: ddp = DistributedDataParallel on every worker", choices=MODES)
    workers: int = option(2, "number of training workers (processes); each gets one GPU on a GPU cluster")
    cpus_per_worker: float = option(1.0, "CPU cores reserved per worker; fractions allowed (0.25 fits 8 workers on 2 cores)")
    gpu: Optional[bool] = option(None, "use GPU workers (default: yes when the cluster has GPUs)")
    epochs: int = option(10, "number of passes over the training set")
    batch_size: int = option(64, "GLOBAL batch: samples per optimizer step summed over all workers "
                             "(per-worker micro-batch = batch-size / (workers x accum-steps))")
    lr: float = option(0.05, "SGD learning rate (peak, at epoch 1)")
    lr_schedule: str = option("cosine", "learning rate over epochs: cosine decay to 0, or constant",
                              choices=("cosine", "constant"))
    momentum: float = option(0.9, "SGD momentum (0 = the lessons' plain SGD)")
    accum_steps: int = option(1, "micro-batches accumulated per optimizer step (gradients synced only on the last)")
    sync_bn: bool = option(False, "synchronise BatchNorm statistics across workers (models with BatchNorm only)")
    model: str = option("lenet", "network", choices=MODELS)
    dataset: str = option("fashion-mnist", "data set; digits (1,797 real digits from scikit-learn) needs no download",
                          choices=DATASETS)
    data_dir: str = option("./data", "where data sets are stored and downloaded to (a directory)")
    download: bool = option(True, "download a missing Fashion-MNIST / CIFAR-10 into --data-dir")
    seed: int = option(0, "random seed for model init and data order (the same on every worker)")
    storage_path: str = option("./runs", "directory (or s3://bucket/path on a cluster) for checkpoints and result.json")
    name: str = option("", "run name, the sub-directory of --storage-path; reuse it to resume (default: mode-model-dataset-time)")
    address: str = option("", "Ray cluster to attach to ('auto' or host:port; default: start a fresh local one)")

    @property
    def micro_batch(self) -> int:
        """Samples per worker per forward/backward pass."""
        return self.batch_size // (self.workers * self.accum_steps)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.storage_path, self.name)


class ConfigError(ValueError):
    """Bad input: reported as one line, before any cluster starts."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence instead of usage + error
        raise ConfigError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ray_dp.py", description=__doc__.split("\n\n")[0],
                     formatter_class=argparse.ArgumentDefaultsHelpFormatter, allow_abbrev=False)
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kwargs = dict(f.metadata)
        if f.name == "gpu":
            group = parser.add_mutually_exclusive_group()
            # SUPPRESS: an absent flag leaves Config's None (= decide from the cluster), not a printed default.
            group.add_argument("--gpu", dest="gpu", action="store_const", const=True, default=argparse.SUPPRESS,
                               help=kwargs["help"])
            group.add_argument("--cpu", dest="gpu", action="store_const", const=False, default=argparse.SUPPRESS,
                               help="use CPU workers (gloo backend)")
        elif isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, **kwargs)
        else:
            metavar = None if "choices" in kwargs else f.name.split("_")[-1].upper()
            parser.add_argument(flag, type=type(f.default), default=f.default, metavar=metavar, **kwargs)
    return parser


def parse_config(argv) -> Config:
    cfg = Config(**vars(build_parser().parse_args(argv)))
    validate(cfg)
    cfg.data_dir = os.path.abspath(cfg.data_dir)  # workers run in another cwd
    if "://" not in cfg.storage_path:
        cfg.storage_path = os.path.abspath(cfg.storage_path)
    cfg.name = cfg.name or f"{cfg.mode}-{cfg.model}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    return cfg


def validate(cfg: Config) -> None:
    checks = [
        (cfg.workers >= 1, f"--workers must be at least 1, got {cfg.workers}"),
        (cfg.cpus_per_worker > 0, f"--cpus-per-worker must be positive, got {cfg.cpus_per_worker}"),
        (cfg.epochs >= 1, f"--epochs must be at least 1, got {cfg.epochs}"),
        (cfg.accum_steps >= 1, f"--accum-steps must be at least 1, got {cfg.accum_steps}"),
        (cfg.batch_size >= 1, f"--batch-size must be at least 1, got {cfg.batch_size}"),
        (cfg.lr > 0, f"--lr must be positive, got {cfg.lr}"),
        (0 <= cfg.momentum < 1, f"--momentum must be in [0, 1), got {cfg.momentum}"),
        (not (cfg.sync_bn and cfg.model != "resnet18"),
         f"--sync-bn needs a model with BatchNorm (resnet18); {cfg.model} has none"),
        (not os.path.exists(cfg.data_dir) or os.path.isdir(cfg.data_dir),
         f"--data-dir {cfg.data_dir} exists but is not a directory"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    per_step = cfg.workers * cfg.accum_steps
    if cfg.batch_size % per_step:
        raise ConfigError(f"--batch-size {cfg.batch_size} must divide by workers x accum-steps = {per_step} "
                          f"(the global batch is split evenly into per-worker micro-batches)")


# ============================================================================
# Data: whole data sets as tensors in memory (all four fit easily).
# ============================================================================

def load_dataset(cfg: Config) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) as float images in [0, 1] of shape (N, C, H, W) and int64 labels."""
    if cfg.dataset == "digits":
        return load_digits()
    if cfg.dataset == "synthetic":
        return make_synthetic(cfg.seed)
    from torchvision.datasets import CIFAR10, FashionMNIST
    dataset_class = {"fashion-mnist": FashionMNIST, "cifar10": CIFAR10}[cfg.dataset]
    return load_torchvision(dataset_class, cfg.data_dir, cfg.download)


def load_digits(test_size: int = 360) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1,797 real 8x8 digits (shipped in its wheel), resized to 28x28 like MNIST."""
    from sklearn.datasets import load_digits as sklearn_digits
    digits = sklearn_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    # A fixed split, independent of --seed, so every run is scored on the same digits.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:test_size], order[test_size:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[test], labels[test])


def make_synthetic(seed: int, n_train: int = 512, n_test: int = 100) -> tuple[TensorDataset, TensorDataset]:
    """Random 1x28x28 images and labels: for smoke tests (n_test=100 is deliberately not a multiple of 3)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n_train + n_test, 1, 28, 28, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (n_train + n_test,), generator=gen)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


class DataError(RuntimeError):
    """The data set is missing and could not be fetched."""


def load_torchvision(dataset_class, root: str, download: bool) -> tuple[TensorDataset, TensorDataset]:
    from filelock import FileLock
    os.makedirs(root, exist_ok=True)
    # Workers sharing a node would otherwise download and unpack the same files at once.
    with FileLock(os.path.join(root, f".{dataset_class.__name__}.lock")):
        try:
            splits = [dataset_class(root, train=train, download=download) for train in (True, False)]
        except (RuntimeError, OSError) as exc:  # not found / corrupt / no network (URLError is an OSError)
            raise DataError(f"{dataset_class.__name__} is not in {root} and could not be "
                            f"{'downloaded' if download else 'loaded (--no-download)'} ({exc}); "
                            f"put its files there with --data-dir DIR, or use --dataset digits (offline)") from None
    return tuple(images_to_tensors(split) for split in splits)


def images_to_tensors(split) -> TensorDataset:
    images = torch.as_tensor(split.data)
    # Fashion-MNIST holds (N, H, W) uint8, CIFAR-10 (N, H, W, C): both become (N, C, H, W) floats.
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    return TensorDataset(images.float().div(255), torch.as_tensor(split.targets, dtype=torch.int64))


# ============================================================================
# Models: the lessons' LeNet and ResNet-18, and a small MLP.
# ============================================================================

class LeNet(nn.Module):
    """d2l's LeNet: conv 3x3 -> avgpool -> conv 5x5 -> avgpool -> 128 -> 10 (800 features on 28x28)."""

    def __init__(self, in_channels: int = 1, image_size: int = 28):
        super().__init__()
        side = ((image_size - 2) // 2 - 4) // 2
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 20, kernel_size=3), nn.ReLU(), nn.AvgPool2d(2),
            nn.Conv2d(20, 50, kernel_size=5), nn.ReLU(), nn.AvgPool2d(2), nn.Flatten())
        self.classifier = nn.Sequential(nn.Linear(50 * side * side, 128), nn.ReLU(), nn.Linear(128, NUM_CLASSES))

    def forward(self, x):
        return self.classifier(self.features(x))


class Residual(nn.Module):
    """ResNet basic block: two 3x3 convs with BatchNorm, plus a 1x1 conv shortcut when the shape changes."""

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


def resnet18(in_channels: int = 1) -> nn.Sequential:
    """d2l's small-image ResNet-18: 3x3 stride-1 stem, no max-pool, 4 stages of 2 blocks, global avg pool."""
    def stage(c_in, c_out, first):
        return nn.Sequential(Residual(c_in, c_out, stride=1 if first else 2), Residual(c_out, c_out))
    return nn.Sequential(
        nn.Conv2d(in_channels, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        stage(64, 64, True), stage(64, 128, False), stage(128, 256, False), stage(256, 512, False),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, NUM_CLASSES))


def build_model(name: str, sample_shape: tuple[int, ...]) -> nn.Module:
    channels, size = sample_shape[0], sample_shape[-1]
    if name == "lenet":
        return LeNet(channels, size)
    if name == "resnet18":
        return resnet18(channels)
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, 256), nn.ReLU(), nn.Linear(256, NUM_CLASSES))


# ============================================================================
# Distributed helpers
# ============================================================================

def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over workers in place (a no-op on one worker)."""
    if rank_and_world()[1] > 1:
        dist.all_reduce(tensor)
    return tensor


class SyncBatchNormCPU(nn.BatchNorm2d):
    """BatchNorm whose batch statistics span all workers, for CPU/gloo, where torch's SyncBatchNorm refuses to run.

    One all-reduce of [sum(x), sum(x^2), count] per channel gives the global mean and variance. The
    all-reduce is autograd-aware, so the backward pass also sums the statistics' gradients across
    workers, which is what makes the gradients equal to BatchNorm over the whole global batch.
    """

    def forward(self, x):
        if not self.training or rank_and_world()[1] == 1:
            return super().forward(x)
        channels = x.shape[1]
        dims = [0, 2, 3]
        count = torch.full((1,), x.numel() / channels, dtype=x.dtype, device=x.device)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = dist_fn.all_reduce(local)
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels:2 * channels] / n - mean * mean
        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean.detach(), self.momentum)
            self.running_var.lerp_(var.detach() * n / (n - 1), self.momentum)  # unbiased, as BatchNorm keeps it
        shape = (1, channels, 1, 1)
        x_hat = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return x_hat * self.weight.view(shape) + self.bias.view(shape)


def convert_sync_bn(model: nn.Module, device: torch.device) -> nn.Module:
    """Swap every BatchNorm2d for a synchronised one: torch's on GPU, SyncBatchNormCPU on CPU."""
    if device.type == "cuda":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for name, child in model.named_children():
        if type(child) is nn.BatchNorm2d:
            synced = SyncBatchNormCPU(child.num_features, child.eps, child.momentum)
            synced.load_state_dict(child.state_dict())
            setattr(model, name, synced)
        else:
            convert_sync_bn(child, device)
    return model


def wrap_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """DDP on more than one worker; the bare model on one (nothing to synchronise)."""
    if rank_and_world()[1] == 1:
        return model
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, DDP) else model


def grad_sync(model: nn.Module, sync: bool):
    """DDP's no_sync() on accumulation micro-steps: their gradients stay local until the last one."""
    return model.no_sync() if isinstance(model, DDP) and not sync else contextlib.nullcontext()


def train_sampler(data: TensorDataset, rank: int, world: int, seed: int) -> DistributedSampler:
    """This rank's shuffled shard. drop_last: every rank gets the same count, so the same number of steps."""
    return DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)


def shard_indices(n: int, rank: int, world: int) -> torch.Tensor:
    """Every index exactly once across ranks (no padded duplicates, unlike DistributedSampler)."""
    return torch.arange(rank, n, world)


# ============================================================================
# Train and evaluate (run on every worker)
# ============================================================================

def learning_rate(cfg: Config, epoch: int) -> float:
    """The epoch's learning rate, a pure function of the epoch (torch's CosineAnnealingLR, per epoch, to 0):
    nothing to save or restore, so a resumed run continues on exactly the same schedule."""
    if cfg.lr_schedule == "constant":
        return cfg.lr
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * epoch / cfg.epochs))


def train_epoch(model, optimizer, data: TensorDataset, sampler: DistributedSampler, cfg: Config,
                device: torch.device, epoch: int) -> dict:
    """One pass over this worker's shard; returns the train loss averaged over ALL workers' samples."""
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, epoch)
    sampler.set_epoch(epoch)  # a new shuffle each epoch, the same one on every rank
    images, labels = data.tensors
    micro_batches = list(BatchSampler(sampler, cfg.micro_batch, drop_last=True))
    steps = len(micro_batches) // cfg.accum_steps  # every rank gets the same count: no rank waits on a missing all-reduce
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    data_seconds, start = 0.0, time.perf_counter()
    for step in range(steps):
        for micro in range(cfg.accum_steps):
            tic = time.perf_counter()
            index = torch.tensor(micro_batches[step * cfg.accum_steps + micro])
            x, y = images[index].to(device, non_blocking=True), labels[index].to(device, non_blocking=True)
            data_seconds += time.perf_counter() - tic
            last = micro == cfg.accum_steps - 1
            with grad_sync(model, sync=last):
                loss = F.cross_entropy(model(x), y)
                # Dividing by K makes K accumulated micro-batches one mean over the whole step's samples.
                (loss / cfg.accum_steps).backward()
            loss_sum += loss.detach() * len(index)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    seconds = time.perf_counter() - start
    local_samples = torch.tensor(steps * cfg.accum_steps * cfg.micro_batch, dtype=torch.float64, device=device)
    totals = all_reduce_sum(torch.stack([loss_sum, local_samples]))
    samples = int(totals[1].item())
    return {"train_loss": (totals[0] / totals[1]).item(), "lr": optimizer.param_groups[0]["lr"],
            "train_samples": samples, "epoch_seconds": seconds,
            "samples_per_second": samples / seconds, "data_seconds": data_seconds}


@torch.no_grad()
def evaluate(model: nn.Module, data: TensorDataset, device: torch.device, batch_size: int = 1000) -> dict:
    """Exact test metrics: each worker scores its own disjoint shard, then ONE all-reduce of [loss, correct, count]."""
    net = unwrap(model).eval()  # the bare module: DDP's forward would sync buffers (a collective) per batch
    rank, world = rank_and_world()
    images, labels = data.tensors
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for index in shard_indices(len(labels), rank, world).split(batch_size):
        x, y = images[index].to(device), labels[index].to(device)
        logits = net(x)
        totals += torch.stack([F.cross_entropy(logits, y, reduction="sum"),
                               (logits.argmax(1) == y).sum(), torch.tensor(len(y), device=device)]).double()
    all_reduce_sum(totals)
    net.train()
    loss_sum, correct, count = totals.tolist()
    return {"test_loss": loss_sum / count, "test_acc": correct / count, "test_count": int(count)}


# ============================================================================
# Checkpoints: rank 0 saves the unwrapped model; Ray copies it to storage.
# ============================================================================

CHECKPOINT_FILE = "checkpoint.pt"


def checkpoint_state(model, optimizer, epoch: int, cfg: Config, history: list) -> dict:
    return {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
            "config": asdict(cfg), "history": history}


def load_checkpoint(path: str) -> dict:
    # weights_only: a checkpoint is data (tensors, numbers, strings), never code to run.
    return torch.load(path, map_location="cpu", weights_only=True)


def report_epoch(metrics: dict, state: Optional[dict], epoch: int) -> None:
    """Every rank calls report (it is a barrier); only rank 0 passes a checkpoint (state)."""
    dir_name = f"checkpoint_epoch_{epoch:03d}"
    if state is None:
        ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=dir_name)
        return
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(state, os.path.join(tmp, CHECKPOINT_FILE))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp), checkpoint_dir_name=dir_name)


def restore(model, optimizer) -> tuple[int, list]:
    """(first epoch to run, metrics history) from Ray's latest checkpoint, if this run has one."""
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0, []
    with checkpoint.as_directory() as directory:
        state = load_checkpoint(os.path.join(directory, CHECKPOINT_FILE))
    unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1, state["history"]


# ============================================================================
# The worker loop (Ray runs one copy per worker)
# ============================================================================

def format_epoch(m: dict, epochs: int) -> str:
    return (f"epoch {m['epoch'] + 1}/{epochs}: train loss {m['train_loss']:.4f}, test loss {m['test_loss']:.4f}, "
            f"test acc {m['test_acc']:.4f}, {m['epoch_seconds']:.1f} s, {m['samples_per_second']:.0f} samples/s")


def train_loop_per_worker(config: dict) -> dict:
    cfg = Config(**config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    is_main = rank == 0
    device = ray.train.torch.get_device()
    torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))  # Ray sets OMP_NUM_THREADS=1 in workers

    train_set, test_set = load_dataset(cfg)
    torch.manual_seed(cfg.seed)  # identical initial weights on every rank (DDP also broadcasts rank 0's)
    model = build_model(cfg.model, train_set.tensors[0].shape[1:])
    if cfg.sync_bn:
        model = convert_sync_bn(model, device)  # before DDP, which must see the final modules
    model = wrap_ddp(model.to(device), device)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)  # created once
    start_epoch, history = restore(model, optimizer)
    if is_main and start_epoch >= cfg.epochs:
        print(f"run '{cfg.name}' already finished its {cfg.epochs} epochs; nothing to train", flush=True)
    elif is_main and start_epoch:
        print(f"resumed from the checkpoint of epoch {start_epoch}; continuing at epoch {start_epoch + 1}", flush=True)
    sampler = train_sampler(train_set, rank, world, cfg.seed)

    for epoch in range(start_epoch, cfg.epochs):
        metrics = {"epoch": epoch, **train_epoch(model, optimizer, train_set, sampler, cfg, device, epoch),
                   **evaluate(model, test_set, device)}
        history.append(metrics)
        if is_main:
            print(format_epoch(metrics, cfg.epochs), flush=True)
        state = checkpoint_state(model, optimizer, epoch, cfg, history) if is_main else None
        report_epoch(metrics, state, epoch)
    return {"history": history, "world_size": world, "device": device.type}


# ============================================================================
# Ray driver
# ============================================================================

def quiet_ray_logs():
    """Runs in every Ray worker process: keep Ray Train's routine chatter off the console."""
    from ray.train.v2._internal.execution import context
    # A harmless error that needs Ray's dashboard (not installed).
    logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner").setLevel(logging.ERROR)
    # "Reporting training result ..." per rank per epoch; this logger is named by file path, so
    # LoggingConfig(log_level) does not reach it.
    logging.getLogger(context.__file__).setLevel(logging.WARNING)


# PRINT_PATCH=0: rank 0's epoch lines reach the console once, not once as print and again as a log record.
RUNTIME_ENV = {"env_vars": {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"},
               "worker_process_setup_hook": quiet_ray_logs}


def check_resources(cfg: Config, cpus: float, gpus: float) -> None:
    if cfg.gpu and gpus < 1:
        raise ConfigError("--gpu was given but this machine has no GPU (use --cpu)")
    need_cpus, need_gpus = cfg.workers * cfg.cpus_per_worker, cfg.workers if cfg.gpu else 0
    if need_cpus > cpus or need_gpus > gpus:
        raise ConfigError(f"{cfg.workers} workers need {need_cpus:g} CPUs and {need_gpus} GPUs but the cluster has "
                          f"{cpus:g} CPUs and {gpus:g} GPUs (lower --workers or --cpus-per-worker)")


def connect(cfg: Config) -> None:
    """Start (or attach to) Ray; settle --gpu/--cpu and check resources first, so nothing starts in vain."""
    if ray.is_initialized():  # e.g. a test session sharing one local cluster
        resources = ray.cluster_resources()
        cfg.gpu = resources.get("GPU", 0) > 0 if cfg.gpu is None else cfg.gpu
        check_resources(cfg, resources.get("CPU", 0), resources.get("GPU", 0))
        return
    if cfg.address:
        ray.init(address=cfg.address, runtime_env=RUNTIME_ENV, logging_level=logging.WARNING)
        resources = ray.cluster_resources()
        cfg.gpu = resources.get("GPU", 0) > 0 if cfg.gpu is None else cfg.gpu
        # An autoscaling cluster may still add nodes, so a shortfall is only a warning here.
        if cfg.workers * (1 if cfg.gpu else 0) > resources.get("GPU", 0):
            print(f"note: the cluster has {resources.get('GPU', 0):g} GPUs now; waiting for more to join", flush=True)
        return
    gpus = torch.cuda.device_count()
    cfg.gpu = gpus > 0 if cfg.gpu is None else cfg.gpu
    check_resources(cfg, os.cpu_count() or 1, gpus)
    ray.init(address="local", runtime_env=RUNTIME_ENV, logging_level=logging.WARNING, include_dashboard=False)


def check_data(cfg: Config) -> tuple[int, int]:
    """Load (downloading if needed) on the driver, so a missing data set fails before any worker starts."""
    train_set, test_set = load_dataset(cfg)
    steps = len(train_set) // cfg.workers // (cfg.micro_batch * cfg.accum_steps)
    if steps < 1:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the {len(train_set)} training samples "
                          f"of {cfg.dataset} allow for one step")
    return len(train_set), len(test_set)


def describe(cfg: Config, sizes: tuple[int, int]) -> str:
    return (f"ray-dp: {cfg.mode} {cfg.model} on {cfg.dataset} ({sizes[0]} train / {sizes[1]} test), "
            f"{cfg.workers} {'GPU' if cfg.gpu else 'CPU'} workers, global batch {cfg.batch_size} = "
            f"{cfg.micro_batch} per worker x {cfg.workers} workers x {cfg.accum_steps} accum, "
            f"lr {cfg.lr}, {cfg.epochs} epochs, run dir {cfg.run_dir}")


def fit(cfg: Config) -> ray.train.Result:
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=asdict(cfg),
        scaling_config=ScalingConfig(num_workers=cfg.workers, use_gpu=cfg.gpu,
                                     resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.gpu else {})}),
        run_config=RunConfig(name=cfg.name, storage_path=cfg.storage_path,
                             checkpoint_config=CheckpointConfig(num_to_keep=None),
                             logging_config=ray.train.LoggingConfig(log_level="WARNING")),  # no per-report INFO lines
        torch_config=TorchConfig(backend="nccl" if cfg.gpu else "gloo"),
    )
    return trainer.fit()


def summarize(cfg: Config, result: ray.train.Result) -> dict:
    out = result.return_value
    history = out["history"]
    final = history[-1]
    timed = history[1:] or history  # epoch 1 includes warm-up; leave it out of sec/epoch when we can
    summary = {
        "config": asdict(cfg), "epochs": history, "final": final,
        "sec_per_epoch": sum(m["epoch_seconds"] for m in timed) / len(timed),
        "world_size": out["world_size"], "device": out["device"],
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
    }
    write_json(os.path.join(cfg.run_dir, "result.json"), summary)
    return summary


def write_json(path: str, data: dict) -> None:
    if "://" in path:  # cloud storage: Ray already holds the checkpoints there; keep result.json local
        path = os.path.basename(path)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=2)
    os.replace(path + ".tmp", path)  # never a half-written result.json


def run(cfg: Config) -> dict:
    sizes = check_data(cfg)
    connect(cfg)
    print(describe(cfg, sizes), flush=True)
    summary = summarize(cfg, fit(cfg))
    print(f"test acc: {summary['final']['test_acc']:.2f}, {summary['sec_per_epoch']:.1f} sec/epoch "
          f"on {summary['world_size']} workers ({summary['device']})", flush=True)
    return summary


# ============================================================================
# main
# ============================================================================

def main(argv=None) -> int:
    try:
        run(parse_config(argv))
    except (ConfigError, DataError) as exc:
        print(f"ray_dp.py: error: {exc}", file=sys.stderr)
        return 2
    except ray.train.TrainingFailedError as exc:
        print(f"ray_dp.py: training failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
