"""Shared fixtures: one local Ray cluster for the whole session, and a gloo process-group launcher."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
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
