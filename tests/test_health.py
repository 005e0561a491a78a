"""A run that proves its own health (#48): the replicas' digests compared across ranks (a change on one rank named
with its rank and tensor), a checkpoint's certificate (an altered one refused before any step), the ledger of the
run's time (its categories sum to the wall clock, a failure's loss counted), a straggler named, and what a rank's
watchdog writes."""
import contextlib
import copy
import io
import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

import ray_dp
from helpers import error_of, here, run_distributed, save_run, train_worker
from test_spot import Saves

# Its digest tests share a module-scoped fixture (one process group for all): under pytest-xdist the module's tests run
# on one worker, which computes it once.
XDIST_GROUP = "test_health"

CPU = torch.device("cpu")


def digest_check(model_name, dtype, change, stage):
    """On each rank: the same model (seed 0), changed as `change` says (None; ("nudge", rank, tensor, by): one
    element of a tensor on one rank; ("constant", rank): a bias filled with another constant there), compared at
    `stage`: the error or None, and this rank's digest."""
    torch.manual_seed(0)
    model = ray_dp.build_model(model_name, (1, 28, 28)).to(dtype)
    rank = dist.get_rank()
    with torch.no_grad():
        if change and change[0] == "nudge" and rank == change[1]:
            dict(model.named_parameters(), **dict(model.named_buffers()))[change[2]].view(-1)[3] += change[3]
        if change and change[0] == "constant":
            model.classifier[0].bias.fill_(0.5 if rank == change[1] else 0.25)
    named = ray_dp.replica_state(model, None, stage)
    hashes, slots = ray_dp.replicas_digest(named, here())
    try:
        ray_dp.compare_replicas(named, hashes, ray_dp.all_reduce_sum(slots.clone()).tolist(), here(), "in the test")
        error = None
    except ray_dp.RunFailed as exc:
        error = str(exc)
    return error, slots[2 * rank:2 * rank + 2].tolist()


NUDGE = ("nudge", 1, "classifier.0.bias")  # one element of a tensor on rank 1, by a step its dtype holds
BUFFER_NUDGE = ("nudge", 2, "1.running_mean", 1e-6)  # BatchNorm's running mean on rank 2
DIGEST_CASES = {
    **{("equal", dtype): ("lenet", dtype, None, "epoch") for dtype in (torch.float32, torch.bfloat16, torch.float64)},
    ("nudged", torch.float32): ("lenet", torch.float32, (*NUDGE, 1e-6), "step"),
    ("nudged", torch.bfloat16): ("lenet", torch.bfloat16, (*NUDGE, 1e-2), "step"),  # 8 bits of mantissa
    "constant": ("lenet", torch.float32, ("constant", 2), "step"),
    **{("buffer", stage): ("resnet18", torch.float32, BUFFER_NUDGE, stage) for stage in ("step", "epoch")},
}


def digest_checks(cases):
    return {case: digest_check(*arguments) for case, arguments in cases.items()}


@pytest.fixture(scope="module")
def digests():
    """Each of DIGEST_CASES on 3 ranks: [(error, digest) of each rank]. One process group runs them all (a group's
    processes take a second of CPU to start and stop)."""
    ranks = run_distributed(digest_checks, 3, DIGEST_CASES)
    return {case: [rank[case] for rank in ranks] for case in DIGEST_CASES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_equal_replicas_give_equal_digests_on_every_rank(dtype, digests):
    out = digests["equal", dtype]
    assert [error for error, _ in out] == [None] * 3
    assert out[0][1] == out[1][1] == out[2][1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_parameter_changed_on_one_rank_of_3_is_named_with_its_rank_and_tensor(dtype, digests):
    out = digests["nudged", dtype]
    assert out[0][0] == out[1][0] == out[2][0] == (
        "the replicas differ in the test: rank 1 of 3 hold other values than rank 0, first in classifier.0.bias; "
        "nothing is saved from them, and the same command resumes from the last checkpoint")


def test_equal_values_changed_together_are_seen_though_their_xor_is_not(digests):
    # a constant tensor of even size: the xor of its elements' bits is 0 whatever the constant
    assert torch.hash_tensor(torch.full((4,), 0.5)) == torch.hash_tensor(torch.full((4,), 0.25))
    assert "rank 2 of 3 hold other values than rank 0, first in classifier.0.bias" in digests["constant"][0][0]


def test_buffers_are_compared_where_rank_0s_were_just_broadcast_and_not_between(digests):
    # BatchNorm's running mean differs between ranks between two forward passes (DDP broadcasts rank 0's before
    # each): at a step it is not compared; at an epoch's end (rank 0's broadcast for evaluation) it is
    assert [error for error, _ in digests["buffer", "step"]] == [None] * 3
    assert "rank 2 of 3 hold other values than rank 0, first in 1.running_mean" in digests["buffer", "epoch"][0][0]


NUDGED = """
import torch, torch.nn as nn
class Nudged(nn.Module):
    '''A user's model that changes one parameter on rank 1 in its 20th forward pass.'''
    def __init__(self):
        super().__init__()
        self.layer, self.calls = nn.Linear(784, 10), 0
    def forward(self, x):
        self.calls += 1
        if self.calls == 20 and self.training and torch.distributed.get_rank() == 1:
            with torch.no_grad():
                self.layer.bias[0] += 1e-3
        return self.layer(x.flatten(1))
"""


def nudged_run(cfg):
    saves = Saves()
    out = train_worker(cfg, here(), saves, ray_dp.LoopOptions(), {})
    return out["stopped"], [where for where, _ in saves.checkpoints]


def test_a_model_that_nudges_a_parameter_on_rank_1_stops_the_run_at_the_next_check_before_any_later_save(tmp_path):
    (tmp_path / "nudged.py").write_text(NUDGED)
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(
        model=f"{tmp_path}/nudged.py:Nudged", dataset="synthetic", synthetic_size=400, batch_size=8, epochs=1,
        workers=2, check_replicas="5", checkpoint_every="8", quiet=True, name="nudged", storage_path=str(tmp_path)))
    (stopped, saved), _ = run_distributed(nudged_run, 2, cfg)
    assert stopped["by"] == ["replicas"] and stopped["error"].startswith(
        "the replicas differ after step 20 of epoch 1 (the run's step 20): rank 0 and rank 1 differ, and no majority "
        "of the 2 ranks tells which drifted, first in layer.bias")
    assert saved == [(1, 8), (1, 16)]  # the newest checkpoint is from before step 20: none from the replicas that differ


def scratch_without_one_layer(cfg):
    allreduce = ray_dp.allreduce
    ray_dp.allreduce = lambda grads, algorithm: allreduce(grads[:-1], algorithm)  # the last bias stays each rank's
    try:
        return train_worker(cfg, here(), Saves(), ray_dp.LoopOptions(), {})["stopped"]
    finally:
        ray_dp.allreduce = allreduce


def test_the_scratch_lesson_with_one_layers_all_reduce_skipped_is_caught_at_the_first_check():
    cfg = ray_dp.Config(mode="scratch", dataset="synthetic", synthetic_size=64, batch_size=16, epochs=2, lr=0.2,
                        lr_schedule="constant", momentum=0.0, checkpoint_every="0", workers=2, quiet=True)
    stopped = run_distributed(scratch_without_one_layer, 2, cfg)[0]
    assert stopped["error"].startswith("the replicas differ after step 1 of epoch 1 (the run's step 1): rank 0 and "
                                       "rank 1 differ, and no majority of the 2 ranks tells which drifted, first in "
                                       "classifier.2.bias")


def test_a_checkpoint_altered_since_it_was_saved_is_refused_in_one_line_before_any_cluster(tmp_path, no_cluster,
                                                                                           capsys):
    run = save_run(tmp_path / "runs" / "r", saved=(1,))
    path = run / ray_dp.checkpoint_dir_name(1) / ray_dp.CHECKPOINT_FILE
    state = torch.load(path, weights_only=True)
    state["optimizer"] = {"state": {0: {"momentum_buffer": torch.ones(3)}}, "param_groups": []}
    torch.save(state, path)
    assert ray_dp.main(["--dataset", "digits", "--storage-path", str(tmp_path / "runs"), "--name", "r"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"ray_dp.py: error: run 'r' cannot resume: its checkpoint {path} holds another optimizer than it certifies "
        f"(it was altered since it was saved)")
    state["optimizer"], state["model"]["classifier.2.bias"][0] = {}, 7.0
    torch.save(state, path)
    assert ray_dp.main(["--eval-only", str(run), "--dataset", "digits"]) == 2
    assert "its weights are not those its certificate says" in capsys.readouterr().err


def test_an_unaltered_checkpoint_matches_its_certificate():
    model = ray_dp.build_model("lenet", (1, 28, 28))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.rand(2, 1, 28, 28)).sum().backward()
    optimizer.step()
    state = ray_dp.checkpoint_state(model.state_dict(), optimizer.state_dict(), 1, ray_dp.Config(), [], [],
                                    {"step": 3, "steps": 9, "samples": 12})
    buffer = io.BytesIO()
    torch.save(state, buffer)
    assert ray_dp.uncertified(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)) == []
    assert set(state["certificate"]) == {"model", "optimizer", "history", "data position"}


SQUARE = """
import torch.nn as nn
class Square(nn.Module):
    '''A square weight between two others.'''
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.Linear(16, 16), nn.Linear(16, 10))
    def forward(self, x):
        return self.net(x)
"""


def moved(state, change):
    """The checkpoint's state with values moved within one tensor, as a conversion bug moves them; the part moved."""
    model, momentum = state["model"], state["optimizer"]["state"][0]["momentum_buffer"]
    if change == "transposed square weight":
        model["net.2.weight"] = model["net.2.weight"].T.contiguous()
    if change == "swapped output rows":
        model["net.3.weight"] = model["net.3.weight"][[1, 0, *range(2, 10)]]
    if change == "reversed bias":
        model["net.3.bias"] = model["net.3.bias"].flip(0)
    if change == "swapped momentum elements":
        momentum[0, :2] = momentum[0, :2].flip(0).clone()
    return "optimizer" if "momentum" in change else "model"


@pytest.mark.parametrize("change", ["transposed square weight", "swapped output rows", "reversed bias",
                                    "swapped momentum elements"])
def test_a_checkpoint_whose_values_moved_within_a_tensor_is_refused_in_one_line_before_any_cluster(
        change, tmp_path, no_cluster, capsys):
    (tmp_path / "square.py").write_text(SQUARE)
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(model=f"{tmp_path}/square.py:Square", dataset="digits",
                                                   storage_path=str(tmp_path / "runs"), name="r"))
    torch.manual_seed(0)
    net = ray_dp.build_model(cfg.model, (1, 28, 28))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    net(torch.rand(4, 1, 28, 28)).sum().backward()
    optimizer.step()
    path = tmp_path / "runs" / "r" / ray_dp.checkpoint_dir_name(1) / ray_dp.CHECKPOINT_FILE
    path.parent.mkdir(parents=True)
    state = ray_dp.checkpoint_state(net.state_dict(), optimizer.state_dict(), 1, cfg, [], [str(c) for c in range(10)])
    part = moved(state, change)
    torch.save(state, path)
    err = error_of(["--model", cfg.model, "--dataset", "digits", "--storage-path", str(tmp_path / "runs"), "--name",
                    "r"], capsys)
    assert err.startswith(f"ray_dp.py: error: run 'r' cannot resume: its checkpoint {path} holds another {part} than "
                          f"it certifies (it was altered since it was saved)")


def test_the_certificate_covers_the_history_and_a_mid_epoch_saves_loss_sums():
    model = ray_dp.build_model("lenet", (1, 28, 28))
    history = [{"epoch": 1, "train_loss": 0.5, "test_loss": 0.25}]
    partial = {"epoch": 1, "step": 3, "steps": 9, "samples": 192, "loss_sum": 123.5, "step_log": [[10, 0.75]],
               "pending": [12.5, 64]}
    state = ray_dp.checkpoint_state(model.state_dict(), {}, 1, ray_dp.Config(), history, [], partial)
    assert ray_dp.uncertified(state) == []
    for part, change in (("history", lambda s: s["history"][0].update(test_loss=0.125)),
                         ("data position", lambda s: s["partial"].update(loss_sum=124.5)),
                         ("data position", lambda s: s["partial"]["step_log"][0].__setitem__(1, 0.5)),
                         ("data position", lambda s: s["partial"].update(pending=[12.5, 32]))):
        altered = copy.deepcopy(state)
        change(altered)
        assert ray_dp.uncertified(altered) == [part]


def test_a_checkpoint_without_its_certificate_resumes_with_a_note_that_nothing_was_checked(capsys):
    cfg = ray_dp.Config(epochs=3, quiet=True)
    model = ray_dp.build_model("lenet", (1, 28, 28))

    def checkpoint_of(epoch, history, partial=None):
        return ray_dp.checkpoint_state(model.state_dict(), {}, epoch, cfg, history, [], partial)
    for kept, said in ((True, ": the same model, optimizer, history and data position as saved"),
                       (False, "; it carries no certificate: what was restored is not checked")):
        state = checkpoint_of(1, [{"epoch": 1}])
        if not kept:
            del state["certificate"]
        ops = ray_dp.Operations(cfg, here())
        ops.track(model, None, checkpoint_of, state)
        assert capsys.readouterr().out == (f"ray-dp: resuming at epoch 2 of 3 with 1 worker, from the checkpoint of "
                                           f"epoch 1{said}\n")
        assert ops.resume_record == {"from": "epoch 1", "certified": kept}


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool, torch.int16,
                                   torch.float16, torch.float8_e4m3fn, torch.complex64])
def test_every_dtype_hashes_and_two_elements_swapped_are_seen(dtype):
    values, swapped = torch.tensor([0, 1, 0, 1, 1]).to(dtype), torch.tensor([0, 1, 1, 0, 1]).to(dtype)
    hashes = ray_dp.tensor_hashes([("a", values), ("b", swapped)], CPU)
    assert not torch.equal(hashes[0], hashes[1])
    dense = torch.eye(3)  # a sparse tensor hashes as its dense values
    assert torch.equal(*ray_dp.tensor_hashes([("a", dense), ("b", dense.to_sparse())], CPU))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # deprecated, and still in models users load
def test_a_64_bit_tensors_two_sign_flips_and_a_quantized_tensor_are_seen():
    # an int64 weight of its high bit would vanish at an even position: each element is weighed as two 32-bit words
    weight = torch.tensor([[0.5, 0.25, -0.125], [1.5, 2.5, 3.5]], dtype=torch.float64)
    flipped = weight.clone()
    flipped[0, 0], flipped[0, 2] = -flipped[0, 0], -flipped[0, 2]
    codes = torch.tensor([0, 5, -2 ** 63])
    quantized = torch.quantize_per_tensor(torch.tensor([0.1, 0.2, 0.3]), 0.1, 0, torch.qint8)
    rescaled = torch.quantize_per_tensor(torch.tensor([0.2, 0.4, 0.6]), 0.2, 0, torch.qint8)  # its integers alike
    hashes = ray_dp.tensor_hashes([("w", weight), ("f", flipped), ("c", codes), ("r", codes.flip(0)),
                                   ("q", quantized), ("s", quantized.flip(0)), ("t", rescaled)], CPU)
    assert not torch.equal(hashes[0], hashes[1]) and not torch.equal(hashes[2], hashes[3])
    assert not torch.equal(hashes[4], hashes[5]) and not torch.equal(hashes[4], hashes[6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64])
def test_a_tensor_negated_whole_or_a_permutation_transposed_is_seen_whatever_its_positions(dtype):
    # a weight linear in the position misses both: [0.1, -0.2, -0.3, 0.4]'s positive and negative values' positions
    # sum alike, and a permutation matrix's ones sit at positions that sum alike transposed
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.tensor([1, -2, -3, 4]).to(dtype), torch.eye(4)[[1, 2, 3, 0]].to(dtype),
               *(torch.randn(4, generator=gen).mul(100).to(dtype) for _ in range(200))]
    for tensor in tensors:
        changed = -tensor if tensor.ndim == 1 else tensor.T.contiguous()
        hashes = ray_dp.tensor_hashes([("a", tensor), ("b", changed)], CPU)
        assert not torch.equal(hashes[0], hashes[1]), tensor


ODD_BUFFERS = """
import torch, torch.nn as nn
class OddBuffers(nn.Module):
    '''A uint32 lookup table and a sparse mask beside the layer, as quantized or pruned models keep them.'''
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(784, 10)
        self.register_buffer("codes", torch.arange(5).to(torch.uint32))
        self.register_buffer("mask", torch.eye(4).to_sparse())
    def forward(self, x):
        return self.layer(x.flatten(1))
"""


def test_a_model_with_unsigned_and_sparse_buffers_trains_and_saves_certified_checkpoints(tmp_path):
    # one worker: DDP itself broadcasts no sparse buffer, nor a uint32 one over gloo
    (tmp_path / "odd.py").write_text(ODD_BUFFERS)
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(
        model=f"{tmp_path}/odd.py:OddBuffers", dataset="synthetic", synthetic_size=64, batch_size=16, epochs=2,
        workers=1, checkpoint_every="2", quiet=True, name="odd", storage_path=str(tmp_path)))
    saves = Saves()
    assert train_worker(cfg, here(), saves, ray_dp.LoopOptions(), {})["stopped"] is None
    assert [where for where, _ in saves.checkpoints] == [(1, 2), (1, 0), (2, 2), (2, 0)]
    assert [ray_dp.uncertified(state) for _, state in saves.checkpoints] == [[]] * 4


def test_the_ledgers_events_file_sorts_after_rank_0s_last_one_written_in_the_same_second(tmp_path):
    """TensorBoard reads a run's events files in name order and never goes back: a file that sorts before the
    one it reads last (the same second, a lower pid) is never shown."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = ray_dp.Config(logdir=str(tmp_path), name="run")
    (tmp_path / "run").mkdir()
    ranks = tmp_path / "run" / f"events.out.tfevents.{int(time.time()) + 1:010d}.{socket.gethostname()}.9999.0"
    ranks.write_bytes(b"")
    ray_dp.write_ledger_events(cfg, {**{what: 1.0 for what in ray_dp.LEDGER}, "goodput": 0.5}, 2)
    last = sorted((tmp_path / "run").iterdir())[-1]
    assert last != ranks
    events = EventAccumulator(str(last))
    events.Reload()
    assert "ledger/goodput" in events.Tags()["scalars"]


def test_the_ledger_sums_to_the_wall_clock_and_charges_a_failure_its_lost_steps_and_restart():
    clock = {"started": 100.0, "imported": 102.0, "checked": 104.0, "fitted": 190.0}
    failed = {"seconds": {"data": 1.0, "model": 2.0, "training steps": 30.0, "saves": 1.0, "evaluation": 2.0},
              "began": 110.0, "at": 150.0, "since_save": 8.0, "saves": 2}
    final = {"seconds": {"data": 1.0, "model": 2.0, "restores": 0.5, "training steps": 20.0, "saves": 1.0,
                         "evaluation": 2.0, "waits for data": 0.5}, "began": 160.0, "at": 185.0, "ended": 186.0,
             "since_save": 0.0, "saves": 2}
    ledger = ray_dp.run_ledger(clock, [failed, final], 1, 195.0)
    assert ledger["wall"] == 95.0 and sum(ledger[what] for what in ray_dp.LEDGER) == pytest.approx(95.0)
    assert ledger["driver"] == 4.0 + 5.0 and ledger["cluster"] == 6.0 + 4.0
    # the 8 s since its last save, 2 s from its last word to its death, 8 s to the next worker group, 3.5 s of its set-up
    assert ledger["failures"] == 8.0 + 2.0 + 8.0 + 3.5
    assert ledger["training steps"] == 30.0 - 8.0 + 20.0 and ledger["goodput"] == round(42.0 / 95.0, 4)
    assert (ledger["failed"], ledger["saved"]) == (1, 4)
    again = ray_dp.run_ledger(clock, [final], 0, 195.0, before=ledger)  # a rerun of the same --name adds up
    assert again["wall"] == 190.0 and again["failed"] == 1 and again["training steps"] == 62.0
    assert (ledger["commands"], again["commands"], again["this_command"]) == (1, 2, 95.0)
    assert ray_dp.format_ledger(ledger).startswith("time: 95.0 s, 42.0 s of it training steps")
    assert ray_dp.format_ledger(again).startswith("time (the run over its 2 commands; this one 95.0 s): 190.0 s, ")


def test_a_command_stopped_by_ctrl_c_counts_its_time_in_the_runs_ledger(tmp_path, no_cluster, monkeypatch, capsys):
    def interrupted(cfg, **options):  # Ctrl-C once the run was checked (Ray starting, or training)
        ray_dp.CLOCK["checked"] = time.time()
        time.sleep(0.2)
        raise KeyboardInterrupt
    monkeypatch.setattr(ray_dp, "run", interrupted)
    argv = ["--dataset", "digits", "--storage-path", str(tmp_path), "--name", "r"]
    assert ray_dp.main(argv) == 130 and ray_dp.main(argv) == 130
    assert capsys.readouterr().err.count("ray_dp.py: interrupted; nothing was saved") == 2
    ledger = json.loads((tmp_path / "r" / "ledger.json").read_text())
    assert ledger["commands"] == 2 and ledger["wall"] >= 0.4 and ledger["other"] >= 0.4


def test_checkpoint_advice_is_young_and_dalys_interval_when_the_run_saves_far_more_or_less_often():
    # 10 saves of 0.5 s, a failure every 30 min: every sqrt(2 x 0.5 x 1800) = 42 s loses the least
    summary = {"ledger": {"failed": 2, "saved": 10, "saves": 5.0, "wall": 3600.0}, "sec_per_epoch": 600.0,
               "final": {"train_samples": 1000}}
    advice = ray_dp.checkpoint_advice(ray_dp.Config(), summary)  # a save at each epoch's end: every 10 min
    assert advice == ("saves cost 0.5 s and a failure came every 30 min: checkpoints every 42 s would lose the "
                      "least (Young/Daly), not every 10 min: --checkpoint-every 1")  # a step: 600 s x 64 / 1000
    assert ray_dp.checkpoint_advice(ray_dp.Config(checkpoint_every="1m"), summary) is None  # within 2x of it
    # in steps: 1000 samples an epoch of 600 s, a save every 5 steps of 64: every 192 s, over 4 times too seldom
    assert "not every 3.2 min: --checkpoint-every 1" in ray_dp.checkpoint_advice(ray_dp.Config(checkpoint_every="5", batch_size=64),
                                                            summary)
    assert ray_dp.checkpoint_advice(ray_dp.Config(), {**summary, "ledger": {**summary["ledger"], "failed": 0}}) is None
    # saves of 0.05 s, a failure every 31 s: every 1.8 s, 18 steps of 0.096 s (not rounded to a tenth of a minute)
    quick = {"ledger": {"failed": 1, "saved": 10, "saves": 0.5, "wall": 31.0}, "sec_per_epoch": 12.0,
             "final": {"train_samples": 1000}}
    assert ray_dp.checkpoint_advice(ray_dp.Config(checkpoint_every="1", batch_size=8), quick) == (
        "saves cost 0.05 s and a failure came every 31 s: checkpoints every 1.8 s would lose the least (Young/Daly), "
        "not every 0.096 s: --checkpoint-every 18")
    # saves of a minute, a failure every 3.5 days: every 107.6 min, in minutes that --checkpoint-every reads
    slow = {"ledger": {"failed": 1, "saved": 10, "saves": 600.0, "wall": 302400.0}, "sec_per_epoch": 36000.0,
            "final": {"train_samples": 1000}}
    advice = ray_dp.checkpoint_advice(ray_dp.Config(checkpoint_every="10m"), slow)
    assert advice.endswith("every 5040 min: checkpoints every 100.4 min would lose the least (Young/Daly), not every "
                           "10 min: --checkpoint-every 100.4m") and ray_dp.checkpoint_interval("100.4m")


def slowed_rank_1(cfg):
    if dist.get_rank() == 1:  # its forward passes 20 ms longer
        forward = ray_dp.LeNet.forward

        def slower(module, x):
            time.sleep(0.02)
            return forward(module, x)
        ray_dp.LeNet.forward = slower
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        train_worker(cfg, here(), Saves(), ray_dp.LoopOptions(), {})
    return printed.getvalue()


def test_a_straggler_is_named_at_the_documented_1_5_times_the_other_ranks_median_on_2_ranks_as_on_4():
    assert ray_dp.straggler_note([[1.0, 1.6]] * 5, 2).startswith(
        "rank 1 is a straggler: its forward passes take 1.6 s a step, the other ranks' median 1 s")
    assert ray_dp.straggler_note([[1.0, 1.6]] * 4 + [[1.0, 1.4]], 2) is None  # at each agreement of the window
    assert ray_dp.straggler_note([[1.0, 1.0, 1.6, 1.0]] * 5, 4).startswith("rank 2 is a straggler")
    assert ray_dp.straggler_note([[0.0, 0.0]] * 5, 2) is None


def test_a_rank_whose_forward_passes_are_slower_than_the_others_is_named_once():
    cfg = ray_dp.Config(dataset="synthetic", synthetic_size=96, batch_size=8, epochs=1, workers=2, log_every=1,
                        checkpoint_every="0", check_replicas="off", quiet=True)
    printed = run_distributed(slowed_rank_1, 2, cfg)[0]
    assert printed.count("ray-dp: note: rank 1 is a straggler: its forward passes take") == 1


def dumped(tmp_path):
    os.environ["TORCH_FR_BUFFER_SIZE"] = "100"  # before a process group, as worker_env sets it for Ray's workers
    group = dist.new_group()
    dist.all_reduce(torch.ones(1), group=group)
    cfg = ray_dp.Config(storage_path=str(tmp_path), name="w", timeout=1800)
    watchdog = ray_dp.Watchdog(cfg, here())
    watchdog.progress("after step 7 of epoch 2")
    watchdog.dump("asked (SIGUSR1)")
    dist.barrier()


def test_a_ranks_watchdog_gives_sigusr1_back_as_it_ends():
    import signal
    before = signal.getsignal(signal.SIGUSR1)
    with ray_dp.Watchdog(ray_dp.Config(), here()):  # torchrun's rank: its main thread takes SIGUSR1 while it trains
        assert signal.getsignal(signal.SIGUSR1) is not before
    assert signal.getsignal(signal.SIGUSR1) is before


def test_sigusr1_to_the_driver_asks_every_rank_for_its_stacks_and_says_where_they_go(capsys):
    import signal
    asked = []
    board = type("Board", (), {"ask_dump": type("Method", (), {"remote": lambda self: asked.append(1)})()})()
    cfg, before = ray_dp.Config(storage_path="/runs", name="r"), signal.getsignal(signal.SIGUSR1)
    with ray_dp.dumps_asked(ray_dp.with_absolute_paths(cfg), board):
        os.kill(os.getpid(), signal.SIGUSR1)
    assert asked == [1] and capsys.readouterr().out == (
        "ray-dp: SIGUSR1: each rank writes its stacks to /runs/r/hang/rank<N>.txt (and torch's flight recorder to "
        "rank<N>.json)\n")
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_watchdog_writes_its_ranks_stacks_and_flight_recorder_and_a_timeouts_report_names_the_rank_behind(tmp_path):
    run_distributed(dumped, 2, tmp_path)
    text = (tmp_path / "w" / "hang" / "rank1.txt").read_text()
    assert text.startswith("rank 1 of 2 on ") and "asked (SIGUSR1); its last progress: after step 7 of epoch 2" in text
    assert "in dumped" in text  # its Python stack
    records = {rank: json.loads((tmp_path / "w" / "hang" / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    assert [status["last_enqueued_collective"] for status in records[0]["pg_status"].values()] == ["1"]
    for rank, count in ((0, 5), (1, 4)):  # as a hang leaves them: rank 1 never came to the 5th of the default group
        records[rank]["pg_status"] = {"0": {"last_enqueued_collective": str(count)}}
        (tmp_path / "w" / "hang" / f"rank{rank}.json").write_text(json.dumps(records[rank]))
    cfg = ray_dp.Config(storage_path=str(tmp_path), name="w", workers=2, timeout=20)
    timed_out = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation")
    # records a SIGUSR1 asked for, before a later failure: not a hang's, whatever that failure
    assert ray_dp.hang_report(cfg, timed_out) is None
    for rank in (0, 1):  # as the watchdogs write them once their rank has made no progress for --timeout / 2
        stacks = tmp_path / "w" / "hang" / f"rank{rank}.txt"
        stacks.write_text(stacks.read_text().replace("asked (SIGUSR1)", "no progress for 10 s (--timeout / 2)"))
    assert ray_dp.hang_report(cfg, RuntimeError("CUDA out of memory")) is None  # another failure than the hang's
    assert ray_dp.hang_report(cfg, timed_out) == (
        f"rank 1 did not come to collective 5, which the other ranks waited in for --timeout 20 s: its stacks are in "
        f"{tmp_path}/w/hang/rank1.txt (every rank's beside it, and torch's flight recorder in rank<N>.json)")


def evaluated(cfg, nudged_rank):
    """--eval-only's worker loop on this rank, the checkpoint's weights as Ray's object store gives them (one
    element changed on `nudged_rank`, as a rank that loaded them wrong): the test metrics, or the refusal."""
    torch.manual_seed(0)
    weights = ray_dp.build_model("lenet", (1, 28, 28), 10).state_dict()
    if dist.get_rank() == nudged_rank:
        weights["classifier.0.bias"][3] += 1e-6
    get, ray_dp.ray.get = ray_dp.ray.get, lambda ref, **_: ref  # the refs are the objects here
    try:
        options = ray_dp.LoopOptions(weights=weights, classes=tuple(map(str, range(10))))
        return ray_dp.eval_loop_per_worker({"config": cfg, "options": options, "worker": here(), "launcher": None})
    except ray_dp.RunFailed as exc:
        return str(exc)
    finally:
        ray_dp.ray.get = get


def test_eval_only_scores_only_replicas_that_agree():
    cfg = ray_dp.Config(dataset="digits", eval_only="run", workers=2, quiet=True)
    assert [out["metrics"]["test_count"] for out in run_distributed(evaluated, 2, cfg, None)] == [360, 360]
    assert run_distributed(evaluated, 2, cfg, 1) == [
        "the replicas differ before scoring: rank 0 and rank 1 differ, and no majority of the 2 ranks tells which "
        "drifted, first in classifier.0.bias; nothing is scored"] * 2


def counted_checks(cfg):
    return train_worker(cfg, here(), Saves(), ray_dp.LoopOptions(), {})["replica_checks"]


def test_a_run_counts_its_replica_checks_and_its_last_line_says_they_all_agreed():
    cfg = ray_dp.Config(dataset="synthetic", synthetic_size=64, batch_size=16, epochs=2, workers=2, check_replicas="1",
                        checkpoint_every="0", quiet=True)
    assert run_distributed(counted_checks, 2, cfg) == [10, 10]  # after each of an epoch's 4 steps, and at its end
    summary = {"final": {"test_acc": 0.5}, "sec_per_epoch": 1.0, "world_size": 2, "device": "cpu", "replica_checks": 10}
    assert ray_dp.format_summary(summary) == ("test acc: 0.50, 1.0 sec/epoch on 2 workers (cpu), replicas alike at all "
                                              "10 checks")


def test_under_torchrun_a_lost_peer_is_one_line_and_ray_dps_own_errors_stay_as_they_are(monkeypatch, tmp_path):
    monkeypatch.setattr(ray_dp, "under_torchrun", lambda: True)
    monkeypatch.setenv("RANK", "1")
    cfg = ray_dp.Config(storage_path=str(tmp_path), name="r")
    with pytest.raises(ray_dp.RunFailed, match="^rank 1 lost its peers: another rank failed, and its own line says"):
        with ray_dp.failures_said(cfg, ray_dp.LoopOptions(torchrun=True)):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:2255")
    with pytest.raises(ray_dp.DataError, match="timed out"):  # its own line and exit status, not a rank's
        with ray_dp.failures_said(cfg, ray_dp.LoopOptions(torchrun=True)):
            raise ray_dp.DataError("reading s3://bucket/images/1.png timed out")


NAN_AT = """
import torch, torch.nn as nn
class Poison(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")

class NaNAt(nn.Module):
    '''A user's model whose rank 1 gives NaN outputs in its 22nd training forward pass (step 10 of epoch 2), unless
    fixed.'''
    fixed, at = False, 22

    def __init__(self):
        super().__init__()
        self.layer, self.calls = nn.Linear(784, 10), 0

    def forward(self, x):
        self.calls += self.training
        out = self.layer(x.flatten(1))
        broken = self.calls == self.at and not self.fixed and torch.distributed.get_rank() == 1
        return self.broken(out) if broken else out

    def broken(self, out):
        return out * float("nan")

class GradNaNAt(NaNAt):
    '''NaN gradients (a finite loss) in its 20th training pass (step 8 of epoch 2): DDP's all-reduce makes every
    rank's weights NaN.'''
    at = 20

    def broken(self, out):
        return Poison.apply(out)
"""


def nan_then_fixed(cfg):
    saves = Saves()
    stopped = train_worker(cfg, here(), saves, ray_dp.LoopOptions(), {})["stopped"]
    ray_dp.user_code(cfg.model, "model").fixed = True  # the model fixed, the same command again
    last = ray_dp.from_rank_0(saves.checkpoints[-1] if saves.checkpoints else None, CPU)
    again = Saves(last[1])
    out = train_worker(cfg, here(), again, ray_dp.LoopOptions(), {})
    return stopped, [where for where, _ in saves.checkpoints], out["resumed"], out["stopped"], len(out["history"])


def test_a_loss_that_turns_nan_stops_every_rank_naming_where_and_the_fixed_model_resumes_from_before_it(tmp_path):
    (tmp_path / "nan.py").write_text(NAN_AT)
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(
        model=f"{tmp_path}/nan.py:NaNAt", dataset="synthetic", synthetic_size=96, batch_size=8, epochs=3, workers=2,
        checkpoint_every="4", quiet=True, name="nan", storage_path=str(tmp_path)))  # 12 steps an epoch
    (stopped, saved, resumed, again, epochs), other = run_distributed(nan_then_fixed, 2, cfg)
    assert stopped == other[0] == {"by": ["loss"], "error": (
        "the loss is not finite from step 10 of epoch 2 (the run's step 22) on rank 1: nothing is saved from it, and "
        "the same command resumes from the last checkpoint")}
    assert saved == [(1, 4), (1, 8), (1, 0), (2, 4), (2, 8)]  # none from step 10 of epoch 2 on
    assert resumed["from"] == "epoch 2, step 8" and resumed["certified"] and again is None and epochs == 3


def test_weights_made_nan_by_a_gradient_under_a_finite_loss_are_not_saved_and_the_fixed_model_resumes(tmp_path):
    (tmp_path / "grad_nan.py").write_text(NAN_AT)
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(
        model=f"{tmp_path}/grad_nan.py:GradNaNAt", dataset="synthetic", synthetic_size=96, batch_size=8, epochs=3,
        workers=2, checkpoint_every="4", quiet=True, name="grad-nan", storage_path=str(tmp_path)))  # 12 steps an epoch
    (stopped, saved, resumed, again, epochs), other = run_distributed(nan_then_fixed, 2, cfg)
    assert stopped == other[0] == {"by": ["loss"], "error": (
        "the weights are not finite at the save after step 8 of epoch 2 on rank 0, first layer.weight: nothing is "
        "saved from them, and the same command resumes from the last checkpoint")}
    assert saved == [(1, 4), (1, 8), (1, 0), (2, 4)]  # the save that found them wrote nothing
    assert resumed["from"] == "epoch 2, step 4" and resumed["certified"] and again is None and epochs == 3


def weights_check(_):
    rank = torch.distributed.get_rank()
    model = torch.nn.Linear(3, 2)
    if rank == 1:  # this rank's own weights, not through a gradient that every rank shares
        model.bias.data[1] = float("nan")
    check = ray_dp.NonFiniteLoss(ray_dp.Config(), here(), model, None)
    return check.at_save("save", "at the save after step 3 of epoch 1")


def test_weights_not_finite_on_one_rank_are_named_alike_on_every_rank():
    said = run_distributed(weights_check, 2, None)
    assert said == ["the weights are not finite at the save after step 3 of epoch 1 on rank 1, first bias: nothing is "
                    "saved from them, and the same command resumes from the last checkpoint"] * 2
