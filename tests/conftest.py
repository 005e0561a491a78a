"""Shared fixtures: one local Ray cluster for the whole session, and a gloo process-group launcher."""
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

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
# to ask for others: nothing goes to any other address. The server starts with the first test that
# needs it (s3), one per pytest-xdist worker.
S3_PORT = free_port()
os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}", "AWS_ACCESS_KEY_ID": "testing",
                   "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                   "AWS_EC2_METADATA_DISABLED": "true"})


def start_s3_server(port: int, **env) -> subprocess.Popen:
    """moto's S3 server on 127.0.0.1:port, once it answers."""
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
            return server
        except urllib.error.HTTPError:  # an answer (refusing, when it checks credentials)
            return server
        except OSError:
            if server.poll() is not None or time.time() > deadline:
                server.kill()
                raise RuntimeError(f"moto's S3 server did not start on 127.0.0.1:{port}")
            time.sleep(0.1)


def stop(server: subprocess.Popen) -> None:
    server.terminate()  # by its own process ID
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()


def pytest_configure(config):
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch
        # one of 2 workers on 2 cores: a second thread of torch's would take the other worker's core (and spin
        # waiting for it)
        torch.set_num_threads(1)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items):
    """pytest-xdist runs the tests on 2 processes (pytest.ini), and each of these groups on one of them: every Ray
    test (one Ray instance for the session), and the other tests of a module that names its XDIST_GROUP (those that
    share a module-scoped fixture). The gloo tests' forkserver (helpers.FORKSERVER: it imports torch and ray_dp)
    starts now, while collection ends."""
    for item in items:
        if item.get_closest_marker("ray"):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif hasattr(item.module, "XDIST_GROUP"):
            item.add_marker(pytest.mark.xdist_group(item.module.XDIST_GROUP))
    if any(getattr(item.module, "run_distributed", None) or getattr(item.module, "Distributed", None)
           for item in items):
        import multiprocessing.forkserver
        multiprocessing.forkserver.ensure_running()


@pytest.fixture(scope="session")
def s3():
    """The S3 server for the session (of this pytest-xdist worker), and a boto3 client of it (buckets are made with
    it)."""
    import boto3
    server = start_s3_server(S3_PORT)
    yield boto3.client("s3")
    stop(server)


@pytest.fixture
def refusing_s3(monkeypatch):
    """An S3 server that refuses every request's credentials, as AWS_ENDPOINT_URL."""
    port = free_port()
    server = start_s3_server(port, INITIAL_NO_AUTH_ACTION_COUNT="0")  # moto checks credentials
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    yield f"http://127.0.0.1:{port}"
    stop(server)


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray instance shared by every test that trains through Ray (start-up costs ~20 s)."""
    import ray

    import ray_dp
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
