"""What several test files share: the repository's path, small random data, a gloo process-group
launcher for exact maths tests (no Ray), and a training run through ray_dp.main with its result."""
import concurrent.futures
import contextlib
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ray_dp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_images(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return ray_dp.TensorDataset(torch.rand(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen))


def _entry(rank, world, fn, workdir, keep_freed):
    # what the rank prints (gloo's C++ log lines, torch's warnings) goes to its log, shown if a rank fails: a test that
    # expects a rank to miss a barrier prints nothing between pytest's dots
    log = os.open(os.path.join(workdir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(log, 1)
    os.dup2(log, 2)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        if keep_freed:  # as worker_setup does in every training process
            ray_dp.keep_freed_memory()
        # loader processes forked, as torchrun's and Ray's workers fork them (a forkserver's child would start a
        # forkserver of its own, seconds of imports per rank)
        mp.set_start_method("fork", force=True)
        args = torch.load(os.path.join(workdir, "args.pt"), weights_only=False)
        torch.save(fn(*args), os.path.join(workdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# Each gloo test's processes are forked from one server process that has imported torch, ray_dp and these helpers
# (multiprocessing's forkserver): a fresh process per rank, as mp.spawn gives, without its seconds of imports. The ranks
# take the test's working directory and sys.path, but the environment the server started with (conftest starts it
# after collection): a test that sets a variable for its ranks passes it to them as an argument.
FORKSERVER = mp.get_context("forkserver")
# What a forkserver started anew imports (without fork_server_from_here, or once its server has gone): torch._dynamo
# too, which torch.optim imports with the first optimizer (3 s of CPU in every process), and torchvision, which every
# rank on a folder or a torchvision model imports. Not scikit-learn: user_code.py reads its tables without it.
PRELOAD = ["torch", "torch._dynamo", "torchvision", "ray_dp", "helpers", "pytest"]
FORKSERVER.set_forkserver_preload(PRELOAD)
IMPORTED_BEFORE_PRELOAD = set()  # the modules the tests' collection had imported (ray_dp's too): test_data reads it


def fork_server_from_here():
    """multiprocessing's forkserver, forked from this process once it has imported what the tests import (after their
    collection) rather than started anew: under pytest-xdist each worker would otherwise import torch, torchvision and
    ray_dp twice, 6 s of CPU of each worker's first 15 s. Call it while this process runs one thread of its own: the
    server is forked from it, Ray is not started yet, and the server never returns into pytest. The server freezes
    what it holds (gc.freeze): the ranks' garbage collections leave its objects out, and their pages shared."""
    import multiprocessing.connection
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker
    import socket

    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:
        return
    IMPORTED_BEFORE_PRELOAD.update(sys.modules)
    for module in PRELOAD:  # what the collected tests have not imported yet (a rank's DDP imports torch._dynamo)
        importlib.import_module(module)
    multiprocessing.resource_tracker.ensure_running()  # the ranks inherit its descriptor through the server
    address = multiprocessing.connection.arbitrary_address("AF_UNIX")
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(address)
        os.chmod(address, 0o600)
        listener.listen()
        alive_r, alive_w = os.pipe()  # the server stops when every process that holds alive_w has ended
        pid = os.fork()
        if pid == 0:
            try:
                os.close(alive_w)
                gc.freeze()
                gc.enable()  # (off while the tests were collected)
                multiprocessing.forkserver.main(listener.fileno(), alive_r, [])
            finally:
                os._exit(0)
        os.close(alive_r)
    server._forkserver_address, server._forkserver_alive_fd, server._forkserver_pid = address, alive_w, pid


class Distributed:
    """fn(*args) started on `world` local processes joined in a gloo process group; join() waits for them and
    returns their return values, in rank order. This process is free meanwhile; leaving a `with Distributed(...)`
    block before join() (an error) stops them. Each keeps freed memory as a training process does (keep_freed=False:
    glibc's default)."""

    def __init__(self, fn, world, *args, keep_freed=True):
        self.world, self.workdir = world, tempfile.TemporaryDirectory()
        # through a file: the forkserver sends a process at most 252 file descriptors, one per tensor shared
        torch.save(args, os.path.join(self.workdir.name, "args.pt"))
        self.processes = mp.start_processes(_entry, args=(world, fn, self.workdir.name, keep_freed), nprocs=world,
                                            join=False, start_method="forkserver")

    def __enter__(self):
        return self

    def __exit__(self, *error):
        for process in self.processes.processes:
            if process.is_alive():
                process.terminate()
                process.join(5)
        self.workdir.cleanup()

    def join(self):
        with self.workdir as workdir:
            try:
                while not self.processes.join():  # raises if a rank failed, after stopping the others
                    pass
            except Exception:
                for r in range(self.world):  # into the failed test's report
                    if os.path.exists(log := os.path.join(workdir, f"rank{r}.log")):
                        print(f"--- rank {r}'s output ---\n{open(log, errors='replace').read()}", file=sys.stderr)
                raise
            return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False) for r in range(self.world)]


def run_distributed(fn, world, *args, keep_freed=True):
    """fn(*args) on `world` local processes joined in a gloo process group; their return values, in rank order."""
    with Distributed(fn, world, *args, keep_freed=keep_freed) as ranks:  # stopped if this process is interrupted
        return ranks.join()


# A process started as Ray starts a training worker: another hash seed, glibc's one arena (ray_dp's runtime
# environment), ray_dp imported. It runs what the tests send it, one request at a time: `argument` in, `result` out.
SERVE = """
import os, pickle, sys, traceback
import ray_dp, torch
requests, answers = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)  # what the code prints, even to file descriptor 1, goes to stderr
sys.stdout = sys.stderr
while True:
    try:
        source, argument = pickle.load(requests)
    except EOFError:
        break
    namespace = {"argument": argument}
    try:
        exec(source, namespace)
        answer = (True, namespace.get("result"))
    except BaseException:  # (SystemExit too: the process serves on)
        answer = (False, traceback.format_exc())
    pickle.dump(answer, answers)
    answers.flush()
"""


class WorkerLikeProcess:
    """SERVE in a fresh interpreter with PYTHONHASHSEED=hash_seed and MALLOC_ARENA_MAX as ray_dp's workers get it:
    one start (3 s of CPU, its imports) for the tests that need such a process (conftest.worker_like_process)."""

    def __init__(self, hash_seed=1):
        env = {k: v for k, v in os.environ.items() if k not in ray_dp.MALLOC_SETTINGS}
        env.update(ray_dp.worker_env(ray_dp.Config())["env_vars"], PYTHONHASHSEED=str(hash_seed))
        self.process = subprocess.Popen([sys.executable, "-c", SERVE], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE)

    def run(self, source, argument=None):
        """exec(source) there, `argument` given; what it left in `result`."""
        import pickle
        try:
            pickle.dump((source, argument), self.process.stdin)
            self.process.stdin.flush()
            done, result = pickle.load(self.process.stdout)
        except (EOFError, BrokenPipeError):
            raise AssertionError(f"the worker-like process ended (exit status {self.process.wait(10)})") from None
        assert done, result
        return result

    def stop(self):
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.close()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def train(tmp_path, name, *flags):
    """ray_dp.py's main with these flags (runs and events under tmp_path); the run's result.json."""
    assert ray_dp.main(["--storage-path", str(tmp_path), "--name", name, "--logdir", str(tmp_path / "tb"),
                        *flags]) == 0
    return json.loads((tmp_path / name / "result.json").read_text())


def final_weights(result):
    return ray_dp.load_checkpoint(result["checkpoint"])["model"]


def assert_bitwise_equal(a, b):
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), "parameters differ"


def assert_ledger_adds_up(ledger, failed=0):
    """result.json's ledger: its categories sum to the wall clock, what no clock saw ("other") within 2% of it."""
    assert sum(ledger[what] for what in ray_dp.LEDGER) == pytest.approx(ledger["wall"], abs=0.01), ledger
    assert abs(ledger["other"]) < 0.02 * ledger["wall"] and ledger["failed"] == failed, ledger
    assert 0 < ledger["goodput"] < 1 and ledger["training steps"] > 0, ledger


DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def digits_folder(root, sizes=(None, None)):
    """scikit-learn's digits, split as --dataset digits splits them, saved as 28x28 PNG files in
    torchvision's ImageFolder layout: root/train/<name>/<i>.png and root/val/<name>/<i>.png (the first
    `sizes` of each split; None: all)."""
    from PIL import Image
    for split, data, size in zip(("train", "val"), ray_dp.load_digits(), sizes):
        images, labels = data.tensors
        for i, (image, label) in enumerate(zip(images[:size], labels[:size].tolist())):
            folder = root / split / DIGIT_NAMES[label]
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (image[0] * 255).round().clamp(0, 255).to(torch.uint8).numpy()
            Image.fromarray(pixels, mode="L").save(folder / f"{i:04d}.png")
    return root


def ray_snapshot_json(*names):
    """Ray's snapshot of a run whose checkpoints are these directories, as Ray writes it: each with its metrics, the
    latest reported last (what Ray resumes from), and the keys ray_dp does not read."""
    committed = [{"checkpoint_dir_name": name, "metrics": {"epoch": i + 1}} for i, name in enumerate(names)]
    return json.dumps({"ray_version": "2.60.0", "checkpoint_results": committed,
                       "checkpoint_report_indices": list(range(len(names))),
                       "latest_checkpoint_result": committed[-1] if committed else None,
                       "pending_training_results": [], "pending_validation_specs": [],
                       "current_report_index": len(names), "validated_checkpoint_dir_names": [],
                       "timed_out_validation_checkpoint_dir_names": [], "failed_validation_checkpoint_dir_names": []})


def save_run(run_dir, saved=(1,), **config):
    """A run directory as torchrun leaves it (checkpoint_epoch_NNN/checkpoint.pt, no Ray snapshot): the checkpoints
    after each of the epochs `saved` (numbered from 1)."""
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(**{"dataset": "digits", "name": run_dir.name,
                                                      "storage_path": str(run_dir.parent), **config}))
    model = ray_dp.build_model(cfg.model, (1, 28, 28))
    for epoch in saved:
        path = run_dir / ray_dp.checkpoint_dir_name(epoch) / ray_dp.CHECKPOINT_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(ray_dp.checkpoint_state(model.state_dict(), {}, epoch, cfg, [], [str(c) for c in range(10)]), path)
    return run_dir


def error_of(argv, capsys):
    """main(argv)'s one-line error (exit 2)."""
    assert ray_dp.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ray_dp.py: error: ") and err.count("\n") == 1, err
    return err


def upload(s3, folder, bucket, prefix):
    """Every file under folder into s3://bucket/prefix/, at the same relative paths (8 at a time: each is a request
    that waits for the server)."""
    def put(path):
        s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder).as_posix()}")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        list(pool.map(put, [path for path in sorted(folder.rglob("*")) if path.is_file()]))


def new_bucket(s3, name):
    s3.create_bucket(Bucket=name)
    return name


def keys(s3, bucket, prefix=""):
    """Every object's key in the bucket (under prefix), sorted."""
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def train_worker(cfg, worker, launcher, options, *_):
    """ray_dp's worker loop (what Ray's and torchrun's workers run) in this process group, with this test's worker
    and launcher."""
    loop = ray_dp.scratch_loop_per_worker if cfg.mode == "scratch" else ray_dp.train_loop_per_worker
    return loop({"config": cfg, "options": options, "worker": worker, "launcher": launcher})


def here(device=torch.device("cpu")):
    """This process as a ray_dp worker of its process group (rank 0 of 1 without one)."""
    return ray_dp.Worker(*ray_dp.rank_and_world(), device)
