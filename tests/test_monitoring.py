"""Monitoring: TensorBoard events read back through a real TensorBoard server; one line per epoch."""
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request

import pytest
import ray

import ray_dp
from helpers import REPO

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_cluster")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


@pytest.fixture
def tensorboard(tmp_path):
    """A real TensorBoard server on 127.0.0.1 reading tmp_path/tb; yields a function to query its HTTP API."""
    logdir, port = tmp_path / "tb", free_port()
    logdir.mkdir()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host",
                               "127.0.0.1", "--port", str(port), "--reload_interval", "1", "--load_fast", "false"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def query(path, **params):
        return get_json(f"http://127.0.0.1:{port}/data/{path}?{urllib.parse.urlencode(params)}")

    query.logdir = logdir
    try:
        yield query
    finally:
        server.kill()  # by its PID, ours alone
        server.wait()


def wait_for(fetch, ready, seconds=60):
    deadline = time.time() + seconds
    while True:
        try:
            value = fetch()
            if ready(value):
                return value
        except OSError:  # server still starting
            pass
        assert time.time() < deadline, "TensorBoard never showed the expected data"
        time.sleep(1)


def test_tensorboard_serves_the_metrics_of_result_json_for_each_run(tmp_path, tensorboard):
    results = {}
    for name, seed in [("run-a", 0), ("run-b", 1)]:
        assert ray_dp.main(["--workers", "2", "--dataset", "digits", "--epochs", "2", "--seed", str(seed),
                            "--storage-path", str(tmp_path / "runs"), "--name", name,
                            "--logdir", str(tensorboard.logdir), "--log-every", "5"]) == 0
        results[name] = json.loads((tmp_path / "runs" / name / "result.json").read_text())

    runs = wait_for(lambda: tensorboard("runs"), lambda r: {"run-a", "run-b"} <= set(r))
    assert {"run-a", "run-b"} <= set(runs)  # two runs under one logdir: two runs in TensorBoard
    for name, result in results.items():
        for tag, key in [("test/acc", "test_acc"), ("train/loss", "train_loss"), ("test/loss", "test_loss")]:
            points = wait_for(lambda: tensorboard("plugin/scalars/scalars", run=name, tag=tag), lambda p: len(p) == 2)
            assert [step for _, step, _ in points] == [1, 2]
            assert [value for _, _, value in points] == pytest.approx([m[key] for m in result["epochs"]], rel=1e-6)
        # Per-step loss: 22 steps per epoch, logged every 5, averaged over both workers.
        steps = tensorboard("plugin/scalars/scalars", run=name, tag="train/loss_step")
        expected = [entry for m in result["epochs"] for entry in m["step_log"]]
        assert [step for _, step, _ in steps] == [5, 10, 15, 20, 27, 32, 37, 42] == [s for s, _ in expected]
        assert [value for _, _, value in steps] == pytest.approx([loss for _, loss in expected], rel=1e-6)
    tags = tensorboard("plugin/scalars/tags")["run-a"]
    assert {"time/epoch_seconds", "time/samples_per_second", "time/data_seconds", "train/lr"} <= set(tags)
    assert tensorboard("plugin/text/tags")["run-a"] == ["config/text_summary"]


def test_console_shows_exactly_one_epoch_line_per_epoch_from_rank_0_only(tmp_path):
    env = dict(os.environ, RAY_AUTH_MODE="token")  # the shared cluster uses token auth (Ray's default)
    proc = subprocess.run(
        [sys.executable, "ray_dp.py", "--workers", "2", "--dataset", "digits", "--epochs", "3", "--cpu",
         "--address", ray.get_runtime_context().gcs_address, "--storage-path", str(tmp_path), "--name", "console",
         "--logdir", str(tmp_path / "tb")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = re.findall(r"\(RayTrainWorker pid=(\d+)[^)]*\)\S* (epoch \d+/3):", proc.stdout)
    assert [epoch for _, epoch in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert len({pid for pid, _ in lines}) == 1  # rank 0 alone
    assert "Reporting training result" not in proc.stdout + proc.stderr  # Ray's per-report chatter is off
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1].startswith("test acc: ")
