"""The differential layer (#22): valid flag combinations, each trained for a few steps by ray_dp's own worker loop
(train_worker: the loop Ray and torchrun run) on 2 or 3 gloo processes, and by one process on the same global
batch. The N-worker run must end where the one process does, and score every test sample once.

Tolerance. The N-worker run adds the same per-sample gradient terms as the one process, in another order (each
rank's mean, then the all-reduce's sum, against one mean over the global batch), so the two differ by rounding
alone, which the network then amplifies: for the lessons' ResNet-18 on 24 random images, one process's own fp32
gradients differ from its fp64 ones by ~1.5e-3 (of 0.24) after a single step, so no fp32 bound could tell a
wrong gradient from rounding there. The exact combinations therefore train in fp64 (the default dtype in every
process; rounding ~1e-16, amplified by at most ~1e4 over 8 steps): bound 1e-9 absolute + 1e-7 relative, which a
real error (a sample counted twice or left out, BatchNorm statistics of one rank, one rank's augmentation)
exceeds by orders of magnitude. --amp is bf16 autocast, which rounds activations to 8 bits of mantissa in
convolutions whose blocking differs with the micro-batch (fp16's GradScaler skips the same overflowing steps on
N workers as on one): those combinations train LeNet in fp32 with a bound of 2e-2. Test metrics are compared within the same bounds; test counts exactly.
"""
import contextlib
import copy
import os

import pytest
import torch
import torch.distributed as dist

import ray_dp
from helpers import REPO, train_worker, Distributed, run_distributed
from test_trust import tiny_folder

# Its tests share a module-scoped fixture of many runs on 2 and 3 gloo processes: under pytest-xdist they run on one
# worker (which computes it once), as do test_spot's, one module after the other: the ranks of either take both cores,
# and two such fixtures at once slow each other's collectives.
XDIST_GROUP = "gloo-runs"
BASE = dict(dataset="synthetic", synthetic_size=48, batch_size=12, epochs=1, lr=0.05, model="lenet", quiet=True,
            name="differential")
# Two epochs where what an epoch's end changes is the point: set_epoch's new order, a schedule over epochs, augmentation
# drawn anew, loader processes that persist, a rerun that resumes after the first.
TWO = dict(epochs=2)
# Decoded in the training process (loader processes: one combination has them; each costs a second to start).
FOLDER = dict(dataset="folder64", batch_size=12, epochs=2, lr=0.05, model="lenet", quiet=True, name="differential",
              loader_workers=0)

# BatchNorm networks on these tiny random batches amplify rounding about a hundredfold per step (shufflenet in fp64:
# 1e-13 after one step, 1e-9 after four, 2e-6 after eight, on 2 workers as on one process against itself in
# another order): they train 2 steps, where the bound still tells rounding from error. The lessons' ResNet-18 costs
# seconds a step here (11M parameters in fp64): on the folder's small images, 2 workers, once. SyncBN with
# accumulation on 3 workers trains your own network of one BatchNorm layer (each of shufflenet's 56 gathers its
# statistics from 3 processes on 2 cores, in each forward and backward: seconds).
RESNET = dict(FOLDER, model="resnet18", sync_bn=True, image_size=8, epochs=1)
SYNC_BN = dict(sync_bn=True, synthetic_size=24, epochs=1)
SHUFFLENET = dict(SYNC_BN, model="shufflenet_v2_x0_5")

OWN = os.path.join(REPO, "tests", "user_code.py")  # a user's own model, data and loss, named by their file
# (name, workers, config, workers of a rerun that resumes after the first epoch or None)
COMBOS = [
    ("sgd-momentum-cosine", 2, dict(TWO), None),
    ("plain-sgd-constant", 2, dict(TWO, momentum=0.0, lr_schedule="constant"), None),
    ("accum-2", 2, dict(accum_steps=2), None),
    ("accum-3", 2, dict(accum_steps=3), None),
    ("warm-up", 2, dict(TWO, warmup_epochs=1), None),
    ("adamw-wd-clip", 2, dict(optimizer="adamw", lr=0.002, weight_decay=0.05, clip_grad_norm=1.0), None),
    ("amp", 2, dict(amp="bf16"), None),
    ("amp-accum-2", 2, dict(amp="bf16", accum_steps=2), None),
    ("amp-fp16", 2, dict(amp="fp16"), None),
    ("3w-amp-fp16-accum-2-clip", 3, dict(amp="fp16", accum_steps=2, clip_grad_norm=1.0), None),
    ("rerun-amp-fp16-2w-to-3w", 2, dict(TWO, amp="fp16"), 3),
    ("image-size-in-memory", 2, dict(model="mlp", image_size=20), None),
    ("image-size-in-memory-loader-process", 2, dict(TWO, model="mlp", image_size=20, loader_workers=1), None),
    ("3w-sgd", 3, dict(TWO), None),
    ("3w-accum-2", 3, dict(accum_steps=2), None),
    ("3w-accum-4", 3, dict(accum_steps=4), None),
    ("3w-adamw-warm-up", 3, dict(TWO, optimizer="adamw", lr=0.002, warmup_epochs=1), None),
    ("3w-smoothing-clip-wd", 3, dict(label_smoothing=0.2, clip_grad_norm=0.3, weight_decay=0.01), None),
    ("3w-amp", 3, dict(amp="bf16"), None),
    ("resnet18-sync-bn-accum-2-adamw", 2, dict(RESNET, accum_steps=2, optimizer="adamw", lr=0.001), None),
    ("shufflenet-sync-bn", 2, dict(SHUFFLENET), None),
    ("3w-own-batchnorm-sync-bn-accum-2-wd-clip", 3, dict(SYNC_BN, model=f"{OWN}:BatchNormCNN", accum_steps=2,
                                                           weight_decay=0.01, clip_grad_norm=1.0), None),
    ("folder-augment", 2, dict(FOLDER), None),
    ("3w-folder-augment-accum-2", 3, dict(FOLDER, accum_steps=2), None),
    ("folder-loader-process", 2, dict(FOLDER, loader_workers=1), None),
    ("folder-no-augment-image-size", 2, dict(FOLDER, augment=False, image_size=20, epochs=1), None),
    ("3w-folder-mlp-smoothing", 3, dict(FOLDER, model="mlp", label_smoothing=0.1, epochs=1), None),
    ("own-cnn", 2, dict(model=f"{OWN}:PlainCNN"), None),
    ("3w-own-cnn-accum-2", 3, dict(model=f"{OWN}:PlainCNN", accum_steps=2), None),
    ("own-tabular-wine", 2, dict(model=f"{OWN}:TabularMLP", dataset=f"{OWN}:wine"), None),
    ("3w-own-mlp-regression-mse", 3, dict(model="mlp", dataset=f"{OWN}:diabetes", loss="mse"), None),
    ("own-everything-adamw", 2, dict(model=f"{OWN}:TabularMLP", dataset=f"{OWN}:diabetes",
                                     loss=f"{OWN}:smooth_l1", optimizer="adamw", lr=0.002), None),
    # class weights per sample, averaged by count over the global batch (a weighted mean of each worker's is refused)
    ("own-weighted-loss", 2, dict(model=f"{OWN}:TabularMLP", dataset=f"{OWN}:wine",
                                  loss=f"{OWN}:weighted_cross_entropy"), None),
    # torch's MSELoss on (N,) targets: the model's (N, 1) output taken as (N,), not broadcast to (N, N)
    ("3w-own-torch-mse-loss", 3, dict(model=f"{OWN}:TabularMLP", dataset=f"{OWN}:diabetes",
                                      loss="torch.nn:MSELoss"), None),
    ("3w-own-lazy-two-targets", 3, dict(model=f"{OWN}:LazyMLP", dataset=f"{OWN}:two_targets", loss="mse"), None),
    # your optimizer (a function; a class of torch's) and schedule, stepped every step (accumulation: every K)
    ("own-adam-one-cycle", 2, dict(TWO, optimizer=f"{OWN}:adam_betas", lr_schedule=f"{OWN}:one_cycle", lr=0.002),
     None),
    ("3w-torch-radam-one-cycle-accum-2", 3, dict(optimizer="torch.optim:RAdam", lr_schedule=f"{OWN}:one_cycle",
                                                 lr=0.002, accum_steps=2), None),
    ("rerun-own-adam-one-cycle-2w-to-3w", 2, dict(TWO, optimizer=f"{OWN}:adam_betas", lr_schedule=f"{OWN}:one_cycle",
                                                  lr=0.002), 3),
    ("rerun-own-wine-2w-to-3w", 2, dict(TWO, model=f"{OWN}:TabularMLP", dataset=f"{OWN}:wine"), 3),
    ("rerun-2w-to-3w", 2, dict(TWO), 3),
    ("rerun-accum-adamw-2w-to-3w", 2, dict(TWO, accum_steps=2, optimizer="adamw", lr=0.002), 3),
    ("rerun-folder-augment-2w-to-3w", 2, dict(FOLDER), 3),
    ("rerun-sync-bn-2w-to-3w", 2, dict(SHUFFLENET, synthetic_size=12, epochs=2), 3),  # a step an epoch
    # a quarter of the training set held out, scored every epoch; the same part on 2 workers, 3 and one process
    ("val-split", 2, dict(TWO, val_split=0.25), None),
    ("3w-folder-val-split", 3, dict(FOLDER, val_split=0.2, epochs=1), None),
    ("own-wine-val-split", 2, dict(model=f"{OWN}:TabularMLP", dataset=f"{OWN}:wine", val_split=0.2), None),
    ("rerun-val-split-2w-to-3w", 2, dict(TWO, val_split=0.25), 3),
]


class Stop(Exception):
    """The run ends here, as a killed one would, after its checkpoint."""


class Recorder:
    """A launcher for a test's process group: the checkpoint to resume from, and rank 0's reports and
    checkpoints kept (copied: a state_dict shares the model's storage)."""

    def __init__(self, resume_from=None, stop_after=None):
        self.resume_from, self.stop_after = resume_from, stop_after
        self.saved, self.reports = None, []

    def latest_checkpoint(self):
        return copy.deepcopy(self.resume_from)

    def report(self, metrics, state, epoch, step=0):
        if state is not None:
            self.saved = copy.deepcopy(state)
        if step:  # a mid-epoch checkpoint: no epoch's metrics
            return
        self.reports.append({k: v for k, v in metrics.items() if k.startswith(("test_", "val_")) or k == "train_loss"})
        if epoch == self.stop_after:
            raise Stop


@ray_dp.dataset("folder64")
def load_folder64(cfg):
    """--dataset folder, its images as fp64 (for the fp64 combinations): the same per-sample path, and the same
    ImageFolders (a held-out part of train/ is read with the test set's transform, as in a real run)."""
    splits = ray_dp.load_folder(cfg)
    for split in splits:
        split.transform = AsDouble(split.transform)
    return splits


class AsDouble:
    def __init__(self, transform):
        self.transform = transform

    def __call__(self, image):
        # torchvision's transforms draw in the default dtype, which loader processes started by spawn do not
        # inherit: fp32 here, as in every real run, so that every process draws the same crops
        with default_dtype(torch.float32):
            return self.transform(image).double()

    def __repr__(self):
        return f"AsDouble({self.transform!r})"


@contextlib.contextmanager
def default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def train(cfg, world, rank, resume_from=None, stop_after=None):
    """ray_dp's worker loop on this process (rank of world), in fp64 but for --amp; rank 0's last checkpoint and its
    reports."""
    recorder = Recorder(resume_from, stop_after)
    with default_dtype(torch.float32 if cfg.amp else torch.float64), contextlib.suppress(Stop):
        train_worker(ray_dp.replace(cfg, workers=world), ray_dp.Worker(rank, world, torch.device("cpu")),
                            recorder, ray_dp.LoopOptions(), {})
    return {"state": recorder.saved, "reports": recorder.reports}


def on_process_group(configs, resumes):
    """Every combination whose run (or rerun) has this world size, on this rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for name, workers, cfg, rerun in configs:
        if workers == world:
            out[name] = train(cfg, world, rank, stop_after=1 if rerun else None)
        if rerun == world:
            out[name] = train(cfg, world, rank, resume_from=resumes[name])
    return out if rank == 0 else None


def resolved(tmp_dir):
    """Each combination's Config as the driver resolves it (the folder's normalisation computed once)."""
    folder = tiny_folder(tmp_dir / "images", classes=("a", "b", "c"), per_class=10, size=12)
    configs = []
    for name, workers, overrides, rerun in COMBOS:
        settings = {**BASE, **overrides}
        if settings["dataset"] == "folder64":
            settings["data_dir"] = str(folder)
        cfg = ray_dp.Config(**settings, workers=workers)
        ray_dp.validate(cfg)
        with default_dtype(torch.float32 if cfg.amp else torch.float64):
            cfg, data = ray_dp.check_data(cfg)
            ray_dp.check_model_fits(cfg, data)
        configs.append((name, workers, cfg, rerun))
    return configs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """N-worker runs (the reruns' first epoch on 2 workers, their second on 3), then one process each."""
    configs = resolved(tmp_path_factory.mktemp("differential"))
    with Distributed(on_process_group, 2, configs, {}) as two:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:  # meanwhile, here: the 2 ranks wait for each other's all-reduces, and leave a core's time free
            once = {}  # combinations whose one process is the same (they differ in workers) share its run
            for _, _, cfg, _ in configs:
                if repr(reference(cfg)) not in once:
                    once[repr(reference(cfg))] = train(reference(cfg), 1, 0)
            one = {name: once[repr(reference(cfg))] for name, _, cfg, _ in configs}
        finally:
            torch.set_num_threads(threads)
        on_two = two.join()[0]
    resumes = {name: on_two[name]["state"] for name, _, _, rerun in configs if rerun}
    on_three = run_distributed(on_process_group, 3, configs, resumes)[0]
    many = {name: (on_three if workers == 3 or rerun == 3 else on_two)[name]
            for name, workers, _, rerun in configs}
    return {name: (many[name], one[name], cfg) for name, _, cfg, _ in configs}


def reference(cfg):
    """One process on the same global batch, in one pass (no accumulation): the sum the N workers' micro-batches
    must add up to. With BatchNorm the micro-batches are what its statistics are taken over (SyncBatchNorm: over
    the same samples on N workers as on one process), so those keep --accum-steps."""
    return ray_dp.replace(cfg, workers=1, accum_steps=cfg.accum_steps if cfg.sync_bn else 1)


def bounds(cfg):
    return (2e-2, 2e-2) if cfg.amp else (1e-9, 1e-7)


def test_the_table_has_at_least_30_combinations():
    assert len(COMBOS) >= 30 and len({name for name, *_ in COMBOS}) == len(COMBOS)


@pytest.mark.parametrize("name", [name for name, *_ in COMBOS])
def test_n_workers_end_where_one_process_does(name, runs):
    many, one, cfg = runs[name]
    atol, rtol = bounds(cfg)
    assert many["state"]["epoch"] == one["state"]["epoch"] == cfg.epochs
    assert many["state"]["outputs"] == (len(many["state"]["classes"]) or 1 + ("two-targets" in name))  # predict's
    assert many["state"]["model"].keys() == one["state"]["model"].keys()
    for key, expected in one["state"]["model"].items():
        got = many["state"]["model"][key]
        if expected.is_floating_point():
            torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"{key}: {m}")
        else:  # BatchNorm's step counts
            assert torch.equal(got, expected), key
    _, test, val = ray_dp.held_out(cfg, ray_dp.load_dataset(cfg))
    for got, expected in zip(many["reports"][-1:], one["reports"][-1:]):
        assert got["test_count"] == expected["test_count"] == len(test)  # every sample scored once
        assert got.get("val_count") == expected.get("val_count") == (len(val) if val is not None else None)
        assert ("test_acc" in got) is ("test_acc" in expected) is ray_dp.classifies(ray_dp.load_dataset(cfg)[1])
        for metric in set(expected) - {"test_count"}:
            assert got[metric] == pytest.approx(expected[metric], abs=atol, rel=rtol), metric


def predictions_on(cfg, path):
    """--eval-only's scores on this process group, each test sample's prediction; rank 0 writes --predict-out."""
    with default_dtype(torch.float64):
        _, test = ray_dp.load_dataset(cfg)
        torch.manual_seed(0)
        net = ray_dp.build_model(cfg.model, ray_dp.input_shape(cfg, test), ray_dp.outputs(test, [])).eval()
        metrics = ray_dp.evaluate(net, test, torch.device("cpu"), batch_size=7, details=True, num_classes=0,
                                  criterion=ray_dp.loss_function(cfg, False))
    if ray_dp.rank_and_world()[0] == 0:
        ray_dp.write_predictions(path, test, metrics["predictions"], [])
    return metrics


def test_a_regression_of_two_values_predicts_both_on_n_workers_as_one_process_does(tmp_path):
    import csv
    cfg = ray_dp.Config(**{**BASE, "model": f"{OWN}:TabularMLP", "dataset": f"{OWN}:two_targets", "loss": "mse"})
    many = run_distributed(predictions_on, 3, cfg, str(tmp_path / "many.csv"))[0]
    one = predictions_on(cfg, str(tmp_path / "one.csv"))  # this process alone
    assert many["test_count"] == one["test_count"] == 89 and many["test_loss"] == pytest.approx(one["test_loss"], 1e-12)
    rows = list(csv.reader(open(tmp_path / "many.csv")))
    assert rows[0] == ["index", "target_0", "target_1", "predicted_0", "predicted_1"] and len(rows) == 90
    assert rows == list(csv.reader(open(tmp_path / "one.csv")))
    with default_dtype(torch.float64):
        _, test = ray_dp.load_dataset(cfg)
    assert [[float(v) for v in row[1:3]] for row in rows[1:]] == test.tensors[1].tolist()
    assert len({row[3] for row in rows[1:]}) > 80 and len({row[4] for row in rows[1:]}) > 80  # every value, not 0s


def test_fp16_autocast_with_its_gradscaler_trains_as_fp32_does_within_a_stated_bound(runs):
    # one process each, on the same batches from the same initial weights: fp16 activations and a scaled loss against
    # fp32, 4 steps of LeNet. Bound: 5e-3 on every weight (measured: 1.1e-3 at most), 1e-2 on the test loss.
    (_, fp16, cfg), fp32 = runs["amp-fp16"], Recorder()
    with default_dtype(torch.float32):
        train_worker(ray_dp.replace(cfg, amp=None, workers=1), ray_dp.Worker(0, 1, torch.device("cpu")), fp32,
                     ray_dp.LoopOptions(), {})
    assert fp16["state"]["history"][-1]["skipped_steps"] == 0 and fp16["state"]["optimizer"]["scaler"]["scale"] == 65536
    for key, value in fp32.saved["model"].items():
        torch.testing.assert_close(fp16["state"]["model"][key], value, atol=5e-3, rtol=0)
    assert fp16["reports"][-1]["test_loss"] == pytest.approx(fp32.reports[-1]["test_loss"], abs=1e-2)
