"""What a newcomer meets (#23): one epoch numbering, finished reruns, messages that say what to do, outputs
that say where they went, a full disk, unreadable images, and ray_dp used from a notebook."""
import errno
import json
import os
import socket
import subprocess
import sys
import time
import traceback

import pytest
import torch

import ray_dp
from helpers import train_worker, REPO, error_of, save_run
from test_multinode import node_ports, stop_node
from test_trust import tiny_folder

DIGITS = ["--dataset", "digits"]


def runs(tmp_path):
    return ["--storage-path", str(tmp_path / "runs"), "--logdir", str(tmp_path / "tb")]


# 1. One epoch numbering: epochs count from 1; a run from before it (checkpoints counted from 0) is refused.

class Recorder:
    """A launcher that resumes from a given checkpoint and keeps what the loop reports and saves."""

    def __init__(self, state=None):
        self.state, self.reports, self.saved = state, [], []

    def latest_checkpoint(self):
        return self.state

    def report(self, metrics, state, epoch, step=0):
        self.reports.append((epoch, metrics["epoch"], state and state["epoch"]))
        self.saved.append(state)


def train_here(cfg, launcher):
    return train_worker(cfg, ray_dp.Worker(0, 1, torch.device("cpu")), launcher, ray_dp.LoopOptions(),
                               {"loop": time.time()})


def as_old_run(run_dir, states):
    """A run directory as ray_dp wrote it before epochs counted from 1: checkpoint_epoch_000 holds the state after
    epoch 1, with "epoch": 0 and a history numbered from 0, and no "format"."""
    for state in states:
        old = {k: v for k, v in state.items() if k != "format"}
        old["epoch"] -= 1
        old["history"] = [{**m, "epoch": m["epoch"] - 1} for m in state["history"]]
        path = run_dir / ray_dp.checkpoint_dir_name(old["epoch"]) / ray_dp.CHECKPOINT_FILE
        path.parent.mkdir(parents=True)
        torch.save(old, path)


def test_epochs_count_from_1_and_a_run_from_before_is_refused_in_one_line(tmp_path, no_cluster, capsys):
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(dataset="synthetic", synthetic_size=64, epochs=2, name="old",
                                                   storage_path=str(tmp_path / "runs")))
    first = Recorder()
    out = train_here(cfg, first)
    assert first.reports == [(1, 1, 1), (2, 2, 2)]  # the checkpoint after epoch 2 is epoch 2's
    assert [m["epoch"] for m in out["history"]] == [1, 2] and out["started_at_epoch"] == 1
    as_old_run(tmp_path / "runs" / "old", first.saved)
    old = tmp_path / "runs" / "old" / "checkpoint_epoch_001"
    synthetic = ["--dataset", "synthetic", "--synthetic-size", "64"]  # a step of the default global batch
    err = error_of(["--name", "old", *synthetic, *runs(tmp_path), "--epochs", "3"], capsys)
    assert f"run 'old' cannot resume: {old / ray_dp.CHECKPOINT_FILE} is a format-1 checkpoint (epochs counted " \
           f"from 0), which this ray_dp.py no longer reads: train the run again" in err
    assert "is a format-1 checkpoint" in error_of(["--eval-only", str(old), *synthetic, *runs(tmp_path)], capsys)


# 4. A finished run says so before any cluster starts, and how to extend it.

def test_a_finished_run_ends_before_ray_starts_and_says_how_to_extend_it(tmp_path, no_cluster, capsys):
    run = save_run(tmp_path / "runs" / "done", saved=(1, 2, 3), epochs=3)
    epochs = [{"epoch": e, "test_acc": 0.9} for e in (1, 2, 3)]
    (run / "result.json").write_text(json.dumps({"final": epochs[-1], "epochs": epochs, "format": 2}))
    assert ray_dp.main(["--name", "done", *DIGITS, *runs(tmp_path)]) == 0  # no_cluster: Ray never starts
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "ray-dp: run 'done' already finished its 3 epochs; nothing to train (--epochs 13 trains " \
                      "it further)"
    assert ray_dp.main(["--name", "done", *DIGITS, *runs(tmp_path), "--epochs", "2"]) == 0
    assert "has trained 3 epochs, more than --epochs 2; nothing to train" in capsys.readouterr().out
    # ... its command checked as any other's (rule 1: validated on every path), though it trains nothing
    assert "--batch-size 64 must divide by workers x accum-steps = 3" in error_of(
        ["--name", "done", *DIGITS, *runs(tmp_path), "--workers", "3"], capsys)
    assert error_of(["--name", "done", *DIGITS, *runs(tmp_path), "--keep-checkpoints", "-1"], capsys) == (
        "ray_dp.py: error: --keep-checkpoints must be at least 0, got -1\n")
    summary = ray_dp.train(name="done", dataset="digits", storage_path=str(tmp_path / "runs"))
    assert [m["epoch"] for m in summary["epochs"]] == [1, 2, 3]
    assert capsys.readouterr().out.strip().endswith("already finished its 3 epochs; nothing to train (--epochs 13 "
                                                    "trains it further)")


# 3. A missing data set: the files it needs, no foreign hint, nothing left behind.

def test_a_failed_download_names_the_files_and_takes_away_what_it_made(tmp_path, no_cluster, capsys):
    data = tmp_path / "data"
    err = error_of(["--data-dir", str(data), *runs(tmp_path)], capsys)
    assert f"FashionMNIST is not in {data} and could not be downloaded (<urlopen error no network>): put its files there " in err
    assert f"({data}/FashionMNIST/raw/ holding train-images-idx3-ubyte, train-labels-idx1-ubyte, " \
           f"t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, from " \
           f"http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/)" in err
    assert "download=True" not in err and not data.exists()  # no lock file, no empty folders
    # A data directory that was there keeps what it had, and the lock (another process may wait on it).
    data.mkdir()
    (data / "mine.txt").write_text("kept")
    error_of(["--data-dir", str(data), *runs(tmp_path)], capsys)
    assert sorted(p.name for p in data.iterdir()) == [".FashionMNIST.lock", "mine.txt"]
    err = error_of(["--dataset", "cifar10", "--no-download", "--data-dir", str(data), *runs(tmp_path)], capsys)
    assert f"CIFAR10 is not in {data} (--no-download): put its files there ({data}/cifar-10-batches-py/ holding " \
           f"data_batch_1, data_batch_2, data_batch_3, data_batch_4, data_batch_5, test_batch, batches.meta, from " \
           f"https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz)" in err


# 6, 7. The header says every switch; --help names the other commands.

def test_the_header_states_every_switch_that_changes_the_maths_or_the_speed():
    cfg = ray_dp.Config(model="resnet18", dataset="synthetic", workers=1, batch_size=8, accum_steps=2, sync_bn=True,
                        amp="bf16", compile=True, gpu=False, name="h")
    info = ray_dp.DataInfo((512, 100), (1, 28, 28), [str(c) for c in range(10)], False)
    header = ray_dp.describe(cfg, info)
    for said in ["1 CPU worker,", "global batch 8 = 4 per worker x 1 worker x 2 accum",
                 "gradients all-reduced every 2 micro-batches (no_sync)", "SyncBatchNorm (ray_dp's, for gloo)",
                 "bf16 autocast", "torch.compile", "batches indexed in memory", "1 thread per worker"]:
        assert said in header, (said, header)
    folder = ray_dp.describe(ray_dp.Config(dataset="folder", workers=3, batch_size=48, gpu=False, name="f"),
                             ray_dp.DataInfo((480, 60), (3, 28, 28), ["a", "b"], True))
    assert "3 CPU workers," in folder and "2 loader processes per worker" in folder and "SyncBatchNorm" not in folder


def test_help_names_compare_and_doctor(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps at the terminal's width
    with pytest.raises(SystemExit) as done:
        ray_dp.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert out.startswith("usage: ray_dp.py [compare | doctor | predict] [flags]")
    assert "'ray_dp.py compare [flags]'" in out and "'ray_dp.py\ndoctor [flags]'" in out


# 12. A full disk: one line, the last safe checkpoint, the same command resumes; no .tmp left.

def test_a_full_disk_is_one_line_naming_the_last_safe_checkpoint_and_leaves_no_tmp_files(tmp_path, no_cluster,
                                                                                       monkeypatch, capsys):
    from ray.train import WorkerGroupError
    run = save_run(tmp_path / "runs" / "full", saved=(1, 2, 3), epochs=10)

    def fit(cfg, loop, options, done):  # rank 0 could not write epoch 4's checkpoint
        assert done == 3
        raise WorkerGroupError("rank 0 failed", {0: RuntimeError("OSError: [Errno 28] No space left on device")})

    real_open = open

    def full_open(path, *args, **kwargs):  # and nothing more fits beside it
        if str(path).startswith(str(run)) and "w" in (args[0] if args else kwargs.get("mode", "r")):
            file = real_open(path, *args, **kwargs)
            file.write = lambda text: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))
            return file
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(ray_dp, "fit", fit)
    monkeypatch.setattr(ray_dp, "connect", lambda cfg: ray_dp.replace(cfg, gpu=False))
    monkeypatch.setattr(ray_dp.ray, "put", lambda value: value)
    monkeypatch.setattr(ray_dp, "open", full_open, raising=False)
    assert ray_dp.main(["--name", "full", *DIGITS, *runs(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"ray_dp.py: training failed: no space left on the device of --storage-path "
                          f"{tmp_path / 'runs'} (")
    assert err.rstrip().endswith(f"free); the last checkpoint that is safe is {run / 'checkpoint_epoch_003'} "
                                 f"(after epoch 3 of 10): once there is space, the same command resumes from it")
    assert not list(run.rglob("*.tmp")) and not (run / "result.json").exists()


def test_an_atomic_write_that_fails_leaves_the_old_file_and_nothing_beside_it(tmp_path, monkeypatch):
    path = tmp_path / "result.json"
    path.write_text("old")
    monkeypatch.setattr(ray_dp.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    with pytest.raises(OSError):
        ray_dp.write_stored(str(path), b"new")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["result.json"]


def test_a_checkpoint_is_on_the_disk_before_its_rename_and_an_older_one_goes_only_after(tmp_path, monkeypatch):
    run, events = tmp_path / "runs" / "r", []
    state = {"model": {"w": torch.zeros(2)}, "epoch": 0}
    ray_dp.save_checkpoint(str(run), state, 1, 40)
    real_fsync, real_replace, real_files_at = os.fsync, os.replace, ray_dp.files_at

    def fsync(descriptor):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        real_fsync(descriptor)

    class Deleting:  # the run directory's file system, its deletions recorded
        def __init__(self, storage):
            self.storage = storage

        def delete_dir(self, path):
            events.append(("delete", path))
            self.storage.delete_dir(path)

        def __getattr__(self, name):
            return getattr(self.storage, name)
    monkeypatch.setattr(ray_dp.os, "fsync", fsync)
    monkeypatch.setattr(ray_dp.os, "replace", lambda *paths: (events.append(("rename", paths[1])), real_replace(*paths)))
    monkeypatch.setattr(ray_dp, "files_at", lambda path: (  # the run directory's, where save_checkpoint deletes
        Deleting(real_files_at(path)[0]) if path.startswith(str(run)) else real_files_at(path)[0],
        real_files_at(path)[1]))
    ray_dp.save_checkpoint(str(run), state, 1, 80)
    new = run / "checkpoint_epoch_001_step_000080"
    assert events == [("fsync", f"{new}/checkpoint.pt.tmp"), ("rename", f"{new}/checkpoint.pt"),
                      ("fsync", str(new)), ("fsync", str(run)),  # the file's entry, then the new directory's
                      ("delete", str(run / "checkpoint_epoch_001_step_000040"))]


def test_a_write_is_done_where_its_directory_cannot_be_flushed_and_file_uris_write_atomically(tmp_path, monkeypatch):
    real_open = os.open

    def refusing(path, flags, *args):  # a directory this process may write but not read (mode 0733)
        if os.path.isdir(path):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args)
    monkeypatch.setattr(ray_dp.os, "open", refusing)
    ray_dp.write_stored(str(tmp_path / "result.json"), b"{}")
    assert (tmp_path / "result.json").read_text() == "{}"
    monkeypatch.undo()
    renamed = []
    real_replace = os.replace
    monkeypatch.setattr(ray_dp.os, "replace", lambda *paths: (renamed.append(paths[1]), real_replace(*paths)))
    ray_dp.write_stored(f"file://{tmp_path}/runs/r/result.json", b"{}")
    assert renamed == [f"{tmp_path}/runs/r/result.json"] and not list((tmp_path / "runs" / "r").glob("*.tmp"))


# 13. An unreadable image is named, with its folder, wherever it is decoded.

def broken_folder(tmp_path):
    root = tiny_folder(tmp_path / "images")
    bad = root / "train" / "dog" / "3.png"
    bad.write_bytes(bad.read_bytes()[:60])  # a truncated PNG
    return root, bad


def test_an_unreadable_image_is_named_by_the_drivers_statistics(tmp_path, no_cluster, capsys):
    root, bad = broken_folder(tmp_path)
    err = error_of(["--dataset", "folder", "--data-dir", str(root), "--batch-size", "4", *runs(tmp_path)], capsys)
    assert f"ray_dp.py: error: {bad} is not a readable image (" in err
    assert f"remove or replace it in {bad.parent}/ (and any other such file in --data-dir {root})" in err


def test_an_unreadable_image_is_named_by_a_workers_loader_and_by_evaluation(tmp_path):
    root, bad = broken_folder(tmp_path)
    cfg = ray_dp.Config(dataset="folder", data_dir=str(root), batch_size=4, workers=1, normalize=((0.5,) * 3,) * 2)
    train, _ = ray_dp.load_dataset(cfg)
    loader = ray_dp.train_batches(train, ray_dp.replace(cfg, loader_workers=1), 0, 1, torch.device("cpu"))
    loader.sampler.set_epoch(0)
    with pytest.raises(ray_dp.DataError) as raised:
        list(loader)  # in a loader process: torch re-raises its error here, with the process's traceback
    # What the driver prints of a worker's failure: the last line, the file named
    assert ray_dp.first_line(raised.value).startswith(f"DataError: {bad} is not a readable image (")
    # The loader (its process persistent) stops its process now, the traceback's frames let go of it: freed by a
    # later garbage collection, its iterator would wait 5 s for the process (its queues closed first), in whichever
    # test that collection falls.
    traceback.clear_frames(raised.tb)
    del loader
    with pytest.raises(ray_dp.DataError, match=f"{bad} is not a readable image"):
        ray_dp.evaluate(ray_dp.build_model("lenet", (3, 28, 28), 2).eval(), train, torch.device("cpu"), 4)


# 11. ray_dp from a notebook: imported, in another directory, on a local Ray and on an attached cluster.

NOTEBOOK = """
import json, math, sys
sys.path.insert(0, {repo!r})
import ray, ray_dp
import torch.nn as nn


class Net(nn.Module):  # the notebook's own model, which says when it first runs
    def __init__(self, sample_shape, num_classes):
        super().__init__()
        self.layer, self.said = nn.Linear(math.prod(sample_shape), num_classes), False

    def forward(self, x):
        if not self.said:
            print("NET FORWARD", flush=True)
            self.said = True
        return self.layer(x.flatten(1))


own = ray_dp.train(workers=2, model=Net, dataset="my_data.py:wine", epochs=2, batch_size=16,
                   storage_path="runs", name="own", address={address!r}, gpu=False)
print("OWN", own["final"]["test_acc"], own["config"]["model"])


@ray_dp.model("tinynet")  # registered by name in the notebook: its workers get it too
def tinynet(sample_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(784, num_classes))


named = ray_dp.train(workers=2, model="tinynet", dataset="digits", epochs=1, storage_path="runs",
                     name="named", address={address!r}, gpu=False)
print("NAMED", named["final"]["test_count"])
ray.shutdown()
local = ray_dp.train(workers=2, model=Net, dataset="digits", epochs=2, storage_path="runs", name="local",
                     quiet=True, worker_output=True)
print("SUMMARIES", json.dumps([[m["epoch"] for m in s["epochs"]] for s in (named, local)]))
"""


def answering(host, port, process, seconds=60):
    """Once host:port takes connections (process: what should be listening there, still running)."""
    deadline = time.time() + seconds
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            assert process.poll() is None and time.time() < deadline, f"nothing answers at {host}:{port}"
            time.sleep(0.2)


@pytest.mark.ray
@pytest.mark.timeout(400)
def test_ray_dp_trains_from_a_notebook_in_another_directory_locally_and_attached(tmp_path):
    # A cluster of its own whose processes cannot import ray_dp from the repository (no PYTHONPATH).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_DEDUP_LOGS"] = "0"  # each worker's line, not Ray's fold of alike lines
    head = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "ray"), "start", "--block", "--head",
                             "--node-ip-address", "127.0.0.5", "--port", "29379", "--num-cpus", "3",
                             "--include-dashboard", "false", "--disable-usage-stats", "--ray-client-server-port",
                             "29380", *node_ports(30000)], env=env, cwd=tmp_path,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    # a data set of the notebook's own in a file that is gone once the driver has read it: the workers get it whole
    (tmp_path / "my_data.py").write_text(open(os.path.join(REPO, "tests", "user_code.py")).read()
                                         + "\nimport os\nos.remove(__file__)\n")
    try:
        answering("127.0.0.5", 29379, head)  # as `ray start --head` returns to a user once the head is up
        script = NOTEBOOK.format(repo=REPO, address="127.0.0.5:29379")
        done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=360)
    finally:
        stop_node(head)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.split("NAMED ", 1)[1].split()[0] == "360"
    own_acc, own_model = done.stdout.split("OWN ", 1)[1].split()[:2]
    assert float(own_acc) > 0.8 and own_model == "__main__:Net" and not (tmp_path / "my_data.py").exists()
    # the workers' prints reach the console once each with worker_output, not at all without it
    said = [line for line in (done.stdout + done.stderr).splitlines() if "NET FORWARD" in line]
    by_workers = [line for line in said if "RayTrainWorker pid=" in line]
    assert len(said) - len(by_workers) == 2, said  # the driver's check of the model, twice
    assert len(by_workers) == 2 and len({line.split("pid=")[1].split(")")[0] for line in by_workers}) == 2, said
    summaries = json.loads(done.stdout.split("SUMMARIES ", 1)[1].splitlines()[0])
    assert summaries == [[1], [1, 2]]
    assert json.loads((tmp_path / "runs" / "local" / "result.json").read_text())["epochs"][-1]["epoch"] == 2


def test_train_takes_the_flags_as_settings_and_refuses_others():
    assert ray_dp.settings_as_flags({"workers": "2:4", "batch_size": 48, "augment": False, "amp": True,
                                     "sync_bn": False, "gpu": False, "image_size": None}) == [
        "--workers", "2:4", "--batch-size", "48", "--no-augment", "--amp", "--cpu"]
    with pytest.raises(ray_dp.ConfigError, match="ray_dp.train\\(\\) has no setting 'batchsize'"):
        ray_dp.train(batchsize=32)
