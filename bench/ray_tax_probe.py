"""bench/ray_tax.py's probe, imported as `sitecustomize` by ray_dp's training processes.

Once torch is imported it times every training step's parts with torch's public hooks (the model's
forward, autograd's backward, the optimizer's step) and Python's garbage collections (gc.callbacks),
and at each optimizer step appends {t, forward, backward, optimizer, gc} to $RAY_TAX_OUT/<pid>.jsonl;
at the first, it writes the thread, affinity and allocator settings this process trains with to
$RAY_TAX_OUT/<pid>.settings.json. RAY_TAX_WITHOUT names ray_dp's threads ("ray-dp heartbeat",
"ray-dp console", "ray-dp watchdog") that start, in any process, as threads that end at once.
"""
import gc
import json
import os
import sys
import threading
import time

OUT = os.environ.get("RAY_TAX_OUT")
SETTINGS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "OMP_WAIT_POLICY",
            "GOMP_SPINCOUNT", "KMP_AFFINITY", "KMP_BLOCKTIME", "MALLOC_ARENA_MAX", "CUDA_VISIBLE_DEVICES")


def install():
    import torch
    import torch.nn.modules.module as module_hooks
    import torch.optim.optimizer as optimizer_hooks

    clock, part = time.perf_counter, {"forward": 0.0, "backward": 0.0, "optimizer": 0.0, "gc": 0.0}
    collecting = [0.0]

    def collection(phase, info):
        if phase == "start":
            collecting[0] = clock()
        else:
            part["gc"] += clock() - collecting[0]
    depth, started, log = [0], [0.0], []

    def before_forward(module, args):
        if depth[0] == 0:
            started[0] = clock()
        depth[0] += 1

    def after_forward(module, args, output):
        depth[0] -= 1
        if depth[0] == 0 and module.training:
            part["forward"] += clock() - started[0]

    backward = torch.autograd.backward

    def timed_backward(*args, **kwargs):
        tic = clock()
        try:
            return backward(*args, **kwargs)
        finally:
            part["backward"] += clock() - tic

    def before_step(optimizer, args, kwargs):
        started[0] = clock()

    def after_step(optimizer, args, kwargs):
        part["optimizer"] += clock() - started[0]
        if not log:  # the first step: this process trains
            write_settings(torch)
            log.append(open(os.path.join(OUT, f"{os.getpid()}.jsonl"), "a", buffering=1))
        log[0].write(json.dumps({"t": time.time(), **part}) + "\n")
        part.update(forward=0.0, backward=0.0, optimizer=0.0, gc=0.0)

    module_hooks.register_module_forward_pre_hook(before_forward)
    module_hooks.register_module_forward_hook(after_forward)
    torch.autograd.backward = timed_backward
    optimizer_hooks.register_optimizer_step_pre_hook(before_step)
    optimizer_hooks.register_optimizer_step_post_hook(after_step)
    gc.callbacks.append(collection)


def write_settings(torch):
    thread = threading.current_thread()
    settings = {
        "loop thread": "main" if thread is threading.main_thread() else f"not main ({thread.name})",
        "loop thread id": threading.get_native_id(),
        "Python threads in the process": threading.active_count(),
        "objects gc.freeze() left out of collections": gc.get_freeze_count(),
        "objects collections traverse": len(gc.get_objects()),
        "torch threads": torch.get_num_threads(), "torch interop threads": torch.get_num_interop_threads(),
        "cores it may run on": sorted(os.sched_getaffinity(0)), "nice": os.nice(0),
        "scheduling policy": os.sched_getscheduler(0), "GIL switch interval s": sys.getswitchinterval(),
        **{name: os.environ.get(name) for name in SETTINGS},
        "parallel_info": torch.__config__.parallel_info()}
    with open(os.path.join(OUT, f"{os.getpid()}.settings.json"), "w") as f:
        json.dump(settings, f, indent=1)


def thread_start(start):
    """Thread.start; a thread RAY_TAX_WITHOUT names ends at once."""
    without = os.environ.get("RAY_TAX_WITHOUT", "").split(",")

    def started(thread):
        if thread.name in without:
            thread._target = lambda *args, **kwargs: None
        return start(thread)
    return started


class AfterTorch:
    """Runs install() once torch's own import has finished."""

    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        import importlib.machinery
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        exec_module = spec.loader.exec_module

        def exec_then_install(module):
            exec_module(module)
            install()
        spec.loader.exec_module = exec_then_install
        return spec


if OUT and ("ray_dp.py" in sys.argv[0] or sys.argv[0].endswith("default_worker.py")):
    sys.meta_path.insert(0, AfterTorch())
    threading.Thread.start = thread_start(threading.Thread.start)
