"""The distributed maths, checked exactly against single-process references (gloo, no Ray)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ray_dp
from helpers import here, assert_bitwise_equal, random_images, run_distributed

CPU = torch.device("cpu")
pytestmark = pytest.mark.timeout(240)


def new_model_and_optimizer(cfg):
    torch.manual_seed(cfg.seed)
    model = ray_dp.build_model(cfg.model, (1, 28, 28))
    return model, torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


def ddp_epochs(cfg_fields, data, epochs=1):
    """Worker side: ray_dp's own train_epoch under DDP on this process group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ray_dp.Config(**cfg_fields, workers=world)
    model, optimizer = new_model_and_optimizer(cfg)
    model = ray_dp.wrap_model(model, CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    batches = ray_dp.train_batches(data, cfg, rank, world, CPU)
    for epoch in range(epochs):
        stats = ray_dp.train_epoch(model, optimizer, batches, cfg, here(), epoch, ray_dp.Operations(cfg, here()))
    return {"params": [p.detach().clone() for p in ray_dp.unwrap(model).parameters()], "stats": stats}


def single_process_reference(cfg, data, world):
    """Plain SGD, one process: step s uses the union of every rank's s-th slice of batch/world samples."""
    model, optimizer = new_model_and_optimizer(cfg)
    shards = [list(ray_dp.train_sampler(data, r, world, cfg.seed)) for r in range(world)]
    per_rank = cfg.batch_size // world
    images, labels = data.tensors
    for step in range(len(shards[0]) // per_rank):
        index = torch.tensor([i for shard in shards for i in shard[step * per_rank:(step + 1) * per_rank]])
        optimizer.zero_grad()
        F.cross_entropy(model(images[index]), labels[index]).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("world, accum", [(2, 1), (1, 2), (2, 2)])
def test_ddp_steps_equal_single_process_steps_on_the_global_batch(world, accum):
    # 48 samples, global batch 16: 3 optimizer steps; with accum 2 each step is 2 no_sync'd micro-batches.
    fields = dict(model="lenet", batch_size=16, accum_steps=accum, lr=0.1, momentum=0.9, seed=3)
    data = random_images(48)
    results = run_distributed(ddp_epochs, world, fields, data)
    expected = single_process_reference(ray_dp.Config(**fields, workers=world), data, world)
    for result in results:  # every rank holds the same parameters, equal to the reference
        assert result["stats"]["train_samples"] == 48
        for got, want in zip(result["params"], expected):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dataloader_path_trains_exactly_like_the_in_memory_path():
    # The same sampler, so the same micro-batches in the same order; the second epoch checks that
    # set_epoch's reshuffle reaches the loader, whose processes persist across epochs.
    fields = dict(model="lenet", batch_size=16, lr=0.1, momentum=0.9, seed=3, epochs=2)
    data = random_images(48)
    in_memory = run_distributed(ddp_epochs, 2, fields, data, 2)
    loader = run_distributed(ddp_epochs, 2, {**fields, "loader_workers": 2}, data, 2)
    for a, b in zip(in_memory, loader):
        assert b["stats"]["train_samples"] == 48
        assert b["stats"]["train_loss"] == a["stats"]["train_loss"]
        for got, want in zip(b["params"], a["params"]):
            assert torch.equal(got, want)


def test_training_loss_is_averaged_over_all_workers():
    fields = dict(model="mlp", batch_size=16, lr=0.01, momentum=0.0, seed=0)
    data = random_images(16)
    results = run_distributed(ddp_epochs, 2, fields, data)
    # One step; its loss is the mean over all 16 samples, computed before the update.
    model, _ = new_model_and_optimizer(ray_dp.Config(**fields))
    images, labels = data.tensors
    expected = F.cross_entropy(model(images), labels).item()
    assert results[0]["stats"]["train_loss"] == results[1]["stats"]["train_loss"]
    assert results[0]["stats"]["train_loss"] == pytest.approx(expected, rel=1e-6)


def step_logs_of_epochs(fields, data, epochs):
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ray_dp.Config(**fields, workers=world)
    model, _ = new_model_and_optimizer(cfg)
    model = ray_dp.wrap_model(model, CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    batches, checkpointer = ray_dp.train_batches(data, cfg, rank, world, CPU), ray_dp.Operations(cfg, here())
    return [ray_dp.train_epoch(model, optimizer, batches, cfg, here(), epoch, checkpointer)["step_log"]
            for epoch in range(epochs)]


def test_an_epoch_shorter_than_log_every_still_logs_every_log_every_steps_of_the_run():
    # 40 samples, global batch 8: 5 steps an epoch, fewer than --log-every 4... twice over 3 epochs
    fields = dict(model="mlp", batch_size=8, lr=0.01, seed=0, log_every=4)
    zero, one = run_distributed(step_logs_of_epochs, 2, fields, random_images(40), 3)
    assert [[step for step, _ in log] for log in zero] == [[4], [8], [12]]
    assert zero == one and all(0 < loss < 10 for log in zero for _, loss in log)


def evaluate_on_rank(data):
    model, _ = new_model_and_optimizer(ray_dp.Config(model="lenet"))
    return ray_dp.evaluate(model, data, CPU, batch_size=7)


def test_exact_evaluation_counts_every_test_sample_once_on_3_workers():
    data = random_images(100, seed=5)  # 100 is not a multiple of 3: a padding sampler would count 102
    results = run_distributed(evaluate_on_rank, 3, data)
    expected = evaluate_on_rank(data)  # no process group: one process scores everything
    assert expected["test_count"] == 100
    for result in results:
        assert result["test_count"] == 100
        assert result["test_acc"] == expected["test_acc"]
        assert result["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-6)  # float32 batch sums, added in another order


@pytest.mark.parametrize("n, world", [(100, 1), (100, 2), (100, 3), (100, 7), (3, 7), (0, 2)])
def test_eval_shards_are_disjoint_and_cover_the_test_set(n, world):
    shards = [ray_dp.shard_indices(n, r, world) for r in range(world)]
    assert sorted(torch.cat(shards).tolist()) == list(range(n))


@pytest.mark.parametrize("world", [2, 3])
def test_train_shards_are_disjoint_cover_the_data_and_reshuffle_each_epoch(world):
    data = random_images(50)
    samplers = [ray_dp.train_sampler(data, r, world, seed=0) for r in range(world)]
    epoch0 = [list(s) for s in samplers]
    flat = [i for shard in epoch0 for i in shard]
    assert len(set(flat)) == len(flat) == 50 - 50 % world  # disjoint; drop_last trims the remainder only
    assert len({len(shard) for shard in epoch0}) == 1  # equal counts: equal step counts on every rank
    for s in samplers:
        s.set_epoch(1)
    assert [list(s) for s in samplers] != epoch0


def sync_bn_on_rank(x_full, grad_full):
    rank, world = dist.get_rank(), dist.get_world_size()
    bn = ray_dp.SyncBatchNormCPU(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.5, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = x_full.chunk(world)[rank].clone().requires_grad_()
    out = bn(x)
    out.backward(grad_full.chunk(world)[rank])
    return {"out": out.detach(), "x_grad": x.grad, "w_grad": bn.weight.grad, "b_grad": bn.bias.grad,
            "running_mean": bn.running_mean, "running_var": bn.running_var}


@pytest.mark.parametrize("shape, batchnorm", [((8, 3), nn.BatchNorm1d), ((8, 3, 5, 5), nn.BatchNorm2d),
                                              ((8, 3, 2, 3, 4), nn.BatchNorm3d)], ids=["1d", "2d", "3d"])
def test_cpu_sync_batchnorm_on_2_workers_equals_batchnorm_over_the_full_batch(shape, batchnorm):
    gen = torch.Generator().manual_seed(0)
    x_full = torch.randn(*shape, generator=gen) * 2 + 1
    grad_full = torch.randn(*shape, generator=gen)
    ranks = run_distributed(sync_bn_on_rank, 2, x_full, grad_full)

    bn = batchnorm(3)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.5, -1.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = x_full.clone().requires_grad_()
    out = bn(x)
    out.backward(grad_full)

    close = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks]), out.detach(), **close)
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in ranks]), x.grad, **close)
    # Parameter gradients are per-rank partial sums; DDP's all-reduce adds them up.
    torch.testing.assert_close(ranks[0]["w_grad"] + ranks[1]["w_grad"], bn.weight.grad, **close)
    torch.testing.assert_close(ranks[0]["b_grad"] + ranks[1]["b_grad"], bn.bias.grad, **close)
    for r in ranks:
        torch.testing.assert_close(r["running_mean"], bn.running_mean, **close)
        torch.testing.assert_close(r["running_var"], bn.running_var, **close)


def test_convert_sync_bn_replaces_every_batchnorm_and_keeps_its_state():
    model = ray_dp.resnet18(1)
    bn_count = sum(type(m) is nn.BatchNorm2d for m in model.modules())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ray_dp.convert_sync_bn(model, CPU)
    assert sum(isinstance(m, ray_dp.SyncBatchNormCPU) for m in model.modules()) == bn_count == 17
    assert not any(type(m) is nn.BatchNorm2d for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    table = ray_dp.convert_sync_bn(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, affine=False)), CPU)
    assert isinstance(table[1], ray_dp.SyncBatchNormCPU) and not table[1].affine  # a tabular model's, too


def sync_bn_cumulative(x_full):
    """Two training steps of a converted double-precision BatchNorm1d with momentum=None on this rank's share."""
    model = ray_dp.convert_sync_bn(nn.Sequential(nn.BatchNorm1d(3, momentum=None)).double(), CPU)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):
        model(x_full[step].chunk(world)[rank])
    return {"running_mean": model[0].running_mean, "running_var": model[0].running_var}


def test_cpu_sync_batchnorm_keeps_the_cumulative_average_and_the_dtype_of_the_batchnorm_it_replaces():
    x_full = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3 + 2
    ranks = run_distributed(sync_bn_cumulative, 2, x_full)
    bn = nn.BatchNorm1d(3, momentum=None).double()
    for step in range(2):
        bn(x_full[step])
    for r in ranks:
        assert r["running_mean"].dtype == torch.float64
        torch.testing.assert_close(r["running_mean"], bn.running_mean)
        torch.testing.assert_close(r["running_var"], bn.running_var)


def test_convert_sync_bn_keeps_the_very_tensors_frozen_layers_and_eval_mode_and_takes_torchs_syncbn_on_cpu():
    frozen = nn.BatchNorm2d(4).eval()
    frozen.weight.requires_grad_(False)
    model = ray_dp.convert_sync_bn(nn.Sequential(frozen, nn.SyncBatchNorm(4)), CPU)
    assert all(isinstance(m, ray_dp.SyncBatchNormCPU) for m in model)
    assert model[0].weight is frozen.weight and model[0].running_mean is frozen.running_mean
    assert not model[0].weight.requires_grad and not model[0].training and model[1].training


def test_amp_bf16_step_is_close_to_the_fp32_step():
    fields = dict(model="lenet", batch_size=16, lr=0.1, momentum=0.0, seed=3)
    data = random_images(16)
    amp = run_distributed(ddp_epochs, 2, {**fields, "amp": True}, data)[0]["params"]
    fp32 = single_process_reference(ray_dp.Config(**fields, workers=2), data, 2)
    assert any(not torch.equal(got, want) for got, want in zip(amp, fp32))  # autocast really ran in bf16
    model, _ = new_model_and_optimizer(ray_dp.Config(**fields))
    for got, want, start in zip(amp, fp32, model.parameters()):
        assert got.dtype == torch.float32  # autocast computes in bf16, the weights stay fp32
        # bf16 keeps ~3 significant digits: the update agrees with fp32's to a few percent.
        torch.testing.assert_close(got - start.detach(), want - start.detach(), rtol=0.05, atol=2e-3)


def test_unwrap_strips_compile_and_ddp_wrappers_for_checkpoints():
    model = ray_dp.build_model("mlp", (1, 28, 28))
    assert ray_dp.unwrap(torch.compile(model)) is model  # compiling is lazy: nothing is built here
    assert list(ray_dp.unwrap(torch.compile(model)).state_dict()) == ["1.weight", "1.bias", "3.weight", "3.bias"]


def upstream_gradient(x_full):
    """A random gradient from above (the gradient of a plain sum through BatchNorm is ~0: it tests nothing)."""
    return torch.randn(x_full.shape, generator=torch.Generator().manual_seed(9))


def sync_bn_uneven(x_full, sizes, amp):
    """SyncBatchNormCPU on this rank's share of x_full (ranks get `sizes` samples each), under bf16 autocast
    after a conv when amp (the conv is what hands BatchNorm bf16 inputs)."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 3, 1), ray_dp.SyncBatchNormCPU(3)
    x = x_full.split(sizes)[rank].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = bn(conv(x))
    out.float().backward(upstream_gradient(x_full).split(sizes)[rank])
    return {"out": out.detach().float(), "x_grad": x.grad, "running_mean": bn.running_mean,
            "running_var": bn.running_var}


def full_batch_bn(x_full, amp):
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)
    x = x_full.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
        out = bn(conv(x))
    out.float().backward(upstream_gradient(x_full))
    return {"out": out.detach().float(), "x_grad": x.grad, "running_mean": bn.running_mean,
            "running_var": bn.running_var}


@pytest.mark.parametrize("offset", [30.0, 1000.0, 5000.0])
def test_cpu_sync_batchnorm_stays_exact_for_large_means_on_uneven_batches(offset):
    # E[x^2] - mean^2 in fp32 was off by 1.8 at mean 5000; Chan's combination of per-rank (mean, M2) is not.
    gen = torch.Generator().manual_seed(1)
    x_full = torch.randn(8, 3, 4, 4, generator=gen) + offset
    ranks = run_distributed(sync_bn_uneven, 2, x_full, [3, 5], False)
    want = full_batch_bn(x_full, False)
    # fp32 itself rounds inputs near 5000 to ~5e-4 (its spacing there): a few of those, not 1.8.
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks]), want["out"], rtol=0, atol=3e-3)
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in ranks]), want["x_grad"], rtol=0, atol=3e-3)
    for r in ranks:
        torch.testing.assert_close(r["running_mean"], want["running_mean"], rtol=1e-6, atol=1e-4)
        torch.testing.assert_close(r["running_var"], want["running_var"], rtol=1e-3, atol=1e-3)


def test_cpu_sync_batchnorm_runs_under_bf16_autocast_like_batchnorm():
    gen = torch.Generator().manual_seed(2)
    x_full = torch.randn(8, 3, 4, 4, generator=gen) * 2 + 1
    ranks = run_distributed(sync_bn_uneven, 2, x_full, [4, 4], True)
    want = full_batch_bn(x_full, True)
    for r in ranks:
        assert r["running_mean"].dtype == r["running_var"].dtype == torch.float32
        torch.testing.assert_close(r["running_mean"], want["running_mean"], rtol=0.02, atol=0.02)
    # bf16 keeps ~3 significant digits
    torch.testing.assert_close(torch.cat([r["out"] for r in ranks]), want["out"], rtol=0.05, atol=0.05)


def bn_model_trained_then_evaluated(data, test):
    """DDP resnet18 (plain BatchNorm, no --sync-bn) trained on different samples per rank, then scored the
    way the training loop scores it; returns the metrics and rank 0's weights (what its checkpoint holds)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ray_dp.Config(model="resnet18", batch_size=8, lr=0.05, seed=0, workers=world)
    torch.manual_seed(0)
    model = ray_dp.wrap_model(ray_dp.build_model("resnet18", (1, 8, 8)), CPU)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    ray_dp.train_epoch(model, optimizer, ray_dp.train_batches(data, cfg, rank, world, CPU), cfg, here(), 0,
                       ray_dp.Operations(cfg, here()))
    drifted = ray_dp.unwrap(model).state_dict()["1.running_mean"].clone()
    broadcast, dtypes = dist.broadcast, []
    dist.broadcast = lambda tensor, src: dtypes.append(tensor.dtype) or broadcast(tensor, src)
    try:
        metrics = ray_dp.evaluate_as_saved(model, test, cfg, CPU)
    finally:
        dist.broadcast = broadcast
    return {"metrics": metrics, "drifted": drifted, "state": ray_dp.unwrap(model).state_dict(), "dtypes": dtypes}


@pytest.mark.timeout(300)
def test_reported_metrics_of_a_batchnorm_model_are_those_of_the_saved_checkpoint():
    gen = torch.Generator().manual_seed(3)
    data = ray_dp.TensorDataset(torch.rand(32, 1, 8, 8, generator=gen) * torch.arange(32).view(-1, 1, 1, 1) / 8,
                                torch.randint(0, 10, (32,), generator=gen))
    test = ray_dp.TensorDataset(torch.rand(20, 1, 8, 8, generator=gen), torch.randint(0, 10, (20,), generator=gen))
    ranks = run_distributed(bn_model_trained_then_evaluated, 2, data, test)
    assert not torch.equal(ranks[0]["drifted"], ranks[1]["drifted"])  # the ranks' statistics did drift apart
    assert_bitwise_equal(ranks[1]["state"], ranks[0]["state"])  # then every rank took rank 0's
    # in one broadcast per dtype (the statistics' floats, the batch counts), not one per buffer (60)
    assert ranks[0]["dtypes"] == ranks[1]["dtypes"] == [torch.float32, torch.int64]
    saved = ray_dp.build_model("resnet18", (1, 8, 8))
    saved.load_state_dict(ranks[0]["state"])  # rank 0 writes the checkpoint: what --eval-only then scores
    expected = ray_dp.evaluate(saved.eval(), test, CPU)
    for r in ranks:
        assert r["metrics"]["test_acc"] == expected["test_acc"] and r["metrics"]["test_count"] == 20
        assert r["metrics"]["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-5)


def all_reduces_per_epoch(compiled):
    """Gradient all-reduces DDP makes in one epoch of 2 steps x 4 accumulated micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ray_dp.Config(model="lenet", batch_size=16, accum_steps=4, lr=0.1, seed=3, workers=world)
    model, _ = new_model_and_optimizer(cfg)
    ddp = ray_dp.wrap_model(model, CPU)
    calls = []

    def counting_allreduce(state, bucket):
        calls.append(1)
        return dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future().then(
            lambda fut: fut.value()[0])
    ddp.register_comm_hook(None, counting_allreduce)
    wrapped = torch.compile(ddp, backend="eager") if compiled else ddp  # eager: the wrapper without inductor
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=cfg.lr)
    ray_dp.train_epoch(wrapped, optimizer, ray_dp.train_batches(random_images(32), cfg, rank, world, CPU), cfg, here(), 0,
                       ray_dp.Operations(cfg, here()))
    return len(calls)


def test_gradient_accumulation_skips_all_reduces_under_torch_compile_too():
    plain, compiled = run_distributed(all_reduces_per_epoch, 2, False)[0], run_distributed(all_reduces_per_epoch, 2,
                                                                                          True)[0]
    assert plain == compiled == 2  # one per optimizer step (LeNet's gradients fit one bucket), not one per micro-batch


def test_evaluation_on_more_workers_than_test_samples_counts_each_once():
    data = random_images(1, seed=5)
    results = run_distributed(evaluate_on_rank, 3, data)  # ranks 1 and 2 have no sample
    assert [r["test_count"] for r in results] == [1, 1, 1]
    assert results[0]["test_acc"] == evaluate_on_rank(data)["test_acc"]
