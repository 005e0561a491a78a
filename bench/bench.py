#!/usr/bin/env python
"""Side-by-side benchmarks of ray_dp.py on this machine; contenders interleaved (A B A B ...), medians.

    python bench/bench.py                # about 15 minutes on 2 cores; writes bench/results.md, results.json
    python bench/bench.py --repeats 1    # a quicker, noisier look

Each figure comes from ray_dp.py's own result.json (per-epoch seconds from the workers' clocks, the first
epoch left out as warm-up) of real runs of the command line, so it measures what users run.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON = sys.executable
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
def flags(dataset="digits", model="lenet", batch=64, epochs=6, *extra):
    return ["--dataset", dataset, "--model", model, "--batch-size", str(batch), "--epochs", str(epochs), *extra]


LENET = flags()
# Compute-bound on CPU: ResNet-18 (about 3 GFLOP per 28x28 image and step) on 512 synthetic images.
RESNET = flags("synthetic", "resnet18", 32, 3)


def run(args, launcher="ray", workers=2, cpus_per_worker=1.0):
    """One run of ray_dp.py; returns its result.json plus the wall-clock seconds to its first step."""
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--storage-path", tmp, "--name", "bench", "--logdir", os.path.join(tmp, "tb"), "--quiet"]
        if launcher == "torchrun":
            command = [TORCHRUN, "--nproc_per_node", str(workers), "ray_dp.py", *args, *common]
        else:
            command = [PYTHON, "ray_dp.py", *args, *common, "--workers", str(workers),
                       "--cpus-per-worker", str(cpus_per_worker)]
        started = time.time()
        proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"bench: {' '.join(command)} failed:\n{proc.stderr[-2000:]}")
        with open(os.path.join(tmp, "bench", "result.json")) as f:
            result = json.load(f)
    result["to_first_step"] = result["first_step_at"] - started
    return result


def steady(result, key="epoch_seconds"):
    return statistics.median(m[key] for m in result["epochs"][1:])


def interleave(contenders, repeats):
    """{name: [result, ...]}, running the contenders in turn so that machine noise hits each alike."""
    results = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, start in contenders.items():
            print(f"  running {name} ...", flush=True)
            results[name].append(start())
    return results


def median_of(results, fn):
    return statistics.median(fn(r) for r in results)


def launcher_overhead(repeats):
    results = interleave({"ray": lambda: run(LENET), "torchrun": lambda: run(LENET, "torchrun")}, repeats)
    ray_epoch, torchrun_epoch = (median_of(results[k], steady) for k in ("ray", "torchrun"))
    return {"ray_sec_per_epoch": ray_epoch, "torchrun_sec_per_epoch": torchrun_epoch,
            "ratio_ray_over_torchrun": ray_epoch / torchrun_epoch,
            "ray_seconds_to_first_step": median_of(results["ray"], lambda r: r["to_first_step"]),
            "torchrun_seconds_to_first_step": median_of(results["torchrun"], lambda r: r["to_first_step"])}


def scaling(args, repeats):
    # Same global batch; 1 worker gets both cores (2 threads), 2 workers one core each.
    results = interleave({"1 worker": lambda: run(args, workers=1, cpus_per_worker=2),
                          "2 workers": lambda: run(args, workers=2)}, repeats)
    one, two = (median_of(results[k], steady) for k in ("1 worker", "2 workers"))
    return {"sec_per_epoch_1_worker": one, "sec_per_epoch_2_workers": two, "speedup": one / two,
            "efficiency": one / two / 2}


def allreduce_variants(workers, repeats):
    cpus = 2 / workers  # share the 2 cores
    runs = {"ddp": lambda: run(flags(batch=48), workers=workers, cpus_per_worker=cpus)}
    for algorithm in ("naive", "ring", "library"):
        runs[f"scratch-{algorithm}"] = (lambda a=algorithm: run(
            flags(batch=48) + ["--mode", "scratch", "--allreduce", a], workers=workers, cpus_per_worker=cpus))
    results = interleave(runs, repeats)
    steps = 1437 // 48
    table = {}
    for name, rs in results.items():
        row = {"sec_per_step": median_of(rs, steady) / steps}
        if name.startswith("scratch"):
            row["allreduce_ms_per_step"] = 1e3 * median_of(rs, lambda r: steady(r, "allreduce_seconds_per_step"))
            row["busbw_GBps"] = median_of(rs, lambda r: steady(r, "allreduce_busbw_gbps"))
        table[name] = row
    return table


def data_wait(repeats):
    results = interleave({"digits (in memory)": lambda: run(LENET),
                          "synthetic (in memory)": lambda: run(flags("synthetic"))}, repeats)
    return {name: median_of(rs, lambda r: steady(r, "data_seconds") / steady(r)) for name, rs in results.items()}


def machine():
    import torch
    import ray
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "threads_per_worker": "= --cpus-per-worker (1 for 2 workers, 2 for 1 worker)",
            "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__}


def to_markdown(report):
    lines = [f"# ray-dp benchmarks", "", f"Machine: {report['machine']}", f"Runs per contender: {report['repeats']} "
             f"(interleaved; medians; first epoch left out). Command: `{report['command']}`", ""]
    lines += ["## 1. Launcher overhead (DDP LeNet, digits, 2 workers, batch 64)", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in report["launcher"].items()]
    for key, title in [("scaling_resnet18", "2. Scaling, compute-bound (ResNet-18, 512 synthetic images, batch 32)"),
                       ("scaling_lenet", "2b. Scaling, LeNet on digits (batch 64)")]:
        lines += ["", f"## {title}", "", "| figure | value |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in report[key].items()]
    for workers in (2, 3):
        lines += ["", f"## 3. DDP vs scratch all-reduce, {workers} workers (LeNet, digits, batch 48)", "",
                  "| contender | sec/step | all-reduce ms/step | bus bandwidth GB/s |", "|---|---|---|---|"]
        for name, row in report[f"allreduce_{workers}"].items():
            lines.append(f"| {name} | {row['sec_per_step']:.4f} | {row.get('allreduce_ms_per_step', float('nan')):.3f} "
                         f"| {row.get('busbw_GBps', float('nan')):.3f} |")
    lines += ["", "## 4. Share of step time waiting for data", "", "| data path | share |", "|---|---|"]
    lines += [f"| {k} | {v:.2%} |" for k, v in report["data_wait"].items()]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2, help="runs per contender (default: 2)")
    args = parser.parse_args()
    report = {"machine": machine(), "repeats": args.repeats, "command": " ".join(["python bench/bench.py", *sys.argv[1:]])}
    print("1. launcher overhead", flush=True)
    report["launcher"] = launcher_overhead(args.repeats)
    print("2. scaling", flush=True)
    report["scaling_resnet18"] = scaling(RESNET, 1)  # one run each: ~1 minute per epoch on 1 worker
    report["scaling_lenet"] = scaling(LENET, args.repeats)
    print("3. DDP vs scratch all-reduce", flush=True)
    report["allreduce_2"] = allreduce_variants(2, args.repeats)
    report["allreduce_3"] = allreduce_variants(3, 1)
    print("4. data wait", flush=True)
    report["data_wait"] = data_wait(1)
    with open(os.path.join(REPO, "bench", "results.json"), "w") as f:
        json.dump(report, f, indent=2)
    markdown = to_markdown(report)
    with open(os.path.join(REPO, "bench", "results.md"), "w") as f:
        f.write(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
