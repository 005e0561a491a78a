"""Your own model, data and loss (#42): named by FILE.py:NAME (or module:NAME) on the command line, or handed to
ray_dp.train() as objects. What the driver checks before any cluster starts, what the run directory records, and
what a rerun says when the file changed. (That N workers train them as one process does: test_differential; that
they reach the workers of a cluster whose nodes lack the file: test_newcomer's notebook test.)"""
import json
import os
import shutil
import textwrap

import pytest
import torch

import ray_dp
from helpers import REPO, error_of, here, run_distributed

OWN = os.path.join(REPO, "tests", "user_code.py")


def runs(tmp_path):
    return ["--storage-path", str(tmp_path / "runs")]


@pytest.fixture
def code(tmp_path):
    """A copy of the user's file in tmp_path, and files that go wrong in their own ways."""
    shutil.copy(OWN, tmp_path / "mine.py")
    (tmp_path / "broken.py").write_text("import torch\nraise ValueError('boom at import')\n")
    (tmp_path / "losses.py").write_text("import torch.nn.functional as F\n\n\ndef per_sample(output, target):\n"
                                        "    return F.cross_entropy(output, target, reduction='none')\n")
    return tmp_path


BAD = [
    (["--model", "{tmp}/none.py:Net", "--dataset", "digits"], "--model {tmp}/none.py:Net: there is no file {tmp}/none.py"),
    (["--model", "{tmp}/mine.py:Nope", "--dataset", "digits"], "--model {tmp}/mine.py:Nope: {tmp}/mine.py has no Nope"),
    (["--model", "{tmp}/broken.py:Net", "--dataset", "digits"],
     "--model {tmp}/broken.py:Net: {tmp}/broken.py fails to import: ValueError: boom at import"),
    (["--dataset", "nomodule:load"], "--dataset nomodule:load: no module nomodule (a file's path ends in .py)"),
    (["--model", "{tmp}/mine.py:not_a_model", "--dataset", "digits"],
     "--model {tmp}/mine.py:not_a_model returned str, not an nn.Module"),
    (["--model", "mlp", "--dataset", "{tmp}/mine.py:not_a_pair"],
     "--dataset {tmp}/mine.py:not_a_pair returned list, not a pair (train, test) of data sets"),
    (["--model", "{tmp}/mine.py:SmallCNN", "--dataset", "{tmp}/mine.py:wine"],
     "--model {tmp}/mine.py:SmallCNN fails on two samples of {tmp}/mine.py:wine (inputs (2, 13)): RuntimeError: "),
    (["--model", "mlp", "--dataset", "digits", "--loss", "{tmp}/losses.py:per_sample"],
     "--loss {tmp}/losses.py:per_sample returned torch.Size([2]), not a scalar mean loss"),
    (["--model", "mlp", "--dataset", "{tmp}/mine.py:wine", "--image-size", "32"],
     "--image-size is for images; {tmp}/mine.py:wine's inputs have the shape (13,): not applicable (drop it)"),
    (["--model", "mlp", "--dataset", "{tmp}/mine.py:wine", "--augment"],
     "--augment is for --dataset folder's images; {tmp}/mine.py:wine is not augmented by ray_dp: not applicable"),
    (["--model", "mlp", "--dataset", "{tmp}/mine.py:dicts"], "--dataset {tmp}/mine.py:dicts: a sample is dict, not an "
                                                              "(input, target) pair"),
    (["--model", "mlp", "--dataset", "{tmp}/mine.py:named_targets", "--batch-size", "2"],
     "--dataset {tmp}/mine.py:named_targets: a target is a class index or a tensor of values: "),
    (["--model", "mlp", "--dataset", "{tmp}/mine.py:holds_a_connection", "--batch-size", "2"],
     "--dataset {tmp}/mine.py:holds_a_connection: its data sets cannot be sent to the workers (TypeError: cannot pickle "),
    (["--mode", "scratch", "--dataset", "digits", "--loss", "mse"], "--loss needs --mode ddp"),
    (["--mode", "scratch", "--dataset", "{tmp}/mine.py:wine"], "--mode scratch trains the lesson's LeNet on images"),
    (["--loss", "huber"], "--loss huber is not a loss of ray_dp.py (cross_entropy, mse, or your own: FILE.py:NAME)"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[message[:40] for _, message in BAD])
def test_bad_own_code_is_one_line_before_any_cluster_and_writes_nothing(flags, message, code, no_cluster, capsys):
    err = error_of([*runs(code), *(flag.format(tmp=code) for flag in flags)], capsys)
    assert err.startswith(f"ray_dp.py: error: {message.format(tmp=code)}"), err
    assert not (code / "runs").exists()


def test_a_relative_file_is_named_by_its_path_from_where_the_command_ran(code, monkeypatch, no_cluster):
    monkeypatch.chdir(code)
    _, cfg, _ = ray_dp.parse_command(["--model", "mine.py:TabularMLP", "--dataset", "mine.py:wine", *runs(code)])
    assert (cfg.model, cfg.dataset) == (f"{code}/mine.py:TabularMLP", f"{code}/mine.py:wine")
    assert cfg.name.startswith("ddp-TabularMLP-wine-")


def trained(code, **settings):
    """A run directory as a run of these settings leaves it after one epoch (as torchrun writes it)."""
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(name="own", storage_path=str(code / "runs"), batch_size=16,
                                                   **settings))
    cfg, data = ray_dp.check_data(cfg)
    net = ray_dp.build_model(cfg.model, data.sample_shape, data.outputs)
    path = code / "runs" / "own" / ray_dp.checkpoint_dir_name(1) / ray_dp.CHECKPOINT_FILE
    path.parent.mkdir(parents=True)
    torch.save(ray_dp.checkpoint_state(net.state_dict(), {}, 1, cfg, [], data.classes), path)
    return path


def test_the_run_records_its_code_a_rerun_notes_a_changed_file_and_refuses_weights_that_no_longer_fit(
        code, no_cluster, capsys):
    flags = ["--model", f"{code}/mine.py:TabularMLP", "--dataset", f"{code}/mine.py:wine", "--batch-size", "16",
             "--name", "own", *runs(code)]
    path = trained(code, model=f"{code}/mine.py:TabularMLP", dataset=f"{code}/mine.py:wine")
    state = torch.load(path, weights_only=True)  # data alone: a checkpoint carries no code to run
    assert state["code"]["model"]["spec"] == f"{code}/mine.py:TabularMLP"
    assert state["code"]["model"]["sha256"] == ray_dp.code_file(f"{code}/mine.py:x")["sha256"]
    assert state["classes"] == ["class_0", "class_1", "class_2"]
    ray_dp.parse_command(flags)
    assert "changed since" not in capsys.readouterr().out
    with open(code / "mine.py", "a") as f:
        f.write("\n# a comment\n")
    ray_dp.CODE.clear()  # a new command
    ray_dp.parse_command(flags)
    assert capsys.readouterr().out.count(f"note: {code}/mine.py changed since run 'own' saved its checkpoint") == 1
    text = (code / "mine.py").read_text().replace("nn.Linear(sample_shape[0], 32), nn.ReLU(), nn.Linear(32,",
                                                  "nn.Linear(sample_shape[0], 64), nn.ReLU(), nn.Linear(64,")
    (code / "mine.py").write_text(text)
    ray_dp.CODE.clear()
    err = error_of(flags, capsys)
    assert err.startswith(f"ray_dp.py: error: the checkpoint's weights do not fit --model {code}/mine.py:TabularMLP "
                          f"({code}/mine.py as it is now): size mismatch for net."), err


def test_result_json_records_your_codes_file_and_hash_as_its_checkpoint_does(code):
    import hashlib
    cfg = ray_dp.Config(model=f"{code}/mine.py:TabularMLP", dataset=f"{code}/mine.py:wine", loss="mse")
    record = ray_dp.run_record(cfg, {"epoch": 1}, {}, None)
    assert json.loads(json.dumps(record))["code"] == {
        flag: {"spec": spec, "file": f"{code}/mine.py",
               "sha256": hashlib.sha256((code / "mine.py").read_bytes()).hexdigest()[:16]}
        for flag, spec in (("model", cfg.model), ("dataset", cfg.dataset))}  # the built-in loss is no code
    assert record["code"] == ray_dp.checkpoint_state({}, {}, 1, cfg, [], [])["code"]


def test_train_takes_your_objects_and_names_them_by_module_and_name():
    from user_code import TabularMLP, smooth_l1, wine
    flags = ray_dp.settings_as_flags({"model": TabularMLP, "dataset": wine, "loss": smooth_l1, "workers": 2})
    assert flags == ["--model", "user_code:TabularMLP", "--dataset", "user_code:wine", "--loss",
                     "user_code:smooth_l1", "--workers", "2"]
    assert ray_dp.CODE["user_code:TabularMLP"] is TabularMLP
    _, cfg, _ = ray_dp.parse_command(flags)
    assert cfg.model == "user_code:TabularMLP"


def test_a_regression_is_scored_by_its_loss_alone():
    train, test = ray_dp.user_code(f"{OWN}:diabetes", "dataset")(None)
    assert not ray_dp.classifies(train) and ray_dp.classifies(ray_dp.load_digits()[0])
    net = ray_dp.build_model("mlp", (10,), 1)
    metrics = ray_dp.evaluate(net.eval(), test, torch.device("cpu"), num_classes=0, details=True,
                              criterion=ray_dp.loss_function(ray_dp.Config(loss="mse")))
    expected = torch.nn.functional.mse_loss(net(test.tensors[0]).squeeze(1), test.tensors[1]).item()
    assert metrics["test_loss"] == pytest.approx(expected, rel=1e-5) and "test_acc" not in metrics
    assert metrics["test_count"] == len(test) and len(metrics["predictions"]) == len(test)


def test_a_file_moved_with_its_text_unchanged_resumes_as_the_same_code(code, no_cluster, capsys):
    trained(code, model=f"{code}/mine.py:TabularMLP", dataset=f"{code}/mine.py:wine")
    (code / "moved").mkdir()
    shutil.copy(code / "mine.py", code / "moved" / "mine.py")
    _, cfg, options = ray_dp.parse_command(["--model", f"{code}/moved/mine.py:TabularMLP", "--dataset",
                                            f"{code}/moved/mine.py:wine", "--batch-size", "16", "--name", "own",
                                            *runs(code)])
    assert options["resume"].done == 1 and cfg.model == f"{code}/moved/mine.py:TabularMLP"
    with open(code / "moved" / "mine.py", "a") as f:
        f.write("# another text\n")
    err = error_of(["--model", f"{code}/moved/mine.py:TabularMLP", "--dataset", f"{code}/moved/mine.py:wine",
                    "--batch-size", "16", "--name", "own", *runs(code)], capsys)
    assert "was trained with --model " in err and "rerun it with its values" in err
    # --eval-only of the run, the file named where it is now: the same code, evaluated from there
    (code / "moved" / "mine.py").write_text((code / "mine.py").read_text())
    ray_dp.CODE.clear()
    _, cfg, _ = ray_dp.parse_command(["--eval-only", str(code / "runs" / "own"), "--model",
                                      f"{code}/moved/mine.py:TabularMLP", *runs(code)])
    assert cfg.model == f"{code}/moved/mine.py:TabularMLP" and cfg.dataset == f"{code}/mine.py:wine"


def test_a_module_spec_has_no_hash_to_vouch_for_another_module():
    record = {"spec": "user_code:TabularMLP"}
    assert not ray_dp.same_setting("model", "user_code:TabularMLP", "user_code_2:TabularMLP", record)
    assert ray_dp.same_setting("model", "user_code:TabularMLP", "user_code:TabularMLP", record)


def test_targets_of_any_integer_kind_are_classes_and_a_data_set_without_targets_still_names_its_labels():
    import numpy as np

    class Rows(torch.utils.data.Dataset):  # per sample, labels as numpy integers, no `targets`
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(3), np.int64(i % 2)
    assert ray_dp.classifies(Rows()) and ray_dp.labels_of(Rows()) == [0, 1, 0, 1]
    assert not ray_dp.classifies([(torch.zeros(3), 0.5)]) and ray_dp.classifies([(torch.zeros(3), True)])
    loss = ray_dp.loss_function(ray_dp.Config())  # cross-entropy takes them all as class indices
    logits = torch.randn(4, 3)
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 2, 1, 1]))
    for dtype in (torch.int32, torch.uint8, torch.int64):
        assert torch.equal(loss(logits, torch.tensor([0, 2, 1, 1], dtype=dtype)), expected)


def test_train_takes_a_loss_instance_but_not_a_model_instance():
    spec = ray_dp.as_spec(torch.nn.MSELoss(), "loss")
    assert spec == "torch.nn.modules.loss:MSELoss()"
    ray_dp.CODE.clear()  # a rerun's process: the spec alone rebuilds it
    assert ray_dp.user_code(spec, "loss") is torch.nn.MSELoss
    with pytest.raises(ray_dp.ConfigError, match="not an instance of HuberLoss made with arguments"):
        ray_dp.as_spec(torch.nn.HuberLoss(delta=2.0), "loss")  # a rerun would rebuild HuberLoss()
    with pytest.raises(ray_dp.ConfigError, match="model= takes a class or a function that returns the model, not an "
                                                 "instance of Linear"):
        ray_dp.as_spec(torch.nn.Linear(3, 2), "model")


def rank_0s_split(cfg):
    data = ray_dp.worker_data(cfg, ray_dp.LoopOptions(torchrun=True), here())
    return data[0].tensors[0]


def test_under_torchrun_every_rank_trains_rank_0s_own_data_set(code):
    # a data set of one's own whose split is drawn anew by every call: rank 0 decides it for all
    (code / "shuffled.py").write_text("import torch\nfrom torch.utils.data import TensorDataset\n\n\n"
                                      "def load():\n    x = torch.randperm(40).double()[:, None]\n"
                                      "    return TensorDataset(x[:30], x[:30, 0]), TensorDataset(x[30:], x[30:, 0])\n")
    cfg = ray_dp.Config(dataset=f"{code}/shuffled.py:load", model="mlp")
    zero, one = run_distributed(rank_0s_split, 2, cfg)
    assert torch.equal(zero, one)


def rank_0s_samples(cfg):
    train, _ = ray_dp.worker_data(cfg, ray_dp.LoopOptions(torchrun=True), here())
    return type(train).__name__, [train[i][0].item() for i in range(len(train))]


def test_under_torchrun_a_data_set_class_of_your_file_reaches_ranks_that_never_imported_it(code):
    (code / "rows.py").write_text(textwrap.dedent("""
        import torch


        class Rows(torch.utils.data.Dataset):
            classes = ["a", "b"]

            def __init__(self, order):
                self.order = order

            def __len__(self):
                return len(self.order)

            def __getitem__(self, i):
                return torch.tensor([float(self.order[i])]), i % 2


        def load():
            order = torch.randperm(40).tolist()
            return Rows(order[:30]), Rows(order[30:])
        """))
    cfg = ray_dp.Config(dataset=f"{code}/rows.py:load", model="mlp")
    zero, one = run_distributed(rank_0s_samples, 2, cfg)
    assert zero == one and zero[0] == "Rows" and len(zero[1]) == 30
