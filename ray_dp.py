#!/usr/bin/env python
"""ray-dp: data-parallel PyTorch training on N Ray workers, in one file.

The DDP tutorial's loop (DistributedDataParallel, DistributedSampler + set_epoch,
gradient accumulation with no_sync, loss all-reduced for logging, optional
SyncBatchNorm, rank-0-only checkpoints, exact multi-worker evaluation), started
on N workers by Ray Train's TorchTrainer: GPU workers (nccl) when the cluster
has GPUs, CPU workers (gloo) otherwise.

Run it:
    python ray_dp.py --workers 2 --dataset digits    # offline quick start (CPU)
    python ray_dp.py --workers 8 --dataset digits    # 8 workers share a 2-core laptop's cores
    python ray_dp.py --workers 8 --model resnet18    # Fashion-MNIST, downloaded to ./data
    python ray_dp.py --dataset cifar10 --model resnet18 --sync-bn --accum-steps 2
    python ray_dp.py --name myrun ...                # run it again with the same name to resume
    python ray_dp.py --address auto --gpu ...        # on a running cluster (ray up cluster.yaml)
    python ray_dp.py doctor --address auto --workers 8
                                                     # check that cluster first, one line a check
    python ray_dp.py --mode scratch --dataset digits
                                                     # the d2l lesson: hand-written all-reduce LeNet
    python ray_dp.py --mode dp --workers 4 --model resnet18
                                                     # nn.DataParallel over 4 GPUs of one worker
    python ray_dp.py compare --workers 2 --dataset digits
                                                     # ddp vs scratch, 1 vs N workers: the table
    python ray_dp.py --eval-only runs/myrun --workers 3 --predict-out preds.csv
                                                     # multi-worker inference
    tensorboard --logdir runs/tensorboard            # watch every run
    python ray_dp.py --help                          # every flag, with units and defaults

Outputs go to <storage-path>/<name>/: one checkpoint_epoch_NNN/ per epoch and result.json, and
checkpoint_epoch_NNN_step_SSSSSS/ within an epoch (--checkpoint-every; SIGTERM saves one and stops).

The file, top to bottom (each section opens with a banner of "=" lines):
    Ray internals        every use of Ray's non-public API, each guarded: a note, or a refusal
    Config               every field is a command-line flag, declared with its help and its facts
                         (may a rerun change it, does --eval-only refuse it, is it a path or a URI)
    Data                 the data sets in memory, folders and buckets read per sample, their checks
    Models               the lessons' LeNet and ResNet-18, an MLP, torchvision's models, --weights
    Distributed helpers  who this worker is, the collectives, the allocator, SyncBatchNorm on CPU,
                         the samplers and loaders
    Train & evaluate     one epoch, exact evaluation, where the model is placed
    Checkpoints          rank 0 saves; the run directory and what a rerun may change
    Monitoring           the console, TensorBoard, the recovery record, ray.log
    Teaching mode        --mode scratch: d2l's hand-written all-reduce LeNet
    Inference            --eval-only: a saved model scored exactly on N workers
    Launch, workers      one launcher seam for Ray and torchrun; what each worker runs
    Launch, driver       the cluster, Ray Train's TorchTrainer, the commands
    compare              the lesson's table, measured side by side
    doctor               a pre-flight check of a Ray cluster
    main                 the command line: one command, one line for every way it can end
"""
from __future__ import annotations

import time

STARTED_AT = time.time()  # before the imports below: the start-up breakdown counts them

import argparse
import contextlib
import ctypes
import errno
import functools
import gc
import importlib
import io
import itertools
import json
import logging
import math
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
from dataclasses import asdict, dataclass, field, fields, replace
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Optional, Union

import ray

# Ray Train's V2 API as ray_dp uses it: 2.60.0 is what requirements.txt pins and the tests run;
# 2.59 runs it too, 2.55 lacks ray.train.LoggingConfig. A driver runs the Ray of the cluster it
# attaches to, so an older cluster meets this first.
SUPPORTED_RAY = ("2.59", "2.61")  # from, up to but not including


def ray_version_problem(version: str) -> Optional[str]:
    """One line when the installed Ray is not one ray_dp runs with, else None."""
    from packaging.version import Version
    low, high = SUPPORTED_RAY
    if Version(low) <= Version(version) < Version(high):
        return None
    return (f"ray_dp needs Ray >= {low} and < {high} (Ray Train's V2 API), but Ray {version} is "
            f"installed: pip install -r requirements.txt (ray[train]==2.60.0), on every node of "
            f"the cluster too")


if (_problem := ray_version_problem(ray.__version__)):
    if __name__ == "__main__":  # the command line: one line, before anything else fails
        print(f"ray_dp.py: error: {_problem}", file=sys.stderr)
        sys.exit(2)
    raise ImportError(_problem)

# After the version check: a Ray that ray_dp does not run with is one line in a fraction of a
# second, not after torch's seconds of imports (Ray's own worker processes import Ray first too).
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import (  # noqa: E402
    BatchSampler, DataLoader, DistributedSampler, Subset, TensorDataset)

import ray.train  # noqa: E402 (older Rays fail right here)
import ray.train.torch  # noqa: E402
from ray.train import CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

IMPORTED_AT = time.time()
# Imported (a notebook), the start-up breakdown begins where a command does (main, train), not at
# the import, which may be long before.
COMMAND_AT: Optional[float] = None


# ==================================================================================================
# Ray internals: every bet ray_dp makes on Ray's non-public API, each behind a guard. Each was
# checked with the Ray requirements.txt pins (RAY_CHECKED); a later Ray may move or change any of
# them. Then what it serves turns off with one "note:" line and the run still trains, or, where
# correctness depends on it (torchrun), the run is refused in one line naming SUPPORTED_RAY.
# The bets: Ray Train's torchrun test, its controller hooks and the objects they are given, the
# class names of its states and errors, its environment knobs (RAY_TRAIN_KNOBS), its progress bar,
# the printer of forwarded output, loggers by name (RAY_LOGGERS), the recorded node groups, the
# bootstrap address, the CPU count, the setup hook's variable, the placement-group cleaner's
# defaults, the auth mode, its memory monitor's wording, its checkpoint snapshot's file.
# (RAY_DEDUP_LOGS and RAY_COLOR_PREFIX, set in start_ray, are public.)
# ==================================================================================================

RAY_CHECKED = "2.60.0"


def ray_internal(module: str, name: Optional[str] = None):
    """Ray's module (or its attribute name), or None if this Ray has no such thing."""
    try:
        found = importlib.import_module(module)
        return getattr(found, name) if name else found
    except (ImportError, AttributeError):
        return None


_noted = set()  # what internal_note has said in this process


def internal_note(what: str, lost: str) -> None:
    """One line, once per process: which of this Ray's internals ray_dp cannot use, and what is
    lost. (Not functools.cache: run as a script, ray_dp's functions travel to Ray's processes by
    value, and a cache wrapper travels by a name that their __main__ lacks.)"""
    if (what, lost) in _noted:
        return
    _noted.add((what, lost))
    checked = "" if ray.__version__ == RAY_CHECKED else f" (ray_dp was checked with {RAY_CHECKED})"
    print(f"note: ray_dp cannot use {what} of Ray {ray.__version__}{checked}: {lost}", flush=True)


def ray_joins_torchrun() -> bool:
    """Ray Train's own test of whether this process runs under torchrun, in which case its local
    mode joins torchrun's process group and ray_dp keeps the checkpoints itself: ray_dp must agree
    with Ray, so a Ray without this test is refused."""
    has_torchrun_env = ray_internal("ray.train.v2._internal.execution.local_mode.torch",
                                    "has_torchrun_env")
    try:
        return has_torchrun_env()
    except TypeError:  # None, or another signature
        low, high = SUPPORTED_RAY
        raise ConfigError(f"under torchrun ray_dp needs Ray Train's local mode as Ray >= {low} and "
                          f"< {high} has it (Ray {ray.__version__} is installed): pip install -r "
                          f"requirements.txt, or run without torchrun "
                          f"(python ray_dp.py --workers N)") from None


# Ray Train's controller hooks (its state changes, the worker group's start, every report; the
# public UserCallback sees reports only): the bases of RecoveryLog and QuietControllerLogs. Where
# this Ray has other ones, stand-ins let those classes be defined, and fit() leaves them out.
CALLBACK_MODULE = "ray.train.v2._internal.execution.callback"
_HOOK_NAMES = ("ControllerCallback", "WorkerGroupCallback", "ReportCallback")
_hooks = [ray_internal(CALLBACK_MODULE, name) for name in _HOOK_NAMES]
CONTROLLER_HOOKS = None not in _hooks
ControllerCallback, WorkerGroupCallback, ReportCallback = (
    hook if CONTROLLER_HOOKS else type(name, (), {}) for hook, name in zip(_hooks, _HOOK_NAMES))
HOOKS_LOST = ("no recovery lines, recovery.json or start-up breakdown, and Ray Train's controller "
              "logs its routine lines")


# The class names of Ray Train's controller states and errors that RecoveryLog tells apart: a Ray
# that renames one makes those lines generic (a failure without its kind), never an error.
ERRORED_STATE, SCHEDULING_STATE = "ErroredState", "SchedulingState"
START_TIMEOUT_ERROR, WORKER_GROUP_ERROR = "WorkerGroupStartupTimeoutError", "WorkerGroupError"
HEALTH_CHECK_ERROR = "WorkerHealthCheckFailedError"  # a rank's process or node died
# How Ray's memory monitor words the workers it killed. Not the word "memory": the error of any
# process that exits unexpectedly lists "the OOM killer due to high memory usage" among causes.
# A Ray that rewords it makes an out-of-memory kill read "its process or node died".
RAY_OOM_KILLED = re.compile(r"low on memory|memory pressure|OUT_OF_MEMORY")


def state_facts(state) -> tuple:
    """What RecoveryLog reads of a state of Ray Train's controller: (its class name, the training
    error it carries or None, the workers a SchedulingState waits for or None). A ShuttingDown
    state is read as the state it leads to."""
    state = getattr(state, "next_state", state)
    decision = getattr(state, "scaling_decision", None)
    return (type(state).__name__, getattr(state, "training_failed_error", None),
            getattr(decision, "num_workers", None))


def worker_node_ips(worker_group) -> dict:
    """{world rank: node IP} of a worker group Ray Train's controller has started."""
    try:
        return {worker.distributed_context.world_rank: worker.metadata.node_ip
                for worker in worker_group.get_workers()}
    except (AttributeError, TypeError):
        internal_note("worker group (get_workers, distributed_context, metadata)",
                      "the recovery lines name no nodes")
        return {}


def ray_tqdm():
    """Ray's tqdm, whose bar the driver draws from a worker's updates (a worker's output is not a
    terminal); None if this Ray has none."""
    tqdm = ray_internal("ray.experimental.tqdm_ray", "tqdm")
    if tqdm is None:
        internal_note("ray.experimental.tqdm_ray.tqdm", "no progress bar")
    return tqdm


ROUTING_LOST = "Ray's own output (warnings, tracebacks) stays on the console, not in ray.log"


def forwarded_lines(batch) -> Optional[tuple]:
    """What ray_dp reads of a batch of lines Ray forwards from its processes: (the lines, whether
    they are chatter for ray.log: a stderr or the raylet's, and the process they came from); None
    if the batch has another shape (then it is printed as Ray prints it)."""
    try:
        source = (f"({batch.get('actor_name') or batch.get('task_name') or ''} "
                  f"pid={batch.get('pid')}, ip={batch.get('ip')})")
        return list(batch["lines"]), bool(batch["is_err"] or batch.get("pid") == "raylet"), source
    except (AttributeError, KeyError, TypeError):
        return None


def ray_printer():
    """Ray's printer of a batch of lines its processes forwarded:
    print_to_stdstream(batch, ignore_prefix); None if this Ray has none."""
    return ray_internal("ray._private.worker", "print_to_stdstream")


def route_ray_prints(route) -> None:
    """Ray prints what its processes forward through a dispatcher (a "ray_print_logs" handler per
    ray.init), and the errors the cluster reports (a worker died, ...) through print_to_stdstream
    itself: both through route(batch, ignore_prefix=...) from now on."""
    try:
        worker = ray_internal("ray._private.worker")
        dispatcher = ray_internal("ray._private.ray_logging", "global_worker_stdstream_dispatcher")
        handlers = [handler for name, handler in dispatcher.handlers if name == "ray_print_logs"]
        if handlers:  # none if log_to_driver=False
            ignore_prefix = getattr(handlers[-1], "keywords", {}).get("ignore_prefix", False)
            dispatcher.remove_handler("ray_print_logs")
            dispatcher.add_handler("ray_print_logs",
                                   functools.partial(route, ignore_prefix=ignore_prefix))
        worker.print_to_stdstream = route
    except (AttributeError, TypeError, ValueError):  # a None above, or other shapes
        internal_note("ray._private.ray_logging.global_worker_stdstream_dispatcher",
                      ROUTING_LOST)


# Ray Train's environment knobs that ray_dp sets, by the constant Ray names each with: what is lost
# where this Ray names none (and so may read another variable).
RAY_TRAIN_CONSTANTS = "ray.train.v2._internal.constants"
RAY_TRAIN_KNOBS = {
    "ENABLE_PREEMPTION_WATCHER_ENV_VAR": "its preemption watcher may print an error on every run",
    "ENABLE_PRINT_PATCH_ENV_VAR": "rank 0's epoch lines may reach the console twice",
    "HEALTH_CHECK_INTERVAL_S_ENV_VAR": "each report may wait for Ray Train's 2 s poll",
    "WORKER_GROUP_START_TIMEOUT_S_ENV_VAR": "--start-timeout may not apply (Ray's default: 60 s)",
}


def ray_train_knob(constant: str) -> str:
    """The environment variable Ray Train reads for one of RAY_TRAIN_KNOBS: its own name for it, or
    where it names none Ray 2.60's (RAY_TRAIN_ and the constant's stem)."""
    return (ray_internal(RAY_TRAIN_CONSTANTS, constant)
            or "RAY_TRAIN_" + constant.removesuffix("_ENV_VAR"))


def check_ray_train_internals() -> None:
    """On the driver, before a run: a note for each knob or logger this Ray names otherwise (not in
    the workers, where it would print once a process)."""
    for constant, lost in RAY_TRAIN_KNOBS.items():
        if ray_internal(RAY_TRAIN_CONSTANTS, constant) is None:
            internal_note(f"{RAY_TRAIN_CONSTANTS}.{constant}", lost)
    if ray_report_logger() is None:
        internal_note(REPORT_MODULE, "each rank logs a line per report")
    if ray_internal(*SIGTERM_SETTER) is None:
        internal_note(".".join(SIGTERM_SETTER), SIGTERM_LOST)


REPORT_MODULE = "ray.train.v2._internal.execution.context"


def ray_report_logger() -> Optional[str]:
    """The logger of Ray Train's "Reporting training result ..." lines (per rank per report),
    named by its file's path, so that LoggingConfig(log_level) does not reach it; None if this Ray
    has no such module."""
    return ray_internal(REPORT_MODULE, "__file__")


# Ray's loggers whose routine lines ray_dp keeps off the console, and the level each is kept at.
RAY_LOGGERS = {
    # Ray's PlacementGroupCleaner polls the State API, which needs Ray's dashboard (not installed):
    # it logs harmless errors, and a traceback when it is slow to stop at the end of a run.
    "ray.train.v2._internal.execution.controller.placement_group_cleaner": logging.ERROR,
    "ray.train.v2._internal.callbacks.placement_group_callback": logging.CRITICAL,
    # Its autoscaling coordinator logs a traceback whenever a resource request times out on a busy
    # machine (the request is sent again; Ray's message says it is safe to ignore)
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client":
        logging.ERROR,
}
# Ray turns token auth on for a cluster it starts, and says so on every run: good, and not news.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


def quiet_ray_logs():
    """Runs in every Ray worker process (its setup hook): keep Ray Train's routine chatter off the
    console, and make SIGTERM while it trains a graceful stop."""
    for name, level in RAY_LOGGERS.items():
        logging.getLogger(name).setLevel(level)
    if (report_logger := ray_report_logger()) is not None:
        logging.getLogger(report_logger).setLevel(logging.WARNING)
    graceful_sigterm_in_ray_worker()


SIGTERM_SETTER = ("ray._private.utils", "set_sigterm_handler")
SIGTERM_LOST = ("SIGTERM to a Ray worker stops it at once (no graceful stop): its workers redo the "
                "steps since the last checkpoint")


def graceful_sigterm_in_ray_worker() -> None:
    """A Ray worker trains in a thread of its own, and Ray's task loop sets its SIGTERM handler
    (exit) in the main thread after this setup hook: set through set_sigterm_handler, which this
    wraps, so that the handler becomes GracefulStop(Ray's). (A Ray without it: a note on the
    driver, check_ray_train_internals; the worker stops at once, as before.)"""
    module, name = SIGTERM_SETTER
    setter = ray_internal(module, name)
    if setter is None or getattr(setter, "graceful", False):
        return

    def set_graceful(handler):
        setter(GracefulStop(handler))
    set_graceful.graceful = True
    setattr(sys.modules[module], name, set_graceful)


def recorded_node_types() -> Optional[list]:
    """The node groups Ray records in its GCS (KubeRay, autoscaler v2): node_types_from_groups,
    or None if it records none."""
    state = ray_internal("ray._private.state", "state")
    try:
        recorded = state.get_cluster_config()
        if recorded is None or not recorded.node_group_configs:
            return None
        return node_types_from_groups(recorded)
    except (AttributeError, TypeError):  # this Ray keeps no such record, or another shape of it
        internal_note("ray._private.state.state.get_cluster_config",
                      "an autoscaler's node groups (KubeRay) are not read; the config that "
                      "`ray up` leaves on the head node still is")
        return None


def node_types_from_groups(cluster_config) -> list:
    """From Ray's autoscaler_pb2.ClusterConfig:
    (resources, max_count) per node group (-1: no limit)."""
    return [(dict(group.resources), math.inf if group.max_count == -1 else group.max_count)
            for group in cluster_config.node_group_configs]


def gcs_address(address: str) -> Optional[str]:
    """--address as host:port, as ray.init resolves it ('auto': the last cluster `ray start`
    recorded on this machine, /tmp/ray/ray_current_cluster); "" if none is recorded, None if this
    Ray cannot say (then nothing is checked before ray.init). ValueError if it is neither."""
    canonicalize = ray_internal("ray._private.services", "canonicalize_bootstrap_address")
    if canonicalize is None:
        if address != "auto":
            return address
        internal_note("ray._private.services.canonicalize_bootstrap_address",
                      "--address auto is not checked before Ray attaches (which may retry for "
                      "minutes)")
        return None
    try:
        return canonicalize(address) or ""
    except ConnectionError:
        return ""


def ray_cpu_count() -> float:
    """The CPUs a Ray started here registers: its count honours cgroup limits, not the host's."""
    try:
        return ray_internal("ray._private.utils", "get_num_cpus")()
    except (TypeError, ValueError):  # None, or another signature
        internal_note("ray._private.utils.get_num_cpus",
                      "this machine's CPUs are counted without its cgroup limits")
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def setup_hook_env_var() -> str:
    """Where ray.init writes a runtime environment's worker_process_setup_hook."""
    name = ray_internal("ray._private.ray_constants", "WORKER_PROCESS_SETUP_HOOK_ENV_VAR")
    if name is None:
        internal_note("ray._private.ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR",
                      "a second ray.init in this process may refuse ray_dp's setup hook")
    return name or "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR"  # Ray 2.60's name


def shorten_placement_group_cleaner_waits() -> None:
    """Ray Train's PlacementGroupCleaner asks the State API (served by Ray's dashboard, which
    requirements.txt does not install) whether the controller still lives, waiting up to 10 s for
    each answer, and at the end of every run the controller waits for the cleaner to stop, which it
    does only between two questions: 10 s, then (at one second a question) still 3 s added to every
    run. One second per question keeps its job (removing a dead controller's placement group), and
    a 0.1 s wait for its stop ends runs that much sooner: a graceful stop is told to exit and leaves
    the placement group to the controller, which removes it itself. (Ray builds the callback: its
    defaults are the only handle, so its signature must be Ray 2.60's.)"""
    import inspect
    cleaner = ray_internal("ray.train.v2._internal.callbacks.placement_group_callback",
                           "PlacementGroupCleanerCallback")
    parameters = list(inspect.signature(cleaner.__init__).parameters) if cleaner else []
    if parameters != ["self", "check_interval_s", "get_actor_timeout_s", "stop_timeout"]:
        internal_note("PlacementGroupCleanerCallback(check_interval_s, get_actor_timeout_s, "
                      "stop_timeout)", "each run may take seconds longer to end")
        return
    cleaner.__init__.__defaults__ = (1.0, 1.0, 0.1)


def ray_auth_mode() -> str:
    """The auth mode this process's Ray speaks (token, disabled, ...);
    "unknown" if it cannot say."""
    name_of = ray_internal("ray._private.authentication.authentication_utils",
                           "get_authentication_mode_name")
    mode = ray_internal("ray._raylet", "get_authentication_mode")
    try:
        return str(name_of(mode()))
    except (TypeError, ValueError, AttributeError):  # a None, or other shapes
        return "unknown"


# Ray Train's list of a run's committed checkpoints (in keep_score's order) and the latest it
# reported: its checkpoint manager's snapshot, a file whose name and keys are Ray's own. A rerun
# resumes from that latest one, as Ray does.
RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
SNAPSHOT_REREAD_S = 1.0
SNAPSHOT_WAYS_ON = ("--eval-only one of the run's checkpoint_epoch_* directories, or rerun with "
                    "--fresh to start over")


def ray_snapshot(run_dir: str) -> Optional[dict]:
    """The run's snapshot as Ray wrote it, or None if it has none. On a disk (not in a bucket,
    whose objects change whole) Ray rewrites the file in place: it opens it, which empties it, then
    writes the JSON it made beforehand. So a reader while the run goes on (--eval-only of it,
    Ctrl-C) can find it empty or cut short for an instant: read again for up to
    SNAPSHOT_REREAD_S before calling it broken."""
    from pyarrow import fs
    storage, path = files_at(run_dir)
    snapshot = f"{path}/{RAY_SNAPSHOT}"
    deadline = time.monotonic() + SNAPSHOT_REREAD_S
    while storage.get_file_info(snapshot).type != fs.FileType.NotFound:
        with storage.open_input_stream(snapshot) as f:
            text = f.read()
        with contextlib.suppress(ValueError):
            state = json.loads(text)
            if snapshot_shape(state):
                return state
        if time.monotonic() > deadline:
            raise BrokenSnapshot(f"{run_dir}/{RAY_SNAPSHOT}")
        time.sleep(0.05)
    return None


def snapshot_shape(state) -> bool:
    """Whether a snapshot has what ray_dp reads as Ray's _CheckpointManagerState has it: the
    committed checkpoints, each with its directory name and metrics, and the latest reported (None,
    or one of them: Ray cannot load one that is not)."""
    if not isinstance(state, dict) or not isinstance(state.get("checkpoint_results"), list):
        return False
    committed, latest = state["checkpoint_results"], state.get("latest_checkpoint_result")
    if not all(isinstance(entry, dict) and isinstance(entry.get("checkpoint_dir_name"), str)
               and isinstance(entry.get("metrics"), dict) for entry in committed):
        return False
    names = {entry["checkpoint_dir_name"] for entry in committed}
    return latest is None or (isinstance(latest, dict)
                              and isinstance(latest.get("checkpoint_dir_name"), str)
                              and latest["checkpoint_dir_name"] in names)


# ==================================================================================================
# Config: every field is a command-line flag (--field-name),
# with its help; validated before anything starts.
# ==================================================================================================


MODES = ("ddp", "scratch", "dp")


ALLREDUCE_ALGORITHMS = ("naive", "ring", "library")






NUM_CLASSES = 10  # the built-in data sets'; a folder or your own data set has its own
# --image-size when not given, for data sets read per sample: what each model was made for.
MODEL_IMAGE_SIZE = {"lenet": 28, "mlp": 28, "resnet18": 32}


DP_NEEDS_GPUS = "--mode dp needs CUDA GPUs (it is nn.DataParallel)"


MAX_SEED = 2 ** 32 - 1  # what every generator takes, scratch mode's seed * 100_003 + epoch too
MAX_SECONDS = 7 * 24 * 3600  # a week: longer timeouts are "never", which is what hangs look like


NO_LESSON = object()  # a field the lesson's recipe leaves to the flag's own default


def option(default, help, *, rerun: str = "fixed", evaluation: str = "train", doctor: bool = False,
           lesson=NO_LESSON, path: bool = False, store: str = "", **argparse_kwargs):
    """A Config field: its flag's default and help, and what each path does with it, declared
    here so that no list elsewhere can forget a new flag (the safe roles are the defaults).
    rerun (a run resumed under its --name): "fixed", the run's own value, a typed other value is
    refused; "adopt", the run's own value unless typed (--epochs extends a run); "free", what this
    command says. evaluation (--eval-only): "train", a training flag, refused when typed;
    "checkpoint", the checkpoint's value, a typed other value is refused; "adopt", the checkpoint's
    unless typed; "free", what this command says. doctor: the doctor takes the flag. lesson:
    --mode scratch's and compare's default, the d2l lesson's recipe. path: a local path, made
    absolute on the driver (Ray's workers run in directories of their own). store: it may be a URI
    of object storage (s3://bucket/key, gs://...) that ray_dp "read"s or "write"s; "": local
    only."""
    assert rerun in ("fixed", "adopt", "free")
    assert evaluation in ("train", "checkpoint", "adopt", "free")
    assert store in ("", "read", "write")
    return field(default=default, metadata={"help": help, "rerun": rerun, "evaluation": evaluation,
                                            "doctor": doctor, "lesson": lesson, "path": path,
                                            "store": store, **argparse_kwargs})


ROLE_KEYS = ("rerun", "evaluation", "doctor", "lesson", "path", "store")  # never argparse's


# resolved once on the driver (parse_command, then connect): a value from then on
@dataclass(frozen=True)
class Config:
    mode: str = option("ddp", "ddp: DistributedDataParallel, one process per worker; scratch: "
                       "the d2l lesson's functional LeNet with hand-written all-reduce and SGD; "
                       "dp: nn.DataParallel over --workers GPUs driven by one process (CUDA only)",
                       choices=MODES)
    workers: int = option(2, "number of training workers (processes); each gets one GPU on a GPU "
                          "cluster. MIN:MAX makes the run elastic: it starts with as many as fit, "
                          "at least MIN, and continues from the last checkpoint when workers come "
                          "or go", metavar="N|MIN:MAX", rerun="free", evaluation="free",
                          doctor=True)
    # Set by --workers MIN:MAX (0: a fixed --workers); not a flag of its own.
    min_workers: int = option(0, "", cli=False, rerun="free", evaluation="free")
    cpus_per_worker: Optional[float] = option(
        None, "CPU cores reserved per worker; fractions allowed (default: 1; on a machine ray_dp "
              "starts Ray on itself, more workers than cores share the cores evenly)",
        type=float, metavar="CPUS", rerun="free", evaluation="free", doctor=True)
    gpu: Optional[bool] = option(None, "use GPU workers (default: yes when the cluster has GPUs)",
                                 rerun="free", evaluation="free", doctor=True)
    epochs: int = option(10, "number of passes over the training set (--mode scratch and "
                         "compare: 20)", metavar="N", rerun="adopt", lesson=20)
    batch_size: int = option(64, "GLOBAL batch: samples per optimizer step summed over all workers "
                             "(per-worker micro-batch = batch-size / (workers x accum-steps); "
                             "--mode scratch and compare: 32, the lesson's)", metavar="N",
                             lesson=32)
    amp: bool = option(False, "mixed precision: forward passes under bf16 autocast (GPU; runs on "
                       "CPU too); bf16 keeps fp32's range, so no GradScaler is needed",
                       evaluation="adopt")
    compile: bool = option(False, "torch.compile the model (the first epoch pays for compiling)",
                           rerun="free")
    lr: float = option(0.05, "learning rate of --optimizer (peak, after any warm-up; "
                       "--mode scratch and compare: 0.2)", metavar="LR", lesson=0.2)
    lr_schedule: str = option("cosine", "learning rate over epochs: cosine decay to 0 over "
                              "--epochs (extending a run stretches it), or constant "
                              "(--mode scratch and compare: constant)",
                              choices=("cosine", "constant"), lesson="constant")
    momentum: float = option(0.9, "SGD momentum (compare: 0, like the lesson's plain SGD, which "
                             "--mode scratch always uses)", metavar="M", lesson=0.0)
    accum_steps: int = option(1, "micro-batches accumulated per optimizer step (gradients synced "
                              "only on the last)", metavar="K")
    allreduce: str = option("naive", "--mode scratch: how gradients are summed: naive (the lesson: "
                            "all into rank 0, then back), ring (reduce-scatter + all-gather), "
                            "library (dist.all_reduce)", choices=ALLREDUCE_ALGORITHMS)
    sync_bn: bool = option(False, "synchronise BatchNorm statistics across workers (models with "
                           "BatchNorm only)")
    model: str = option("lenet", "network: lenet, mlp, resnet18 (the lessons', for small "
                        "images), or any torchvision classification model by name, e.g. "
                        "resnet50, mobilenet_v3_small, vit_b_16, torchvision.resnet18 "
                        "(torchvision's own; --model list shows them)",
                        metavar="NAME", evaluation="checkpoint")
    weights: str = option("", "start from this state_dict file (e.g. torchvision's ImageNet "
                          ".pth); tensors whose shapes do not fit (a classifier for other "
                          "classes) stay new; a local file or a URI (s3://...)", metavar="PATH",
                          path=True, store="read")
    image_size: Optional[int] = option(
        None, "images are resized to N x N pixels (default: --dataset folder: 28 for lenet and "
              "mlp, 32 for resnet18, 224 for torchvision models; the built-in sets: their own "
              "size, 28 or 32)", type=int, metavar="N", evaluation="checkpoint")
    augment: bool = option(True, "--dataset folder: random resized crops and horizontal flips when "
                           "training (--no-augment: resize and center crop, as for evaluation)")
    optimizer: str = option("sgd", "sgd (with --momentum) or adamw", choices=("sgd", "adamw"))
    weight_decay: float = option(0.0, "weight decay, on weights only (not on biases or norm "
                                 "layers)", metavar="WD")
    warmup_epochs: int = option(0, "epochs of linear learning-rate warm-up before the schedule",
                                metavar="N")
    clip_grad_norm: float = option(0.0, "clip the gradients' global norm to this after the "
                                   "all-reduce (every rank clips the same gradients; 0: no "
                                   "clipping)", metavar="NORM")
    label_smoothing: float = option(0.0, "label smoothing of the training loss (0 to 1)",
                                    metavar="EPS")
    loader_workers: Optional[int] = option(
        None, "0: data held in memory are indexed on the worker's device (the fast path), "
              "per-sample data decoded in the worker; N: a torch DataLoader with N loader "
              "processes per worker (persistent; pinned memory on GPU) (default: 0 for in-memory "
              "data sets, 2 for folder)",
        type=int, metavar="N", rerun="free", evaluation="free")
    # The data's per-channel (mean, std), computed once on the driver for per-sample data sets.
    normalize: Optional[tuple] = option(None, "", cli=False, evaluation="checkpoint")
    synthetic_size: int = option(512, "--dataset synthetic: training images "
                                 "(the test set has 100)", metavar="N", evaluation="checkpoint")
    dataset: str = option("fashion-mnist", "data set; digits (1,797 real digits from scikit-learn) "
                          "needs no download; folder: your images, --data-dir PATH holding "
                          "train/<class>/* and val/<class>/*", evaluation="checkpoint", doctor=True)
    data_dir: str = option("./data", "where data sets are stored and downloaded to (a directory); "
                           "--dataset folder: the folder, on every node's disk or in object "
                           "storage (s3://bucket/prefix)", metavar="DIR", rerun="adopt",
                           evaluation="adopt", doctor=True, path=True, store="read")
    download: bool = option(True, "download a missing Fashion-MNIST / CIFAR-10 into --data-dir",
                            rerun="free", evaluation="free", doctor=True)
    seed: int = option(0, "random seed: model init and data order (the same on every worker), "
                       "each sample's augmentation and each worker's dropout (their own)",
                       metavar="N", evaluation="checkpoint")
    storage_path: str = option("./runs", "directory (or s3://bucket/path on a cluster) for "
                               "checkpoints and result.json", metavar="PATH", rerun="free",
                               evaluation="free", doctor=True, path=True, store="write")
    name: str = option("", "run name, the sub-directory of --storage-path; reuse it to resume "
                       "(default: mode-model-dataset-date-time-pid)", metavar="NAME",
                       rerun="free", evaluation="free")
    logdir: str = option("./runs/tensorboard", "TensorBoard events go to LOGDIR/<name>/, "
                         "one sub-run per run: watch with tensorboard --logdir LOGDIR",
                         metavar="LOGDIR", rerun="free", evaluation="free", path=True)
    log_every: int = option(10, "log the train loss (averaged over workers) to TensorBoard every "
                            "this many steps", metavar="STEPS", rerun="free")
    quiet: bool = option(False, "no progress bar (there is none anyway when the output is "
                         "not a terminal)", rerun="free", evaluation="free")
    max_failures: int = option(0, "restart the worker group this many times after a worker dies, "
                               "from the last checkpoint (-1: without limit)", metavar="K",
                               rerun="free", evaluation="free")
    checkpoint_every: str = option(
        "10m", "also save a checkpoint within an epoch, to resume from exactly there: every STEPS "
               "optimizer steps, or every Nm minutes of training (rank 0's clock); 0: at each "
               "epoch's end only (--mode scratch: 0). SIGTERM saves at the next --log-every step",
        metavar="STEPS|Nm", rerun="free", lesson="0")
    timeout: float = option(1800.0, "seconds a collective may wait for the slowest worker before "
                            "the run fails (torch.distributed's process-group timeout)",
                            metavar="SECONDS", rerun="free", evaluation="free")
    start_timeout: float = option(60.0, "seconds to wait for the workers to start (at the "
                                  "start, and after a failure or resize) before Ray tries again "
                                  "with what fits", metavar="SECONDS", rerun="free",
                                  evaluation="free", doctor=True)
    keep_freed_memory: bool = option(
        True, "training processes keep the memory a step frees for the next step (glibc's malloc): "
              "fewer page faults and faster steps, at a higher peak of resident memory "
              "(bench/memory.md); --no-keep-freed-memory leaves glibc's defaults",
        rerun="free", evaluation="free")
    fresh: bool = option(False, "start the run --name over, deleting its checkpoints, instead of "
                         "resuming it", rerun="free")
    address: str = option("", "Ray cluster to attach to ('auto' or host:port; default: start a "
                          "fresh local one)", metavar="ADDRESS", rerun="free", evaluation="free",
                          doctor=True)
    eval_only: str = option("", "evaluate a saved checkpoint on --workers workers instead of "
                            "training: a run directory (its last checkpoint), "
                            "a checkpoint_epoch_NNN directory, or a checkpoint.pt file "
                            "(local or a URI: s3://...)",
                            metavar="PATH", rerun="free", evaluation="free", store="read")
    predict_out: str = option("", "with --eval-only: write each test sample's index, label, "
                              "predicted class and probability to this CSV file",
                              metavar="FILE.csv", rerun="free", evaluation="free", path=True,
                              store="write")

    @property
    def processes(self) -> int:
        """Ray workers: one per --workers, except --mode dp,
        where one process drives --workers GPUs."""
        return 1 if self.mode == "dp" else self.workers

    @property
    def micro_batch(self) -> int:
        """Samples per process per forward/backward pass
        (nn.DataParallel splits it further over GPUs)."""
        return self.batch_size // (self.processes * self.accum_steps)

    @property
    def threads(self) -> int:
        """Intra-op threads per worker: its whole cores (at least one)."""
        return max(1, int(self.cpus_per_worker or 1))

    @property
    def run_dir(self) -> str:
        return os.path.join(self.storage_path, self.name)


class ConfigError(ValueError):
    """Bad input: reported as one line, before any cluster starts."""


class BrokenSnapshot(ConfigError):
    """A run's snapshot (ray_snapshot) that does not read as Ray writes it: the fact, and the ways
    on that a reader with better ones (--eval-only's) replaces."""

    def __init__(self, path: str):
        self.fact = f"{path} is not Ray's list of checkpoints"
        super().__init__(f"{self.fact}: {SNAPSHOT_WAYS_ON}")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action):  # "(default: )" says nothing: leave empty defaults out
        return action.help if action.default in ("", None) else super()._get_help_string(action)


def fields_where(role: str, *values) -> set:
    """The Config fields whose declared role (option()) is one of `values`."""
    return {f.name for f in fields(Config) if f.metadata[role] in values}


# --mode scratch and compare, for what the command line leaves unsaid: the lesson's recipe, plain
# SGD at a constant learning rate, large enough and long enough to leave the plateau where the
# lesson's init (randn * 0.01) sits at chance for hundreds of steps (measured on digits: README,
# Teaching). Declared with each field (lesson=).
LESSON_DEFAULTS = {f.name: f.metadata["lesson"] for f in fields(Config)
                   if f.metadata["lesson"] is not NO_LESSON}
# What a rerun of a run may change (how long it trains, on how many workers of what kind, where it
# reads and writes, what it logs): anything else would silently train a different model.
RERUN_MAY_CHANGE = fields_where("rerun", "free", "adopt")
# What a rerun takes from the run it resumes when the command does not say.
RERUN_ADOPTS = fields_where("rerun", "fixed", "adopt")
# --eval-only: flags that only training uses (typing one is an error, not silently ignored), and
# what the checkpoint fixes or suggests.
EVAL_REFUSES = fields_where("evaluation", "train")
EVAL_FROM_CHECKPOINT = fields_where("evaluation", "checkpoint", "adopt")
# what `ray_dp.py doctor` takes: where, how many workers of what kind, storage, data
DOCTOR_FLAGS = fields_where("doctor", True)
PATH_FIELDS = fields_where("path", True)
# What ray_dp does with each flag that may name object storage: "read" or "write" (option(store=)).
STORE_ACCESS = {f.name: f.metadata["store"] for f in fields(Config) if f.metadata["store"]}
# What each field's values may be (a checkpoint's config is checked against them): from its type.
FIELD_TYPES = {f.name: {"int": int, "float": (int, float), "str": str, "bool": bool,
                        "Optional[int]": (type(None), int),
                        "Optional[float]": (type(None), int, float),
                        "Optional[bool]": (type(None), bool),
                        "Optional[tuple]": (type(None), tuple)}[f.type] for f in fields(Config)}
EVAL_FIXED = fields_where("evaluation", "checkpoint")
CONFIG_FIELDS = [f.name for f in fields(Config)]  # in the order --help lists them
CLI_FIELDS = {f.name for f in fields(Config) if f.metadata.get("cli", True)}  # a flag's


class _WorkersAction(argparse.Action):
    """--workers N, or MIN:MAX for an elastic run."""

    def __call__(self, parser, namespace, text, option_string=None):
        low, colon, high = text.partition(":")
        try:
            namespace.workers, namespace.min_workers = ((int(high), int(low)) if colon
                                                        else (int(low), 0))
        except ValueError:  # also "3:" and ":3": half a range is no range
            raise ConfigError(f"--workers takes N or MIN:MAX in whole numbers, "
                              f"got {text!r}") from None
        if colon and namespace.min_workers < 1:
            # 0 would mean "not elastic": validate() says why MIN must be >= 1
            namespace.min_workers = -1


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one sentence instead of usage + error
        raise ConfigError(f"{message} (see --help)")


def build_parser(command: str = "train") -> argparse.ArgumentParser:
    descriptions = {
        "train": __doc__.split("\n\n")[0],
        "compare": "compare: train ddp and scratch LeNet at 1 and --workers N workers (scratch "
                   "with each all-reduce), same global batch and seed, and print the lesson's "
                   "table; writes compare.csv, compare.md and compare.png to "
                   "<storage-path>/<name>/",
        "doctor": "doctor: check a Ray cluster before training on it, one line per check: Ray "
                  "reachable (and its auth), the same Python/Ray/torch/torchvision on every "
                  "node, resources for --workers, storage every node shares, a worker group of "
                  "--workers started and its all-reduce timed at 4 KiB to 64 MiB (and the network "
                  "interface each rank uses), the data. Exits 0 only if every check passed."}
    commands = ("other commands: 'ray_dp.py compare [flags]' trains ddp and the scratch LeNet at 1 "
                "and N workers side by side and prints the lesson's table; 'ray_dp.py doctor "
                "[flags]' checks a Ray cluster before training on it (each takes --help)")
    parser = _Parser(prog="ray_dp.py" if command == "train" else f"ray_dp.py {command}",
                     usage="%(prog)s [compare | doctor] [flags]" if command == "train" else None,
                     description=descriptions[command], formatter_class=_HelpFormatter,
                     epilog=commands if command == "train" else None, allow_abbrev=False)
    if command == "compare":
        parser.add_argument("--scale-lr", action="store_true",
                            help="N-worker rows keep the per-worker batch (global batch x N, as "
                                 "the lesson did) and scale the learning rate by N with it")
    if command == "doctor":
        parser.add_argument("--hang-timeout", type=float, default=30.0, metavar="SECONDS",
                            help="seconds every rank has to come to each probe collective before "
                                 "the ones that did not are named; also the longest one probe "
                                 "collective may take (the process group's timeout)")
        parser.add_argument("--check-images", action="store_true",
                            help="--dataset folder: also decode every image of train/ and val/ "
                                 "on this machine, with a progress bar, and name each file that "
                                 "is not a readable image (a few seconds per 10,000 small "
                                 "images)")
    for f in fields(Config):
        flag = "--" + f.name.replace("_", "-")
        kwargs = {k: v for k, v in f.metadata.items() if k not in ROLE_KEYS}
        if not kwargs.pop("cli", True) or (command == "doctor" and f.name not in DOCTOR_FLAGS):
            continue
        if f.name == "dataset":
            kwargs["choices"] = sorted(DATASETS)  # the registry, complete by the time anyone parses
        if f.name == "workers":
            parser.add_argument(flag, action=_WorkersAction, default=f.default, **kwargs)
        elif f.name == "gpu":
            group = parser.add_mutually_exclusive_group()
            # SUPPRESS: an absent flag leaves Config's None
            # (= decide from the cluster), not a printed default.
            group.add_argument("--gpu", dest="gpu", action="store_const", const=True,
                               default=argparse.SUPPRESS, help=kwargs["help"])
            group.add_argument("--cpu", dest="gpu", action="store_const", const=False,
                               default=argparse.SUPPRESS, help="use CPU workers (gloo backend)")
        elif isinstance(f.default, bool):
            # a switch; one that is on by default also gets its --no- form
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            parser.add_argument(flag, action=action, default=f.default, **kwargs)
        else:
            kwargs.setdefault("type", type(f.default))
            parser.add_argument(flag, default=f.default, **kwargs)
    return parser


def is_uri(path: str) -> bool:
    # s3://bucket/path and the like: storage that pyarrow reaches, not a local path
    return "://" in str(path)


def is_run_name(name: str) -> bool:
    """One path component, so that <storage-path>/<name> and <logdir>/<name> stay inside their
    roots; printable, not blank, and short enough for a file system (255 bytes)."""
    return (name not in (".", "..") and not any(sep in name for sep in ("/", "\\"))
            and name.isprintable() and (not name or name.strip()) and len(name.encode()) <= 255)


def not_writable(path: str) -> Optional[str]:
    """The first existing part of `path` if this process cannot create or write there, else None."""
    for part in [Path(path), *Path(path).parents]:
        if part.exists():
            return None if os.access(part, os.W_OK | os.X_OK) else str(part)
    return None


def files_at(path: str):
    """(pyarrow file system, path in it) for a local path or a URI: one way to read, list, write and
    delete runs, checkpoints and data wherever they are."""
    from pyarrow import fs
    return fs.FileSystem.from_uri(path) if is_uri(path) else (fs.LocalFileSystem(),
                                                               os.path.abspath(path))


def stored_type(path: str) -> str:
    """What is at a local path or a URI: "file", "directory" or "none"."""
    from pyarrow import fs
    storage, where = files_at(path)
    return {fs.FileType.File: "file", fs.FileType.Directory: "directory"}.get(
        storage.get_file_info(where).type, "none")


def store_problem(uri: str, access: str) -> Optional[str]:
    """Why the object storage at `uri` cannot be used ("read" or "write"), in words that say what to
    check, or None: asked once, of its bucket, before any cluster starts (a missing bucket or
    refused credentials would otherwise fail on every worker, or at the first checkpoint)."""
    from pyarrow import ArrowException, fs
    if (problem := uri_syntax_problem(uri)):
        return problem
    try:
        storage, path = fs.FileSystem.from_uri(uri)
    except (ArrowException, ValueError) as exc:
        return str(exc).splitlines()[0]
    if isinstance(storage, fs.LocalFileSystem):  # file://: a directory, checked as one
        return None
    bucket = path.split("/")[0]
    if not bucket:
        return f"names no bucket (write {uri.split('://')[0]}://BUCKET/path)"
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    at = f" at {endpoint} (AWS_ENDPOINT_URL)" if endpoint and uri.startswith("s3:") else ""
    try:
        found = storage.get_file_info(bucket).type
    except (OSError, ArrowException) as exc:
        reason = " ".join(str(exc).split())
        # HTTP 403, not the digits of a port (the endpoint's address is in the reason too)
        if re.search(r"ACCESS_DENIED|INVALID_ACCESS_KEY|SIGNATURE|FORBIDDEN|(?<![:\d])403(?!\d)",
                     reason):
            return (f"the store{at} refused access to bucket '{bucket}' ({store_error(reason)}): "
                    f"check the credentials this machine uses (AWS_ACCESS_KEY_ID and "
                    f"AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or its IAM role) and that they may "
                    f"{'read and write' if access == 'write' else 'read'} the bucket")
        return f"bucket '{bucket}'{at} cannot be reached ({store_error(reason)})"
    if found == fs.FileType.NotFound:
        check = ("its name and AWS_ENDPOINT_URL" if at else
                 "its name (and for a store other than AWS's, set AWS_ENDPOINT_URL)")
        return f"bucket '{bucket}' does not exist{at}: create it, or check {check}"
    if access == "read" and storage.get_file_info(path).type == fs.FileType.NotFound:
        return f"bucket '{bucket}' holds nothing at '{path[len(bucket) + 1:]}'"
    return None


def uri_syntax_problem(uri: str) -> Optional[str]:
    """ray_dp appends to a URI's path (<storage-path>/<name>/checkpoint_epoch_001/...) and prints
    and records it: what would change what it names, or hide a secret, is refused."""
    scheme, _, rest = uri.partition("://")
    if (marks := sorted(set(uri) & set("?#%"))):
        return (f"'{marks[0]}' in a URI would change what it names (options, fragments and escapes "
                f"are not taken; say where an S3-compatible store is with AWS_ENDPOINT_URL)")
    if "@" in rest.split("/")[0]:
        return ("credentials in a URI would be printed and kept in result.json: give them as "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or the node's IAM role)")
    if "" in rest.rstrip("/").split("/")[1:]:
        return "an empty path component ('//')"
    return None


def store_error(reason: str) -> str:
    """The part of an AWS SDK error that names it: 'AWS Error ACCESS_DENIED during HeadBucket'."""
    named = reason[reason.find("AWS Error"):] if "AWS Error" in reason else reason
    return re.split(r" \(Request ID|; Details", named)[0][:200].rstrip(": .")


def check_store(flag: str, uri: str) -> None:
    """A flag that names object storage: one line before anything starts when it cannot be used
    (or when the flag takes local paths only)."""
    name = flag.replace("-", "_")
    if name not in STORE_ACCESS:
        takers = ["--" + name.replace("_", "-") for name in STORE_ACCESS]
        raise ConfigError(f"--{flag} {uri}: a local path, not a URI (only "
                          f"{', '.join(takers[:-1])} and {takers[-1]} take one)")
    if (problem := store_problem(uri, STORE_ACCESS[name])):
        raise ConfigError(f"--{flag} {uri}: {problem}")


def not_a_directory(path: str) -> Optional[str]:
    """The first existing part of `path` if it is a file
    (so no directory can be made there), else None."""
    for part in [Path(path), *Path(path).parents]:
        if part.exists():
            return None if part.is_dir() else str(part)
    return None


def check_location(cfg: Config) -> None:
    """--storage-path can be used, and --name names a place inside it: checked before anything
    looks there (a rerun's checkpoint, --fresh's directory, an evaluation's result.json)."""
    check_run_name(cfg)
    if is_uri(cfg.storage_path):
        check_store("storage-path", cfg.storage_path)


def check_run_name(cfg: Config) -> None:
    if not cfg.storage_path:
        raise ConfigError("--storage-path, --logdir and --data-dir cannot be empty")
    if not is_run_name(cfg.name):
        raise ConfigError(f"--name must be one directory name (printable; no '/', '\\', '.' or "
                          f"'..'; at most 255 bytes), got {cfg.name!r}")
    if is_uri(cfg.storage_path) and (marks := sorted(set(cfg.name) & set("?#%"))):
        raise ConfigError(f"--name {cfg.name}: '{marks[0]}' would change what the run's URI "
                          f"({cfg.run_dir}) names; choose a name without '?', '#' or '%'")


def checkpoint_interval(every: str) -> Optional[tuple[int, float]]:
    """--checkpoint-every as (steps, seconds), one of them 0; None if it is neither."""
    if match := re.fullmatch(r"\s*(\d{1,9})\s*", every):
        return int(match[1]), 0.0
    if match := re.fullmatch(r"\s*(\d{1,6}(?:\.\d*)?|\.\d+)\s*m\s*", every):
        return (0, float(match[1]) * 60) if float(match[1]) > 0 else None
    return None


def validate(cfg: Config, doctor: bool = False, resuming: bool = False) -> None:
    """One line for the first thing wrong with the final configuration (what the flags, the
    lesson's defaults, torchrun and the run it resumes or the checkpoint it evaluates made of it).
    The doctor trains nothing (no batch to split) and tries --storage-path on every node itself;
    a run that resumes starts from its checkpoint, not from --weights (which may have moved)."""
    if not doctor:
        check_run_name(cfg)  # its storage was checked where the command first looked there
    cpus = cfg.cpus_per_worker
    checks = [
        (cfg.workers >= 1, f"--workers must be at least 1, got {cfg.workers}"),
        (cfg.min_workers == 0 or 1 <= cfg.min_workers <= cfg.workers,
         f"--workers MIN:MAX needs 1 <= MIN <= MAX, got {max(cfg.min_workers, 0)}:{cfg.workers}"),
        (not (cfg.min_workers and cfg.mode == "dp"),
         "--mode dp runs one worker; it cannot be elastic"),
        (cpus is None or (math.isfinite(cpus) and cpus > 0),
         f"--cpus-per-worker must be a positive number, got {cpus}"),
        (cpus is None or cpus >= 1 or round(cpus, 4) == cpus,
         f"--cpus-per-worker below 1 must be a multiple of 0.0001 (Ray's resolution), got {cpus}"),
        (all((cfg.storage_path, cfg.logdir, cfg.data_dir)),
         "--storage-path, --logdir and --data-dir cannot be empty"),
        (cfg.epochs >= 1, f"--epochs must be at least 1, got {cfg.epochs}"),
        (0 <= cfg.seed <= MAX_SEED, f"--seed must be 0 to {MAX_SEED}, got {cfg.seed}"),
        (cfg.accum_steps >= 1, f"--accum-steps must be at least 1, got {cfg.accum_steps}"),
        (cfg.batch_size >= 1, f"--batch-size must be at least 1, got {cfg.batch_size}"),
        (math.isfinite(cfg.lr) and cfg.lr > 0, f"--lr must be a positive number, got {cfg.lr}"),
        (cfg.log_every >= 1, f"--log-every must be at least 1, got {cfg.log_every}"),
        (cfg.max_failures >= -1,
         f"--max-failures must be -1 (no limit) or more, got {cfg.max_failures}"),
        (checkpoint_interval(cfg.checkpoint_every) is not None,
         f"--checkpoint-every must be a number of steps (200), minutes (10m) or 0 (at epochs' "
         f"ends only), got {cfg.checkpoint_every}"),
        (not (cfg.mode == "scratch" and checkpoint_interval(cfg.checkpoint_every) not in
              (None, (0, 0.0))),
         "--checkpoint-every needs --mode ddp (scratch mode saves at each epoch's end)"),
        (1 <= cfg.timeout <= MAX_SECONDS,
         f"--timeout must be 1 to {MAX_SECONDS} seconds, got {cfg.timeout}"),
        (1 <= cfg.start_timeout <= MAX_SECONDS,
         f"--start-timeout must be 1 to {MAX_SECONDS} seconds, got {cfg.start_timeout}"),
        (0 <= cfg.momentum < 1, f"--momentum must be in [0, 1), got {cfg.momentum}"),
        (not (cfg.mode == "scratch" and cfg.model != "lenet"),
         f"--mode scratch trains the lesson's functional LeNet, not {cfg.model} (drop --model)"),
        (not (cfg.mode == "scratch" and cfg.accum_steps > 1),
         "--accum-steps needs --mode ddp (scratch mode has none)"),
        (not (cfg.mode == "scratch" and cfg.sync_bn),
         "--sync-bn needs --mode ddp (scratch mode's LeNet has no BatchNorm)"),
        (not (cfg.mode == "scratch" and (cfg.amp or cfg.compile)),
         "--amp and --compile need --mode ddp (scratch mode is the lesson's plain fp32 code)"),
        (cfg.loader_workers is None or cfg.loader_workers >= 0,
         f"--loader-workers must be 0 (in memory) or more, got {cfg.loader_workers}"),
        (not (cfg.mode == "scratch" and cfg.loader_workers),
         "--loader-workers needs --mode ddp (scratch mode slices the lesson's in-memory batches)"),
        (not (cfg.mode == "scratch" and cfg.dataset == "folder"),
         "--dataset folder needs --mode ddp (scratch mode slices the lesson's in-memory batches)"),
        (not (cfg.mode == "scratch" and (cfg.optimizer != "sgd" or cfg.weight_decay or cfg.weights
                                         or cfg.clip_grad_norm or cfg.label_smoothing)),
         "--optimizer, --weight-decay, --weights, --clip-grad-norm and --label-smoothing need "
         "--mode ddp (scratch mode is the lesson's plain SGD)"),
        (not (cfg.mode == "scratch" and cfg.image_size),
         "--image-size needs --mode ddp (scratch mode is the lesson's LeNet on 28 x 28 images)"),
        (cfg.image_size is None or cfg.image_size >= 1,
         f"--image-size must be at least 1 pixel, got {cfg.image_size}"),
        (cfg.image_size is None or cfg.model not in ("lenet", "mlp") or cfg.image_size >= 14,
         f"--image-size {cfg.image_size} is too small for {cfg.model} (at least 14)"),
        (math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0,
         f"--weight-decay must be 0 or more, got {cfg.weight_decay}"),
        (0 <= cfg.warmup_epochs < cfg.epochs,
         f"--warmup-epochs must be 0 to --epochs - 1 = {cfg.epochs - 1}, got {cfg.warmup_epochs}"),
        (math.isfinite(cfg.clip_grad_norm) and cfg.clip_grad_norm >= 0,
         f"--clip-grad-norm must be 0 (off) or more, got {cfg.clip_grad_norm}"),
        (0 <= cfg.label_smoothing < 1,
         f"--label-smoothing must be in [0, 1), got {cfg.label_smoothing}"),
        (cfg.synthetic_size >= 1, f"--synthetic-size must be at least 1, got {cfg.synthetic_size}"),
        (not (cfg.mode == "dp" and cfg.sync_bn),
         "--sync-bn needs --mode ddp: nn.DataParallel keeps BatchNorm statistics per GPU replica"),
        (not (cfg.mode == "dp" and cfg.gpu is False),
         f"{DP_NEEDS_GPUS}; drop --cpu, or use --mode ddp"),
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
    check_model_name(cfg.model)
    if cfg.dataset not in DATASETS:  # one a checkpoint names, trained where another was registered
        raise ConfigError(f"--dataset {cfg.dataset} is not a data set of this ray_dp.py "
                          f"(registered: {', '.join(sorted(DATASETS))})")
    if cfg.sync_bn and not has_batchnorm(cfg.model):
        raise ConfigError(f"--sync-bn needs a model with BatchNorm (e.g. resnet18); "
                          f"{cfg.model} has none")
    check_stores(cfg, doctor, resuming)
    if cfg.weights and not resuming and stored_type(cfg.weights) != "file":
        raise ConfigError(f"--weights {cfg.weights} is not a file")
    directories = {"data-dir": cfg.data_dir, "logdir": cfg.logdir, "storage-path": cfg.storage_path,
                   "predict-out": cfg.predict_out}
    for flag, typed in directories.items():
        if doctor and flag != "data-dir":  # the doctor writes no logs or predictions
            continue
        path = os.path.dirname(typed) if flag == "predict-out" else typed
        if path and is_uri(path):
            continue  # check_stores'
        elif path and (blocker := not_a_directory(path)):
            raise ConfigError(f"--{flag} {typed}: {blocker} is a file, not a directory")
        elif path and flag != "data-dir" and (blocker := not_writable(path)):
            raise ConfigError(f"--{flag} {typed}: {blocker} is not writable")
    if not doctor and not cfg.eval_only:  # evaluation has no global batch to split
        check_batch_split(cfg)


def check_stores(cfg: Config, doctor: bool, resuming: bool) -> None:
    """Every flag of the final configuration that names object storage, checked in one request each
    (store_problem), but those checked where the command first read them (--storage-path:
    check_location; --eval-only: checkpoint_file) and, for the doctor, those it does not take; a
    resumed run reads no --weights."""
    names = (PATH_FIELDS | STORE_ACCESS.keys()) - {"storage_path", "eval_only"}
    if doctor:
        names &= DOCTOR_FLAGS
    if resuming:
        names.discard("weights")
    for name in sorted(names):
        value = getattr(cfg, name)
        if not is_uri(value):
            continue
        if name == "data_dir" and cfg.dataset != "folder":
            raise ConfigError(f"--data-dir {value}: only --dataset folder reads its data from "
                              f"object storage; {cfg.dataset} is kept in a local directory")
        check_store(name.replace("_", "-"), value)


def check_batch_split(cfg: Config) -> None:
    """The global batch splits evenly into per-worker micro-batches at every size an elastic run
    may take (MIN:MAX), as at a fixed --workers."""
    sizes = range(cfg.min_workers or cfg.workers, cfg.workers + 1)
    step = math.lcm(*(workers * cfg.accum_steps for workers in sizes))
    if not cfg.batch_size % step:
        return
    lower, upper = cfg.batch_size // step * step, (cfg.batch_size // step + 1) * step
    near = f"e.g. {lower} or {upper}" if lower else f"e.g. {upper}"
    if upper > 16 * cfg.batch_size:  # no batch near the one typed divides: the range is the problem
        near = f"narrow the range: no batch near {cfg.batch_size} divides by all of them"
    if len(sizes) == 1:
        raise ConfigError(f"--batch-size {cfg.batch_size} must divide by workers x accum-steps = "
                          f"{step} (the global batch is split evenly into per-worker "
                          f"micro-batches; {near})")
    each = ", ".join(map(str, sizes[:-1])) + f" and {sizes[-1]}"
    raise ConfigError(f"--batch-size {cfg.batch_size} must divide by workers x accum-steps at "
                      f"every size --workers {sizes[0]}:{sizes[-1]} may take ({each} workers x "
                      f"{cfg.accum_steps}: a multiple of {step}; {near})")


def check_model_name(name: str) -> None:
    if name in MODELS or name.removeprefix(TORCHVISION) in torchvision_models():
        return
    import difflib
    close = difflib.get_close_matches(name, [*MODELS, *torchvision_names()], n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise ConfigError(f"--model {name} is not a model of ray_dp or torchvision{hint} "
                      f"(--model list shows them)")


NOT_TYPED = object()


def with_absolute_paths(cfg: Config) -> Config:
    """Ray's workers run in directories of their own:
    every local path they are handed is absolute."""
    paths = {name: os.path.abspath(getattr(cfg, name)) for name in PATH_FIELDS
             if getattr(cfg, name) and not is_uri(getattr(cfg, name))}
    return replace(cfg, **paths)


def default_run_name(command: str, cfg: Config) -> str:
    """mode-model-dataset-date-time-pid: the pid keeps two runs started in the same second apart."""
    prefix = {"compare": "compare", "eval": f"eval-{cfg.model}-{cfg.dataset}"}.get(
        command, f"{cfg.mode}-{cfg.model}-{cfg.dataset}")
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def under_torchrun() -> bool:
    """The driver was started by torchrun (the DDP tutorial's launcher), not by hand: Ray Train's
    local mode then runs the loop in each torchrun process, and ray_dp keeps the checkpoints itself.
    Only the driver asks: Ray's own workers have RANK, WORLD_SIZE, ... too, but not torchrun's run
    id."""
    return "TORCHELASTIC_RUN_ID" in os.environ and ray_joins_torchrun()


def torchrun_follower() -> bool:
    """A torchrun process other than rank 0: it parses its command line, and takes the rest, the
    run's configuration as resolved from the run directory, which checkpoint and what it holds, from
    rank 0 (which checks them all before training: a refusal there ends every rank, as torchrun
    stops the others when one fails). Its own view of the run directory may be another machine's,
    or one that rank 0's --fresh is deleting."""
    return under_torchrun() and os.environ.get("RANK") != "0"


def torchrun_launch(command: str, args: dict, typed: set) -> dict:
    """Under torchrun, torchrun decides the worker count (WORLD_SIZE) and the device (CUDA if the
    machine has it): the config states what will really run, so that it is validated like any
    other."""
    world = os.environ["WORLD_SIZE"]
    if not world.isdigit() or int(world) < 1:
        raise ConfigError(f"torchrun's WORLD_SIZE must be a positive whole number, got {world!r}")
    world = int(world)
    if args["mode"] == "dp":
        raise ConfigError("--mode dp is one process driving every GPU; "
                          "under torchrun use --mode ddp")
    if command != "train" or args["eval_only"]:
        raise ConfigError("under torchrun ray_dp trains; run compare and --eval-only with python "
                          "ray_dp.py, whose Ray workers need no torchrun")
    if "workers" in typed and (args["workers"], args.get("min_workers", 0)) != (world, 0):
        raise ConfigError(f"torchrun starts {world} processes (WORLD_SIZE={world}) and they are "
                          f"the workers: drop --workers (or change --nproc_per_node)")
    cuda = torch.cuda.is_available()
    if args.get("gpu") is not None and args["gpu"] != cuda:  # absent: --gpu / --cpu not typed
        raise ConfigError(f"under torchrun the workers use {'CUDA' if cuda else 'the CPU'} "
                          f"when the machine {'has' if cuda else 'has no'} GPUs: "
                          f"drop --{'cpu' if cuda else 'gpu'}")
    return {**args, "workers": world, "min_workers": 0, "gpu": cuda}


# ==================================================================================================
# Data: whole data sets as tensors in memory (all four fit easily),
# loaded and checked on the driver first.
# ==================================================================================================


# Your own data set: one function, registered by name, that returns (train, test) torch Datasets of
# (image tensor (C, H, W), int label) pairs, e.g.
#     @dataset("mine")
#     def load_mine(cfg: Config):
#         train, test = torch.load("/data/mine.pt")  # tensors on a file every node can read
#         return TensorDataset(*train), TensorDataset(*test)
# and --dataset mine trains on it. TensorDatasets take the in-memory fast path; other Datasets are
# read per sample by --loader-workers processes. A `classes` attribute names the classes (else 0, 1,
# ...).
DATASETS: dict = {}


def dataset(name: str):
    """Register a data set loader under --dataset NAME."""
    def register(load):
        DATASETS[name] = load
        return load
    return register


def load_dataset(cfg: Config):
    """(train, test) as the data set's loader gives them; built-ins: float images in [0, 1] of shape
    (N, C, H, W) and int64 labels, as TensorDatasets."""
    return DATASETS[cfg.dataset](cfg)


@dataset("fashion-mnist")
def load_fashion_mnist(cfg: Config) -> tuple[TensorDataset, TensorDataset]:
    from torchvision.datasets import FashionMNIST
    return load_torchvision(FashionMNIST, cfg.data_dir, cfg.download)


@dataset("cifar10")
def load_cifar10(cfg: Config) -> tuple[TensorDataset, TensorDataset]:
    from torchvision.datasets import CIFAR10
    return load_torchvision(CIFAR10, cfg.data_dir, cfg.download)


@dataset("digits")
def load_digits_set(cfg: Config) -> tuple[TensorDataset, TensorDataset]:
    return load_digits()


@dataset("synthetic")
def load_synthetic(cfg: Config) -> tuple[TensorDataset, TensorDataset]:
    return make_synthetic(cfg.seed, cfg.synthetic_size)


@dataset("folder")
def load_folder(cfg: Config):
    """--data-dir PATH laid out as torchvision's ImageFolder wants it (pytorch/examples' imagenet):
    PATH/train/<class>/* and PATH/val/<class>/*, any format PIL reads, decoded per sample; PATH on
    a disk or in object storage (s3://bucket/prefix: StoredImageFolder)."""
    from torchvision.datasets import ImageFolder
    root = cfg.data_dir.rstrip("/") if is_uri(cfg.data_dir) else cfg.data_dir
    for split in ("train", "val"):
        if stored_type(f"{root}/{split}") != "directory":
            other = "val" if split == "train" else "train"
            raise DataError(f"--dataset folder needs {root}/{split}/<class>/<images> (and "
                            f"{root}/{other}/ beside it)")
    train_transform, eval_transform = image_transforms(cfg)
    try:
        if is_uri(root):
            train = StoredImageFolder(f"{root}/train", train_transform, data_dir=root)
            val = StoredImageFolder(f"{root}/val", eval_transform, data_dir=root)
        else:
            loader = functools.partial(read_image, data_dir=root)
            train = ImageFolder(f"{root}/train", transform=train_transform, loader=loader)
            val = ImageFolder(f"{root}/val", transform=eval_transform, loader=loader)
    except FileNotFoundError as exc:  # a class folder without a single image
        raise DataError(f"--data-dir {root}: {exc}") from None
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes)) or "none"
        only_val = sorted(set(val.classes) - set(train.classes)) or "none"
        raise DataError(f"--data-dir {root}: train/ and val/ must hold the same classes; only in "
                        f"train/: {only_train}, only in val/: {only_val}")
    return train, val


class StoredImageFolder(torch.utils.data.Dataset):
    """torchvision's ImageFolder over object storage (root: s3://bucket/prefix/train), with its
    attributes (classes, class_to_idx, samples, targets) and its order (sorted classes, then
    sorted(os.walk())), so that a bucket and a disk holding the same files give the same samples.
    The objects are listed once, a request per 1,000, where the data set is made (the driver, which
    sends the list to the workers); a batch's images are fetched together (prefetch), each decoded
    when the loader asks for it."""

    def __init__(self, root: str, transform, data_dir: str):
        from pyarrow import fs
        from torchvision.datasets.folder import IMG_EXTENSIONS, has_file_allowed_extension
        storage, path = files_at(root)
        found = storage.get_file_info(fs.FileSelector(path, recursive=True, allow_not_found=True))
        # (class, its folder, file name) of each object under a class folder
        entries = [(parts[0], "/".join(parts[:-1]), parts[-1]) for info in found
                   for parts in [info.path[len(path) + 1:].split("/")]
                   if len(parts) > 1 and info.type == fs.FileType.File]
        self.classes = sorted({parts[0] for info in found
                               for parts in [info.path[len(path) + 1:].split("/")]
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
        """A batch (torch's DataLoader asks for it whole, through Subset too)."""
        self.prefetch(indices)
        return [self[index] for index in indices]

    def prefetch(self, indices: list) -> None:
        """The objects of these samples fetched at once, a request each in threads of their own: a
        loader waits for the slowest of a batch, not for the sum of their latencies."""
        from concurrent.futures import ThreadPoolExecutor
        paths = [self.samples[index][0] for index in indices]
        with ThreadPoolExecutor(max_workers=min(16, len(paths) or 1)) as pool:
            self.fetched.update(zip(paths, pool.map(
                functools.partial(stored_image, data_dir=self.data_dir), paths)))


def read_image(path: str, data_dir: str, data: Optional[bytes] = None):
    """ImageFolder's own loader (PIL, as RGB), for a file or an object's bytes (fetched before: a
    store that fails says so itself); but a file that is no readable image is named, with its
    folder, in one line: wherever it is decoded (the driver's statistics, a worker's loader, an
    evaluation)."""
    from PIL import Image
    from torchvision.datasets.folder import default_loader
    try:
        if data is None:
            return default_loader(path)
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except BROKEN_IMAGE as exc:
        raise DataError(unreadable_image(path, data_dir, exc)) from None


def stored_image(uri: str, data_dir: str) -> bytes:
    """An image's bytes from object storage, through one connection per loader process (made on
    first use in that process: a store's client does not survive a fork)."""
    data_dir = data_dir.rstrip("/")
    key = (data_dir, os.getpid())
    if key not in STORE_CONNECTIONS:
        STORE_CONNECTIONS[key] = files_at(data_dir)
    storage, root = STORE_CONNECTIONS[key]
    with storage.open_input_file(root + uri[len(data_dir):]) as f:
        return f.read()


STORE_CONNECTIONS = {}  # (--data-dir, process ID): its (file system, path), for stored_image


def unreadable_image(path: str, data_dir: str, error: BaseException) -> str:
    return (f"{path} is not a readable image ({image_error(error)}): remove or replace it in "
            f"{path.rsplit('/', 1)[0]}/ (ray_dp.py doctor --dataset folder --data-dir {data_dir} "
            f"--check-images finds every such file)")


def image_error(error: BaseException) -> str:
    """PIL's reason in one line, without the in-memory file it read an object from."""
    reason = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", " ".join(str(error).split()))
    return reason or type(error).__name__


def broken_image_errors() -> tuple:
    """What PIL raises for a file that is no readable image: truncated, unknown, broken, too big."""
    from PIL import Image
    return OSError, SyntaxError, ValueError, Image.DecompressionBombError


BROKEN_IMAGE = broken_image_errors()


def image_transforms(cfg: Config) -> tuple:
    """torchvision's standard transforms at --image-size: training with --augment (random resized
    crop + horizontal flip) or without (resize + center crop); evaluation resize + center crop; then
    normalised with cfg.normalize (mean, std per channel) once it is known."""
    from torchvision import transforms as T
    size = cfg.image_size or MODEL_IMAGE_SIZE.get(cfg.model, 224)
    fixed = [T.Resize(size), T.CenterCrop(size)]
    train = [T.RandomResizedCrop(size), T.RandomHorizontalFlip()] if cfg.augment else fixed
    normalize = [T.Normalize(*cfg.normalize)] if cfg.normalize else []
    return (T.Compose([*train, T.ToTensor(), *normalize]),
            T.Compose([*fixed, T.ToTensor(), *normalize]))


IMAGENET_STATISTICS = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])


def with_data_statistics(cfg: Config, train_set) -> Config:
    """Per-sample data sets are normalised: with ImageNet's statistics when starting from --weights
    (torchvision's ImageNet weights expect them), otherwise with the data's, from up to 500 training
    images, computed once here on the driver and kept in the config (a rerun or an evaluation of the
    run uses the same)."""
    if isinstance(train_set, TensorDataset) or cfg.normalize:
        return cfg
    if cfg.weights:
        return replace(cfg, normalize=IMAGENET_STATISTICS)
    picked = torch.linspace(0, len(train_set) - 1, 500).long().unique().tolist()
    if hasattr(train_set, "prefetch"):  # a bucket's: fetched at once
        train_set.prefetch(picked)
    with torch.random.fork_rng():  # --augment's random crops: the same statistics on every run
        torch.manual_seed(cfg.seed)
        sample = torch.stack([train_set[i][0] for i in picked])
    mean = sample.mean((0, 2, 3))
    std = sample.std((0, 2, 3)).clamp_min(1e-3)
    return replace(cfg, normalize=([round(v, 4) for v in mean.tolist()],
                                   [round(v, 4) for v in std.tolist()]))


def class_names(dataset) -> list:
    """The data set's class names: its `classes`, or 0..K-1 from its labels."""
    if getattr(dataset, "classes", None):
        return [str(name) for name in dataset.classes]
    if not isinstance(dataset, TensorDataset) and not hasattr(dataset, "targets"):
        raise DataError(f"a data set read per sample ({type(dataset).__name__}) needs a `classes` "
                        f"attribute (the class names) or `targets` (every sample's label)")
    return [str(c) for c in range(max(labels_of(dataset)) + 1)]


class NamedTensors(TensorDataset):
    """A TensorDataset that knows its class names."""

    def __init__(self, *tensors, classes: list):
        super().__init__(*tensors)
        self.classes = classes


def load_digits(test_size: int = 360) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 1,797 real 8x8 digits (shipped in its wheel), resized to 28x28 like MNIST."""
    pixels, target = sklearn_digits_file()
    images = torch.tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    images = F.interpolate(images, size=(28, 28), mode="bilinear", align_corners=False)
    labels = torch.tensor(target, dtype=torch.int64)
    # A fixed split, independent of --seed, so every run is scored on the same digits.
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
    test, train = order[:test_size], order[test_size:]
    classes = [str(c) for c in range(10)]
    return (NamedTensors(images[train], labels[train], classes=classes),
            NamedTensors(images[test], labels[test], classes=classes))


def sklearn_digits_file() -> tuple:
    """(pixels (1797, 64), labels) from scikit-learn's digits.csv.gz, read as its load_digits reads
    it, but without importing scikit-learn: that costs ~1 s, on the way to every digits run's first
    step. (The tests check that both give the same digits.)"""
    import importlib.util

    import numpy as np
    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise DataError("--dataset digits needs scikit-learn: pip install -r requirements.txt")
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():
        raise DataError(f"--dataset digits: scikit-learn's {path} is missing: reinstall it "
                        f"(pip install -r requirements.txt)")
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def make_synthetic(seed: int, n_train: int = 512,
                   n_test: int = 100) -> tuple[TensorDataset, TensorDataset]:
    """Random 1x28x28 images and labels: for smoke tests (n_test=100 is deliberately not a
    multiple of 3)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n_train + n_test, 1, 28, 28, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (n_train + n_test,), generator=gen)
    classes = [str(c) for c in range(NUM_CLASSES)]
    return (NamedTensors(x[:n_train], y[:n_train], classes=classes),
            NamedTensors(x[n_train:], y[n_train:], classes=classes))


class DataError(RuntimeError):
    """The data set is missing and could not be fetched."""


def load_torchvision(dataset_class, root: str,
                     download: bool) -> tuple[TensorDataset, TensorDataset]:
    """A torchvision data set from root, downloaded there first if it is missing and `download`; a
    failed attempt takes away what it made (its partial files; root, lock file and all, if it made
    root)."""
    before = set(os.listdir(root)) if os.path.isdir(root) else None
    try:
        with download_lock(root, dataset_class.__name__) if download else contextlib.nullcontext():
            try:
                splits = [dataset_class(root, train=train, download=download)
                          for train in (True, False)]
            except (RuntimeError, OSError) as exc:
                # not found / corrupt / no network (URLError is an OSError); still holding the
                # lock, so that no other process's download is taken away with this one's
                remove_made(root, before, own_entries(dataset_class))
                raise DataError(missing_dataset(dataset_class, root, download, exc)) from None
    except DataError:
        # root is this attempt's: gone too, if all it holds is lock files (not another's data)
        if before is None and os.path.isdir(root) and all(
                re.fullmatch(r"\.\w+\.lock", name) for name in os.listdir(root)):
            shutil.rmtree(root, ignore_errors=True)
        raise
    return tuple(images_to_tensors(split) for split in splits)


def missing_dataset(dataset_class, root: str, download: bool, error: Exception) -> str:
    """Why a built-in data set is not there, and the files that would make it so. (torchvision's
    own "You can use download=True" names no flag of ray_dp's: it is left out.)"""
    reason = " ".join(str(error).split())  # torchvision's messages run over several lines
    tried = (f" and could not be downloaded ({reason})" if "download=True" not in reason
             else " and could not be downloaded") if download else " (--no-download)"
    return (f"{dataset_class.__name__} is not in {root}{tried}: put its files there "
            f"({expected_files(dataset_class, root)}) or --data-dir where they are, or use "
            f"--dataset digits (offline)")


def expected_files(dataset_class, root: str) -> str:
    """Where torchvision looks for a data set's files under root, and their names."""
    if hasattr(dataset_class, "resources"):  # the MNIST family: FashionMNIST/raw/*-ubyte
        folder = os.path.join(root, dataset_class.__name__, "raw")
        names = [os.path.splitext(os.path.basename(url))[0] for url, _ in dataset_class.resources]
    else:  # CIFAR-10: cifar-10-batches-py/
        folder = os.path.join(root, dataset_class.base_folder)
        names = ([name for name, _ in dataset_class.train_list + dataset_class.test_list]
                 + [dataset_class.meta["filename"]])
    return f"{folder}/ holding {', '.join(names)}"


def own_entries(dataset_class) -> tuple:
    """What a torchvision data set puts in its root: its folder, its archive (CIFAR-10's)."""
    folder = dataset_class.__name__ if hasattr(dataset_class, "resources") else \
        dataset_class.base_folder
    return (folder, *filter(None, [getattr(dataset_class, "filename", None)]))


def remove_made(root: str, before: Optional[set], own: tuple) -> None:
    """Take away the data set's own entries of root (`own`) that appeared since `before` (root's
    entries then; None: root did not exist). The lock file stays (a process waiting on it holds
    it open), unless root itself is new and holds nothing else (load_torchvision)."""
    for name in set(own) - (before or set()):
        path = os.path.join(root, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            with contextlib.suppress(OSError):
                os.unlink(path)


@contextlib.contextmanager
def download_lock(root: str, name: str):
    """Workers sharing a node would otherwise download and unpack the same files at once. (Reading
    alone, --no-download and the doctor, writes nothing.)"""
    from filelock import FileLock
    try:
        os.makedirs(root, exist_ok=True)
        lock = FileLock(os.path.join(root, f".{name}.lock"))
        lock.acquire()
    except OSError as exc:
        raise DataError(f"--data-dir {root}: cannot create the download's lock file there "
                        f"({exc.strerror or exc}); use a writable --data-dir, or --no-download "
                        f"where the files already are") from None
    try:
        yield
    finally:
        lock.release()


def images_to_tensors(split) -> TensorDataset:
    images = torch.as_tensor(split.data)
    # Fashion-MNIST holds (N, H, W) uint8, CIFAR-10 (N, H, W, C): both become (N, C, H, W) floats.
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)
    # (class_names, not split.classes: run as a script, this function travels to the workers by
    # value, and cloudpickle would take torch.classes, next to torch here, for a module to ship.)
    return NamedTensors(images.float().div(255), torch.as_tensor(split.targets, dtype=torch.int64),
                        classes=class_names(split))


@dataclass(frozen=True)
class DataInfo:
    """What the driver learns of the data before any worker starts."""
    sizes: tuple  # (train samples, test samples)
    sample_shape: tuple  # one image's (C, H, W)
    classes: list  # their names
    per_sample: bool  # read (decoded) per sample, not held in memory
    datasets: tuple = field(default=(), repr=False, compare=False)  # (train, test) as loaded
    fingerprint: Optional[str] = None  # the training set's list of samples (samples_fingerprint)


def check_data(cfg: Config) -> tuple[Config, DataInfo]:
    """Load (downloading if needed) on the driver, so a missing data set fails before any worker
    starts; the config with the data's normalisation, and what the driver learns of the data."""
    train_set, test_set = load_dataset(cfg)
    if len(train_set) // cfg.processes < cfg.micro_batch * cfg.accum_steps:
        raise ConfigError(f"--batch-size {cfg.batch_size} is larger than the {len(train_set)} "
                          f"training samples of {cfg.dataset} allow for one step")
    cfg = with_data_statistics(cfg, train_set)
    if cfg.dataset == "folder":  # the transforms now normalise: the same files, not listed again
        train_set.transform, test_set.transform = image_transforms(cfg)
    elif not isinstance(train_set, TensorDataset):
        train_set, test_set = load_dataset(cfg)
    info = DataInfo((len(train_set), len(test_set)), input_shape(cfg, train_set),
                    class_names(train_set), not isinstance(train_set, TensorDataset),
                    (train_set, test_set), samples_fingerprint(train_set))
    return cfg, info


def input_shape(cfg: Config, data) -> tuple:
    """One sample's (C, H, W) as the model sees it: at --image-size, to which every batch is resized
    on the worker's device (resized; a folder's transforms already give that size)."""
    shape = tuple(data[0][0].shape)
    return (shape[0], cfg.image_size, cfg.image_size) if cfg.image_size else shape


def resized(images: torch.Tensor, size: Optional[int]) -> torch.Tensor:
    """A batch of in-memory images at --image-size (bilinear; antialiased when shrinking), on the
    device that holds them: the data set itself stays at its own size in memory."""
    if not size or images.shape[-1] == size == images.shape[-2]:
        return images
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False,
                         antialias=size < images.shape[-1])


def samples_per_epoch(cfg: Config, train_size: int) -> int:
    """Samples trained per epoch: whole global batches.
    (ddp: each worker's equal shard, cut to whole steps.)"""
    if cfg.mode == "scratch":
        return train_size // cfg.batch_size * cfg.batch_size
    steps = train_size // cfg.processes // (cfg.micro_batch * cfg.accum_steps)
    return steps * cfg.batch_size


# ==================================================================================================
# Models: the lessons' LeNet and ResNet-18, and a small MLP.
# ==================================================================================================


class LeNet(nn.Module):
    """d2l's LeNet: conv 3x3 -> avgpool -> conv 5x5 -> avgpool -> 128 -> 10
    (800 features on 28x28)."""

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
    """ResNet basic block: two 3x3 convs with BatchNorm,
    plus a 1x1 conv shortcut when the shape changes."""

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
    """d2l's small-image ResNet-18:
    3x3 stride-1 stem, no max-pool, 4 stages of 2 blocks, global avg pool."""
    def stage(c_in, c_out, first):
        return nn.Sequential(Residual(c_in, c_out, stride=1 if first else 2),
                             Residual(c_out, c_out))
    return nn.Sequential(
        nn.Conv2d(in_channels, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
        stage(64, 64, True), stage(64, 128, False), stage(128, 256, False), stage(256, 512, False),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes))


# Your own model: one function, registered by name, that builds it from one sample's shape (C, H, W)
# and the number of classes, e.g.
#     @model("tiny")
#     def tiny(sample_shape, num_classes):
#         return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(sample_shape), num_classes))
# and --model tiny trains it. Any torchvision classification model works by name too (--model list).
MODELS: dict = {}


def model(name: str):
    """Register a model builder under --model NAME."""
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
    channels, size = sample_shape[0], sample_shape[-1]
    return nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, 256), nn.ReLU(),
                         nn.Linear(256, num_classes))


# torchvision's models by name; torchvision.NAME names one that a model of ray_dp's shadows (the
# lessons' small-image resnet18 is ray_dp's; torchvision.resnet18 is the ImageNet one).
TORCHVISION = "torchvision."


def torchvision_models() -> list:
    """The classification models torchvision builds by name
    (resnet50, mobilenet_v3_small, vit_b_16, ...)."""
    import torchvision.models
    return torchvision.models.list_models(module=torchvision.models)


def torchvision_names() -> list:
    """How --model names torchvision's models: bare, or torchvision.NAME where ray_dp has one."""
    return [TORCHVISION + name if name in MODELS else name for name in torchvision_models()]


# Built without their auxiliary classifiers, whose extra outputs only their own training recipes
# use (a training-mode forward would return a tuple); init_weights=True is torchvision's default,
# said so that it does not warn on every worker.
TORCHVISION_OPTIONS = {"googlenet": {"aux_logits": False, "init_weights": True},
                       "inception_v3": {"aux_logits": False, "init_weights": True}}


def build_model(name: str, sample_shape: tuple[int, ...],
                num_classes: int = NUM_CLASSES) -> nn.Module:
    if name in MODELS:
        return MODELS[name](tuple(sample_shape), num_classes)
    import torchvision.models
    name = name.removeprefix(TORCHVISION)
    net = torchvision.models.get_model(name, weights=None, num_classes=num_classes,
                                       **TORCHVISION_OPTIONS.get(name, {}))
    return with_input_channels(net, sample_shape[0])


def model_outline(name: str, sample_shape: tuple, num_classes: int = NUM_CLASSES) -> nn.Module:
    """The model without its memory, for questions about its shape: built on the meta device, or
    on the CPU for the few that compute their layout from tensors' values (RegNets)."""
    try:
        with torch.device("meta"):
            return build_model(name, sample_shape, num_classes)
    except NotImplementedError:  # "Cannot copy out of meta tensor"
        return build_model(name, sample_shape, num_classes)


@functools.lru_cache(maxsize=4)
def outline_for_any_size(name: str, channels: int, num_classes: int) -> nn.Module:
    """A torchvision model's outline in eval mode, asked about one image size after another (the
    bisection below): its layers depend on the channels, not on the images' size, so it is built
    once (half the time of each question for a DenseNet)."""
    return model_outline(name, (channels,), num_classes).eval()


@functools.lru_cache(maxsize=64)
def image_size_problem(name: str, sample_shape: tuple, num_classes: int) -> Optional[str]:
    """Why `name` cannot take images of sample_shape (C, H, W), in a line, or None: a forward pass
    of two images on the model's outline."""
    try:
        if name in MODELS:  # ray_dp's own size their layers to the images
            net = model_outline(name, sample_shape, num_classes).eval()
        else:
            net = outline_for_any_size(name, sample_shape[0], num_classes)
        device = next(net.parameters()).device
        with torch.no_grad():
            net(torch.zeros(2, *sample_shape, device=device))
    except Exception as exc:  # noqa: BLE001 - what the model says is the reason, whatever kind
        return first_line(exc)
    return None


def smallest_image_size(name: str, channels: int, num_classes: int, fails: int) -> Optional[int]:
    """The smallest square image size above `fails` that the model takes (by bisection, up to
    512 px; models that take one size only, like the ViTs' 224, are found too), or None."""
    def takes(size: int) -> bool:
        return image_size_problem(name, (channels, size, size), num_classes) is None
    low, high = fails, 512
    if not takes(high):
        return next((size for size in (224, 299, 384) if size > fails and takes(size)), None)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if takes(middle) else (middle, high)
    return high


def check_single_image_steps(cfg: Config, shape: tuple, num_classes: int) -> None:
    """A micro-batch of one image (at the most workers a run may have): BatchNorm cannot take the
    statistics of a single value per channel (a 1 x 1 map at the model's end) in training, unless
    --sync-bn takes them over every worker."""
    if cfg.eval_only or cfg.sync_bn or cfg.mode == "scratch" or cfg.micro_batch != 1:
        return
    net = model_outline(cfg.model, shape, num_classes).train()
    try:
        net(torch.zeros(1, *shape, device=next(net.parameters()).device))
    except Exception as exc:  # noqa: BLE001 - what the model says is the reason, whatever kind
        raise ConfigError(f"--model {cfg.model} cannot train on micro-batches of one image "
                          f"({first_line(exc)}): raise --batch-size to 2 per worker or more, or "
                          f"use --sync-bn") from None


def check_model_fits(cfg: Config, data: "DataInfo") -> None:
    """Every listed model on every data set either trains or is refused here, in one line, before
    any cluster starts: images too small for the model name the size that works and its flag."""
    shape = tuple(data.sample_shape)
    problem = image_size_problem(cfg.model, shape, len(data.classes))
    if problem is None:
        check_single_image_steps(cfg, shape, len(data.classes))
        return
    side = shape[-1]
    size = smallest_image_size(cfg.model, shape[0], len(data.classes), side)
    what = f"{cfg.dataset}'s images as given ({side} x {side} px)"
    if size is None:
        raise ConfigError(f"--model {cfg.model} cannot take {what} nor any size up to 512 px: "
                          f"{problem}")
    raise ConfigError(f"--model {cfg.model} cannot take {what}: {problem}; the smallest size it "
                      f"takes is {size} x {size} px: add --image-size {size}")


def with_input_channels(net: nn.Module, channels: int) -> nn.Module:
    """A torchvision model takes 3 channels: its first convolution is made anew for `channels`."""
    if channels == 3:
        return net
    for module in net.modules():
        for name, child in module.named_children():
            if isinstance(child, nn.Conv2d) and child.in_channels == 3:
                setattr(module, name, nn.Conv2d(channels, child.out_channels, child.kernel_size,
                                                child.stride, child.padding, child.dilation,
                                                child.groups, child.bias is not None))
                return net
    return net


def read_weights(path: str) -> dict:
    """A state_dict file (a ray-dp checkpoint's model too), loaded as data only (weights_only)."""
    try:
        source = io.BytesIO(read_stored(path)) if is_uri(path) else path
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for files it cannot read safely
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"--weights {path} is not a state_dict torch can load safely "
                          f"({reason[:160]})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--weights {path} is not a state_dict (names to tensors)")
    return state


def check_weights(cfg: Config, info: "DataInfo") -> Optional[str]:
    """--weights must fit the model: the header says what is kept and what is new."""
    if not cfg.weights:
        return None
    weights = read_weights(cfg.weights)
    kept, new = load_weights(build_model(cfg.model, info.sample_shape, len(info.classes)), weights)
    if not kept:
        twin = TORCHVISION + cfg.model
        fits_twin = twin in torchvision_names() and load_weights(
            build_model(twin, info.sample_shape, len(info.classes)), weights)[0]
        hint = f"; they fit torchvision's {cfg.model}: use --model {twin}" if fits_twin else ""
        raise ConfigError(f"--weights {cfg.weights} does not fit {cfg.model}: none of its "
                          f"{len(weights)} tensors has the name and shape of one of the "
                          f"model's{hint}")
    listed = ", ".join(new[:4]) + (f" and {len(new) - 4} more" if len(new) > 4 else "")
    return (f"--weights {cfg.weights}: kept {len(kept)} of the model's {len(kept) + len(new)} "
            f"tensors" + (f"; new (fine-tuned from scratch): {listed}" if new else ""))


def has_batchnorm(name: str) -> bool:
    net = model_outline(name, (3, 32, 32))
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in net.modules())


def load_weights(net: nn.Module, weights: dict) -> tuple[list, list]:
    """--weights: every tensor of the file whose name and shape fit the model is loaded; the others
    (a classifier for another number of classes, a first layer for other channels) stay new.
    Returns (kept names, new names)."""
    own = net.state_dict()
    kept = [k for k, v in weights.items() if k in own and own[k].shape == v.shape]
    net.load_state_dict({k: weights[k] for k in kept}, strict=False)
    return kept, [k for k in own if k not in kept]


# ==================================================================================================
# Distributed helpers: who this worker is, the collectives, SyncBatchNorm on CPU, the samplers.
# ==================================================================================================


@dataclass
class Worker:
    """Who and where this process is."""
    rank: int
    world: int
    device: torch.device
    node_rank: int = 0  # which machine: Ray numbers nodes by IP address

    @property
    def is_main(self) -> bool:
        return self.rank == 0  # the one rank that prints and writes

    @classmethod
    def from_ray(cls, cfg: Config) -> "Worker":
        torch.set_num_threads(cfg.threads)  # Ray sets OMP_NUM_THREADS=1 in workers
        ctx = ray.train.get_context()
        return cls(ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device(),
                   ctx.get_node_rank())


def bound_collectives(seconds: float) -> None:
    """--timeout for every collective. Ray's TorchConfig sets it when it makes the process group;
    Ray's local mode (torchrun) makes it with torch's default, so set it again here, the same on
    both."""
    if dist.is_available() and dist.is_initialized():
        dist.set_timeout(timedelta(seconds=seconds))


# glibc's mallopt(3) parameters (malloc.h), and how much freed memory a training process keeps
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
KEPT_FREED_BYTES = 1 << 30
# a user's own choice of glibc's malloc settings, which ray-dp leaves as they are
MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                   "MALLOC_MMAP_MAX_", "GLIBC_TUNABLES")
memory_kept = False


def one_arena(cfg: Config) -> dict:
    """The runtime environment of Ray's training workers: with --keep-freed-memory, glibc's one
    arena for every thread. Ray trains in a thread, and a thread's own arena serves each block over
    64 MiB from mmap whatever the thresholds say; the main arena keeps them (bench/memory.md)."""
    if not cfg.keep_freed_memory or any(name in os.environ
                                        for name in (*MALLOC_SETTINGS, "MALLOC_ARENA_MAX")):
        return {}
    return {"env_vars": {"MALLOC_ARENA_MAX": "1"}}


def keep_freed_memory() -> None:
    """Let this training process's allocator keep what a step frees for the next step. glibc's
    malloc returns each freed block above its mmap threshold (adaptive, at most 32 MB: one layer's
    activations of mobilenet_v3_small at 224 px are 51 MB) to the kernel, which zero-fills every
    page of it again at its first touch in the next step: a quarter of the CPU time goes to page
    faults (bench/bench.py --plain-only counts them). Kept, the process holds its peak memory
    between steps too. Before each fork (loader processes, which inherit the setting) the free
    pages go back to the kernel: a child would otherwise share them copy-on-write, and each page
    the parent then reuses would be copied. Left as it is: another C library than glibc, a glibc
    that refuses the threshold (before 2.26: at most 32 MB), and a user's own MALLOC_SETTINGS."""
    global memory_kept
    if memory_kept or any(name in os.environ for name in MALLOC_SETTINGS):
        return
    try:
        os.confstr("CS_GNU_LIBC_VERSION")
        libc = ctypes.CDLL(None)  # the C library this process runs on
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (ValueError, OSError, AttributeError):  # not glibc
        return
    # the trim threshold only with the mmap threshold: either one alone freezes the adaptive one
    if mallopt(M_MMAP_THRESHOLD, KEPT_FREED_BYTES) and mallopt(M_TRIM_THRESHOLD, KEPT_FREED_BYTES):
        os.register_at_fork(before=lambda: malloc_trim(0))
        memory_kept = True


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum `tensor` over workers in place (a no-op on one worker)."""
    if rank_and_world()[1] > 1:
        dist.all_reduce(tensor)
    return tensor


def broadcast_from_rank_0(tensors: list) -> None:
    """Rank 0's values of these tensors on every rank (in place; a collective): one broadcast per
    dtype, as each broadcast is a round of messages (a ResNet-50 holds 161 buffers)."""
    by_dtype: dict = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    for same in by_dtype.values():
        flat = torch.cat([tensor.reshape(-1) for tensor in same])
        dist.broadcast(flat, src=0)
        for tensor, values in zip(same, flat.split([tensor.numel() for tensor in same])):
            tensor.copy_(values.view_as(tensor))


def node_ranks(worker: Worker) -> list:
    """Every worker's node rank, in world-rank order (a collective: all ranks call it)."""
    ranks = torch.zeros(worker.world, dtype=torch.int64, device=worker.device)
    ranks[worker.rank] = worker.node_rank
    return all_reduce_sum(ranks).tolist()


class SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward pass all-reduces the gradient too: each rank's output
    depends on every rank's input, so each input's gradient is the sum over ranks of the outputs'
    gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class SyncBatchNormCPU(nn.BatchNorm2d):
    """BatchNorm whose batch statistics span all workers, for CPU/gloo, where torch's SyncBatchNorm
    refuses to run.

    Each rank computes its own count, mean and sum of squared deviations (M2) per channel, in fp32
    even under bf16 autocast; one all-reduce hands every rank all ranks' triples, and Chan's
    parallel formula combines them. (E[x^2] - mean^2 would cancel catastrophically: at an input
    mean of 5000, fp32 keeps no digit of a unit variance.) The all-reduce is autograd-aware, so the
    backward pass also sums the statistics' gradients across workers: the gradients equal
    BatchNorm's over the whole global batch.
    """

    def forward(self, x):
        rank, world = rank_and_world()
        if not self.training or world == 1:
            return super().forward(x)
        shape = (1, x.shape[1], 1, 1)
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 at least (fp64 stays)
        count, mean, m2 = rank_statistics(x32)
        # Rank r's row holds its [count, mean, M2]; the sum over ranks is then every rank's rows.
        rows = torch.zeros(world, 1 + 2 * x.shape[1], dtype=x32.dtype, device=x.device)
        rows = rows.index_copy(0, torch.tensor([rank], device=x.device),
                               torch.cat([count, mean, m2]).unsqueeze(0))
        rows = SumOverRanks.apply(rows)
        mean, var, n = combine_statistics(rows[:, 0], *rows[:, 1:].chunk(2, dim=1))
        with torch.no_grad():
            self.num_batches_tracked += 1
            self.running_mean.lerp_(mean.detach(), self.momentum)
            # unbiased, as BatchNorm keeps it
            self.running_var.lerp_(var.detach() * n / (n - 1), self.momentum)
        x_hat = (x32 - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        return (x_hat * self.weight.view(shape) + self.bias.view(shape)).to(x.dtype)


def rank_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's per-channel count, mean and sum of squared deviations from that mean
    (two passes)."""
    count = torch.full((1,), x.numel() / x.shape[1], dtype=x.dtype, device=x.device)
    mean = x.mean((0, 2, 3))
    m2 = (x - mean.view(1, -1, 1, 1)).square().sum((0, 2, 3))
    return count, mean, m2


def combine_statistics(counts, means, m2s) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chan et al.'s parallel variance: the global mean, the biased variance and the count, per
    channel, from each rank's (count, mean, M2). Deviations of means from the global mean, never
    x^2 sums."""
    n = counts.sum()
    mean = (counts[:, None] * means).sum(0) / n
    m2 = m2s.sum(0) + (counts[:, None] * (means - mean).square()).sum(0)
    return mean, m2 / n, n


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


def wrap_model(model: nn.Module, device: torch.device, mode: str = "ddp") -> nn.Module:
    """DDP on more than one worker; the bare model on one (nothing to synchronise).
    --mode dp: nn.DataParallel over every GPU Ray gave this single worker (the lesson's concise
    version)."""
    if mode == "dp":
        return nn.DataParallel(model)
    if rank_and_world()[1] == 1:
        return model
    # gradient_as_bucket_view: gradients live in DDP's all-reduce buckets,
    # saving a copy and its memory.
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
               gradient_as_bucket_view=True)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under torch.compile's and DDP's / DataParallel's wrappers
    (what checkpoints hold)."""
    model = getattr(model, "_orig_mod", model)
    return model.module if isinstance(model, (DDP, nn.DataParallel)) else model


def grad_sync(model: nn.Module, sync: bool):
    """DDP's no_sync() on accumulation micro-steps: their gradients stay local until the last one.
    (Looked for under torch.compile's wrapper too, which would otherwise hide it.)"""
    ddp = getattr(model, "_orig_mod", model)
    return ddp.no_sync() if isinstance(ddp, DDP) and not sync else contextlib.nullcontext()


def train_sampler(data: TensorDataset, rank: int, world: int, seed: int) -> "ResumableSampler":
    """This rank's shuffled shard.
    drop_last: every rank gets the same count, so the same number of steps."""
    return ResumableSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed,
                            drop_last=True)


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start an epoch part way: set_epoch(epoch, start) leaves out the
    first `start` entries of the epoch's permutation (the samples that the steps a checkpoint has
    done consumed, on however many workers: s steps of a global batch B are its first s x B) and
    shards the rest as DistributedSampler shards a whole epoch (train_sampler's: shuffled, whole
    shares only). Nothing skipped is read."""

    start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def __len__(self) -> int:
        if not self.start:
            return super().__len__()
        return (len(self.dataset) - self.start) // self.num_replicas

    def __iter__(self):
        if not self.start:
            return super().__iter__()
        order = torch.randperm(len(self.dataset),
                               generator=torch.Generator().manual_seed(self.seed + self.epoch))
        rest = order[self.start:self.start + len(self) * self.num_replicas]
        return iter(rest[self.rank::self.num_replicas].tolist())


class InMemoryBatches:
    """The fast path for data sets that fit in memory: the tensors (already on the worker's device)
    indexed by the sampler's micro-batches, with no loader processes and no per-sample collation.
    Iterates like a DataLoader: len() steps, a fresh pass per epoch in the sampler's order."""

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


# Random streams: (--seed, stream, ...) seeds each one (stream_seed). What must be equal on every
# rank (the model's initial weights, the data order) is drawn from --seed itself; what must differ
# gets a stream of its own, reproducible on a rerun and a resume: each sample's augmentation in
# each epoch, each rank's dropout in each step (a resume at any step draws what it would have).
AUGMENTATION_STREAM, RANK_STREAM = 1, 2


def seed_generators(seed: int, device: torch.device, every_gpu: bool = False) -> None:
    """The generators a training step draws from: the CPU's, and the GPU's it runs on, or with
    every_gpu (--mode dp: nn.DataParallel's replicas) every GPU's (not torch.manual_seed's every
    device kind: 0.14 ms a call, against 2 us)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        (torch.cuda.manual_seed_all if every_gpu else torch.cuda.manual_seed)(seed)


def stream_seed(seed: int, stream: int, *keys: int) -> int:
    """A seed for one random stream, independent of every other stream's (numpy's SeedSequence
    hashes the keys)."""
    return int(np.random.SeedSequence([seed, stream, *keys]).generate_state(1, np.uint64)[0])


class EpochKeys(torch.utils.data.Sampler):
    """A sampler's indices as (epoch, index) keys, for SampleStreams: the epoch rides along to the
    loader processes, whose own state lasts across epochs (persistent workers)."""

    def __init__(self, sampler: ResumableSampler):
        self.sampler, self.epoch = sampler, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.sampler.set_epoch(epoch, start)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self):
        return ((self.epoch, index) for index in self.sampler)


class SampleStreams(torch.utils.data.Dataset):
    """A per-sample data set whose random augmentation is each sample's own: sample i's crop and
    flip in epoch e come from a stream seeded by (--seed, e, i), whichever rank or loader process
    reads it and however many workers there are. N workers then see the augmentations one process
    would on the same global batch (not N copies of one rank's), and a rerun or a resume the same
    ones again. Only the CPU generator is seeded (torchvision's transforms draw from it), and
    restored after, so that the training process's own stream (dropout) goes on untouched."""

    def __init__(self, data, seed: int):
        self.data, self.seed = data, seed

    def __len__(self) -> int:
        return len(self.data)

    def __getitems__(self, keys: list) -> list:
        """A batch: a data set that can fetch its samples together (StoredImageFolder) does."""
        if hasattr(self.data, "prefetch"):
            self.data.prefetch([index for _, index in keys])
        return [self[key] for key in keys]

    def __getitem__(self, key: tuple):
        epoch, index = key
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(
                stream_seed(self.seed, AUGMENTATION_STREAM, epoch, index))
            return self.data[index]


def train_batches(data, cfg: Config, rank: int, world: int, device: torch.device):
    """This rank's micro-batches, the same ones in the same order on either path."""
    sampler = train_sampler(data, rank, world, cfg.seed)
    workers = loader_workers(cfg, data)
    if not workers and isinstance(data, TensorDataset):
        return InMemoryBatches(data, sampler, cfg.micro_batch)
    if not isinstance(data, TensorDataset):
        data, sampler = SampleStreams(data, cfg.seed), EpochKeys(sampler)
    # For data that must be read or decoded per sample: loader processes that live as long as the
    # run (persistent: not re-forked every epoch), pinned host memory so that copies to the GPU are
    # asynchronous.
    return DataLoader(data, batch_size=cfg.micro_batch, sampler=sampler, drop_last=True,
                      num_workers=workers, pin_memory=device.type == "cuda",
                      persistent_workers=workers > 0, worker_init_fn=leave_sigterm_to_the_rank)


def leave_sigterm_to_the_rank(loader_id: int) -> None:
    """A loader process ignores SIGTERM: a shutdown signals every process, and a loader that died
    of it would fail its rank before the rank saved. The rank's stop ends its loaders."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def loader_workers(cfg: Config, data) -> int:
    """--loader-workers, or by default none for data held in memory
    and 2 for data read per sample."""
    if cfg.loader_workers is not None:
        return cfg.loader_workers
    return 0 if isinstance(data, TensorDataset) else 2


def shard_indices(n: int, rank: int, world: int) -> torch.Tensor:
    """Every index exactly once across ranks (no padded duplicates, unlike DistributedSampler); a
    rank beyond the last sample gets none."""
    return torch.arange(min(rank, n), n, world)


# ==================================================================================================
# Train & evaluate (on every worker): one epoch, exact evaluation.
# ==================================================================================================


def autocast(cfg: Config, device: torch.device):
    """--amp: bf16 autocast for the forward pass and loss
    (the backward pass follows the same casts)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.amp)


def learning_rate(cfg: Config, epoch: int) -> float:
    """The epoch's learning rate, a pure function of the epoch (torch's CosineAnnealingLR, per
    epoch, to 0): nothing to save or restore, so a resumed run continues on exactly the same
    schedule."""
    if epoch < cfg.warmup_epochs:  # --warmup-epochs W: lr x 1/(W+1), 2/(W+1), ... then the schedule
        return cfg.lr * (epoch + 1) / (cfg.warmup_epochs + 1)
    if cfg.lr_schedule == "constant":
        return cfg.lr
    done = (epoch - cfg.warmup_epochs) / (cfg.epochs - cfg.warmup_epochs)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * done))


def build_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """SGD (with --momentum) or AdamW. --weight-decay applies to weights, not to biases or to
    norm layers' scales and shifts (the one-dimensional parameters), as the imagenet recipes do."""
    params = list(model.parameters())
    groups = params if not cfg.weight_decay else [
        {"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=0.0)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


# What a rank votes for at a log step (StepLog.step adds the votes up on every rank): a stop
# because this process got SIGTERM, a stop the driver asked for (SIGTERM to the driver), a
# checkpoint due by rank 0's clock.
SIGTERM_VOTE, DRIVER_VOTE, DUE_VOTE = "sigterm", "driver", "due"
VOTES = (SIGTERM_VOTE, DRIVER_VOTE, DUE_VOTE)
STOP_VOTES = {SIGTERM_VOTE, DRIVER_VOTE}


class GracefulStop:
    """SIGTERM while this process trains (what a reclaimed spot node or a drained one gets, a
    couple of minutes before it goes): the run saves at the next log step and stops, rather than
    losing the steps since its last checkpoint. Outside training, or at a second SIGTERM, what the
    signal did before (Ray's handler, or the default: exit)."""

    def __init__(self, before):
        self.before, self.asked, self.training = before, False, False
        self.on_ask = None  # the driver's: tell the workers

    def __call__(self, signum, frame) -> None:
        # the driver's on_ask: False when no worker trains now to hear it (waiting for workers)
        if self.training and not self.asked and (self.on_ask is None or self.on_ask()):
            self.asked = True
            # a write of its own, not print(): the signal may have come in the middle of one
            os.write(sys.__stdout__.fileno(), b"ray-dp: SIGTERM: saving a checkpoint at the next "
                     b"log step (--log-every) or the epoch's end, then stopping (a second SIGTERM "
                     b"stops at once)\n")
            return
        if callable(self.before):
            self.before(signum, frame)
        elif self.before == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        # SIG_IGN, or a handler not set from Python (None): ignored, as it was


def graceful_stop() -> Optional[GracefulStop]:
    """This process's GracefulStop, installed if this thread may (Python's signal handlers are the
    main thread's; Ray's workers train in another: graceful_sigterm_in_ray_worker installs
    theirs)."""
    handler = signal.getsignal(signal.SIGTERM)
    if hasattr(handler, "asked"):  # GracefulStop, or one pickled by value from a script
        return handler
    if threading.current_thread() is not threading.main_thread():
        return None
    stop = GracefulStop(handler)
    signal.signal(signal.SIGTERM, stop)
    return stop


class SaveRules:
    """When a worker saves within an epoch and whether it stops. --checkpoint-every STEPS: at
    those steps (the same on every rank, no vote needed); Nm: when rank 0's clock says so; a stop:
    when any rank got SIGTERM or the driver asked. Those two are votes that StepLog adds up, so
    that every rank saves and stops at the same step. Rank 0 also keeps the driver's board
    (ProgressBoard, under Ray) told how many steps it trained since the last checkpoint, and hears
    the driver's stop through its heartbeat (DriverLink)."""

    def __init__(self, cfg: Config, save=None, link: Optional["DriverLink"] = None,
                 stop: Optional[GracefulStop] = None):
        self.every_steps, self.every_seconds = checkpoint_interval(cfg.checkpoint_every)
        self.save_fn, self.stop = save, stop
        self.main = rank_and_world()[0] == 0
        self.link = link if self.main else None
        self.last_save, self.since = time.monotonic(), 0

    def votes(self, epoch_end: bool = False) -> list:
        """This rank's votes now (StepLog counts them at its log steps, train_epoch once more at
        the epoch's end; a stop asked for stays asked). At the epoch's end rank 0 asks the driver
        once more and waits for its answer: the heartbeat's last may be seconds old."""
        votes = [SIGTERM_VOTE] if self.stop is not None and self.stop.asked else []
        if epoch_end and self.link is not None:
            self.link.beat(timeout=10)
        if self.link is not None and self.link.asked:
            votes.append(DRIVER_VOTE)
        if (self.main and self.every_seconds
                and time.monotonic() - self.last_save >= self.every_seconds):
            votes.append(DUE_VOTE)
        return votes

    def due_at(self, step: int) -> bool:
        return bool(self.every_steps) and step % self.every_steps == 0

    def stepped(self, logged: bool) -> None:
        """A step trained. At log steps rank 0 tells the board, without waiting (a message costs
        about 0.5 ms here: not every step)."""
        self.since += 1
        if self.link is not None and logged:
            self.link.board.stepped.remote(self.since)

    def save(self, partial: dict) -> None:
        if self.save_fn:
            self.save_fn(partial)
        self.saved()

    def saved(self) -> None:
        self.last_save, self.since = time.monotonic(), 0
        if self.link is not None:
            self.link.board.stepped.remote(0)


class DriverLink:
    """Rank 0's line to the driver's ProgressBoard: a beat every BEAT_S from a thread of its own,
    so that the driver knows a worker trains however long a step takes, and whose answer says
    whether the driver asked for a stop (SIGTERM to the driver)."""

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
        """One beat; its answer (a stop asked?) kept. A board that is gone or slow: no answer."""
        try:
            self.asked = ray.get(self.board.beat.remote(), timeout=timeout) or self.asked
        except (ray.exceptions.RayError, TimeoutError):
            pass


class StepLog:
    """Per-step train loss for TensorBoard, averaged over workers every cfg.log_every steps, and
    rank 0's progress bar (Ray's tqdm: drawn by the driver, since a worker's output is not a
    terminal). The same all-reduce carries the ranks' votes (SaveRules.votes): a stop asked for,
    a checkpoint due by the clock, decided together."""

    def __init__(self, cfg: Config, epoch: int, steps: int, device: torch.device, progress: bool,
                 entries: Optional[list] = None, done: int = 0, pending: Optional[list] = None):
        self.cfg, self.epoch, self.steps = cfg, epoch, steps
        # [loss sum, samples] since last log, then the votes; from a mid-epoch checkpoint all
        # ranks' sums so far on rank 0 (pending), which the next log's all-reduce adds to the rest
        self.pending = torch.zeros(2 + len(VOTES), dtype=torch.float64, device=device)
        if pending:
            self.pending[:2] = torch.tensor(pending, dtype=torch.float64)
        # [global step, train loss averaged over all workers' samples]; a resumed epoch's so far
        self.entries = list(entries or [])
        tqdm = ray_tqdm() if progress else None
        self.bar = tqdm(total=steps, desc=f"epoch {epoch + 1}/{cfg.epochs}") if tqdm else None
        if self.bar and done:  # a resumed epoch's steps so far (Ray's tqdm takes no initial=)
            self.bar.update(done)
        self.start, self.done = time.perf_counter(), done
        self.first_step_at = None  # wall clock: the start-up breakdown's last mark

    def step(self, step: int, loss_sum: torch.Tensor, samples: int, votes=list) -> set:
        """The votes every rank agreed on at this step (none between two logs: votes(), this
        rank's, is asked for at log steps only; the teaching loop casts none)."""
        self.first_step_at = self.first_step_at or time.time()
        self.pending[:2] += torch.stack([loss_sum.double(),
                                         torch.tensor(samples, dtype=torch.float64)])
        agreed = set()
        # the same steps on every rank, so the all-reduces pair up
        if (step + 1) % self.cfg.log_every == 0:
            mine = votes()
            self.pending[2:] = torch.tensor([vote in mine for vote in VOTES], dtype=torch.float64)
            total = all_reduce_sum(self.pending.clone()).tolist()
            self.entries.append([self.epoch * self.steps + step + 1, total[0] / total[1]])
            agreed = {vote for vote, count in zip(VOTES, total[2:]) if count}
            self.pending.zero_()
        if self.bar:
            rate = ((step + 1 - self.done) * self.cfg.batch_size
                    / (time.perf_counter() - self.start))
            loss = f", loss {self.entries[-1][1]:.4f}" if self.entries else ""
            self.bar.set_description(f"epoch {self.epoch + 1}/{self.cfg.epochs}{loss}, "
                                     f"{rate:.0f} samples/s")
            self.bar.update(1)
        return agreed

    def close(self) -> list:
        if self.bar:
            self.bar.close()
        return self.entries


def train_epoch(model, optimizer, batches, cfg: Config, device: torch.device, epoch: int,
                progress: bool = False, rules: Optional["SaveRules"] = None,
                partial: Optional[dict] = None) -> dict:
    """One pass over this worker's shard (`train_batches`), or the rest of one from a mid-epoch
    checkpoint (partial: what its steps so far added up to); returns the train loss averaged over
    ALL workers' samples. rules: when to save within the epoch (every rank calls rules.save
    at the same steps) and whether to stop; the epoch's metrics then say where it stopped."""
    rules = rules or SaveRules(cfg)
    partial = partial or {"step": 0, "samples_done": 0, "loss_sum": 0.0, "samples": 0,
                          "step_log": []}
    rank = rank_and_world()[0]
    model.train()
    for group in optimizer.param_groups:
        group["lr"] = learning_rate(cfg, epoch)
    # a new shuffle each epoch, the same one on every rank; from a mid-epoch checkpoint, the rest
    batches.sampler.set_epoch(epoch, partial["samples_done"])
    first = partial["step"]
    # every rank gets the same count: no rank waits on a missing all-reduce
    steps = first + len(batches) // cfg.accum_steps
    global_batch = cfg.micro_batch * cfg.accum_steps * rank_and_world()[1]
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    log = StepLog(cfg, epoch, steps, device, progress, partial["step_log"], first,
                  partial.get("pending") if rank == 0 else None)
    micro_batches = iter(batches)
    data_seconds, start, stopped = 0.0, time.perf_counter(), None
    saves, save_seconds = 0, 0.0  # the checkpoints within this epoch, and their time
    for step in range(first, steps):
        # this rank's own dropout (and other in-model randomness) for this step: a function of
        # (seed, rank, epoch, step), so that a run resumed at any step draws what it would have
        seed_generators(stream_seed(cfg.seed, RANK_STREAM, rank, epoch, step), device,
                        every_gpu=cfg.mode == "dp")
        step_loss, waited = train_step(model, optimizer, micro_batches, cfg, device)
        data_seconds += waited
        loss_sum += step_loss
        agreed = log.step(step, step_loss, cfg.micro_batch * cfg.accum_steps, rules.votes)
        rules.stepped(logged=(step + 1) % cfg.log_every == 0)
        if step + 1 < steps and (rules.due_at(step + 1) or agreed):
            tic = time.perf_counter()
            # the epoch's losses so far, and those since the last log (TensorBoard's next point)
            totals = all_reduce_sum(torch.cat([torch.stack([loss_sum, torch.tensor(
                (step + 1 - first) * cfg.micro_batch * cfg.accum_steps, dtype=torch.float64,
                device=device)]), log.pending[:2]])).tolist()
            rules.save({"epoch": epoch, "step": step + 1, "samples_done": partial["samples_done"]
                        + (step + 1 - first) * global_batch,
                        "loss_sum": partial["loss_sum"] + totals[0],
                        "samples": partial["samples"] + int(totals[1]),
                        "step_log": list(log.entries), "pending": totals[2:], "steps": steps})
            saves, save_seconds = saves + 1, save_seconds + time.perf_counter() - tic
        if agreed & STOP_VOTES:
            stopped, stopped_by = step + 1, sorted(agreed & STOP_VOTES)
            break
    seconds = time.perf_counter() - start
    trained = ((stopped or steps) - first) * cfg.accum_steps * cfg.micro_batch
    # the epoch's totals, and the votes once more: an epoch shorter than --log-every has no log step
    mine = rules.votes(epoch_end=True) if not stopped else []
    totals = all_reduce_sum(torch.tensor([loss_sum.item(), trained, *[v in mine for v in VOTES]],
                                         dtype=torch.float64, device=device)).tolist()
    if not stopped and (asked := {v for v, n in zip(VOTES, totals[2:]) if n} & STOP_VOTES):
        stopped, stopped_by = steps, sorted(asked)
    samples = partial["samples"] + int(totals[1])
    metrics = epoch_metrics((partial["loss_sum"] + totals[0]), samples,
                            optimizer.param_groups[0]["lr"], seconds, data_seconds, log,
                            trained=samples - partial["samples"], checkpoints_within=saves,
                            checkpoint_seconds=save_seconds,
                            **({"resumed_at_step": first} if first else {}))
    return ({**metrics, "stopped_at_step": stopped, "steps": steps, "stopped_by": stopped_by}
            if stopped else metrics)


def train_step(model, optimizer, micro_batches, cfg: Config, device: torch.device) -> tuple:
    """One optimizer step over --accum-steps micro-batches: (the loss summed over this rank's
    samples, the seconds spent waiting for them)."""
    step_loss = torch.zeros((), dtype=torch.float64, device=device)
    data_seconds = 0.0
    for micro in range(cfg.accum_steps):
        tic = time.perf_counter()
        x, y = next(micro_batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        x = resized(x, cfg.image_size)  # data held in memory; a folder's come at their size
        data_seconds += time.perf_counter() - tic
        last = micro == cfg.accum_steps - 1
        with grad_sync(model, sync=last), autocast(cfg, device):
            loss = F.cross_entropy(model(x), y, label_smoothing=cfg.label_smoothing)
            # Dividing by K makes K accumulated micro-batches one mean over the whole step's
            # samples.
            (loss / cfg.accum_steps).backward()
        step_loss += loss.detach() * len(y)
    if cfg.clip_grad_norm:  # after the last backward's all-reduce: every rank clips the same
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return step_loss, data_seconds


def epoch_metrics(loss_sum: float, samples: int, lr: float, seconds: float, data_seconds: float,
                  log: StepLog, trained: Optional[int] = None, **more) -> dict:
    """An epoch's training metrics, the same keys in both modes: the loss averaged over all workers'
    samples, the learning rate, the samples trained, the time, throughput (of the samples trained
    in these seconds: an epoch resumed mid-way trained `trained` of them), time waiting for data,
    and the per-step losses for TensorBoard."""
    return {"train_loss": loss_sum / samples, "lr": lr, "train_samples": samples,
            "epoch_seconds": seconds,
            "samples_per_second": (samples if trained is None else trained) / seconds,
            "data_seconds": data_seconds, "first_step_at": log.first_step_at,
            "step_log": log.close(), **more}


@torch.no_grad()
def evaluate(net, data, device: torch.device, batch_size: int = 1000, details: bool = False,
             num_classes: int = NUM_CLASSES, workers: int = 0,
             image_size: Optional[int] = None) -> dict:
    """Exact test metrics: each worker scores its own disjoint shard, then ONE all-reduce adds up
    [loss sum, confusion matrix] (and, with details, every sample's prediction at its own index).

    net maps images to logits: a bare module in eval mode (see `inference`) or the teaching mode's
    lenet. data: tensors in memory, or a data set read per sample (by `workers` loader processes).
    """
    rank, world = rank_and_world()
    loss_sum = torch.zeros(1, dtype=torch.float64, device=device)
    # [true, predicted]
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.float64, device=device)
    # class, prob
    predictions = torch.zeros(len(data) if details else 0, 2, dtype=torch.float64, device=device)
    indices = shard_indices(len(data), rank, world)
    for index, x, y in eval_batches(data, indices, batch_size, workers):
        x, y = resized(x.to(device), image_size), y.to(device)
        logits = net(x)
        loss_sum += F.cross_entropy(logits, y, reduction="sum")
        probability, predicted = logits.softmax(1).max(1)
        confusion.index_put_((y, predicted), torch.ones_like(y, dtype=torch.float64),
                             accumulate=True)
        if details:  # other ranks leave these rows at 0, so the sum is each rank's own rows
            predictions[index.to(device)] = torch.stack(
                [predicted.double(), probability.double()], 1)
    totals = all_reduce_sum(torch.cat([loss_sum, confusion.flatten(), predictions.flatten()]))
    confusion = totals[1:1 + num_classes ** 2].view(num_classes, num_classes)
    count = confusion.sum().item()
    metrics = {"test_loss": totals[0].item() / count, "test_acc": confusion.trace().item() / count,
               "test_count": int(count)}
    if details:
        metrics["confusion"] = confusion.long().tolist()
        metrics["predictions"] = totals[1 + num_classes ** 2:].view(-1, 2).tolist()
    return metrics


def eval_batches(data, indices: torch.Tensor, batch_size: int, workers: int):
    """(indices, images, labels) of this rank's shard, in order:
    indexed in memory, or read per sample."""
    if isinstance(data, TensorDataset):
        images, labels = data.tensors
        for index in indices.split(batch_size):
            yield index, images[index], labels[index]
        return
    loader = DataLoader(Subset(data, indices.tolist()), batch_size=batch_size, num_workers=workers,
                        worker_init_fn=leave_sigterm_to_the_rank)
    for index, (images, labels) in zip(indices.split(batch_size), loader):
        yield index, images, labels


def evaluate_as_saved(model: nn.Module, test_set, cfg: Config, device: torch.device,
                      num_classes: int = NUM_CLASSES) -> dict:
    """Score the model that the checkpoint will hold. Without SyncBatchNorm each rank's BatchNorm
    running statistics drift apart (DDP broadcasts rank 0's only at the start of a forward); rank 0
    saves its own, so every rank evaluates with those."""
    if rank_and_world()[1] > 1:
        broadcast_from_rank_0(list(unwrap(model).buffers()))
    with inference(model) as net, autocast(cfg, device):
        return evaluate(net, test_set, device, eval_batch_size(test_set), num_classes=num_classes,
                        workers=loader_workers(cfg, test_set), image_size=cfg.image_size)


def eval_batch_size(data) -> int:
    """In memory, large batches cost nothing; decoded images (224 x 224 x 3 floats) do."""
    return 1000 if isinstance(data, TensorDataset) else 64


@contextlib.contextmanager
def inference(model: nn.Module):
    """The bare module in eval mode:
    DDP's own forward would sync buffers (a collective) on every batch."""
    net = unwrap(model).eval()
    try:
        yield net
    finally:
        net.train()


def cuda_fast_paths(cfg: Config, train_set: TensorDataset, test_set: TensorDataset,
                    device: torch.device) -> tuple[TensorDataset, TensorDataset]:
    # Fixed input shapes: let cuDNN pick its fastest kernels. (Imported by name: run as a script,
    # this function travels to the workers by value, and cloudpickle cannot ship
    # torch.backends.cudnn.)
    importlib.import_module("torch.backends.cudnn").benchmark = True
    # The whole (small) data set on the GPU once: batches are then indexed there, no host copies.
    # (Not the training set that loader processes read: they need it in host memory.)
    if isinstance(test_set, TensorDataset):
        test_set = TensorDataset(*(t.to(device) for t in test_set.tensors))
    if isinstance(train_set, TensorDataset) and not loader_workers(cfg, train_set):
        train_set = TensorDataset(*(t.to(device) for t in train_set.tensors))
    return train_set, test_set


def on_device(model: nn.Module, device: torch.device, name: str) -> nn.Module:
    """The model on its device, its 4-d weights in NHWC (channels_last): the layout convolutions run
    fastest in, on CPU (oneDNN: ray-dp's training step on mobilenet_v3_small at 224 px took 0.66 of
    the time it took in NCHW, bench/bench.py --step-only) as on GPU (tensor cores skip layout
    transposes), except the LeNet's few channels on GPU (tensor-core kernels want multiples of 8).
    Inputs stay NCHW: the first convolution converts them."""
    if device.type == "cuda" and name == "lenet":
        return model.to(device)
    return model.to(device, memory_format=torch.channels_last)


# ==================================================================================================
# Checkpoints: rank 0 saves the unwrapped model; a run directory and what a rerun may change.
# ==================================================================================================


CHECKPOINT_FILE = "checkpoint.pt"


# Epochs are numbered from 1 wherever a user reads them (the console, checkpoint_epoch_NNN, a
# checkpoint's and result.json's "epoch", TensorBoard): the checkpoint of epoch 3 is the state after
# 3 epochs. Checkpoints before format 2 counted from 0 (load_checkpoint renumbers them); the loops
# count from 0 internally (seeds, the schedule), as they always did.
CHECKPOINT_FORMAT = 2


def checkpoint_dir_name(epoch: int, step: int = 0) -> str:
    """checkpoint_epoch_003: after epoch 3; checkpoint_epoch_003_step_000040: after 40 steps of
    it."""
    return f"checkpoint_epoch_{epoch:03d}" + (f"_step_{step:06d}" if step else "")


CHECKPOINT_DIR = re.compile(r"checkpoint_epoch_(\d+)(?:_step_(\d+))?")


def checkpoint_order(name: str) -> Optional[tuple[int, int]]:
    """(epochs done, steps of the next one done) of a checkpoint directory's name, or None."""
    match = CHECKPOINT_DIR.fullmatch(name)
    if not match:
        return None
    epoch, step = int(match[1]), int(match[2] or 0)
    return (epoch - 1, step) if step else (epoch, 0)


def checkpoint_state(model_state: dict, optimizer_state: dict, epoch: int, cfg: Config,
                     history: list, classes: list, partial: Optional[dict] = None,
                     samples: Optional[str] = None) -> dict:
    """What a checkpoint holds after `epoch` epochs (and, mid-epoch, `partial`: the steps of the
    next one done, the samples they consumed and what their losses added up to); `classes`, the
    names of the model's outputs in order, is what an evaluation scores against (not what the test
    set's labels happen to reach); `samples`, the training list's fingerprint, what a resume
    must find again."""
    # contiguous, whatever layout trained it (on_device): what users' code and tools expect of a
    # state_dict (.view, .numpy(), safetensors)
    return {"model": {key: value.contiguous() for key, value in model_state.items()},
            "optimizer": optimizer_state, "epoch": epoch,
            "config": asdict(cfg), "history": list(history), "classes": list(classes),
            "format": CHECKPOINT_FORMAT, **({"partial": partial} if partial else {}),
            **({"samples": samples} if samples else {})}


def renumbered(record: dict) -> dict:
    """A checkpoint (epoch, history) or a result.json (final, epochs) from before format 2, whose
    epochs counted from 0, numbered as today's."""
    if record.get("format", 1) >= 2:
        return record

    def later(metrics):
        return ({**metrics, "epoch": metrics["epoch"] + 1}
                if isinstance(metrics, dict) and isinstance(metrics.get("epoch"), int) else metrics)
    renamed = {key: [later(m) for m in record[key]] for key in ("history", "epochs")
               if isinstance(record.get(key), list)}
    if isinstance(record.get("epoch"), int):
        renamed["epoch"] = record["epoch"] + 1
    if isinstance(record.get("final"), dict):
        renamed["final"] = later(record["final"])
    return {**record, **renamed, "format": CHECKPOINT_FORMAT}


def load_checkpoint(path: str) -> dict:
    """The one reader of checkpoint files, local or in cloud storage (s3://...): one clear sentence
    for a file that is not a readable ray-dp checkpoint."""
    try:
        source = io.BytesIO(read_stored(str(path))) if is_uri(str(path)) else path
        # weights_only: a checkpoint is data (tensors, numbers, strings), never code to run.
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many kinds for truncated, corrupt or foreign files
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{path} is not a readable checkpoint ({reason[:200]})") from None
    if not isinstance(state, dict) or not {"model", "config"} <= state.keys():
        raise ConfigError(f"{path} is not a ray-dp checkpoint (it has no model and config)")
    config = state["config"]
    if not (isinstance(config, dict) and isinstance(config.get("model"), str)
            and isinstance(config.get("dataset"), str)):
        raise ConfigError(f"{path} is not a ray-dp checkpoint (its config names no model and "
                          f"data set)")
    return renumbered(state)


def checkpoint_file(path: str) -> str:
    """The checkpoint file that PATH means, local or a URI: the file itself, DIR/checkpoint.pt, or
    a run's last epoch."""
    if is_uri(path):
        check_store("eval-only", path)
    kind = stored_type(path)
    if kind == "none":
        raise ConfigError(f"--eval-only {path} does not exist")
    full = path.rstrip("/") if is_uri(path) else os.path.abspath(path)
    if kind == "file":
        return full
    if stored_type(f"{full}/{CHECKPOINT_FILE}") == "file":
        return f"{full}/{CHECKPOINT_FILE}"
    try:
        latest = latest_committed(full)  # the last one whole: not one cut short
    except BrokenSnapshot as exc:
        raise ConfigError(f"--eval-only {path}: {exc.fact}; if its run is still training, try "
                          f"again, or --eval-only one of its checkpoint_epoch_* directories"
                          ) from None
    if latest is None:
        raise ConfigError(f"--eval-only {path} holds no checkpoint ({CHECKPOINT_FILE} or "
                          f"checkpoint_epoch_*/{CHECKPOINT_FILE})")
    return latest if is_uri(latest) else str(Path(latest).resolve())


def epoch_checkpoints(run_dir: str) -> list[str]:
    """A run's checkpoint files (local or a URI) in the order they were trained, mid-epoch ones
    included: by number, since as text epoch 1000 sorts before 999."""
    from pyarrow import fs
    run_dir = str(run_dir)
    storage, path = files_at(run_dir)
    found = {}
    for info in storage.get_file_info(fs.FileSelector(path, allow_not_found=True)):
        order = checkpoint_order(info.base_name)
        if order and info.type == fs.FileType.Directory:
            found[order] = f"{info.path}/{CHECKPOINT_FILE}"
    epochs = sorted(found)
    kinds = storage.get_file_info([found[epoch] for epoch in epochs])
    return [f"{run_dir.rstrip('/')}/{Path(found[epoch]).parent.name}/{CHECKPOINT_FILE}"
            for epoch, kind in zip(epochs, kinds) if kind.type == fs.FileType.File]


def latest_committed(run_dir: str) -> Optional[str]:
    """The checkpoint file a rerun resumes from, as its launcher will (resume_point)."""
    return resume_point(run_dir)[0]


def resume_point(run_dir: str) -> tuple[Optional[str], bool]:
    """The checkpoint file a rerun resumes from, as its launcher will, and whether Ray listed it.
    Under torchrun, which lists none (a Ray snapshot there is an earlier Ray run's, stale once
    torchrun trained on), the highest epoch written (atomically). Under Ray, the latest one Ray
    reported (its snapshot names it), or where Ray lists none, the highest epoch written, which
    the driver hands Ray's workers (Resume.unlisted)."""
    state = None if under_torchrun() else ray_snapshot(run_dir)
    if state is None:
        files = epoch_checkpoints(run_dir)
        return (files[-1] if files else None), False
    # as Ray resumes: from the latest reported, not the last listed (the list is in keep_score's
    # order), and from none if it names none
    latest = state.get("latest_checkpoint_result")
    return (f"{run_dir}/{latest['checkpoint_dir_name']}/{CHECKPOINT_FILE}" if latest else None,
            True)


def write_json(path: str, data: dict) -> None:
    """result.json beside the run's checkpoints, in cloud storage too."""
    write_stored(path, json.dumps(data, indent=2).encode())


def write_stored(path: str, data: bytes) -> None:
    """A whole file, local (write_atomically) or in object storage, which writes the whole object
    or nothing."""
    from pyarrow import fs
    storage, key = files_at(path)
    if isinstance(storage, fs.LocalFileSystem):  # a disk, file:// too
        write_atomically(key, data)
        return
    with storage.open_output_stream(key) as f:
        f.write(data)


def write_atomically(path: str, data: Union[str, bytes]) -> None:
    """Never a half-written file: write beside it, flush it to the disk, rename it over the file,
    flush the directory; a write that fails (a full disk) leaves the file as it was and nothing
    beside it. Why fsync: after a power loss a renamed file that was never flushed can be empty."""
    folder = os.path.dirname(os.path.abspath(path))
    made = [part for part in [folder, *Path(folder).parents] if not os.path.isdir(part)]
    os.makedirs(folder, exist_ok=True)
    try:
        with open(path + ".tmp", "wb" if isinstance(data, bytes) else "w",
                  **({} if isinstance(data, bytes) else {"newline": ""})) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path + ".tmp", path)
        for part in [folder, *(os.path.dirname(str(new)) for new in made)]:
            sync_directory(part)  # the file's entry, and those of the directories made for it
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path + ".tmp")
        raise


def sync_directory(folder: str) -> None:
    """A rename in `folder` made durable where the system lets this process flush a directory (a
    directory it may not read, a file system that flushes none: the write itself is done)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


RUN_MARKERS = (RAY_SNAPSHOT, "result.json", "recovery.json")


@dataclass(frozen=True)
class Resume:
    """What a rerun resumes from, as the driver found it: the epochs its checkpoint has done (0:
    none, the run starts from the beginning) and the classes its outputs were trained for (None: a
    checkpoint from before they were kept)."""
    done: int = 0
    classes: Optional[list] = None
    step: int = 0  # a mid-epoch checkpoint: the steps of epoch done + 1 it has done
    # the checkpoint's file where Ray lists none of the run's (torchrun wrote them, or Ray stopped
    # before it listed its first): Ray's workers would start over, so they are handed this one
    unlisted: Optional[str] = None
    samples: Optional[str] = None  # the fingerprint of the list of samples it trained on

    @property
    def resumes(self) -> bool:
        return bool(self.done or self.step)


def check_run_dir(cfg: Config, typed: Optional[set] = None) -> tuple[Config, Resume]:
    """Part of resolving a training run's configuration, before it is validated and before any
    cluster starts. --fresh: the directory it will delete must be this run's and nothing else. A
    rerun: the checkpoint it will resume from must load (a corrupt one is one sentence here, not a
    failure on every worker) and must have been trained the way this command says; what the command
    does not say (flags not typed, when `typed` is given) it takes from that checkpoint.
    Returns the config to run and what it resumes from."""
    from pyarrow import fs
    storage, run_dir = files_at(cfg.run_dir)
    kind = storage.get_file_info(run_dir).type
    if kind == fs.FileType.NotFound:
        return cfg, Resume()
    if kind != fs.FileType.Directory:
        raise ConfigError(f"{cfg.run_dir} is a file, not a run directory: choose another --name")
    if cfg.fresh:
        check_deletable(cfg, storage, run_dir)
        return cfg, Resume()
    try:
        latest, listed = resume_point(cfg.run_dir)
    except BrokenSnapshot as exc:
        raise ConfigError(f"run '{cfg.name}' cannot resume: {exc}") from None
    if listed:
        note_epochs_beyond_rays(cfg, latest)
    if latest is None:
        return cfg, Resume()
    try:
        state = load_checkpoint(latest)
    except ConfigError as exc:
        raise ConfigError(f"run '{cfg.name}' cannot resume: {exc}; "
                          f"rerun with --fresh to start over, "
                          f"or --eval-only an earlier checkpoint_epoch_* directory") from None
    stored = stored_config(state)
    cfg = follow_stored(cfg, stored, typed)
    check_same_training(cfg, stored)
    done = state["epoch"]
    if cfg.lr_schedule == "cosine" and stored["epochs"] != cfg.epochs and done < cfg.epochs:
        print(f"note: the cosine schedule now spans --epochs {cfg.epochs} (it was "
              f"{stored['epochs']}): epoch {done + 1} trains at lr "
              f"{learning_rate(cfg, done):.4g}", flush=True)
    return cfg, Resume(done, state.get("classes"), (state.get("partial") or {}).get("step", 0),
                       None if listed else latest, state.get("samples"))


def note_epochs_beyond_rays(cfg: Config, latest: Optional[str]) -> None:
    """Ray resumes from its own list. A checkpoint beyond its latest was written outside it (by
    torchrun, after this run's Ray ones) or cut short as Ray stopped (it copies checkpoints into
    place, not atomically): which one it is cannot be told, so say what happens to it."""
    files = epoch_checkpoints(cfg.run_dir)
    highest = Path(files[-1]).parent.name if files else None
    listed = Path(latest).parent.name if latest else None
    listed_order = checkpoint_order(listed) if listed else (-1, 0)  # None: a name not ray_dp's
    if highest and listed_order and checkpoint_order(highest) > listed_order:
        from_ = f"from {listed}" if listed else "from the start"
        print(f"note: run '{cfg.name}' has {highest}, beyond the latest "
              f"checkpoint Ray lists: Ray resumes {from_} and trains those epochs again (under "
              f"torchrun the run resumes from the highest epoch)", flush=True)


def stored_config(state: dict) -> dict:
    """A checkpoint's config as today's Config fields: a field the checkpoint predates has its
    default (what the run trained with, since the flag did not exist), one that no longer exists
    is left out; values as the Config holds them (a tuple comes back from a checkpoint as a
    list)."""
    saved = {k: tuple(v) if isinstance(v, list) else v for k, v in state["config"].items()
             if k in CONFIG_FIELDS}
    for name, value in saved.items():
        if not isinstance(value, FIELD_TYPES[name]):
            raise ConfigError(f"a checkpoint's config holds {name} = {value!r}, which is not a "
                              f"value of --{name.replace('_', '-')}: not a ray-dp checkpoint")
    return {**{f.name: f.default for f in fields(Config)}, **saved}


def follow_stored(cfg: Config, stored: dict, typed: Optional[set]) -> Config:
    """A rerun's untyped training settings and --epochs come from the run it resumes (so the
    shortest command that names the run resumes it as it was, whatever today's defaults are)."""
    if typed is None:
        return cfg
    adopt = {name: stored[name] for name in CONFIG_FIELDS if name in RERUN_ADOPTS - typed
             if stored[name] != getattr(cfg, name)}
    if stored["mode"] == "scratch":  # the lesson's defaults for what a rerun may change untyped
        adopt.update({name: value for name, value in LESSON_DEFAULTS.items()
                      if name not in typed | RERUN_ADOPTS and getattr(cfg, name) != value})
    shown = [as_flag(k, v) for k, v in adopt.items() if k in CLI_FIELDS]
    if shown:
        print(f"note: run '{cfg.name}' resumes with its own {', '.join(shown)}", flush=True)
    return replace(cfg, **adopt)


def check_same_training(cfg: Config, stored: dict) -> None:
    now = asdict(cfg)
    # scratch: plain SGD
    ignored = RERUN_MAY_CHANGE | ({"momentum"} if cfg.mode == "scratch" else set())
    changed = [name for name in now if name not in ignored
               and not same_setting(name, stored[name], now[name])]
    if changed:
        was = ", ".join(as_flag(name, stored[name]) for name in changed)
        says = ", ".join(as_flag(name, now[name]) for name in changed)
        raise ConfigError(f"run '{cfg.name}' was trained with {was}; this command says {says}: "
                          f"rerun it with its values to resume it, or start over with --fresh or "
                          f"a new --name")


def same_setting(name: str, stored, now) -> bool:
    """A stored setting and today's say the same: equal, or for --weights the same file however its
    path is spelt (a link, or a checkpoint from before paths were made absolute)."""
    if stored == now:
        return True
    if name == "weights" and stored and now and os.path.exists(stored) and os.path.exists(now):
        return os.path.samefile(stored, now)
    return False


def as_flag(name: str, value) -> str:
    """How a config value is typed: --lr 0.05, --amp; 'no --amp' for a switch that was off."""
    flag = name.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"no --{flag}"
    if value is None or value == "":  # not given: the flag's own default
        return f"no --{flag}"
    return f"--{flag} {value}"


def check_deletable(cfg: Config, storage, run_dir: str) -> None:
    """--fresh deletes <storage-path>/<name>/ only if it is a ray-dp run, inside --storage-path,
    and holds neither --logdir nor --data-dir (./runs/tensorboard is a directory of ./runs too)."""
    from pyarrow import fs
    names = {Path(info.path).name for info in storage.get_file_info(fs.FileSelector(run_dir))}
    if not (names & set(RUN_MARKERS)
            or any(checkpoint_order(n) for n in names)):
        raise ConfigError(f"--fresh: {cfg.run_dir} is not a ray-dp run (no checkpoints, no "
                          f"result.json); not deleting it")
    target = location(cfg.run_dir)
    if target[0] == "local" and os.path.dirname(target[1]) != location(cfg.storage_path)[1]:
        raise ConfigError(f"--fresh: {cfg.run_dir} leads to {target[1]}, outside --storage-path; "
                          f"not deleting it")
    for name in sorted((PATH_FIELDS | STORE_ACCESS.keys()) - {"storage_path"}):
        if (path := getattr(cfg, name)) and within(location(path), target):
            raise ConfigError(f"--fresh: {cfg.run_dir} holds --{name.replace('_', '-')} {path}; "
                              f"not deleting it")


def location(path: str) -> tuple:
    """(file system, path in it) of a local path or a URI, in one spelling: links resolved on a
    disk (a run directory that is a link may point anywhere), file:// as the disk it is."""
    storage, where = files_at(path)
    if storage.type_name == "local":
        return "local", os.path.realpath(where)
    return storage.type_name, where.rstrip("/")


def within(place: tuple, folder: tuple) -> bool:
    return place[0] == folder[0] and f"{place[1]}/".startswith(f"{folder[1]}/")


def start_fresh(cfg: Config) -> None:
    """--fresh, once every check has passed:
    delete the run's directory (check_run_dir vetted it)."""
    from pyarrow import fs
    storage, run_dir = files_at(cfg.run_dir)
    if cfg.fresh and storage.get_file_info(run_dir).type == fs.FileType.Directory:
        storage.delete_dir(run_dir)
        print(f"--fresh: deleted {cfg.run_dir}; starting run '{cfg.name}' over", flush=True)


# ==================================================================================================
# Monitoring: the console (one line per epoch and per event),
# TensorBoard, the recovery record, ray.log.
# ==================================================================================================


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{('es' if noun.endswith('s') else 's') * (count != 1)}"


def format_epoch(m: dict, epochs: int) -> str:
    resumed = f" (from step {m['resumed_at_step'] + 1})" if m.get("resumed_at_step") else ""
    return (f"epoch {m['epoch']}/{epochs}: train loss {m['train_loss']:.4f}, "
            f"test loss {m['test_loss']:.4f}, test acc {m['test_acc']:.4f}, "
            f"{m['epoch_seconds']:.1f} s{resumed}, {m['samples_per_second']:.0f} samples/s")


def format_summary(summary: dict, launcher: str = "") -> str:
    """The lessons' closing line:
    `test acc: 0.97, 0.3 sec/epoch on 2 workers (cpu)`, and what it survived."""
    world = summary["world_size"]
    line = (f"test acc: {summary['final']['test_acc']:.2f}, {summary['sec_per_epoch']:.1f} "
            f"sec/epoch on {plural(world, 'worker')} ({summary['device']}{launcher})")
    recovery = summary.get("recovery") or {}
    if recovery.get("failures"):
        sizes = [size for _, size in recovery["world_sizes"]]
        redone = ", ".join(map(str, recovery["epochs_redone"])) or "none"
        line += (f"; survived {plural(recovery['failures'], 'failure')}, "
                 f"{plural(recovery['restarts'], 'restart')} "
                 f"(workers {' -> '.join(map(str, sizes))}), epochs redone: {redone}")
    return line


def near_chance(cfg: Config, summary: dict) -> Optional[str]:
    """When a run ended where guessing would (10 classes: 0.10),
    what most likely happened and what to try."""
    final, acc = summary["final"], summary["final"]["test_acc"]
    # synthetic labels are random: chance is right
    if acc > 1.5 / NUM_CLASSES or cfg.dataset == "synthetic":
        return None
    steps = sum(m["train_samples"] for m in summary["epochs"]) // cfg.batch_size
    head = f"test acc {acc:.2f} is near chance (1/{NUM_CLASSES} = {1 / NUM_CLASSES:.2f})"
    if not math.isfinite(final["train_loss"]) or final["train_loss"] > 3 * math.log(NUM_CLASSES):
        return (f"{head}: the loss grew to {final['train_loss']:.3g}, so lr {cfg.lr} is too "
                f"large; try --lr {cfg.lr / 5:g}")
    if cfg.mode == "scratch":
        tips = ["more steps (more --epochs, or a smaller --batch-size)"]
        if cfg.lr_schedule != "constant" or cfg.lr < 0.2:
            tips.append("a constant lr of 0.2 to 0.3 (--lr 0.2 --lr-schedule constant)")
        return (f"{head}: the lesson's init (randn * 0.01) sits at chance for hundreds of steps "
                f"and this run took {steps} at lr {cfg.lr} ({cfg.lr_schedule}); "
                f"give it {' or '.join(tips)}")
    return (f"{head} after {steps} steps at lr {cfg.lr} ({cfg.lr_schedule}): try more --epochs "
            f"or another --lr (train loss {final['train_loss']:.3f}; ln 10 = 2.303 is the loss "
            f"of a uniform guess)")


EPOCH_SCALARS = {"train/loss": "train_loss", "train/lr": "lr", "test/loss": "test_loss",
                 "test/acc": "test_acc", "time/epoch_seconds": "epoch_seconds",
                 "time/samples_per_second": "samples_per_second",
                 "time/data_seconds": "data_seconds",
                 "comm/allreduce_seconds_per_step": "allreduce_seconds_per_step",
                 "comm/allreduce_busbw_gbps": "allreduce_busbw_gbps"}


class TensorBoardWriter:
    """An epoch's metrics (rank 0's report) as TensorBoard events in LOGDIR/<name>/: the per-step
    losses that ride along in it, the epoch's scalars, and at the last epoch the hyperparameters."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.writer = None

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
            final = {"hparam/test_acc": m["test_acc"], "hparam/test_loss": m["test_loss"],
                     "hparam/train_loss": m["train_loss"]}
            self.writer.add_hparams(hparams, final, run_name=".")  # ".": in this run's directory
        self.writer.flush()


class TensorBoardLogger(ray.train.UserCallback):
    """TensorBoardWriter in Ray Train's controller, which Ray places on the driver's node: the
    events land where the user started the run (and runs TensorBoard) even when rank 0 is on
    another node, with no shared file system needed."""

    def __init__(self, cfg: Config):
        self.tensorboard = TensorBoardWriter(cfg)

    def after_report(self, run_context, metrics: list, checkpoint) -> None:
        # rank 0's: the values are all-reduced, the same on every rank; a mid-epoch checkpoint's
        # report has no epoch's metrics yet (its steps' losses come with the epoch's)
        if "step" not in metrics[0]:
            self.tensorboard.write(metrics[0])


class ProgressBoard:
    """A Ray actor on the driver's side of a run: rank 0 tells it, at log steps and without
    waiting, how many steps it trained since the last checkpoint (what a failure then loses: the
    steps the restarted workers redo), and beats (DriverLink) to read whether the driver asked for
    a stop (SIGTERM to the driver). It outlives the worker groups of a run, so it can count across
    their restarts."""

    # seconds without a beat after which no worker trains (DriverLink.BEAT_S, several times over)
    HEARD_WITHIN = 10.0

    def __init__(self):
        self.since, self.redone, self.stop, self.heard_at = 0, 0, False, 0.0

    def stepped(self, since: int) -> None:
        self.since = since

    def beat(self) -> bool:
        self.heard_at = time.time()
        return self.stop

    def restarted(self) -> None:
        """A worker group starts: what the last one trained since its last checkpoint is redone."""
        self.redone, self.since = self.redone + self.since, 0

    def ask_stop(self) -> bool:
        """Whether rank 0 will hear of it: it beat within HEARD_WITHIN seconds."""
        self.stop = True
        return time.time() - self.heard_at < self.HEARD_WITHIN

    def steps_redone(self) -> int:
        return self.redone


def progress_board():
    """A ProgressBoard on the driver's node, which lives as long as the driver does."""
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0, scheduling_strategy=here)(ProgressBoard).remote()


def board_heard(board) -> bool:
    """The driver's SIGTERM, told to the board: whether rank 0 will hear of it (False: no worker
    trains now, or the board is gone; the signal then stops the driver at once)."""
    try:
        return ray.get(board.ask_stop.remote(), timeout=10)
    except (ray.exceptions.RayError, TimeoutError):
        return False


class RecoveryLog(ControllerCallback, WorkerGroupCallback, ReportCallback):
    """One console line per event of a run's life that is not an epoch: a worker or node lost,
    failure k of --max-failures, waiting for workers, a start that timed out, the worker group
    (re)started; and the same events as a record (recovery.json in the run's local directory) for
    result.json.

    Ray Train runs it in its controller, on the driver's node (Ray's internal callback hooks: the
    public UserCallback sees reports only). Its lines start with "ray-dp: ", which the console
    prints bare."""

    def __init__(self, cfg: Config, record_path: str, done: int = 0,
                 launched: Optional[dict] = None):
        self.cfg, self.record_path = cfg, record_path
        # the start-up breakdown: the driver's clocks, and the controller's (the first group's)
        self.launched, self.clock = launched or {}, {}
        self.events, self.failures, self.node_ips = [], 0, {}
        # the last epoch reported (or resumed from): 0 before the first
        self.done = done
        # the error last described: Ray passes it to ShuttingDown, then to Errored
        self.reported = None
        self.save_failed = False

    def after_controller_state_update(self, previous_state, current_state) -> None:
        kind, error, workers = state_facts(current_state)
        if error is not None and error is not self.reported:
            self.reported = error
            self.failed(error, stopping=kind == ERRORED_STATE)
        elif kind == SCHEDULING_STATE and self.events:
            waiting_for = plural(workers, "worker") if workers is not None else "the workers"
            self.add(f"waiting up to {self.cfg.start_timeout:g} s for {waiting_for} "
                     f"(--start-timeout)", event="waiting", workers=workers)

    def before_worker_group_start(self, worker_group_context) -> None:
        self.clock.setdefault("group", time.time())

    def before_init_train_context(self, workers) -> dict:
        self.clock.setdefault("actors", time.time())  # the workers' processes are up
        return {}

    def after_worker_group_start(self, worker_group) -> None:
        self.node_ips = worker_node_ips(worker_group)
        nodes = sorted(set(self.node_ips.values()))
        message = (f"{plural(len(self.node_ips), 'worker')} started on {', '.join(nodes)}"
                   if self.events else None)
        self.add(message, event="started", workers=len(self.node_ips), nodes=nodes)

    def after_report(self, training_report, metrics: list) -> None:
        # the epoch this report's checkpoint is in (mid-epoch: at metrics' step), or has ended
        epoch = metrics[0]["epoch"]
        if "startup" in metrics[0] and not any(e["event"] == "startup" for e in self.events):
            phases = startup_breakdown(self.launched, self.clock, metrics[0]["startup"])
            self.add(format_startup(phases), event="startup", seconds=phases)
        pending = [e for e in self.events if e["event"] == "failed" and "redone" not in e]
        for failure in pending:  # the first report after a restart: the epochs trained twice
            failure["redone"] = list(range(epoch, failure["during_epoch"] + 1))
            self.save()
        self.done = epoch - 1 if "step" in metrics[0] else epoch

    def failed(self, error, stopping: bool) -> None:
        controller = getattr(error, "controller_failure", None)
        if type(controller).__name__ == START_TIMEOUT_ERROR and not stopping:
            then = "trying again with what fits" if self.cfg.min_workers else "trying again"
            self.add(f"the workers did not all start within {self.cfg.start_timeout:g} s; {then}",
                     event="start_timeout")
            return
        # Ray charges --max-failures with the training's failures only (a worker group error that
        # is not a preemption); its own start-up errors and preemptions have limits of their own.
        counted = type(error).__name__ == WORKER_GROUP_ERROR and "preempt" not in str(error).lower()
        self.failures += counted
        limit = self.cfg.max_failures
        if not counted:
            then = ("stopping (Ray does not retry this error)" if stopping
                    else "Ray retries it (not counted ")
            then += "" if stopping else "against --max-failures)"
        elif stopping:
            then = f"failure {self.failures}, more than --max-failures {limit} allows: stopping"
        else:
            of = "no limit" if limit == -1 else f"{limit} allowed"
            then = (f"failure {self.failures} (--max-failures: {of}): restarting the workers from "
                    f"the last checkpoint")
        worker_failures = getattr(error, "worker_failures", {})
        what = (describe_worker_failures(worker_failures, self.node_ips)
                or first_line(controller or error))
        self.add(f"{what} during epoch {self.done + 1}; {then}", event="failed",
                 failure=self.failures, counted=counted, during_epoch=self.done + 1,
                 what=what, node_ips=self.node_ips,
                 errors={rank: first_line(e) for rank, e in worker_failures.items()})

    def add(self, message: Optional[str], **event) -> None:
        if message:
            print(f"ray-dp: {message}", flush=True)
        self.events.append({"at": time.time(), **event})
        self.save()

    def save(self) -> None:
        """The record is a convenience:
        a disk that refuses it must not stop the training it records."""
        try:
            write_json(self.record_path, {"events": self.events})
        except OSError as exc:
            if not self.save_failed:
                print(f"ray-dp: cannot write {self.record_path} ({exc}); "
                      f"training goes on without it", flush=True)
            self.save_failed = True


# A collective whose peer vanished: gloo's and NCCL's words for it.
PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|remote process exited"
                       r"|communicator was aborted")


def startup_breakdown(launched: dict, controller: dict, worker: dict) -> dict:
    """Seconds in each phase of a run's start, from the driver's clocks (launched), Ray Train's
    controller's and rank 0's (worker; on another node its clock may differ a little). A phase
    whose clocks are missing (a cluster already up; torchrun has no controller) is left out."""
    spans = [("imports", launched.get("started"), launched.get("imported")),
             ("checks", launched.get("imported"), launched.get("checked")),
             ("Ray", launched.get("checked"), launched.get("connected")),
             ("worker group", launched.get("fit"), controller.get("actors")),
             ("process group", controller.get("actors", launched.get("fit")), worker.get("loop")),
             ("data", worker.get("loop"), worker.get("data")),
             ("model", worker.get("data"), worker.get("model")),
             ("first step", worker.get("model"), worker.get("first_step"))]
    phases = {name: round(end - start, 2) for name, start, end in spans if start and end}
    begun = launched.get("started", launched.get("imported", launched.get("fit")))
    if begun and worker.get("first_step"):
        phases["total"] = round(worker["first_step"] - begun, 2)
    return phases


def format_startup(phases: dict) -> str:
    """start-up: imports 2.2 s, Ray 3.5 s, ..., first step 0.1 s: 14.1 s to the first step."""
    parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()
                      if name != "total")
    total = f": {phases['total']:.1f} s to the first step" if "total" in phases else ""
    return f"start-up: {parts}{total}"


def describe_worker_failures(failures: dict, node_ips: dict) -> str:
    """Which ranks were lost: those whose process or node died (Ray's health check failed), and
    when every error raised is a collective that lost its peer, the ranks that raised nothing (they
    could not). Otherwise the first error raised. The other ranks' errors follow from it; ray.log
    has them all."""
    stopped = [re.search(f"{SIGTERM_STOPPED}; saved .* and stopped", str(error))
               for error in failures.values()]
    if failures and all(stopped):  # every rank saved, then stopped: which one got it matters not
        return stopped[0][0]
    lost = {rank for rank, error in failures.items()
            if type(error).__name__ == HEALTH_CHECK_ERROR}
    if not lost and failures and all(PEER_LOST.search(str(error)) for error in failures.values()):
        lost = set(node_ips) - set(failures)
    if lost:
        where = ", ".join(f"rank {rank}{on_node(rank, node_ips, failures.get(rank, ''))}"
                          for rank in sorted(lost))
        memory = any(RAY_OOM_KILLED.search(str(failures.get(rank, ""))) for rank in lost)
        return (f"lost worker {where} "
                f"({'killed: out of memory' if memory else 'its process or node died'})")
    if failures:
        rank = min(failures)
        return (f"worker rank {rank}{on_node(rank, node_ips, failures[rank])} failed: "
                f"{first_line(failures[rank])}")
    return ""


def on_node(rank: int, node_ips: dict, error) -> str:
    ip = node_ips.get(rank) or node_ip_in(error)
    return f" on {ip}" if ip else ""


def node_ip_in(error) -> str:
    """The node address Ray's health-check error names (its worker's metadata), or ''."""
    found = re.search(r"node_ip='([^']+)'", str(error))
    return found[1] if found else ""


def first_line(error: BaseException) -> str:
    """An error in one line: a traceback's last line
    (which names its type), else 'Type: message'."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    # ray_dp's own errors by their names alone, however the module was run
    last = re.sub(r"^(__main__|ray_dp)\.(?=\w+Error\b)", "", lines[-1] if lines else "")
    if re.match(r"[\w.]+(Error|Exception|Interrupt)\b", last):
        return last[:400]
    return f"{type(error).__name__}: {last[:160]}" if last else type(error).__name__


def recovery_summary(record_path: str) -> dict:
    """result.json's account of failures:
    how many, the restarts, the world size over time, epochs redone."""
    try:
        with open(record_path) as f:
            events = json.load(f)["events"]
    except FileNotFoundError:  # torchrun: no Ray controller, no such events
        return {}
    starts = [e for e in events if e["event"] == "started"]
    return {"failures": sum(e["event"] == "failed" for e in events),
            "restarts": max(len(starts) - 1, 0),
            "world_sizes": [[e["at"], e["workers"]] for e in starts],
            "epochs_redone": [epoch for e in events for epoch in e.get("redone", [])],
            "events": events}


def describe_training_error(error: ray.train.TrainingFailedError, node_ips: dict) -> str:
    """One line for a run that failed for good (Ray's own message is the ranks' tracebacks)."""
    controller = getattr(error, "controller_failure", None)
    return (describe_worker_failures(getattr(error, "worker_failures", {}), node_ips)
            or first_line(controller or error))


class RayOutput:
    """What Ray forwards to this console from its processes. ray_dp's own lines (the training
    workers' and the controller's stdout) stay; Ray's and the libraries' chatter (every stderr
    line: tracebacks, gloo's errors, warnings; the raylet's notices) goes to ray.log in the run's
    local directory. Lines that start with "ray-dp: " are printed without Ray's process prefix."""

    def __init__(self):
        self.print_to_console, self.log_path = ray_printer(), None

    def route(self, batch: dict, ignore_prefix: bool = False) -> None:
        facts = forwarded_lines(batch)
        if facts is None:
            self.print_to_console(batch, ignore_prefix=ignore_prefix)
            return
        all_lines, chatter, source = facts
        if chatter:
            self.to_log(all_lines, source)
            return
        # In order, a run of lines at a time:
        # ours without Ray's prefix, the rest as Ray prints them.
        for ours, lines in itertools.groupby(all_lines,
                                             key=lambda line: str(line).startswith("ray-dp: ")):
            self.print_to_console({**batch, "lines": list(lines)},
                                  ignore_prefix=ours or ignore_prefix)

    def to_log(self, lines: list, source: str) -> None:
        if not self.log_path:
            return
        try:
            with open(self.log_path, "a") as f:
                f.writelines(f"{source} {line}\n" for line in lines)
        except OSError:  # a full disk: the run's own failure says so, in one line
            pass


_ray_output: Optional[RayOutput] = None  # one per driver process


def send_ray_output_to(log_path: Optional[str]) -> None:
    """From now on, Ray's forwarded chatter goes to log_path (a run's ray.log; None: nowhere)."""
    global _ray_output
    if _ray_output is None:
        _ray_output = RayOutput()
    if _ray_output.print_to_console:
        # again after each ray.init, which adds a printing handler of its own
        route_ray_prints(_ray_output.route)
    else:
        internal_note("ray._private.worker.print_to_stdstream", ROUTING_LOST)
    if log_path:
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
    _ray_output.log_path = log_path


def local_run_dir(cfg: Config) -> str:
    """Where the driver's node keeps a run's logs: the run directory, or for cloud storage beside
    its TensorBoard events (LOGDIR/<name>)."""
    return os.path.join(cfg.logdir, cfg.name) if is_uri(cfg.run_dir) else cfg.run_dir


class QuietControllerLogs(ControllerCallback):
    """quiet_ray_logs() in Ray Train's controller, which the job's worker_process_setup_hook does
    not reach (the controller is an actor with a runtime environment of its own): as it starts,
    since a run may end before any report (a rerun of a finished run, a failed start), and its
    shutdown is where the placement-group cleaner's traceback would come from."""

    def after_controller_start(self, train_run_context) -> None:
        quiet_ray_logs()


# ==================================================================================================
# Teaching mode (--mode scratch): d2l's "multi-GPU from scratch", one Ray worker per GPU of the
# lesson. Everything DDP does for us is written out by hand here, on purpose.
# ==================================================================================================


def init_lenet_params(seed: int, in_channels: int = 1, image_size: int = 28) -> list[torch.Tensor]:
    """The lesson's parameters: W ~ randn * 0.01, zero biases;
    the seed makes every worker's copy identical."""
    gen = torch.Generator().manual_seed(seed)
    side = ((image_size - 2) // 2 - 4) // 2  # 4 on 28x28: 50 x 4 x 4 = 800 features
    shapes = [(20, in_channels, 3, 3), (20,), (50, 20, 5, 5), (50,),
              (50 * side * side, 128), (128,), (128, 10), (10,)]
    return [torch.randn(s, generator=gen) * 0.01 if len(s) > 1 else torch.zeros(s) for s in shapes]


def lenet(X: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """The lesson's functional LeNet: conv 3x3, relu, avg-pool; conv 5x5, relu, avg-pool;
    2 dense layers."""
    h1 = F.avg_pool2d(F.relu(F.conv2d(X, params[0], params[1])), kernel_size=2, stride=2)
    h2 = F.avg_pool2d(F.relu(F.conv2d(h1, params[2], params[3])), kernel_size=2, stride=2)
    h3 = F.relu(h2.reshape(h2.shape[0], -1) @ params[4] + params[5])
    return h3 @ params[6] + params[7]


def get_params(params: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copy the parameters to this worker's device and track their gradients. (The convolutions'
    weights NHWC, as on_device places ray-dp's LeNet on a CPU: compare's rows then differ by the
    code the lesson writes by hand, not by memory layout.)"""
    nhwc = device.type == "cpu"
    return [p.clone().to(device, memory_format=torch.channels_last if nhwc and p.ndim == 4
                         else torch.preserve_format).requires_grad_() for p in params]


def split_batch(X: torch.Tensor, y: torch.Tensor, rank: int,
                world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's slice of the global mini-batch (the lesson hands slice i to GPU i)."""
    return X.chunk(world)[rank], y.chunk(world)[rank]


def allreduce_naive(buffer: torch.Tensor) -> None:
    """The lesson's algorithm: sum everything into rank 0 ("GPU 0"),
    then rank 0 sends the sum back to all."""
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


def _exchange(send: torch.Tensor, receive: torch.Tensor, right: int, left: int) -> None:
    """Send to the right neighbour while receiving from the left one
    (blocking both ways would deadlock)."""
    for request in (dist.isend(send, dst=right), dist.irecv(receive, src=left)):
        request.wait()


def allreduce_ring(buffer: torch.Tensor) -> None:
    """Ring all-reduce: reduce-scatter, then all-gather. Each rank sends 2(N-1)/N of the buffer in
    all, whatever N is, instead of rank 0 receiving and sending (N-1) whole buffers."""
    rank, world = rank_and_world()
    chunks = buffer.tensor_split(world)  # views into buffer; sizes differ by at most one element
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])  # tensor_split puts the larger chunks first
    # after step s, chunk (rank - s - 1) holds s + 2 ranks' contributions
    for step in range(world - 1):
        target = chunks[(rank - step - 1) % world]
        _exchange(chunks[(rank - step) % world], incoming[:target.numel()], right, left)
        target += incoming[:target.numel()]
    # Now rank r holds the complete sum of chunk (r + 1) % N:
    # pass the complete chunks round the ring.
    for step in range(world - 1):
        _exchange(chunks[(rank + 1 - step) % world], chunks[(rank - step) % world], right, left)


def allreduce_library(buffer: torch.Tensor) -> None:
    dist.all_reduce(buffer)  # what DDP calls (in buckets, overlapped with the backward pass)


ALLREDUCE = {"naive": allreduce_naive, "ring": allreduce_ring, "library": allreduce_library}


def allreduce(grads: list[torch.Tensor], algorithm: str) -> int:
    """Sum every worker's gradients, in place on every worker; returns the bytes reduced.

    The gradients are flattened into one buffer first: one message per step instead of eight small
    ones (a ring over tiny tensors is all latency)."""
    if rank_and_world()[1] == 1:
        return 0
    flat = torch.cat([g.reshape(-1) for g in grads])
    ALLREDUCE[algorithm](flat)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))
    return flat.numel() * flat.element_size()


def sgd(params: list[torch.Tensor], lr: float, batch_size: int) -> None:
    """The lesson's SGD. The gradients are SUMS over the global batch (sum loss, summed across
    workers): sum of gradients / global batch = mean gradient, the same step DDP takes with a mean
    loss."""
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad / batch_size
            p.grad.zero_()


def train_batch(X, y, params, lr: float, algorithm: str,
                worker: Worker) -> tuple[float, float, int]:
    """One global mini-batch: forward/backward on this worker's slice, all-reduce, SGD.
    Returns (sum loss of the slice, all-reduce seconds, bytes reduced)."""
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
    """Wait for queued GPU work, so that a clock read means what it says."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def scratch_train_epoch(params, data: TensorDataset, cfg: Config, worker: Worker, epoch: int,
                        progress: bool = False) -> dict:
    images, labels = data.tensors
    # Every worker draws the same global batches (same seed, same order) and keeps its own slice.
    order = torch.randperm(len(labels),
                           generator=torch.Generator().manual_seed(cfg.seed * 100_003 + epoch))
    steps = len(labels) // cfg.batch_size
    loss_sum, comm_seconds, nbytes, start = 0.0, 0.0, 0, time.perf_counter()
    log = StepLog(cfg, epoch, steps, worker.device, progress)
    for step in range(steps):
        index = order[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        loss, seconds, nbytes = train_batch(images[index], labels[index], params,
                                            learning_rate(cfg, epoch), cfg.allreduce, worker)
        loss_sum, comm_seconds = loss_sum + loss, comm_seconds + seconds
        log.step(step, torch.tensor(loss, device=worker.device), cfg.batch_size // worker.world)
    seconds = time.perf_counter() - start
    total_loss = all_reduce_sum(
        torch.tensor(loss_sum, dtype=torch.float64, device=worker.device)).item()
    per_step = comm_seconds / max(steps, 1)
    # NCCL-tests' "bus bandwidth": what each link carried, comparable across worker counts.
    busbw = 2 * (worker.world - 1) / worker.world * nbytes / per_step / 1e9 if nbytes else 0.0
    return epoch_metrics(total_loss, steps * cfg.batch_size, learning_rate(cfg, epoch), seconds,
                         0.0, log, allreduce_seconds_per_step=per_step, allreduce_bytes=nbytes,
                         allreduce_busbw_gbps=busbw)


# The same numbers as LeNet's state_dict, so checkpoints of both modes load into ray_dp.LeNet.
LENET_KEYS = ["features.0.weight", "features.0.bias", "features.3.weight", "features.3.bias",
              "classifier.0.weight", "classifier.0.bias",
              "classifier.2.weight", "classifier.2.bias"]


def params_to_state_dict(params: list[torch.Tensor]) -> dict:
    # The lesson multiplies X @ W for dense layers; nn.Linear stores W transposed.
    return {key: (p.detach().T if key.startswith("classifier") and p.ndim == 2
                  else p.detach()).cpu().clone()
            for key, p in zip(LENET_KEYS, params)}


def state_dict_to_params(state: dict) -> list[torch.Tensor]:
    return [state[key].T if key.startswith("classifier") and state[key].ndim == 2 else state[key]
            for key in LENET_KEYS]


# ==================================================================================================
# Inference (--eval-only): a saved model scored exactly on N workers,
# per class, with each prediction.
# ==================================================================================================


def eval_config(cfg: Config, typed: set) -> tuple[Config, dict]:
    """The config for evaluating --eval-only's checkpoint, and the checkpoint. What the checkpoint
    fixes (the model, the data it was trained on, the images as it saw them: option(eval=...))
    comes from its config; a typed training flag, or a typed value that contradicts the
    checkpoint, is an error rather than silently ignored."""
    path = checkpoint_file(cfg.eval_only)
    checkpoint = load_checkpoint(path)
    trained = stored_config(checkpoint)
    refused = [f"--{name.replace('_', '-')}" for name in CONFIG_FIELDS
               if name in typed & EVAL_REFUSES]
    if refused:
        are = "is a training flag and has" if len(refused) == 1 else "are training flags and have"
        raise ConfigError(f"{', '.join(refused)} {are} no effect with --eval-only")
    contradicting = [name for name in CONFIG_FIELDS if name in typed & EVAL_FIXED
                     and not same_setting(name, trained[name], getattr(cfg, name))]
    if contradicting:
        was = ", ".join(as_flag(name, trained[name]) for name in contradicting)
        says = ", ".join(as_flag(name, getattr(cfg, name)) for name in contradicting)
        raise ConfigError(f"the checkpoint holds a {trained['model']} trained on "
                          f"{trained['dataset']} with {was}; {says} contradicts it (drop it)")
    # A scratch-mode checkpoint is a LeNet state_dict too, so every checkpoint is evaluated the ddp
    # way; images as the model saw them in training (size, normalisation), whatever today's
    # defaults; bf16 autocast and the data's folder as in training unless typed.
    taken = {name: trained[name] for name in EVAL_FROM_CHECKPOINT
             if name in EVAL_FIXED or name not in typed}
    return replace(cfg, **taken, mode="ddp", eval_only=path), checkpoint


def checkpoint_classes(cfg: Config, checkpoint: dict, train_set, test_set) -> list:
    """The names of the checkpoint's outputs (a checkpoint from before they were kept: its training
    set's), refused in one line when the test set's own names or labels say otherwise: its labels
    would be scored against another class's output."""
    names = checkpoint.get("classes") or class_names(train_set)
    if getattr(test_set, "classes", None):
        check_same_classes(cfg, names, class_names(test_set), "evaluate it on")
    labels = labels_of(test_set)
    if labels and not 0 <= min(labels) <= max(labels) < len(names):
        raise ConfigError(f"{cfg.dataset}'s test labels run from {min(labels)} to {max(labels)}, "
                          f"but the checkpoint has {plural(len(names), 'class')} (0 to "
                          f"{len(names) - 1})")
    return names


def check_same_classes(cfg: Config, trained: list, found: list, then: str) -> None:
    """The data's classes are the ones the checkpoint's outputs were trained for, by name and order;
    else one line (the data's labels would train or score another class's output)."""
    if found != trained:
        where = f"--data-dir {cfg.data_dir}" if cfg.dataset == "folder" else cfg.dataset
        raise ConfigError(f"the checkpoint's classes are {', '.join(trained)}; {where} has "
                          f"{', '.join(found)}: {then} the data it was trained on")


def write_predictions(path: str, test_set, predictions: list, names: list) -> None:
    """--predict-out: every test sample's label and prediction, by number and name, with its
    probability; and, for images read from files, the file."""
    import csv
    files = [file for file, _ in test_set.samples] if hasattr(test_set, "samples") else None
    text = io.StringIO()
    writer = csv.writer(text)
    writer.writerow(["index", "label", "predicted", "probability", "label_name", "predicted_name"]
                    + (["path"] if files else []))
    for i, (label, (predicted, probability)) in enumerate(zip(labels_of(test_set), predictions)):
        writer.writerow([i, label, int(predicted), f"{probability:.6f}", names[label],
                         names[int(predicted)]] + ([files[i]] if files else []))
    write_stored(path, text.getvalue().encode())


def labels_of(data) -> list:
    """Every sample's label, without decoding a single image."""
    return data.tensors[1].tolist() if isinstance(data, TensorDataset) else list(data.targets)


def format_eval(metrics: dict, per_class: list, out: dict) -> str:
    lines = [f"test loss {metrics['test_loss']:.4f}, test acc {metrics['test_acc']:.4f} "
             f"({sum(c['correct'] for c in per_class)}/{metrics['test_count']}) "
             f"on {out['world_size']} workers ({out['device']})", "",
             "class  count  correct  acc     name"]
    lines += [f"{c['class']:>5}  {c['count']:>5}  {c['correct']:>7}  {c['acc']:.4f}  {c['name']}"
              for c in per_class]
    lines += ["", "confusion matrix (rows: true class, columns: predicted class)",
              "      " + "".join(f"{c:>6}" for c in range(len(per_class)))]
    lines += [f"{c:>6}" + "".join(f"{n:>6}" for n in row)
              for c, row in enumerate(metrics["confusion"])]
    return "\n".join(lines)


# ==================================================================================================
# Launch, the workers' side: one seam (a launcher) for Ray and torchrun, and what each worker runs.
# ==================================================================================================


@dataclass(frozen=True)
class LoopOptions:
    """What the driver hands every worker besides the config."""
    progress: bool = False  # draw rank 0's progress bar: someone watches this terminal
    # the workers are torchrun's processes (Ray Train's local mode), not Ray's
    torchrun: bool = False
    weights: Optional[object] = None  # --eval-only: the model's weights, in Ray's object store
    classes: tuple = ()  # --eval-only: the names of the model's outputs, from the checkpoint
    start_from: Optional[object] = None  # --weights: the file's tensors, in Ray's object store
    data: Optional[object] = None  # (train, test) held in memory, in Ray's object store
    launched: dict = field(default_factory=dict)  # the driver's clocks: the start-up breakdown
    board: Optional[object] = None  # Ray: the driver's ProgressBoard (steps since a checkpoint)
    # Ray: Resume.unlisted's state, in Ray's object store, for when Ray has no checkpoint to give
    resume_from: Optional[object] = None


class RayLauncher:
    """Workers that Ray Train started: Ray finds the run's latest checkpoint in storage, and its
    controller collects every report, commits rank 0's checkpoint and writes the TensorBoard events
    (TensorBoardLogger)."""

    def __init__(self, cfg: Config, worker: Worker, resume_from: Optional[object] = None):
        self.cfg, self.resume_from = cfg, resume_from

    def latest_checkpoint(self) -> Optional[dict]:
        """Ray's latest checkpoint of the run; where Ray has none, the one the driver chose for
        every rank (a run directory Ray never listed), else None."""
        checkpoint = ray.train.get_checkpoint()
        if checkpoint is None:
            return ray.get(self.resume_from) if self.resume_from is not None else None
        with checkpoint.as_directory() as directory:
            return load_checkpoint(os.path.join(directory, CHECKPOINT_FILE))

    def report(self, metrics: dict, state: Optional[dict], epoch: int, step: int = 0) -> None:
        """Every rank reports (a barrier); only rank 0 passes a checkpoint (state)."""
        dir_name = checkpoint_dir_name(epoch, step)
        if state is None:
            ray.train.report(metrics, checkpoint=None, checkpoint_dir_name=dir_name)
            return
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(state, os.path.join(tmp, CHECKPOINT_FILE))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=dir_name)


class TorchrunLauncher:
    """torchrun's processes (Ray Train's local mode): there is no controller, so rank 0 keeps the
    checkpoints in the run directory itself, where Ray would have, and writes the TensorBoard
    events."""

    def __init__(self, cfg: Config, worker: Worker, launched: Optional[dict] = None):
        self.cfg, self.worker, self.launched = cfg, worker, launched or {}
        self.tensorboard = TensorBoardWriter(cfg) if worker.is_main else None

    def latest_checkpoint(self) -> Optional[dict]:
        """Rank 0 reads the latest checkpoint (after its own --fresh) and hands every rank its
        contents: the ranks resume from one checkpoint at one epoch, shared file system or not."""
        state = None
        if self.worker.is_main:
            latest = latest_committed(self.cfg.run_dir)
            state = load_checkpoint(latest) if latest else None
        return from_rank_0(state, self.worker.device)

    def report(self, metrics: dict, state: Optional[dict], epoch: int, step: int = 0) -> None:
        if state is not None:
            save_checkpoint(self.cfg.run_dir, state, epoch, step)
        if step:  # within an epoch: the checkpoint only (Ray's local mode has no other use)
            return
        ray.train.report(metrics)  # local mode keeps the last metrics for the Result
        if self.tensorboard:
            self.tensorboard.write(metrics)
            if "startup" in metrics:
                phases = startup_breakdown(self.launched, {}, metrics["startup"])
                print(f"ray-dp: {format_startup(phases)}", flush=True)


def save_checkpoint(run_dir: str, state: dict, epoch: int, step: int = 0) -> None:
    """Rank 0's checkpoint of an epoch (or of `step` steps of it), where Ray would have committed
    it, whole or not at all (a crash or a full disk mid-write leaves no half one): renamed into
    place on a disk, one object in a bucket. Then, once it is durable (write_stored), the
    mid-epoch checkpoints before it go: a run keeps its epochs' and its last."""
    saved = io.BytesIO()
    torch.save(state, saved)
    name = checkpoint_dir_name(epoch, step)
    write_stored(os.path.join(run_dir, name, CHECKPOINT_FILE), saved.getvalue())
    storage, path = files_at(run_dir)
    for older in epoch_checkpoints(run_dir):
        folder = PurePosixPath(older).parent.name
        if folder != name and checkpoint_order(folder)[1]:
            storage.delete_dir(f"{path}/{folder}")


Launcher = Union[RayLauncher, TorchrunLauncher]


def worker_setup(loop_config: dict) -> tuple[Config, Worker, "Launcher", LoopOptions]:
    """Who this worker is,
    and the launcher that knows where its checkpoints are and where reports go."""
    cfg, options = loop_config["config"], loop_config["options"]
    worker = Worker.from_ray(cfg)
    if cfg.keep_freed_memory:
        keep_freed_memory()
    bound_collectives(cfg.timeout)
    if options.torchrun:
        # Each torchrun process resolved its own config, from what it saw of the run directory
        # (another machine may see none, or see it before rank 0's --fresh deleted it): rank 0's
        # is the run's. (Ray's workers all get the driver's.)
        cfg = from_rank_0(cfg, worker.device)
    launcher = (TorchrunLauncher(cfg, worker, options.launched) if options.torchrun
                else RayLauncher(cfg, worker, options.resume_from))
    return cfg, worker, launcher, options


def worker_data(cfg: Config, options: LoopOptions, worker: Worker) -> tuple:
    """(train, test) as the run decided them: the driver's copy from Ray's object store (data held
    in memory: loaded once, no files needed on the workers' nodes; the list of a folder's images,
    made once), under torchrun rank 0's list of a folder's images, else this worker loads them.
    Each rank then checks that its node holds every file of the list (check_node_holds)."""
    if options.data is not None:
        data = ray.get(options.data)
    elif options.torchrun and cfg.dataset == "folder":
        data = from_rank_0(load_dataset(cfg) if worker.is_main else None, worker.device)
    else:
        return load_dataset(cfg)
    check_node_holds(data, cfg, worker)
    return data


def check_node_holds(data: tuple, cfg: Config, worker: Worker) -> None:
    """A folder on each node's own disk: every rank's node holds each image of the run's list, else
    every rank stops with one line naming a node, a file and --data-dir; images that the list lacks
    are not trained (rank 0 says so, once). A bucket is the same for every node."""
    if cfg.dataset != "folder" or is_uri(cfg.data_dir):
        return
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset
    mine = []
    for split, listed in zip(("train", "val"), data):
        root = os.path.join(cfg.data_dir, split)
        here = {os.path.relpath(path, root) for path, _ in make_dataset(
            root, listed.class_to_idx, IMG_EXTENSIONS, allow_empty=True)}
        wanted = [os.path.relpath(path, listed.root) for path, _ in listed.samples]
        lacks = [f"{split}/{name}" for name in wanted if name not in here]
        mine.append((lacks[:1], len(lacks), len(here - set(wanted))))
    found = [(node_name(), mine)] * worker.world
    if worker.world > 1:
        dist.all_gather_object(found, (node_name(), mine))
    for rank, (node, splits) in enumerate(found):
        for first, lacks, _ in splits:
            if lacks:
                raise DataError(f"node {node} (rank {rank}) lacks {plural(lacks, 'image')} of the "
                                f"run's list in --data-dir {cfg.data_dir}, e.g. {first[0]}: copy "
                                f"the same folder to every node (cluster.yaml's file_mounts), or "
                                f"keep it in object storage (s3://...)")
    extra = {node: sum(more for *_, more in splits) for node, splits in found}
    if worker.is_main and any(extra.values()):
        node, more = max(extra.items(), key=lambda item: item[1])
        print(f"ray-dp: note: node {node} holds {plural(more, 'image')} in --data-dir "
              f"{cfg.data_dir} that the run's list does not: they are not trained", flush=True)


def node_name() -> str:
    """This node as Ray names it (its address), or its host name outside Ray."""
    import socket
    return ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()


def samples_fingerprint(data) -> Optional[str]:
    """A per-sample data set's list of samples (classes, and each file, relative to its folder,
    with its label) in 16 hex digits; None for data without such a list."""
    import hashlib
    try:
        root = os.fspath(data.root).rstrip("/")
        lines = [",".join(map(str, data.classes))] + [
            f"{os.fspath(path)[len(root) + 1:]}\t{label}" for path, label in data.samples]
    except (AttributeError, TypeError, ValueError):  # no such list, or one of another shape
        return None
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def starting_weights(cfg: Config, options: LoopOptions) -> dict:
    """--weights' tensors: from Ray's object store (no shared disk needed), or under torchrun, where
    there is none, from the file."""
    if options.start_from is not None:
        return ray.get(options.start_from)
    return read_weights(cfg.weights)


def resume(launcher: "Launcher") -> tuple["Start", Optional[dict]]:
    """Where the loop starts, and the checkpoint's state or None: both modes'."""
    state = launcher.latest_checkpoint()
    if state is None:
        return Start(), None
    return Start(state["epoch"], state["history"], state.get("partial")), state


def from_rank_0(value, device: torch.device):
    """Rank 0's value on every rank (a collective: every rank calls it); the value itself where
    there is one rank."""
    if rank_and_world()[1] == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=0, device=device)
    return shared[0]


def check_classes_agree(classes: list, device: torch.device) -> None:
    """Every rank's data holds rank 0's classes (per-sample data: each node reads its own folder);
    else every rank stops with the same error, rather than one waiting for the others forever."""
    differs = torch.tensor([from_rank_0(classes, device) != classes], dtype=torch.int64,
                           device=device)
    if all_reduce_sum(differs).item():
        raise DataError("the workers' data sets hold different classes: the same folder must be "
                        "on every node that trains (ray_dp.py doctor checks it)")


def run_epochs(cfg: Config, worker: Worker, launcher: "Launcher", start: "Start",
               train_fn, eval_fn, state_fn, marks: dict, rules: Optional[SaveRules] = None) -> dict:
    """The epoch loop both modes share: train, evaluate, print (rank 0), report + checkpoint
    (rank 0's). start: where the checkpoint left off (the index, from 0, of the first epoch to
    train, and the steps of it done). train_fn(epoch, partial). rules (--mode ddp): the
    checkpoints within an epoch, and the stop. marks: the wall clock when this worker's loop
    started, had its data, its model."""
    start_epoch, history = start.epoch, start.history
    if worker.is_main and start_epoch >= cfg.epochs:
        print(f"ray-dp: {finished_run(cfg, start_epoch)}", flush=True)
    elif worker.is_main and (start_epoch or start.partial):
        print(f"ray-dp: {start.describe(cfg, worker)}", flush=True)
    stopped = None
    for epoch in range(start_epoch, cfg.epochs):
        trained = train_fn(epoch, start.partial if epoch == start_epoch else None)
        stopped_at, steps = trained.pop("stopped_at_step", None), trained.pop("steps", None)
        by = trained.pop("stopped_by", [])
        if stopped_at is not None and stopped_at < steps:  # saved at that step (SaveRules)
            stopped = {"epoch": epoch + 1, "step": stopped_at, "steps": steps, "by": by}
            break
        # ended_at (wall clock):
        # the time between two epochs' ends counts evaluation and reporting too.
        metrics = {"epoch": epoch + 1, **trained, **eval_fn(), "ended_at": time.time()}
        if epoch == start_epoch:  # the start-up breakdown's worker marks, with the first step's
            marks = {**marks, "first_step": metrics["first_step_at"]}
            metrics["startup"] = marks
        history.append(metrics)
        if worker.is_main:
            print(format_epoch(metrics, cfg.epochs), flush=True)
        launcher.report({**metrics, "keep": keep_score(epoch + 1)},
                        state_fn(epoch + 1, history) if worker.is_main else None, epoch + 1)
        if rules:
            rules.saved()
        if stopped_at is not None and epoch + 1 < cfg.epochs:  # at the epoch's last step
            stopped = {"epoch": epoch + 2, "step": 0, "steps": None, "by": by}
            break
    return {"history": history, "world_size": worker.world, "device": worker.device.type,
            "started_at_epoch": start_epoch + 1, "first_step_at": marks.get("first_step"),
            "startup": marks, "node_ranks": node_ranks(worker), "stopped": stopped}


@dataclass
class Start:
    """Where a worker's loop starts: the index of the first epoch to train (the epochs done), the
    metrics history so far, and from a mid-epoch checkpoint what that epoch's steps so far added up
    to (partial)."""
    epoch: int = 0
    history: list = field(default_factory=list)
    partial: Optional[dict] = None

    def describe(self, cfg: Config, worker: Worker) -> str:
        workers = plural(worker.world, "worker")
        if not self.partial:
            return (f"resuming at epoch {self.epoch + 1} of {cfg.epochs} with {workers}, from the "
                    f"checkpoint of epoch {self.epoch}")
        step = self.partial["step"]
        return (f"resuming at epoch {self.epoch + 1} of {cfg.epochs}, step {step + 1} of "
                f"{self.partial['steps']}, with {workers}, from the checkpoint at epoch "
                f"{self.epoch + 1}, step {step}")


def keep_score(epoch: int, step: int = 0, steps: int = 1) -> float:
    """The score Ray keeps checkpoints by (CheckpointConfig: the best --epochs + 1): every epoch's
    own above every mid-epoch one, and a later mid-epoch one above an earlier."""
    return 1e9 + epoch if not step else epoch - 1 + step / (steps + 1)


def finished_run(cfg: Config, done: int) -> str:
    """What a rerun of a run that has done its --epochs says, and how to train it further."""
    more = f"--epochs {max(done, cfg.epochs) + 10} trains it further"
    if done > cfg.epochs:
        return (f"run '{cfg.name}' has trained {done} epochs, more than --epochs {cfg.epochs}; "
                f"nothing to train ({more})")
    return (f"run '{cfg.name}' already finished its {plural(done, 'epoch')}; nothing to train "
            f"({more})")


def train_loop_per_worker(config: dict) -> dict:
    """--mode ddp (and dp): the DDP tutorial's loop."""
    marks = {"loop": time.time()}
    return train_worker(*worker_setup(config), marks)


def train_worker(cfg: Config, worker: Worker, launcher: "Launcher", options: LoopOptions,
                 marks: dict) -> dict:
    """One worker's training, whoever launched it (Ray, torchrun, or a test's process group)."""
    if cfg.min_workers:  # elastic: the same global batch, split over the workers there are now
        cfg = replace(cfg, workers=worker.world)
    train_set, test_set = worker_data(cfg, options, worker)
    marks["data"] = time.time()
    classes = class_names(train_set)
    check_classes_agree(classes, worker.device)
    # identical initial weights on every rank (DDP also broadcasts rank 0's)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, input_shape(cfg, train_set), len(classes))
    start, state = resume(launcher)
    if state is None and cfg.weights:  # --weights: where a new run starts from
        load_weights(model, starting_weights(cfg, options))
    if cfg.sync_bn:
        # before DDP, which must see the final modules
        model = convert_sync_bn(model, worker.device)
    if worker.device.type == "cuda":
        train_set, test_set = cuda_fast_paths(cfg, train_set, test_set, worker.device)
    model = wrap_model(on_device(model, worker.device, cfg.model), worker.device, cfg.mode)
    if cfg.compile:
        model = torch.compile(model)
    optimizer = build_optimizer(cfg, model)  # created once
    if state is not None:
        unwrap(model).load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    batches = train_batches(train_set, cfg, worker.rank, worker.world, worker.device)
    marks["model"] = time.time()

    samples = samples_fingerprint(train_set)

    def state_of(epoch: int, history: list, partial: Optional[dict] = None) -> dict:
        return checkpoint_state(unwrap(model).state_dict(), optimizer.state_dict(), epoch, cfg,
                                history, classes, partial, samples)

    def save_within_epoch(partial: dict) -> None:
        epoch, step = partial["epoch"], partial["step"]
        metrics = {"epoch": epoch + 1, "step": step, "steps": partial["steps"],
                   "keep": keep_score(epoch + 1, step, partial["steps"])}
        launcher.report(metrics, state_of(epoch, start.history, partial) if worker.is_main
                        else None, epoch + 1, step)

    board = options.board if worker.is_main and told(options.board, "restarted") else None
    stop = graceful_stop()
    link = DriverLink(board) if board is not None else None
    rules = SaveRules(cfg, save_within_epoch, link, stop)
    with training(stop), link or contextlib.nullcontext():
        out = run_epochs(
            cfg, worker, launcher, start,
            train_fn=lambda epoch, partial: train_epoch(
                model, optimizer, batches, cfg, worker.device, epoch,
                options.progress and worker.is_main, rules, partial),
            eval_fn=lambda: evaluate_as_saved(model, test_set, cfg, worker.device, len(classes)),
            state_fn=state_of, marks=marks, rules=rules)
    if (out["stopped"] and out["stopped"]["by"] == [SIGTERM_VOTE] and not options.torchrun
            and cfg.max_failures):
        # a worker's node is going: Ray restarts the workers (--max-failures; without it, the run
        # ends as the driver's stop does) from the checkpoint just saved, on the nodes there are
        raise StoppedBySigtermError(f"{SIGTERM_STOPPED}; saved {where(out['stopped'])} and stopped")
    return out


def told(board, method: str) -> bool:
    """board.method() done; False where there is no board, or it is gone (the run goes on
    without: no steps_redone, no stop from the driver)."""
    if board is None:
        return False
    try:
        ray.get(getattr(board, method).remote(), timeout=30)
        return True
    except (ray.exceptions.RayError, TimeoutError):
        return False


class StoppedBySigtermError(RuntimeError):
    """Every rank's end after a worker's SIGTERM and the checkpoint it led to."""


SIGTERM_STOPPED = "a worker got SIGTERM"


def where(stopped: dict) -> str:
    """Where a stopped run's checkpoint is: "epoch 3, step 40 of 120", or "the end of epoch 2"."""
    if stopped["step"]:
        return f"epoch {stopped['epoch']}, step {stopped['step']} of {stopped['steps']}"
    return f"the end of epoch {stopped['epoch'] - 1}"


@contextlib.contextmanager
def training(stop: Optional[GracefulStop]):
    """SIGTERM asks for a graceful stop while this process trains (GracefulStop)."""
    if stop is None:
        yield
        return
    stop.training, stop.asked = True, False
    try:
        yield
    finally:
        stop.training, stop.on_ask = False, None


def scratch_loop_per_worker(config: dict) -> dict:
    """--mode scratch: the functional LeNet, hand-written all-reduce and SGD,
    exact distributed evaluation."""
    marks = {"loop": time.time()}
    cfg, worker, launcher, options = worker_setup(config)
    train_set, test_set = worker_data(cfg, options, worker)
    marks["data"] = time.time()
    start, state = resume(launcher)
    channels, size = train_set.tensors[0].shape[1], train_set.tensors[0].shape[-1]
    initial = (init_lenet_params(cfg.seed, channels, size) if state is None
               else state_dict_to_params(state["model"]))
    params = get_params(initial, worker.device)
    marks["model"] = time.time()
    return run_epochs(
        cfg, worker, launcher, start,
        train_fn=lambda epoch, _: scratch_train_epoch(params, train_set, cfg, worker, epoch,
                                                      options.progress and worker.is_main),
        eval_fn=lambda: evaluate(lambda X: lenet(X, params), test_set, worker.device),
        state_fn=lambda epoch, hist: checkpoint_state(params_to_state_dict(params), {}, epoch,
                                                      cfg, hist, class_names(train_set)),
        marks=marks)


def eval_loop_per_worker(config: dict) -> dict:
    """--eval-only: the checkpoint's model scored on this worker's shard of the test set
    (exactly once each)."""
    cfg, worker, _, options = worker_setup(config)
    # put in Ray's object store by the driver: no shared disk needed
    weights = ray.get(options.weights)
    _, test_set = worker_data(cfg, options, worker)
    classes = len(options.classes)  # the checkpoint's, not what the test labels reach
    model = build_model(cfg.model, input_shape(cfg, test_set), classes)
    model.load_state_dict(weights)
    on_device(model, worker.device, cfg.model).eval()
    with autocast(cfg, worker.device):
        metrics = evaluate(model, test_set, worker.device, eval_batch_size(test_set), details=True,
                           num_classes=classes, workers=loader_workers(cfg, test_set),
                           image_size=cfg.image_size)
    return {"metrics": metrics, "world_size": worker.world, "device": worker.device.type}


# ==================================================================================================
# Launch, the driver's side: the cluster (GPU or CPU, does it fit),
# Ray Train's TorchTrainer, the commands.
# ==================================================================================================


@dataclass(frozen=True)
class Cluster:
    """What a run can use: the resources up now and, where an autoscaler can add nodes, its node
    types as (resources of one node, most nodes) (None: nothing says). local: this machine alone,
    which never grows."""
    now: dict
    node_types: Optional[list]
    local: bool

    @property
    def most(self) -> Optional[dict]:
        """The most of each resource the node types add up to."""
        if self.node_types is None:
            return None
        most = {}
        for resources, count in self.node_types:
            for kind, amount in resources.items():
                if amount and count:
                    most[kind] = most.get(kind, 0) + amount * count
        return most

    def hosts(self, per_worker: dict) -> bool:
        """Some node type can hold one worker (a worker never spans nodes)."""
        return any(count and fits(per_worker, resources)
                   for resources, count in self.node_types or [])


def resources_per_worker(cfg: Config) -> dict:
    gpus = cfg.workers if cfg.mode == "dp" else 1  # dp: one process holds all of the run's GPUs
    return {"CPU": cfg.cpus_per_worker or 1.0, **({"GPU": gpus} if cfg.gpu else {})}


def decide_gpu(cfg: Config, cluster: Cluster) -> bool:
    """GPU workers (nccl) or CPU workers (gloo), when --gpu / --cpu did not say."""
    if cfg.gpu is not None:
        return cfg.gpu
    if cfg.mode == "dp" or cluster.now.get("GPU", 0) > 0:
        return True
    # e.g. a fresh `ray up` cluster: GPU nodes start when workers ask for GPUs
    if cluster.most is not None:
        return cluster.most.get("GPU", 0) > 0
    if cluster.local:
        return False
    raise ConfigError(f"the cluster at {cfg.address} has no GPU now and ray_dp cannot tell "
                      f"whether it can add GPU nodes (no autoscaler configuration found): "
                      f"pass --gpu or --cpu")


def settle_device(cfg: Config, cluster: Cluster) -> Config:
    """The config with the device decided, once the workers are known to fit: Ray would otherwise
    wait forever for resources that never come."""
    cfg = replace(cfg, gpu=decide_gpu(cfg, cluster))
    if (cluster.local and cfg.cpus_per_worker is None
            and cfg.processes > cluster.now.get("CPU", 0) and not cfg.gpu):
        cfg = share_cores(cfg, cluster.now.get("CPU", 0))
    fewest = cfg.min_workers or cfg.processes  # an elastic run starts once its minimum fits
    need = {kind: amount * fewest for kind, amount in resources_per_worker(cfg).items()}
    if fits(need, cluster.now):
        return cfg
    have = f"{cluster.now.get('CPU', 0):g} CPUs and {cluster.now.get('GPU', 0):g} GPUs"
    if cluster.local and cfg.mode == "dp" and not cluster.now.get("GPU"):
        raise ConfigError(f"{DP_NEEDS_GPUS} and this machine has none; use --mode ddp")
    if cluster.local and cfg.gpu and not cluster.now.get("GPU"):
        raise ConfigError("--gpu was given but this machine has no GPU (use --cpu)")
    if cluster.local or cluster.most is None or not fits(need, cluster.most):
        limit = (f"the cluster has {have}" if cluster.local else
                 f"the cluster has {have} and no autoscaler configuration that could add more"
                 if cluster.most is None else
                 f"its node types add up to at most {cluster.most}")
        raise ConfigError(f"{fewest} workers need {need['CPU']:g} CPUs and {need.get('GPU', 0)} "
                          f"GPUs but {limit} (lower --workers or --cpus-per-worker)")
    if cluster.node_types is not None and not cluster.hosts(resources_per_worker(cfg)):
        raise ConfigError(f"one worker needs {resources_per_worker(cfg)} and no node type of the "
                          f"cluster has that much (lower --cpus-per-worker)")
    print(f"note: waiting for the cluster to grow to {need} (it has {have} now)", flush=True)
    return cfg


def share_cores(cfg: Config, cores: float) -> Config:
    """More workers than this machine has cores, and no --cpus-per-worker: as torchrun would, start
    them all, each on an equal share of the cores (one thread each). The maths is that of the
    global batch."""
    # Ray counts CPUs in steps of 0.0001
    share = math.floor(cores / cfg.processes * 10_000) / 10_000
    if not share:
        raise ConfigError(f"{cfg.processes} workers cannot share {cores:g} cores (Ray's smallest "
                          f"share is 0.0001 CPU): lower --workers")
    print(f"note: {cfg.processes} workers share this machine's {cores:g} cores: {share:g} CPU and "
          f"1 thread each (--cpus-per-worker sets it)", flush=True)
    return replace(cfg, cpus_per_worker=share)


def fits(need: dict, have: dict) -> bool:
    return all(amount <= have.get(kind, 0) for kind, amount in need.items())


# what `ray up` leaves on the head node for its autoscaler
BOOTSTRAP_CONFIG = "~/ray_bootstrap_config.yaml"


def autoscaler_node_types(bootstrap_path: str = BOOTSTRAP_CONFIG) -> Optional[list]:
    """The attached cluster's node types, as its autoscaler knows them: from the node groups Ray
    records in its GCS (KubeRay, autoscaler v2), else from the config `ray up` left on this head
    node; None if neither."""
    recorded = recorded_node_types()
    if recorded is not None:
        return recorded
    path = os.path.expanduser(bootstrap_path)
    if not os.path.isfile(path):
        return None
    import yaml
    with open(path) as f:
        return node_types_from_yaml(yaml.safe_load(f))


def node_types_from_yaml(cluster_yaml: dict) -> list:
    """From a cluster launcher config (cluster.yaml as `ray up` prepared it): the head node once,
    plus max_workers nodes of each node type."""
    head = cluster_yaml.get("head_node_type")
    return [(node_type.get("resources", {}), node_type.get("max_workers", 0) + (name == head))
            for name, node_type in cluster_yaml.get("available_node_types", {}).items()]


def check_reachable(address: str, seconds: float = 5.0) -> None:
    """A cluster's GCS must answer before ray.init, which would otherwise retry for minutes. 'auto'
    is the last cluster `ray start` recorded on this machine (/tmp/ray/ray_current_cluster),
    possibly long gone."""
    import socket
    try:
        resolved = gcs_address(address)
    except ValueError:
        raise ConfigError(f"--address {address}: give 'auto' or host:port "
                          f"(e.g. 10.0.0.5:6379)") from None
    if resolved is None:  # this Ray cannot tell where 'auto' points
        return
    if not resolved:
        raise ConfigError(f"--address {address}: no running Ray cluster is recorded on this "
                          f"machine; start one (ray start --head, or ray up cluster.yaml) or drop "
                          f"--address to run here")
    host, _, port = resolved.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=seconds).close()
    except (OSError, ValueError):
        found = (f" (--address {address} found it in /tmp/ray/ray_current_cluster)"
                 if address == "auto" else "")
        raise ConfigError(f"no Ray cluster answers at {resolved}{found}: start one "
                          f"(ray start --head, or ray up cluster.yaml), or drop --address to run "
                          f"on this machine") from None


def connect(cfg: Config) -> Config:
    """Start (or attach to) Ray, after checking that the run fits, so that nothing starts in vain.
    Returns the config with the device decided."""
    if not ray.is_initialized() and not cfg.address:
        machine = {"CPU": ray_cpu_count(), "GPU": torch.cuda.device_count()}
        cfg = settle_device(cfg, Cluster(machine, None, local=True))
        start_ray(cfg.address)
        return cfg
    start_ray(cfg.address)
    return settle_device(cfg, cluster_of(cfg))


def start_ray(address: str) -> None:
    """Start a Ray of this machine's own (no address), or attach to the cluster at address, unless
    this process already runs one; one line if the cluster does not answer."""
    # Ray would fold epoch lines that differ only in numbers
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray colours its "(RayTrainWorker pid=...)" prefixes (read as it prints): not into a file or a
    # pipe, where the escape codes would be text
    if not sys.stdout.isatty():
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if ray.is_initialized():
        check_runtime_env()
        return
    if not address:
        logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
        ray.init(address="local", runtime_env=fresh_runtime_env(), logging_level=logging.WARNING,
                 include_dashboard=False)
        return
    check_reachable(address)
    try:
        ray.init(address=address, runtime_env=fresh_runtime_env(), logging_level=logging.WARNING)
    except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
        raise ConfigError(f"cannot attach to the Ray cluster at {address}: "
                          f"{first_line(exc)}") from None


def fresh_runtime_env() -> dict:
    """RUNTIME_ENV for a ray.init: Ray writes the setup hook into the env_vars it is given, and a
    later ray.init in the same process (a notebook's second Ray) refuses a hook already there."""
    hook = setup_hook_env_var()
    env_vars = {k: v for k, v in RUNTIME_ENV["env_vars"].items() if k != hook}
    # which object store the driver checked is the one every worker uses (credentials, though,
    # are each node's own: its IAM role or environment, never sent along)
    env_vars.update({k: os.environ[k] for k in STORE_SETTINGS if k in os.environ})
    return {**RUNTIME_ENV, "env_vars": env_vars}


STORE_SETTINGS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION")


def check_runtime_env() -> None:
    """Imported, ray_dp needs Ray to ship it to its processes (RUNTIME_ENV's py_modules): a Ray this
    process started itself without it would fail in every worker, one traceback each."""
    if "py_modules" in RUNTIME_ENV and "py_modules" not in ray.get_runtime_context().runtime_env:
        raise ConfigError("this Ray was started without ray_dp's runtime environment, so its "
                          "workers cannot import ray_dp: ray.shutdown(), then ray.init(runtime_env="
                          "ray_dp.RUNTIME_ENV) (or let ray_dp start Ray)")


def cluster_of(cfg: Config) -> Cluster:
    """The Ray this process runs: what it has now and, attached to a cluster (--address), what its
    autoscaler can add. A cluster this process started (tests, compare's rows) will not grow."""
    attached = bool(cfg.address)
    return Cluster(ray.cluster_resources(), autoscaler_node_types() if attached else None,
                   local=not attached)


# PRINT_PATCH=0: rank 0's epoch lines reach the console once,
# not once as print and again as a log record.
RUNTIME_ENV = {"env_vars": {ray_train_knob("ENABLE_PREEMPTION_WATCHER_ENV_VAR"): "0",
                            ray_train_knob("ENABLE_PRINT_PATCH_ENV_VAR"): "0"},
               "worker_process_setup_hook": quiet_ray_logs}
if __name__ != "__main__":
    # Imported (a notebook, another program): Ray's processes unpickle its functions by reference,
    # so they must import this module. Ray ships this one file with the job to every process it
    # starts, locally and on an attached cluster (run as a script, the functions travel by value).
    RUNTIME_ENV["py_modules"] = [sys.modules[__name__]]


def fit(cfg: Config, loop, options: LoopOptions, done: int = 0) -> ray.train.Result:
    """Run `loop` on the run's workers
    (Ray's, or under torchrun this very process) and wait for it."""
    training = loop is not eval_loop_per_worker
    # torchrun's other ranks: their config is not the run's until rank 0's reaches their loop
    logs = None if torchrun_follower() else local_run_dir(cfg)
    prepare_ray_train(cfg, logs and os.path.join(logs, "ray.log"))
    options.launched["fit"] = time.time()
    callbacks = controller_callbacks(cfg, logs, done, options.launched)
    # num_workers=0 under torchrun: Ray Train's local mode runs the loop in this very process.
    workers = (0 if options.torchrun else
               (cfg.min_workers, cfg.workers) if cfg.min_workers else cfg.processes)
    trainer = TorchTrainer(
        loop,
        train_loop_config={"config": cfg, "options": options},
        scaling_config=scaling_config(cfg, workers),
        run_config=RunConfig(name=cfg.name, storage_path=cfg.storage_path,
                             # torchrun: ray_dp keeps the checkpoints, Ray's list is not read
                             checkpoint_config=(CheckpointConfig() if options.torchrun
                                                else checkpoint_config(cfg)),
                             # no INFO per report
                             logging_config=ray.train.LoggingConfig(log_level="WARNING"),
                             callbacks=callbacks + ([TensorBoardLogger(cfg)] if training else []),
                             failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
                             worker_runtime_env=one_arena(cfg)),
        torch_config=TorchConfig(backend="nccl" if cfg.gpu else "gloo", timeout_s=int(cfg.timeout)),
    )
    try:
        return trainer.fit()
    except SystemExit:
        # Ray Train's own Ctrl-C handler, which fit() installs, aborts the run and exits
        raise KeyboardInterrupt from None


def checkpoint_config(cfg: Config) -> CheckpointConfig:
    """Every epoch's checkpoint, and of the mid-epoch ones what room is left in --epochs + 1:
    Ray keeps the best by keep_score (and always the latest). A run whose checkpoints came before
    mid-epoch ones (no score) keeps them all, as it did."""
    if not reports_keep_score(cfg.run_dir):
        return CheckpointConfig(num_to_keep=None)
    return CheckpointConfig(num_to_keep=cfg.epochs + 1, checkpoint_score_attribute="keep",
                            checkpoint_score_order="max")


def reports_keep_score(run_dir: str) -> bool:
    """Whether every checkpoint Ray lists for the run carries keep_score (none listed: yes)."""
    committed = (ray_snapshot(run_dir) or {}).get("checkpoint_results", [])
    return all("keep" in entry["metrics"] for entry in committed)


def controller_callbacks(cfg: Config, logs: Optional[str], done: int = 0,
                         launched: Optional[dict] = None) -> list:
    """ray_dp's hooks in Ray Train's controller: its logs kept quiet and, where the run keeps its
    logs (logs: that directory), its recovery record."""
    if not CONTROLLER_HOOKS:
        internal_note(CALLBACK_MODULE, HOOKS_LOST)
        return []
    return [QuietControllerLogs()] + ([RecoveryLog(
        cfg, os.path.join(logs, "recovery.json"), done, launched)] if logs else [])


def prepare_ray_train(cfg: Config, log_path: str) -> None:
    """Ray Train's settings for a run of ray_dp's (training, evaluation, the doctor's probe), and
    Ray's chatter sent to log_path."""
    check_ray_train_internals()
    # Ray Train's controller collects reports (and commits checkpoints) once per poll, 2 s by
    # default: with short epochs every report would wait for it, and a crash right after one would
    # lose it.
    os.environ.setdefault(ray_train_knob("HEALTH_CHECK_INTERVAL_S_ENV_VAR"), "0.2")
    # Ray hands it on to its controller
    os.environ[ray_train_knob("WORKER_GROUP_START_TIMEOUT_S_ENV_VAR")] = str(cfg.start_timeout)
    shorten_placement_group_cleaner_waits()
    send_ray_output_to(log_path)


def scaling_config(cfg: Config, workers) -> ScalingConfig:
    """Where Ray places the workers, and what each holds: the same for every command."""
    return ScalingConfig(num_workers=workers, use_gpu=cfg.gpu,
                         resources_per_worker=resources_per_worker(cfg))


def describe(cfg: Config, data: DataInfo, torchrun: bool = False) -> str:
    """The run's header: what trains on what, and every switch that changes the maths or the
    speed."""
    kind = "GPU" if cfg.gpu else "CPU"
    workers = (f"1 worker driving {cfg.workers} GPUs (nn.DataParallel)" if cfg.mode == "dp" else
               f"{cfg.min_workers}-{cfg.workers} {kind} workers (elastic)" if cfg.min_workers else
               plural(cfg.workers, f"{kind} worker"))
    extra = f", {cfg.allreduce} all-reduce" if cfg.mode == "scratch" else ""
    sizes = data.sizes
    dropped = sizes[0] - samples_per_epoch(cfg, sizes[0])
    left_out = (f" ({dropped} train samples left out per epoch: whole global batches only)"
                if dropped else "")
    launcher = " (torchrun)" if torchrun else ""
    return (f"ray-dp{launcher}: {cfg.mode} {cfg.model} on {cfg.dataset} "
            f"({sizes[0]} train / {sizes[1]} test{images(cfg, data)}), "
            f"{workers}{extra}, "
            f"global batch {cfg.batch_size} = {cfg.micro_batch} per worker x "
            f"{plural(cfg.processes, 'worker')} x {cfg.accum_steps} accum{left_out}, "
            f"lr {cfg.lr} ({cfg.lr_schedule}), {optimizer_name(cfg)}, "
            f"{', '.join(switches(cfg, data))}, {plural(cfg.epochs, 'epoch')}, "
            f"run dir {cfg.run_dir}")


def switches(cfg: Config, data: DataInfo) -> list:
    """What is on besides the recipe, in words: how batches arrive, accumulation, SyncBatchNorm,
    mixed precision, compilation, the threads each worker computes with."""
    loaders = cfg.loader_workers if cfg.loader_workers is not None else 2 * data.per_sample
    said = [f"{plural(loaders, 'loader process')} per worker" if loaders
            else "batches indexed in memory"]
    if cfg.accum_steps > 1:
        said.append(f"gradients all-reduced every {cfg.accum_steps} micro-batches (no_sync)")
    if cfg.sync_bn:
        said.append("SyncBatchNorm" + ("" if cfg.gpu else " (ray_dp's, for gloo)"))
    if cfg.amp:
        said.append("bf16 autocast (--amp)")
    if cfg.compile:
        said.append("torch.compile")
    return said + [plural(cfg.threads, "thread") + " per worker"]


def images(cfg: Config, data: DataInfo) -> str:
    """A per-sample data set's images as the model sees them: size, augmentation, normalisation;
    data held in memory: the size, where --image-size resizes them."""
    if not data.per_sample:
        size = data.sample_shape[-1]
        return f", images resized to {size} x {size} px" if cfg.image_size else ""
    size = data.sample_shape[-1]
    augment = "augmented" if cfg.augment else "not augmented"
    mean, std = cfg.normalize or ([], [])
    return (f", {len(data.classes)} classes, images {size} x {size} px, {augment}, normalised with "
            f"mean {mean} std {std}")


def optimizer_name(cfg: Config) -> str:
    if cfg.mode == "scratch" or (cfg.optimizer == "sgd" and not cfg.momentum):
        name = "plain SGD"
    else:
        name = "AdamW" if cfg.optimizer == "adamw" else f"SGD momentum {cfg.momentum}"
    knobs = [(cfg.weight_decay, f"weight decay {cfg.weight_decay}"),
             (cfg.warmup_epochs, f"{plural(cfg.warmup_epochs, 'warm-up epoch')}"),
             (cfg.clip_grad_norm, f"gradient norm clipped at {cfg.clip_grad_norm}"),
             (cfg.label_smoothing, f"label smoothing {cfg.label_smoothing}")]
    return ", ".join([name, *(text for value, text in knobs if value)])


def run_record(cfg: Config, final: Optional[dict], out: dict, checkpoint: Optional[str],
               **more) -> dict:
    """result.json, for training and evaluation alike: the config, the final metrics, who computed
    them (world size, device) and with which checkpoint file; then what the command adds."""
    return {"config": asdict(cfg), "final": final, "world_size": out.get("world_size"),
            "device": out.get("device"), "checkpoint": checkpoint, "format": CHECKPOINT_FORMAT,
            **more}


def summarize(cfg: Config, result: ray.train.Result, launched: dict, board=None) -> dict:
    out = result.return_value
    history = out["history"]
    # Medians, leaving out epoch 1 (warm-up) when there are more:
    # a shared machine's stalls skew means. An epoch resumed part way took part of an epoch's time.
    timed = history[1:] or history
    whole = [m for m in timed if not m.get("resumed_at_step")] or timed
    checkpoint = last_checkpoint(cfg, history[-1]["epoch"])
    recovery = recovery_summary(os.path.join(local_run_dir(cfg), "recovery.json"))
    if recovery and board is not None:  # the optimizer steps trained twice because of failures
        recovery["steps_redone"] = ray.get(board.steps_redone.remote())
    # the start-up breakdown as the controller printed it (Ray), or rank 0 (torchrun)
    startup = [e["seconds"] for e in recovery.get("events", []) if e["event"] == "startup"]
    summary = run_record(
        cfg, history[-1], out, checkpoint, epochs=history,
        sec_per_epoch=statistics.median(m["epoch_seconds"] for m in whole),
        samples_per_second=statistics.median(m["samples_per_second"] for m in timed),
        started_at_epoch=out["started_at_epoch"], node_ranks=out["node_ranks"],
        first_step_at=out["first_step_at"], recovery=recovery,
        startup=startup[0] if startup else startup_breakdown(launched, {}, out["startup"]))
    write_json(os.path.join(cfg.run_dir, "result.json"), summary)
    return summary


def last_checkpoint(cfg: Config, epoch: int) -> str:
    """The checkpoint of a run's last epoch: named by its number, so known without asking Ray
    (whose Result may lack it when its state API is slow); a run from before epochs counted from 1,
    which trained nothing since, has it under its old name, the last it committed."""
    path = os.path.join(cfg.run_dir, checkpoint_dir_name(epoch), CHECKPOINT_FILE)
    if is_uri(path) or os.path.isfile(path):
        return path
    return latest_committed(cfg.run_dir) or path


def stored_result(cfg: Config, done: int) -> Optional[dict]:
    """A finished run's result.json, if it is the record of its last checkpoint's epoch."""
    try:
        summary = renumbered(json.loads(read_stored(os.path.join(cfg.run_dir, "result.json"))))
        return summary if summary["epochs"][-1]["epoch"] == done else None
    except (OSError, ValueError, AttributeError, KeyError, IndexError, TypeError):
        return None


def finished_result(cfg: Config, resume: Resume) -> Optional[dict]:
    """The result.json of a run that has done its --epochs, else None."""
    return stored_result(cfg, resume.done) if resume.done >= cfg.epochs else None


def finished(cfg: Config, summary: dict, done: int) -> dict:
    """A rerun of a finished run: nothing to train, said before any cluster starts."""
    print(f"ray-dp: {finished_run(cfg, done)}", flush=True)
    return summary


def read_stored(path: str) -> bytes:
    """A file's bytes, local or in cloud storage (s3://...)."""
    if not is_uri(path):
        return Path(path).read_bytes()
    storage, key = files_at(path)
    with storage.open_input_stream(key) as f:
        return f.read()


def wrote_run(cfg: Config, summary: dict) -> str:
    """The training command's last line: where everything it wrote is (the epochs it trained: a
    resumed run's earlier checkpoints were there before)."""
    first, last = summary["started_at_epoch"], summary["epochs"][-1]["epoch"]
    result = os.path.join(cfg.run_dir, "result.json")
    if first > last:
        return f"wrote {result} (no epoch left to train)"
    checkpoints = (checkpoint_dir_name(first) if first == last else
                   f"{checkpoint_dir_name(first)} to {checkpoint_dir_name(last)}")
    return (f"wrote {result} and {checkpoints} beside it; TensorBoard events in "
            f"{os.path.join(cfg.logdir, cfg.name)}")


class RunStopped(RuntimeError):
    """A graceful stop (SIGTERM): where, and how to go on."""


class RunFailed(RuntimeError):
    """Training failed for good: one line, with where Ray's errors are."""


def record_failure(cfg: Config, error: ray.train.TrainingFailedError) -> str:
    """result.json for a run that failed
    (its config, the error, the recovery record); the one-line reason."""
    logs = local_run_dir(cfg)
    recovery = recovery_summary(os.path.join(logs, "recovery.json"))
    failed = [e for e in recovery.get("events", []) if e["event"] == "failed"]
    node_ips = {int(rank): ip for rank, ip in (failed[-1]["node_ips"] if failed else {}).items()}
    if disk_full(error):
        reason = storage_full(cfg, error)
    else:
        reason = (f"{describe_training_error(error, node_ips)}; the full errors are in "
                  f"{os.path.join(logs, 'ray.log')}")
    try:
        write_json(os.path.join(cfg.run_dir, "result.json"),
                   run_record(cfg, None, {}, None, error=reason, recovery=recovery))
    except OSError as exc:  # the disk that failed the run may refuse the record of it too
        if not disk_full(exc):
            raise
    return reason


def disk_full(error: BaseException) -> bool:
    """A write failed for want of space (ENOSPC): here, or on a worker or in Ray's controller,
    whose errors arrive as text."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        return True
    texts = [error, getattr(error, "controller_failure", None),
             *getattr(error, "worker_failures", {}).values()]
    return any(text is not None and "No space left on device" in str(text) for text in texts)


def storage_full(cfg: Config, error: Optional[BaseException] = None) -> str:
    """A run stopped by a full disk, in one line: where space ran out, the last checkpoint that is
    safe (committed whole: what a rerun resumes from), and how to go on."""
    try:
        latest = latest_committed(cfg.run_dir)
        state = load_checkpoint(latest) if latest else None
    except BrokenSnapshot as exc:  # cut short by the full disk as Ray rewrote it
        return f"{full_device(cfg, error)}; {exc.fact}: once there is space, {SNAPSHOT_WAYS_ON}"
    except (ConfigError, OSError):  # what storage still answers decides what may be called safe
        latest = None
    if latest is None:
        safe = "no checkpoint was saved, so the same command starts it over once there is space"
    else:
        step = (state.get("partial") or {}).get("step", 0)
        at = (f"epoch {state['epoch'] + 1} of {cfg.epochs}, step {step}" if step
              else f"epoch {state['epoch']} of {cfg.epochs}")
        safe = (f"the last checkpoint that is safe is {os.path.dirname(latest)} ({at}): once "
                f"there is space, the same command resumes from it")
    return f"{full_device(cfg, error)}; {safe}"


def full_device(cfg: Config, error: Optional[BaseException]) -> str:
    """Which device ran out of space: the file a write here failed on, else (a worker's or Ray's
    controller's write, known only as text) the fullest of --storage-path's and --logdir's."""
    if getattr(error, "filename", None):
        return f"no space left on the device of {error.filename}"
    free = {}
    for flag, path in (("storage-path", cfg.storage_path), ("logdir", cfg.logdir)):
        existing = next((p for p in [Path(path), *Path(path).parents] if p.exists()), None)
        if not is_uri(path) and existing is not None:
            with contextlib.suppress(OSError):
                free[flag, path] = shutil.disk_usage(existing).free
    if not free:
        return f"no space left on a device the run writes to (--storage-path {cfg.storage_path})"
    (flag, path), left = min(free.items(), key=lambda item: item[1])
    return f"no space left on the device of --{flag} {path} ({human_bytes(left)} free)"


def run(cfg: Config, resume: Resume = Resume(), data: Optional[DataInfo] = None) -> Optional[dict]:
    """Train the resolved and validated cfg, resuming from `resume` (check_run_dir): check the data
    and the model against it, start (or attach to) Ray, train, summarize. Under torchrun each of
    its processes runs this; rank 0 alone checks, speaks and writes, and decides for all (the loop
    takes rank 0's config and checkpoint: torchrun_follower)."""
    torchrun, follower = under_torchrun(), torchrun_follower()
    # The start-up breakdown's first marks: this process's start and imports, if this run pays them.
    first = not ray.is_initialized()
    launched = ({} if not first else {"started": STARTED_AT, "imported": IMPORTED_AT}
                if __name__ == "__main__" else {"imported": COMMAND_AT or time.time()})
    # a run that resumes starts from its checkpoint: --weights is neither read nor needed
    resumes = resume.resumes
    if not follower:
        if data is None:
            cfg, data = check_data(cfg)
        check_model_fits(cfg, data)
        if resume.classes:
            check_same_classes(cfg, resume.classes, data.classes, "resume it on")
        check_same_samples(cfg, resume, data)
        weights_note = None if resumes else check_weights(cfg, data)
        if launched:  # this run pays for the checks and for starting Ray
            launched["checked"] = time.time()
        cfg = cfg if torchrun else connect(cfg)
        # under torchrun before rank 0's loop looks for checkpoints
        start_fresh(cfg)
        print(describe(cfg, data, torchrun), flush=True)
        if weights_note:
            print(f"note: {weights_note}", flush=True)
    if launched and not torchrun:  # torchrun's processes start no Ray: no such phase
        launched["connected"] = time.time()
    loop = scratch_loop_per_worker if cfg.mode == "scratch" else train_loop_per_worker
    # Through Ray's object store, loaded once and no files needed on the workers' nodes: --weights,
    # data held in memory, and the list of a bucket's images. (torchrun has no object store: its
    # processes read them.)
    shared = not torchrun
    options = LoopOptions(progress=sys.stdout.isatty() and not cfg.quiet, torchrun=torchrun,
                          start_from=(ray.put(read_weights(cfg.weights))
                                      if cfg.weights and shared and not resumes else None),
                          data=ray.put(data.datasets) if shared and sent(cfg, data) else None,
                          launched=launched,
                          board=(progress_board() if shared and cfg.mode != "scratch"
                                 and ray.is_initialized() else None),
                          resume_from=(ray.put(load_checkpoint(resume.unlisted))
                                       if shared and resume.unlisted else None))
    if torchrun:
        # local mode logs every report at INFO
        logging.getLogger("ray.train").setLevel(logging.WARNING)
    try:
        # SIGTERM to the driver: rank 0 hears of it from the board (--mode ddp under Ray)
        stop = graceful_stop() if options.board is not None else None
        if stop is not None:
            stop.on_ask = functools.partial(board_heard, options.board)
        with contextlib.redirect_stdout(io.StringIO()) if follower else contextlib.nullcontext(), \
                training(stop):
            result = fit(cfg, loop, options, resume.done)
    except ray.train.TrainingFailedError as exc:
        # rank 0 records the failure; the others' configs were never the run's
        reason = describe_training_error(exc, {}) if follower else record_failure(cfg, exc)
        raise RunFailed(reason) from None
    except OSError as exc:  # torchrun: rank 0's own write, raised here
        if disk_full(exc):
            raise RunFailed(storage_full(cfg, exc)) from None
        raise
    if follower:
        return None
    if stopped := result.return_value["stopped"]:
        raise RunStopped(f"stopped at {where(stopped)} (SIGTERM), its checkpoint saved: the same "
                         f"command resumes from there")
    try:
        summary = summarize(cfg, result, options.launched, options.board)
    except OSError as exc:
        if disk_full(exc):  # result.json: the checkpoints are all committed
            raise RunFailed(storage_full(cfg, exc)) from None
        raise
    print(format_summary(summary, ", torchrun" if torchrun else ""), flush=True)
    if (advice := near_chance(cfg, summary)):
        print(f"note: {advice}", flush=True)
    if cfg.mode == "dp":
        print(f"note: nn.DataParallel normalised each GPU's 1/{cfg.workers} of the batch with its "
              f"own BatchNorm statistics (per replica); only DDP can synchronise them "
              f"(--mode ddp --sync-bn)", flush=True)
    print(wrote_run(cfg, summary), flush=True)
    return summary


def check_same_samples(cfg: Config, resume: Resume, data: DataInfo) -> None:
    """A resume takes up the list of samples its checkpoint trained on (its saved place in an epoch
    is a place in that list)."""
    if resume.resumes and data.fingerprint and not resume.samples:
        print(f"note: run '{cfg.name}' was saved before ray_dp kept its list of images: it "
              f"resumes on --data-dir {cfg.data_dir} as it is now", flush=True)
    if resume.samples and data.fingerprint and resume.samples != data.fingerprint:
        raise ConfigError(f"run '{cfg.name}' trained on another list of images than --data-dir "
                          f"{cfg.data_dir} holds now ({data.sizes[0]} train images): restore the "
                          f"folder as it was, or start over with --fresh or a new --name")


def sent(cfg: Config, data: DataInfo) -> bool:
    """The driver sends the workers their data (not only its place): data held in memory, and a
    folder's list of images (listed once: the run's one list, whatever each node holds)."""
    return not data.per_sample or cfg.dataset == "folder"


def run_eval(cfg: Config, checkpoint: dict) -> dict:
    """--eval-only: the same test metrics as training, plus per-class accuracy and the confusion
    matrix; returns what result.json holds."""
    train_set, test_set = load_dataset(cfg)
    names = checkpoint_classes(cfg, checkpoint, train_set, test_set)
    info = DataInfo((len(train_set), len(test_set)), input_shape(cfg, test_set), names,
                    not isinstance(test_set, TensorDataset))
    check_model_fits(cfg, info)
    if stored_type(cfg.run_dir) == "file":
        raise ConfigError(f"{cfg.run_dir} is a file, not a run directory: choose another --name")
    if epoch_checkpoints(cfg.run_dir):
        raise ConfigError(f"--name {cfg.name}: {cfg.run_dir} holds a training run, whose "
                          f"result.json this evaluation would overwrite; choose another --name")
    cfg = connect(cfg)
    print(f"ray-dp: evaluating {cfg.eval_only} ({cfg.model} on {cfg.dataset}, "
          f"{len(test_set)} test samples) on {cfg.workers} {'GPU' if cfg.gpu else 'CPU'} workers",
          flush=True)
    # the workers need no shared disk
    options = LoopOptions(weights=ray.put(checkpoint["model"]), classes=tuple(names),
                          data=ray.put((train_set, test_set)) if sent(cfg, info) else None)
    out = fit(cfg, eval_loop_per_worker, options).return_value
    metrics = out["metrics"]
    predictions, confusion = metrics.pop("predictions"), metrics["confusion"]
    per_class = [{"class": c, "name": names[c], "count": sum(confusion[c]),
                  "correct": confusion[c][c], "acc": confusion[c][c] / max(sum(confusion[c]), 1)}
                 for c in range(len(names))]
    record = run_record(cfg, metrics, out, cfg.eval_only, per_class=per_class)
    write_json(os.path.join(cfg.run_dir, "result.json"), record)
    wrote = [os.path.join(cfg.run_dir, "result.json")]
    if cfg.predict_out:
        write_predictions(cfg.predict_out, test_set, predictions, names)
        wrote.append(f"{cfg.predict_out} ({plural(len(predictions), 'prediction')})")
    print(format_eval(metrics, per_class, out), flush=True)
    print(f"wrote {' and '.join(wrote)}", flush=True)
    return record


# ==================================================================================================
# compare: the lesson's table, measured side by side.
# ==================================================================================================


def compare_configs(base: Config, scale_lr: bool) -> list[Config]:
    """ddp and scratch LeNet at 1 worker and at --workers N (scratch with each all-reduce at N)."""
    n = base.workers
    rows = [("ddp", "library", 1), ("ddp", "library", n), ("scratch", "naive", 1)]
    rows += [("scratch", algorithm, n) for algorithm in ALLREDUCE_ALGORITHMS]
    configs = []
    for mode, algorithm, workers in dict.fromkeys(rows if n > 1 else rows[:1] + rows[2:3]):
        # --scale-lr: the lesson's way of adding GPUs (same per-GPU batch, so a bigger global
        # batch), with the learning rate scaled linearly along; without it, every row trains the
        # same global batch.
        factor = workers if scale_lr else 1
        label = f"{mode}-{algorithm}-{workers}w" if mode == "scratch" else f"{mode}-{workers}w"
        # scratch rows save at epochs' ends only (the lesson's loop has no steps to resume at)
        every = "0" if mode == "scratch" else base.checkpoint_every
        configs.append(replace(base, mode=mode, allreduce=algorithm, workers=workers, name=label,
                               checkpoint_every=every,
                               storage_path=base.run_dir,
                               logdir=os.path.join(base.logdir, base.name),
                               batch_size=base.batch_size * factor, lr=round(base.lr * factor, 10)))
    return configs


def compare_rows(configs: list[Config], summaries: list[dict]) -> list[dict]:
    baseline = {cfg.mode: s["sec_per_epoch"] for cfg, s in zip(configs, summaries)
                if cfg.workers == 1}
    rows = []
    for cfg, s in zip(configs, summaries):
        speedup = baseline[cfg.mode] / s["sec_per_epoch"]
        comm = (s["final"].get("allreduce_seconds_per_step") if s["final"].get("allreduce_bytes")
                else None)
        rows.append({"run": cfg.name, "mode": cfg.mode,
                     "allreduce": cfg.allreduce if cfg.mode == "scratch" else "ddp",
                     "workers": cfg.workers, "global_batch": cfg.batch_size, "lr": cfg.lr,
                     "test_acc": round(s["final"]["test_acc"], 4),
                     "sec_per_epoch": round(s["sec_per_epoch"], 3),
                     "samples_per_s": round(s["samples_per_second"]), "speedup": round(speedup, 2),
                     "efficiency": round(speedup / cfg.workers, 2),
                     "allreduce_ms_per_step": round(comm * 1e3, 3) if comm else "",
                     "busbw_GBps": round(s["final"]["allreduce_busbw_gbps"], 3) if comm else ""})
    return rows


def write_compare(out_dir: str, rows: list[dict], histories: list[list[dict]]) -> str:
    """compare.csv, compare.md (the table, returned) and compare.png."""
    import csv
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_stored(os.path.join(out_dir, "compare.csv"), text.getvalue().encode())
    table = "\n".join(["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])] +
                      ["| " + " | ".join(str(v) for v in row.values()) + " |" for row in rows])
    write_stored(os.path.join(out_dir, "compare.md"), (table + "\n").encode())
    plot_compare(os.path.join(out_dir, "compare.png"), rows, histories)
    return table


# Runs that learn alike (naive = ring = library) draw lines on top of each other: each run gets its
# own dash and marker, and the markers shrink from run to run, so that later ones sit inside
# earlier ones.
LINE_STYLES = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"), ((0, (5, 1)), "v"),
               ((0, (1, 3)), "X")]


def plot_compare(path: str, rows: list[dict], histories: list[list[dict]]) -> None:
    """Accuracy and loss per epoch for every run;
    seconds per epoch; speedup over 1 worker against N x."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    (acc_axes, loss_axes), (time_axes, speed_axes) = axes
    for i, (row, history, (dash, marker)) in enumerate(
            zip(rows, histories, LINE_STYLES * len(rows))):
        epochs = [m["epoch"] for m in history]
        style = dict(linestyle=dash, marker=marker, markersize=11 - 1.3 * i,
                     markerfacecolor="none" if i % 2 else None, alpha=0.85, label=row["run"])
        acc_axes.plot(epochs, [m["test_acc"] for m in history], **style)
        loss_axes.plot(epochs, [m["train_loss"] for m in history], **style)
    acc_axes.set(xlabel="epoch", ylabel="test accuracy", title="test accuracy per epoch",
                 ylim=(0, 1))
    loss_axes.set(xlabel="epoch", ylabel="train loss",
                  title="train loss per epoch (mean over all workers)")
    last_epoch = max(m["epoch"] for history in histories for m in history)
    for axis in (acc_axes, loss_axes):
        # whole epochs only: a short run's each (a locator labels fractions around one or two)
        if last_epoch <= 10:
            axis.set_xticks(range(1, last_epoch + 1))
        else:
            axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.set_xlim(0.5, last_epoch + 0.5)
        axis.grid(alpha=0.3)
    acc_axes.legend(fontsize=8)
    names = [row["run"] for row in rows]
    epochs_timed = max(len(histories[0]) - 1, 1)
    time_axes.bar(names, [row["sec_per_epoch"] for row in rows], color="tab:blue")
    time_axes.set(ylabel="seconds per epoch",
                  title=(f"seconds per epoch: median of epochs 2-{epochs_timed + 1} of 1 run each"
                         if epochs_timed > 1 else "seconds per epoch"))
    speed_axes.bar(names, [row["speedup"] for row in rows], color="tab:green", label="measured")
    speed_axes.hlines([row["workers"] for row in rows], [i - 0.4 for i in range(len(rows))],
                      [i + 0.4 for i in range(len(rows))], colors="black", linestyles="--",
                      label="ideal: N x on N workers")
    speed_axes.set(ylabel="speedup",
                   title="speedup: sec/epoch of the same mode on 1 worker / this run's",
                   # room for the legend above N x
                   ylim=(0, 1.3 * max(row["workers"] for row in rows)))
    speed_axes.legend(fontsize=8, loc="upper left", ncol=2)
    for axis in (time_axes, speed_axes):
        axis.tick_params(axis="x", labelrotation=30)
        axis.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    write_stored(path, png.getvalue())


def compare(base: Config, scale_lr: bool) -> list[dict]:
    configs = compare_configs(base, scale_lr)
    resolved = []
    for cfg in configs:  # every row is resolved and checked before any cluster starts
        cfg, resume = check_run_dir(cfg)
        if (summary := finished_result(cfg, resume)) is not None:  # a row done before
            resolved.append((cfg, resume, None, summary))
            continue
        validate(cfg, resuming=resume.resumes)
        cfg, data = check_data(cfg)
        check_model_fits(cfg, data)
        resolved.append((cfg, resume, data, None))
    if any(summary is None for *_, summary in resolved):
        connect(max(configs, key=lambda c: c.workers))
    summaries = [run(cfg, resume, data) if summary is None else finished(cfg, summary, resume.done)
                 for cfg, resume, data, summary in resolved]
    rows = compare_rows(configs, summaries)
    print(write_compare(base.run_dir, rows, [s["epochs"] for s in summaries]))
    print(f"wrote compare.csv, compare.md and compare.png to {base.run_dir}", flush=True)
    return rows


# ==================================================================================================
# doctor: a pre-flight check of a Ray cluster, one line per check (what was found, and on failure
# what to do): Ray, the nodes' software, resources, shared storage, a worker group and its
# all-reduce, the data.
# ==================================================================================================


@dataclass(frozen=True)
class Check:
    ok: bool
    says: str  # the figure; on failure, what is wrong and what to do


class Doctor:
    """The checks, in order; one that needs what an earlier one found is skipped when that failed.
    Node-level questions go to one task per node; the worker group is the one a run would start."""

    def __init__(self, cfg: Config, hang_timeout: float, check_images: bool = False):
        self.cfg, self.hang_timeout, self.check_images = cfg, hang_timeout, check_images
        self.logs = tempfile.mkdtemp(prefix="ray-dp-doctor-")  # Ray's messages; kept on failure
        self.probe: Optional[dict] = None
        self.nodes: dict = {}  # node name -> node ID, once Ray is up

    def run(self) -> bool:
        checks = [("Ray", self.ray, None), ("versions", self.versions, "Ray"),
                  ("resources", self.resources, "Ray"), ("storage", self.storage, "Ray"),
                  ("workers", self.workers, "resources"), ("all-reduce", self.allreduce, "workers"),
                  ("data", self.data, "Ray")] + ([("images", self.images, "data")]
                                                 if self.check_images else [])
        started, passed, log = time.time(), set(), os.path.join(self.logs, "ray.log")
        try:
            for name, check, needs in checks:
                if needs and needs not in passed:
                    print(f"skipped {name:<10} (needs {needs})", flush=True)
                    continue
                result = self.checked(check)
                passed.update([name] if result.ok else [])
                print(f"{'ok' if result.ok else 'FAILED':<7} {name:<10} {result.says}",
                      flush=True)
        finally:
            failed = len(checks) - len(passed)
            kept = failed and os.path.isfile(log)
            if not kept:
                send_ray_output_to(None)
                shutil.rmtree(self.logs, ignore_errors=True)
        where = f"; Ray's messages are in {log}" if kept else ""
        print(f"doctor: {failed} of {len(checks)} checks failed or were skipped "
              f"({time.time() - started:.1f} s){where}" if failed else
              f"doctor: all {len(checks)} checks passed in {time.time() - started:.1f} s",
              flush=True)
        return not failed

    @staticmethod
    def checked(check) -> Check:
        """A check's verdict; an error it did not foresee fails it, in one line (Ctrl-C stops)."""
        try:
            return check()
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is this check's failure
            return Check(False, f"{first_line(exc)} (the check itself failed)")

    def ray(self) -> Check:
        begun = time.time()
        where = (f"at {self.cfg.address}, attached" if self.cfg.address
                 else "started on this machine")
        try:
            start_ray(self.cfg.address)
        except ConfigError as exc:
            return Check(False, str(exc))
        send_ray_output_to(os.path.join(self.logs, "ray.log"))
        self.nodes = node_names(alive_nodes())
        return Check(True, f"Ray {ray.__version__} {where} in {time.time() - begun:.1f} s; "
                           f"auth {node_software()['auth']} (this client)")

    def versions(self) -> Check:
        here, nodes = node_software(), self.on_every_node(node_software)
        for node, found in nodes.items():
            if isinstance(found, Exception):
                return Check(False, f"node {node} did not answer: {said(found)}")
            differ = [f"{key} {found[key]} (the driver {here[key]})"
                      for key in SOFTWARE if found[key] != here[key]]
            if differ:
                return Check(False, f"node {node} ({found['host']}) has {', '.join(differ)}: "
                                    f"install requirements.txt into the same Python on every "
                                    f"node (cluster.yaml's setup_commands), and set "
                                    f"RAY_AUTH_MODE the same everywhere")
        same = ", ".join(f"{key} {here[key]}" for key in SOFTWARE)
        return Check(True, f"{plural(len(nodes), 'node')}, the same as the driver's: {same}")

    def resources(self) -> Check:
        cluster = cluster_of(self.cfg)
        have = (f"{plural(len(self.nodes), 'node')}, {cluster.now.get('CPU', 0):g} CPUs, "
                f"{cluster.now.get('GPU', 0):g} GPUs now")
        grows = (f"; its node types add up to {cluster.most}" if cluster.most is not None else
                 "" if cluster.local else "; no autoscaler configuration found")
        notes = io.StringIO()
        try:
            with contextlib.redirect_stdout(notes):
                self.cfg = settle_device(self.cfg, cluster)
        except ConfigError as exc:
            return Check(False, f"{have}{grows}; {exc}")
        noted = " ".join(line.removeprefix("note: ") for line in notes.getvalue().splitlines())
        kind = "GPU workers (nccl)" if self.cfg.gpu else "CPU workers (gloo)"
        each = " + ".join(f"{amount:g} {resource}" for resource, amount in
                          resources_per_worker(self.cfg).items())
        return Check(True, f"{have}{grows}; --workers {self.cfg.processes}: {kind}, {each} "
                           f"each{'; ' + noted if noted else ''}")

    def storage(self) -> Check:
        if is_uri(self.cfg.storage_path) and (problem := store_problem(self.cfg.storage_path,
                                                                       "write")):
            return Check(False, f"{self.cfg.storage_path}: {problem}")
        root = self.cfg.storage_path.rstrip("/")
        folder = f"{root}/.ray-dp-doctor-{os.getpid()}-{time.time():.0f}"
        written = self.on_every_node(write_marker, folder)
        seen = self.on_every_node(read_markers, folder)
        made = {self.nodes[name]: answer["created"] for name, answer in written.items()
                if isinstance(answer, dict) and answer["created"]}
        self.on_every_node(remove_markers, folder, made)
        return storage_verdict(self.cfg.storage_path, written, seen, self.nodes)

    def workers(self) -> Check:
        cfg = self.cfg
        prepare_ray_train(cfg, os.path.join(self.logs, "ray.log"))
        trainer = TorchTrainer(
            doctor_loop_per_worker, train_loop_config={"hang_timeout": self.hang_timeout},
            scaling_config=scaling_config(cfg, cfg.processes),
            run_config=RunConfig(name="probe", storage_path=self.logs,
                                 logging_config=ray.train.LoggingConfig(log_level="WARNING"),
                                 callbacks=controller_callbacks(cfg, None)),
            torch_config=TorchConfig(backend="nccl" if cfg.gpu else "gloo",
                                     timeout_s=int(math.ceil(self.hang_timeout))))
        begun = time.time()
        try:
            self.probe = trainer.fit().return_value
        except SystemExit:  # Ray Train's own Ctrl-C handler, which fit() installs
            raise KeyboardInterrupt from None
        except ray.train.TrainingFailedError as exc:
            return Check(False, f"{probe_failure(exc)}; a rank that never answers is most often "
                                f"bound to a network interface the others cannot reach: set "
                                f"GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) on every node")
        ranks = self.probe["ranks"]
        up = max(rank["started"] for rank in ranks) - begun
        bound = ", ".join(f"rank {r['rank']} on {r['node']} via {r['address']} ({r['interface']})"
                          for r in ranks)
        found = (f"{plural(len(ranks), 'worker')} up in {up:.1f} s (placed, started, "
                 f"{self.probe['backend']} process group); {bound}")
        if (stray := unreachable_rank(ranks)):
            return Check(False, f"{found}; rank {stray['rank']} on {stray['node']} sends its "
                                f"collectives from {stray['address']}, which other nodes cannot "
                                f"reach: set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) to the "
                                f"interface that holds {stray['node']}")
        return Check(True, found)

    def allreduce(self) -> Check:
        ranks = len(self.probe["ranks"])
        sizes = ", ".join(
            f"{human_bytes(t['bytes'])} {three_figures(t['seconds'] * 1e3)} ms"
            + (f" {rate(bus_bandwidth(t['bytes'], t['seconds'], ranks))}" if ranks > 1 else "")
            for t in self.probe["timings"])
        return Check(True, f"{self.probe['backend']} on {plural(ranks, 'worker')}, time per "
                           f"all-reduce{' and bus bandwidth' if ranks > 1 else ''}: {sizes}")

    def data(self) -> Check:
        cfg = replace(self.cfg, download=False)
        try:
            here = data_files(cfg)
        except DataError as exc:
            return missing_data(self.cfg, exc)
        if not here["per_sample"]:
            return Check(True, f"{cfg.dataset}: {here['train']} train / {here['test']} test "
                               f"samples on the driver, which sends them to the workers (their "
                               f"nodes need no files)")
        for node, found in self.on_every_node(data_files, cfg).items():
            if isinstance(found, Exception):
                return Check(False, f"node {node}: {said(found)} (every node that trains "
                                    f"reads the images itself)")
            if found != here:
                return Check(False, f"node {node} sees {found['train']} train / {found['test']} "
                                    f"val images in {classes_of(found, here)}, the driver "
                                    f"{here['train']} / {here['test']} in "
                                    f"{classes_of(here, found)}")
        return Check(True, f"{cfg.dataset} {cfg.data_dir}: {here['train']} train / {here['test']} "
                           f"val images in {plural(len(here['classes']), 'class')}, the same on "
                           f"every node")

    def images(self) -> Check:
        """Every image of the folder decoded on this machine (where the driver computes the
        statistics; the data check found the same files on every node)."""
        begun = time.time()
        paths = [path for split in ("train", "val") for path, _ in
                 load_dataset(replace(self.cfg, download=False))[split == "val"].samples]
        bad = unreadable_images(paths, self.cfg.data_dir)
        seconds = time.time() - begun
        pace = f"{seconds:.1f} s, {seconds / len(paths) * 10_000:.1f} s per 10,000"
        if not bad:
            return Check(True, f"all {len(paths)} images of {self.cfg.data_dir} decode ({pace})")
        named = "; ".join(f"{path} ({reason})" for path, reason in bad[:3])
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return Check(False, f"{len(bad)} of {len(paths)} images cannot be read: {named}{more}; "
                            f"remove or replace them ({pace})")

    def on_every_node(self, function, *args) -> dict:
        """function(*args) once on each node, all at once, by node name: its return value, or the
        exception it raised, or a TimeoutError for a node that did not answer within
        --start-timeout."""
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
            except Exception as exc:  # noqa: BLE001 - the node's own error is the answer
                answers[name] = exc
        return answers


def doctor(cfg: Config, hang_timeout: float, check_images: bool = False) -> bool:
    where = f"the cluster at {cfg.address}" if cfg.address else "this machine (a local Ray)"
    print(f"ray-dp doctor: {where}, --workers {cfg.workers}, storage {cfg.storage_path}, "
          f"data {cfg.dataset}", flush=True)
    return Doctor(cfg, hang_timeout, check_images).run()


SOFTWARE = ("python", "ray", "torch", "torchvision", "auth")


def node_software() -> dict:
    """This process's Python, Ray, torch, torchvision, and the auth mode its Ray speaks."""
    import platform
    import socket

    import torchvision
    return {"host": socket.gethostname(), "python": platform.python_version(),
            "ray": ray.__version__, "torch": torch.__version__,
            "torchvision": torchvision.__version__, "auth": ray_auth_mode()}


def alive_nodes() -> list:
    return [node for node in ray.nodes() if node["Alive"]]


def node_names(nodes: list) -> dict:
    """{name: node ID}: a node by its address; with its ID too where two share one (several
    raylets on one host)."""
    addresses = [node["NodeManagerAddress"] for node in nodes]
    return {(f"{address} ({node['NodeID'][:8]})" if addresses.count(address) > 1 else address):
            node["NodeID"] for node, address in zip(nodes, addresses)}


def write_marker(folder: str) -> dict:
    """On one node: a file named after the node's ID written into folder. {"error": None or why
    not, "created": the first directory of folder's that did not exist, for remove_markers}."""
    from pyarrow import ArrowException, fs
    try:
        files, path = files_at(folder)
        created = next((str(part) for part in reversed(PurePosixPath(path).parents)
                        if str(part) not in (".", "/")
                        and files.get_file_info(str(part)).type == fs.FileType.NotFound), None)
        if not is_uri(folder):  # a bucket has no directories to make
            files.create_dir(path, recursive=True)
        with files.open_output_stream(f"{path}/{ray.get_runtime_context().get_node_id()}") as f:
            f.write(b"written by ray_dp.py doctor\n")
    except (OSError, ArrowException, ValueError) as exc:
        return {"error": " ".join(str(exc).split()), "created": None}
    return {"error": None, "created": created}


def read_markers(folder: str):
    """On one node: the markers it sees in folder (a list of node IDs), or why it cannot (str)."""
    from pyarrow import ArrowException, fs
    try:
        files, path = files_at(folder)
        return [info.base_name for info in
                files.get_file_info(fs.FileSelector(path, allow_not_found=True))]
    except (OSError, ArrowException, ValueError) as exc:
        return " ".join(str(exc).split())


def remove_markers(folder: str, created: dict) -> None:
    """On one node: the markers' folder, and the directories this node made for it (created: by
    node ID), so that the doctor leaves nothing behind."""
    from pyarrow import ArrowException
    with contextlib.suppress(OSError, ArrowException, ValueError):
        files, path = files_at(folder)
        files.delete_dir(path)
        if (made := created.get(ray.get_runtime_context().get_node_id())):
            files.delete_dir(made)


def storage_verdict(storage: str, written: dict, seen: dict, node_ids: dict) -> Check:
    """Shared storage, from what each node wrote (write_marker's answer) and then saw (its list of
    node IDs), by node name."""
    for node, answer in written.items():
        error = answer if isinstance(answer, BaseException) else answer["error"]
        if error is not None:
            return Check(False, f"node {node} cannot write under {storage}: {said(error)}; "
                                f"choose a --storage-path every node can write (s3://... or a "
                                f"shared file system)")
    for reader, markers in seen.items():
        if not isinstance(markers, list):
            return Check(False, f"node {reader} cannot read {storage}: {said(markers)}")
        if (missing := [writer for writer in written if node_ids[writer] not in markers]):
            return Check(False, f"node {reader} cannot see what node {missing[0]} wrote under "
                                f"{storage}: use s3:// or a shared file system (rank 0 saves the "
                                f"checkpoints wherever it runs; every node reads them to resume)")
    if len(written) == 1:
        return Check(True, f"{storage}: the node wrote a marker and read it back")
    return Check(True, f"{storage}: {len(written)} nodes each wrote a marker and each read all "
                       f"{len(written)} back (shared)")


def said(answer) -> str:
    """A node's answer as words: an exception in one line, else as it is."""
    return first_line(answer) if isinstance(answer, BaseException) else str(answer)


def data_files(cfg: Config) -> dict:
    """What --dataset finds here without downloading: its sizes and classes, and whether the
    workers read it per sample (on their own nodes) or it is held in memory (sent by the driver)."""
    train, test = load_dataset(cfg)
    train[0]  # decoded as a run's first look at the data decodes it: a file that is no image fails
    named = isinstance(train, TensorDataset) or getattr(train, "classes", None)
    return {"train": len(train), "test": len(test),
            "classes": class_names(train) if named else None,
            "per_sample": not isinstance(train, TensorDataset)}


def unreadable_images(paths: list, data_dir: str) -> list:
    """(path, why) of each file that PIL cannot decode, reading them all with a progress bar."""
    from PIL import Image
    from tqdm import tqdm
    bad = []
    for path in tqdm(paths, desc="decoding images", unit=" images",
                     disable=not sys.stderr.isatty()):
        source = io.BytesIO(stored_image(path, data_dir)) if is_uri(path) else path
        try:
            with Image.open(source) as image:
                image.load()
        except BROKEN_IMAGE as exc:
            bad.append((path, image_error(exc)))
    return bad


def classes_of(seen: dict, other: dict) -> str:
    """A folder's classes, in the words that tell them from another node's: how many, and the
    names only one of the two has."""
    names, others = seen["classes"] or [], other["classes"] or []
    only = [name for name in names if name not in others]
    return plural(len(names), "class") + (f" (only here: {', '.join(only)})" if only else "")


def download_source(dataset: str) -> Optional[str]:
    from torchvision.datasets import CIFAR10, FashionMNIST
    return {"fashion-mnist": FashionMNIST.mirrors[0], "cifar10": CIFAR10.url}.get(dataset)


def missing_data(cfg: Config, error: DataError) -> Check:
    """A data set not on the driver's disk: fine if a run can download it (the driver does, once,
    and sends it to the workers)."""
    import socket
    import urllib.parse
    source = download_source(cfg.dataset)
    if not cfg.download or source is None:
        return Check(False, str(error))
    where = urllib.parse.urlsplit(source)
    host = where.hostname
    try:
        socket.create_connection((host, where.port or {"http": 80}.get(where.scheme, 443)),
                                 timeout=5).close()
    except OSError as exc:
        return Check(False, f"{cfg.dataset} is not in {cfg.data_dir} and {host} cannot be "
                            f"reached to download it ({exc.strerror or exc}): copy its files "
                            f"there on the driver's machine (--data-dir), or use --dataset digits "
                            f"(offline)")
    return Check(True, f"{cfg.dataset} is not in {cfg.data_dir} yet; {host} answers, so a run "
                       f"downloads it there first (the driver only: it sends the data on)")


PROBE_BYTES = (4 << 10, 256 << 10, 16 << 20, 64 << 20)


class ProbeHang(RuntimeError):
    """Ranks that did not come to a collective in time."""


def doctor_loop_per_worker(config: dict) -> Optional[dict]:
    """Each of the doctor's workers: where it runs and which address its collectives use, then an
    all-reduce at each of PROBE_BYTES, each after a barrier that names the ranks that do not come
    (a collective would only time out). Rank 0 returns what they all found."""
    started = time.time()
    backend, device = dist.get_backend(), ray.train.torch.get_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # torch's monitored_barrier is gloo's alone: an NCCL run gets a gloo group beside its own
    watch = None if backend == "gloo" else dist.new_group(backend="gloo")
    hang = config["hang_timeout"]
    everyone_comes(watch, hang, "the first collective")
    me = {"rank": dist.get_rank(), "node": ray.util.get_node_ip_address(), "started": started,
          **collective_address(backend)}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, me)
    timings = []
    for size in PROBE_BYTES:
        everyone_comes(watch, hang, f"the {human_bytes(size)} all-reduce")
        timings.append({"bytes": size, "seconds": time_allreduce(size, device)})
    return ({"ranks": ranks, "timings": timings, "backend": backend} if dist.get_rank() == 0
            else None)


def everyone_comes(group, seconds: float, before: str) -> None:
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=seconds), wait_all_ranks=True)
    except RuntimeError as exc:  # rank 0 names the absent; the others only lose rank 0
        absent = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", str(exc))
        if absent:
            raise ProbeHang(f"rank {absent[1]} did not come to {before} within {seconds:g} s "
                            f"(--hang-timeout)") from None
        raise


def time_allreduce(size: int, device: torch.device) -> float:
    """Median seconds of one all-reduce of `size` bytes (float32) on this worker's device."""
    tensor = torch.ones(size // 4, device=device)
    seconds = []
    for _ in range(1 + (10 if size <= 1 << 20 else 3)):  # the first one warms up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begun = time.perf_counter()
        dist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - begun)
    return statistics.median(seconds[1:])


def collective_address(backend: str) -> dict:
    """The address and network interface this worker's collectives go out of, found as the backend
    finds them: {GLOO,NCCL}_SOCKET_IFNAME if set; else gloo takes the first address of the host's
    name that it can bind, NCCL an InfiniBand interface, else any but loopback and docker."""
    interfaces = interface_addresses()
    variable = "GLOO_SOCKET_IFNAME" if backend == "gloo" else "NCCL_SOCKET_IFNAME"
    if (named := os.environ.get(variable)):
        # NCCL's syntax: a list of name prefixes; '=' exact names, '^' names to leave out
        exact = "=" if backend == "gloo" else ""  # gloo takes whole names only
        chosen = [name for name in interfaces if named_interface(name, exact + named)]
        return {"interface": f"{chosen[0] if chosen else '?'}, {variable}={named}",
                "address": interfaces.get(chosen[0], "?") if chosen else "?"}
    if backend != "gloo":
        candidates = [name for name in interfaces if not name.startswith(("lo", "docker"))]
        name = min(candidates, key=lambda n: not n.startswith("ib"), default="lo")
        return {"interface": name, "address": interfaces.get(name, "?")}
    import socket
    address = first_bindable(socket.gethostname())
    name = next((n for n, a in interfaces.items() if a == address),
                "lo" if address.startswith("127.") else "?")
    return {"interface": name, "address": address}


def named_interface(name: str, spec: str) -> bool:
    """Whether interface `name` is one that GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME = spec picks."""
    exclude, spec = spec.startswith("^"), spec.lstrip("^")
    exact, spec = spec.startswith("="), spec.lstrip("=")
    hit = any(name == part if exact else name.startswith(part) for part in spec.split(",") if part)
    return hit != exclude


def interface_addresses() -> dict:
    """Each network interface's first IPv4 address (psutil's list: any OS), by interface name."""
    import socket

    import psutil
    found = {}
    for name, addresses in psutil.net_if_addrs().items():
        ipv4 = [entry.address for entry in addresses if entry.family == socket.AF_INET]
        if ipv4:
            found[name] = ipv4[0]
    return found


def first_bindable(host: str) -> str:
    """gloo's choice: the first address of `host` that a socket can bind, else loopback."""
    import socket
    try:
        candidates = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return "127.0.0.1"
    for family, kind, protocol, _, address in candidates:
        with socket.socket(family, kind, protocol) as probe:
            try:
                probe.bind((address[0], 0))
                return address[0]
            except OSError:
                continue
    return "127.0.0.1"


def unreachable_rank(ranks: list) -> Optional[dict]:
    """A rank whose collectives leave from a loopback address while the nodes have addresses of
    their own (other machines): the others cannot reach it, and the first collective hangs."""
    nodes = {rank["node"] for rank in ranks}
    if len(nodes) < 2 or all(node.startswith("127.") for node in nodes):
        return None
    return next((rank for rank in ranks if rank["address"].startswith("127.")
                 or rank["address"] == "::1"), None)


def probe_failure(error: ray.train.TrainingFailedError) -> str:
    """Why the doctor's worker group failed: the ranks that did not come, where rank 0 named
    them."""
    for _, failure in sorted(getattr(error, "worker_failures", {}).items()):
        # the exception itself, or a traceback that ends in it
        if (found := re.search(r"ProbeHang: (.*)", f"{type(failure).__name__}: {failure}")):
            return found[1].strip()
    return describe_training_error(error, {})


def human_bytes(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{three_figures(size / scale)} {unit}"
    return f"{size} B"


def bus_bandwidth(size: int, seconds: float, ranks: int) -> float:
    """Bytes per second each link carries in a ring all-reduce (nccl-tests' busbw): the data
    size over the time, times 2(n-1)/n."""
    return size / seconds * 2 * (ranks - 1) / ranks


def three_figures(value: float) -> str:
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def rate(bytes_per_second: float) -> str:
    if bytes_per_second >= 1e9:
        return f"{three_figures(bytes_per_second / 1e9)} GB/s"
    return f"{three_figures(bytes_per_second / 1e6)} MB/s"


# ==================================================================================================
# main: the command line, one command, one line for every way it can end.
# ==================================================================================================


def parse_command(argv) -> tuple[str, Config, dict]:
    """(command, config, command options): `ray_dp.py [flags]` trains; `ray_dp.py compare
    [flags]` compares; `ray_dp.py doctor [flags]` checks a cluster."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv[:1] in (["compare"], ["doctor"]) else "train"
    parser, flags = build_parser(command), argv if command == "train" else argv[1:]
    args = vars(parser.parse_args(flags))
    if command == "doctor":
        return "doctor", *doctor_config(args)
    # argparse fills in defaults only for attributes the namespace lacks:
    # what keeps NOT_TYPED was not typed.
    untyped = argparse.Namespace(**dict.fromkeys(args, NOT_TYPED))
    typed = {k for k, v in vars(parser.parse_args(flags, untyped)).items() if v is not NOT_TYPED}
    options = {"scale_lr": args.pop("scale_lr")} if command == "compare" else {}
    if args["model"] == "list":
        return "models", None, {}
    cfg = resolve(command, args, typed)
    if command == "compare" and (cfg.eval_only or cfg.min_workers):
        raise ConfigError("compare trains its own rows at 1 and --workers N workers: give a fixed "
                          "--workers N, and run --eval-only on its own")
    if cfg.eval_only:
        cfg, options["checkpoint"] = eval_config(cfg, typed)
        command = "eval"
    cfg = replace(cfg, name=cfg.name or default_run_name(command, cfg))
    if torchrun_follower():  # rank 0 resolves and checks the run for every rank
        return command, cfg, {"resume": Resume()}
    check_location(cfg)  # where the run it may resume is, or where the results go
    adopted = []
    if command == "train":
        # a rerun takes what the command line leaves unsaid from the run it resumes
        typed_cfg = cfg
        cfg, options["resume"] = check_run_dir(cfg, typed)
        # a finished run trains nothing: no training check applies to it (Under torchrun rank 0's
        # loop says so: the other ranks wait for it there.)
        if not under_torchrun() and (summary := finished_result(cfg, options["resume"])):
            return "finished", cfg, {"summary": summary, "done": options["resume"].done}
        adopted = [as_flag(f, getattr(cfg, f)) for f in CONFIG_FIELDS
                   if getattr(cfg, f) != getattr(typed_cfg, f) and f in CLI_FIELDS]
    try:
        validate(cfg, resuming=options.get("resume", Resume()).resumes)
    except ConfigError as exc:
        if adopted:  # the value at fault may be one the user never typed
            raise ConfigError(f"{exc}; run '{cfg.name}' trained with {', '.join(adopted)}, which "
                              f"this rerun takes from it") from None
        raise
    return command, cfg, options


def resolve(command: str, args: dict, typed: set) -> Config:
    """The flags as typed, completed by everything but the run directory's and the checkpoint's
    values: the lesson's defaults for scratch and compare, torchrun's world, absolute paths."""
    if command == "compare" or args["mode"] == "scratch":
        args = {**args, **{k: v for k, v in LESSON_DEFAULTS.items() if k not in typed}}
    if under_torchrun():
        args = torchrun_launch(command, args, typed)
    return with_absolute_paths(Config(**args))


def doctor_config(args: dict) -> tuple[Config, dict]:
    """The doctor's flags checked as a run's would be, but for --storage-path, which the doctor
    tries on every node instead."""
    hang_timeout, check_images = args.pop("hang_timeout"), args.pop("check_images")
    if not 1 <= hang_timeout <= MAX_SECONDS:
        raise ConfigError(f"--hang-timeout must be 1 to {MAX_SECONDS} seconds, got {hang_timeout}")
    # MIN:MAX: the most workers the run may have is what has to start
    cfg = with_absolute_paths(replace(Config(**args), min_workers=0))
    validate(cfg, doctor=True)
    if check_images and cfg.dataset != "folder":
        raise ConfigError(f"--check-images reads the image files of --dataset folder; "
                          f"{cfg.dataset} has none")
    return cfg, {"hang_timeout": hang_timeout, "check_images": check_images}


def list_models(cfg: None) -> None:
    """--model list: ray_dp's models, then torchvision's."""
    print("ray_dp: " + " ".join(MODELS))
    print("torchvision (ImageNet-size; --weights to start from a downloaded .pth): "
          + " ".join(torchvision_names()))


def interrupted(command: str, cfg: Optional[Config]) -> str:
    """Ctrl-C: what was kept, and the command line that continues."""
    if command == "compare" and cfg:
        return (f"interrupted; the same command with --name {cfg.name} resumes the rows "
                f"(finished ones are kept)")
    try:
        latest = latest_committed(cfg.run_dir) if command == "train" and cfg else None
    except BrokenSnapshot as exc:  # cut short as Ray stopped
        return f"interrupted; {exc}"
    if latest is None:
        return "interrupted; nothing was saved"
    try:
        state = load_checkpoint(latest)  # its name may be an old run's, counted from 0
        done, step = state["epoch"], (state.get("partial") or {}).get("step", 0)
    except ConfigError:  # a checkpoint cut short: say what its name says
        done, step = checkpoint_order(Path(latest).parent.name) or (0, 0)
    same = "the same command without --fresh" if cfg.fresh else "the same command"
    return (f"interrupted {position(done, step, cfg.epochs)} (saved in {cfg.run_dir}); "
            f"{same} with --name {cfg.name} resumes it")


def position(done: int, step: int, epochs: int) -> str:
    """Where a checkpoint is: "after epoch 2 of 3", or mid-epoch "at epoch 3 of 3, step 40"."""
    return (f"at epoch {done + 1} of {epochs}, step {step}" if step
            else f"after epoch {done} of {epochs}")


def train(**settings) -> dict:
    """ray_dp from Python, e.g. a notebook cell: the flags as keyword arguments, named as --help
    names them with _ for - (ray_dp.train(workers=2, dataset="digits", epochs=3); a switch takes
    True or False). It trains (or resumes, or with eval_only evaluates) as the command line would,
    and returns what the run's result.json holds: the config, "final" and, for training, every
    epoch's metrics in "epochs". Bad settings raise ConfigError, a failed run RunFailed, a run
    stopped by SIGTERM (its checkpoint saved: the same call resumes it) RunStopped."""
    global COMMAND_AT
    COMMAND_AT = time.time()
    command, cfg, options = parse_command(settings_as_flags(settings))
    if command == "models":
        raise ConfigError("model='list' is the command line's listing (python ray_dp.py --model "
                          "list); ray_dp.train trains or evaluates")
    return {"train": run, "eval": run_eval, "finished": finished}[command](cfg, **options)


def settings_as_flags(settings: dict) -> list:
    """train()'s keyword arguments as the command line they stand for."""
    flags = []
    for name, value in settings.items():
        if name not in CLI_FIELDS:
            raise ConfigError(f"ray_dp.train() has no setting {name!r}: its settings are the "
                              f"flags of ray_dp.py --help, with _ for - (e.g. batch_size)")
        flag = "--" + name.replace("_", "-")
        if name == "gpu":
            flags += [] if value is None else ["--gpu" if value else "--cpu"]
        elif isinstance(value, bool):
            default = next(f.default for f in fields(Config) if f.name == name)
            flags += [flag] if value else [f"--no-{flag[2:]}"] if default else []
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def main(argv=None) -> int:
    global COMMAND_AT
    COMMAND_AT, command, cfg = time.time(), "train", None
    try:
        command, cfg, options = parse_command(argv)
        commands = {"compare": compare, "eval": run_eval, "train": run, "models": list_models,
                    "doctor": doctor, "finished": finished}
        outcome = commands[command](cfg, **options)
    except (ConfigError, DataError) as exc:
        print(f"ray_dp.py: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"ray_dp.py: training failed: {exc}", file=sys.stderr)
        return 1
    except RunStopped as exc:
        print(f"ray_dp.py: {exc}", file=sys.stderr)
        return 143  # 128 + SIGTERM, as a shell reports one
    except ray.train.TrainingFailedError as exc:  # --eval-only's workers
        print(f"ray_dp.py: evaluation failed: {describe_training_error(exc, {})}", file=sys.stderr)
        return 1
    except OSError as exc:  # an evaluation's result.json or predictions
        if not disk_full(exc):
            raise
        print(f"ray_dp.py: error: {full_device(cfg, exc)}: free space and run the same command "
              f"again", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"ray_dp.py: {interrupted(command, cfg)}", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a Ctrl-C
    return 1 if command == "doctor" and not outcome else 0


if __name__ == "__main__":
    # What the imports made (torch's and Ray's objects, about 300,000) stays out of every garbage
    # collection of this command, the one at its exit too: most of a second of a one-line error.
    gc.freeze()
    sys.exit(main())
