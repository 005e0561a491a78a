"""Shared fixtures: one local Ray cluster for the whole session, and a gloo process-group launcher."""
import os
import sys
import urllib.error

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # tests import ray_dp (and helpers, beside them) by name
# Ray workers import ray_dp by name when the tests pass them its functions.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


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
