"""Shared fixtures: one local Ray cluster for the whole session, and a gloo process-group launcher."""
import gc
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from importlib.metadata import version

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # tests import ray_dp (and helpers, beside them) by name
# Ray workers import ray_dp by name when the tests pass them its functions.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Object storage: an S3-protocol server (moto's) on 127.0.0.1, reached as a user reaches any
# S3-compatible store, through AWS_ENDPOINT_URL. Said here, before the shared Ray starts, so that its
# processes reach it too; credentials of the server's own (it takes any), and no instance metadata
# to ask for others: nothing goes to any other address. A pytest-xdist worker starts one for its first
# test that needs it (s3), or before its Ray if its session has such a test (the port was picked here:
# Ray's processes would take other ports meanwhile).
S3_PORT = free_port()
os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}", "AWS_ACCESS_KEY_ID": "testing",
                   "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                   "AWS_EC2_METADATA_DISABLED": "true"})


def launch_s3_server(port: int, **env) -> subprocess.Popen:
    """moto's S3 server starting on 127.0.0.1:port (answers_at: once it answers)."""
    return subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def answers_at(server: subprocess.Popen, port: int) -> subprocess.Popen:
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
        except urllib.error.HTTPError:  # an answer (refusing, when it checks credentials)
            pass
        except OSError:
            if server.poll() is None and time.time() < deadline:
                time.sleep(0.1)
                continue
        if server.poll() is not None or time.time() > deadline:  # not ours: it exited (the port was taken)
            server.kill()
            raise RuntimeError(f"moto's S3 server did not start on 127.0.0.1:{port}")
        return server


def start_s3_server(port: int, **env) -> subprocess.Popen:
    """moto's S3 server on 127.0.0.1:port, once it answers."""
    return answers_at(launch_s3_server(port, **env), port)


def stop(server: subprocess.Popen) -> None:
    server.terminate()  # by its own process ID
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()


_s3_server = None  # this worker's, launched by its first test that needs it


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own
def pytest_configure(config):
    if (status := config.pluginmanager.get_plugin("terminaldistreporter")) and config.option.verbose < 0:
        status.getstatus = lambda: ""  # -q: dots only, not pytest-xdist's "bringing up nodes..." lines
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", 0):  # a process that collects tests
        gc.disable()  # until collection ends (one collection then, not dozens during its imports: seconds of CPU)
    if hasattr(config, "workerinput"):  # an xdist worker (not its subprocesses, which inherit PYTEST_XDIST_WORKER)
        import torch
        # one of 2 workers on 2 cores: a second thread of torch's would take the other worker's core (and spin
        # waiting for it)
        torch.set_num_threads(1)
    elif config.getoption("numprocesses", 0) and config.getoption("dist", "no") == "loadgroup" and groups_nothing():
        raise pytest.UsageError(f"pytest-xdist {version('pytest-xdist')} groups no test on pytest {pytest.__version__} "
                                "(xdist #1386): the tests of a group would spread over the workers (more Rays than "
                                "two, module fixtures made twice); install "
                                "requirements-test.txt (pytest 9.1), or run with -n 0")


def groups_nothing() -> bool:
    """pytest-xdist 3.8 marks a test's group in its node ID, which pytest 9.2 no longer reads."""
    def major_minor(package):
        return tuple(int(part) for part in version(package).split(".")[:2])
    return major_minor("pytest") >= (9, 2) and major_minor("pytest-xdist") <= (3, 8)


# Ray's tests in two groups of about equal time, each with a Ray of its own (ray_cluster): pytest-xdist hands a group
# to a worker as it runs short of tests, so they run side by side on most runs (one after the other otherwise).
RAY_GROUPS = dict.fromkeys(["test_multinode", "test_newcomer", "test_doctor", "test_object_storage", "test_monitoring",
                            "test_ray_internals"], "ray-b")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """pytest-xdist runs the tests on 2 processes (pytest.ini), and each of these groups on one of them: each of
    RAY_GROUPS' two groups of Ray tests (a Ray instance each), and the other tests of a module that names its
    XDIST_GROUP (those that share a module-scoped fixture). The gloo tests' forkserver starts now
    (helpers.fork_server_from_here: forked from here). Then this process is set up as a training process
    (keep_freed_memory) and its objects so far frozen."""
    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group(RAY_GROUPS.get(item.module.__name__, "ray")))
        elif hasattr(item.module, "XDIST_GROUP"):
            item.add_marker(pytest.mark.xdist_group(item.module.XDIST_GROUP))
    gc.collect()  # the collection's garbage, once (before the forkserver is forked: it freezes what it holds)
    if any(getattr(item.module, "run_distributed", None) or getattr(item.module, "Distributed", None)
           for item in items):
        import helpers
        helpers.fork_server_from_here()
    if "ray_dp" in sys.modules:  # (one that cannot be imported is the collection's error, named with its file)
        sys.modules["ray_dp"].keep_freed_memory()  # this process trains as a training process does (server forked)
    # What collection made (torch's, torchvision's, Ray's and the tests' objects) stays out of every later garbage
    # collection, the one at exit too (a second of CPU per process).
    gc.freeze()
    gc.enable()


_cleaning = None  # the thread that removes older runs' temporary directories


@pytest.hookimpl(trylast=True)  # after pytest-xdist's, which made this run's temporary directory
def pytest_sessionstart(session):
    """The temporary directories of runs before the last tmp_path_retention_count, which pytest removes as the run
    ends (a second of the disk's for the thousands of files a run leaves), go now, in a thread: under pytest-xdist
    this process only waits for its workers meanwhile."""
    global _cleaning
    config = session.config
    keep = int(config.getini("tmp_path_retention_count"))
    if (hasattr(config, "workerinput") or config.option.basetemp or not keep
            or config.getini("tmp_path_retention_policy") == "none"):
        return
    from _pytest.pathlib import LOCK_TIMEOUT, cleanup_numbered_dir  # pytest's own, with its locks
    root = config._tmp_path_factory.getbasetemp().parent
    _cleaning = threading.Thread(target=cleanup_numbered_dir, daemon=True,
                                 args=(root, "pytest-", keep, time.time() - LOCK_TIMEOUT))
    _cleaning.start()


@pytest.hookimpl(tryfirst=True)  # before pytest's own cleanup
def pytest_sessionfinish(session):
    if _cleaning is not None:
        _cleaning.join()


@pytest.hookimpl(trylast=True)  # after every other plugin's
def pytest_unconfigure(config):
    gc.enable()  # (a session that ended before its collection did: pytest.main in a notebook goes on)
    if _s3_server is not None:
        stop(_s3_server)
    if hasattr(config, "workerinput"):  # an xdist worker (not its subprocesses, which inherit PYTEST_XDIST_WORKER)
        # A worker has sent its results: it leaves without Python's finalization, which frees every object of
        # torch's, Ray's and the tests' one by one (seconds, at the end of the run).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def launch_this_workers_s3_server():
    global _s3_server
    _s3_server = _s3_server or launch_s3_server(S3_PORT)


@pytest.fixture(scope="session")
def s3():
    """This worker's S3 server for the session, and a boto3 client of it (buckets are made with it)."""
    launch_this_workers_s3_server()
    import boto3  # (while the server starts)
    answers_at(_s3_server, S3_PORT)
    yield boto3.client("s3")


@pytest.fixture
def refusing_s3(monkeypatch):
    """An S3 server that refuses every request's credentials, as AWS_ENDPOINT_URL."""
    port = free_port()
    server = start_s3_server(port, INITIAL_NO_AUTH_ACTION_COUNT="0")  # moto checks credentials
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    yield f"http://127.0.0.1:{port}"
    stop(server)


@pytest.fixture(scope="session")
def worker_like_process():
    """helpers.WorkerLikeProcess for the session (its tests share an xdist group: one start)."""
    import helpers
    process = helpers.WorkerLikeProcess()
    yield process
    process.stop()


@pytest.fixture(scope="session")
def ray_cluster(request):
    """One local Ray instance shared by the Ray tests of a pytest-xdist worker (start-up costs ~20 s)."""
    import ray

    import ray_dp
    if any("s3" in item.fixturenames for item in request.session.items):
        launch_this_workers_s3_server()
    # 4 logical CPUs on a 2-core machine: room for 3 one-CPU workers plus Ray Train's controller.
    ray.init(address="local", num_cpus=4, include_dashboard=False, runtime_env=ray_dp.RUNTIME_ENV,
             logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture
def no_cluster(monkeypatch):
    """As on a fresh 2-core machine without GPUs or network; starting Ray fails the test."""
    import ray
    import torch
    import torchvision

    def refuse(*args, **kwargs):
        raise AssertionError("a Ray cluster was started for bad input")
    monkeypatch.setattr(ray, "init", refuse)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)

    def no_network(self):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(torchvision.datasets.FashionMNIST, "download", no_network)
