"""What a run's health costs: the replicas' digest per model and the interval --check-replicas auto picks from
it, the agreement all-reduce that carries it (and the stop and save votes), and the whole feature's overhead on
training at the defaults (digests, the ledger's clocks, the straggler's forward clock), on this machine's CPU.

    python bench/health.py          # about 4 minutes on 2 cores: bench/health.md and bench/health.json
    python bench/health.py --quick  # fewer repeats, a smoke test of the script
"""
import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import ray_dp  # noqa: E402

CPU = torch.device("cpu")


def mlp_100m() -> nn.Module:
    """A 100M-parameter MLP on 28x28 inputs: 784 -> 4096 -> 6 x (4096 -> 4096) -> 10."""
    layers = [nn.Flatten(), nn.Linear(784, 4096), nn.ReLU()]
    for _ in range(6):
        layers += [nn.Linear(4096, 4096), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(4096, 10))


MODELS = {"lenet": lambda: ray_dp.build_model("lenet", (1, 28, 28)),
          "resnet18 (the lesson's)": lambda: ray_dp.build_model("resnet18", (1, 28, 28)),
          "100M-parameter MLP": mlp_100m}


def median_seconds(fn, repeats):
    seconds = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - tic)
    return statistics.median(seconds)


def digest_costs(repeats):
    """Per model, one process, one thread (as a worker): the digest of its parameters (what a check between saves
    compares: ray_dp's tensor_hashes and digest), of its parameters and SGD momentum (at a save), a training step
    (forward, backward, SGD with momentum) on a micro-batch of 32 (the quick start's: global 64 on 2 workers), the
    interval --check-replicas auto picks (it aims at 0.5% of training, so that checks stay under 1%), and the checks' share of training then."""
    torch.set_num_threads(1)
    figures = {}
    worker = ray_dp.Worker(0, 1, CPU)
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model = build()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.rand(32, 1, 28, 28), torch.randint(0, 10, (32,))

        def step():
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        step()  # warm-up, and the momentum buffers a save's digest includes
        step_s = median_seconds(step, max(2, repeats))
        for stage in ("step", "save"):
            named = ray_dp.replica_state(model, optimizer, stage)
            figures[f"{name}: digest at a {stage}, ms"] = round(1e3 * median_seconds(
                lambda: ray_dp.replicas_digest(named, worker), repeats * 3), 3)
        check_s = figures[f"{name}: digest at a step, ms"] / 1e3
        every = max(math.ceil(check_s / (ray_dp.CHECK_SHARE * step_s)), 1)
        figures[f"{name}: parameters, millions"] = round(sum(p.numel() for p in model.parameters()) / 1e6, 2)
        figures[f"{name}: training step, ms"] = round(1e3 * step_s, 1)
        figures[f"{name}: --check-replicas auto checks every N steps"] = every
        figures[f"{name}: checks' share of training at that interval, %"] = round(100 * check_s / (every * step_s), 2)
    return figures


def _rank(rank, world, store, out, repeats):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        result = rank_figures(repeats)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def rank_figures(repeats):
    """On each of 2 gloo processes: the agreement's all-reduce alone; then the quick start's training (LeNet on
    digits, global batch 64) three ways, with the health checks as the defaults have them, with the replica checks
    off (the forward clock on), and with both off (Operations told of no model), their epochs interleaved (4
    epochs of each in turn, 4 x repeats epochs each, the first of each left out): samples/s (median), and within the
    defaults' run the seconds its checks took (digest and all-reduce, timed around each) as a share of its
    training."""
    world, worker = dist.get_world_size(), ray_dp.Worker(dist.get_rank(), dist.get_world_size(), CPU)
    figures = {}
    flags = torch.zeros(5 + 4 + 3 * world, dtype=torch.float64)
    agree = median_seconds(lambda: ray_dp.all_reduce_sum(flags.clone()).tolist(), 200)
    figures["the agreement: one all-reduce of 21 float64 on 2 processes, us"] = round(1e6 * agree, 1)
    cfg = ray_dp.Config(dataset="digits", workers=world, quiet=True)
    train, _ = ray_dp.load_digits()
    runs = {}
    for label in ("health on (the defaults)", "replica checks off (forward clock on)", "health off"):
        torch.manual_seed(0)
        model = ray_dp.wrap_model(ray_dp.on_device(ray_dp.build_model("lenet", (1, 28, 28)), CPU, "lenet"), CPU)
        optimizer = ray_dp.build_optimizer(cfg, model)
        checks = ray_dp.replace(cfg, check_replicas="auto" if "defaults" in label else "off")
        checkpointer = ray_dp.Operations(checks, worker)  # told of no model: health off
        checkpointer.track(None if label == "health off" else model, optimizer, None, None)
        runs[label] = [model, optimizer, ray_dp.train_batches(train, cfg, worker.rank, world, CPU), checkpointer, []]
    spent = [0.0]
    checkpointer = runs["health on (the defaults)"][3]
    agreement = checkpointer.agree

    def timed(losses, logged_step, epoch_end, check, where):
        tic = time.perf_counter()
        try:
            return agreement(losses, logged_step, epoch_end, check, where)
        finally:
            spent[0] += (time.perf_counter() - tic) if check else 0.0
    checkpointer.agree = timed
    trained, epoch = 0.0, 0
    for block in range(repeats):
        for label, (model, optimizer, batches, checks, rates) in runs.items():
            for epoch in range(4 * block, 4 * block + 4):
                metrics = ray_dp.train_epoch(model, optimizer, batches, cfg, worker, epoch % cfg.epochs, checks)
                rates.append(metrics["samples_per_second"])
                trained += metrics["epoch_seconds"] if label.startswith("health on") else 0.0
    medians = {label: statistics.median(run[4][1:]) for label, run in runs.items()}
    for label, rate in medians.items():
        figures[f"quick start's training, {label}: samples/s"] = round(rate)
    off = medians["health off"]
    figures["health on against health off, %"] = round(100 * (off - medians["health on (the defaults)"]) / off, 2)
    figures["health on: --check-replicas auto checked every N steps"] = checkpointer.agreement.checks[0].every
    figures["health on: its checks' seconds (digest and all-reduce), % of training"] = round(
        100 * spent[0] / trained, 2)
    plain, timed, x = nn.Identity(), nn.Identity(), torch.zeros(1)
    clock = ray_dp.ForwardClock(timed, CPU)  # its two hooks on a module that does nothing
    with_hooks = median_seconds(lambda: [timed(x) for _ in range(1000)] and clock.take(), 5)
    figures["the forward clock, per forward pass, us"] = round(1e6 * (with_hooks - median_seconds(
        lambda: [plain(x) for _ in range(1000)], 5)) / 1000, 2)
    ledger = ray_dp.Ledger()
    figures["a ledger charge (twice a step), us"] = round(1e6 * median_seconds(
        lambda: [ledger.charge("training steps") for _ in range(1000)], 5) / 1000, 2)
    return figures


def distributed_figures(repeats):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(_rank, args=(2, os.path.join(tmp, "store"), out, repeats), nprocs=2)
        with open(out) as f:
            return json.load(f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one repeat each: a smoke test")
    args = parser.parse_args()
    repeats = 1 if args.quick else 5
    started = time.time()
    figures = {**digest_costs(repeats), **distributed_figures(repeats)}
    machine = {"cpu": platform.machine(), "cores": os.cpu_count(), "python": platform.python_version(),
               "torch": torch.__version__}
    command = "python bench/health.py" + (" --quick" if args.quick else "")
    lines = [f"# ray-dp health checks' cost (`{command}`, {(time.time() - started) / 60:.0f} minutes)", "",
             f"Machine: {machine}", "", digest_costs.__doc__.replace("\n    ", " "), "",
             rank_figures.__doc__.replace("\n    ", " "), "", "| figure | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in figures.items()]
    with open(os.path.join(REPO, "bench", "health.json"), "w") as f:
        json.dump({"command": command, "machine": machine, "figures": figures}, f, indent=2)
    with open(os.path.join(REPO, "bench", "health.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
