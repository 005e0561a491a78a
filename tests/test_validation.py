"""A validation split (#61): --val-split holds out part of the training set (seeded, stratified, the same on every rank,
worker count and rerun), scored exactly every epoch; --best-by and --early-stop go by it and the test set stays whole.
(That N workers score it as one process does: test_differential's val-split combinations; a resume from any step with
one: test_spot's.)"""
import collections
import json
import os

import pytest
import torch

import ray_dp
from helpers import REPO, error_of, here, run_distributed, train_worker
from test_spot import Saves
from test_trust import tiny_folder

OWN = os.path.join(REPO, "tests", "user_code.py")


def split_of(**settings):
    cfg = ray_dp.Config(**{"dataset": "digits", "val_split": 0.2, **settings})
    return ray_dp.held_out(cfg, ray_dp.load_dataset(cfg))


def test_the_split_is_seeded_stratified_disjoint_and_leaves_the_test_set_whole():
    train, test = ray_dp.load_digits()
    kept, same_test, val = split_of()
    assert same_test is not None and torch.equal(same_test.tensors[1], test.tensors[1])  # the test set untouched
    assert len(kept) + len(val) == len(train) == 1437 and len(val) == 288  # a fifth, rounded up
    rows = {tuple(row.flatten().tolist()) for row in torch.cat([kept.tensors[0], val.tensors[0]])}
    assert len(rows) == len(train)  # each training sample in one part, once
    labels, held = collections.Counter(train.tensors[1].tolist()), collections.Counter(val.tensors[1].tolist())
    for label, count in labels.items():  # each class in proportion: within one sample of a fifth of it
        assert abs(held[label] - 0.2 * count) <= 1, (label, held[label], count)
    assert kept.classes == val.classes == train.classes
    again, other = split_of()[2], split_of(seed=1)[2]
    assert torch.equal(again.tensors[0], val.tensors[0]) and not torch.equal(other.tensors[0], val.tensors[0])


def test_the_split_is_the_same_on_every_rank_at_any_worker_count_of_a_rerun():
    # what a worker holds (worker_data under torchrun: each rank splits its own copy) on 2 ranks and on 3
    cfg = ray_dp.Config(dataset="digits", val_split=0.1, workers=2)
    on_two = run_distributed(held_labels, 2, cfg)
    on_three = run_distributed(held_labels, 3, ray_dp.replace(cfg, workers=3))
    assert on_two[0] == on_two[1] == on_three[0] == on_three[2] == held_labels(cfg)


def held_labels(cfg):
    _, _, val = ray_dp.worker_data(cfg, ray_dp.LoopOptions(torchrun=True), here())
    return val.tensors[1].tolist(), val.tensors[0].sum().item()


def test_an_image_folders_held_out_part_is_read_as_the_test_set_is_without_augmentation(tmp_path):
    folder = tiny_folder(tmp_path / "images", classes=("a", "b", "c"), per_class=10, size=12)
    cfg = ray_dp.Config(dataset="folder", data_dir=str(folder), val_split=0.3, batch_size=6, workers=2)
    cfg, info = ray_dp.check_data(cfg)
    train, test, val = info.datasets
    assert info.sizes == (21, 30, 9) and info.classes == ["a", "b", "c"]
    assert [label for _, label in (val[i] for i in range(len(val)))] == [0] * 3 + [1] * 3 + [2] * 3
    assert val.transform is not train.transform and repr(val.transform) == repr(test.transform)
    assert "RandomResizedCrop" in repr(train.transform) and "RandomResizedCrop" not in repr(val.transform)
    assert torch.equal(val[0][0], val[0][0])  # no random crop: the same image every time it is read
    assert train.class_to_idx == {"a": 0, "b": 1, "c": 2} and len(train.samples) == 30  # every node holds all 30
    assert "(21 train + 9 val / 30 test, 3 classes" in ray_dp.describe(cfg, info)


class Unlisted(torch.utils.data.Dataset):
    """Read per sample, with class names but no list of targets (which only decoding every sample would give)."""
    classes = ["even", "odd"]

    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.full((3,), float(i)), i % 2


class Fetched(Unlisted):
    """Fetches a batch's samples at once, as a folder in a bucket does (StoredImageFolder.prefetch)."""
    asked = []

    def prefetch(self, indices):
        self.asked.append(indices)


def test_a_held_out_part_of_a_bucket_folder_fetches_the_samples_its_indices_mean():
    kept, _, val = ray_dp.held_out(ray_dp.Config(val_split=0.25), (Fetched(), None))
    streams = ray_dp.SampleStreams(val, seed=0)  # as the training loop reads a per-sample set
    batch = streams.__getitems__([(0, 0), (0, 1)])
    assert Fetched.asked == [[val.indices[0], val.indices[1]]] and len(batch) == 2


def test_your_data_set_read_per_sample_without_its_targets_is_split_at_random_keeping_its_attributes():
    kept, _, val = ray_dp.held_out(ray_dp.Config(val_split=0.25), (Unlisted(), None))
    assert (len(kept), len(val)) == (30, 10) and kept.classes == val.classes == ["even", "odd"]
    rows = [int(part[i][0][0]) for part in (kept, val) for i in range(len(part))]
    assert sorted(rows) == list(range(40))
    assert ray_dp.class_names(val) == ["even", "odd"] and ray_dp.classifies(val)


@pytest.mark.parametrize("argv, message", [
    (["--best-by", "val_acc"], "--best-by val_acc needs --val-split (the part of the training set it scores)"),
    (["--val-split", "1"], "--val-split must be in [0, 1), got 1.0"),
    (["--val-split", "0.5", "--batch-size", "1024"], "--batch-size 1024 is larger than the 718 training samples"),
    (["--early-stop", "-1"], "--early-stop must be at least 0, got -1"),
    (["--eval-only", "{tmp}", "--val-split", "0.1"], "--val-split is a training flag and has no effect with "
                                                     "--eval-only"),
])
def test_a_split_that_cannot_be_is_one_line_before_any_cluster(argv, message, tmp_path, no_cluster, capsys):
    if "{tmp}" in argv:
        from helpers import save_run
        save_run(tmp_path / "run")
    argv = [a.format(tmp=tmp_path / "run") for a in argv]
    err = error_of(["--dataset", "digits", "--storage-path", str(tmp_path / "runs"), *argv], capsys)
    assert message in err, err


def test_val_split_chooses_the_best_by_the_held_out_set_unless_told_otherwise():
    assert ray_dp.parse_command(["--val-split", "0.1"])[1].best_by == "val_loss"
    assert ray_dp.parse_command(["--val-split", "0.1", "--best-by", "test_acc"])[1].best_by == "test_acc"
    assert ray_dp.parse_command([])[1].best_by == "test_loss"


def test_early_stop_is_patience_epochs_without_a_better_value():
    history = [{"epoch": e + 1, "val_loss": loss} for e, loss in enumerate([0.5, 0.4, 0.45, 0.41, 0.4])]
    cfg = ray_dp.Config(val_split=0.1, best_by="val_loss", early_stop=3)
    assert ray_dp.early_stop(history[:4], cfg) is None
    assert ray_dp.early_stop(history, cfg) == {"epoch": 5, "best_epoch": 2, "metric": "val_loss", "value": 0.4}
    assert ray_dp.early_stop(history, ray_dp.replace(cfg, early_stop=0)) is None
    assert ray_dp.early_stop(history, ray_dp.replace(cfg, early_stop=4)) is None


def trained_with_val(cfg):
    saves = Saves()
    out = train_worker(cfg, here(), saves, ray_dp.LoopOptions(), {})
    return out["history"], out["early_stopped"], [metrics.get("best") for metrics in saves.epochs]


def test_every_rank_scores_the_held_out_set_exactly_and_stops_early_at_the_same_epoch(capsys):
    # random labels: the held-out loss soon stops improving; --early-stop 1 ends the run there, on both ranks
    cfg = ray_dp.Config(dataset="synthetic", synthetic_size=240, val_split=0.2, best_by="val_loss", early_stop=1,
                        epochs=12, batch_size=16, lr=0.2, workers=2, checkpoint_every="0", quiet=True)
    ranks = run_distributed(trained_with_val, 2, cfg)
    (history, early, best), other = ranks[0], ranks[1]
    assert early == other[1] and len(history) == len(other[0])  # rank 0's decision, on every rank
    assert [m["val_count"] for m in history] == [48] * len(history) and history[0]["test_count"] == 100
    assert history[0]["train_samples"] == 192 and all(0 <= m["val_acc"] <= 1 for m in history)
    best_epoch = min(history, key=lambda m: (m["val_loss"], m["epoch"]))["epoch"]
    assert early == {"epoch": len(history), "best_epoch": best_epoch, "metric": "val_loss",
                     "value": history[best_epoch - 1]["val_loss"]}
    assert len(history) < 12 and len(history) - best_epoch == 1
    assert best.index(True) + 1 == 1 and best[best_epoch - 1]  # the first epoch is best until bettered
    line = ray_dp.format_epoch(history[0], 12)
    assert ", val loss " in line and ", val acc " in line and line.index("val loss") < line.index("test loss")


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
def test_through_ray_the_best_is_chosen_on_the_held_out_set_and_a_rerun_of_an_early_stopped_run_trains_nothing(
        tmp_path, capsys):
    flags = ["--workers", "2", "--dataset", "digits", "--val-split", "0.1", "--early-stop", "1", "--epochs", "40",
             "--lr", "0.5", "--storage-path", str(tmp_path), "--name", "val", "--logdir", str(tmp_path / "tb")]
    assert ray_dp.main(flags) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "val" / "result.json").read_text())
    stopped = result["early_stopped"]
    assert stopped and stopped["epoch"] == len(result["epochs"]) < 40 and result["config"]["best_by"] == "val_loss"
    assert result["best"]["epoch"] == stopped["best_epoch"] and result["best"]["metric"] == "val_loss"
    assert (f"ray-dp: early stop after epoch {stopped['epoch']}: val_loss not better than epoch "
            f"{stopped['best_epoch']}'s") in out
    assert "(1293 train + 144 val / 360 test)" in out and result["final"]["val_count"] == 144
    rerun = [flag for flag in flags if flag not in ("--early-stop", "1")]  # left out: the run's own
    assert ray_dp.main(rerun) == 0  # nothing to train
    assert (f"run 'val' stopped early after epoch {stopped['epoch']} (--early-stop 1); nothing to train"
            in capsys.readouterr().out)


def test_a_rerun_keeps_its_early_stop_and_an_early_stopped_run_says_how_to_go_on(capsys):
    assert "early_stop" in ray_dp.RERUN_ADOPTS  # a rerun that leaves it out stops as the run did
    cfg = ray_dp.Config(epochs=8, early_stop=1, val_split=0.1, best_by="val_loss", name="v", quiet=True)
    assert ray_dp.finished_run(cfg, 2) == ("run 'v' stopped early after epoch 2 (--early-stop 1); nothing to train "
                                           "(a larger --early-stop, or 0, trains it further)")
    history = [{"epoch": 1, "val_loss": 0.5}, {"epoch": 2, "val_loss": 0.6}]
    model = ray_dp.build_model("lenet", (1, 28, 28))
    state = ray_dp.checkpoint_state(model.state_dict(), {}, 2, cfg, history, [])
    ops = ray_dp.Operations(cfg, here())  # as torchrun's ranks resume it, where no driver has said so
    ops.track(model, None, None, state)
    assert list(ops.epochs()) == [] and ops.early["epoch"] == 2
    assert "ray-dp: run 'v' stopped early after epoch 2 (--early-stop 1); nothing to train" in capsys.readouterr().out


def test_early_stop_by_the_test_set_says_so(tmp_path):
    cfg = ray_dp.Config(dataset="digits", early_stop=2, workers=2, storage_path=str(tmp_path), name="e")
    _, _, notes = ray_dp.preflight(cfg, ray_dp.Resume(), None, ())
    assert notes == ["--early-stop goes by --best-by test_loss, of the test set: --val-split holds out part of the "
                     "training set to stop by"]
    assert ray_dp.preflight(ray_dp.replace(cfg, val_split=0.1, best_by="val_loss"), ray_dp.Resume(), None, ())[2] == []
