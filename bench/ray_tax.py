#!/usr/bin/env python
"""Where a Ray epoch's time goes against torchrun's: the same ray_dp.py command line under each.

    python bench/ray_tax.py                       # ~45 minutes: writes bench/ray_tax.md and ray_tax.json
    python bench/ray_tax.py --cases spare-core    # one case (~8 minutes); the others' figures stay
    python bench/ray_tax.py --rounds 1 --cases memory --contenders ray,no-relay

Contenders run in turn (torchrun, Ray, Ray with one thing changed, ..., then again: a round), each
its own process, one worker; a figure is the median over rounds of each run's median steady epoch
(the first left out), a ratio the median of each round's ratio to torchrun. bench/ray_tax_probe.py,
imported as `sitecustomize` by the training process, splits each step into forward, backward and
the optimizer with torch's public hooks; ray_dp's result.json gives the epoch and its waits for
data; /proc, sampled once a second, gives every thread's and every other process's CPU.
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
    """Once a second, at nice 19: every process's CPU ticks, and every thread's in the trainer (the
    process whose probe wrote <pid>.jsonl); the trainer's loader processes count as the trainer."""

    def __init__(self, out: str):
        self.out, self.samples, self.done = out, [], threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        names = {}
        while not self.done.wait(1.0):
            snapshot, trainers = {}, {os.path.basename(log).split(".")[0]
                                      for log in glob.glob(os.path.join(self.out, "*.jsonl"))}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if names.get(pid, "ray::IDLE").startswith(("ray::IDLE", "python")):
                        names[pid] = process_name(pid)  # Ray's workers take their names late
                except OSError:
                    continue
                mine = "trainer" if pid in trainers or fields[1] in trainers else names[pid]
                snapshot[pid] = (mine, int(fields[11]) + int(fields[12]))
            for pid in trainers:
                loop = loop_thread(self.out, pid)
                for task in glob.glob(f"/proc/{pid}/task/*"):
                    try:
                        with open(f"{task}/stat") as f:
                            head, fields = f.read().rsplit(")", 1)
                    except OSError:
                        continue
                    fields, tid = fields.split(), os.path.basename(task)
                    name = ("the loop's thread" if tid == loop else "main thread" if tid == pid
                            else head.split("(", 1)[1])
                    snapshot[(pid, tid)] = (name, int(fields[11]) + int(fields[12]))
            self.samples.append((time.time(), snapshot))

    def threads(self, start: float, end: float) -> dict:
        """Between start and end: the trainer's threads and their cores by name, and the cores
        every other process used (this one left out)."""
        self.done.set()
        self.thread.join()
        inside = [s for s in self.samples if start <= s[0] <= end]
        found = {"trainer threads": 0, "trainer's threads' cores": [], "other processes": [],
                 "other cores": float("nan")}
        if len(inside) < 2:
            return found
        (t0, first), (t1, last) = inside[0], inside[-1]
        threads, processes = collections.Counter(), collections.Counter()
        for key, (name, ticks) in last.items():
            used = (ticks - first.get(key, (name, ticks))[1]) / TICK / (t1 - t0)
            if isinstance(key, tuple):
                threads[name] += used
                found["trainer threads"] += 1
            elif name != "trainer" and key != str(os.getpid()):
                processes[name] += used
        if not found["trainer threads"]:  # an unprobed run: which process trains is not known
            return found
        return {**found, "other cores": sum(processes.values()),
                "trainer's threads' cores": [(n, round(c, 4)) for n, c in threads.most_common()
                                              if c >= 0.002],
                "other processes": [(n, round(c, 4)) for n, c in processes.most_common()
                                    if c >= 0.002]}


def loop_thread(out: str, pid: str) -> str:
    """The id of the thread that trains in process pid, as its probe wrote it."""
    try:
        with open(os.path.join(out, f"{pid}.settings.json")) as f:
            return str(json.load(f)["loop thread id"])
    except (OSError, ValueError, KeyError):
        return ""


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


# a load of argv[1] of a core: 1 ms of computing every 1 / argv[1] ms
LOAD = ("import sys, time\nshare = float(sys.argv[1])\nwhile True:\n    end = time.perf_counter() + 0.001\n"
        "    while time.perf_counter() < end:\n        pass\n    time.sleep(0.001 / share - 0.001)")


def run(args, launcher, env=None, threads=2):
    """One ray_dp.py run as a user types it, one worker of `threads` threads: result.json, its
    steady epochs' parts (probed runs), the trainer's threads and every process's CPU."""
    out = tempfile.mkdtemp(prefix="ray_tax_")
    probe = os.path.join(out, "site")
    os.makedirs(probe)
    shutil.copy(os.path.join(bench.REPO, "bench", "ray_tax_probe.py"), f"{probe}/sitecustomize.py")
    common = ["--storage-path", out, "--name", "bench", "--logdir", os.path.join(out, "tb"), "--quiet",
              "--cpus-per-worker", str(threads)]
    if launcher == "torchrun":
        command = [bench.TORCHRUN, "--nproc_per_node", "1", "ray_dp.py", *args, *common]
    else:
        command = [bench.PYTHON, "ray_dp.py", *args, *common, "--workers", "1"]
    env = {**os.environ, "RAY_TAX_OUT": out, **(env or {})}
    probed = env["RAY_TAX_OUT"] != ""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [probe, os.environ.get("PYTHONPATH")]))
    watch = ThreadWatch(out)
    load = subprocess.Popen([bench.PYTHON, "-c", LOAD, env["RAY_TAX_LOAD"]]) if "RAY_TAX_LOAD" in env else None
    done = subprocess.run(command, cwd=bench.REPO, capture_output=True, text=True, env=env)
    if load is not None:
        load.kill()
    if done.returncode:
        sys.exit(f"ray_tax: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    with open(os.path.join(out, "bench", "result.json")) as f:
        result = json.load(f)
    epochs = result["epochs"]
    result.update(watch.threads(epochs[0]["ended_at"], epochs[-1]["ended_at"]))
    steps, logs = [], glob.glob(os.path.join(out, "*.jsonl"))
    if probed and len(logs) != 1:
        sys.exit(f"ray_tax: the probe wrote {len(logs)} step logs, not 1: {' '.join(command)}")
    for log in logs:
        with open(log) as f:
            steps += [json.loads(line) for line in f]
        with open(log.replace(".jsonl", ".settings.json")) as f:
            result["settings"] = json.load(f)
    shutil.rmtree(out, ignore_errors=True)
    result["parts"] = [split(m, before["ended_at"], steps, probed)
                       for before, m in zip(epochs, epochs[1:])]
    return result


def split(epoch: dict, since: float, steps: list, probed: bool) -> dict:
    """An epoch's training seconds in PARTS (and gc, within them): the probe's steps that ended
    after the last epoch's end (its evaluation included) and by this one's, its data waits."""
    inside = [s for s in steps if since < s["t"] <= epoch["ended_at"]]
    if probed and (not inside or abs(len(inside) - epoch["train_samples"] / BATCH) >= 1):
        sys.exit(f"ray_tax: {len(inside)} steps probed in an epoch of {epoch['train_samples']} samples")
    parts = {part: sum(s[part] for s in inside) for part in (*PARTS[:3], "gc")}
    parts["waits for data"] = epoch["data_seconds"]
    parts["rest"] = epoch["epoch_seconds"] - sum(parts[p] for p in PARTS[:4])
    return {"epoch": epoch["epoch_seconds"], "steps": len(inside), **parts}


def median_epoch(result: dict) -> dict:
    return sorted(result["parts"], key=lambda p: p["epoch"])[(len(result["parts"]) - 1) // 2]


BATCH = 64
MEMORY = ["--dataset", "synthetic", "--model", "resnet18", "--image-size", "32", "--batch-size",
          str(BATCH), "--epochs", "3"]


def folder_flags():
    return ["--dataset", "folder", "--data-dir", bench.mnist_folder(), "--model", "mobilenet_v3_small",
            "--image-size", "224", "--loader-workers", "2", "--batch-size", str(BATCH), "--epochs", "2"]


# name: (what it is, launcher, extra flags, environment)
CONTENDERS = {
    "torchrun": ("torchrun", "torchrun", [], {}),
    "ray": ("Ray, as ray_dp runs it", "ray", [], {}),
    "torchrun-unprobed": ("torchrun, no probe", "torchrun", [], {"RAY_TAX_OUT": ""}),
    "ray-unprobed": ("Ray, no probe", "ray", [], {"RAY_TAX_OUT": ""}),
    "no-heartbeat": ("Ray, rank 0's heartbeat thread off", "ray", [],
                     {"RAY_TAX_WITHOUT": "ray-dp heartbeat"}),
    "no-relay": ("Ray, the driver's console relay off", "ray", [], {"RAY_TAX_WITHOUT": "ray-dp console"}),
    "no-watchdog": ("Ray, the watchdog thread off", "ray", [], {"RAY_TAX_WITHOUT": "ray-dp watchdog"}),
    "arenas": ("Ray, glibc's default arenas (not ray_dp's MALLOC_ARENA_MAX=1)", "ray", [],
               {"MALLOC_ARENA_MAX": "16"}),
    "no-ray-metrics": ("Ray, Ray's and Ray Train's metrics off", "ray", [],
                       {"RAY_enable_metrics_collection": "0", "RAY_TRAIN_METRICS_ENABLED": "0"}),
    "polls-2s": ("Ray, Train's controller polling every 2 s (ray_dp: 0.2 s)", "ray", [],
                 {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "2"}),
    "nice-0": ("Ray, every Ray worker at nice 0 (Ray's: 15)", "ray", [], {"RAY_worker_niceness": "0"}),
    "torchrun-beside-load": ("torchrun beside 0.1 of a core in 1 ms bursts (as Ray's processes use)",
                             "torchrun", [], {"RAY_TAX_LOAD": "0.1"}),
}
# name: (title, flags, the worker's threads, contenders by default)
CASES = {"memory": ("in memory: the lessons' ResNet-18, 512 random 32 x 32 images, batch 64, 8 steps "
                    "an epoch, 3 epochs; one worker of 2 threads", lambda: MEMORY, 2, ",".join(CONTENDERS)),
         "folder": ("image folder: 4,000 MNIST digits as PNG (bench/bench.py's), mobilenet_v3_small at "
                    "224 px, batch 64, 2 loader processes, 62 steps an epoch, 2 epochs; one worker of 2 "
                    "threads", folder_flags, 2, "torchrun,ray"),
         "spare-core": ("a core to spare: the in-memory ResNet-18 on one worker of 1 thread, the other "
                        "core left to the launchers' own processes", lambda: MEMORY, 1, "torchrun,ray")}


def rotated(contenders: dict, rounds: int) -> dict:
    """{name: [result, ...]}: every contender once a round, each round's order turned by one."""
    results, names = {name: [] for name in contenders}, list(contenders)
    for turn in range(rounds):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            print(f"  round {turn + 1}: {name} ...", flush=True)
            results[name].append(contenders[name]())
    return results


def summarized(runs: dict) -> dict:
    """Each contender's median run (by its median steady epoch) and that epoch's parts; its ratio
    to torchrun's, the median of each round's; the trainer's threads and settings in that run."""
    base = [median_epoch(r)["epoch"] for r in runs["torchrun"]]
    figures = {}
    for name, results in runs.items():
        epochs = [median_epoch(r)["epoch"] for r in results]
        middle = results[epochs.index(statistics.median_low(epochs))]
        rounds = [e / b for e, b in zip(epochs, base)]
        figures[name] = {
            "parts": median_epoch(middle), "ratio to torchrun": statistics.median(rounds),
            "rounds' ratios": rounds, "epochs": epochs,
            **{key: middle[key] for key in ("other cores", "other processes", "trainer threads",
                                            "trainer's threads' cores")},
            "settings": middle.get("settings", {})}
    return figures


def markdown(report: dict) -> list:
    lines = []
    for label, run_of in report["cases"].items():
        figures, case = run_of["figures"], run_of.get("case", label)
        title = CASES[case][0] + (f" ({label})" if label != case else "")
        lines += ["", f"## {title}", "", f"`{run_of['command']}`, {run_of['minutes']:.0f} "
                  "minutes. The median run's median steady epoch, in seconds, split by the probe (gc: "
                  "the garbage collections within the parts); other processes: the cores every "
                  "process but the trainer (and its loader processes) used during the steady "
                  "epochs; nice: the trainer's.", "",
                  "| contender | s/epoch | / torchrun (each round) | " + " | ".join(PARTS) +
                  " | gc | other processes, cores | nice |", "|---" * (len(PARTS) + 6) + "|"]
        for name, f in figures.items():
            parts = f["parts"]
            split_ = [f"{parts[p]:.2f}" if "steps" in parts and parts["steps"] else "" for p in
                      (*PARTS, "gc")]
            rounds = ", ".join(f"{r:.3f}" for r in f["rounds' ratios"])
            lines.append(f"| {CONTENDERS[name][0]} | {parts['epoch']:.2f} | "
                         f"**{f['ratio to torchrun']:.3f}** ({rounds}) | " + " | ".join(split_) +
                         f" | {f['other cores']:.3f} | {f['settings'].get('nice', '')} |".replace(
                             " nan |", "  |"))
        for name in ("torchrun", "ray"):
            f = figures[name]
            busy = ", ".join(f"{n} {c:.3f}" for n, c in f["trainer's threads' cores"])
            others = ", ".join(f"{n} {c:.3f}" for n, c in f["other processes"])
            lines += ["", f"{CONTENDERS[name][0]}: the trainer runs {f['trainer threads']} threads; "
                      f"cores used by its threads, by name: {busy}. Other processes' cores: "
                      f"{others or 'none'}."]
        settings = {name: figures[name]["settings"] for name in ("torchrun", "ray")}
        lines += ["", "| setting the trainer sees | torchrun | Ray |", "|---|---|---|"]
        lines += [f"| {key} | {settings['torchrun'].get(key)} | {settings['ray'].get(key)} |"
                  for key in settings["ray"] if key != "parallel_info"]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="runs per contender (default: 3)")
    parser.add_argument("--cases", default="memory,folder", help="of: " + ", ".join(CASES))
    parser.add_argument("--contenders", help="of: " + ", ".join(CONTENDERS) + " (torchrun always "
                        "runs; default: all in memory, torchrun and ray otherwise)")
    parser.add_argument("--as", dest="label", help="keep the figures under this name, beside the case's")
    parser.add_argument("--rewrite", action="store_true", help="only bench/ray_tax.md, from the json")
    args = parser.parse_args()
    command = " ".join(["python bench/ray_tax.py", *sys.argv[1:]])
    path = os.path.join(bench.REPO, "bench", "ray_tax.json")
    report = {"machine": bench.machine(), "cases": {}}
    if os.path.exists(path):  # the other cases' last figures stay
        with open(path) as f:
            report["cases"] = json.load(f)["cases"]
    for case in [] if args.rewrite else args.cases.split(","):
        _, flags, threads, chosen = CASES[case]
        names = ["torchrun", *(n for n in (args.contenders or chosen).split(",") if n != "torchrun")]
        contenders = {name: (lambda c=CONTENDERS[name]: run([*flags(), *c[2]], c[1], c[3], threads))
                      for name in names}
        started = time.time()
        figures = summarized(rotated(contenders, args.rounds))
        report["cases"][args.label or case] = {
            "case": case, "command": command, "minutes": (time.time() - started) / 60,
            "figures": figures}
        print(f"{case}: " + ", ".join(f"{n} {f['ratio to torchrun']:.3f}" for n, f in figures.items()),
              flush=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    lines = ["# ray-dp: Ray against torchrun", "", f"Machine: {report['machine']}", "",
             " ".join(__doc__.split("\n\n")[2].split()), "",
             "The rest: the loss, moving a batch, seeding its dropout, the step's agreement, zero_grad, "
             "the schedule. Replica checks compare workers' replicas: with one worker there are none. "
             "memory-before was measured with ray_dp before its trainers ran at nice 0 (its Ray rows at "
             "Ray's 15, its command as it ran); the other cases with the trainers at 0.",
             *markdown(report)]
    with open(os.path.join(bench.REPO, "bench", "ray_tax.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
