"""End to end through Ray Train on one shared local cluster: the README quick start, checkpoints, resume."""
import json

import pytest
import torch

import ray_dp
from helpers import train

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("ray_cluster")]

# The README's quick start states this accuracy; measured 0.9722 (digits, 2 workers, defaults, seed 0).
QUICK_START_ACC = 0.95


def checkpoint_files(run_dir):
    return sorted(p for p in run_dir.glob("checkpoint_epoch_*/*"))


def test_readme_quick_start_learns_digits_and_checkpoints_each_epoch(tmp_path):
    result = train(tmp_path, "quick", "--workers", "2", "--dataset", "digits")
    epochs = result["epochs"]
    assert len(epochs) == result["config"]["epochs"] == 10
    assert all(m["test_count"] == 360 and m["train_samples"] == 1408 for m in epochs)  # 1437 // 64 steps x 64
    assert result["final"]["test_acc"] >= QUICK_START_ACC
    assert result["world_size"] == 2 and result["device"] == "cpu"

    # One checkpoint per epoch, one file each (rank 0's alone), loadable as plain data into a bare LeNet.
    files = checkpoint_files(tmp_path / "quick")
    assert [f.parent.name for f in files] == [f"checkpoint_epoch_{e:03d}" for e in range(10)]
    assert all(f.name == ray_dp.CHECKPOINT_FILE for f in files)
    state = ray_dp.load_checkpoint(files[-1])
    assert state["epoch"] == 9 and state["config"]["workers"] == 2
    assert not any(key.startswith("module.") for key in state["model"])
    model = ray_dp.build_model("lenet", (1, 28, 28))
    model.load_state_dict(state["model"])
    _, test = ray_dp.load_digits()
    # The saved weights are the trained ones: one process scores them exactly as the workers did.
    single = ray_dp.evaluate(model, test, torch.device("cpu"))
    assert (single["test_acc"], single["test_count"]) == (epochs[-1]["test_acc"], 360)
    assert single["test_loss"] == pytest.approx(epochs[-1]["test_loss"], rel=1e-6)  # float32 sums, other order
    assert result["checkpoint"].endswith("checkpoint_epoch_009/checkpoint.pt")

    # The same command with a larger --epochs extends the finished run: epochs 1-10 come from the
    # checkpoint unchanged (their timings too); only epoch 11 is trained.
    extended = train(tmp_path, "quick", "--workers", "2", "--dataset", "digits", "--epochs", "11")
    assert extended["epochs"][:10] == epochs and extended["started_at_epoch"] == 10
    assert [m["epoch"] for m in extended["epochs"]] == list(range(11))
    assert len(checkpoint_files(tmp_path / "quick")) == 11


def test_three_workers_with_accumulation_evaluate_every_test_sample_once(tmp_path):
    # synthetic: 100 test samples (a padding sampler would score 102 on 3 workers); 512 train samples,
    # global batch 48 = 8 per worker x 3 workers x 2 accumulation steps -> 10 steps, 480 samples.
    result = train(tmp_path, "three", "--workers", "3", "--dataset", "synthetic", "--model", "mlp",
                   "--batch-size", "48", "--accum-steps", "2", "--epochs", "2")
    assert result["world_size"] == 3
    assert [m["test_count"] for m in result["epochs"]] == [100, 100]
    assert [m["train_samples"] for m in result["epochs"]] == [480, 480]


def test_scratch_mode_with_its_defaults_learns_digits_on_2_workers(tmp_path):
    # No flag but the data set: the lesson's recipe (batch 32, plain SGD at a constant lr 0.2, 20 epochs)
    # leaves the init's plateau (README: measured 0.97).
    result = train(tmp_path, "scratch", "--mode", "scratch", "--workers", "2", "--dataset", "digits")
    assert result["final"]["test_acc"] >= 0.9 and result["final"]["test_count"] == 360
    assert len(result["epochs"]) == 20 and {m["lr"] for m in result["epochs"]} == {0.2}
    assert result["final"]["allreduce_bytes"] == 4 * 129_068  # every LeNet parameter, one flat buffer
    # Its checkpoint is a plain LeNet state_dict, scored the same by one process.
    state = ray_dp.load_checkpoint(checkpoint_files(tmp_path / "scratch")[-1])
    model = ray_dp.LeNet()
    model.load_state_dict(state["model"])
    assert ray_dp.evaluate(model, ray_dp.load_digits()[1], torch.device("cpu"))["test_acc"] == \
        result["final"]["test_acc"]


def test_compare_writes_the_lessons_table_csv_markdown_and_plot(tmp_path, capsys):
    import csv

    import matplotlib.image
    # One epoch: the rows' learning is the scratch test's and the README's; this checks the outputs.
    assert ray_dp.main(["compare", "--workers", "2", "--dataset", "digits", "--epochs", "1",
                        "--storage-path", str(tmp_path), "--name", "cmp"]) == 0
    out_dir = tmp_path / "cmp"
    with open(out_dir / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["ddp-1w", "ddp-2w", "scratch-naive-1w", "scratch-naive-2w",
                                        "scratch-ring-2w", "scratch-library-2w"]
    assert {(r["global_batch"], r["lr"]) for r in rows} == {("32", "0.2")}  # the same everywhere (no --scale-lr)
    assert [float(r["speedup"]) for r in rows if r["workers"] == "1"] == [1.0, 1.0]
    for r in rows:
        assert 0 <= float(r["test_acc"]) <= 1 and float(r["sec_per_epoch"]) > 0
        run = json.loads((out_dir / r["run"] / "result.json").read_text())
        assert float(r["test_acc"]) == round(run["final"]["test_acc"], 4)
        assert float(r["efficiency"]) == pytest.approx(float(r["speedup"]) / int(r["workers"]), abs=0.01)
        if r["mode"] == "scratch" and r["workers"] == "2":
            assert float(r["allreduce_ms_per_step"]) > 0 and float(r["busbw_GBps"]) > 0
    markdown = (out_dir / "compare.md").read_text()
    assert markdown.count("\n") == 2 + len(rows) and "| scratch-ring-2w |" in markdown
    assert "| scratch-ring-2w |" in capsys.readouterr().out  # the table is printed too
    png = out_dir / "compare.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert matplotlib.image.imread(png).shape[:2] == (900, 1300)


def test_eval_only_on_3_workers_matches_training_and_one_process_and_predicts_every_sample(tmp_path):
    import csv
    trained = train(tmp_path, "to-eval", "--workers", "2", "--dataset", "digits", "--epochs", "2")
    predictions = tmp_path / "predictions.csv"
    assert ray_dp.main(["--eval-only", str(tmp_path / "to-eval"), "--workers", "3", "--storage-path", str(tmp_path),
                        "--name", "evaluated", "--predict-out", str(predictions)]) == 0
    evaluated = json.loads((tmp_path / "evaluated" / "result.json").read_text())
    assert evaluated["world_size"] == 3 and evaluated["checkpoint"].endswith("checkpoint_epoch_001/checkpoint.pt")
    assert evaluated["final"]["test_acc"] == trained["final"]["test_acc"]  # exactly: same counts
    assert evaluated["final"]["test_count"] == 360
    assert sum(map(sum, evaluated["final"]["confusion"])) == 360
    assert sum(c["correct"] for c in evaluated["per_class"]) == round(360 * trained["final"]["test_acc"])

    model = ray_dp.build_model("lenet", (1, 28, 28))
    model.load_state_dict(ray_dp.load_checkpoint(evaluated["checkpoint"])["model"])
    _, test = ray_dp.load_digits()
    assert ray_dp.evaluate(model, test, torch.device("cpu"))["test_acc"] == evaluated["final"]["test_acc"]

    with open(predictions) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["index"]) for r in rows] == list(range(360))  # every sample once, in index order
    assert [int(r["label"]) for r in rows] == test.tensors[1].tolist()
    assert sum(r["label"] == r["predicted"] for r in rows) / 360 == evaluated["final"]["test_acc"]
    assert all(0.1 <= float(r["probability"]) <= 1 for r in rows)  # a max over 10 classes is at least 1/10
