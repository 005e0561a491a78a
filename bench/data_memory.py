#!/usr/bin/env python
"""Memory of Ray's training workers for a data set held in memory: how much each worker holds of it, and what the
allocator setting (--keep-freed-memory, Ray's workers' MALLOC_ARENA_MAX=1) adds over many epochs. Writes
bench/data_memory.md and bench/data_memory.json.

    python bench/data_memory.py                        # 256 MB of data, 2 workers, 8 epochs: about 6 minutes
    python bench/data_memory.py --mb 128 --epochs 4    # a quicker look
    python bench/data_memory.py --script OLD/ray_dp.py=before --script ray_dp.py=after --only default

The data set is a function of one's own (tests' style: FILE.py:NAME) returning two TensorDatasets of random
3 x 32 x 32 float32 images, 90% to train; the model ray_dp's mlp (3072 -> 256 -> 10), batch 256. A thread samples
every Ray training worker's memory 5 times a second from /proc: resident (RSS), proportional (PSS: shared pages
divided among the processes that map them) and private (USS: pages of this process alone), each epoch's largest.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TABLE = '''
import torch
from torch.utils.data import TensorDataset


def load(cfg):
    n = {mb} * 2 ** 20 // (3 * 32 * 32 * 4)
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(n, 3, 32, 32, generator=generator), torch.randint(0, 10, (n,), generator=generator)
    cut = n * 9 // 10
    return TensorDataset(images[:cut].clone(), labels[:cut].clone()), TensorDataset(images[cut:].clone(),
                                                                                    labels[cut:].clone())
'''
WORKLOADS = {  # name: the flags beside --epochs, the storage and the name
    # data-bound: the table above, ray_dp's mlp, 2 workers
    "table": lambda table, args: ["--model", "mlp", "--dataset", f"{table}:load", "--batch-size", "256",
                                  "--workers", str(args.workers)],
    # compute-bound, as bench/memory.md's: the lessons' resnet18, 512 random images at 32 px, one worker of 2 threads
    "resnet18": lambda table, args: ["--model", "resnet18", "--dataset", "synthetic", "--image-size", "32",
                                     "--batch-size", "64", "--workers", "1", "--cpus-per-worker", "2"],
}
SETTINGS = {  # name: (extra flags, extra environment)
    "default": ([], {}),  # --keep-freed-memory, and Ray's workers get MALLOC_ARENA_MAX=1
    "arenas as glibc's": ([], {"MALLOC_ARENA_MAX": "8"}),  # a user's own setting: ray_dp leaves it
    "--no-keep-freed-memory": (["--no-keep-freed-memory"], {}),
}


def parent(pid: str) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[1]


def descends(pid: str, root: int) -> bool:
    """pid is root's descendant (Ray's workers are its raylet's children, the raylet the driver's): not
    another Ray's on the same machine."""
    while pid not in ("0", "1"):
        pid = parent(pid)
        if pid == str(root):
            return True
    return False


class Watch:
    """The memory (GB) of every Ray training worker that descends from the process `root`, sampled from
    /proc: [(time, pid, rss, pss, uss)]."""

    def __init__(self, root: int):
        self.root, self.samples, self.done = root, [], threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        while not self.done.wait(0.2):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        if not f.read(40).startswith(b"ray::RayTrainWorker") or not descends(pid, self.root):
                            continue
                    with open(f"/proc/{pid}/smaps_rollup") as f:
                        kb = {line.split(":")[0]: int(line.split()[1]) for line in f if line.endswith("kB\n")}
                except OSError:  # gone meanwhile
                    continue
                uss = kb["Private_Clean"] + kb["Private_Dirty"]
                self.samples.append((time.time(), pid, kb["Rss"] / 2 ** 20, kb["Pss"] / 2 ** 20, uss / 2 ** 20))

    def stop(self):
        self.done.set()
        self.thread.join()


def run(script, workload, flags, env, epochs):
    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, script, *workload, "--epochs", str(epochs), "--storage-path", tmp, "--name",
                   "memory", "--logdir", os.path.join(tmp, "tb"), "--quiet", *flags]
        driver = subprocess.Popen(command, cwd=REPO, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        watch = Watch(driver.pid)
        _, stderr = driver.communicate()
        watch.stop()
        if driver.returncode:
            sys.exit(f"data_memory: {' '.join(command)} failed:\n{stderr[-3000:]}")
        with open(os.path.join(tmp, "memory", "result.json")) as f:
            result = json.load(f)
    ends = [result["first_step_at"]] + [epoch["ended_at"] for epoch in result["epochs"]]
    peaks = []  # each epoch's largest RSS, PSS and USS of any worker, then before the first step
    for start, end in [(0, ends[0]), *zip(ends, ends[1:])]:
        inside = [s for s in watch.samples if start <= s[0] <= end]
        peaks.append([round(max((s[k] for s in inside), default=float("nan")), 3) for k in (2, 3, 4)])
    return {"peaks_before_training": peaks[0], "peaks_per_epoch": peaks[1:],
            "sec_per_epoch": [round(e["epoch_seconds"], 3) for e in result["epochs"]]}


def markdown(args, figures):
    lines = [f"# Memory of a data set held in memory, per Ray training worker (`python bench/data_memory.py"
             f"{' --mb %d' % args.mb if args.mb != 256 else ''}{' --epochs %d' % args.epochs if args.epochs != 8 else ''}`)",
             "", f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}. "
             f"{args.mb} MB of float32 images in two TensorDatasets (90% train), {args.workers} CPU workers, "
             f"ray_dp's mlp, batch 256, {args.epochs} epochs. GB: the largest sample of any worker (5 a second); "
             f"RSS resident, PSS shared pages divided among their processes, USS private.", "",
             "| workload | setting | script | before the first step: RSS / PSS / USS | epoch 1 | last epoch | "
             "largest of all epochs | s/epoch (median of later epochs) |", "|---|---|---|---|---|---|---|---|"]
    for (workload, name, script), run_figures in figures.items():
        per_epoch = run_figures["peaks_per_epoch"]
        largest = [max(epoch[k] for epoch in per_epoch) for k in range(3)]
        later = sorted(run_figures["sec_per_epoch"][1:]) or run_figures["sec_per_epoch"]
        lines.append(f"| {workload} | {name} | {script} | "
                     f"{' / '.join(map(str, run_figures['peaks_before_training']))} | "
                     f"{' / '.join(map(str, per_epoch[0]))} | {' / '.join(map(str, per_epoch[-1]))} | "
                     f"{' / '.join(f'{v:.3f}' for v in largest)} | {later[len(later) // 2]:.3f} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="megabytes of data held in memory")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2, help="the table's workers")
    parser.add_argument("--workload", action="append", choices=WORKLOADS, help="these workloads only")
    parser.add_argument("--script", action="append", default=[], metavar="PATH[=LABEL]",
                        help="a ray_dp.py to measure, named LABEL in the table (repeatable; default: this "
                             "repository's)")
    parser.add_argument("--only", action="append", choices=SETTINGS, help="these settings only")
    parser.add_argument("--out", default=os.path.join(HERE, "data_memory"), help="PATH for PATH.md and PATH.json")
    args = parser.parse_args()
    scripts = args.script or [os.path.join(REPO, "ray_dp.py")]
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        table = os.path.join(tmp, "table.py")
        with open(table, "w") as f:
            f.write(TABLE.format(mb=args.mb))
        for workload in args.workload or WORKLOADS:
            for name in args.only or SETTINGS:
                for script in scripts:
                    script, _, shown = script.partition("=")
                    shown = shown or (os.path.relpath(script, REPO) if script.startswith(REPO) else script)
                    print(f"data_memory: {workload}, {name}, {shown}", flush=True)
                    figures[(workload, name, shown)] = run(script, WORKLOADS[workload](table, args),
                                                           *SETTINGS[name], args.epochs)
                    print(json.dumps(figures[(workload, name, shown)]), flush=True)
    with open(args.out + ".json", "w") as f:
        json.dump([{"workload": workload, "setting": name, "script": script, **run_figures}
                   for (workload, name, script), run_figures in figures.items()], f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(args, figures))


if __name__ == "__main__":
    main()
