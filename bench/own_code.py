#!/usr/bin/env python
"""Your own model, data and loss through ray-dp on 2 Ray workers, against the same model trained in one plain
PyTorch process (a DataLoader, SGD with momentum, the same cosine schedule, batch and epochs). Writes
bench/own_code.md and bench/own_code.json.

    python bench/own_code.py          # 4 ray-dp runs and 4 plain ones, about 3 minutes on 2 cores

The cases are the README's: a CNN of the tutorial's kind (dropout, log_softmax) on digits, an MLP on scikit-learn's
wine table, a regression (diabetes, --loss mse), and a class defined in a notebook-like script (ray_dp.train).
"""
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
import ray_dp  # noqa: E402  (the digits loader only: the plain loop's data are ray-dp's)

USER_CODE = os.path.join(REPO, "tests", "user_code.py")
NOTEBOOK_NET = '''
import torch.nn as nn


class Net(nn.Module):  # a notebook's own model
    def __init__(self, sample_shape, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.net(x)
'''
NOTEBOOK = NOTEBOOK_NET + '''

if __name__ == "__main__":
    import json, sys
    sys.path.insert(0, {repo!r})
    import ray_dp
    summary = ray_dp.train(model=Net, dataset="digits", workers=2, epochs=5, storage_path={runs!r}, quiet=True)
    print("RESULT", json.dumps(summary["final"]))
'''

CASES = [  # name, what the user types (the ray-dp run), the plain loop's model, data, loss, epochs, batch, lr
    ("CNN with dropout and log_softmax on digits",
     ["--model", "tests/user_code.py:SmallCNN", "--dataset", "digits"], "SmallCNN", "digits", "cross_entropy", 10, 64,
     0.05),
    ("MLP on scikit-learn's wine",
     ["--model", "tests/user_code.py:TabularMLP", "--dataset", "tests/user_code.py:wine", "--epochs", "20",
      "--batch-size", "16"], "TabularMLP", "wine", "cross_entropy", 20, 16, 0.05),
    ("regression: diabetes, --loss mse",
     ["--model", "tests/user_code.py:TabularMLP", "--dataset", "tests/user_code.py:diabetes", "--loss", "mse",
      "--epochs", "20", "--batch-size", "32", "--lr", "0.01"], "TabularMLP", "diabetes", "mse", 20, 32, 0.01),
    ("a notebook's class (ray_dp.train(model=Net))", None, "Net", "digits", "cross_entropy", 5, 64, 0.05),
]


def module_from(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plain(model_name, data_name, loss_name, epochs, batch, lr):
    """One process, the loop a user would write; whole batches only, as ray-dp's global batch."""
    torch.manual_seed(0)
    user = module_from(USER_CODE, "user_code")
    if data_name == "digits":
        train, test = ray_dp.load_digits()
    else:
        train, test = getattr(user, data_name)(*([None] if data_name == "diabetes" else []))
    outputs = 1 if loss_name == "mse" else 10 if data_name == "digits" else len(train.classes)
    shape = tuple(train[0][0].shape)
    model = (user.SmallCNN() if model_name == "SmallCNN" else user.TabularMLP(shape, outputs)
             if model_name == "TabularMLP" else module_from_text(NOTEBOOK_NET).Net(shape, outputs))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_of = ((lambda out, y: F.mse_loss(out.reshape(y.shape), y)) if loss_name == "mse" else F.cross_entropy)
    for epoch in range(epochs):
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * epoch / epochs))
        model.train()
        for x, y in DataLoader(train, batch_size=batch, shuffle=True, drop_last=True):
            optimizer.zero_grad()
            loss_of(model(x), y).backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        out = model(x)
        result = {"test_loss": loss_of(out, y).item(), "test_count": len(y)}
        if loss_name != "mse":
            result["test_acc"] = (out.argmax(1) == y).float().mean().item()
    return result


def module_from_text(text):
    path = os.path.join(tempfile.mkdtemp(), "notebook_net.py")
    with open(path, "w") as f:
        f.write(text)
    return module_from(path, "notebook_net")


def ray_dp_run(flags, runs):
    """The command as a user types it, from the repository; the run's result.json."""
    command = [sys.executable, "ray_dp.py", "--workers", "2", "--quiet", "--storage-path", runs, "--logdir",
               os.path.join(runs, "tb"), "--name", "run", *flags]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    with open(os.path.join(runs, "run", "result.json")) as f:
        return json.load(f)["final"], " ".join(["python", "ray_dp.py", "--workers", "2", *flags])


def notebook_run(runs):
    script = os.path.join(runs, "notebook.py")
    with open(script, "w") as f:
        f.write(NOTEBOOK.format(repo=REPO, runs=runs))
    done = subprocess.run([sys.executable, script], cwd=runs, capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"the notebook script failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    final = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])
    return final, "ray_dp.train(model=Net, dataset=\"digits\", workers=2, epochs=5)"


def main():
    rows, started = [], time.time()
    for name, flags, model, data, loss, epochs, batch, lr in CASES:
        with tempfile.TemporaryDirectory() as runs:
            ours, command = ray_dp_run(flags, runs) if flags else notebook_run(runs)
        theirs = plain(model, data, loss, epochs, batch, lr)
        rows.append({"case": name, "command": command, "ray_dp": ours, "plain": theirs})
        print(name, {k: ours.get(k) for k in ("test_acc", "test_loss")}, theirs, flush=True)
    minutes = (time.time() - started) / 60
    with open(os.path.join(HERE, "own_code.json"), "w") as f:
        json.dump(rows, f, indent=1)
    lines = [f"# Your own code: ray-dp on 2 Ray workers against one plain process (`python bench/own_code.py`, "
             f"{minutes:.0f} minutes)", "",
             "Each case as a user types it (the models and data sets are tests/user_code.py's), against the same "
             "model, data, loss, batch, epochs and cosine schedule trained by a plain PyTorch loop in one process "
             "(a shuffled DataLoader, whole batches only, SGD momentum 0.9). The two differ in data order and "
             "initial weights' stream, not in the maths (the differential tests show N workers equal one process "
             "for the same order: tests/test_differential.py).", "",
             "| case | command | ray-dp: test acc | plain: test acc | ray-dp: test loss | plain: test loss |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        acc = [f"{row[side]['test_acc']:.3f}" if "test_acc" in row[side] else "-" for side in ("ray_dp", "plain")]
        loss = [f"{row[side]['test_loss']:.3f}" for side in ("ray_dp", "plain")]
        lines.append(f"| {row['case']} | `{row['command']}` | {acc[0]} | {acc[1]} | {loss[0]} | {loss[1]} |")
    with open(os.path.join(HERE, "own_code.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
