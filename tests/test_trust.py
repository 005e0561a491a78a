"""Trust on every path (#22): a run reports what one process would compute, whatever the flags, the launcher or
the rerun. One regression test (or a few) per item of the review; each fails on the code before the fix."""
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import ray_dp
from helpers import here, REPO, error_of, run_distributed, save_run

DIGITS = ["--dataset", "digits"]


def tiny_folder(root, classes=("cat", "dog"), per_class=6, size=12, seed=0):
    """An ImageFolder tree of small random RGB PNGs: root/train/<class>/*.png and root/val/<class>/*.png."""
    from PIL import Image
    gen = torch.Generator().manual_seed(seed)
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = torch.randint(0, 256, (size, size, 3), generator=gen, dtype=torch.uint8).numpy()
                Image.fromarray(pixels, mode="RGB").save(root / split / name / f"{i}.png")
    return root


def runs(tmp_path):
    return ["--storage-path", str(tmp_path / "runs")]


# 1. A rerun validates the batch it adopts, with the workers it will run on.

@pytest.mark.parametrize("stored, rerun, message", [
    ({"batch_size": 100, "workers": 2}, ["--workers", "8"], "--batch-size 100 must divide by workers x accum-steps = 8"),
    ({"batch_size": 8, "workers": 2}, ["--workers", "16"], "--batch-size 8 must divide by workers x accum-steps = 16"),
    ({"batch_size": 96, "accum_steps": 2}, ["--workers", "5"], "--batch-size 96 must divide by workers x accum-steps = 10"),
])
def test_a_rerun_validates_the_batch_it_adopts(stored, rerun, message, tmp_path, no_cluster, capsys):
    save_run(tmp_path / "runs" / "a", saved=range(1, 3), **stored)
    err = error_of([*runs(tmp_path), "--name", "a", *DIGITS, *rerun], capsys)
    assert message in err and "which this rerun takes from it" in err  # the value the user did not type


@pytest.mark.parametrize("message, named", [
    ("--lr 0.2 is too large", ["--lr 0.2"]), ("lr: too large", ["--lr 0.2"]), ("--augment: no", ["no --augment"]),
    ("--lr-schedule cosine is not allowed", []), ("already so", []), ("it takes no --warmup-epochs", [])])
def test_a_refused_rerun_names_the_flags_it_adopted_that_the_message_names_as_a_word(message, named, tmp_path,
                                                                                   no_cluster, capsys, monkeypatch):
    save_run(tmp_path / "runs" / "a", saved=range(1, 3), lr=0.2, augment=False)

    def refuse(cfg, **_):
        raise ray_dp.ConfigError(message)
    monkeypatch.setattr(ray_dp, "validate", refuse)
    err = error_of([*runs(tmp_path), "--name", "a", *DIGITS], capsys)
    said = re.search(r"trained with (.*), which this rerun takes from it", err)
    assert (said.group(1).split(", ") if said else []) == named, err


def test_a_rerun_on_more_workers_keeps_its_own_batch_when_it_splits(tmp_path, no_cluster):
    save_run(tmp_path / "runs" / "a", saved=range(1, 3), batch_size=96, workers=2)
    command, cfg, options = ray_dp.parse_command([*runs(tmp_path), "--name", "a", *DIGITS, "--workers", "3"])
    assert (cfg.batch_size, cfg.workers, cfg.micro_batch, options["resume"].done) == (96, 3, 32, 2)


# 2. Under torchrun, rank 0 decides what to resume from (and the config), and every rank follows.

def resume_as_rank_sees_it(storages):
    """Each rank resolved its own config from the run directory it sees (rank 1: another machine, without the
    shared file system); what the torchrun launcher hands each rank."""
    rank = dist.get_rank()
    cfg = ray_dp.Config(dataset="digits", name="run", storage_path=storages[rank], lr=0.1 if rank == 0 else 0.05)
    worker = ray_dp.Worker(rank, dist.get_world_size(), torch.device("cpu"))
    cfg = ray_dp.from_rank_0(cfg, worker.device)
    state = ray_dp.TorchrunLauncher(cfg, worker).latest_checkpoint()
    return cfg.lr, cfg.storage_path, None if state is None else state["epoch"]


def test_torchrun_ranks_resume_from_rank_0s_checkpoint_whatever_they_see(tmp_path):
    save_run(tmp_path / "machine0" / "run", saved=range(1, 4))
    (tmp_path / "machine1").mkdir()  # the other machine sees no run at all
    seen = run_distributed(resume_as_rank_sees_it, 2, [str(tmp_path / "machine0"), str(tmp_path / "machine1")])
    assert seen[0] == seen[1] == (0.1, str(tmp_path / "machine0"), 3)


# 3. Random augmentation is each sample's own (the same on 1 or N workers), dropout each rank's own.

def augmented_epoch(cfg, data, world, epoch):
    """Every rank's first micro-batch of `epoch`, put back in the global batch's order (rank r holds positions r,
    r + world, ...)."""
    per_rank = []
    for rank in range(world):
        batches = ray_dp.train_batches(data, cfg, rank, world, torch.device("cpu"))
        batches.sampler.set_epoch(epoch)
        per_rank.append(next(iter(batches))[0])
    return torch.stack(per_rank, 1).flatten(0, 1)


@pytest.mark.parametrize("loader_workers", [0, 1])
def test_augmentation_is_the_same_on_one_or_n_workers_and_new_each_epoch(loader_workers, tmp_path):
    folder = tiny_folder(tmp_path / "images", size=20)
    cfg = ray_dp.Config(dataset="folder", data_dir=str(folder), model="lenet", batch_size=4, workers=2,
                        loader_workers=loader_workers, augment=True)
    cfg, info = ray_dp.check_data(cfg)
    train = info.datasets[0]
    one = augmented_epoch(ray_dp.replace(cfg, workers=1), train, 1, epoch=0)
    two = augmented_epoch(cfg, train, 2, epoch=0)
    assert torch.equal(one, two)  # N workers see the crops one process would, not copies of one rank's
    assert not torch.equal(two[0], two[1])  # rank 0's position 0 and rank 1's position 0 differ
    assert torch.equal(augmented_epoch(cfg, train, 2, epoch=0), two)  # a rerun draws them again
    streams = ray_dp.SampleStreams(train, cfg.seed)
    assert torch.equal(streams[0, 5][0], streams[0, 5][0])  # sample 5 in epoch 0, twice
    assert not torch.equal(streams[0, 5][0], streams[1, 5][0])  # and in epoch 1: a new crop


def dropout_masks():
    """The dropout mask of the first training step's forward pass on this rank, twice (a rerun)."""
    masks = []
    for _ in range(2):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Dropout(0.5), torch.nn.Linear(784, 10))
        seen = []
        net[1].register_forward_hook(lambda module, inputs, output: seen.append((output == 0).clone()))
        cfg = ray_dp.Config(dataset="synthetic", synthetic_size=16, batch_size=8, workers=2, epochs=1)
        data = ray_dp.make_synthetic(0, 16)[0]
        batches = ray_dp.train_batches(data, cfg, dist.get_rank(), 2, torch.device("cpu"))
        ray_dp.train_epoch(ray_dp.wrap_model(net, torch.device("cpu")), torch.optim.SGD(net.parameters(), 0.1),
                           batches, cfg, here(), 0, ray_dp.Operations(cfg, here()))
        masks.append(seen[0])
    return masks


def test_dropout_is_each_ranks_own_and_the_same_on_a_rerun():
    (rank0, rank0_again), (rank1, rank1_again) = run_distributed(dropout_masks, 2)
    assert torch.equal(rank0, rank0_again) and torch.equal(rank1, rank1_again)
    assert not torch.equal(rank0, rank1)


# 4. --eval-only scores what was trained: the seed's data, the checkpoint's classes; the doctor compares names.

def test_eval_only_of_a_synthetic_run_uses_its_seed(tmp_path, no_cluster, capsys):
    run = save_run(tmp_path / "runs" / "syn", dataset="synthetic", seed=3)
    command, cfg, _ = ray_dp.parse_command(["--eval-only", str(run)])
    assert (command, bool(cfg.eval_only), cfg.seed) == ("train", True, 3)
    assert "with --seed 3; --seed 0 contradicts it" in error_of(["--eval-only", str(run), "--seed", "0"], capsys)
    assert ray_dp.parse_command(["--eval-only", str(run), "--seed", "3"])[1].seed == 3


def folder_checkpoint(tmp_path, classes):
    folder = tiny_folder(tmp_path / "trained_on", classes=classes)
    cfg, info = ray_dp.check_data(ray_dp.Config(dataset="folder", data_dir=str(folder), model="mlp", batch_size=4))
    model = ray_dp.build_model("mlp", info.sample_shape, len(info.classes))
    path = tmp_path / "checkpoint.pt"
    torch.save(ray_dp.checkpoint_state(model.state_dict(), {}, 0, cfg, [], info.classes), path)
    return path


def test_eval_only_refuses_a_folder_whose_classes_are_other_names(tmp_path, no_cluster, capsys):
    path = folder_checkpoint(tmp_path, ("cat", "dog"))
    other = tiny_folder(tmp_path / "other", classes=("cat", "wolf"))
    err = error_of([*runs(tmp_path), "--eval-only", str(path), "--data-dir", str(other)], capsys)
    assert "the checkpoint's classes are cat, dog" in err and "has cat, wolf" in err


def test_the_doctors_data_check_tells_folders_with_other_class_names_apart(tmp_path):
    here = ray_dp.data_files(ray_dp.Config(dataset="folder", data_dir=str(tiny_folder(tmp_path / "a"))))
    there = ray_dp.data_files(ray_dp.Config(dataset="folder", data_dir=str(tiny_folder(
        tmp_path / "b", classes=("cat", "wolf")))))
    assert here != there  # the same counts: only the names differ
    assert ray_dp.classes_of(there, here) == "2 classes (only here: wolf)"


# 5. A checkpoint from before a flag existed trained with the flag's default.

def test_a_checkpoint_without_a_newer_flag_refuses_a_change_of_it(tmp_path, no_cluster, capsys):
    run = save_run(tmp_path / "runs" / "old", saved=range(1, 3))
    path = run / "checkpoint_epoch_002" / ray_dp.CHECKPOINT_FILE
    state = torch.load(path, weights_only=True)
    for key in ("label_smoothing", "clip_grad_norm", "warmup_epochs"):
        del state["config"][key]
    torch.save(state, path)
    err = error_of([*runs(tmp_path), "--name", "old", *DIGITS, "--label-smoothing", "0.3",
                    "--clip-grad-norm", "0.1", "--warmup-epochs", "3"], capsys)
    assert ("was trained with --warmup-epochs 0, --clip-grad-norm 0.0, --label-smoothing 0.0; this command says "
            "--warmup-epochs 3, --clip-grad-norm 0.1, --label-smoothing 0.3") in err


# 6. torchvision models: auxiliary heads off, small images refused with the size that works, no traceback.

@pytest.mark.parametrize("name, size", [("googlenet", 32), ("inception_v3", 80)])
def test_models_with_auxiliary_heads_train(name, size):
    torch.manual_seed(0)
    net = ray_dp.build_model(name, (3, size, size), 10).train()
    loss = torch.nn.functional.cross_entropy(net(torch.rand(2, 3, size, size)), torch.tensor([1, 2]))
    loss.backward()  # a tuple of outputs would not get here


@pytest.mark.parametrize("flags, message", [
    (["--model", "vgg11"], "--model vgg11 cannot take digits's images as given (28 x 28 px): "),
    (["--model", "vgg11"], "the smallest size it takes is 32 x 32 px: add --image-size 32"),
    (["--model", "vit_b_16"], "the smallest size it takes is 224 x 224 px: add --image-size 224"),
    (["--model", "inception_v3", "--image-size", "64"], "the smallest size it takes is 75 x 75 px"),
])
def test_a_model_too_big_for_the_images_is_one_line_before_any_cluster(flags, message, tmp_path, no_cluster,
                                                                       capsys):
    assert message in error_of([*runs(tmp_path), *DIGITS, *flags], capsys)


# One model of each family torchvision lists, at the built-in sets' sizes (1 x 28 x 28, 3 x 32 x 32).
FAMILIES = ["alexnet", "convnext_tiny", "densenet121", "efficientnet_b0", "efficientnet_v2_s", "googlenet",
            "inception_v3", "maxvit_t", "mnasnet0_5", "mobilenet_v2", "mobilenet_v3_small", "regnet_x_400mf",
            "regnet_y_400mf", "resnet50", "torchvision.resnet18", "resnext50_32x4d", "shufflenet_v2_x0_5",
            "squeezenet1_1", "swin_t", "swin_v2_t", "vgg11", "vgg11_bn", "vit_b_32", "wide_resnet50_2"]


def test_every_family_of_listed_models_is_tried_below():
    def family(name):
        return re.match(r"[a-z]+", name.removeprefix("torchvision."))[0]
    families, listed = {family(n) for n in FAMILIES}, {family(n) for n in ray_dp.torchvision_names()}
    assert listed <= families, f"add a model of {listed - families} to FAMILIES"


@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)], ids=["28px", "32px"])
@pytest.mark.parametrize("name", FAMILIES)
def test_every_listed_model_fits_the_builtin_images_or_says_which_size_does(name, shape):
    cfg = ray_dp.Config(model=name, dataset="digits")
    info = ray_dp.DataInfo((100, 10), shape, [str(c) for c in range(10)], False)
    try:
        ray_dp.check_model_fits(cfg, info)
    except ray_dp.ConfigError as exc:
        assert "\n" not in str(exc) and "add --image-size" in str(exc), exc
        size = int(str(exc).rsplit(" ", 1)[1])
        ray_dp.check_model_fits(ray_dp.replace(cfg, image_size=size), ray_dp.DataInfo((100, 10), (shape[0], size, size),
                                                                               info.classes, False))


def test_sync_bn_on_a_regnet_is_accepted_without_a_traceback(tmp_path, no_cluster):
    _, cfg, _ = ray_dp.parse_command([*runs(tmp_path), *DIGITS, "--model", "regnet_y_400mf", "--sync-bn"])
    assert cfg.sync_bn and ray_dp.has_batchnorm("regnet_y_400mf")


def test_image_size_resizes_in_memory_sets_for_training_and_evaluation():
    cfg = ray_dp.Config(dataset="digits", model="mlp", image_size=40, batch_size=8, workers=1)
    train, test = ray_dp.load_digits()
    assert ray_dp.input_shape(cfg, train) == (1, 40, 40)
    x, _ = next(iter(ray_dp.train_batches(train, cfg, 0, 1, torch.device("cpu"))))
    assert ray_dp.resized(x, cfg.image_size).shape == (8, 1, 40, 40)  # as train_epoch resizes each batch
    net = ray_dp.build_model("mlp", (1, 40, 40)).eval()
    metrics = ray_dp.evaluate(net, test, torch.device("cpu"), image_size=40)
    assert metrics["test_count"] == len(test)


def test_image_size_is_refused_where_it_cannot_apply(tmp_path, no_cluster, capsys):
    err = error_of([*runs(tmp_path), *DIGITS, "--mode", "scratch", "--image-size", "32"], capsys)
    assert "--image-size needs --mode ddp" in err


# 7. --eval-only sizes the model from the checkpoint's classes, not from the test labels.

def test_eval_classes_come_from_the_checkpoint_not_the_test_labels(tmp_path):
    train = ray_dp.TensorDataset(torch.rand(20, 1, 28, 28), torch.arange(20) % 10)
    test = ray_dp.TensorDataset(torch.rand(9, 1, 28, 28), torch.arange(9))  # no sample of class 9
    cfg = ray_dp.Config(dataset="digits")
    names = ray_dp.checkpoint_classes(cfg, {"classes": [str(c) for c in range(10)]}, train, test)
    assert names == [str(c) for c in range(10)]
    assert ray_dp.checkpoint_classes(cfg, {}, train, test) == names  # an older checkpoint: its training set's
    ray_dp.write_predictions(str(tmp_path / "p.csv"), test, [[9, 0.9]] * 9, names)  # class 9 predicted
    assert (tmp_path / "p.csv").read_text().splitlines()[1] == "0,0,9,0.900000,0,9"
    with pytest.raises(ray_dp.ConfigError, match="test labels run from 0 to 8, but the checkpoint has 5 classes"):
        ray_dp.checkpoint_classes(cfg, {"classes": list("abcde")}, train, test)


# 8. A resume needs its checkpoint only, not --weights; the same file by another path is the same file.

def test_a_resume_neither_needs_nor_reads_weights(tmp_path, monkeypatch, capsys):
    weights = tmp_path / "w.pth"
    torch.save(ray_dp.build_model("lenet", (1, 28, 28)).state_dict(), weights)
    save_run(tmp_path / "runs" / "ft", saved=range(1, 3), weights=str(weights))
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")
    argv = [*runs(tmp_path), "--name", "ft", *DIGITS, "--weights", "../sub/../w.pth"]
    assert ray_dp.parse_command(argv)[2]["resume"].done == 2  # another spelling of the same file
    weights.unlink()  # moved away: resuming needs only the checkpoint
    command, cfg, options = ray_dp.parse_command(argv)

    def no_reading(path):
        raise AssertionError("a resume read --weights")

    class Connected(Exception):
        pass

    def connect(cfg):
        raise Connected
    monkeypatch.setattr(ray_dp, "read_weights", no_reading)
    monkeypatch.setattr(ray_dp, "connect", connect)
    with pytest.raises(Connected):
        ray_dp.run(cfg, options["resume"])


# 9. --eval-only refuses every training flag (derived from the flags' declared roles) and contradictions.

def eval_typed_value(name):
    """A value to type for a refused training flag, other than its default."""
    f = next(f for f in ray_dp.fields(ray_dp.Config) if f.name == name)
    flag = "--" + name.replace("_", "-")
    if isinstance(f.default, bool):
        return [f"--no-{name.replace('_', '-')}"] if f.default else [flag]
    if choices := f.metadata["argparse"].get("choices"):
        return [flag, next(c for c in choices if c != f.default)]
    return [flag, {"weights": "{weights}"}.get(name, "3")]


@pytest.mark.parametrize("name", sorted(ray_dp.EVAL_REFUSES))
def test_eval_only_refuses_every_training_flag(name, tmp_path, no_cluster, capsys):
    run = save_run(tmp_path / "runs" / "r")
    torch.save({}, tmp_path / "w.pth")
    flags = [a.format(weights=tmp_path / "w.pth") for a in eval_typed_value(name)]
    err = error_of([*runs(tmp_path), "--eval-only", str(run), *flags], capsys)
    assert f"--{name.replace('_', '-')} is a training flag and has no effect with --eval-only" in err


def test_the_roles_cover_the_flags_the_review_found_ignored():
    assert {"optimizer", "weight_decay", "warmup_epochs", "clip_grad_norm", "label_smoothing", "weights",
            "augment"} <= ray_dp.EVAL_REFUSES


def test_eval_only_refuses_an_image_size_other_than_the_checkpoints(tmp_path, no_cluster, capsys):
    run = save_run(tmp_path / "runs" / "r", image_size=28)
    assert "with --image-size 28; --image-size 64 contradicts it" in error_of(
        [*runs(tmp_path), "--eval-only", str(run), "--image-size", "64"], capsys)


# 10. torchvision's resnet18 by name, and the hint when its weights are given to the lessons' resnet18.

def test_torchvision_resnet18_is_listed_and_builds_torchvisions(tmp_path, no_cluster, capsys):
    assert "torchvision.resnet18" in ray_dp.torchvision_names()
    net = ray_dp.build_model("torchvision.resnet18", (3, 64, 64))
    assert {"conv1.weight", "fc.weight"} <= net.state_dict().keys()
    ray_dp.list_models()
    assert "torchvision.resnet18" in capsys.readouterr().out
    weights = tmp_path / "resnet18.pth"
    torch.save(net.state_dict(), weights)
    info = ray_dp.DataInfo((10, 10), (3, 32, 32), [str(c) for c in range(10)], False)
    with pytest.raises(ray_dp.ConfigError, match="they fit torchvision's resnet18: use --model torchvision.resnet18"):
        ray_dp.check_weights(ray_dp.Config(model="resnet18", weights=str(weights)), info)


# 11. Another Ray version is one line naming the installed and the needed ones.

def test_an_unsupported_ray_is_one_line(tmp_path):
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text("__version__ = '2.55.1'\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "ray_dp.py", "--help"], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"ray_dp.py: error: {ray_dp.ray_version_problem('2.55.1')}\n")
    assert "Ray 2.55.1 is installed" in proc.stderr and ">= 2.59 and < 2.61" in proc.stderr
    assert ray_dp.ray_version_problem("2.60.0") is None and ray_dp.ray_version_problem("2.59.0") is None


# The review of the fix: what it still let through.

def test_in_memory_image_size_reaches_the_loader_process_path_too():
    cfg = ray_dp.Config(dataset="synthetic", model="mlp", image_size=20, batch_size=8, workers=1, loader_workers=1)
    train, test = ray_dp.make_synthetic(0, 16)
    net = ray_dp.build_model("mlp", ray_dp.input_shape(cfg, train))
    batches = ray_dp.train_batches(train, cfg, 0, 1, torch.device("cpu"))
    metrics = ray_dp.train_epoch(net, torch.optim.SGD(net.parameters(), 0.01), batches, cfg, here(), 0,
                                 ray_dp.Operations(cfg, here()))
    assert metrics["train_samples"] == 16  # a 28 px batch would not fit the 20 px model's first layer
    assert ray_dp.evaluate(net.eval(), test, torch.device("cpu"), image_size=20)["test_count"] == 100


def test_a_folder_rerun_takes_its_data_dir_and_refuses_other_classes(tmp_path, no_cluster, capsys, monkeypatch):
    folder = tiny_folder(tmp_path / "dogs")
    other = tiny_folder(tmp_path / "wolves", classes=("cat", "wolf"))
    cfg, info = ray_dp.check_data(ray_dp.Config(dataset="folder", data_dir=str(folder), model="mlp", batch_size=4))
    save = ray_dp.replace(cfg, name="f", storage_path=str(tmp_path / "runs"))
    path = tmp_path / "runs" / "f" / "checkpoint_epoch_001" / ray_dp.CHECKPOINT_FILE
    path.parent.mkdir(parents=True)
    model = ray_dp.build_model("mlp", info.sample_shape, 2)
    torch.save(ray_dp.checkpoint_state(model.state_dict(), {}, 1, save, [], info.classes), path)
    _, resumed, options = ray_dp.parse_command([*runs(tmp_path), "--name", "f"])  # the shortest rerun
    assert (resumed.data_dir, options["resume"].classes) == (str(folder), ["cat", "dog"])

    class Connected(Exception):
        pass

    def connect(cfg):
        raise Connected
    monkeypatch.setattr(ray_dp, "connect", connect)
    with pytest.raises(Connected):
        ray_dp.run(resumed, options["resume"])
    _, moved, options = ray_dp.parse_command([*runs(tmp_path), "--name", "f", "--data-dir", str(other)])
    with pytest.raises(ray_dp.ConfigError, match="the checkpoint's classes are cat, dog; --data-dir .* has cat, wolf"):
        ray_dp.run(moved, options["resume"])


def different_classes():
    names = ["cat", "dog"] if dist.get_rank() == 0 else ["cat", "wolf"]
    try:
        ray_dp.check_classes_agree(names, torch.device("cpu"))
    except ray_dp.DataError as exc:
        return str(exc)


def test_every_rank_stops_when_the_nodes_folders_hold_other_classes():
    assert all("the workers' data sets hold different classes" in said for said in run_distributed(
        different_classes, 2))


def test_torchrun_ranks_other_than_0_leave_the_run_directory_to_rank_0(tmp_path, monkeypatch):
    # The run as rank 0 sees it, trained with batch 96: this rank's defaults (batch 64) do not split over 3.
    save_run(tmp_path / "runs" / "exp", saved=range(1, 3), batch_size=96)
    for key, value in {"TORCHELASTIC_RUN_ID": "none", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "3",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(key, value)
    command, cfg, options = ray_dp.parse_command(["--storage-path", str(tmp_path / "elsewhere"), "--name", "exp",
                                                  *DIGITS])
    assert (command, options["resume"].done) == ("train", 0) and ray_dp.torchrun_follower()


@pytest.mark.parametrize("argv, message", [
    (["compare", "--eval-only", "x"], "compare trains its own rows"),
    (["compare", "--workers", "2:4"], "give a fixed --workers N"),
    (["--seed", "4294967296"], "--seed must be 0 to 4294967295, got 4294967296"),
    (["--workers", "1:16"], "narrow the range"),
    (["--model", "torchvision.resnet18", "--batch-size", "2"], "cannot train on micro-batches of one sample"),
])
def test_more_input_that_would_fail_after_ray_started_is_one_line(argv, message, tmp_path, no_cluster, capsys):
    command = argv[:1] if argv[:1] == ["compare"] else []
    assert message in error_of([*command, *runs(tmp_path), *DIGITS, *argv[len(command):]], capsys)


@pytest.mark.parametrize("config, message", [
    (None, "its config names no model and data set"),
    ({"model": "lenet"}, "its config names no model and data set"),
    ({"model": "lenet", "dataset": "digits", "image_size": "32"}, "holds image_size = '32'"),
    ({"model": "lenet", "dataset": "mine"}, "--dataset mine is not a dataset of ray_dp"),
])
def test_a_checkpoint_with_an_odd_config_is_one_line(config, message, tmp_path, no_cluster, capsys):
    path = tmp_path / "odd.pt"
    torch.save({"model": {}, "config": config, "epoch": 0, "format": ray_dp.CHECKPOINT_FORMAT}, path)
    assert message in error_of([*runs(tmp_path), "--eval-only", str(path)], capsys)


def test_a_per_sample_data_set_without_class_names_is_one_line():
    class Unnamed(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, index):
            return torch.zeros(1, 4, 4), 0
    with pytest.raises(ray_dp.DataError, match="needs a `classes` attribute"):
        ray_dp.class_names(Unnamed())


def test_weights_by_a_link_is_the_same_file_on_a_rerun(tmp_path, no_cluster):
    weights = tmp_path / "w.pth"
    torch.save(ray_dp.build_model("lenet", (1, 28, 28)).state_dict(), weights)
    (tmp_path / "link.pth").symlink_to(weights)
    save_run(tmp_path / "runs" / "ft", saved=range(1, 3), weights=str(weights))
    _, cfg, options = ray_dp.parse_command([*runs(tmp_path), "--name", "ft", *DIGITS, "--weights",
                                            str(tmp_path / "link.pth")])
    assert options["resume"].done == 2


def test_eval_only_takes_loader_workers(tmp_path, no_cluster):
    run = save_run(tmp_path / "runs" / "r")
    assert ray_dp.parse_command([*runs(tmp_path), "--eval-only", str(run), "--loader-workers", "3"])[1].loader_workers == 3


# Round 4. A folder's list of images is the run's: a resume finds the list its checkpoint trained on, or refuses.

def test_a_folder_run_whose_images_changed_refuses_to_resume_in_one_line(tmp_path, no_cluster, capsys):
    folder = tiny_folder(tmp_path / "images")
    flags = [*runs(tmp_path), "--name", "f", "--dataset", "folder", "--data-dir", str(folder), "--model", "mlp",
             "--batch-size", "4", "--epochs", "3"]
    cfg, info = ray_dp.check_data(ray_dp.parse_command(flags)[1])
    model = ray_dp.build_model("mlp", info.sample_shape, len(info.classes))
    path = tmp_path / "runs" / "f" / ray_dp.checkpoint_dir_name(1) / ray_dp.CHECKPOINT_FILE
    path.parent.mkdir(parents=True)
    torch.save(ray_dp.checkpoint_state(model.state_dict(), {}, 1, cfg, [], info.classes, samples=info.fingerprint),
               path)
    _, cfg, options = ray_dp.parse_command(flags)
    assert options["resume"].samples == info.fingerprint
    ray_dp.check_same_samples(cfg, options["resume"], ray_dp.check_data(cfg)[1])  # the same images: it resumes
    (folder / "train" / "dog" / "3.png").unlink()
    assert error_of(flags, capsys) == (
        f"ray_dp.py: error: run 'f' trained on another list of images than --data-dir {folder} holds now (11 train "
        f"images): restore the folder as it was, or start over with --fresh or a new --name\n")


def test_a_users_own_data_set_with_samples_of_another_shape_or_a_path_root_is_fingerprinted_or_left_alone(tmp_path):
    from torchvision.datasets import ImageFolder
    folder = tiny_folder(tmp_path / "images")
    by_path = ImageFolder(folder / "train")  # torchvision keeps a Path root as it is
    by_text = ImageFolder(str(folder / "train"))
    assert ray_dp.samples_fingerprint(by_path) == ray_dp.samples_fingerprint(by_text) is not None

    class Odd(torch.utils.data.Dataset):
        root, classes, samples = None, ["a"], [1, 2, 3]
    assert ray_dp.samples_fingerprint(Odd()) is None
