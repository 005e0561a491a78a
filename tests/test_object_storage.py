"""Object storage (#24): data, runs and checkpoints in s3://, against an S3-protocol server that the tests start on
127.0.0.1 (conftest's s3 fixture: moto's server, reached through AWS_ENDPOINT_URL as any S3-compatible store is)."""
import csv
import io
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import ray_dp
from helpers import (DIGIT_NAMES, Distributed, assert_bitwise_equal, digits_folder, error_of, final_weights, keys,
                     new_bucket, run_distributed, save_run, train, train_worker, upload)

# its tests share a module-scoped fixture: under pytest-xdist they run on one worker, which computes it once
XDIST_GROUP = "test_object_storage"
DIGITS = ["--dataset", "digits"]


@pytest.fixture(scope="module")
def unreachable_stores(request):
    """Probes of stores that do not answer, started by the module's first test if its last one (which reads them) is
    selected: each waits seconds for an answer, meanwhile the module's other tests run."""
    from conftest import free_port
    if not any(item.name.startswith("test_s3_unreachable") for item in request.session.items):
        yield None
        return
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with Distributed(refusals_of_unreachable_stores, 2, endpoint, UNREACHABLE_BUCKET) as probes:
        yield endpoint, probes


UNREACHABLE_BUCKET = "ray-dp-tests-no-such-bucket-4611"


def refusals_of_unreachable_stores(endpoint, bucket):
    """Rank 0 with AWS_ENDPOINT_URL where nothing listens, rank 1 without it (AWS, whose name does not resolve here)
    and two flags side by side: what main prints (the environment is a process's). Starting Ray fails."""
    import contextlib
    from concurrent.futures import ThreadPoolExecutor

    import ray

    def refuse(*args, **kwargs):
        raise AssertionError("a Ray cluster was started for bad input")
    ray.init = refuse

    def printed(argv):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            return ray_dp.main(argv), err.getvalue()

    def parsed(argv):
        try:
            ray_dp.parse_command(argv)
        except ray_dp.ConfigError as exc:
            return 2, f"ray_dp.py: error: {exc}\n"
    if dist.get_rank() == 0:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        return [printed([*DIGITS, "--storage-path", "s3://runs/x"])]
    del os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_EC2_METADATA_DISABLED"] = "true"
    with ThreadPoolExecutor(1) as side:
        evaluation = side.submit(parsed, ["--eval-only", f"s3://{bucket}/ray-dp/run"])
        return [printed([*DIGITS, "--storage-path", f"s3://{bucket}/ray-dp"]), evaluation.result()]


@pytest.fixture(scope="module")
def images(s3, tmp_path_factory):
    """The first 256 train and 100 val digits as PNG class folders, on disk and in s3://images/digits/."""
    folder = digits_folder(tmp_path_factory.mktemp("digits"), sizes=(256, 100))
    upload(s3, folder, new_bucket(s3, "images"), "digits")
    return folder


def test_missing_buckets_are_one_line_each_before_any_cluster_starts(s3, images, no_cluster, capsys,
                                                                     unreachable_stores):
    endpoint = f"at {ray_dp.os.environ['AWS_ENDPOINT_URL']} (AWS_ENDPOINT_URL)"
    missing = f"bucket 'missing' does not exist {endpoint}: create it, or check its name and AWS_ENDPOINT_URL"
    for flags in (["--storage-path", "s3://missing/runs"], ["--weights", "s3://missing/w.pth"],
                  ["--eval-only", "s3://missing/runs/q"], ["--dataset", "folder", "--data-dir", "s3://missing/d"],
                  ["doctor", "--dataset", "folder", "--data-dir", "s3://missing/d"]):
        argv = flags if flags[0] == "doctor" else [*DIGITS, *flags]
        assert error_of(argv, capsys) == f"ray_dp.py: error: {' '.join(flags[-2:])}: {missing}\n"
    assert error_of([*DIGITS, "--weights", "s3://images/w.pth"], capsys).endswith(
        "--weights s3://images/w.pth: bucket 'images' holds nothing at 'w.pth'\n")
    assert error_of([*DIGITS, "--data-dir", "s3://images/digits"], capsys).endswith(
        "--data-dir s3://images/digits: only --dataset folder reads its data from object storage; digits is kept "
        "in a local directory\n")
    assert error_of([*DIGITS, "--logdir", "s3://images/tb"], capsys).endswith(
        "--logdir s3://images/tb: a local path, not a URI (only --weights, --data-dir, --storage-path, --eval-only "
        "and --predict-out take one)\n")
    # what ray_dp cannot extend into a run's address (<storage-path>/<name>/...), or would print and record
    changes = "would change what it names (options, fragments and escapes are not taken; say where"
    for uri, problem in [("s3://", "names no bucket (write s3://BUCKET/path)"),
                         ("s3://images//runs", "an empty path component ('//')"),
                         ("s3://images/runs?endpoint_override=x", f"'?' in a URI {changes}"),
                         ("s3://images/runs#x", f"'#' in a URI {changes}"),
                         ("s3://images/a%2Fb", f"'%' in a URI {changes}"),
                         ("s3://key:secret@images/runs", "credentials in a URI would be printed and kept in "
                                                         "result.json")]:
        assert f"--storage-path {uri}: {problem}" in error_of([*DIGITS, "--storage-path", uri], capsys)
    assert error_of([*DIGITS, "--storage-path", "s3://images/runs", "--name", "a#b"], capsys).endswith(
        "--name a#b: '#' would change what the run's URI (s3://images/runs/a#b) names; choose a name without '?', "
        "'#' or '%'\n")


@pytest.mark.parametrize("answer, problem", [
    ("Bucket 'runs' not found", "bucket 'runs' does not exist: create it, or check its name (and for a store other "
                                "than AWS's, set AWS_ENDPOINT_URL)"),
    ("When resolving region for bucket 'runs': AWS Error ACCESS_DENIED during HeadBucket operation: No response body",
     "the store refused access to bucket 'runs' (AWS Error ACCESS_DENIED during HeadBucket operation: No response "
     "body): check the credentials"),
    ("When resolving region for bucket 'runs': AWS Error NETWORK_CONNECTION during HeadBucket operation: curlCode: 6, "
     "Could not resolve hostname; Details: Could not resolve host: runs.s3.us-east-1.amazonaws.com",
     "bucket 'runs' cannot be reached (AWS Error NETWORK_CONNECTION during HeadBucket operation: curlCode: 6, Could "
     "not resolve hostname): check this machine's network (and for a store other than AWS's, set AWS_ENDPOINT_URL)")])
def test_each_answer_of_aws_to_pyarrows_region_request_is_one_line(monkeypatch, answer, problem):
    """What pyarrow raises as it opens s3://runs/x on AWS (arrow's s3fs: the HeadBucket that finds the region)."""
    import pyarrow

    class FileSystem:
        @staticmethod
        def from_uri(uri):
            raise OSError(answer)
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    monkeypatch.setattr(pyarrow.fs, "FileSystem", FileSystem)
    assert ray_dp.store_problem("s3://runs/x", "write").startswith(problem)


def test_a_port_with_403_in_it_is_not_a_refusal(monkeypatch):
    import pyarrow

    class Unreachable:
        def get_file_info(self, path):
            raise OSError("AWS Error NETWORK_CONNECTION during HeadBucket operation: curlCode: 7, Could not connect "
                          "to server http://127.0.0.1:40371")

    class FileSystem:
        @staticmethod
        def from_uri(uri):
            return Unreachable(), "runs/x"
    monkeypatch.setattr(pyarrow.fs, "FileSystem", FileSystem)
    assert "cannot be reached" in ray_dp.store_problem("s3://runs/x", "write")


def test_workers_reach_the_store_the_driver_checked_but_get_no_credentials(monkeypatch):
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    env_vars = ray_dp.fresh_runtime_env()["env_vars"]
    assert env_vars["AWS_ENDPOINT_URL"] == ray_dp.os.environ["AWS_ENDPOINT_URL"] and env_vars["AWS_REGION"] == "eu-west-1"
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & env_vars.keys()


def test_the_doctors_storage_check_names_a_missing_bucket(s3):
    doctor = ray_dp.Doctor(ray_dp.Config(storage_path="s3://missing/runs"), 30)
    try:
        with pytest.raises(ray_dp.ConfigError) as failed:
            doctor.storage()
        assert str(failed.value) == ("--storage-path s3://missing/runs: bucket 'missing' does not exist at "
                                     f"{ray_dp.os.environ['AWS_ENDPOINT_URL']} (AWS_ENDPOINT_URL): "
                                     "create it, or check its name and AWS_ENDPOINT_URL")
    finally:
        shutil.rmtree(doctor.logs)


def test_refused_credentials_are_one_line_naming_the_bucket_and_what_to_check(refusing_s3, no_cluster, capsys):
    refused = (f"the store at {refusing_s3} (AWS_ENDPOINT_URL) refused access to bucket 'data' (AWS Error "
               f"ACCESS_DENIED during HeadBucket operation: No response body): check the credentials this machine "
               f"uses (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or its IAM role) and that they may ")
    assert error_of([*DIGITS, "--storage-path", "s3://data/runs"], capsys) == (
        f"ray_dp.py: error: --storage-path s3://data/runs: {refused}read and write the bucket\n")
    assert error_of(["--dataset", "folder", "--data-dir", "s3://data/images"], capsys) == (
        f"ray_dp.py: error: --data-dir s3://data/images: {refused}read the bucket\n")


def test_a_bucket_folder_is_listed_as_imagefolder_lists_the_same_files(s3, tmp_path):
    from PIL import Image
    from torchvision.datasets import ImageFolder
    # class names that sort differently as paths ("a-b/" < "a/"), a sub-folder, a file that is no image (by its
    # name) and one beside the class folders: ImageFolder's classes, order and samples, object for file
    for path in ["train/a/z.png", "train/a/sub/b.png", "train/a-b/c.png", "train/b/a.png", "train/loose.png"]:
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        Image.new("L", (8, 8), color=len(path)).save(tmp_path / path)
    (tmp_path / "train" / "a" / "notes.txt").write_text("not an image")
    upload(s3, tmp_path, new_bucket(s3, "listing"), "set")
    on_disk = ImageFolder(str(tmp_path / "train"))
    stored = ray_dp.StoredImageFolder("s3://listing/set/train", lambda image: image, "s3://listing/set")
    assert stored.classes == on_disk.classes == ["a", "a-b", "b"] and stored.class_to_idx == on_disk.class_to_idx
    assert [(path.replace("s3://listing/set", str(tmp_path)), c) for path, c in stored.samples] == on_disk.samples
    assert stored.targets == on_disk.targets
    assert [image.tobytes() for image, _ in stored.__getitems__([0, 3])] == [
        on_disk[i][0].tobytes() for i in (0, 3)]
    (tmp_path / "train" / "c").mkdir()
    (tmp_path / "train" / "c" / "notes.txt").write_text("a class with no image")
    upload(s3, tmp_path, "listing", "set")
    with pytest.raises(FileNotFoundError) as on_disk_error:
        ImageFolder(str(tmp_path / "train"))
    with pytest.raises(FileNotFoundError, match="^" + ray_dp.re.escape(str(on_disk_error.value)) + "$"):
        ray_dp.StoredImageFolder("s3://listing/set/train", None, "s3://listing/set")


def test_a_run_in_a_bucket_resumes_and_fresh_deletes_its_prefix_and_nothing_beside_it(s3, tmp_path, no_cluster,
                                                                                      capsys):
    run = save_run(tmp_path / "q", saved=(1, 2))  # as torchrun leaves a run: no snapshot of Ray's
    upload(s3, run, new_bucket(s3, "runs"), "mine/q")
    beside = ["mine/q-notes.txt", "mine/q10/result.json", "other/q/result.json"]
    for key in beside:
        s3.put_object(Bucket="runs", Key=key, Body=b"{}")
    argv = [*DIGITS, "--storage-path", "s3://runs/mine", "--name", "q", "--epochs", "3"]
    _, cfg, options = ray_dp.parse_command(argv)
    assert options["resume"].done == 2  # from its last checkpoint, found by listing the bucket
    _, cfg, options = ray_dp.parse_command([*argv, "--fresh"])
    capsys.readouterr()
    ray_dp.start_fresh(cfg)
    assert capsys.readouterr().out == "--fresh: deleted s3://runs/mine/q; starting run 'q' over\n"
    # nothing beside it deleted; pyarrow keeps the storage path visible with an empty "directory" object
    assert keys(s3, "runs") == sorted([*beside, "mine/"])


def test_fresh_deletes_no_weights_and_no_data_that_a_run_holds(s3, tmp_path, no_cluster, capsys):
    upload(s3, save_run(tmp_path / "t1", saved=(1, 2)), new_bucket(s3, "fresh"), "runs/t1")
    before = keys(s3, "fresh")
    weights = "s3://fresh/runs/t1/checkpoint_epoch_002/checkpoint.pt"
    assert error_of([*DIGITS, "--storage-path", "s3://fresh/runs", "--name", "t1", "--fresh", "--weights",
                     weights], capsys).endswith(f"--fresh: s3://fresh/runs/t1 holds --weights {weights}; not deleting it\n")
    assert keys(s3, "fresh") == before
    local = save_run(tmp_path / "runs" / "r9", saved=(1,))  # a file:// URI of a folder in a local run
    digits_folder(local / "data", sizes=(20, 10))
    assert error_of(["--storage-path", str(tmp_path / "runs"), "--name", "r9", "--fresh", "--dataset", "folder",
                     "--data-dir", f"file://{local}/data"], capsys).endswith(
        f"--fresh: {local} holds --data-dir file://{local}/data; not deleting it\n")
    assert (local / "data" / "train").is_dir()


def lists_on_rank_0_only(data_dir):
    """On each of torchrun's ranks: the bucket's images as worker_data hands them; rank 1 cannot list."""
    worker = ray_dp.Worker(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    if worker.rank == 1:
        ray_dp.load_dataset = lambda cfg: (_ for _ in ()).throw(AssertionError("rank 1 listed the bucket"))
    cfg = ray_dp.Config(dataset="folder", data_dir=data_dir)
    train_set, val_set, _ = ray_dp.worker_data(cfg, ray_dp.LoopOptions(torchrun=True), worker)
    return train_set.samples, len(val_set)


def test_under_torchrun_rank_0_lists_a_bucket_for_every_rank(s3, images):
    ranks = run_distributed(lists_on_rank_0_only, 2, "s3://images/digits")
    assert ranks[0] == ranks[1] and len(ranks[0][0]) == 256 and ranks[0][1] == 100


def test_an_object_that_is_no_image_is_named_by_its_uri(s3, tmp_path):
    (tmp_path / "train" / "cat").mkdir(parents=True)
    (tmp_path / "train" / "cat" / "a.png").write_text("not an image")
    upload(s3, tmp_path, new_bucket(s3, "broken"), "set")
    data = ray_dp.StoredImageFolder("s3://broken/set/train", lambda image: image, "s3://broken/set")
    with pytest.raises(ray_dp.DataError) as error:
        data[0]
    assert str(error.value) == ("s3://broken/set/train/cat/a.png is not a readable image (cannot identify image "
                                "file): remove or replace it in s3://broken/set/train/cat/ (and any other such file "
                                "in --data-dir s3://broken/set)")


def test_every_path_to_a_checkpoint_takes_a_uri(s3, tmp_path):
    run = save_run(tmp_path / "q", saved=(1, 2))
    upload(s3, run, new_bucket(s3, "checkpoints"), "runs/q")
    last = "s3://checkpoints/runs/q/checkpoint_epoch_002/checkpoint.pt"
    assert ray_dp.epoch_checkpoints("s3://checkpoints/runs/q") == [last.replace("002", "001"), last]
    for path in ("s3://checkpoints/runs/q", "s3://checkpoints/runs/q/checkpoint_epoch_002", last):
        assert ray_dp.checkpoint_file(path) == last  # --eval-only: a run, a checkpoint directory, a file
    weights = ray_dp.read_weights(last)  # --weights
    assert_bitwise_equal(weights, torch.load(run / "checkpoint_epoch_002" / "checkpoint.pt")["model"])
    with pytest.raises(ray_dp.ConfigError, match=r"^--eval-only s3://checkpoints/runs holds no checkpoint "):
        ray_dp.checkpoint_file("s3://checkpoints/runs")


def torchrun_saves_and_resumes(storage):
    """On each of torchrun's ranks: rank 0 saves a checkpoint into the bucket; then every rank resumes from it."""
    worker = ray_dp.Worker(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    cfg = ray_dp.Config(dataset="digits", name="q", storage_path=storage)
    launcher = ray_dp.TorchrunLauncher(cfg, worker)
    before = launcher.latest_checkpoint()
    if worker.is_main:
        ray_dp.save_checkpoint(cfg.run_dir, {**before, "epoch": 3}, 3)
    dist.barrier()
    return before["epoch"], launcher.latest_checkpoint()["epoch"]


def test_torchrun_keeps_and_resumes_its_checkpoints_in_a_bucket(s3, tmp_path):
    upload(s3, save_run(tmp_path / "q", saved=(1, 2)), new_bucket(s3, "torchrun"), "runs/q")
    assert run_distributed(torchrun_saves_and_resumes, 2, "s3://torchrun/runs") == [(2, 3), (2, 3)]
    assert keys(s3, "torchrun", "runs/q/checkpoint_epoch_003/") == ["runs/q/checkpoint_epoch_003/checkpoint.pt"]


def torchrun_trains_12_epochs(storage):
    """ray_dp's worker loop on this rank as torchrun runs it (rank 0 keeps the checkpoints), 12 epochs keeping 2."""
    cfg = ray_dp.Config(dataset="synthetic", synthetic_size=48, batch_size=12, epochs=12, lr=0.2, quiet=True,
                        name="kept", storage_path=storage, keep_checkpoints=2, checkpoint_every="2", workers=2,
                        logdir=storage if not ray_dp.is_uri(storage) else "/tmp/unused-tb")
    worker = ray_dp.Worker(dist.get_rank(), dist.get_world_size(), torch.device("cpu"))
    ray_dp.ray.train.report = lambda metrics, **_: None  # no Ray Train session in this test's processes
    launcher = ray_dp.TorchrunLauncher(cfg, worker)
    launcher.tensorboard = None
    history = train_worker(cfg, worker, launcher, ray_dp.LoopOptions(torchrun=True), {})["history"]
    best = ray_dp.load_checkpoint(f"{cfg.run_dir}/{ray_dp.BEST_CHECKPOINT}")
    _, test = ray_dp.load_dataset(cfg)
    net = ray_dp.build_model(cfg.model, ray_dp.input_shape(cfg, test), 10)
    net.load_state_dict(best["model"])
    return history, best["epoch"], ray_dp.evaluate(net.eval(), test, torch.device("cpu"))


@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_12_epochs_keeping_2_hold_the_latest_2_and_the_best_which_scores_as_its_epoch_did(s3, tmp_path, where):
    storage = str(tmp_path) if where == "disk" else f"s3://{new_bucket(s3, 'kept')}/runs"
    (history, best_epoch, scores), _ = run_distributed(torchrun_trains_12_epochs, 2, storage)
    names = (sorted(p.name for p in (tmp_path / "kept").iterdir()) if where == "disk"
             else sorted({key.split("/")[2] for key in keys(s3, "kept", "runs/kept/")} - {""}))  # "": the prefix
    assert names == ["checkpoint_best", "checkpoint_epoch_011", "checkpoint_epoch_012"]
    best = ray_dp.best_epoch(history, "test_loss")
    assert best_epoch == best["epoch"] < 11 and best["test_loss"] == min(e["test_loss"] for e in history)
    assert (scores["test_loss"], scores["test_acc"]) == pytest.approx((best["test_loss"], best["test_acc"]), abs=1e-6)


def test_predictions_and_compares_tables_go_into_a_bucket(s3):
    new_bucket(s3, "outputs")
    data = ray_dp.NamedTensors(torch.zeros(2, 1, 1, 1), torch.tensor([0, 1]), classes=["cat", "dog"])
    ray_dp.write_predictions("s3://outputs/eval/preds.csv", data, [(1, 0.75), (1, 0.5)], ["cat", "dog"])
    body = s3.get_object(Bucket="outputs", Key="eval/preds.csv")["Body"].read().decode()
    assert [row["predicted_name"] for row in csv.DictReader(io.StringIO(body))] == ["dog", "dog"]
    rows = ray_dp.compare_rows([ray_dp.Config(name="ddp-1w", workers=1)],
                               [{"sec_per_epoch": 1.0, "samples_per_second": 100, "final": {"test_acc": 0.5}}])
    table = ray_dp.write_compare("s3://outputs/compare", rows)
    assert keys(s3, "outputs", "compare/") == ["compare/compare.csv", "compare/compare.md"]
    assert s3.get_object(Bucket="outputs", Key="compare/compare.md")["Body"].read().decode() == table + "\n"


@pytest.mark.ray
@pytest.mark.timeout(600)
@pytest.mark.usefixtures("ray_cluster")
def test_a_bucket_trains_resumes_and_evaluates_exactly_as_the_same_folder_on_disk(s3, images, tmp_path, capsys):
    flags = ["--workers", "2", "--dataset", "folder", "--batch-size", "64", "--lr", "0.05", "--loader-workers", "1"]
    local = train(tmp_path, "local", *flags, "--data-dir", str(images), "--epochs", "2")
    runs = f"s3://{new_bucket(s3, 'training')}/runs"
    for epochs in ("1", "2"):  # stopped after its first epoch, then resumed by the same command
        assert ray_dp.main([*flags, "--data-dir", "s3://images/digits", "--storage-path", runs, "--name", "q",
                            "--logdir", str(tmp_path / "tb"), "--epochs", epochs, "--keep-checkpoints", "1"]) == 0
    out = capsys.readouterr().out
    assert "resuming at epoch 2 of 2 with 2 workers, from the checkpoint of epoch 1" in out
    stored = json.loads(s3.get_object(Bucket="training", Key="runs/q/result.json")["Body"].read())
    best = stored["best"]
    assert out.splitlines()[-1].startswith(
        f"wrote {runs}/q/result.json and checkpoint_epoch_002, checkpoint_best (epoch {best['epoch']}, test_loss "
        f"{best['value']:.4g}) beside it")
    assert stored["checkpoint"] == f"{runs}/q/checkpoint_epoch_002/checkpoint.pt"
    # --keep-checkpoints 1: Ray deleted epoch 1's once epoch 2's was committed, and lists what the bucket holds
    held = {key.rsplit("/", 2)[1] for key in keys(s3, "training", "runs/q/") if key.endswith("/checkpoint.pt")}
    assert held == {"checkpoint_epoch_002", "checkpoint_best"}
    listed = ray_dp.ray_snapshot(f"{runs}/q")["checkpoint_results"]
    assert [entry["checkpoint_dir_name"] for entry in listed] == ["checkpoint_epoch_002"]
    # the same images, statistics, order and augmentation: the same model, to the bit
    assert stored["config"]["normalize"] == local["config"]["normalize"]
    assert_bitwise_equal(ray_dp.load_checkpoint(stored["checkpoint"])["model"], final_weights(local))
    assert stored["final"]["test_acc"] == local["final"]["test_acc"] and stored["final"]["test_count"] == 100

    predictions = tmp_path / "predictions.csv"
    assert ray_dp.main(["--eval-only", f"{runs}/q", "--workers", "3", "--storage-path", runs, "--name", "evaluated",
                        "--predict-out", str(predictions)]) == 0
    evaluated = json.loads(s3.get_object(Bucket="training", Key="runs/evaluated/result.json")["Body"].read())
    assert evaluated["checkpoint"] == best["checkpoint"]  # a run's best
    scored = stored["epochs"][best["epoch"] - 1]
    assert (evaluated["final"]["test_acc"], evaluated["world_size"]) == (scored["test_acc"], 3)
    assert evaluated["final"]["test_loss"] == pytest.approx(scored["test_loss"], abs=1e-6)
    with open(predictions) as f:
        rows = list(csv.DictReader(f))
    val = sorted(f"s3://images/{key}" for key in keys(s3, "images", "digits/val/"))
    assert sorted(row["path"] for row in rows) == val and len(val) == 100  # each val object once, by its URI
    assert all(row["path"].split("/")[-2] == row["label_name"] in DIGIT_NAMES for row in rows)
    assert sum(row["label"] == row["predicted"] for row in rows) / 100 == evaluated["final"]["test_acc"]


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("ray_cluster")
def test_the_doctor_passes_against_the_bucket_and_leaves_nothing_in_it(s3, images, capsys):
    from test_doctor import lines_by_check
    new_bucket(s3, "doctor")
    assert ray_dp.main(["doctor", "--workers", "2", "--storage-path", "s3://doctor/runs", "--dataset", "folder",
                        "--data-dir", "s3://images/digits"]) == 0
    checks = lines_by_check(capsys.readouterr().out)
    assert {status for status, _ in checks.values()} == {"ok"}, checks
    assert checks["storage"][1] == "s3://doctor/runs: the node wrote a marker and read it back"
    assert checks["data"][1] == ("folder s3://images/digits: 256 train / 100 val images in 10 classes, the same on "
                                 "every node")
    assert keys(s3, "doctor") == []  # not even the storage path's own "directory"


def test_s3_unreachable_at_its_endpoint_or_on_aws_is_one_line_naming_the_bucket_and_what_to_check(unreachable_stores):
    """Without AWS_ENDPOINT_URL, pyarrow asks AWS for the bucket's region as it opens the URI: here that fails at DNS,
    elsewhere AWS answers that the bucket is missing or refused. (The module's last test: its probes have waited
    meanwhile.)"""
    endpoint, probes = unreachable_stores
    [there], aws = probes.join()
    assert there == (2, f"ray_dp.py: error: --storage-path s3://runs/x: bucket 'runs' at {endpoint} (AWS_ENDPOINT_URL) "
                        f"cannot be reached (AWS Error NETWORK_CONNECTION during HeadBucket operation: curlCode: 7, "
                        f"Could not connect to server): check that the store runs there\n")
    bucket = UNREACHABLE_BUCKET
    for flag, (status, err) in zip(("--storage-path", "--eval-only"), aws):
        assert status == 2 and err.count("\n") == 1, err
        assert err.startswith(f"ray_dp.py: error: {flag} s3://{bucket}/ray-dp") and f"bucket '{bucket}'" in err
        assert err.rstrip().endswith(("(and for a store other than AWS's, set AWS_ENDPOINT_URL)",
                                      "read the bucket", "read and write the bucket")), err
