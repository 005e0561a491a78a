"""Your own model, data and loss (#42): named by FILE.py:NAME (or module:NAME) on the command line, or handed to
ray_dp.train() as objects. What the driver checks before any cluster starts, what the run directory records, and
what a rerun says when the file changed. (That N workers train them as one process does: test_differential; that
they reach the workers of a cluster whose nodes lack the file: test_newcomer's notebook test.)"""
import json
import os
import shutil
import textwrap
import warnings

import pytest
import torch

import ray_dp
from helpers import REPO, WorkerLikeProcess, error_of, here, run_distributed

OWN = os.path.join(REPO, "tests", "user_code.py")


def runs(tmp_path):
    return ["--storage-path", str(tmp_path / "runs")]


@pytest.fixture
def code(tmp_path):
    """A copy of the user's file in tmp_path, and files that go wrong in their own ways."""
    shutil.copy(OWN, tmp_path / "mine.py")
    (tmp_path / "broken.py").write_text("import torch\nraise ValueError('boom at import')\n")
    (tmp_path / "losses.py").write_text("import torch.nn.functional as F\n\n\ndef per_batch(output, target):\n"
                                        "    return F.cross_entropy(output, target, reduction='none')[:3]\n")
    (tmp_path / "odd.py").write_text(ODD)
    (tmp_path / "needs_more.py").write_text("import not_installed_anywhere\n")
    return tmp_path


ODD = """
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset


class Pair(nn.Module):  # logits and an auxiliary output, in eval mode too
    def __init__(self, num_classes):
        super().__init__()
        self.layer = nn.Linear(13, num_classes)

    def forward(self, x):
        return self.layer(x), x.mean(1)


def first_of_pair(output, target):
    return nn.functional.cross_entropy(output[0], target)


class NormedMLP(nn.Module):  # BatchNorm1d: no statistics of one sample
    def __init__(self, num_classes):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(13, 8), nn.BatchNorm1d(8), nn.Linear(8, num_classes))

    def forward(self, x):
        return self.net(x)


class HalfUsed(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.used, self.spare = nn.Linear(13, num_classes), nn.Linear(13, num_classes)

    def forward(self, x):
        return self.used(x)


def adam_of_its_own(params, cfg):  # holds none of the model's parameters
    return torch.optim.Adam([torch.zeros(3, requires_grad=True)], lr=cfg.lr)


def rows(labels, test_labels, dtype=torch.float32):
    x = torch.randn(len(labels) + len(test_labels), 13, generator=torch.Generator().manual_seed(0)).to(dtype)
    return (TensorDataset(x[:len(labels)], torch.tensor(labels)),
            TensorDataset(x[len(labels):], torch.tensor(test_labels)))


def unseen_test_label():
    return rows([0, 1, 2, 0] * 4, [0, 3])


def negative_label():
    return rows([0, 1, -1, 0] * 4, [0, 1])


def whole_number_floats():
    return rows([0.0, 1.0, 2.0, 1.0] * 4, [0.0, 1.0])


def float64_rows():
    return rows([0, 1, 2, 1] * 4, [0, 1], torch.float64)


def fails_to_read():
    raise FileNotFoundError("/data/table.csv")


def with_a_default(n=16):  # called without the config
    return rows([0, 1, 2, 1] * (n // 4), [0, 1])


class WeightedLoss(nn.CrossEntropyLoss):  # its class weights have no default
    def __init__(self, class_weights):
        super().__init__(weight=class_weights, reduction="none")


class FailsInTraining(nn.Module):  # scores fine, fails to train
    def __init__(self, num_classes):
        super().__init__()
        self.layer = nn.Linear(13, num_classes)

    def forward(self, x):
        return self.layer(x if not self.training else x[:, :12])


def one_cycle_an_epoch_short(optimizer, cfg, steps_per_epoch):
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=cfg.lr, epochs=cfg.epochs - 1,
                                               steps_per_epoch=steps_per_epoch)


class MLP(HalfUsed):  # named in capitals
    pass


class Codes(HalfUsed):  # a lookup table of unsigned codes, which DDP's broadcast over gloo cannot send
    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.spare = nn.Identity()
        self.register_buffer("codes", torch.arange(4).to(torch.uint32))


class Sparse(Codes):
    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.codes = torch.eye(3).to_sparse_csr()


class Frozen(HalfUsed):  # a parameter gloo cannot carry, left out of training
    def __init__(self, num_classes):
        super().__init__(num_classes)
        self.spare = nn.Identity()
        self.table = nn.Parameter(torch.zeros(3, dtype=torch.int16), requires_grad=False)


class DropRates(nn.Module):  # timm's stochastic depth: its rates read with .item() in __init__
    def __init__(self, num_classes):
        super().__init__()
        self.rates = [rate.item() for rate in torch.linspace(0, 0.1, 2)]
        self.net = nn.Sequential(nn.Linear(13, 8), nn.BatchNorm1d(8), nn.Linear(8, num_classes))

    def forward(self, x):
        return self.net(x)
"""


BAD = [
    (["--model", "{tmp}/none.py:Net", "--dataset", "digits"], "--model {tmp}/none.py:Net: there is no file {tmp}/none.py"),
    (["--model", "{tmp}/mine.py:Nope", "--dataset", "digits"], "--model {tmp}/mine.py:Nope: {tmp}/mine.py has no Nope\n"),
    (["--model", "{tmp}/mine.py:TabularMlp", "--dataset", "digits"],
     "--model {tmp}/mine.py:TabularMlp: {tmp}/mine.py has no TabularMlp; did you mean TabularMLP?"),
    (["--model", "{tmp}/broken.py:Net", "--dataset", "digits"],
     "--model {tmp}/broken.py:Net: {tmp}/broken.py fails to import: ValueError: boom at import"),
    (["--dataset", "nomodule:load"], "--dataset nomodule:load: no module nomodule (a file's path ends in .py)"),
    (["--model", "{tmp}/needs_more.py:Net", "--dataset", "digits"], "--model {tmp}/needs_more.py:Net: "
     "{tmp}/needs_more.py fails to import: ModuleNotFoundError: No module named 'not_installed_anywhere'"),
    (["--model", "{tmp}/mine.py:not_a_model", "--dataset", "digits"],
     "--model {tmp}/mine.py:not_a_model returned str, not an nn.Module"),
    (["--model", "mlp", "--dataset", "{tmp}/mine.py:not_a_pair"],
     "--dataset {tmp}/mine.py:not_a_pair returned list, not a pair (train, test) of data sets"),
    (["--model", "{tmp}/mine.py:SmallCNN", "--dataset", "{tmp}/mine.py:wine"],
     "--model {tmp}/mine.py:SmallCNN fails on 16 samples of {tmp}/mine.py:wine (inputs (16, 13)): RuntimeError: "),
    (["--model", "mlp", "--dataset", "digits", "--loss", "{tmp}/losses.py:per_batch"],
     "--loss {tmp}/losses.py:per_batch is not a mean over samples ("),
    # class weights as torch reduces them: a weighted mean, which differs with the workers' split of the batch
    (["--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/mine.py:wine", "--loss",
      "{tmp}/mine.py:weighted_mean_cross_entropy"],
     "--loss {tmp}/mine.py:weighted_mean_cross_entropy is not a mean over samples ("),
    (["--model", "__main__:LeNet", "--dataset", "digits"],
     "--model __main__:LeNet names an object of the script that called ray_dp.train(): pass it (model=...), or "
     "name a file: FILE.py:NAME"),
    (["--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/mine.py:diabetes", "--loss", "mse",
      "--label-smoothing", "0.1"], "--label-smoothing is cross_entropy's; --loss mse does not smooth (drop it)"),
    (["--model", "{tmp}/odd.py:Pair", "--dataset", "{tmp}/mine.py:wine", "--loss", "{tmp}/odd.py:first_of_pair"],
     "--model {tmp}/odd.py:Pair returns tuple in eval mode: ray_dp scores a tensor"),
    (["--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/odd.py:unseen_test_label", "--batch-size", "4"],
     "--dataset {tmp}/odd.py:unseen_test_label's test labels run from 0 to 3; its classes are 0 to 2"),
    (["--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/odd.py:negative_label", "--batch-size", "4"],
     "--dataset {tmp}/odd.py:negative_label's training labels run from -1 to 1; its classes are 0 to 1"),
    (["--model", "{tmp}/odd.py:NormedMLP", "--dataset", "{tmp}/mine.py:wine", "--batch-size", "2"],
     "--model {tmp}/odd.py:NormedMLP cannot train on micro-batches of one sample (ValueError: Expected more than 1 "),
    (["--model", "{tmp}/odd.py:HalfUsed", "--dataset", "{tmp}/mine.py:wine"],
     "--model {tmp}/odd.py:HalfUsed: spare.weight, spare.bias get no gradient from the loss: use them in forward, "
     "or add --find-unused-parameters"),
    (["--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/odd.py:fails_to_read"],
     "--dataset {tmp}/odd.py:fails_to_read failed: FileNotFoundError: /data/table.csv"),
    (["--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/odd.py:whole_number_floats", "--batch-size", "4"],
     "--dataset {tmp}/odd.py:whole_number_floats's targets are torch.float32 values (e.g. 0): class indices are "
     "integers (torch.long)"),
    (["--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/mine.py:wine", "--loss", "mse"],
     "--loss mse is a regression's; {tmp}/mine.py:wine's targets are integers, class indices to ray_dp (3 classes)"),
    (["--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/odd.py:float64_rows", "--batch-size", "4"],
     "--model {tmp}/mine.py:TabularMLP fails on 16 samples of {tmp}/odd.py:float64_rows (inputs (16, 13)): "
     "RuntimeError: mat1 and mat2 must have the same dtype, but got Double and Float (inputs must be torch.float32, "
     "not torch.float64)"),
    (["compare", "--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/mine.py:wine"],
     "compare trains the lesson's LeNet with cross-entropy"),
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
    (["--loss", "huber"], "--loss huber is not a loss of ray_dp (cross_entropy, mse, or your own: FILE.py:NAME)"),
    (["--lr-schedule", "{tmp}/mine.py:one_cycel"],
     "--lr-schedule {tmp}/mine.py:one_cycel: {tmp}/mine.py has no one_cycel; did you mean one_cycle?"),
    (["--model", "mlp", "--dataset", "digits", "--optimizer", "{tmp}/mine.py:not_an_optimizer"],
     "--optimizer {tmp}/mine.py:not_an_optimizer returned list, not a torch.optim.Optimizer"),
    (["--model", "mlp", "--dataset", "digits", "--lr-schedule", "{tmp}/mine.py:adam_betas"],
     "--lr-schedule {tmp}/mine.py:adam_betas fails on --model mlp: TypeError: "),
    (["--model", "mlp", "--dataset", "digits", "--lr-schedule", "{tmp}/mine.py:one_cycle", "--warmup-epochs", "1"],
     "--lr-schedule {tmp}/mine.py:one_cycle sets every step's rate: it takes no --warmup-epochs"),
    (["--mode", "scratch", "--dataset", "digits", "--optimizer", "torch.optim:Adam"], "--optimizer needs --mode ddp"),
    (["--model", "mlp", "--dataset", "digits", "--optimizer", "torch.optim:LBFGS"],
     "--optimizer torch.optim:LBFGS fails on --model mlp: TypeError: "),
    (["--model", "mlp", "--dataset", "digits", "--optimizer", "{tmp}/odd.py:adam_of_its_own"],
     "--optimizer {tmp}/odd.py:adam_of_its_own holds none of --model mlp's parameters, so it would train nothing"),
    (["--mode", "scratch", "--dataset", "digits", "--lr-schedule", "{tmp}/mine.py:one_cycle"],
     "--lr-schedule {tmp}/mine.py:one_cycle needs --mode ddp (scratch mode: the lesson's own)"),
    (["--model", "mlp", "--dataset", "{tmp}/mine.py:diabetes", "--loss", "mse", "--best-by", "test_acc"],
     "--best-by test_acc: {tmp}/mine.py:diabetes is a regression, whose epochs have no accuracy; choose test_loss"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must be at least 0, got -1"),
    (["--best-by", "val_loss"], "--best-by val_loss needs --val-split (the part of the training set it scores)"),
    (["--model", "{tmp}/mine.py:TabularMLP", "--dataset", "{tmp}/mine.py:wine", "--loss", "{tmp}/odd.py:WeightedLoss"],
     "--loss {tmp}/odd.py:WeightedLoss cannot be made without arguments (TypeError: "),
    (["--model", "{tmp}/odd.py:Codes", "--dataset", "{tmp}/mine.py:wine", "--workers", "2"],
     "--model {tmp}/odd.py:Codes: gloo cannot send its codes (sparse, or of a dtype it lacks) to CPU workers: make "
     "it dense, int32, int64 or a float\n"),
    (["--model", "{tmp}/odd.py:Sparse", "--dataset", "{tmp}/mine.py:wine", "--workers", "3", "--batch-size", "48"],
     "--model {tmp}/odd.py:Sparse: gloo cannot send its codes (sparse, or of a dtype it lacks)"),
    (["--model", "{tmp}/odd.py:Frozen", "--dataset", "{tmp}/mine.py:wine", "--workers", "2"],
     "--model {tmp}/odd.py:Frozen: gloo cannot send its table (sparse, or of a dtype it lacks) to CPU workers"),
    (["--model", "{tmp}/odd.py:Mlp", "--dataset", "digits"], "--model {tmp}/odd.py:Mlp: {tmp}/odd.py has no Mlp; did "
                                                             "you mean MLP?"),
    (["--model", "{tmp}/odd.py:FailsInTraining", "--dataset", "{tmp}/mine.py:wine"],
     "--model {tmp}/odd.py:FailsInTraining fails to train on 2 samples of {tmp}/mine.py:wine (in training mode, "
     "forward and backward): RuntimeError: mat1 and mat2 shapes cannot be multiplied"),
    (["--model", "mlp", "--dataset", "digits", "--lr-schedule", "{tmp}/odd.py:one_cycle_an_epoch_short"],
     "--lr-schedule {tmp}/odd.py:one_cycle_an_epoch_short cannot step the run's --epochs 10 x 22 steps: ValueError: "
     "Tried to step 199 times. The specified number of total steps is 198"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[message[:40] for _, message in BAD])
@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")  # (Sparse's own, as torch builds it)
def test_bad_own_code_is_one_line_before_any_cluster_and_writes_nothing(flags, message, code, no_cluster, capsys):
    command = flags[:1] if flags[0] == "compare" else []
    err = error_of([*command, *runs(code), *(flag.format(tmp=code) for flag in flags[len(command):])], capsys)
    assert err.startswith(f"ray_dp.py: error: {message.format(tmp=code)}"), err
    assert not (code / "runs").exists()


def test_a_model_that_reads_values_in_init_is_asked_its_shape_on_a_real_build(code):
    # timm's idiom cannot be built on the meta device: a resume, --eval-only and --sync-bn build it for real
    spec = f"{code}/odd.py:DropRates"
    cfg = ray_dp.Config(model=spec, dataset=f"{code}/mine.py:wine", sync_bn=True, workers=2, batch_size=4)
    net = ray_dp.build_model(spec, (13,), 3)
    info = ray_dp.DataInfo((178, 36), (13,), ["0", "1", "2"], False, ray_dp.load_dataset(cfg), outputs=3)
    assert ray_dp.has_batchnorm(spec, (13,), 3)
    ray_dp.check_model_fits(cfg, info)
    ray_dp.check_state_fits(cfg, info, {"model": net.state_dict()})


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


def test_a_rerun_that_lengthens_your_schedules_run_is_refused_before_any_cluster(code, no_cluster, capsys):
    spec = f"{code}/mine.py:one_cycle"  # its saved state spans the run's 10 epochs of steps
    trained(code, model=f"{code}/mine.py:TabularMLP", dataset=f"{code}/mine.py:wine", lr_schedule=spec)
    flags = ["--model", f"{code}/mine.py:TabularMLP", "--dataset", f"{code}/mine.py:wine", "--batch-size", "16",
             "--lr-schedule", spec, "--name", "own", *runs(code)]
    ray_dp.parse_command(flags)  # the same --epochs resumes
    err = error_of([*flags, "--epochs", "12"], capsys)
    assert err == (f"ray_dp.py: error: run 'own' made --lr-schedule {spec} for --epochs 10, and its saved state "
                   f"resumes as it was: rerun with --epochs 10, or start over with --fresh\n")


def test_your_schedule_is_tried_after_the_step_it_follows_so_torch_warns_nothing():
    cfg = ray_dp.Config(dataset="digits", model="mlp", optimizer=f"{REPO}/tests/user_code.py:adam_betas",
                        lr_schedule=f"{REPO}/tests/user_code.py:one_cycle")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()" printed in the run
        ray_dp.check_training_choices(cfg, ray_dp.check_data(cfg)[1])


def test_your_optimizers_own_rate_is_what_the_cosine_schedule_scales_not_lr(code):
    from test_spot import Saves, run
    (code / "fixed.py").write_text("import torch\n\n\ndef adam_1e3(params, cfg):\n"
                                   "    return torch.optim.Adam(params, lr=1e-3)\n")
    cfg = ray_dp.Config(dataset="digits", model="mlp", epochs=2, lr=0.05, quiet=True, checkpoint_every="0",
                        optimizer=f"{code}/fixed.py:adam_1e3", storage_path=str(code / "runs"), name="fixed")
    saves = Saves()
    run(cfg, saves, 1)
    assert [m["lr"] for m in saves.epochs] == [ray_dp.learning_rate(cfg, e, 1e-3) for e in (0, 1)] == [1e-3, 5e-4]


@pytest.mark.xdist_group("worker-like-process")
def test_an_objects_hash_is_the_same_in_a_process_that_unpickles_it_by_value(code, monkeypatch, worker_like_process):
    # a class passed from Python reaches Ray's workers by value: the checkpoint's hash (a worker's) once differed from
    # result.json's (the driver's), and every predict, eval-only and rerun noted a change that was none
    import sys
    import ray.cloudpickle
    source = ("import torch.nn as nn\n\n\nclass Net(nn.Module):\n    width = 3\n    act = nn.ReLU()\n"
              "    def forward(self, x, scale=2):\n        return x * len({'a', 'b'}) * scale * self.size\n"
              "    @property\n    def size(self):\n        return 1.5\n"
              "    @staticmethod\n    def make(n, *, bias=True):\n        return nn.Linear(n, n, bias=bias)\n"
              "    acts = {'relu', 'gelu', 'tanh', 'silu'}\n    odd = type('Odd', (), {'__repr__': lambda s: 1 / 0})()\n")
    (code / "notebook_code.py").write_text(source)
    monkeypatch.syspath_prepend(str(code))
    import notebook_code
    ray.cloudpickle.register_pickle_by_value(notebook_code)
    try:
        blob = ray.cloudpickle.dumps(notebook_code.Net)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(notebook_code)
        sys.modules.pop("notebook_code")
    # a set's order follows its strings' hashes, which differ per process: in a process whose order of the class's set
    # is not this one's (a hash seed of its own; another if that one happens to give this order)
    unpickled = "import pickle, ray_dp\nnet = pickle.loads(argument)\nresult = list(net.acts), ray_dp.source_text(net)"
    order, there = worker_like_process.run(unpickled, blob)
    for seed in range(2, 6):
        if order != list(notebook_code.Net.acts):
            break
        other = WorkerLikeProcess(hash_seed=seed)
        order, there = other.run(unpickled, blob)
        other.stop()
    assert order != list(notebook_code.Net.acts) and there == ray_dp.source_text(notebook_code.Net)
    # what the class holds besides its methods' code changes its hash too: an attribute, a default, a property's body
    for before, after in [("width = 3", "width = 4"), ("scale=2", "scale=3"), ("return 1.5", "return 2.5"),
                          ("bias=True", "bias=False"), ("nn.ReLU()", "nn.Tanh()")]:
        namespace = {}
        exec(source.replace(before, after), namespace)
        assert ray_dp.source_text(namespace["Net"]) != there, after
    namespace = {}
    exec(source, namespace)
    assert ray_dp.source_text(namespace["Net"]) == there


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
                                      f"{code}/moved/mine.py:TabularMLP", "--dataset", f"{code}/mine.py:wine",
                                      *runs(code)])
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


def test_train_takes_classes_and_functions_not_instances_whose_arguments_a_rerun_would_lose():
    weights = torch.tensor([1.0, 3.0])
    for instance in (torch.nn.CrossEntropyLoss(weight=weights), torch.nn.BCEWithLogitsLoss(pos_weight=weights),
                     torch.nn.MSELoss()):
        with pytest.raises(ray_dp.ConfigError, match=f"loss= takes a class or a function, not an instance of "
                                                     f"{type(instance).__name__}, which a rerun could not make again"):
            ray_dp.as_spec(instance, "loss")
    with pytest.raises(ray_dp.ConfigError, match="model= takes a class or a function, not an instance of Linear"):
        ray_dp.as_spec(torch.nn.Linear(3, 2), "model")
    assert ray_dp.as_spec(torch.nn.MSELoss, "loss") == "torch.nn.modules.loss:MSELoss"
    ray_dp.CODE.clear()  # a rerun's process: the name alone makes it again
    assert ray_dp.user_code("torch.nn.modules.loss:MSELoss", "loss") is torch.nn.MSELoss


def test_two_lambdas_of_one_call_are_one_line_not_one_taken_for_the_other(no_cluster):
    ray_dp.CODE.clear()
    with pytest.raises(ray_dp.ConfigError, match="loss= is another object of the name test_own_code:test_two_lambdas_"
                                                 ".*<lambda> than one given before: give each its own name"):
        ray_dp.train(model=lambda num_classes: torch.nn.Linear(13, num_classes), dataset="digits",
                     loss=lambda output, target: torch.nn.functional.cross_entropy(output, target))


def test_a_misspelt_setting_of_train_names_the_closest():
    with pytest.raises(ray_dp.ConfigError, match="ray_dp.train\\(\\) has no setting 'epocs'; did you mean epochs\\?"):
        ray_dp.train(epocs=3)


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
    train, _, _ = ray_dp.worker_data(cfg, ray_dp.LoopOptions(torchrun=True), here())
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


def test_a_checkpoint_never_names_the_code_that_runs_eval_only_and_a_rerun_name_it_again(code, no_cluster, capsys):
    # a checkpoint copied from elsewhere whose config names a file of its choosing: nothing of it is imported
    (code / "evil.py").write_text(f"open({str(code / 'ran')!r}, 'w').close()\nfrom mine import *\n")
    shutil.copy(code / "mine.py", code / "evil_dir_mine.py")
    trained(code, model=f"{code}/evil.py:TabularMLP", dataset=f"{code}/mine.py:wine")
    (code / "ran").unlink()  # trained() itself imported it, as training does
    err = error_of(["--eval-only", str(code / "runs" / "own"), *runs(code)], capsys)
    assert err.startswith(f"ray_dp.py: error: the checkpoint trained your own code: name it again, --model "
                          f"{code}/evil.py:TabularMLP, --dataset {code}/mine.py:wine (ray_dp.train(): the same "
                          f"objects); a checkpoint never names the code"), err
    err = error_of(["--name", "own", "--dataset", f"{code}/mine.py:wine", *runs(code)], capsys)
    assert err.startswith(f"ray_dp.py: error: run 'own' trained your own code: name it again, --model "
                          f"{code}/evil.py:TabularMLP ("), err
    assert not (code / "ran").exists()


def test_your_optimizer_and_schedule_are_named_again_by_a_rerun_and_not_needed_by_eval_only(code, no_cluster,
                                                                                            capsys):
    trained(code, model=f"{code}/mine.py:TabularMLP", dataset=f"{code}/mine.py:wine",
            optimizer=f"{code}/mine.py:adam_betas", lr_schedule=f"{code}/mine.py:one_cycle")
    own = ["--model", f"{code}/mine.py:TabularMLP", "--dataset", f"{code}/mine.py:wine"]
    err = error_of(["--name", "own", *own, *runs(code)], capsys)
    assert err.startswith(f"ray_dp.py: error: run 'own' trained your own code: name it again, --lr-schedule "
                          f"{code}/mine.py:one_cycle, --optimizer {code}/mine.py:adam_betas ("), err
    cfg, _ = ray_dp.eval_config(ray_dp.Config(eval_only=str(code / "runs" / "own"), model=own[1], dataset=own[3]),
                                {"model", "dataset"})
    assert (cfg.optimizer, cfg.lr_schedule) == ("sgd", "cosine")  # a training setting: not the checkpoint's code


def test_a_rerun_of_another_object_under_the_same_name_notes_it(code, no_cluster, capsys):
    # a notebook's class, its cell edited: the same name (notebook:Net), another text, and no file to hash
    def cell(width):
        namespace = {"__name__": "notebook", "nn": torch.nn}
        exec(compile(f"class Net(nn.Module):\n    def __init__(self, num_classes):\n        super().__init__()\n"
                     f"        self.layer = nn.Linear(13, {width})\n\n    def forward(self, x):\n"
                     f"        return self.layer(x)\n", "<cell>", "exec"), namespace)
        return namespace["Net"]
    flags = ray_dp.settings_as_flags({"model": cell(3), "dataset": f"{code}/mine.py:wine", "batch_size": 16,
                                      "name": "own", "storage_path": str(code / "runs")})
    trained(code, model="notebook:Net", dataset=f"{code}/mine.py:wine")
    ray_dp.CODE.clear()
    ray_dp.settings_as_flags({"model": cell(3)})  # the same cell run again
    ray_dp.parse_command(flags)
    assert "changed since" not in capsys.readouterr().out
    ray_dp.CODE.clear()
    ray_dp.settings_as_flags({"model": cell(5)})
    ray_dp.parse_command(flags)
    assert "note: notebook:Net changed since run 'own' saved its checkpoint" in capsys.readouterr().out


def test_eval_only_from_python_of_a_run_with_a_local_lambda_loss_says_to_pass_it_again(code, no_cluster):
    def experiment():
        return lambda output, target: torch.nn.functional.cross_entropy(output, target)
    ray_dp.CODE.clear()
    spec = ray_dp.as_spec(experiment(), "loss")
    trained(code, model=f"{code}/mine.py:TabularMLP", dataset=f"{code}/mine.py:wine", loss=spec)
    with pytest.raises(ray_dp.ConfigError, match=f"the checkpoint trained your own code: name it again, --loss "
                                                 f"{spec} \\(ray_dp.train\\(\\): the same objects\\)"):
        ray_dp.train(eval_only=str(code / "runs" / "own"), model=f"{code}/mine.py:TabularMLP",
                     dataset=f"{code}/mine.py:wine", storage_path=str(code / "runs"))


def called_with_3(shipped):
    import pickle
    return str(pickle.loads(shipped)(3))


def test_a_file_that_imports_a_module_of_its_folder_loads_and_reaches_workers_without_the_folder(code):
    import ray.cloudpickle
    (code / "layers_of_mine.py").write_text("import torch.nn as nn\n\n\ndef block(n):\n    return nn.Linear(n, n)\n")
    (code / "net_of_mine.py").write_text("import torch.nn as nn\nimport layers_of_mine\n\n\n"
                                         "def build(num_classes):\n    return nn.Sequential(layers_of_mine.block(13), "
                                         "nn.Linear(13, num_classes))\n")
    build = ray_dp.user_code(f"{code}/net_of_mine.py:build", "model")
    shipped = ray.cloudpickle.dumps(build)
    (code / "layers_of_mine.py").unlink()
    (code / "net_of_mine.py").unlink()
    [built] = run_distributed(called_with_3, 1, shipped)  # in a process that has never imported them
    assert "Linear(in_features=13, out_features=3" in built, built


def test_a_data_function_with_a_default_argument_is_called_without_the_config(code):
    train, test = ray_dp.load_dataset(ray_dp.Config(dataset=f"{code}/odd.py:with_a_default"))
    assert (len(train), len(test)) == (16, 2)


def test_the_workers_get_the_model_and_the_loss_not_the_data_function_with_what_it_read(code):
    # a table read at module level: the data function's global, shipped with it by value
    (code / "table.py").write_text("import torch\nfrom torch.utils.data import TensorDataset\n\n"
                                   "TABLE = torch.randn(200_000, 13)\n\n\n"
                                   "def load():\n    return TensorDataset(TABLE[:100], TABLE[:100, 0]), "
                                   "TensorDataset(TABLE[100:120], TABLE[100:120, 0])\n")
    import ray.cloudpickle
    cfg = ray_dp.Config(model=f"{code}/mine.py:TabularMLP", dataset=f"{code}/table.py:load", loss="mse")
    ray_dp.load_dataset(cfg), ray_dp.build_model(cfg.model, (13,), 1)
    shipped = ray_dp.code_for_workers(cfg)
    assert list(shipped[0]) == [cfg.model] and len(ray.cloudpickle.dumps(shipped)) < 100_000


def test_a_conv3d_model_is_placed_on_its_device_without_channels_last():
    net = torch.nn.Sequential(torch.nn.Conv3d(1, 2, 3), torch.nn.Flatten(), torch.nn.LazyLinear(4))
    placed = ray_dp.on_device(net, torch.device("cpu"), "volumes.py:Net")
    assert placed(torch.zeros(2, 1, 5, 5, 5)).shape == (2, 4)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.bool])
def test_targets_of_any_integer_kind_are_scored_as_class_indices(dtype):
    x = torch.randn(12, 5, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 1] * 6)
    net, loss = torch.nn.Linear(5, 2), ray_dp.loss_function(ray_dp.Config(), training=False)
    expected = ray_dp.evaluate(net, ray_dp.TensorDataset(x, labels), torch.device("cpu"), num_classes=2, details=True,
                               criterion=loss)
    got = ray_dp.evaluate(net, ray_dp.TensorDataset(x, labels.to(dtype)), torch.device("cpu"), num_classes=2,
                          details=True, criterion=loss)
    assert got == expected and sum(map(sum, got["confusion"])) == 12


def steps_with_a_parameter_left_out(find_unused, every):
    """Three DDP steps of a model that uses one of its layers in every `every`-th step only (0: never)."""
    class Sometimes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.steps = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2), 0

        def forward(self, x):
            self.steps += 1
            return self.a(x) + (self.b(x) if every and self.steps % every == 0 else 0)
    cfg = ray_dp.Config(find_unused_parameters=find_unused)
    model = ray_dp.wrap_model(Sometimes(), torch.device("cpu"), cfg)
    try:
        for _ in range(3):
            model(torch.ones(4, 3)).sum().backward()
    except RuntimeError as exc:
        return str(exc).strip().splitlines()[-1]
    return "trained"


def test_a_parameter_left_out_in_some_steps_names_the_flag_which_trains_it():
    assert run_distributed(steps_with_a_parameter_left_out, 2, False, 2)[0] == (
        "parameters of the model got no gradient in a step (DDP needs each one's): train with "
        "--find-unused-parameters")
    # (never used: a step that uses every parameter would have DDP's reducer warn that the flag costs time)
    assert run_distributed(steps_with_a_parameter_left_out, 2, True, 0) == ["trained", "trained"]


def test_in_memory_data_travel_as_arrays_which_ray_workers_read_in_place():
    import pickle
    train, _ = ray_dp.load_digits()
    sent = ray_dp.shared(train)
    buffers = []  # what Ray's serializer keeps out of the pickle: its object store's memory, mapped by each worker
    wire = pickle.dumps(sent, protocol=5, buffer_callback=buffers.append)
    assert len(wire) < 5_000 and sum(memoryview(b).nbytes for b in buffers) == 1437 * 28 * 28 * 4 + 1437 * 8
    received = pickle.loads(wire, buffers=buffers)
    assert isinstance(received, ray_dp.TensorDataset) and received.classes == train.classes
    assert received.tensors[0].data_ptr() == sent.tensors[0].data_ptr()  # the very memory, not a copy
    assert torch.equal(received.tensors[1], train.tensors[1])
    copied = pickle.loads(pickle.dumps(sent))  # torchrun's ranks: an ordinary copy
    assert torch.equal(copied.tensors[0], train.tensors[0]) and copied.classes == train.classes
    assert ray_dp.shared(ray_dp.SampleStreams(train, 0)).__class__ is ray_dp.SampleStreams  # per sample: as it is
