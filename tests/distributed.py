"""Run a function on N local processes joined in a gloo process group (no Ray): for exact maths tests."""
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank, world, fn, args, workdir):
    dist.init_process_group("gloo", init_method=f"file://{workdir}/store", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        torch.save(fn(*args), os.path.join(workdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world, *args):
    """fn(*args) on `world` ranks; returns the list of the ranks' return values (rank order)."""
    with tempfile.TemporaryDirectory() as workdir:
        mp.spawn(_entry, args=(world, fn, args, workdir), nprocs=world, join=True)
        return [torch.load(os.path.join(workdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
