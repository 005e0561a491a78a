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
            assert [step for _, step, _ in points] == [1, 2] == [m["epoch"] for m in result["epochs"]]  # one numbering
            assert [value for _, _, value in points] == pytest.approx([m[key] for m in result["epochs"]], rel=1e-6)
        # Per-step loss: 22 steps per epoch, logged every 5 steps of the run, averaged over both workers.
        steps = tensorboard("plugin/scalars/scalars", run=name, tag="train/loss_step")
        expected = [entry for m in result["epochs"] for entry in m["step_log"]]
        assert [step for _, step, _ in steps] == [5, 10, 15, 20, 25, 30, 35, 40] == [s for s, _ in expected]
        assert [value for _, _, value in steps] == pytest.approx([loss for _, loss in expected], rel=1e-6)
    tags = tensorboard("plugin/scalars/tags")["run-a"]
    assert {"time/epoch_seconds", "time/samples_per_second", "time/data_seconds", "train/lr"} <= set(tags)
    # where the time went (result.json's ledger), at the run's last epoch
    assert {f"ledger/{what.replace(' ', '_')}_seconds" for what in ray_dp.LEDGER} | {"ledger/goodput"} <= set(tags)
    goodput = tensorboard("plugin/scalars/scalars", run="run-a", tag="ledger/goodput")
    assert [(step, value) for _, step, value in goodput] == [(2, pytest.approx(results["run-a"]["ledger"]["goodput"]))]
    assert tensorboard("plugin/text/tags")["run-a"] == ["config/text_summary"]


def readme_quick_start_output():
    """The lines the README's quick start says the command prints."""
    with open(os.path.join(REPO, "README.md")) as f:
        after = f.read().split("What it prints:\n\n```\n", 1)[1]
    return after.split("\n```", 1)[0].splitlines()


def as_pattern(line):
    """A README line as a pattern: its words and punctuation as they are, any number where it has one, anything
    where it says '...'."""
    parts = re.split(r"(\.\.\.|\d+(?:\.\d+)?)", line)
    return "".join(".*" if part == "..." else r"\d+(?:\.\d+)?" if re.fullmatch(r"[\d.]+", part) else re.escape(part)
                   for part in parts)


def has_shape_of(readme, printed):
    """The printed lines, in order, are the README's but for numbers; a README line '...' stands for any lines. Of
    the time line, the categories after the cluster's are LEDGER's, in its order, each there when it took a
    twentieth of a second or more."""
    later = "".join(rf"(?:, {re.escape(what)} (?!0\.0 )\d+\.\d s)?" for what in ray_dp.LEDGER[2:]
                    if what != "training steps")
    def shape(line):
        if line.startswith("ray-dp: time:"):
            head = re.match(r".*? cluster [\d.]+ s", line)
            assert re.fullmatch(later, line[head.end():]), f"the README's time line is not LEDGER's: {line}"
            return as_pattern(head.group(0)) + later
        return as_pattern(line)
    pattern = "".join("(?:.*\n)*?" if line == "..." else shape(line) + "\n" for line in readme)
    return re.fullmatch(pattern, "\n".join(printed) + "\n") is not None


def test_the_quick_start_prints_what_the_readme_shows_one_epoch_line_each_from_rank_0_without_colour_codes(
        tmp_path):
    # The README's quick start with fewer epochs, on the shared cluster, its output piped (as to a file).
    env = dict(os.environ, RAY_AUTH_MODE="token")  # the shared cluster uses token auth (Ray's default)
    proc = subprocess.run(
        [sys.executable, "ray_dp.py", "--workers", "2", "--dataset", "digits", "--epochs", "3", "--cpu",
         "--address", ray.get_runtime_context().gcs_address, "--storage-path", str(tmp_path / "runs"),
         "--logdir", str(tmp_path / "runs" / "tensorboard")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = re.findall(r"^(epoch \d+/3):", proc.stdout, re.MULTILINE)
    assert lines == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]  # rank 0's alone, without Ray's prefix
    assert "\x1b" not in proc.stdout + proc.stderr  # no colour codes in a pipe
    assert "Reporting training result" not in proc.stdout + proc.stderr  # Ray's per-report chatter is off
    assert "Traceback" not in proc.stdout + proc.stderr and proc.stderr == ""
    run_dir = next((tmp_path / "runs").glob("ddp-lenet-digits-*"))
    assert not (run_dir / "ray.log").exists() or "Traceback" not in (run_dir / "ray.log").read_text()
    assert has_shape_of(readme_quick_start_output(), proc.stdout.strip().splitlines()), proc.stdout
    best = json.loads((run_dir / "result.json").read_text())["best"]
    assert proc.stdout.strip().splitlines()[-1] == (
        f"wrote {run_dir / 'result.json'} and checkpoint_epoch_001 to checkpoint_epoch_003, checkpoint_best (epoch "
        f"{best['epoch']}, test_loss {best['value']:.4g}) beside it; TensorBoard events in "
        f"{tmp_path / 'runs' / 'tensorboard' / run_dir.name}")


def test_the_shape_check_tells_other_lines_apart():
    readme = ["ray-dp: 2 workers", "(w pid=1) epoch 1/10: acc 0.5", "...", "(w pid=1) epoch 10/10: acc 0.9",
              "ray-dp: time: 9.0 s; driver 1.0 s, cluster 2.0 s, data 0.1 s, saves 0.2 s",
              "wrote .../runs/x-1/result.json"]
    printed = ["ray-dp: 2 workers", "(w pid=7) epoch 1/3: acc 0.4", "(w pid=7) epoch 2/3: acc 0.6",
               "(w pid=7) epoch 3/3: acc 0.8", "ray-dp: time: 7.5 s; driver 1.5 s, cluster 3.0 s, data 0.1 s",
               "wrote /tmp/a/runs/x-2/result.json"]
    assert has_shape_of(readme, printed)
    assert not has_shape_of(readme, printed[:-1] + ["wrote /tmp/a/runs/x-2/results.json"])  # another name
    assert not has_shape_of(readme, [line.replace("acc", "accuracy") for line in printed])
    assert not has_shape_of(readme, printed[1:])  # a line missing
    for tail, shown in [(", waits for data 0.1 s, saves 0.3 s", True), ("", True), (", saves 0.1 s, data 0.2 s", False),
                        (", training steps 0.1 s", False), (", lunch 0.1 s", False), (", saves 0.0 s", False)]:
        time_line = "ray-dp: time: 7.5 s; driver 1.5 s, cluster 3.0 s" + tail  # LEDGER's, in its order, >= 0.05 s
        assert has_shape_of(readme, printed[:4] + [time_line, printed[5]]) == shown, tail
    with pytest.raises(AssertionError, match="not LEDGER's"):  # a README that names a category LEDGER lacks
        has_shape_of([line + ", lunch 0.1 s" if line.startswith("ray-dp: time") else line for line in readme], printed)
