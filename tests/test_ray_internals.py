"""ray_dp's bets on Ray's non-public API (its "Ray internals" section), each made unavailable as a later Ray might
make it: the nicety it serves turns off with one note and the run goes on, or, under torchrun, a one-line refusal."""
import importlib
import importlib.util
import json
import os
import sys
import time
import types

import pytest
import ray

import ray_dp
from helpers import train_worker, error_of, ray_snapshot_json, run_distributed, save_run, train

TORCHRUN_ENV = {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.fixture(autouse=True)
def each_note_anew(monkeypatch):
    monkeypatch.setattr(ray_dp, "_noted", set())


def missing(monkeypatch, module, name=None):
    """Ray's module, or its attribute name, gone as a later Ray might have moved it."""
    if name is None:
        monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError
    else:
        monkeypatch.delattr(importlib.import_module(module), name)


def notes(capsys):
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ray_dp cannot use ")]


def note_about(capsys, what):
    said = notes(capsys)
    assert len(said) == 1 and said[0].startswith(f"note: ray_dp cannot use {what} of Ray {ray.__version__}: "), said
    return said[0]


def test_torchrun_is_one_line_refused_by_a_ray_without_ray_trains_torchrun_test(monkeypatch, no_cluster, capsys):
    missing(monkeypatch, "ray.train.v2._internal.execution.local_mode.torch", "has_torchrun_env")
    assert not ray_dp.under_torchrun()  # not under torchrun: nothing asked
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    err = error_of(["--dataset", "digits"], capsys)
    assert err.startswith("ray_dp.py: error: under torchrun ray_dp needs Ray Train's local mode as Ray >= 2.59 "
                          "and < 2.61 has it"), err


def test_under_torchrun_ray_dp_agrees_with_ray_trains_own_test(monkeypatch):
    from ray.train.v2._internal.execution.local_mode.torch import has_torchrun_env
    for name, value in TORCHRUN_ENV.items():
        monkeypatch.setenv(name, value)
    assert ray_dp.under_torchrun() and has_torchrun_env()
    monkeypatch.delenv("MASTER_PORT")
    assert not ray_dp.under_torchrun() and not has_torchrun_env()


def test_the_note_names_the_ray_ray_dp_was_checked_with_when_it_is_another(monkeypatch, capsys):
    monkeypatch.setattr(ray, "__version__", "2.61.0")
    ray_dp.internal_note("ray._private.utils.get_num_cpus", "what is lost")
    assert notes(capsys) == ["note: ray_dp cannot use ray._private.utils.get_num_cpus of Ray 2.61.0 (ray_dp was "
                             f"checked with {ray_dp.RAY_CHECKED}): what is lost"]
    ray_dp.internal_note("ray._private.utils.get_num_cpus", "what is lost")
    assert notes(capsys) == []  # once a process


def test_run_as_a_script_its_setup_hook_and_controller_callbacks_reach_rays_processes(tmp_path, monkeypatch):
    # Run as a script, Ray pickles ray_dp's functions by value; a process whose __main__ is not ray_dp (this one)
    # must load them, as Ray's workers and controller do.
    import ray.cloudpickle
    hook, callbacks = ray.cloudpickle.loads(run_distributed(pickled_as_script, 1, str(tmp_path))[0])
    from ray._private import utils
    monkeypatch.setattr(utils, "set_sigterm_handler", utils.set_sigterm_handler)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="192.0.2.2:2222"))
    monkeypatch.setenv("RAY_ADDRESS", "192.0.2.2:2222")  # (as the hook sets it: restored after the test)
    hook()
    assert getattr(utils.set_sigterm_handler, "graceful", False)  # Ray's SIGTERM handler becomes a graceful stop
    assert [type(c).__name__ for c in callbacks] == ["TensorBoardWriter", "FailureLog"]
    callbacks[1].add("a line", event="test")
    assert (tmp_path / "recovery.json").exists()


def test_ray_dps_own_ray_asks_its_own_state_api_where_another_ray_runs_beside_it(monkeypatch):
    """Ray Train's placement-group cleaner asks the State API without an address: Ray then scans this machine for a
    GCS, and with another Ray running it raised (30 lines of traceback under --worker-output), or where `ray start`
    recorded the other, asked that one."""
    from ray._private import services
    monkeypatch.setattr(services, "find_gcs_addresses", lambda: {"192.0.2.2:1111", "192.0.2.2:2222"})
    monkeypatch.setattr(services, "find_bootstrap_address", lambda temp_dir: None)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: types.SimpleNamespace(gcs_address="192.0.2.2:2222"))
    monkeypatch.setattr(ray_dp, "graceful_sigterm_in_ray_worker", lambda: None)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ConnectionError, match="Found multiple active Ray instances"):
        services.canonicalize_bootstrap_address_or_die(None)
    try:
        ray_dp.fresh_runtime_env()["worker_process_setup_hook"]()  # in each process of the Ray ray_dp starts
        assert services.canonicalize_bootstrap_address_or_die(None) == "192.0.2.2:2222"
    finally:
        os.environ.pop("RAY_ADDRESS", None)


def test_worker_output_beside_another_ray_says_so_once(monkeypatch, capsys):
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **settings: None)
    monkeypatch.setattr(ray_dp, "RAY_STARTED", {})
    other = types.SimpleNamespace(pid=4242, info={"name": "gcs_server"})
    monkeypatch.setattr(ray_dp.psutil, "process_iter", lambda attrs: iter([other]))
    ray_dp.start_ray("", 2)  # the workers' output in Ray's logs: nothing of the other Ray to say
    assert capsys.readouterr().out == ""
    ray_dp.start_ray("", 2, worker_output=True)
    assert capsys.readouterr().out == ("note: another Ray runs on this machine (its GCS: pid 4242); ray_dp starts its "
                                       "own beside it\n")
    monkeypatch.setattr(ray_dp.psutil, "process_iter", lambda attrs: iter([]))
    ray_dp.start_ray("", 2, worker_output=True)
    assert capsys.readouterr().out == ""

def test_worker_output_into_a_file_or_pipe_has_no_colour_codes(monkeypatch, capsys):
    started = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **settings: started.update(settings))
    monkeypatch.setattr(ray_dp, "RAY_STARTED", {})
    monkeypatch.setattr(ray_dp.psutil, "process_iter", lambda attrs: iter([]))  # no other Ray's note
    monkeypatch.setenv("RAY_COLOR_PREFIX", "")
    monkeypatch.delenv("RAY_COLOR_PREFIX")  # (restored as it was after the test)
    ray_dp.start_ray("", 2, worker_output=True)  # stdout: pytest's capture, not a terminal
    assert started["log_to_driver"] is True
    ray._private.worker.print_worker_logs({"pid": 7, "ip": "192.0.2.2", "localhost": "192.0.2.2",
                                           "actor_name": "RayTrainWorker", "lines": ["hello"]}, sys.stdout)
    assert capsys.readouterr().out == "(RayTrainWorker pid=7) hello\n"


def pickled_as_script(logs):
    """ray_dp.py run as a script (python ray_dp.py --model list) in this fresh process: its setup hook and controller
    callbacks, pickled as Ray pickles them."""
    import ray.cloudpickle
    script = {"__name__": "__main__", "__file__": ray_dp.__file__}
    argv, sys.argv = sys.argv, ["ray_dp.py", "--model", "list"]
    try:
        exec(compile(open(ray_dp.__file__).read(), ray_dp.__file__, "exec"), script)
    except SystemExit:
        pass
    finally:
        sys.argv = argv
    return ray.cloudpickle.dumps([script["fresh_runtime_env"]()["worker_process_setup_hook"],
                                  [script["TensorBoardWriter"](script["Config"]()),
                                   script["FailureLog"](script["Config"](), logs, None, 0)]])


def test_the_autoscalers_node_types_come_from_the_config_ray_up_left_on_the_head(tmp_path):
    bootstrap = tmp_path / "ray_bootstrap_config.yaml"
    bootstrap.write_text("head_node_type: head\navailable_node_types:\n  head: {resources: {CPU: 4}, max_workers: 0}\n"
                         "  gpu: {resources: {CPU: 8, GPU: 1}, max_workers: 3}\n")
    assert ray_dp.autoscaler_node_types(str(bootstrap)) == [({"CPU": 4}, 1), ({"CPU": 8, "GPU": 1}, 3)]
    assert ray_dp.autoscaler_node_types(str(tmp_path / "none.yaml")) is None


def test_without_rays_address_resolution_a_dead_address_is_still_one_line_and_auto_goes_unchecked(monkeypatch,
                                                                                                     capsys):
    from conftest import free_port
    missing(monkeypatch, "ray._private.services", "canonicalize_bootstrap_address")
    dead = f"127.0.0.1:{free_port()}"
    with pytest.raises(ray_dp.ConfigError, match=f"^no Ray cluster answers at {dead}: start one"):
        ray_dp.check_reachable(dead)
    assert notes(capsys) == []
    assert ray_dp.check_reachable("auto") is None  # left to ray.init
    note_about(capsys, "ray._private.services.canonicalize_bootstrap_address")


def test_ray_trains_knobs_are_the_variables_ray_train_reads(monkeypatch):
    from ray.train.v2._internal import constants
    monkeypatch.delenv(constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR, raising=False)
    ray_dp.set_ray_train_knobs(ray_dp.Config(start_timeout=42.0))
    assert os.environ[constants.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR] == "42.0"
    assert os.environ[constants.HEALTH_CHECK_INTERVAL_S_ENV_VAR] == "0.2"


# Ray 2.60's words (strings in its GCS server and raylet binaries) for a worker process that exited unexpectedly,
# whatever the cause, and for one its memory monitor killed.
EXITED = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
          "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
          "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called, or (3) the "
          "worker crashed unexpectedly due to SIGSEGV or another unexpected error. If the process was killed by the "
          "kernel OOM killer (verifiable by checking for OOM in dmesg of the OOMing node), consider enabling "
          "resource isolation.")
MONITOR_KILLED = ("The actor is dead because its worker process has died. Worker exit type: NODE_OUT_OF_MEMORY Worker "
                  "exit detail: 1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: "
                  "10.0.0.2, ID: 3a4b) was 23.10GB used / 24.00GB limit (0.962500)")


@pytest.mark.parametrize("death, said", [(EXITED, "its process or node died"),
                                         (MONITOR_KILLED, "killed: out of memory")], ids=["exited", "oom-killed"])
def test_only_rays_memory_monitor_says_out_of_memory_not_the_causes_ray_lists_for_every_exit(death, said):
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError
    failures = {0: RuntimeError("Connection reset by peer"),
                1: WorkerHealthCheckFailedError("A worker health check failed.", RuntimeError(death))}
    assert ray_dp.describe_worker_failures(failures, {0: "10.0.0.1", 1: "10.0.0.2"}) == \
        f"lost worker rank 1 on 10.0.0.2 ({said})"


def test_the_snapshots_the_tests_write_are_ones_ray_loads():
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState
    for names in [(), ("checkpoint_epoch_001", "checkpoint_epoch_002")]:
        state = json.loads(ray_snapshot_json(*names))
        _CheckpointManagerState.model_validate(state)  # raises where Ray would not load it
        assert ray_dp.snapshot_shape(state)


def test_a_snapshot_ray_is_rewriting_is_read_again_not_called_broken(tmp_path, monkeypatch):
    run = save_run(tmp_path / "run", saved=[1, 2])
    snapshot = run / ray_dp.RAY_SNAPSHOT
    snapshot.write_text("")  # as Ray's rewrite leaves it between opening the file and writing it
    waits = []

    def ray_writes_it_meanwhile(seconds):
        waits.append(seconds)
        snapshot.write_text(ray_snapshot_json("checkpoint_epoch_001"))
    monkeypatch.setattr(ray_dp, "SNAPSHOT_REREAD_S", 60)
    # ray_dp's clock only: no other thread's sleep counts
    monkeypatch.setattr(ray_dp, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=ray_writes_it_meanwhile))
    assert ray_dp.latest_committed(str(run)) == f"{run}/checkpoint_epoch_001/{ray_dp.CHECKPOINT_FILE}"
    assert len(waits) == 1  # it read again, once


def test_a_snapshot_resumes_from_the_latest_checkpoint_ray_reported_as_ray_does(tmp_path):
    run = save_run(tmp_path / "run", saved=[1, 2])
    state = json.loads(ray_snapshot_json("checkpoint_epoch_001", "checkpoint_epoch_002"))
    state["checkpoint_results"].reverse()  # in keep_score's order, the latest need not be last
    (run / ray_dp.RAY_SNAPSHOT).write_text(json.dumps(state))
    assert ray_dp.latest_committed(str(run)).endswith(f"/checkpoint_epoch_002/{ray_dp.CHECKPOINT_FILE}")
    state["latest_checkpoint_result"] = None  # Ray gives its workers no checkpoint: the run starts over
    (run / ray_dp.RAY_SNAPSHOT).write_text(json.dumps(state))
    assert ray_dp.latest_committed(str(run)) is None



def test_torchrun_deleting_a_checkpoint_ray_lists_drops_rays_list_so_ray_resumes_from_the_highest(tmp_path):
    # a Ray run (2 epochs, listed) extended under torchrun keeping 1: Ray's list named a deleted checkpoint, and the
    # next Ray run could not resume
    run = save_run(tmp_path / "run", saved=[1, 2])
    (run / ray_dp.RAY_SNAPSHOT).write_text(ray_snapshot_json("checkpoint_epoch_001", "checkpoint_epoch_002"))
    state = ray_dp.load_checkpoint(str(run / "checkpoint_epoch_002" / ray_dp.CHECKPOINT_FILE))
    ray_dp.save_checkpoint(str(run), {**state, "epoch": 3}, 3, keep=1)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint_epoch_003"]
    assert ray_dp.resume_point(str(run)) == (f"{run}/checkpoint_epoch_003/{ray_dp.CHECKPOINT_FILE}", False)


def test_a_run_ray_listed_before_keep_checkpoints_says_its_checkpoints_stay(tmp_path, capsys):
    run = save_run(tmp_path / "runs" / "old", saved=[1, 2])
    (run / ray_dp.RAY_SNAPSHOT).write_text(ray_snapshot_json("checkpoint_epoch_001", "checkpoint_epoch_002"))
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(storage_path=str(tmp_path / "runs"), name="old", keep_checkpoints=2))
    assert ray_dp.checkpoint_config(cfg).num_to_keep is None  # Ray's list has no "keep" score to rank them by
    assert capsys.readouterr().out == ("note: run 'old' began before --keep-checkpoints: Ray keeps every checkpoint it "
                                       "lists (--fresh starts it over with the latest 2 kept)\n")
    state = json.loads(ray_snapshot_json("checkpoint_epoch_001", "checkpoint_epoch_002"))
    for entry in state["checkpoint_results"]:
        entry["metrics"]["keep"] = entry["metrics"]["epoch"]
    (run / ray_dp.RAY_SNAPSHOT).write_text(json.dumps(state))
    assert ray_dp.checkpoint_config(cfg).num_to_keep == 2 and capsys.readouterr().out == ""

def other_shapes():
    """Snapshots Ray does not load: unreadable, or what ray_dp reads is missing or of another type (its model of the
    file rejects them), or (the last) a latest checkpoint it does not list (its _load_state's KeyError)."""
    whole = json.loads(ray_snapshot_json("checkpoint_epoch_001"))
    entry = whole["checkpoint_results"][0]
    return ["", "{", "[]", json.dumps({"checkpoints": []}),
            json.dumps({**whole, "checkpoint_results": [{"path": "x", "metrics": {}}]}),
            json.dumps({**whole, "checkpoint_results": [{**entry, "metrics": 3}]}),
            json.dumps({**whole, "checkpoint_results": [{**entry, "metrics": None}]}),
            json.dumps({**whole, "latest_checkpoint_result": 3}),
            json.dumps({**whole, "latest_checkpoint_result": {**entry, "checkpoint_dir_name": ["elsewhere"]}}),
            json.dumps({**whole, "latest_checkpoint_result": {**entry, "checkpoint_dir_name": "elsewhere"}})]


@pytest.mark.parametrize("text", other_shapes(), ids=range(len(other_shapes())))
def test_a_snapshot_that_stays_unreadable_or_of_another_shape_is_one_line_before_any_cluster(
        text, tmp_path, monkeypatch, no_cluster, capsys):
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState
    if text != other_shapes()[-1]:  # that one passes Ray's model and fails its _load_state
        with pytest.raises(ValueError):  # pydantic's validation errors are ValueErrors
            _CheckpointManagerState.model_validate_json(text)
    monkeypatch.setattr(ray_dp, "SNAPSHOT_REREAD_S", 0.01)
    run = save_run(tmp_path / "run", saved=[1])
    (run / ray_dp.RAY_SNAPSHOT).write_text(text)
    broken = f"{run}/{ray_dp.RAY_SNAPSHOT} is not Ray's list of checkpoints"
    assert error_of(["--storage-path", str(tmp_path), "--name", "run", "--dataset", "digits"], capsys) == (
        f"ray_dp.py: error: run 'run' cannot resume: {broken}: --eval-only one of the run's checkpoint_epoch_* "
        f"directories, or rerun with --fresh to start over\n")
    assert error_of(["--eval-only", str(run)], capsys) == (
        f"ray_dp.py: error: --eval-only {run}: {broken}; if its run is still training, try again, or --eval-only "
        f"one of its checkpoint_epoch_* directories\n")
    epoch_1 = run / "checkpoint_epoch_001"  # that way on is open
    assert ray_dp.checkpoint_file(str(epoch_1)) == str(epoch_1 / ray_dp.CHECKPOINT_FILE)


def test_ctrl_c_and_a_full_disk_say_the_snapshot_is_cut_short_not_that_nothing_was_saved(tmp_path, monkeypatch):
    monkeypatch.setattr(ray_dp, "SNAPSHOT_REREAD_S", 0.01)
    run = save_run(tmp_path / "run", saved=[1])
    (run / ray_dp.RAY_SNAPSHOT).write_text("")  # Ray stopped, or the disk filled, as it rewrote it
    cfg = ray_dp.Config(storage_path=str(tmp_path), name="run", epochs=3)
    broken = (f"{run}/{ray_dp.RAY_SNAPSHOT} is not Ray's list of checkpoints: --eval-only one of the run's "
              f"checkpoint_epoch_* directories, or rerun with --fresh to start over")
    assert ray_dp.interrupted("train", cfg) == f"interrupted; {broken}"
    full = ray_dp.storage_full(cfg)
    assert full.startswith("no space left on the device of --") and " free); " in full
    assert full.endswith(f"; {broken.replace(': ', ': once there is space, ', 1)}")
    out = tmp_path / "elsewhere" / "preds.csv"  # a file of its own (predict's --out): that disk is named
    out.parent.mkdir()
    named = ray_dp.storage_full(cfg, OSError(28, "No space left on device", str(out)))
    assert named.startswith(f"no space left on the device of {out} (") and " free); " in named


def without_any_ray_internal(cfg):
    """On each rank: ray_dp's worker side (setup hook, worker loop with rank 0's progress bar) where every internal
    of Ray's is missing; the notes this rank printed and rank 0's trained state."""
    import contextlib
    import io

    from test_differential import Recorder
    ray_dp.ray_internal = lambda module, name=None: None
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):  # the bar: not on the terminal
        ray_dp.graceful_sigterm_in_ray_worker()
        recorder = Recorder()
        worker = ray_dp.Worker(ray_dp.dist.get_rank(), ray_dp.dist.get_world_size(), ray_dp.torch.device("cpu"))
        train_worker(cfg, worker, recorder, ray_dp.LoopOptions(progress=True), {})
    return [line for line in out.getvalue().splitlines() if line.startswith("note:")], recorder.saved


def test_a_workers_side_trains_where_every_ray_internal_is_missing():
    cfg = ray_dp.Config(dataset="synthetic", synthetic_size=32, batch_size=8, epochs=1, workers=2, quiet=True)
    (notes_0, saved), (notes_1, _) = run_distributed(without_any_ray_internal, 2, cfg)
    assert saved["epoch"] == 1
    assert notes_0 == notes_1 == []  # the worker's side asks none of them


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_a_run_trains_where_every_ray_internal_is_missing(ray_cluster, tmp_path, monkeypatch, capsys):
    # As a later Ray would look to ray_dp: none of its internals found.
    monkeypatch.setattr(ray_dp, "ray_internal", lambda module, name=None: None)
    result = train(tmp_path, "no-internals", "--dataset", "digits", "--workers", "2", "--epochs", "1")
    assert result["final"]["test_count"] == 360 and result["final"]["test_acc"] > 0.2  # chance: 0.1
    assert [event["event"] for event in result["recovery"]["events"]] == ["command", "started"]  # public callbacks: kept
    assert ray_dp.SIGTERM_LOST in "\n".join(notes(capsys))


