"""Teaching mode (--mode scratch): hand-written all-reduce and SGD, checked against DDP and one process."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ray_dp
from helpers import random_images, run_distributed

CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(240)
SIZES = [1, 7, 10, 1001]  # 1 and 7 are smaller than / not divisible by the worker count


def rank_tensors(rank, integer_valued):
    gen = torch.Generator().manual_seed(100 + rank)
    tensors = [torch.randn(n, generator=gen) for n in SIZES]
    return [t.round() * 3 if integer_valued else t for t in tensors]


def allreduce_each_way(integer_valued):
    rank = dist.get_rank()
    results = {}
    for algorithm in ray_dp.ALLREDUCE_ALGORITHMS:
        grads = rank_tensors(rank, integer_valued)
        nbytes = ray_dp.allreduce(grads, algorithm)
        raw = torch.cat(rank_tensors(rank, integer_valued))[3:]  # also the bare algorithm on an odd-sized buffer
        ray_dp.ALLREDUCE[algorithm](raw)
        results[algorithm] = (grads, raw, nbytes)
    return results


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("integer_valued", [True, False], ids=["exact", "float"])
def test_naive_ring_and_library_allreduce_give_the_same_sums(world, integer_valued):
    ranks = run_distributed(allreduce_each_way, world, integer_valued)
    expected = [sum(ts) for ts in zip(*[rank_tensors(r, integer_valued) for r in range(world)])]
    expected_raw = torch.cat(expected)[3:]
    for result in ranks:
        for algorithm, (grads, raw, nbytes) in result.items():
            assert nbytes == 4 * sum(SIZES)
            for got, want in zip(grads + [raw], expected + [expected_raw]):
                if integer_valued:  # sums of small integers are exact in float32, whatever the order
                    assert torch.equal(got, want), algorithm
                else:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def scratch_steps(cfg_fields, data, steps):
    """Hand-written steps on this process group; asserts every rank holds identical parameters after each."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    cfg = ray_dp.Config(**cfg_fields)
    worker = ray_dp.Worker(rank, world, CPU)
    params = ray_dp.get_params(ray_dp.init_lenet_params(cfg.seed), CPU)
    images, labels = data.tensors
    for step in range(steps):
        index = slice(step * cfg.batch_size, (step + 1) * cfg.batch_size)
        ray_dp.train_batch(images[index], labels[index], params, cfg.lr, cfg.allreduce, worker)
        if world > 1:
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            gathered = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(gathered, flat)
            assert all(torch.equal(g, gathered[0]) for g in gathered), f"ranks differ after step {step}"
    epoch = ray_dp.scratch_train_epoch(params, data, cfg, worker, 0, ray_dp.Operations(cfg, worker))  # plus one full epoch of batches
    return {"params": [p.detach().clone() for p in params], "epoch": epoch}


@pytest.mark.parametrize("algorithm", ray_dp.ALLREDUCE_ALGORITHMS)
def test_scratch_on_2_workers_equals_scratch_on_1_worker_with_the_same_global_batch(algorithm):
    # A large lr so the few steps move the small (randn * 0.01) weights measurably.
    fields = dict(batch_size=16, lr=5.0, lr_schedule="constant", allreduce=algorithm, seed=4)
    data = random_images(64)
    one = scratch_steps(fields, data, steps=3)
    two = run_distributed(scratch_steps, 2, fields, data, 3)
    assert one["epoch"]["train_samples"] == two[0]["epoch"]["train_samples"] == 64
    assert two[0]["epoch"]["allreduce_bytes"] > 0 and one["epoch"]["allreduce_bytes"] == 0
    moved = max((p - q).abs().max() for p, q in zip(one["params"], ray_dp.init_lenet_params(4)))
    assert moved > 1e-3
    for got, want in zip(two[0]["params"], one["params"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert two[0]["epoch"]["train_loss"] == pytest.approx(one["epoch"]["train_loss"], rel=1e-6)


def scratch_and_ddp_step(X, y, lr):
    rank, world = dist.get_rank(), dist.get_world_size()
    initial = ray_dp.init_lenet_params(seed=7)
    params = ray_dp.get_params(initial, CPU)
    ray_dp.train_batch(X, y, params, lr, "naive", ray_dp.Worker(rank, world, CPU))  # sum loss, sgd / global batch

    model = ray_dp.LeNet()
    model.load_state_dict(ray_dp.params_to_state_dict(initial))
    model = ray_dp.wrap_model(model, CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)  # plain SGD, mean loss, DDP averages gradients
    X_slice, y_slice = ray_dp.split_batch(X, y, rank, world)
    F.cross_entropy(model(X_slice), y_slice).backward()
    optimizer.step()
    return ray_dp.params_to_state_dict(params), ray_dp.unwrap(model).state_dict()


def test_one_scratch_step_equals_one_ddp_step():
    data = random_images(16, seed=9)
    for scratch, ddp in run_distributed(scratch_and_ddp_step, 2, *data.tensors, 5.0):
        assert scratch.keys() == ddp.keys()
        for key in scratch:
            torch.testing.assert_close(scratch[key], ddp[key], rtol=1e-5, atol=1e-7)


def test_lesson_parameters_have_the_lesson_shapes_and_init():
    params = ray_dp.init_lenet_params(seed=0)
    assert [tuple(p.shape) for p in params] == [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,),
                                                 (128, 10), (10,)]
    assert all(torch.equal(a, b) for a, b in zip(params, ray_dp.init_lenet_params(seed=0)))  # same on every worker
    assert all(p.abs().sum() == 0 for p in params[1::2])  # zero biases
    assert 0.008 < params[2].std() < 0.012  # randn * 0.01
    # The same numbers in LeNet's layout give the same function.
    model = ray_dp.LeNet()
    model.load_state_dict(ray_dp.params_to_state_dict(params))
    X = torch.rand(3, 1, 28, 28)
    torch.testing.assert_close(model(X), ray_dp.lenet(X, params))
