#!/usr/bin/env python
"""The baseline for ray_dp's start-up: a bare Ray Train run whose workers do nothing but report
once, started as `ray_dp.py --workers N` starts its own (a local Ray, the same runtime environment
variables, report interval, scaling config, backend and Ray Train settings). Prints one JSON line of
clock times: this script's start, its imports done, Ray up, rank 0's loop started.

    python bench/bare_trainer.py --workers 2
"""
import time

STARTED = time.time()

import argparse  # noqa: E402  (after the clock starts, as in ray_dp.py)
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import tempfile  # noqa: E402

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train import RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402

IMPORTED = time.time()


def loop(config):
    started = time.time()
    ray.train.report({"loop": started})
    return {"loop": started}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    # ray_dp's settings: the controller's report poll, Ray's env vars for the workers, the
    # placement-group cleaner's shorter waits (Ray Train's defaults add 10 s or more at the end)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    from ray.train.v2._internal.callbacks import placement_group_callback
    placement_group_callback.PlacementGroupCleanerCallback.__init__.__defaults__ = (1.0, 1.0, 0.1)
    ray.init(address="local", include_dashboard=False, logging_level=logging.WARNING,
             runtime_env={"env_vars": {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}})
    connected = time.time()
    with tempfile.TemporaryDirectory() as storage:
        trainer = TorchTrainer(
            loop, scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False,
                                               resources_per_worker={"CPU": 1.0}),
            run_config=RunConfig(name="bare", storage_path=storage,
                                 logging_config=ray.train.LoggingConfig(log_level="WARNING")),
            torch_config=TorchConfig(backend="gloo", timeout_s=1800))
        first_step = trainer.fit().return_value["loop"]
    ray.shutdown()
    print(json.dumps({"started_at": STARTED, "imported_at": IMPORTED, "connected_at": connected,
                      "first_step_at": first_step}))


if __name__ == "__main__":
    main()
