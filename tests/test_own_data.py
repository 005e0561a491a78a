"""Your own data and model, checked without Ray: an image folder and what is wrong with one, any
torchvision model by name, --weights, and the optimiser knobs against a single-process reference."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ray_dp
from helpers import here, DIGIT_NAMES, digits_folder, random_images, run_distributed

CPU = torch.device("cpu")
# its tests share a module-scoped fixture: under pytest-xdist they run on one worker, which computes it once
XDIST_GROUP = "test_own_data"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return digits_folder(tmp_path_factory.mktemp("images"))


def config(folder, **fields):
    return ray_dp.Config(dataset="folder", data_dir=str(folder), **fields)


def test_a_folder_reads_its_classes_and_images_like_torchvision(folder):
    train, val = ray_dp.load_dataset(config(folder, augment=False))
    assert ray_dp.class_names(train) == sorted(DIGIT_NAMES) and (len(train), len(val)) == (1437, 360)
    assert train[0][0].shape == (3, 28, 28)  # RGB (ImageFolder's loader), lenet's 28 pixels
    cfg, info = ray_dp.check_data(config(folder, augment=False))
    mean, std = cfg.normalize  # the data's own statistics, computed once here
    assert len(mean) == len(std) == 3 and 0.2 < mean[0] < 0.4 and info.per_sample
    normalised = ray_dp.load_dataset(cfg)[1][0][0]
    assert abs(normalised.mean().item()) < 1.5  # no longer in [0, 1]
    sized = ray_dp.load_dataset(config(folder, image_size=20, model="mlp"))[0]
    assert sized[0][0].shape == (3, 20, 20)


def broken(folder, tmp_path, kind):
    import shutil
    root = tmp_path / kind
    # hard links: the tests remove, rename and add files, never write into one (a copy costs 0.1-1 s of CPU)
    shutil.copytree(folder, root, copy_function=os.link)
    if kind == "no-val":
        shutil.rmtree(root / "val")
    elif kind == "empty-class":
        for f in (root / "train" / "nine").iterdir():
            f.unlink()
    elif kind == "other-classes":
        (root / "val" / "nine").rename(root / "val" / "ten")
    return root


@pytest.mark.parametrize("kind, message", [
    ("no-val", "--dataset folder needs"),
    ("empty-class", "Found no valid file for the classes nine"),
    ("other-classes", "train/ and val/ must hold the same classes; only in train/: ['nine'], only in val/: ['ten']"),
])
def test_a_folder_that_is_not_train_and_val_of_the_same_classes_is_one_line(kind, message, folder, tmp_path,
                                                                            no_cluster, capsys):
    root = broken(folder, tmp_path, kind)
    assert ray_dp.main(["--dataset", "folder", "--data-dir", str(root), "--storage-path", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ray_dp.py: error: ") and err.count("\n") == 1 and message in err, err


def test_files_that_are_not_images_are_left_out_by_their_extension(folder, tmp_path):
    root = broken(folder, tmp_path, "as-is")
    (root / "train" / "one" / "notes.txt").write_text("not an image")
    assert len(ray_dp.load_dataset(config(root))[0]) == 1437


def test_any_torchvision_model_by_name_takes_the_datas_channels_and_classes():
    net = ray_dp.build_model("efficientnet_b0", (1, 32, 32), 7)
    assert net(torch.zeros(2, 1, 32, 32)).shape == (2, 7)
    assert ray_dp.has_batchnorm("mobilenet_v3_small") and not ray_dp.has_batchnorm("lenet")


def test_model_list_shows_ray_dps_and_torchvisions_models(capsys):
    with pytest.raises(SystemExit) as done:  # as --help does
        ray_dp.main(["--model", "list"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("ray_dp: lenet resnet18 mlp\n") and " resnet50 " in out and "vit_b_16" in out


def test_weights_keep_what_fits_and_say_what_is_new(tmp_path):
    imagenet_like = ray_dp.build_model("torchvision.resnet18", (3, 224, 224), 1000)  # ImageNet's shapes
    torch.save(imagenet_like.state_dict(), tmp_path / "resnet18.pth")
    info = ray_dp.DataInfo((100, 10), (3, 64, 64), [str(c) for c in range(5)], True)
    cfg = ray_dp.Config(model="torchvision.resnet18", weights=str(tmp_path / "resnet18.pth"))
    assert ray_dp.check_weights(cfg, info).endswith("new (fine-tuned from scratch): fc.weight, fc.bias")
    fine_tuned = ray_dp.build_model("torchvision.resnet18", (3, 64, 64), 5)
    kept, new = ray_dp.load_weights(fine_tuned, ray_dp.read_weights(cfg.weights))
    assert new == ["fc.weight", "fc.bias"]
    assert all(torch.equal(fine_tuned.state_dict()[k], imagenet_like.state_dict()[k]) for k in kept)
    # the normalisation is ImageNet's, as ImageNet weights expect
    assert ray_dp.with_data_statistics(cfg, object()).normalize == ray_dp.IMAGENET_STATISTICS


@pytest.mark.parametrize("argv, message", [
    (["--model", "lenet", "--weights", "{resnet}"], "does not fit lenet: none of its"),
    (["--weights", "{notes}"], "is not a state_dict torch can load safely"),
    (["--weights", "{missing}"], "is not a file"),
    (["--image-size", "0"], "--image-size must be at least 1, got 0"),
    (["--model", "lenet", "--image-size", "8"], "--image-size 8 is too small for lenet"),
    (["--model", "mobilenet_v2x"], "did you mean mobilenet_v2"),
    (["--optimizer", "adam"], "--optimizer adam is not an optimizer of ray_dp; did you mean adamw?"),
    (["--warmup-epochs", "10"], "--warmup-epochs must be 0 to --epochs - 1 = 9"),
    (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1)"),
    (["--mode", "scratch", "--weight-decay", "0.1"], "--weight-decay needs --mode ddp (scratch mode: the lesson's plain SGD)"),
    (["--mode", "scratch", "--dataset", "folder"], "--dataset folder needs --mode ddp"),
])
def test_bad_own_data_and_model_flags_are_one_line(argv, message, tmp_path, no_cluster, capsys):
    if "{resnet}" in argv:  # (an 11M-parameter model to build and write: only where it is read)
        torch.save(ray_dp.build_model("resnet18", (1, 28, 28)).state_dict(), tmp_path / "resnet.pth")
    (tmp_path / "notes.pth").write_text("not a tensor file")
    paths = dict(resnet=tmp_path / "resnet.pth", notes=tmp_path / "notes.pth", missing=tmp_path / "none.pth")
    argv = [a.format(**paths) for a in argv]
    assert ray_dp.main(["--dataset", "digits", "--storage-path", str(tmp_path / "runs"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ray_dp.py: error: ") and err.count("\n") == 1 and message in err, err


def test_warm_up_rises_linearly_to_the_peak_then_follows_the_schedule():
    cfg = ray_dp.Config(lr=0.4, warmup_epochs=3, epochs=7, lr_schedule="cosine")
    assert [round(ray_dp.learning_rate(cfg, e), 6) for e in range(7)] == [0.1, 0.2, 0.3, 0.4, 0.341421, 0.2, 0.058579]


KNOBS = dict(model="lenet", batch_size=16, lr=0.05, seed=3, momentum=0.9, weight_decay=0.1,
             warmup_epochs=1, epochs=3, clip_grad_norm=0.05, label_smoothing=0.1)


def ddp_steps_with_knobs(fields, data):
    torch.set_default_dtype(torch.float64)  # this rank's process alone
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = ray_dp.Config(**fields, workers=world)
    torch.manual_seed(cfg.seed)
    model = ray_dp.wrap_model(ray_dp.build_model("lenet", (1, 28, 28)), CPU)
    optimizer = ray_dp.build_optimizer(cfg, model)
    batches = ray_dp.train_batches(data, cfg, rank, world, CPU)
    for epoch in range(2):  # a warm-up epoch, then the peak
        ray_dp.train_epoch(model, optimizer, batches, cfg, here(), epoch, ray_dp.Operations(cfg, here()))
    return [p.detach().clone() for p in ray_dp.unwrap(model).parameters()]


def reference_steps_with_knobs(fields, data, world):
    """One process, written out: SGD or AdamW with decay on weights only, the warm-up lr, label
    smoothing, the gradient of the whole global batch clipped, each step's samples all ranks' slices."""
    cfg = ray_dp.Config(**fields, workers=world)
    torch.manual_seed(cfg.seed)
    model = ray_dp.build_model("lenet", (1, 28, 28))
    weights = [p for p in model.parameters() if p.ndim > 1]
    others = [p for p in model.parameters() if p.ndim <= 1]
    groups = [{"params": weights, "weight_decay": 0.1}, {"params": others, "weight_decay": 0}]
    optimizer = (torch.optim.AdamW(groups, lr=0.05) if cfg.optimizer == "adamw" else
                 torch.optim.SGD(groups, lr=0.05, momentum=0.9))
    images, labels = data.tensors
    per_rank = cfg.batch_size // world
    for epoch, lr in enumerate([0.05 / 2, 0.05]):  # warm-up epoch 1 of 1: lr x 1/2
        for group in optimizer.param_groups:
            group["lr"] = lr
        shards = []
        for r in range(world):
            sampler = ray_dp.train_sampler(data, r, world, cfg.seed)
            sampler.set_epoch(epoch)
            shards.append(list(sampler))
        for step in range(len(shards[0]) // per_rank):
            index = torch.tensor([i for shard in shards for i in shard[step * per_rank:(step + 1) * per_rank]])
            optimizer.zero_grad()
            F.cross_entropy(model(images[index]), labels[index], label_smoothing=0.1).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            optimizer.step()
    return [p.detach() for p in model.parameters()]


# In fp64: Adam divides by the root of the squared gradients' average, so where a gradient is ~0 the fp32
# rounding of a 2-worker mean against a 1-process one moved a few of 25,000 weights by up to 1.1e-4 (measured);
# in fp64 that rounding is ~1e-16, and the bound tells it from a wrong step.
@pytest.mark.parametrize("optimizer, tolerance", [("sgd", 1e-9), ("adamw", 1e-9)])
def test_optimizer_knobs_on_2_workers_equal_one_process_written_out(optimizer, tolerance):
    images, labels = random_images(48).tensors
    data = ray_dp.TensorDataset(images.double(), labels)
    knobs = {**KNOBS, "optimizer": optimizer}
    ranks = run_distributed(ddp_steps_with_knobs, 2, knobs, data)
    torch.set_default_dtype(torch.float64)
    try:
        expected = reference_steps_with_knobs(knobs, data, 2)
        torch.manual_seed(KNOBS["seed"])
        initial = ray_dp.build_model("lenet", (1, 28, 28)).parameters()
    finally:
        torch.set_default_dtype(torch.float32)
    assert max((a - b.detach()).abs().max() for a, b in zip(ranks[0], initial)) > 1e-3  # they moved
    for got in ranks:
        for g, want in zip(got, expected):
            torch.testing.assert_close(g, want, rtol=1e-5, atol=tolerance)


def test_a_registered_data_set_of_image_files_is_sized_normalised_and_augmented_as_a_folder_is(folder):
    from torchvision.datasets import ImageFolder

    @ray_dp.dataset("my-images", per_sample=True, image_files=True)
    def my_images(cfg):  # ImageFolders as a user makes them: no transforms of ray_dp's
        return tuple(ImageFolder(os.path.join(cfg.data_dir, split)) for split in ("train", "val"))
    try:
        cfg, info = ray_dp.check_data(ray_dp.replace(config(folder), dataset="my-images"))
        assert cfg.normalize is not None and info.sample_shape == (3, 28, 28)  # its own statistics, as a folder's
        mine = ray_dp.loaded(cfg)  # what every rank loads: the same transforms, with those statistics
        theirs = ray_dp.loaded(ray_dp.replace(cfg, dataset="folder"))
        assert [repr(split.transform) for split in mine] == [repr(split.transform) for split in theirs]
        assert cfg.normalize == ray_dp.check_data(config(folder))[0].normalize
    finally:
        del ray_dp.DATASETS["my-images"]


def test_the_gpus_fast_path_keeps_a_data_sets_class_names():
    train, test = ray_dp.load_digits()
    moved = ray_dp.cuda_fast_paths(ray_dp.Config(dataset="digits"), (train, test, None), torch.device("cpu"))
    assert moved[0].classes == train.classes and moved[1].classes == test.classes and moved[2] is None
    assert torch.equal(moved[0].tensors[0], train.tensors[0])
