#!/usr/bin/env python
"""Where a Ray epoch's time goes against torchrun's: the same ray_dp.py command line under each.

    python bench/ray_tax.py                     # writes bench/ray_tax.md and ray_tax.json
    python bench/ray_tax.py --rounds 1 --cases memory --contenders torchrun,ray

Contenders run in turn (torchrun, Ray, Ray with one thing changed, ..., then again: a round), each
its own process, one worker of 2 threads; figures are medians over rounds of each run's steady
epochs (the first left out). bench/ray_tax_probe.py, imported as `sitecustomize` by the training
process, splits each step into forward, backward and the optimizer with torch's public hooks;
ray_dp's result.json gives the epoch and its waits for data; /proc gives every thread's CPU.
"""
import argparse
import collections
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (bench/bench.py: the runs' helpers)

TICK = os.sysconf("SC_CLK_TCK")
PARTS = ("forward", "backward", "optimizer", "waits for data", "rest")


class ThreadWatch:
    """Every thread's CPU ticks in each process that trains (a probe's <pid>.jsonl exists), and
    all processes' (bench.CpuWatch), 4 times a second."""

    def __init__(self, out: str):
        self.out, self.samples, self.done = out, [], threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        names = {}
        while not self.done.wait(1.0):
            snapshot = {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if not names.get(pid, "").startswith(("ray::", "raylet", "gcs_server")):
                        names[pid] = process_name(pid)  # Ray's workers take their names late
                except OSError:
                    continue
                snapshot[pid] = (names[pid], int(fields[11]) + int(fields[12]))
            for log in glob.glob(os.path.join(self.out, "*.jsonl")):
                pid = os.path.basename(log).split(".")[0]
                for task in glob.glob(f"/proc/{pid}/task/*"):
                    try:
                        with open(f"{task}/stat") as f:
                            head, fields = f.read().rsplit(")", 1)
                    except OSError:
                        continue
                    fields = fields.split()
                    snapshot[(pid, os.path.basename(task))] = (
                        head.split("(", 1)[1], int(fields[11]) + int(fields[12]))
            self.samples.append((time.time(), snapshot))

    def threads(self, start: float, end: float) -> dict:
        """Between start and end: each trainer's threads and their cores used by name, and the
        cores every other process used (the sampler, this process, left out)."""
        self.done.set()
        self.thread.join()
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2:
            return {}
        (t0, first), (t1, last) = inside[0], inside[-1]
        by_pid = collections.defaultdict(lambda: collections.Counter())
        counts = collections.Counter(key[0] for key in last if isinstance(key, tuple))
        processes = collections.Counter()
        for key, (name, ticks) in last.items():
            used = (ticks - first.get(key, (name, ticks))[1]) / TICK / (t1 - t0)
            if isinstance(key, str) and key not in counts and key != str(os.getpid()):
                processes[name] += used
        for (pid, tid), (name, ticks) in ((k, v) for k, v in last.items() if isinstance(k, tuple)):
            used = ticks - first.get((pid, tid), (name, ticks))[1]
            by_pid[pid][name] += used / TICK / (t1 - t0)
        trainers = {pid: {"threads": counts[pid],
                          "busy": [(n, round(s, 4)) for n, s in used.most_common() if s >= 0.002]}
                    for pid, used in by_pid.items()}
        return {"trainer": trainers, "other processes": [
            (n, round(s, 4)) for n, s in processes.most_common() if s >= 0.002],
            "other cores": sum(processes.values())}


def process_name(pid: str) -> str:
    """A process's name for the tables: Ray's actor title, or its program and script."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        words = f.read(300).replace(b"\0", b" ").decode(errors="replace").split()
    if not words:  # a kernel thread
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    if words[0].startswith("ray::"):
        return " ".join(words)[:40]
    return " ".join([os.path.basename(w) for w in words[:3] if not w.startswith("-")][:2])


# Ray's driver: ray_dp imported (so a worker's probe may find it), its console relay off if asked
DRIVER = ("import contextlib, os, sys, ray_dp\n"
          "if 'relay' in os.environ.get('RAY_TAX_WITHOUT', ''):\n"
          "    ray_dp.relayed = lambda board: contextlib.nullcontext()\n"
          "sys.exit(ray_dp.main(sys.argv[1:]))")


def run(args, launcher, env=None):
    """One ray_dp.py run, one worker of 2 threads, the probe on: result.json, its steady epochs'
    parts, the trainer's threads and every process's CPU."""
    out = tempfile.mkdtemp(prefix="ray_tax_")
    probe = os.path.join(out, "site")
    os.makedirs(probe)
    shutil.copy(os.path.join(bench.REPO, "bench", "ray_tax_probe.py"), f"{probe}/sitecustomize.py")
    common = ["--storage-path", out, "--name", "bench", "--logdir", os.path.join(out, "tb"), "--quiet"]
    if launcher == "torchrun":
        command = [bench.TORCHRUN, "--nproc_per_node", "1", "ray_dp.py", *args, *common,
                   "--cpus-per-worker", "2"]
    else:
        command = [bench.PYTHON, "-c", DRIVER, *args, *common, "--workers", "1", "--cpus-per-worker", "2"]
    pythonpath = os.pathsep.join(filter(None, [probe, bench.REPO, os.environ.get("PYTHONPATH")]))
    watch = ThreadWatch(out)
    done = subprocess.run(command, cwd=bench.REPO, capture_output=True, text=True,
                          env={**os.environ, "RAY_TAX_OUT": out, "PYTHONPATH": pythonpath, **(env or {})})
    if done.returncode:
        sys.exit(f"ray_tax: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(out, "bench", "result.json")) as f:
        result = json.load(f)
    epochs = result["epochs"]
    result.update(watch.threads(epochs[0]["ended_at"], epochs[-1]["ended_at"]))
    steps = []
    for log in glob.glob(os.path.join(out, "*.jsonl")):
        with open(log) as f:
            steps += [json.loads(line) for line in f]
        with open(log.replace(".jsonl", ".settings.json")) as f:
            result["settings"] = json.load(f)
    shutil.rmtree(out, ignore_errors=True)
    result["parts"] = [split(m, steps) for m in epochs[1:]]
    return result


def split(epoch: dict, steps: list) -> dict:
    """An epoch's seconds in PARTS: the probe's steps that ended within it, its data waits."""
    begun = epoch["ended_at"] - epoch["epoch_seconds"]
    inside = [s for s in steps if begun <= s["t"] <= epoch["ended_at"]]
    parts = {part: sum(s[part] for s in inside) for part in PARTS[:3]}
    parts["waits for data"] = epoch["data_seconds"]
    parts["rest"] = epoch["epoch_seconds"] - sum(parts.values())
    return {"epoch": epoch["epoch_seconds"], "steps": len(inside), **parts}


def medians(results: list) -> dict:
    """The median over runs of each run's median steady epoch, in PARTS."""
    return {key: statistics.median(statistics.median(p[key] for p in r["parts"]) for r in results)
            for key in ("epoch", *PARTS)}


MEMORY = ["--dataset", "synthetic", "--model", "resnet18", "--image-size", "32", "--batch-size", "64",
          "--epochs", "3"]


def folder_flags():
    return ["--dataset", "folder", "--data-dir", bench.mnist_folder(), "--model", "mobilenet_v3_small",
            "--image-size", "224", "--loader-workers", "2", "--batch-size", "64", "--epochs", "2"]


# name: (what it is, launcher, extra flags, environment)
CONTENDERS = {
    "torchrun": ("torchrun", "torchrun", [], {}),
    "ray": ("Ray, as ray_dp runs it", "ray", [], {}),
    "no-heartbeat": ("Ray, rank 0's heartbeat thread off", "ray", [], {"RAY_TAX_WITHOUT": "heartbeat"}),
    "no-relay": ("Ray, the driver's console relay off", "ray", [], {"RAY_TAX_WITHOUT": "relay"}),
    "no-replica-checks": ("Ray, replica checks off", "ray", ["--check-replicas", "off"], {}),
    "no-allocator-setting": ("Ray, the allocator setting off", "ray", ["--no-keep-freed-memory"], {}),
    "no-ray-metrics": ("Ray, Ray's and Ray Train's metrics off", "ray", [],
                       {"RAY_enable_metrics_collection": "0", "RAY_TRAIN_METRICS_ENABLED": "0"}),
    "polls-2s": ("Ray, Train's controller polling every 2 s (ray_dp: 0.2 s)", "ray", [],
                 {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}),
    "nice-0": ("Ray, its workers at nice 0 (Ray's: 15)", "ray", [], {"RAY_worker_niceness": "0"}),
}
CASES = {"memory": ("in memory: the lessons' ResNet-18, 512 random 32 x 32 images, batch 64, 8 steps "
                    "an epoch, 3 epochs", lambda: MEMORY),
         "folder": ("image folder: 4,000 MNIST digits as PNG (bench/bench.py's), mobilenet_v3_small at "
                    "224 px, batch 64, 2 loader processes, 62 steps an epoch, 2 epochs", folder_flags)}


def summarized(runs: dict) -> dict:
    """Each contender's medians, its ratio to torchrun (the median of each round's), its threads."""
    base = runs["torchrun"]
    figures = {}
    for name, results in runs.items():
        epochs = [statistics.median(p["epoch"] for p in r["parts"]) for r in results]
        rounds = [e / statistics.median(p["epoch"] for p in b["parts"]) for e, b in zip(epochs, base)]
        figures[name] = {
            "parts": medians(results), "ratio to torchrun": statistics.median(rounds),
            "rounds' ratios": rounds, "epochs": epochs,
            "other cores": statistics.median(r["other cores"] for r in results),
            "other processes": results[-1]["other processes"], "trainer": results[-1]["trainer"],
            "settings": results[-1]["settings"]}
    return figures


def markdown(report: dict) -> list:
    lines = []
    for case, figures in report["cases"].items():
        lines += ["", f"## {CASES[case][0]}", "", "Seconds of a steady epoch (medians), split by the "
                  "probe; other processes: the cores every process but the trainer used meanwhile.", "",
                  "| contender | s/epoch | / torchrun (rounds) | " + " | ".join(PARTS) +
                  " | other processes, cores |", "|---" * (len(PARTS) + 4) + "|"]
        for name, f in figures.items():
            rounds = ", ".join(f"{r:.3f}" for r in f["rounds' ratios"])
            lines.append(f"| {CONTENDERS[name][0]} | {f['parts']['epoch']:.2f} | "
                         f"**{f['ratio to torchrun']:.3f}** ({rounds}) | " +
                         " | ".join(f"{f['parts'][p]:.2f}" for p in PARTS) +
                         f" | {f['other cores']:.3f} |")
        for name in ("torchrun", "ray"):
            f = figures[name]
            for pid, trainer in f["trainer"].items():
                busy = ", ".join(f"{n} {c:.3f}" for n, c in trainer["busy"])
                lines += ["", f"{CONTENDERS[name][0]}: the trainer runs {trainer['threads']} threads; "
                          f"cores used by name: {busy}"]
            others = ", ".join(f"{n} {c:.3f}" for n, c in f["other processes"])
            lines += ["", f"{CONTENDERS[name][0]}: other processes' cores: {others or 'none'}"]
        settings = {name: figures[name]["settings"] for name in ("torchrun", "ray")}
        lines += ["", "| setting the trainer sees | torchrun | Ray |", "|---|---|---|"]
        lines += [f"| {key} | {settings['torchrun'].get(key)} | {settings['ray'].get(key)} |"
                  for key in settings["ray"] if key != "parallel_info"]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs per contender (default: 3)")
    parser.add_argument("--cases", default="memory,folder", help="of: " + ", ".join(CASES))
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="of: " + ", ".join(CONTENDERS) + " (torchrun always runs)")
    parser.add_argument("--folder-contenders", default="torchrun,ray")
    args = parser.parse_args()
    started = time.time()
    report = {"machine": bench.machine(), "command": " ".join(["python bench/ray_tax.py", *sys.argv[1:]]),
              "cases": {}}
    for case in args.cases.split(","):
        flags = CASES[case][1]()
        chosen = args.folder_contenders if case == "folder" else args.contenders
        names = ["torchrun", *(n for n in chosen.split(",") if n != "torchrun")]
        contenders = {name: (lambda c=CONTENDERS[name]: run([*flags, *c[2]], c[1], c[3]))
                      for name in names}
        report["cases"][case] = summarized(bench.interleave(contenders, args.rounds))
        print(f"{case}: " + ", ".join(f"{n} {f['ratio to torchrun']:.3f}"
                                      for n, f in report["cases"][case].items()), flush=True)
    report["minutes"] = (time.time() - started) / 60
    with open(os.path.join(bench.REPO, "bench", "ray_tax.json"), "w") as f:
        json.dump(report, f, indent=1)
    lines = [f"# ray-dp: Ray against torchrun (`{report['command']}`, {report['minutes']:.0f} minutes)",
             "", f"Machine: {report['machine']}", "", " ".join(__doc__.split("\n\n")[2].split()),
             *markdown(report)]
    with open(os.path.join(bench.REPO, "bench", "ray_tax.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
