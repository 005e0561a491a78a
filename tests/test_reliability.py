"""Reliability: a dead worker, a killed driver, a corrupt checkpoint; bitwise-reproducible runs."""
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import helpers
import ray_dp
from helpers import REPO, assert_bitwise_equal, final_weights

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_cluster")]
# Small steps (4 samples per worker) so that an epoch lasts long enough to be interrupted in.
RUN = ["--workers", "2", "--dataset", "digits", "--batch-size", "8", "--epochs", "3", "--seed", "5"]


def train(tmp_path, name, *flags):
    return helpers.train(tmp_path, name, *RUN, *flags)


def crash_once(marker, at_epoch, at_step, sigterm=False, once_committed=None):
    """ray_dp's training function, except that rank 1 dies at this step of this epoch as a killed process
    would (os._exit: no exception, no cleanup), or gets SIGTERM there (as a reclaimed spot node's processes do),
    once: the marker file, at an absolute path, lets the restarted group run through. once_committed: (run
    directory, checkpoint directory name) that rank 1 waits there for Ray to have committed (at its controller's
    next poll: a checkpoint a worker dies before is lost). The driver hands it to Ray in place of
    ray_dp.train_loop_per_worker."""
    def train_loop_per_worker(config):
        import os
        import signal
        import time

        import ray

        import ray_dp
        if ray.train.get_context().get_world_rank() == 1 and not os.path.exists(marker):
            batches = ray_dp.InMemoryBatches.__iter__

            def committed():
                run_dir, name = once_committed
                return f"/{name}/" in (ray_dp.latest_committed(run_dir) or "")

            def dying(self):
                for step, batch in enumerate(batches(self)):
                    if (self.sampler.epoch, step) == (at_epoch, at_step):
                        deadline = time.time() + 60
                        while once_committed and not committed() and time.time() < deadline:
                            time.sleep(0.05)
                        open(marker, "w").close()
                        if not sigterm:
                            os._exit(1)
                        os.kill(os.getpid(), signal.SIGTERM)
                    yield batch
            ray_dp.InMemoryBatches.__iter__ = dying
        return ray_dp.train_loop_per_worker(config)
    return train_loop_per_worker


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted run, the yardstick of every test here: its directory."""
    tmp_path = tmp_path_factory.mktemp("reference")
    train(tmp_path, "reference")
    return tmp_path / "reference"


@pytest.fixture(scope="module")
def reference(reference_run):
    return final_weights(json.loads((reference_run / "result.json").read_text()))


def test_a_second_run_with_the_same_seed_ends_identical_even_through_dataloader_processes(tmp_path, reference):
    # DataLoader processes forked in each Ray worker deliver the same batches as the in-memory path.
    assert_bitwise_equal(final_weights(train(tmp_path, "again", "--loader-workers", "2")), reference)


def test_a_worker_killed_mid_epoch_restarts_from_the_checkpoint_within_the_epoch_and_ends_identical(
        tmp_path, monkeypatch, capsys, reference):
    marker = tmp_path / "crashed"
    monkeypatch.setattr(ray_dp, "train_loop_per_worker",  # epoch 3, step 53, once Ray has committed step 40's
                        crash_once(str(marker), 2, 52, once_committed=(str(tmp_path / "crash"),
                                                                      "checkpoint_epoch_003_step_000040")))
    result = train(tmp_path, "crash", "--max-failures", "1", "--checkpoint-every", "20")
    assert marker.exists()  # it did die
    out = capsys.readouterr().out
    # as Ray reports an exit (its error lists the OOM killer among possible causes of every one): not out of memory
    assert "(its process or node died) during epoch 3; failure 1 (--max-failures: 1 allowed)" in out
    # the restarted group resumed from the checkpoint after step 40 of epoch 3: steps 41 to 52 are trained twice (step
    # 52 is the run's step 410, a log step, at which the ranks agreed, and rank 0 told the driver)
    # what the workers restored is what the checkpoint certifies (the file's fingerprint, recomputed on every rank)
    assert ("resuming at epoch 3 of 3, step 41 of 179, with 2 workers, from the checkpoint at epoch 3, step 40: the "
            "same model, optimizer, history and data position as saved") in out
    assert result["resumed"] == {"from": "epoch 3, step 40", "certified": True}
    assert result["started_at_epoch"] == 3 and result["recovery"]["steps_redone"] == 12
    assert [m["epoch"] for m in result["epochs"]] == [1, 2, 3] and result["epochs"][-1]["train_samples"] == 1432
    assert_bitwise_equal(final_weights(result), reference)
    # where the time went: the categories add up to the wall clock, what no clock saw ("other") within 2% of it; the
    # failure's cost (its steps since the save, the restart, the new group's set-up) charged to it
    helpers.assert_ledger_adds_up(result["ledger"], failed=1)
    assert result["ledger"]["failures"] > 1
    # the latest 3 epochs' checkpoints (--keep-checkpoints' default): the mid-epoch ones went as Ray stored newer ones
    assert sorted(p.name for p in (tmp_path / "crash").glob("checkpoint_epoch_*")) == [
        "checkpoint_epoch_001", "checkpoint_epoch_002", "checkpoint_epoch_003"]


def test_a_run_directory_ray_never_listed_resumes_on_ray_from_its_latest_epoch_identically(
        tmp_path, reference_run, reference, monkeypatch, capsys):
    run = tmp_path / "unlisted"  # as torchrun leaves a run, or Ray one it stopped before it listed a checkpoint
    for epoch in (1, 2):
        name = ray_dp.checkpoint_dir_name(epoch)
        shutil.copytree(reference_run / name, run / name)
    marker = tmp_path / "crashed"  # and a worker dies before Ray has a checkpoint of its own to restart from
    monkeypatch.setattr(ray_dp, "train_loop_per_worker", crash_once(str(marker), 2, 5))
    result = train(tmp_path, "unlisted", "--max-failures", "1")
    out = capsys.readouterr().out
    assert marker.exists() and "during epoch 3; failure 1 (--max-failures: 1 allowed)" in out
    assert out.count("resuming at epoch 3 of 3") == 2  # both worker groups
    # Ray had no checkpoint to give the workers: they took the driver's, and trained epoch 3 only
    assert result["started_at_epoch"] == 3 and [m["epoch"] for m in result["epochs"]] == [1, 2, 3]
    listed = json.loads((run / ray_dp.RAY_SNAPSHOT).read_text())["checkpoint_results"]
    assert [entry["checkpoint_dir_name"] for entry in listed] == ["checkpoint_epoch_003"]
    assert_bitwise_equal(final_weights(result), reference)


def test_sigterm_to_a_worker_saves_at_the_next_log_step_and_ray_restarts_from_there(tmp_path, monkeypatch, capsys,
                                                                                   reference):
    monkeypatch.setattr(ray_dp, "train_loop_per_worker", crash_once(str(tmp_path / "signalled"), 1, 33, sigterm=True))
    result = train(tmp_path, "spot", "--max-failures", "1", "--checkpoint-every", "0")
    out = capsys.readouterr().out
    assert "saving a checkpoint within seconds" not in out  # the driver's promise; a rank's own may be a teardown's
    # signalled in step 34 of epoch 2: saved at the ranks' next agreement, at the latest the next log step (step 41,
    # the run's 220th), where the restarted workers go on
    saved = re.search(r"ray-dp: a worker got SIGTERM; saved epoch 2, step (\d+) of 179 and stopped during epoch 2; "
                      r"failure 1 \(--max-failures: 1 allowed\): restarting the workers from the last checkpoint", out)
    assert saved and 34 <= int(saved[1]) <= 41, out
    assert f"from the checkpoint at epoch 2, step {saved[1]}" in out
    assert result["recovery"]["steps_redone"] == 0 and result["recovery"]["failures"] == 1
    assert_bitwise_equal(final_weights(result), reference)


# The driver, with its workers' steps of epoch 2 slowed to 0.6 s each until the file `fast` exists: `python ray_dp.py` as
# imported (so Ray ships ray_dp to its workers), its training function a wrapper that travels by value.
SLOWED_DRIVER = """
import sys
import ray_dp

def train_loop_per_worker(config, fast=sys.argv[1]):
    import os
    import time
    import ray_dp
    batches = ray_dp.InMemoryBatches.__iter__

    def slowed(self):
        for step, batch in enumerate(batches(self)):
            if self.sampler.epoch == 1 and not os.path.exists(fast):
                time.sleep(0.6)
                with open(f"{fast}.{os.getpid()}", "w") as at:  # the step being trained, for the test to read
                    at.write(str(step))
                os.replace(f"{fast}.{os.getpid()}", fast + ".at")  # whole: never read empty
            yield batch
    ray_dp.InMemoryBatches.__iter__ = slowed
    return ray_dp.train_loop_per_worker(config)

ray_dp.train_loop_per_worker = train_loop_per_worker
sys.exit(ray_dp.main(sys.argv[2:]))
"""


def driver_past_epoch_1(tmp_path, name, stdout, *flags, slow=False):
    """`python ray_dp.py` on the shared cluster, in a session of its own (Ctrl-C in a terminal signals the whole
    foreground process group), once Ray has committed its epoch 1; and the path of Ray's snapshot of the run.
    slow: its epoch 2 slowed (SLOWED_DRIVER) until the file tmp_path / "fast" exists."""
    command = [*RUN, "--cpu", "--storage-path", str(tmp_path), "--name", name, "--logdir", str(tmp_path / "tb"),
               "--address", ray.get_runtime_context().gcs_address, *flags]
    command = ([sys.executable, "-c", SLOWED_DRIVER, str(tmp_path / "fast"), *command] if slow
               else [sys.executable, "ray_dp.py", *command])
    driver = subprocess.Popen(command, cwd=REPO, env=dict(os.environ, RAY_AUTH_MODE="token"),
                              stdout=stdout, stderr=subprocess.PIPE, text=True, start_new_session=True)
    snapshot = tmp_path / name / "checkpoint_manager_snapshot.json"
    deadline = time.time() + 240
    while not (snapshot.exists() and "checkpoint_epoch_001" in snapshot.read_text()):  # epoch 1 committed
        assert driver.poll() is None and time.time() < deadline, "the first run never checkpointed"
        time.sleep(0.1)
    return driver, snapshot


def test_sigterm_to_the_driver_saves_within_seconds_however_long_the_steps_and_the_same_command_resumes_identically(
        tmp_path, reference):
    # no log step in an epoch (179 steps), and 65 s into epoch 2 before the signal: rank 0 said nothing of its steps
    # for longer than the minute after which the driver once took it for not training, and let the signal kill it; the
    # stop is agreed within seconds of training (rank 0's next beat, then the ranks' next agreement), not at a log step
    driver, _ = driver_past_epoch_1(tmp_path, "drained", subprocess.PIPE, "--log-every", "1000", slow=True)
    printed = {"stdout": [], "stderr": []}
    heard = threading.Event()  # the driver's board has the stop: rank 0 hears it at its next beat

    def read(name):
        for line in getattr(driver, name):
            printed[name].append(line)
            if line.startswith("ray-dp: SIGTERM: saving"):
                heard.set()
    readers = [threading.Thread(target=read, args=(name,), daemon=True) for name in printed]
    for reader in readers:
        reader.start()
    time.sleep(65)
    driver.send_signal(signal.SIGTERM)
    signalled, step_signalled = time.time(), int((tmp_path / "fast.at").read_text() or 0)
    assert heard.wait(30), "the driver never took the SIGTERM"
    try:  # the steps stay 0.6 s until the run has stopped (a beat, an agreement, the save), so the steps it overran
        driver.wait(timeout=60)  # count its seconds, however loaded the machine
    except subprocess.TimeoutExpired:
        pass
    (tmp_path / "fast").touch()
    driver.wait(timeout=120)
    for reader in readers:
        reader.join(timeout=30)
    stdout, stderr = "".join(printed["stdout"]), "".join(printed["stderr"])
    assert driver.returncode == 143 and "Traceback" not in stderr, stdout + stderr
    stopped = re.fullmatch(r"ray_dp.py: stopped at epoch 2, step (\d+) of 179 \(SIGTERM\), its checkpoint saved: the "
                           r"same command resumes from there", stderr.splitlines()[-1])
    assert stopped, stderr
    # 50 steps or more into epoch 2 (0.6 s a step) when signalled, and stopped within 4 beats' time of it
    assert 50 <= step_signalled <= int(stopped[1]) <= step_signalled + 4 * ray_dp.DriverLink.BEAT_S / 0.6 + 5
    assert "ray-dp: SIGTERM: saving a checkpoint within seconds of training" in stdout
    assert time.time() - signalled < 120

    result = train(tmp_path, "drained")  # the same command, in this process: the rest of epoch 2, then epoch 3
    assert result["started_at_epoch"] == 2 and result["epochs"][1].get("resumed_at_step") == int(stopped[1])
    assert result["recovery"]["steps_redone"] == 0
    assert_bitwise_equal(final_weights(result), reference)
    helpers.assert_ledger_adds_up(result["ledger"])  # both commands' time: the stopped one's kept in ledger.json
    assert result["ledger"]["saved"] >= 2  # epoch 1's and the SIGTERM's


@pytest.mark.timeout(300)
def test_sigterm_to_the_drivers_whole_process_group_stops_its_own_ray_too_and_exits_143_within_seconds(tmp_path):
    # timeout(1) and scancel signal the whole group: ray_dp's own Ray (its GCS) stops with the driver, which once
    # waited a minute for that GCS and exited 1
    driver = subprocess.Popen([sys.executable, "ray_dp.py", "--workers", "2", "--dataset", "digits", "--epochs", "40",
                               "--storage-path", str(tmp_path), "--name", "group", "--logdir", str(tmp_path / "tb")],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    snapshot, deadline = tmp_path / "group" / "checkpoint_manager_snapshot.json", time.time() + 150
    def epochs_committed():  # the highest whole epoch Ray lists (it keeps the latest 3)
        text = snapshot.read_text() if snapshot.exists() else ""
        return max(map(int, re.findall(r"checkpoint_epoch_(\d{3})(?![_\d])", text)), default=0)
    try:  # rank 0 prints an epoch's line before its checkpoint is reported: wait for Ray's commit of epoch 2 or later
        while epochs_committed() < 2:
            assert driver.poll() is None and time.time() < deadline, "the run never committed epoch 2"
            time.sleep(0.1)
    finally:
        if epochs_committed() < 2:  # the group too: its own Ray outlives a driver that died
            with contextlib.suppress(ProcessLookupError):
                os.killpg(driver.pid, signal.SIGKILL)
    os.killpg(driver.pid, signal.SIGTERM)
    signalled = time.time()
    stderr = driver.communicate(timeout=100)[1]
    assert driver.returncode == 143 and time.time() - signalled < 30, stderr
    # the workers get the signal too: they save at their next agreement, or Ray stops first and epoch 2's committed
    # checkpoint, or a later epoch's, is the one to resume from
    stopped = re.fullmatch(r"ray_dp.py: stopped (after epoch (\d+) of 40|at epoch (\d+) of 40, step (\d+)) \(SIGTERM, "
                           r"to ray_dp's own Ray too\); the same command resumes from (\S+)", stderr.splitlines()[-1])
    assert stopped and os.path.isfile(stopped[5]), stderr
    done, step = (int(stopped[2]), 0) if stopped[2] else (int(stopped[3]) - 1, int(stopped[4]))
    checkpoint = ray_dp.load_checkpoint(stopped[5])
    assert done + (step > 0) >= 2 and (checkpoint["epoch"], (checkpoint.get("partial") or {}).get("step", 0)) == (
        done, step)
    ledger = json.loads((tmp_path / "group" / "ledger.json").read_text())  # its time, kept for the run's total
    assert sum(ledger[what] for what in ray_dp.LEDGER) == pytest.approx(ledger["wall"], abs=0.01) and ledger["wall"] > 5


def test_a_worker_death_without_max_failures_fails_with_a_message(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(ray_dp, "train_loop_per_worker", crash_once(str(tmp_path / "crashed"), 0, 3))
    assert ray_dp.main([*RUN, "--storage-path", str(tmp_path), "--name", "dies", "--logdir", str(tmp_path)]) == 1
    assert "ray_dp.py: training failed:" in capsys.readouterr().err


def test_ctrl_c_says_where_it_stopped_and_the_same_command_resumes_identically(tmp_path, reference):
    driver, snapshot = driver_past_epoch_1(tmp_path, "killed", subprocess.DEVNULL)
    os.killpg(driver.pid, signal.SIGINT)
    stderr = driver.communicate(timeout=120)[1]
    committed = json.loads(snapshot.read_text())["checkpoint_results"]
    assert len(committed) < 3, "the run finished before it was interrupted"
    assert driver.returncode == 130 and "Traceback" not in stderr
    assert stderr.splitlines()[-1] == (f"ray_dp.py: interrupted after epoch {len(committed)} of 3 (saved in "
                                       f"{tmp_path / 'killed'}); the same command with --name killed resumes it")

    result = train(tmp_path, "killed")  # the same command, in this process
    assert result["started_at_epoch"] == len(committed) + 1  # continued after the last committed epoch
    assert_bitwise_equal(final_weights(result), reference)


def test_a_corrupt_latest_checkpoint_is_one_sentence_and_fresh_starts_over(tmp_path, capsys, reference_run, reference):
    shutil.copytree(reference_run, tmp_path / "corrupt")  # a finished run, as the reference left it
    latest = tmp_path / "corrupt" / "checkpoint_epoch_003" / ray_dp.CHECKPOINT_FILE
    latest.write_bytes(latest.read_bytes()[:1000])  # cut short
    capsys.readouterr()
    assert ray_dp.main([*RUN, "--storage-path", str(tmp_path), "--name", "corrupt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run 'corrupt' cannot resume:" in err and "is not a readable checkpoint" in err
    assert "--fresh" in err

    old = ray_dp.TensorBoardWriter(ray_dp.Config(logdir=str(tmp_path / "tb"), name="corrupt", epochs=20))
    old.write({"epoch": 10, "train_loss": 9.0, "step_log": []})  # the curve of an earlier run under this name
    old.writer.close()
    result = train(tmp_path, "corrupt", "--fresh")
    assert result["started_at_epoch"] == 1 and len(result["epochs"]) == 3
    events = EventAccumulator(str(tmp_path / "tb" / "corrupt")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (m["epoch"], pytest.approx(m["train_loss"])) for m in result["epochs"]]  # the new run's alone
    assert_bitwise_equal(final_weights(result), reference)


HANGING = '''
import torch, torch.nn as nn, torch.distributed as dist


class HangsOnRank1(nn.Module):
    """A user's model whose rank 1, in its 30th forward pass, waits in a collective no other rank comes to."""

    def __init__(self):
        super().__init__()
        self.layer, self.calls, self.aside = nn.Linear(784, 10), 0, None

    def forward(self, x):
        if self.aside is None and dist.is_initialized():
            self.aside = dist.new_group()  # every rank, in its first forward pass
        self.calls += 1
        if self.calls == 30 and self.training and dist.get_rank() == 1:
            dist.all_reduce(torch.zeros(1), group=self.aside)
        return self.layer(x.flatten(1))
'''


def test_a_rank_that_hangs_in_a_collective_is_named_with_the_records_of_every_ranks_stacks(tmp_path, capsys):
    (tmp_path / "hang.py").write_text(HANGING)
    code = ray_dp.main([*RUN, "--model", f"{tmp_path}/hang.py:HangsOnRank1", "--timeout", "20", "--epochs", "1",
                        "--storage-path", str(tmp_path), "--name", "hang", "--logdir", str(tmp_path / "tb")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("ray_dp.py:")]  # (not Ray's)
    hang = tmp_path / "hang" / "hang"
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith("ray_dp.py: training failed: rank 1 did not come to collective "), err
    assert (f"which the other ranks waited in for --timeout 20 s: its stacks are in {hang}/rank1.txt (every rank's "
            f"beside it, and torch's flight recorder in rank<N>.json)") in err[0]
    for rank in (0, 1):  # each rank's Python stacks, written once it had made no progress for --timeout / 2
        text = (hang / f"rank{rank}.txt").read_text()
        assert text.startswith(f"rank {rank} of 2 on ") and "no progress for 10 s (--timeout / 2)" in text
        assert json.loads((hang / f"rank{rank}.json").read_text())["pg_status"]
    assert "in forward" in (hang / "rank1.txt").read_text()  # where it waits: the model's forward pass


def test_under_torchrun_a_rank_that_hangs_is_named_in_one_line_per_rank_and_no_rank_promises_a_save(tmp_path):
    (tmp_path / "hang.py").write_text(HANGING)
    proc = subprocess.run([os.path.join(os.path.dirname(sys.executable), "torchrun"), "--nproc_per_node", "2",
                           "ray_dp.py", *RUN, "--model", f"{tmp_path}/hang.py:HangsOnRank1", "--timeout", "10",
                           "--epochs", "1", "--storage-path", str(tmp_path), "--name", "hang", "--logdir",
                           str(tmp_path / "tb")], cwd=REPO, capture_output=True, text=True, timeout=300)
    ours = [line for line in proc.stderr.splitlines() if line.startswith("ray_dp.py:")]
    assert proc.returncode != 0 and not [line for line in proc.stderr.splitlines() if "]: Traceback" in line]
    assert ours[0].startswith("ray_dp.py: training failed: rank 1 did not come to collective "), proc.stderr
    assert f"its stacks are in {tmp_path}/hang/hang/rank1.txt" in ours[0]
    assert ours[1:] in ([], ["ray_dp.py: training failed: rank 1 lost its peers: another rank failed, and its own "
                             "line says why"]), ours
    assert "saving a checkpoint within seconds" not in proc.stdout  # torchrun's SIGTERM to the rank left behind


def test_replicas_that_differ_stop_the_run_before_any_save_from_them_and_the_same_command_resumes_the_last_good_one(
        tmp_path, capsys):
    # #48's case, on Ray, at the defaults (--check-replicas auto): a user's model changes one bias on rank 1 in its
    # 20th forward pass
    from test_health import NUDGED
    (tmp_path / "nudged.py").write_text(NUDGED)
    command = ["--workers", "2", "--model", f"{tmp_path}/nudged.py:Nudged", "--dataset", "synthetic",
               "--synthetic-size", "400", "--batch-size", "8", "--epochs", "1", "--checkpoint-every", "8",
               "--storage-path", str(tmp_path), "--name", "nudged", "--logdir", str(tmp_path / "tb")]
    for attempt, (nudged_at, saved) in enumerate([(20, 16), (16 + 20, 32)]):
        assert ray_dp.main(command) == 1
        out, err = capsys.readouterr()
        err = [line for line in err.splitlines() if line.startswith("ray_dp.py:")]
        caught = re.fullmatch(r"ray_dp\.py: training failed: the replicas differ (?:at the save )?after step (\d+) "
                              r"of epoch 1(?: \(the run's step \d+\))?: rank 0 and rank 1 differ, and no majority of the 2 ranks "
                              r"tells which drifted, "
                              r"first in layer\.bias; nothing is saved from them, and the same command resumes from the "
                              r"last checkpoint", err[0])
        assert len(err) == 1 and caught, err
        assert nudged_at <= int(caught[1]) <= nudged_at + 8  # at a check (auto's interval) or at the next save
        steps = sorted(int(path.name.rsplit("_", 1)[1]) for path in (tmp_path / "nudged").glob("checkpoint_epoch_*"))
        assert steps[-1] == saved < nudged_at  # none from the replicas that differ
        if attempt:  # the rerun began from the last good checkpoint, certified
            assert ("resuming at epoch 1 of 1, step 17 of 50, with 2 workers, from the checkpoint at epoch 1, step "
                    "16: the same model, optimizer, history and data position as saved") in out


class Reclaimed(RuntimeError):
    preempted = True  # as Ray's RayActorError of a worker on a node drained for preemption


def test_a_reclaimed_nodes_workers_dying_are_one_preemption_however_often_the_controller_polls(tmp_path):
    log = ray_dp.FailureLog(ray_dp.Config(), str(tmp_path))
    log.after_report(None, [{"epoch": 1, "began": 1.0}, {"epoch": 1, "began": 1.0}], None)
    for _ in range(5):  # Ray Train's controller polls every 0.2 s until the deadline: a new dict each time
        log.after_exception(None, {1: Reclaimed("the actor died"), 0: RuntimeError("Connection reset by peer")})
    log.after_report(None, [{"epoch": 1, "step": 40, "began": 2.0}], None)  # the next attempt's first report
    for _ in range(2):  # a real failure, polled twice: one failure
        log.after_exception(None, {0: RuntimeError("CUDA error: an illegal memory access")})
    events = json.loads((tmp_path / "recovery.json").read_text())["events"]
    assert [e["event"] for e in events] == ["command", "started", "preempted", "started", "failed"]
    assert log.failures == 1 and ray_dp.recovery_summary(str(tmp_path / "recovery.json"))["restarts"] == 1
