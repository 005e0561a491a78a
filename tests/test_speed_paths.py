"""What makes a worker's step as fast as the plain loop's (#25), asserted as behaviour, not as time (the times are
bench/bench.py's --step-only and --plain-only): the allocator keeps what a step frees, gives it back before a fork,
and the channels_last layout computes the same gradients as the layout a model is built in."""
import os
import resource
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ray_dp
from helpers import run_distributed

pytestmark = pytest.mark.timeout(120)


def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def step_faults(steps=8):
    """Page faults of `steps` steps that each write a 64 MB block (one layer's activations) and free it."""
    before = faults()
    for _ in range(steps):
        torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
    return faults() - before


def resident():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def allocator_counts():
    """In a process of its own (mallopt's settings cannot be undone, and page faults are counted per process),
    forked from the gloo tests' server, which never sets them: glibc's default, then ray_dp's."""
    default = step_faults()
    ray_dp.keep_freed_memory()
    step_faults(10)  # the heap grows until the block fits wherever small allocations fell: a few steps
    kept = step_faults()
    before_fork = resident()
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    return {"default": default, "kept": kept, "given back": before_fork - resident()}


def glibc():
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


@pytest.mark.skipif(not glibc(), reason="mallopt is glibc's")
def test_a_workers_allocator_keeps_freed_blocks_and_gives_them_back_before_a_fork():
    [counts] = run_distributed(allocator_counts, 1, keep_freed=False)
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    # glibc's default: every step's block comes fresh from the kernel, each of its pages a fault
    assert counts["default"] >= 8 * pages * 0.9
    # kept: the steps reuse the block, not a page faults again
    assert counts["kept"] < pages / 10
    # before the fork the free block went back to the kernel (a child would share it copy-on-write)
    assert counts["given back"] >= (64 << 20) * 0.9


# Blocks of 128 MB written and freed in a thread, as Ray trains in a thread of the worker process; the page faults
# of the last 8. With ray_dp: its thresholds (keep_freed_memory) and torch's allocator, in a process started as Ray
# starts a worker (conftest.worker_like_process). Without: glibc's malloc under the same thresholds, in a process
# started with glibc's defaults, that does not import torch (seconds of CPU).
IN_A_THREAD = """
import ctypes, resource, sys, threading
if WITH_RAY_DP:
    import ray_dp, torch
    def written():
        torch.empty(128 << 20, dtype=torch.uint8).fill_(1)
else:
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    def written():
        block = libc.malloc(128 << 20)
        libc.memset(block, 1, 128 << 20)
        libc.free(block)
def steps(out):
    if WITH_RAY_DP:
        ray_dp.keep_freed_memory()
    else:
        assert all(libc.mallopt(int(option), int(sys.argv[1])) for option in sys.argv[2:])
    for _ in range(10 if WITH_RAY_DP else 1):  # the heap grows until the block fits
        written()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(8):
        written()
    out.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
out = []
thread = threading.Thread(target=steps, args=(out,))
thread.start(), thread.join()
result = out[0]
ctypes.CDLL(None).malloc_trim(0)  # the kept block back to the kernel (a shared process serves on)
"""


@pytest.mark.skipif(not glibc(), reason="mallopt is glibc's")
@pytest.mark.xdist_group("worker-like-process")
def test_a_thread_keeps_its_freed_128_mb_blocks_in_the_one_arena_rays_workers_get(worker_like_process):
    pages = (128 << 20) // os.sysconf("SC_PAGE_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in ray_dp.MALLOC_SETTINGS}
    thresholds = [str(ray_dp.KEPT_FREED_BYTES), str(ray_dp.M_MMAP_THRESHOLD), str(ray_dp.M_TRIM_THRESHOLD)]
    own_arena = subprocess.run([sys.executable, "-c", f"WITH_RAY_DP = False\n{IN_A_THREAD}\nprint(result)",
                                *thresholds], env=env, capture_output=True, text=True)
    assert own_arena.returncode == 0, own_arena.stderr[-800:]
    # a thread's own arena: each block over 64 MiB comes fresh from the kernel, thresholds or not
    assert int(own_arena.stdout) >= 8 * pages * 0.9
    # the runtime environment of Ray's training workers: one arena, whose thresholds keep the block
    assert worker_like_process.run(f"WITH_RAY_DP = True\n{IN_A_THREAD}") < pages / 10


@pytest.mark.parametrize("name,shape", [("lenet", (1, 28, 28)), ("resnet18", (1, 12, 12)),
                                        ("mobilenet_v3_small", (3, 32, 32))])
def test_channels_last_computes_the_gradients_of_the_layout_the_model_is_built_in(name, shape):
    torch.set_default_dtype(torch.float64)  # rounding ~1e-16: a layout bug would be ~1e-1
    try:
        torch.manual_seed(0)
        built = ray_dp.build_model(name, shape)
        placed = ray_dp.on_device(ray_dp.build_model(name, shape), torch.device("cpu"), name)
        placed.load_state_dict(built.state_dict())
        images, labels = torch.randn(6, *shape), torch.randint(0, 10, (6,))
        for model in (built, placed):
            torch.manual_seed(1)  # the same dropout masks
            F.cross_entropy(model(images), labels).backward()
    finally:
        torch.set_default_dtype(torch.float32)
    weights = [p for p in placed.parameters() if p.ndim == 4]
    assert weights and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
    assert not all(p.is_contiguous() for p in weights)  # moved: some weights' strides are NHWC's only
    for (key, a), b in zip(built.named_parameters(), placed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-9, atol=1e-12, msg=key)


def test_a_users_own_malloc_settings_are_left_as_they_are(monkeypatch):
    calls = []
    monkeypatch.setattr(ray_dp, "memory_kept", False)
    monkeypatch.setattr(ray_dp.ctypes, "CDLL", lambda name: calls.append(name))
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    ray_dp.keep_freed_memory()
    assert calls == [] and not ray_dp.memory_kept


def test_every_worker_loop_keeps_freed_memory(monkeypatch):
    """operations(), which the training, teaching and evaluation loops all start with, under Ray and torchrun."""
    kept = []
    monkeypatch.setattr(ray_dp, "keep_freed_memory", lambda: kept.append(True))  # not in pytest's own process
    monkeypatch.setattr(ray_dp.Worker, "current", classmethod(lambda cls, cfg: ray_dp.Worker(0, 1, CPU)))
    ops = ray_dp.operations({"config": ray_dp.Config(dataset="synthetic"), "options": ray_dp.LoopOptions()})
    assert kept == [True] and ops.cfg.dataset == "synthetic"
    ray_dp.operations({"config": ray_dp.Config(dataset="synthetic", keep_freed_memory=False),
                       "options": ray_dp.LoopOptions()})
    assert kept == [True]  # --no-keep-freed-memory: glibc's defaults


def test_rays_training_workers_share_one_arena_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE", raising=False)
    monkeypatch.delenv("RAY_worker_niceness", raising=False)
    # the flight recorder of their collectives (hang records); nice 0 (the next test)
    recorder = {"TORCH_FR_BUFFER_SIZE": "2000", "RAY_worker_niceness": "0"}
    assert ray_dp.worker_env(ray_dp.Config()) == {"env_vars": {**recorder, "MALLOC_ARENA_MAX": "1"}}
    assert ray_dp.worker_env(ray_dp.Config(keep_freed_memory=False)) == {"env_vars": recorder}
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")  # the user's own
    assert ray_dp.worker_env(ray_dp.Config()) == {"env_vars": recorder}
    monkeypatch.setenv("RAY_worker_niceness", "5")  # the user's own, passed on to a cluster's workers
    assert ray_dp.worker_env(ray_dp.Config())["env_vars"]["RAY_worker_niceness"] == "5"


CPU = torch.device("cpu")


def test_a_worker_trains_its_model_in_channels_last_and_saves_it_contiguous(monkeypatch, tmp_path):
    from test_differential import train
    placed = []
    wrap = ray_dp.wrap_model
    monkeypatch.setattr(ray_dp, "wrap_model", lambda model, *rest: placed.append(model) or wrap(model, *rest))
    cfg = ray_dp.Config(dataset="synthetic", synthetic_size=32, batch_size=16, epochs=1, model="lenet", quiet=True,
                        storage_path=str(tmp_path), name="layout")
    saved = train(cfg, 1, 0)["state"]
    conv = [p for p in placed[0].parameters() if p.ndim == 4][1]  # the second convolution: 6 input channels
    assert conv.is_contiguous(memory_format=torch.channels_last) and not conv.is_contiguous()
    assert all(tensor.is_contiguous() for tensor in saved["model"].values())
    assert saved["model"].keys() == ray_dp.build_model("lenet", (1, 28, 28)).state_dict().keys()


def test_the_teaching_modes_convolutions_are_nhwc_as_ddps_lenet_on_a_cpu():
    params = ray_dp.get_params(ray_dp.init_lenet_params(0), CPU)
    weights = [p for p in params if p.ndim == 4]
    assert len(weights) == 2 and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
    assert not weights[1].is_contiguous()  # 6 input channels: NHWC's strides only (1 channel: both layouts')
    assert all(p.requires_grad for p in params)


@pytest.mark.ray
def test_rays_training_workers_run_at_nice_0_as_torchrun_s_while_rays_other_workers_keep_15(ray_cluster):
    import ray

    @ray.remote(num_cpus=0)
    def niceness():
        return os.nice(0)
    trainer = niceness.options(runtime_env=ray_dp.worker_env(ray_dp.Config()))
    assert ray.get([trainer.remote(), niceness.remote()]) == [os.nice(0), min(os.nice(0) + 15, 19)]

