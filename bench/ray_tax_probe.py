"""bench/ray_tax.py's probe, imported as `sitecustomize` by ray_dp's training processes.

Once torch is imported it times every training step's parts with torch's public hooks (the model's
forward, autograd's backward, the optimizer's step) and, at each optimizer step, appends
{t, forward, backward, optimizer} to $RAY_TAX_OUT/<pid>.jsonl; at the first, it writes the thread,
affinity and allocator settings this process trains with to $RAY_TAX_OUT/<pid>.settings.json.
With RAY_TAX_WITHOUT=heartbeat, a Ray worker's ray_dp beats to the driver only at an epoch's end.
"""
import importlib.abc
import importlib.machinery
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

    clock, part = time.perf_counter, {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
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
        part.update(forward=0.0, backward=0.0, optimizer=0.0)

    module_hooks.register_module_forward_pre_hook(before_forward)
    module_hooks.register_module_forward_hook(after_forward)
    torch.autograd.backward = timed_backward
    optimizer_hooks.register_optimizer_step_pre_hook(before_step)
    optimizer_hooks.register_optimizer_step_post_hook(after_step)


def write_settings(torch):
    thread = threading.current_thread()
    settings = {
        "loop thread": "main" if thread is threading.main_thread() else f"not main ({thread.name})",
        "threads in the process": threading.active_count(),
        "torch threads": torch.get_num_threads(), "torch interop threads": torch.get_num_interop_threads(),
        "cores it may run on": sorted(os.sched_getaffinity(0)), "nice": os.nice(0),
        "scheduling policy": os.sched_getscheduler(0), "GIL switch interval s": sys.getswitchinterval(),
        **{name: os.environ.get(name) for name in SETTINGS},
        "parallel_info": torch.__config__.parallel_info()}
    with open(os.path.join(OUT, f"{os.getpid()}.settings.json"), "w") as f:
        json.dump(settings, f, indent=1)


def without_heartbeat(ray_dp):
    if "heartbeat" in os.environ.get("RAY_TAX_WITHOUT", ""):
        ray_dp.DriverLink.BEAT_S = 1e9


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs AFTER[name](module) once that module's own import has finished."""
    AFTER = {"torch": lambda module: install(), "ray_dp": without_heartbeat}

    def find_spec(self, name, path, target=None):
        if name not in self.AFTER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            self.AFTER.pop(name)(module)
        spec.loader.exec_module = exec_then
        return spec


if OUT and ("ray_dp.py" in sys.argv[0] or sys.argv[0].endswith("default_worker.py")):
    sys.meta_path.insert(0, AfterImport())
