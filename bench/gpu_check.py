"""The GPU paths on one CUDA GPU, without Ray (ray_dp's worker loop on 2 gloo processes that share the GPU, as
tests/helpers.py runs it on CPUs): --amp, --sync-bn (torch's SyncBatchNorm), the in-memory data on the GPU,
the replica checks with torch.hash_tensor on the device and the forward clock's CUDA events; then what a replica
check costs beside a training step on the GPU, per model (bench/health.md has the CPU's).

    python bench/gpu_check.py [OUT.json]     # about 3 minutes on one H200
"""
import json
import math
import os
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

sys.path.insert(0, os.path.join(REPO, "bench"))
from health import MODELS  # noqa: E402

if not hasattr(dist, "set_timeout"):  # torch < 2.12 (a device's own torch): --timeout left as it is
    dist.set_timeout = lambda timeout: None
GPU = torch.device(os.environ.get("GPU_CHECK_DEVICE", "cuda:0"))  # cpu: a smoke test of the script
CUDA = GPU.type == "cuda"


class Saves:
    """A launcher that keeps rank 0's checkpoints in memory."""
    restore_seconds = 0.0

    def __init__(self):
        self.checkpoints = []

    def latest_checkpoint(self):
        return None

    def report(self, metrics, state, epoch, step=0):
        if state is not None:
            self.checkpoints.append((epoch, step))


RUNS = {"lenet, digits, --amp": dict(dataset="digits", model="lenet", amp=True, epochs=3),
        "resnet18, synthetic, --sync-bn --amp": dict(dataset="synthetic", synthetic_size=512, model="resnet18",
                                                     sync_bn=True, amp=True, epochs=2, lr=0.02),
        "mlp, digits, --accum-steps 2, checks every step": dict(dataset="digits", model="mlp", accum_steps=2,
                                                                epochs=2, check_replicas="1")}


def _rank(rank, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    if CUDA:
        torch.cuda.set_device(GPU)
    results = {}
    for name, settings in RUNS.items():
        cfg = ray_dp.Config(**settings, workers=2, gpu=CUDA, quiet=True, checkpoint_every="5")
        cfg, _ = ray_dp.check_data(cfg)
        tic = time.perf_counter()
        try:
            launcher = Saves()
            loop_out = ray_dp.train_loop_per_worker({"config": cfg, "options": ray_dp.LoopOptions(),
                                                     "worker": ray_dp.Worker(rank, 2, GPU), "launcher": launcher})
            history = loop_out["history"]
            results[name] = {"ok": loop_out["stopped"] is None, "stopped": loop_out["stopped"],
                             "test_acc": history[-1].get("test_acc"), "train_loss": history[-1]["train_loss"],
                             "test_count": history[-1]["test_count"], "saves": len(launcher.checkpoints),
                             "seconds": round(time.perf_counter() - tic, 1)}
        except Exception as exc:  # a path that fails on a GPU: what to fix
            results[name] = {"ok": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    try:  # torch's flight recorder, as ray_dp's Watchdog writes it to hang/rank<N>.json
        from torch._C._distributed_c10d import _dump_fr_trace_json
        recorded = _dump_fr_trace_json(True, False)
    except (ImportError, AttributeError, RuntimeError):
        recorded = None
    results["flight recorder"] = bool(recorded and json.loads(recorded).get("pg_status"))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def timed(fn, repeats):
    seconds = []
    for _ in range(repeats):
        ray_dp.synchronize(GPU)
        tic = time.perf_counter()
        fn()
        ray_dp.synchronize(GPU)
        seconds.append(time.perf_counter() - tic)
    return statistics.median(seconds)


def digest_costs():
    figures, worker = {}, ray_dp.Worker(0, 1, GPU)
    for name, build in MODELS.items():
        torch.manual_seed(0)
        model = ray_dp.on_device(build(), GPU, "lenet" if name == "lenet" else name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x, y = torch.rand(32, 1, 28, 28, device=GPU), torch.randint(0, 10, (32,), device=GPU)

        def step():
            with torch.autocast(GPU.type, dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        for _ in range(3):
            step()
        step_s = timed(step, 20)
        named = ray_dp.replica_state(model, optimizer, "step")
        check_s = timed(lambda: ray_dp.replicas_digest(named, worker), 20)
        every = max(math.ceil(check_s / (ray_dp.CHECK_SHARE * step_s)), 1)
        figures[name] = {"step ms": round(1e3 * step_s, 3), "digest ms": round(1e3 * check_s, 3),
                         "auto checks every N steps": every,
                         "share at that interval %": round(100 * check_s / (every * step_s), 2)}
    return figures


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "bench", "gpu_check.json")
    report = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if CUDA else "none",
              "hash_tensor": hasattr(torch, "hash_tensor")}
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), os.path.join(tmp, "out.json")), nprocs=2)
        with open(os.path.join(tmp, "out.json")) as f:
            report["runs on 2 gloo processes sharing the GPU"] = json.load(f)
    report["a replica check beside a bf16 training step, batch 32"] = digest_costs()
    with open(out_path, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
