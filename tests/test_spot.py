"""Spot-safe training (#28): checkpoints within an epoch (--checkpoint-every), a resume from one that continues at
the next step with the same data order, and a graceful stop on SIGTERM.

A kill here is an exception on every rank at the same micro-batch (before its forward pass: no collective in flight),
so that one process group serves every scenario; a resume is a new run of ray_dp's worker loop (train_worker) from
the last checkpoint the killed one saved. Same world size, same arithmetic: the final parameters must be bitwise
those of the uninterrupted run."""
import contextlib
import copy
import io
import os
import shutil
import signal
import socket
import subprocess
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import ray_dp
from helpers import REPO, train_worker, here, assert_bitwise_equal, run_distributed, save_run
from test_trust import tiny_folder

# Its tests share a module-scoped fixture of many runs on 2 gloo processes: under pytest-xdist they run on one worker
# (which computes it once), as do test_differential's (see there).
XDIST_GROUP = "gloo-runs"
BASE = dict(dataset="synthetic", synthetic_size=60, batch_size=12, epochs=2, lr=0.05, model="lenet", quiet=True,
            name="spot", checkpoint_every="1", log_every=1)
OWN = os.path.join(REPO, "tests", "user_code.py")  # your model, optimizer and schedule, named by their file


class Killed(Exception):
    """The run ends here, as a killed worker's would."""


class Saves:
    """A launcher that keeps every checkpoint (copied: a state_dict shares the model's storage), resumes from the
    one it is given, and counts the reports."""

    def __init__(self, resume_from=None):
        self.resume_from, self.checkpoints, self.epochs = resume_from, [], []

    def latest_checkpoint(self):
        return copy.deepcopy(self.resume_from)

    def report(self, metrics, state, epoch, step=0):
        if state is not None:
            self.checkpoints.append(((epoch, step), copy.deepcopy(state)))
        if not step:
            self.epochs.append(metrics)


class killed_after:
    """Raise Killed at the micro-batch after `micro_batches` of them (counted over the whole run): resized() is what
    train_epoch calls once per micro-batch, on either data path (and evaluate once per test batch: one an epoch
    here); split_batch() is scratch mode's, once per step."""

    def __init__(self, micro_batches, counted="resized"):
        self.left, self.counted, self.original = micro_batches, counted, getattr(ray_dp, counted)

    def __enter__(self):
        def counting(*args):
            if self.left == 0:
                raise Killed
            self.left -= 1
            return self.original(*args)
        setattr(ray_dp, self.counted, counting)

    def __exit__(self, *error):
        setattr(ray_dp, self.counted, self.original)
        return error[0] is Killed


def run(cfg, launcher, world, torchrun=False):
    rank = dist.get_rank() if dist.is_initialized() else 0
    return train_worker(ray_dp.replace(cfg, workers=world), ray_dp.Worker(rank, world, torch.device("cpu")),
                               launcher, ray_dp.LoopOptions(torchrun=torchrun), {})


def config(tmp_dir, **overrides):
    settings = {**BASE, **overrides}
    if settings["dataset"] == "folder":
        settings["data_dir"] = str(tiny_folder(tmp_dir / "images", classes=("a", "b", "c"), per_class=20, size=12))
    cfg = ray_dp.Config(**settings, workers=2)
    ray_dp.validate(cfg)
    cfg, data = ray_dp.check_data(cfg)
    ray_dp.check_model_fits(cfg, data)
    return cfg


def kills_and_resumes(cases):
    """On each rank: for each (name, cfg, kills): the uninterrupted run's final state, and for each kill point the
    final state after a kill there and a resume from the last checkpoint before it (and where that was)."""
    out = {}
    for name, cfg, kills in cases:
        whole = Saves()
        run(cfg, whole, dist.get_world_size())
        every_epoch = Saves()
        run(ray_dp.replace(cfg, checkpoint_every="0"), every_epoch, dist.get_world_size())
        resumed = {}
        for micro_batches in kills:
            first = Saves()
            with killed_after(micro_batches, "split_batch" if cfg.mode == "scratch" else "resized"):
                run(cfg, first, dist.get_world_size())
            # rank 0's (the one that saves), on every rank: as Ray's checkpoint and torchrun's broadcast give it
            last = ray_dp.from_rank_0(first.checkpoints[-1] if first.checkpoints else ((0, 0), None),
                                      torch.device("cpu"))
            second = Saves(last[1])
            again = run(cfg, second, dist.get_world_size())
            resumed[micro_batches] = {"from": last[0], "final": second.checkpoints and second.checkpoints[-1][1]["model"],
                                      "epochs": second.epochs, "resumed": again["resumed"],
                                      "optimizer": second.checkpoints and second.checkpoints[-1][1]["optimizer"]}
        out[name] = {"whole": whole.checkpoints, "every_epoch": every_epoch.checkpoints and every_epoch.checkpoints[-1][1]["model"],
                     "resumed": resumed}
    return out if dist.get_rank() == 0 else None


# 60 samples, global batch 12: 5 steps an epoch. accum 2 on 2 workers: 3 samples a micro-batch, 2 micro-batches a
# step, 10 an epoch. Kills: inside the first step (before any checkpoint), inside the accumulation of step 2, at the
# start of the last step of epoch 1, in the middle of epoch 2, inside the last step of the run.
ACCUM_KILLS = (1, 3, 8, 15, 19)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spot")
    cases = [("in-memory-accum-2", config(tmp, accum_steps=2, log_every=2), ACCUM_KILLS),
             ("folder-augment-loader-process", config(tmp, dataset="folder", loader_workers=1, checkpoint_every="2"),
              (5, 7)),
             ("dropout-adamw", config(tmp, model=f"{OWN}:DropoutCNN", synthetic_size=24, optimizer="adamw",
                                      lr=0.002, checkpoint_every="1"), (1, 3)),
             ("scratch", config(tmp, mode="scratch", lr_schedule="constant", momentum=0.0, checkpoint_every="2"),
              (3, 6, 9)),
             # your optimizer and schedule: the schedule's state in the checkpoint, with the optimizer's
             ("own-adam-one-cycle", config(tmp, optimizer=f"{OWN}:adam_betas", lr_schedule=f"{OWN}:one_cycle",
                                           lr=0.002), (7,)),
             # fp16's GradScaler: its scale and growth tracker in the checkpoint, with the optimizer's state
             ("amp-fp16", config(tmp, model=f"{OWN}:OverflowsAtFirst", amp="fp16"), (2, 7)),
             # a fifth of the training set held out: the same part, and the same steps after a resume
             ("val-split", config(tmp, val_split=0.2, synthetic_size=75), (3, 6)),
             ("scratch-val-split", config(tmp, mode="scratch", lr_schedule="constant", momentum=0.0,
                                          checkpoint_every="2", val_split=0.2, synthetic_size=75), (5,))]
    return run_distributed(kills_and_resumes, 2, cases)[0]


def test_checkpoints_within_an_epoch_change_nothing_the_run_computes(runs):
    for name, out in runs.items():
        assert_bitwise_equal(out["whole"][-1][1]["model"], out["every_epoch"])


def test_every_step_and_every_2_steps_are_saved_and_named_by_epoch_and_step(runs):
    saved = [where for where, _ in runs["in-memory-accum-2"]["whole"]]
    assert saved == [(1, 1), (1, 2), (1, 3), (1, 4), (1, 0), (2, 1), (2, 2), (2, 3), (2, 4), (2, 0)]
    assert [where for where, _ in runs["folder-augment-loader-process"]["whole"]] == [(1, 2), (1, 4), (1, 0),
                                                                                      (2, 2), (2, 4), (2, 0)]
    assert ray_dp.checkpoint_dir_name(2, 4) == "checkpoint_epoch_002_step_000004"
    state = dict(runs["in-memory-accum-2"]["whole"])[(2, 3)]
    assert (state["epoch"], state["partial"]["step"], state["partial"]["samples"]) == (1, 3, 36)


@pytest.mark.parametrize("name", ["in-memory-accum-2", "folder-augment-loader-process", "dropout-adamw", "scratch",
                                  "own-adam-one-cycle", "amp-fp16", "val-split", "scratch-val-split"])
def test_a_run_killed_at_any_step_and_resumed_ends_bitwise_where_the_uninterrupted_one_does(runs, name):
    out = runs[name]
    for micro_batches, resumed in out["resumed"].items():
        assert_bitwise_equal(resumed["final"], out["whole"][-1][1]["model"]), micro_batches


def test_fp16s_skipped_steps_are_counted_shown_and_its_scaler_resumes_bitwise_from_any_step(runs):
    out = runs["amp-fp16"]
    whole = out["whole"][-1][1]
    # the GradScaler's first scale (65536) overflows the first steps' fp16 gradients: each skipped, the scale halved
    skipped = [m["skipped_steps"] for m in whole["history"]]
    assert skipped[0] >= 1 and whole["optimizer"]["scaler"]["scale"] == 65536 / 2 ** sum(skipped)
    assert ray_dp.format_epoch(whole["history"][0], 2).endswith(
        f" samples/s, {ray_dp.plural(skipped[0], 'step')} skipped (fp16 overflow)")
    for kill, resumed in out["resumed"].items():  # a mid-epoch checkpoint keeps its epoch's count
        assert resumed["optimizer"]["scaler"] == whole["optimizer"]["scaler"], kill
        assert [m["skipped_steps"] for m in resumed["epochs"]] == skipped[-len(resumed["epochs"]):], kill


def test_every_resume_restores_what_its_checkpoint_certifies(runs):
    for name, out in runs.items():
        for kill, resumed in out["resumed"].items():
            epoch, step = resumed["from"]
            expected = None if (epoch, step) == (0, 0) else {
                "from": f"epoch {epoch}, step {step}" if step else f"epoch {epoch}", "certified": True}
            assert resumed["resumed"] == expected, (name, kill)


def test_the_resume_starts_from_the_last_checkpoint_before_the_kill(runs):
    # (epoch, step) of the checkpoint: (1, 0) is after epoch 1, (2, s) after s steps of epoch 2; (0, 0): none yet
    started = {kill: resumed["from"] for kill, resumed in runs["in-memory-accum-2"]["resumed"].items()}
    assert started == {1: (0, 0), 3: (1, 1), 8: (1, 4), 15: (2, 2), 19: (2, 4)}


def test_a_resumed_epoch_reports_every_sample_of_it_and_the_same_losses(runs):
    out = runs["in-memory-accum-2"]
    whole = dict(out["whole"])[(2, 0)]["history"]
    resumed = out["resumed"][15]["epochs"]  # killed in epoch 2, resumed at its step 3
    assert [m["epoch"] for m in resumed] == [2] and resumed[0]["train_samples"] == whole[1]["train_samples"] == 60
    assert resumed[0]["resumed_at_step"] == 2 and "resumed_at_step" not in whole[1]
    assert " s (from step 3), " in ray_dp.format_epoch(resumed[0], 2)  # its seconds are those of 3 steps
    assert resumed[0]["train_loss"] == pytest.approx(whole[1]["train_loss"], rel=1e-12)
    # TensorBoard's per-step curve (every 2 steps of the run), the resume in between two of its points (after 7)
    assert [s for s, _ in resumed[0]["step_log"]] == [s for s, _ in whole[1]["step_log"]] == [6, 8, 10]
    assert [loss for _, loss in resumed[0]["step_log"]] == pytest.approx([loss for _, loss in whole[1]["step_log"]],
                                                                         rel=1e-12)


def test_the_rest_of_an_epoch_on_another_number_of_workers_takes_every_remaining_sample_once():
    data = torch.utils.data.TensorDataset(torch.arange(103))
    for before, after, steps in [(2, 3, 2), (3, 2, 1), (4, 1, 3), (2, 2, 0)]:
        global_batch = 12
        first = [ray_dp.train_sampler(data, r, before, seed=5) for r in range(before)]
        for s in first:
            s.set_epoch(3)
        consumed = [i for s in first for i in list(s)[:steps * global_batch // before]]
        rest = [ray_dp.train_sampler(data, r, after, seed=5) for r in range(after)]
        for s in rest:
            s.set_epoch(3, steps * global_batch)
        remaining = [i for s in rest for i in s]
        order = torch.randperm(103, generator=torch.Generator().manual_seed(5 + 3)).tolist()
        assert sorted(consumed) == sorted(order[:steps * global_batch])
        assert len(set(remaining)) == len(remaining) and not set(remaining) & set(consumed)
        # all of the rest but what no whole share of `after` workers holds (drop_last, as DistributedSampler)
        assert len(remaining) == (103 - steps * global_batch) // after * after
        assert set(remaining) <= set(order[steps * global_batch:])


def test_from_the_start_the_sampler_is_torchs_distributed_sampler():
    data = torch.utils.data.TensorDataset(torch.arange(103))
    for world in (1, 2, 3):
        for rank in range(world):
            ours = ray_dp.train_sampler(data, rank, world, seed=7)
            theirs = torch.utils.data.DistributedSampler(data, world, rank, shuffle=True, seed=7, drop_last=True)
            ours.set_epoch(4), theirs.set_epoch(4)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


@pytest.mark.parametrize("every, parsed", [("0", (0, 0.0)), ("200", (200, 0.0)), ("10m", (0, 600.0)),
                                           ("0.5m", (0, 30.0)), (" 3 ", (3, 0.0))])
def test_checkpoint_every_takes_steps_or_minutes(every, parsed):
    assert ray_dp.checkpoint_interval(every) == parsed


@pytest.mark.parametrize("every", ["-1", "10s", "m", "0m", "1.5", "ten"])
def test_checkpoint_every_that_is_neither_is_one_line(every, capsys):
    assert ray_dp.main(["--dataset", "digits", "--checkpoint-every", every]) == 2
    assert capsys.readouterr().err.strip() == (
        f"ray_dp.py: error: --checkpoint-every must be a number of steps (200), minutes (10m) or 0 (at epochs' ends "
        f"only), got {every}")


def test_scratch_mode_saves_at_epochs_ends_unless_told_otherwise(runs):
    assert ray_dp.parse_command(["--mode", "scratch", "--dataset", "digits"])[1].checkpoint_every == "0"
    assert [where for where, _ in runs["scratch"]["whole"]] == [(1, 2), (1, 4), (1, 0), (2, 2), (2, 4), (2, 0)]


def sigterm_at(cfg, micro_batches, torchrun, loaders_too=False, agree_s=ray_dp.Agreement.AGREE_S):
    """On each rank: SIGTERM to rank 1 only (loaders_too: and to its loader processes, at once, as a shutdown signals
    every process), at its micro-batch `micro_batches`; the run saves at the next log step and stops (under Ray every
    rank raises then, for Ray to restart the workers). Then a resume from that checkpoint, to the end."""
    stopped, resumed_run = Saves(), None
    resized = ray_dp.resized
    count = [0]
    ray_dp.Agreement.AGREE_S = agree_s

    def signalling(x, size):
        count[0] += 1
        if dist.get_rank() == 1 and count[0] == micro_batches:
            me = psutil.Process()
            # from another process, as a shutdown's (torch's loader processes exit quietly on their parent's)
            subprocess.run(["kill", "-TERM", *(str(process.pid) for process in
                                               [me, *(me.children(recursive=True) if loaders_too else [])])])
        return resized(x, size)
    ray_dp.resized = signalling
    try:
        out = run(cfg, stopped, dist.get_world_size(), torchrun)
    except ray_dp.RunStopped as exc:
        out = {"stopped": str(exc)}
    finally:
        ray_dp.resized = resized
    saved_at, state = ray_dp.from_rank_0(stopped.checkpoints[-1] if stopped.checkpoints else None,
                                         torch.device("cpu"))
    resumed_run = Saves(state)
    run(cfg, resumed_run, dist.get_world_size())
    whole = Saves()
    run(cfg, whole, dist.get_world_size())
    final = resumed_run.checkpoints and (resumed_run.checkpoints[-1][1]["model"], whole.checkpoints[-1][1]["model"])
    return {"stopped": out["stopped"], "saved_at": saved_at, "final": final,
            "handler": type(signal.getsignal(signal.SIGTERM)).__name__}


@pytest.mark.parametrize("torchrun, max_failures", [(True, 0), (False, 0), (False, 1)])
def test_sigterm_to_one_worker_saves_at_the_next_log_step_on_every_rank_and_the_resume_redoes_nothing(
        tmp_path, torchrun, max_failures):
    cfg = config(tmp_path, checkpoint_every="0", log_every=2, max_failures=max_failures)
    zero, one = run_distributed(sigterm_at, 2, cfg, 2, torchrun)  # in step 2 (of 5): saved after it, a log step
    if max_failures:  # Ray's workers fail, all of them, after the checkpoint: Ray restarts them
        assert zero["stopped"] == one["stopped"] == "a worker got SIGTERM; saved epoch 1, step 2 of 5 and stopped"
    else:  # the run ends, as the driver's stop ends it: the same command (or torchrun's restart) resumes
        assert zero["stopped"] == one["stopped"] == {"epoch": 1, "step": 2, "steps": 5, "by": ["sigterm"]}
    assert zero["saved_at"] == (1, 2)
    assert_bitwise_equal(*zero["final"])
    assert zero["handler"] == "GracefulStop"


def test_sigterm_to_a_rank_and_its_loader_processes_at_once_saves_on_every_rank_and_resumes_bitwise(tmp_path):
    cfg = config(tmp_path, dataset="folder", loader_workers=2, checkpoint_every="0", log_every=2)
    zero, one = run_distributed(sigterm_at, 2, cfg, 2, True, True)  # in step 2 (of 5): saved after it, a log step
    assert zero["stopped"] == one["stopped"] == {"epoch": 1, "step": 2, "steps": 5, "by": ["sigterm"]}
    assert zero["saved_at"] == (1, 2)
    assert_bitwise_equal(*zero["final"])


def on_own_folders(configs):
    """On each rank: a torchrun run whose --data-dir is its own (as each node reads its own disk); what it trained, or
    the error it stopped with, and what it printed."""
    ray_dp.bound_collectives(60)  # on code that trains each rank's own list, a rank's extra step would wait forever
    saves = Saves()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = run(configs[dist.get_rank()], saves, dist.get_world_size(), torchrun=True)
    if "data_error" in out:  # every rank returns it: the driver says it, and Ray retries nothing
        return {"error": out["data_error"]}
    return {"samples": [m["train_samples"] for m in saves.epochs], "printed": printed.getvalue(),
            "losses": [m["train_loss"] for m in saves.epochs],
            "fingerprint": saves.checkpoints and saves.checkpoints[-1][1]["samples"]}  # rank 0 saves


def folders_that_differ(tmp_path, change):
    cfg = config(tmp_path, dataset="folder", loader_workers=0, checkpoint_every="0")
    other = tmp_path / "node1"
    shutil.copytree(cfg.data_dir, other)
    change(other)
    return [cfg, ray_dp.replace(cfg, data_dir=str(other))]


def test_a_node_with_images_the_list_lacks_trains_rank_0s_list_and_says_so_once(tmp_path):
    def twelve_more(folder):  # on rank 1's own list: a sixth step, that rank 0 never takes
        for i in range(12):
            shutil.copy(folder / "train" / "a" / "0.png", folder / "train" / "a" / f"extra{i}.png")
    configs = folders_that_differ(tmp_path, twelve_more)
    zero, one = run_distributed(on_own_folders, 2, configs)
    assert zero["samples"] == one["samples"] == [60, 60]  # rank 0's 60 images, each once, in whole global batches
    assert zero["losses"] == one["losses"]  # all-reduced over the same steps
    assert zero["fingerprint"] == ray_dp.samples_fingerprint(ray_dp.load_dataset(configs[0])[0])
    assert zero["printed"].count("note: node ") == 1 and "holds 12 images in --data-dir" in zero["printed"]
    assert "note:" not in one["printed"]


def test_a_node_that_lacks_an_image_of_the_list_stops_every_rank_with_one_line_naming_it(tmp_path):
    configs = folders_that_differ(tmp_path, lambda folder: (folder / "train" / "b" / "3.png").unlink())
    errors = [out["error"] for out in run_distributed(on_own_folders, 2, configs)]
    assert errors[0] == errors[1].replace(configs[1].data_dir, configs[0].data_dir)
    assert errors[1] == (f"node {socket.gethostname()} (rank 1) lacks 1 image of the run's list in --data-dir "
                         f"{configs[1].data_dir}, e.g. train/b/3.png: copy the same folder to every node (cluster.yaml's "
                         f"file_mounts), or keep it in object storage (s3://...)")


def saved_at(cfg, epoch_step):
    """On each rank: a run whose checkpoints go on every step; rank 0's at (epoch, step)."""
    saves = Saves()
    run(cfg, saves, dist.get_world_size())
    return dict(saves.checkpoints).get(epoch_step)


def resumed_on(cfg, state):
    saves = Saves(state)
    run(cfg, saves, dist.get_world_size())
    return saves.epochs


def test_an_elastic_resize_mid_epoch_spreads_the_rest_of_the_epoch_over_the_new_workers(tmp_path):
    cfg = config(tmp_path, checkpoint_every="1", min_workers=1)  # --workers 1:3 (elastic), started on 2
    state = run_distributed(saved_at, 2, cfg, (1, 2))[0]  # 2 of the 5 steps of epoch 1: its first 24 samples
    assert state["partial"]["samples"] == 24
    epochs = run_distributed(resumed_on, 3, cfg, state)[0]  # the rest of it on 3 workers: 36 samples, 4 each a step
    assert [m["epoch"] for m in epochs] == [1, 2]
    assert epochs[0]["train_samples"] == 60 and epochs[1]["train_samples"] == 60
    assert [s for s, _ in epochs[0]["step_log"]] == [1, 2, 3, 4, 5]


def test_an_epoch_without_a_log_step_still_stops_within_it_after_a_sigterm(tmp_path):
    cfg = config(tmp_path, checkpoint_every="0", log_every=10)  # 5 steps an epoch: no log step in it
    zero, one = run_distributed(sigterm_at, 2, cfg, 2, True, False, 0.0)  # agreements every step: not timed
    stopped = zero["stopped"]
    assert stopped == one["stopped"] and stopped["by"] == ["sigterm"]
    assert (stopped["epoch"], stopped["step"]) == (1, 2)  # at the ranks' first agreement after the signal (step 2)
    assert zero["saved_at"] == (1, stopped["step"])
    assert_bitwise_equal(*zero["final"])


def test_a_scratch_run_resumes_by_its_name_alone_with_the_lessons_epoch_end_checkpoints(tmp_path):
    save_run(tmp_path / "runs" / "s", saved=(1,), mode="scratch", epochs=20, batch_size=32, lr=0.2,
             lr_schedule="constant", momentum=0.0, checkpoint_every="0")
    _, cfg, options = ray_dp.parse_command(["--storage-path", str(tmp_path / "runs"), "--name", "s"])
    assert (cfg.mode, cfg.checkpoint_every, options["resume"].done) == ("scratch", "0", 1)


def test_fresh_deletes_a_run_that_holds_only_checkpoints_within_an_epoch(tmp_path):
    run = tmp_path / "runs" / "t"
    (run / ray_dp.checkpoint_dir_name(1, 40)).mkdir(parents=True)
    (run / ray_dp.checkpoint_dir_name(1, 40) / ray_dp.CHECKPOINT_FILE).write_bytes(b"x")
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(storage_path=str(tmp_path / "runs"), name="t", fresh=True))
    assert ray_dp.check_run_dir(cfg)[1].done == 0  # checked and accepted: start_fresh deletes it


def test_compares_scratch_rows_save_at_epochs_ends_and_its_ddp_rows_as_typed():
    _, base, _ = ray_dp.parse_command(["compare", "--dataset", "digits", "--checkpoint-every", "5m"])
    rows = {cfg.name: cfg.checkpoint_every for cfg in ray_dp.compare_configs(base, False)}
    assert rows["ddp-2w"] == "5m" and {every for name, every in rows.items() if "scratch" in name} == {"0"}


def test_checkpoint_every_zero_written_otherwise_is_still_zero_for_scratch():
    ray_dp.validate(ray_dp.Config(mode="scratch", checkpoint_every="00", dataset="digits"))


def handler_calls(before, training, on_ask=None):
    """What a GracefulStop does with one SIGTERM: (asked, what the handler before it saw)."""
    seen = []
    if before == "callable":
        before = lambda signum, frame: seen.append(signum)  # noqa: E731
    stop = ray_dp.GracefulStop(before)
    stop.training, stop.on_ask = training, on_ask
    stop(signal.SIGTERM, None)
    return stop.asked, seen


def test_sigterm_while_training_asks_for_a_stop_and_otherwise_does_what_it_did_before():
    assert handler_calls("callable", training=True) == (True, [])
    assert handler_calls("callable", training=False) == (False, [signal.SIGTERM])  # Ray's handler: it exits
    assert handler_calls(signal.SIG_IGN, training=False) == (False, [])  # ignored stays ignored
    assert handler_calls(None, training=True, on_ask=lambda: False) == (False, [])  # nobody to tell: not swallowed
    assert handler_calls("callable", training=True, on_ask=lambda: False) == (False, [signal.SIGTERM])
    stop = ray_dp.GracefulStop(signal.SIG_IGN)
    stop.on_ask = object()
    with stop:
        assert stop.training
    assert not stop.training and stop.on_ask is None  # nothing of the run it served stays behind



def test_a_fit_that_raises_after_a_group_sigterm_ends_as_the_group_stop_once_its_own_ray_is_gone(monkeypatch, tmp_path,
                                                                                                  capsys):
    # the group's SIGTERM may end fit() (its controller gone) before the watch sees the GCS go: the driver then waited
    # a minute on Ray's GCS and exited 1
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing answers there: ray_dp's own Ray gone
    exits = []
    monkeypatch.setattr(ray_dp.ray, "get_runtime_context", lambda: type("C", (), {"gcs_address": f"127.0.0.1:{port}"}))
    monkeypatch.setattr(ray_dp, "RAY_STARTED", {"local": True})
    monkeypatch.setattr(ray_dp.os, "_exit", lambda status: exits.append(status) or (_ for _ in ()).throw(SystemExit))
    cfg = ray_dp.Config(dataset="digits", storage_path=str(tmp_path), name="group")
    stop = ray_dp.GracefulStop(signal.SIG_IGN)
    stop.on_ask = lambda: None  # the Board gone: no answer
    with stop, pytest.raises(SystemExit):
        with ray_dp.own_ray_watched(cfg, stop):
            stop(signal.SIGTERM, None)
            assert stop.heard and stop.asked  # the GCS does not answer: the workers had the signal too
            raise RuntimeError("the controller died")  # before the watch's first look
    assert exits[:1] == [143] and "SIGTERM, to ray_dp's own Ray too" in capsys.readouterr().err

class FakeBoard:
    """The driver's ProgressBoard as rank 0 sees it, without Ray: stepped.remote records, beat.remote answers whether
    a stop was asked."""

    class Method:
        def __init__(self, answer):
            self.answer, self.calls = answer, []

        def remote(self, *args):
            self.calls.append(args)
            return self.answer(*args)

    def __init__(self):
        self.stop = False
        self.stepped = self.Method(lambda since, snapshot: None)
        self.beat = self.Method(lambda: self.stop)
        self.restarted = self.Method(lambda: True)
        self.dumps_asked = self.Method(lambda: 0)


def test_rank_0_tells_the_board_at_agreements_and_hears_the_drivers_stop_from_its_heartbeat(monkeypatch):
    monkeypatch.setattr(ray_dp.ray, "get", lambda ref, timeout=None: ref)
    monkeypatch.setattr(ray_dp.DriverLink, "BEAT_S", 0.01)
    monkeypatch.setattr(ray_dp, "graceful_stop", lambda: None)  # this process's SIGTERM stays pytest's
    board = FakeBoard()
    checkpointer = ray_dp.Operations(ray_dp.Config(checkpoint_every="0", log_every=2), here(), None,
                                       ray_dp.LoopOptions(board=board))
    _, losses = checkpointer.start_epoch(0)
    for step in range(3):
        losses.add(torch.tensor(1.0), 1)
        assert not checkpointer.after_step(0, step, 10, losses)
    # told at the first step (the first agreement, which times the steps) and at the log step; nothing asked yet
    assert [since for since, _ in board.stepped.calls] == [1, 2]
    assert checkpointer.agree(losses, 0, False, False, None) == set()
    with checkpointer:  # beats from a thread of its own: no step needs to come for the driver to know rank 0 trains
        deadline = time.time() + 10
        while len(board.beat.calls) < 3 and time.time() < deadline:
            time.sleep(0.01)
        board.stop = True
        while not checkpointer.progress.link.asked and time.time() < deadline:
            time.sleep(0.01)
    assert len(board.beat.calls) >= 3 and checkpointer.agree(losses, 0, False, False, None) == {ray_dp.DRIVER_VOTE}
    board.stop = False
    assert checkpointer.agree(losses, 0, True, False, None) == {ray_dp.DRIVER_VOTE}  # asked stays asked


def test_a_resumed_epochs_progress_bar_starts_at_its_steps_so_far():
    bar = ray_dp.Bar()
    bar.show((0, 4, 10, None, 100.0, 2))
    assert bar.tqdm.n == 4 and bar.tqdm.total == 10 and bar.tqdm.desc.startswith("epoch 1/2, 100 samples/s")
    bar.show(None)
    assert bar.tqdm is None


def test_rank_0_votes_the_notices_reading_every_5_s_and_the_last_save_when_the_next_chance_is_past_the_deadline():
    class Agreement:
        def step_seconds(self, ledger):
            return 1.0

    class Store:
        last = 0.5  # this run's last save, in seconds
    notice, ledger = ray_dp.SpotNotice(ray_dp.Config(), here(), on_ray=True), ray_dp.Ledger()
    ledger.seconds["evaluation"] = 10.0
    assert notice.votes(Agreement(), ledger, 5, Store()) == set()  # read just now, no notice
    notice.read_at -= ray_dp.SpotNotice.NOTICE_S
    assert notice.votes(Agreement(), ledger, 5, Store()) == {ray_dp.READ_VOTE}
    notice.read_at, notice.heard, notice.first = time.time(), object(), True
    notice.deadline = time.time() + 4.5  # two steps and two saves and a second: 4 s
    assert notice.votes(Agreement(), ledger, 5, Store()) == set()
    assert notice.votes(Agreement(), ledger, 1, Store()) == {ray_dp.DUE_VOTE, ray_dp.LAST_VOTE}  # then evaluation
    notice.deadline -= 1
    assert notice.votes(Agreement(), ledger, 5, Store()) == {ray_dp.DUE_VOTE, ray_dp.LAST_VOTE}
    assert notice.votes(Agreement(), ledger, 0, Store()) == set()  # an epoch's last step: its own save follows
    notice.first = False  # the notice's first save still owed (it came at an epoch's end)
    notice.deadline += 100
    assert notice.votes(Agreement(), ledger, 5, Store()) == {ray_dp.DUE_VOTE}
    other = ray_dp.SpotNotice(ray_dp.Config(), ray_dp.Worker(1, 2, torch.device("cpu")), on_ray=True)
    other.read_at -= 10
    assert other.votes(Agreement(), ledger, 5, Store()) == set()  # rank 0 decides for all
    off = ray_dp.SpotNotice(ray_dp.Config(spot_notices=False), here(), on_ray=True)
    off.read_at -= 10
    assert off.votes(Agreement(), ledger, 5, Store()) == set()  # --no-spot-notices: never read
