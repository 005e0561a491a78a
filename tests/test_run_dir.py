"""Run directories, resume and the device choice, checked before any cluster starts: no path leaves its
root, --fresh deletes only its own run, a rerun trains what it trained before, GPU when a cluster can add GPUs."""
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

import ray_dp
from helpers import REPO, error_of, ray_snapshot_json, run_distributed, save_run

DIGITS = ["--dataset", "digits"]

DIGITS_INFO = ray_dp.DataInfo((1437, 360), (1, 28, 28), [str(c) for c in range(10)], False)


@pytest.mark.parametrize("name", ["../victim", "{victim}", ".", "..", "../runs"])
def test_fresh_with_a_name_outside_the_storage_path_deletes_nothing(name, tmp_path, no_cluster, capsys):
    victim, keep = tmp_path / "victim", save_run(tmp_path / "runs" / "keep")
    victim.mkdir()
    (victim / "precious.txt").write_text("x")
    argv = ["--storage-path", str(tmp_path / "runs"), "--name", name.format(victim=victim), "--fresh", *DIGITS]
    assert "--name must be one directory name" in error_of(argv, capsys)
    assert (victim / "precious.txt").exists() and (keep / "checkpoint_epoch_001").exists()


def test_fresh_refuses_a_run_directory_that_links_elsewhere(tmp_path, no_cluster, capsys):
    victim = save_run(tmp_path / "victim")  # even a run: its directory is not inside --storage-path
    (victim / "precious.txt").write_text("x")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "link").symlink_to(victim)
    argv = ["--storage-path", str(tmp_path / "runs"), "--name", "link", "--fresh", *DIGITS]
    assert "outside --storage-path; not deleting it" in error_of(argv, capsys)
    assert (victim / "precious.txt").exists()


def test_fresh_deletes_its_own_run_directory_and_nothing_else(tmp_path, capsys):
    mine, other = save_run(tmp_path / "runs" / "mine"), save_run(tmp_path / "runs" / "other")
    _, cfg, _ = ray_dp.parse_command(["--storage-path", str(tmp_path / "runs"), "--name", "mine", "--fresh", *DIGITS])
    ray_dp.check_run_dir(cfg)
    assert mine.exists()  # checking deletes nothing: every other check comes first
    ray_dp.start_fresh(cfg)
    assert not mine.exists() and (other / "checkpoint_epoch_001" / ray_dp.CHECKPOINT_FILE).exists()
    assert "--fresh: deleted" in capsys.readouterr().out


def curve(events, tag):
    """The steps of a TensorBoard tag in the events of a run's directory, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    return [event.step for event in EventAccumulator(str(events)).Reload().Scalars(tag)]


def test_fresh_starts_the_runs_tensorboard_curves_over(tmp_path, capsys):
    """The new run's train/loss is drawn alone, not after the old one's steps (one zig-zag line)."""
    save_run(tmp_path / "runs" / "mine")
    argv = ["--storage-path", str(tmp_path / "runs"), "--logdir", str(tmp_path / "tb"), "--name", "mine", *DIGITS]
    _, cfg, _ = ray_dp.parse_command([*argv, "--epochs", "3"])
    old = ray_dp.TensorBoardWriter(cfg)
    for epoch in (1, 2, 3):
        old.write({"epoch": epoch, "train_loss": 1.0, "step_log": [(5 * epoch - s, 1.0) for s in (4, 3, 2, 1, 0)]})
    old.writer.close()
    assert curve(tmp_path / "tb" / "mine", "train/loss_step") == list(range(1, 16))
    (tmp_path / "tb" / "mine" / "notes.txt").write_text("mine")
    _, cfg, _ = ray_dp.parse_command([*argv, "--fresh"])
    capsys.readouterr()
    ray_dp.start_fresh(cfg)
    assert capsys.readouterr().out == (f"--fresh: deleted {tmp_path / 'runs' / 'mine'} and the run's TensorBoard "
                                       f"events in {tmp_path / 'tb' / 'mine'}; starting run 'mine' over\n")
    assert (tmp_path / "tb" / "mine" / "notes.txt").read_text() == "mine"  # only the events ray_dp wrote
    new = ray_dp.TensorBoardWriter(cfg)
    new.write({"epoch": 1, "train_loss": 0.5, "step_log": [(1, 0.5), (2, 0.4)]})
    new.writer.close()
    assert curve(tmp_path / "tb" / "mine", "train/loss_step") == [1, 2]
    assert curve(tmp_path / "tb" / "mine", "train/loss") == [1]


@pytest.mark.parametrize("name, flags, message", [
    ("documents", [], "is not a ray-dp run (no checkpoints, no result.json); not deleting it"),
    ("tensorboard", ["--logdir", "{runs}/tensorboard"], "holds --logdir"),  # ./runs/tensorboard by default
    ("exp", ["--workers", "64", "--cpus-per-worker", "1"], "64 workers need 64 CPUs"),  # a later check fails: nothing deleted yet
])
def test_fresh_refuses_what_is_not_this_run_and_deletes_only_after_every_check(name, flags, message, tmp_path,
                                                                            no_cluster, capsys):
    runs = tmp_path / "runs"
    save_run(runs / "exp")
    (runs / "documents").mkdir()
    (runs / "documents" / "precious.txt").write_text("x")
    (runs / "tensorboard" / "exp").mkdir(parents=True)
    (runs / "tensorboard" / "result.json").write_text("{}")  # even if it looked like a run
    before = {str(p) for p in tmp_path.rglob("*")}
    flags = [f.format(runs=runs) for f in flags]
    assert message in error_of(["--storage-path", str(runs), "--name", name, "--fresh", *DIGITS, *flags], capsys)
    assert {str(p) for p in tmp_path.rglob("*")} == before


def test_a_run_in_uri_storage_is_checked_on_resume_like_a_local_one(tmp_path, no_cluster, capsys):
    run = save_run(tmp_path / "bucket" / "exp")
    (run / "checkpoint_manager_snapshot.json").write_text(ray_snapshot_json("checkpoint_epoch_001"))
    uri = f"file://{tmp_path}/bucket"  # pyarrow's URI storage, as s3:// is
    _, cfg, _ = ray_dp.parse_command(["--storage-path", uri, "--name", "exp", *DIGITS])
    ray_dp.check_run_dir(cfg)  # the same config: it resumes
    assert "was trained with --lr 0.05; this command says --lr 0.1" in error_of(
        ["--storage-path", uri, "--name", "exp", *DIGITS, "--lr", "0.1"], capsys)


CHANGED = [
    (["--lr", "0.1"], "was trained with --lr 0.05; this command says --lr 0.1"),
    (["--seed", "1", "--batch-size", "32"], "was trained with --batch-size 64, --seed 0; this command says "
                                            "--batch-size 32, --seed 1"),
    (["--mode", "scratch", "--batch-size", "64", "--lr", "0.05", "--lr-schedule", "cosine", "--momentum", "0.9"],
     "was trained with --mode ddp; this command says --mode scratch"),
    (["--amp"], "was trained with no --amp; this command says --amp"),
    (["--model", "mlp"], "was trained with --model lenet; this command says --model mlp"),
    (["--dataset", "synthetic"], "--dataset digits; this command says --dataset synthetic"),
]


@pytest.mark.parametrize("flags, message", CHANGED, ids=[" ".join(f) for f, _ in CHANGED])
def test_resuming_with_a_different_training_config_names_each_difference(flags, message, tmp_path, no_cluster,
                                                                          capsys):
    run = save_run(tmp_path / "runs" / "exp")
    before = (run / "checkpoint_epoch_001" / ray_dp.CHECKPOINT_FILE).read_bytes()
    err = error_of(["--storage-path", str(tmp_path / "runs"), "--name", "exp", *DIGITS, *flags], capsys)
    assert message in err and "--fresh or a new --name" in err
    assert (run / "checkpoint_epoch_001" / ray_dp.CHECKPOINT_FILE).read_bytes() == before


def test_resuming_may_extend_epochs_and_change_workers_and_says_where_the_cosine_lr_goes(tmp_path, capsys):
    save_run(tmp_path / "runs" / "exp", saved=range(1, 11))
    _, cfg, _ = ray_dp.parse_command(["--storage-path", str(tmp_path / "runs"), "--name", "exp", *DIGITS,
                                      "--epochs", "20", "--workers", "1", "--max-failures", "2", "--quiet"])
    ray_dp.check_run_dir(cfg)  # no error
    out = capsys.readouterr().out
    lr = ray_dp.learning_rate(cfg, 10)
    assert f"the cosine schedule now spans --epochs 20 (it was 10): epoch 11 trains at lr {lr:.4g}" in out
    assert lr == pytest.approx(0.025)  # half the peak: the cosine restarts its second half


def test_a_rerun_takes_what_it_does_not_type_from_the_run_it_resumes(tmp_path, capsys):
    # Trained with other values than today's defaults: the shortest command that names the run resumes it.
    save_run(tmp_path / "runs" / "exp", saved=range(1, 4), lr=0.1, batch_size=32, epochs=5, seed=7)
    argv = ["--storage-path", str(tmp_path / "runs"), "--name", "exp", *DIGITS]
    command, resumed, options = ray_dp.parse_command(argv)
    assert (resumed.lr, resumed.batch_size, resumed.epochs, resumed.seed, options["resume"].done) == (0.1, 32, 5, 7, 3)
    assert "note: run 'exp' resumes with its own --epochs 5, --batch-size 32, --lr 0.1, --seed 7" in capsys.readouterr().out
    _, typed_cfg, options = ray_dp.parse_command([*argv, "--epochs", "8"])  # typed: kept (it may change)
    assert typed_cfg.epochs == 8


def test_a_rerun_of_checkpoints_ray_never_listed_hands_the_workers_the_drivers_pick(tmp_path, no_cluster):
    run = save_run(tmp_path / "run", saved=[1, 2])  # as torchrun leaves it: Ray would give its workers nothing
    cfg = ray_dp.Config(dataset="digits", storage_path=str(tmp_path), name="run", epochs=3)
    _, resume = ray_dp.check_run_dir(cfg)
    assert (resume.done, resume.unlisted) == (2, f"{run}/checkpoint_epoch_002/{ray_dp.CHECKPOINT_FILE}")
    (run / ray_dp.RAY_SNAPSHOT).write_text(ray_snapshot_json("checkpoint_epoch_001"))  # Ray's own pick
    _, resume = ray_dp.check_run_dir(cfg)
    assert (resume.done, resume.unlisted) == (1, None)


def test_checkpoints_are_ordered_by_epoch_number_not_as_text(tmp_path):
    run = save_run(tmp_path / "run", saved=[2, 999, 1000])
    assert [Path(p).parent.name for p in ray_dp.epoch_checkpoints(run)] == [
        "checkpoint_epoch_002", "checkpoint_epoch_999", "checkpoint_epoch_1000"]
    assert ray_dp.checkpoint_file(str(run)).endswith("checkpoint_epoch_1000/checkpoint.pt")
    assert ray_dp.latest_committed(str(run)).endswith("checkpoint_epoch_1000/checkpoint.pt")


def test_latest_committed_follows_rays_snapshot_over_orphan_directories(tmp_path):
    run = save_run(tmp_path / "run", saved=[1, 2])  # epoch 2 written but never committed
    (run / "checkpoint_manager_snapshot.json").write_text(ray_snapshot_json("checkpoint_epoch_001"))
    assert ray_dp.latest_committed(str(run)).endswith("checkpoint_epoch_001/checkpoint.pt")
    assert ray_dp.checkpoint_file(str(run)).endswith("checkpoint_epoch_001/checkpoint.pt")  # --eval-only too
    cfg = ray_dp.Config(storage_path=str(tmp_path), name="run", epochs=5)
    assert ray_dp.interrupted("train", cfg) == (f"interrupted after epoch 1 of 5 (saved in {run}); "
                                                f"the same command with --name run resumes it")
    fresh = ray_dp.replace(cfg, fresh=True)  # the same command would delete what was saved
    assert ray_dp.interrupted("train", fresh).endswith("the same command without --fresh with --name run resumes it")


TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "1"}


def test_under_torchrun_a_rerun_resumes_from_its_highest_epoch_not_an_earlier_ray_runs_list(tmp_path, monkeypatch):
    run = save_run(tmp_path / "run", saved=[1, 2])  # Ray trained epoch 1, then torchrun epoch 2
    (run / ray_dp.RAY_SNAPSHOT).write_text(ray_snapshot_json("checkpoint_epoch_001"))
    assert ray_dp.latest_committed(str(run)).endswith(f"/checkpoint_epoch_001/{ray_dp.CHECKPOINT_FILE}")  # Ray's
    for key, value in {**TORCHRUN, "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    assert ray_dp.latest_committed(str(run)).endswith(f"/checkpoint_epoch_002/{ray_dp.CHECKPOINT_FILE}")
    cfg = ray_dp.Config(dataset="digits", storage_path=str(tmp_path), name="run", epochs=3)
    assert ray_dp.check_run_dir(cfg)[1].done == 2  # what the driver says is what TorchrunLauncher loads
    (run / ray_dp.RAY_SNAPSHOT).write_text("")  # even a broken one is not read
    assert ray_dp.check_run_dir(cfg)[1].done == 2


def test_a_ray_rerun_says_it_trains_again_the_epochs_beyond_rays_list(tmp_path, capsys):
    run = save_run(tmp_path / "run", saved=[1, 2, 3])  # Ray trained epoch 1, then torchrun epochs 2 and 3
    (run / ray_dp.RAY_SNAPSHOT).write_text(ray_snapshot_json("checkpoint_epoch_001"))
    cfg = ray_dp.Config(dataset="digits", storage_path=str(tmp_path), name="run")
    assert ray_dp.check_run_dir(cfg)[1].done == 1  # as Ray resumes
    assert capsys.readouterr().out == (
        "note: run 'run' has checkpoint_epoch_003, beyond the latest checkpoint Ray lists: Ray resumes from "
        "checkpoint_epoch_001 and trains those epochs again (under torchrun the run resumes from the highest "
        "epoch)\n")
    (run / ray_dp.RAY_SNAPSHOT).write_text(ray_snapshot_json("checkpoint_epoch_001", "checkpoint_epoch_003"))
    ray_dp.check_run_dir(cfg)
    assert capsys.readouterr().out == ""  # nothing beyond it


@pytest.mark.parametrize("world, flags, message", [
    (3, [], "--batch-size 64 must divide by workers x accum-steps = 3"),
    (128, [], "--batch-size 64 must divide by workers x accum-steps = 128"),
    (2, ["--workers", "4"], "torchrun starts 2 processes (WORLD_SIZE=2) and they are the workers"),
    (2, ["--gpu"], "under torchrun the workers use the CPU when the machine has no GPUs: drop --gpu"),
    (2, ["--mode", "dp"], "under torchrun use --mode ddp"),
    ("abc", [], "WORLD_SIZE must be a positive whole number, got 'abc'"),
])
def test_torchrun_world_size_is_validated_like_workers(world, flags, message, monkeypatch, no_cluster, capsys):
    for key, value in {**TORCHRUN, "WORLD_SIZE": str(world)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert message in error_of([*DIGITS, *flags], capsys)


def test_torchrun_config_states_the_world_size_it_runs(monkeypatch):
    for key, value in {**TORCHRUN, "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(key, value)
    _, cfg, _ = ray_dp.parse_command(DIGITS)
    assert (cfg.workers, cfg.micro_batch, cfg.gpu) == (4, 16, torch.cuda.is_available())


def never_joins(seconds, done):
    """Rank 0 waits in an all-reduce that rank 1 never joins; the bound set afterwards must end the wait."""
    ray_dp.bound_collectives(seconds)
    if dist.get_rank() == 1:
        deadline = time.perf_counter() + seconds + 8
        while not os.path.exists(done) and time.perf_counter() < deadline:  # until rank 0 has stopped waiting
            time.sleep(0.05)
        return None
    start = time.perf_counter()
    try:
        dist.all_reduce(torch.ones(1))
    except RuntimeError:
        return time.perf_counter() - start
    finally:
        open(done, "w").close()
    return float("inf")


@pytest.mark.timeout(120)
def test_the_collective_timeout_applies_to_a_process_group_made_without_it(tmp_path):
    # Ray Train's local mode (torchrun) makes the process group with torch's default (30 min).
    waited = run_distributed(never_joins, 2, 1, str(tmp_path / "done"))[0]
    assert 0.9 < waited < 9


def test_default_run_names_differ_for_runs_started_in_the_same_second(monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda fmt: "20261130-120000")
    names = set()
    for pid in (101, 102):
        monkeypatch.setattr(os, "getpid", lambda: pid)
        names.add(ray_dp.parse_command(DIGITS)[1].name)
    assert len(names) == 2


def test_result_json_goes_beside_the_checkpoints_on_uri_storage(tmp_path):
    uri = f"file://{tmp_path}/bucket/exp/result.json"  # pyarrow's URI storage, as s3:// is
    ray_dp.write_json(uri, {"final": {"test_acc": 0.5}})
    assert json.loads((tmp_path / "bucket" / "exp" / "result.json").read_text()) == {"final": {"test_acc": 0.5}}
    assert not os.path.exists("result.json")


def test_header_states_the_samples_dropped_each_epoch():
    cfg = ray_dp.Config(dataset="digits", workers=2, name="x")
    assert "(29 train samples left out per epoch: whole global batches only)" in ray_dp.describe(cfg, DIGITS_INFO)
    assert "left out" not in ray_dp.describe(ray_dp.replace(cfg, batch_size=1, workers=1), DIGITS_INFO)


# ---- GPU or CPU workers, from what the cluster says ----

def shipped_cluster_yaml():
    """cluster.yaml as `ray up` prepares it and leaves it on the head (~/ray_bootstrap_config.yaml)."""
    from ray.autoscaler._private.util import prepare_config
    with open(os.path.join(REPO, "cluster.yaml")) as f:
        return prepare_config(yaml.safe_load(f))


def test_a_fresh_ray_up_cluster_with_gpu_node_types_but_no_gpu_yet_trains_on_gpus(tmp_path):
    bootstrap = tmp_path / "ray_bootstrap_config.yaml"
    bootstrap.write_text(yaml.safe_dump(shipped_cluster_yaml()))
    node_types = ray_dp.autoscaler_node_types(str(bootstrap))
    fresh = ray_dp.Cluster(now={"CPU": 0}, node_types=node_types)  # only the CPU:0 head is up
    assert fresh.most == {"CPU": 32, "GPU": 4}  # 4 g5.2xlarge workers; the head has CPU 0
    cfg = ray_dp.Config(address="auto", workers=4, model="resnet18")
    assert ray_dp.decide_gpu(cfg, fresh) is True
    settled = ray_dp.settle_device(cfg, fresh)  # waits for the autoscaler rather than failing
    assert settled.gpu and ray_dp.resources_per_worker(settled) == {"CPU": 1.0, "GPU": 1}
    with pytest.raises(ray_dp.ConfigError, match="its node types add up to at most"):
        ray_dp.settle_device(ray_dp.replace(cfg, workers=8), fresh)  # 8 GPUs: more than 4 nodes x 1
    with pytest.raises(ray_dp.ConfigError, match="no node type of the cluster has that much"):
        ray_dp.settle_device(ray_dp.replace(cfg, workers=2, cpus_per_worker=16), fresh)  # 8 CPUs a node


@pytest.mark.parametrize("cfg, cluster, gpu", [
    (ray_dp.Config(), ray_dp.Cluster({"CPU": 2}, None), False),  # a laptop
    (ray_dp.Config(), ray_dp.Cluster({"CPU": 2, "GPU": 1}, None), True),
    (ray_dp.Config(address="auto"), ray_dp.Cluster({"CPU": 2, "GPU": 2}, None), True),
    (ray_dp.Config(address="auto"), ray_dp.Cluster({"CPU": 8}, [({"CPU": 16}, 2)]), False),
    (ray_dp.Config(address="auto", gpu=False), ray_dp.Cluster({"CPU": 0}, [({"GPU": 4}, 1)]), False),
    (ray_dp.Config(address="auto", gpu=True), ray_dp.Cluster({"CPU": 4}, None), True),
])
def test_device_decision(cfg, cluster, gpu):
    assert ray_dp.decide_gpu(cfg, cluster) is gpu


def test_an_attached_cluster_that_cannot_say_whether_it_adds_gpus_asks_for_gpu_or_cpu():
    with pytest.raises(ray_dp.ConfigError, match="cannot tell whether it can add GPU nodes.*pass --gpu or --cpu"):
        ray_dp.decide_gpu(ray_dp.Config(address="10.0.0.1:6379"), ray_dp.Cluster({"CPU": 8}, None))


def test_cluster_yaml_and_readme_pass_gpu_explicitly():
    for path in ["cluster.yaml", "README.md"]:
        with open(os.path.join(REPO, path)) as f:
            lines = [line for line in f.read().replace("\\\n", " ").splitlines() if "--address auto" in line]
        assert lines and all("--gpu" in line or "--cpu" in line for line in lines), path


def test_ray_trains_placement_group_cleaner_waits_one_second_per_question_and_not_for_its_stop():
    # Pinned Ray 2.60: without its dashboard every State API question waits 10 s, and the end of each
    # run waited 3 s for the cleaner to stop (README, Performance). A Ray upgrade that changes the
    # callback fails here.
    from ray.train.v2._internal.callbacks.placement_group_callback import PlacementGroupCleanerCallback
    ray_dp.set_ray_train_knobs(ray_dp.Config())
    callback = PlacementGroupCleanerCallback()
    assert (callback._check_interval_s, callback._get_actor_timeout_s, callback._stop_timeout) == (1.0, 1.0, 0.1)


# ---- The failure log: what Ray Train's controller tells its public callbacks, as the console and result.json tell it ----

def recovery_log(tmp_path, **cfg):
    log = ray_dp.FailureLog(ray_dp.Config(**cfg), str(tmp_path))
    log.after_report(None, reports(1), None)  # the first worker group's first report: its nodes
    return log


def reports(epoch, nodes=("10.0.0.1", "10.0.0.2")):
    return [{"epoch": epoch, "node": node} for node in nodes]


def lost_rank_1():
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    dead = WorkerHealthCheckFailedError("A worker health check failed.", RuntimeError("node_ip='10.0.0.2'"))
    return {0: RuntimeError("Connection reset by peer"), 1: dead}


def test_a_lost_worker_is_failure_k_of_max_failures_and_the_epochs_redone_are_recorded(tmp_path, capsys):
    log = recovery_log(tmp_path, max_failures=3)
    failures = lost_rank_1()
    log.after_exception(None, failures)
    log.after_exception(None, failures)  # the same failure, polled again: one
    log.after_report(None, reports(2, ("10.0.0.1", "10.0.0.3")), None)  # resumed at epoch 2 on another node
    assert capsys.readouterr().out == (
        "ray-dp: lost worker rank 1 on 10.0.0.2 (its process or node died) during epoch 2; failure 1 "
        "(--max-failures: 3 allowed): restarting the workers from the last checkpoint\n"
        "ray-dp: 2 workers started on 10.0.0.1, 10.0.0.3\n")
    record = ray_dp.recovery_summary(str(tmp_path / "recovery.json"))
    assert (record["failures"], record["restarts"], record["epochs_redone"]) == (1, 1, [2])
    assert record["world_sizes"][-1][1] == 2
    assert "Connection reset by peer" in (tmp_path / "ray.log").read_text()  # the full errors, off the console


def test_recovery_json_keeps_every_commands_events_and_counts_the_last_ones_alone(tmp_path, capsys):
    first = recovery_log(tmp_path, max_failures=3)
    first.after_exception(None, lost_rank_1())  # the first command: a failure, then stopped (Ctrl-C)
    second = recovery_log(tmp_path, max_failures=3)  # the same --name again: a clean run
    events = json.loads((tmp_path / "recovery.json").read_text())["events"]
    assert [e["event"] for e in events] == ["command", "started", "failed", "command", "started"]
    record = ray_dp.recovery_summary(str(tmp_path / "recovery.json"))
    assert (record["failures"], record["restarts"], len(record["events"])) == (0, 0, 5)
    assert "workers started" not in capsys.readouterr().out  # a command's first start is no restart
    second.after_exception(None, lost_rank_1())
    assert ray_dp.recovery_summary(str(tmp_path / "recovery.json"))["failures"] == 1


def test_a_failure_beyond_max_failures_says_the_run_stops(tmp_path, capsys):
    log = recovery_log(tmp_path, max_failures=1)
    log.after_exception(None, {0: RuntimeError("boom")})
    log.after_exception(None, {1: RuntimeError("again")})
    assert capsys.readouterr().out.splitlines() == [
        "ray-dp: worker rank 0 on 10.0.0.1 failed: RuntimeError: boom during epoch 2; failure 1 (--max-failures: 1 "
        "allowed): restarting the workers from the last checkpoint",
        "ray-dp: worker rank 1 on 10.0.0.2 failed: RuntimeError: again during epoch 2; failure 2, more than "
        "--max-failures 1 allows: stopping"]


def test_a_resumed_run_numbers_its_failures_from_the_epoch_it_resumed_after(tmp_path, capsys):
    log = ray_dp.FailureLog(ray_dp.Config(max_failures=1), str(tmp_path), done=5)
    log.after_exception(None, lost_rank_1())
    assert "during epoch 6;" in capsys.readouterr().out


def test_a_recovery_record_that_cannot_be_written_does_not_stop_training(tmp_path, capsys):
    (tmp_path / "recovery.json").mkdir()  # in the way
    log = ray_dp.FailureLog(ray_dp.Config(), str(tmp_path))
    log.after_report(None, reports(1), None)
    log.after_exception(None, lost_rank_1())
    assert capsys.readouterr().out.count("cannot write") == 1
