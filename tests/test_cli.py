"""Bad input: one clear sentence, exit status 2, no traceback, and no Ray cluster started."""
import subprocess
import sys

import pytest
import torch

import ray_dp
from helpers import DIGIT_NAMES, REPO, digits_folder

DIGITS_INFO = ray_dp.DataInfo((1437, 360), (1, 28, 28), [str(c) for c in range(10)], False)


def a_file(tmp_path):
    path = tmp_path / "not_a_dir"
    path.write_text("x")
    return str(path)


BAD_INPUTS = [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--workers", "abc"], "--workers takes N or MIN:MAX in whole numbers, got 'abc'"),
    (["--workers", "3:2"], "--workers MIN:MAX needs 1 <= MIN <= MAX, got 3:2"),
    (["--workers", "0:2"], "--workers MIN:MAX needs 1 <= MIN <= MAX, got 0:2"),
    (["--workers", "2:x"], "--workers takes N or MIN:MAX in whole numbers, got '2:x'"),
    (["--workers", "2:3", "--batch-size", "64"],
     "at every size --workers 2:3 may take = 6 (the global batch is split evenly into per-worker micro-batches; e.g. 60 or 66)"),
    (["--mode", "dp", "--workers", "1:2"], "--mode dp runs one worker; it cannot be elastic"),
    (["--max-failures", "-2"], "--max-failures must be at least -1, got -2"),
    (["--timeout", "0"], "--timeout must be at least 1, got 0.0"),
    (["--timeout", "0.5"], "--timeout must be at least 1, got 0.5"),
    (["--timeout", "inf"], "--timeout must be at least 1, got inf"),
    (["--start-timeout", "0"], "--start-timeout must be at least 1, got 0.0"),
    (["--name", "x" * 300], "at most 255 bytes"),
    (["--name", " "], "--name must be one directory name"),
    (["--name", "a\nb"], "--name must be one directory name"),
    (["--storage-path", ""], "--storage-path, --logdir and --data-dir cannot be empty"),
    (["--logdir", ""], "--storage-path, --logdir and --data-dir cannot be empty"),
    (["--storage-path", "foo://bar"], "--storage-path foo://bar: "),
    (["--lr", "inf"], "--lr must be a positive number, got inf"),
    (["--lr", "nan"], "--lr must be a positive number, got nan"),
    (["--cpus-per-worker", "inf"], "--cpus-per-worker must be a positive number"),
    (["--workers", "3:"], "--workers takes N or MIN:MAX in whole numbers, got '3:'"),
    (["--workers", ":3"], "--workers takes N or MIN:MAX in whole numbers, got ':3'"),
    (["--name", "../victim"], "--name must be one directory name"),
    (["--name", "/tmp/victim"], "--name must be one directory name"),
    (["--name", "a/b"], "--name must be one directory name"),
    (["--name", "."], "--name must be one directory name"),
    (["--name", ".."], "--name must be one directory name"),
    (["--name", "a\\b"], "--name must be one directory name"),
    (["--storage-path", "{file}"], "is a file, not a directory"),
    (["--storage-path", "{file}/runs"], "is a file, not a directory"),
    (["--logdir", "{file}/tb"], "is a file, not a directory"),
    (["--logdir", "/proc/tb"], "--logdir /proc/tb: /proc is not writable"),
    (["--log-every", "0"], "--log-every must be at least 1"),
    (["--mode", "scratch", "--amp"], "--amp needs --mode ddp (scratch mode: the lesson's plain fp32 code)"),
    (["--dataset", "synthetic", "--synthetic-size", "0"], "--synthetic-size must be at least 1"),
    (["--loader-workers", "-1"], "--loader-workers must be at least 0, got -1"),
    (["--mode", "scratch", "--loader-workers", "2"], "--loader-workers needs --mode ddp"),
    (["--cpus-per-worker", "0"], "--cpus-per-worker must be a positive number"),
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--accum-steps", "0"], "--accum-steps must be at least 1"),
    (["--batch-size", "10", "--workers", "3"], "--batch-size 10 must divide by workers x accum-steps = 3"),
    (["--batch-size", "32", "--workers", "3"], "micro-batches; e.g. 30 or 33)"),
    (["--batch-size", "64", "--workers", "2", "--accum-steps", "3"], "must divide by workers x accum-steps = 6"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--lr", "-0.1"], "--lr must be a positive number"),
    (["--momentum", "1"], "--momentum must be in [0, 1)"),
    (["--model", "vgg"], "--model vgg is not a model of ray_dp; did you mean vgg19"),
    (["--dataset", "imagenet"], "--dataset imagenet is not a dataset of ray_dp (cifar10, digits, fashion-mnist"),
    (["--sync-bn", "--model", "lenet"], "--sync-bn needs a model with BatchNorm"),
    (["--bogus-flag"], "unrecognized arguments: --bogus-flag"),
    (["--dataset", "digits", "--gpu"], "--gpu was given but this machine has no GPU"),
    (["--dataset", "digits", "--workers", "8", "--cpus-per-worker", "1"],
     "8 workers need 8 CPUs and 0 GPUs but the cluster has 2 CPUs"),
    (["--dataset", "digits", "--batch-size", "4096"], "larger than the 1437 training samples"),
    (["--dataset", "fashion-mnist", "--data-dir", "{tmp}"], "could not be downloaded"),
    (["--dataset", "cifar10", "--data-dir", "{tmp}", "--no-download"], "(--no-download): put its files there"),
    (["--dataset", "cifar10", "--data-dir", "{tmp}", "--no-download"],  # where they come from, offline too
     "data_batch_5, test_batch, batches.meta, from https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz)"),
    (["--dataset", "fashion-mnist", "--data-dir", "{tmp}", "--no-download"],
     "t10k-labels-idx1-ubyte, from http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/)"),
    (["--data-dir", "{file}"], "is a file, not a directory"),
    (["--mode", "dp", "--dataset", "digits"], "--mode dp needs CUDA GPUs"),
    (["--mode", "dp", "--workers", "4", "--model", "resnet18"],  # before the data (Fashion-MNIST: no download)
     "--mode dp needs CUDA GPUs (it is nn.DataParallel); this machine has none: use --mode ddp"),
    (["--mode", "dp", "--cpu"], "--mode dp needs CUDA GPUs (it is nn.DataParallel); drop --cpu"),
    (["--mode", "dp", "--model", "resnet18", "--sync-bn"], "nn.DataParallel keeps BatchNorm statistics per GPU"),
    (["--mode", "scratch", "--sync-bn"], "--sync-bn needs --mode ddp"),
    (["--mode", "scratch", "--model", "resnet18"], "--model needs --mode ddp (scratch mode: the lesson's functional LeNet)"),
    (["--mode", "scratch", "--accum-steps", "2"], "--accum-steps needs --mode ddp"),
    (["--mode", "scratch", "--allreduce", "tree"], "argument --allreduce: invalid choice: 'tree'"),
    (["compare", "--workers", "3", "--batch-size", "64"], "--batch-size 64 must divide by workers x accum-steps = 3"),
    (["compare", "--workers", "4", "--dataset", "digits", "--cpus-per-worker", "1"], "4 workers need 4 CPUs"),
]


@pytest.mark.parametrize("argv, message", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_exits_2_with_one_sentence_before_any_cluster(argv, message, no_cluster, tmp_path, capsys):
    argv = [a.format(tmp=tmp_path, file=a_file(tmp_path)) for a in argv]
    command = argv[:1] if argv[:1] == ["compare"] else []
    storage = ["--storage-path", str(tmp_path / "runs")]  # before the row's flags: a row's own path wins
    assert ray_dp.main(command + storage + argv[len(command):]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ray_dp.py: error: ") and err.count("\n") == 1, err
    assert message in err
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.fixture
def run_dir(tmp_path):
    """A run directory with one real (tiny, untrained) checkpoint, as training leaves it."""
    cfg = ray_dp.Config(dataset="digits")
    model = ray_dp.build_model("lenet", (1, 28, 28))
    state = ray_dp.checkpoint_state(model.state_dict(), {}, 1, cfg, [], [str(c) for c in range(10)],
                                    inputs=(1, 28, 28))
    (tmp_path / "run" / "checkpoint_epoch_001").mkdir(parents=True)
    torch.save(state, tmp_path / "run" / "checkpoint_epoch_001" / ray_dp.CHECKPOINT_FILE)
    return tmp_path / "run"


def corrupt_copy(run_dir):
    data = (run_dir / "checkpoint_epoch_001" / ray_dp.CHECKPOINT_FILE).read_bytes()
    path = run_dir.parent / "corrupt.pt"
    path.write_bytes(data[: len(data) // 2])  # a copy cut short, as a crash mid-write would leave it
    return path


def foreign_file(run_dir):
    path = run_dir.parent / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    return path


EVAL_BAD_INPUTS = [
    (lambda d: ["--eval-only", str(d.parent / "nowhere")], "does not exist"),
    (lambda d: ["--eval-only", str(d.parent)], "holds no checkpoint"),
    (lambda d: ["--eval-only", str(corrupt_copy(d))], "is not a readable checkpoint"),
    (lambda d: ["--eval-only", str(foreign_file(d))], "is not a ray-dp checkpoint"),
    (lambda d: ["--eval-only", str(d), "--model", "resnet18"], "--model resnet18 contradicts it"),
    (lambda d: ["--eval-only", str(d), "--dataset", "synthetic"], "--dataset synthetic contradicts it"),
    (lambda d: ["--eval-only", str(d), "--epochs", "3"], "--epochs is a training flag"),
    (lambda d: ["--eval-only", str(d), "--compile"], "--compile is a training flag"),
    (lambda d: ["--eval-only", str(d), "--fresh"], "--fresh is a training flag"),
    (lambda d: ["--eval-only", str(d), "--predict-out", str(d / "checkpoint_epoch_001" / "checkpoint.pt" / "p.csv")],
     "is a file, not a directory"),
    (lambda d: ["--predict-out", str(d / "p.csv")], "--predict-out needs --eval-only"),
    (lambda d: ["--eval-only", str(d), "--predict-out", str(d)], "must name a .csv file"),
    (lambda d: ["--eval-only", str(d), "--predict-out", str(d / "checkpoint_epoch_001" / "checkpoint.pt")],
     "must name a .csv file"),
    (lambda d: ["--eval-only", str(csv_named_checkpoint(d)), "--predict-out", str(csv_named_checkpoint(d))],
     "is the checkpoint being evaluated"),
    (lambda d: ["--eval-only", str(d), "--predict-out", str(d / "dir.csv")], "is a directory"),
    (lambda d: ["--eval-only", str(d), "--predict-out", "/proc/preds/p.csv"],  # root's os.access says yes
     "--predict-out /proc/preds/p.csv: /proc is not writable"),
    (lambda d: ["--eval-only", str(d), "--storage-path", str(d.parent), "--name", d.name],
     "holds a training run, which this command would write over"),
]


def csv_named_checkpoint(run_dir):
    path = run_dir.parent / "model.csv"
    path.write_bytes((run_dir / "checkpoint_epoch_001" / ray_dp.CHECKPOINT_FILE).read_bytes())
    return path


@pytest.mark.parametrize("make_argv, message", EVAL_BAD_INPUTS, ids=[m for _, m in EVAL_BAD_INPUTS])
def test_eval_only_bad_input_is_one_sentence(make_argv, message, run_dir, no_cluster, capsys):
    (run_dir / "dir.csv").mkdir()
    argv = make_argv(run_dir)
    before = snapshot(run_dir.parent)
    assert ray_dp.main(["--storage-path", str(run_dir.parent / "runs"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ray_dp.py: error: ") and err.count("\n") == 1 and message in err, err
    assert snapshot(run_dir.parent) == before  # nothing written, deleted or overwritten


def snapshot(root):
    """Every file under root with its bytes."""
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_eval_only_takes_amp_and_refuses_compile(run_dir):
    # --amp evaluates under bf16 autocast (eval_loop_per_worker); compiling would not pay for one pass.
    command, cfg, _ = ray_dp.parse_command(["--eval-only", str(run_dir), "--amp"])
    assert command == "train" and cfg.eval_only and cfg.amp == "bf16"
    assert ray_dp.parse_command(["--eval-only", str(run_dir), "--amp", "fp16"])[1].amp == "fp16"
    for saved, now in ((True, "bf16"), (False, None)):  # a run from before --amp fp16: --amp was bf16's alone
        state = torch.load(run_dir / "checkpoint_epoch_001" / ray_dp.CHECKPOINT_FILE, weights_only=True)
        assert ray_dp.stored_config({**state, "config": {**state["config"], "amp": saved}})["amp"] == now
    with pytest.raises(ray_dp.ConfigError, match="--compile is a training flag"):
        ray_dp.parse_command(["--eval-only", str(run_dir), "--compile"])


def test_eval_only_takes_model_and_data_from_the_checkpoint(run_dir):
    for path in [run_dir, run_dir / "checkpoint_epoch_001", run_dir / "checkpoint_epoch_001" / "checkpoint.pt"]:
        command, cfg, _ = ray_dp.parse_command(["--eval-only", str(path), "--workers", "3", "--dataset", "digits"])
        assert command == "train" and cfg.eval_only and (cfg.model, cfg.dataset, cfg.workers) == ("lenet", "digits", 3)
        assert cfg.eval_only == str(run_dir / "checkpoint_epoch_001" / "checkpoint.pt")


OWN = f"{REPO}/tests/user_code.py"


@pytest.fixture
def predicting(run_dir):
    """What predict's refusals need beside the digits LeNet run: a run of your TabularMLP on wine, a folder of
    colour images (which the grayscale LeNet cannot take), a folder holding no image, and a file."""
    from PIL import Image
    cfg = ray_dp.with_absolute_paths(ray_dp.Config(model=f"{OWN}:TabularMLP", dataset=f"{OWN}:wine"))
    net = ray_dp.build_model(cfg.model, (13,), 3)
    state = ray_dp.checkpoint_state(net.state_dict(), {}, 1, cfg, [], ["class_0", "class_1", "class_2"])
    (run_dir.parent / "wine" / "checkpoint_epoch_001").mkdir(parents=True)
    torch.save(state, run_dir.parent / "wine" / "checkpoint_epoch_001" / ray_dp.CHECKPOINT_FILE)
    (run_dir.parent / "colour" / "a").mkdir(parents=True)
    Image.new("RGB", (28, 28), (200, 30, 30)).save(run_dir.parent / "colour" / "a" / "red.png")
    (run_dir.parent / "no_images").mkdir()
    (run_dir.parent / "no_images" / "notes.txt").write_text("not an image")
    (run_dir.parent / "colour.py").write_text("import torch\n\n\ndef cifar_like():\n"
                                              "    return torch.utils.data.TensorDataset(torch.rand(4, 3, 32, 32))\n")
    return run_dir


PREDICT_BAD_INPUTS = [
    (lambda d: [str(d.parent / "nowhere"), "--inputs", str(d.parent / "colour")],
     "error: predict {d.parent}/nowhere does not exist"),
    (lambda d: [str(d.parent / "colour"), "--inputs", str(d.parent / "colour")],
     "error: predict {d.parent}/colour holds no checkpoint"),
    (lambda d: [str(d), "--inputs", str(d.parent / "no_images")],
     "error: --inputs {d.parent}/no_images holds no image (.jpg, .jpeg, .png,"),
    (lambda d: [str(d), "--inputs", str(d.parent / "nowhere")],
     "error: --inputs {d.parent}/nowhere is neither a folder nor FILE.py:NAME"),
    (lambda d: [str(d), "--inputs", str(d.parent / "no_images" / "notes.txt")],
     "error: --inputs {d.parent}/no_images/notes.txt: {d.parent}/no_images/notes.txt is a file, not a directory"),
    (lambda d: [str(d), "--inputs", str(d.parent / "colour"), "--out", str(d.parent / "p.txt")],
     "error: --out must name a .csv file, got {d.parent}/p.txt"),
    (lambda d: [str(d), "--inputs", str(d.parent / "colour"), "--out", str(d / "dir.csv")],
     "error: --out {d}/dir.csv is a directory; name a .csv file"),
    (lambda d: [str(d), "--inputs", f"{d.parent}/mine.py:rows"], "error: --inputs {d.parent}/mine.py:rows: there is no "
                                                                   "file {d.parent}/mine.py"),
    (lambda d: [str(d), "--inputs", f"{OWN}:new_wine"], f"error: --inputs {OWN}:new_wine: {OWN} has no new_wine; did "
                                                        f"you mean new_wines?"),
    (lambda d: [str(d), "--inputs", f"{OWN}:wine"], f"error: --inputs {OWN}:wine returned tuple, not a Dataset"),
    (lambda d: [str(d), "--inputs", f"{OWN}:new_wines"], "error: the inputs are (13,) where the run trained on "
                                                         "(1, 28, 28)"),
    (lambda d: [str(d), "--inputs", f"{d.parent}/colour.py:cifar_like"], "error: the inputs are (3, 32, 32) where the "
                                                                         "run trained on (1, 28, 28)"),
    (lambda d: [str(d.parent / "wine"), "--model", f"{OWN}:TabularMLP", "--inputs", str(d.parent / "colour")],
     "error: --inputs {d.parent}/colour: images are read as --dataset folder and the lessons' sets read theirs, and "
     "this run trained on --dataset " + OWN + ":wine: give --inputs FILE.py:NAME returning inputs as it trained on "
     "them"),
    (lambda d: [str(d.parent / "wine"), "--inputs", f"{OWN}:new_wines"],
     f"error: the checkpoint trained your own code: name it again, --model {OWN}:TabularMLP (ray_dp.train(): "),
    (lambda d: [str(d.parent / "wine"), "--model", f"{OWN}:HeadFirstMLP", "--inputs", f"{OWN}:new_wines"],
     f"--model {OWN}:HeadFirstMLP contradicts it (name it again: --model {OWN}:TabularMLP)"),
    (lambda d: [str(d.parent / "wine"), "--model", f"{OWN}:TabularMLP", "--inputs", f"{OWN}:new_patients"],
     f"error: the checkpoint's weights do not fit --model {OWN}:TabularMLP ({OWN} as it is now): size mismatch"),
    (lambda d: [str(d), "--inputs", str(d.parent / "colour"), "--epochs", "3"],
     "error: unrecognized arguments: --epochs 3 (see --help)"),
    (lambda d: [str(d), "--inputs", str(d.parent / "colour"), "--dataset", "digits"],
     "error: unrecognized arguments: --dataset digits (see --help)"),  # named as typed
    (lambda d: [str(d)], "error: the following arguments are required: --inputs, --out (see --help)"),
    (lambda d: [str(d), "--inputs", str(d.parent / "colour"), "--out"], "error: argument --out: expected one argument"),
    (lambda d: [str(d), "--inputs", str(d.parent / "colour"), "--out", ""], "error: --out must name a .csv file, got ''"),
    (lambda d: [str(d), "--inputs", str(d.parent / "colour"), "--out", "/proc/preds/p.csv"],
     "error: --out /proc/preds/p.csv: /proc is not writable"),
]


@pytest.mark.parametrize("make_argv, message", PREDICT_BAD_INPUTS,
                         ids=[message.split(": ", 1)[1][:60] for _, message in PREDICT_BAD_INPUTS])
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # LeNet on tabular inputs, refused
def test_predict_bad_input_is_one_sentence_before_any_cluster(make_argv, message, predicting, no_cluster, capsys):
    (predicting / "dir.csv").mkdir()
    before = snapshot(predicting.parent)
    argv = make_argv(predicting)  # the command line's predict writes its rows: --out is required
    argv += [] if "--out" in argv or len(argv) == 1 else ["--out", str(predicting.parent / "p.csv")]
    assert ray_dp.main(["predict", *argv, "--storage-path", str(predicting.parent / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ray_dp.py: ") and err.count("\n") == 1 and message.format(d=predicting) in err, err
    assert snapshot(predicting.parent) == before  # nothing written


def test_predict_under_torchrun_says_to_run_it_with_python(run_dir, no_cluster, monkeypatch, capsys):
    for name, value in {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    assert ray_dp.main(["predict", str(run_dir), "--inputs", str(run_dir), "--out", "p.csv"]) == 2
    assert capsys.readouterr().err == ("ray_dp.py: error: under torchrun ray_dp trains; run compare and predict with "
                                       "python ray_dp.py, whose Ray workers need no torchrun\n")


def test_predict_reads_your_inputs_alone_and_a_folders_images_in_path_order(run_dir, tmp_path):
    # (input, anything) pairs: the input alone, with a stand-in target; a TensorDataset stays in memory
    cfg = ray_dp.Config(dataset=f"{OWN}:new_patients")
    inputs, keys = ray_dp.predict_inputs(cfg, torch.zeros(2), {"config": {"dataset": "folder"}})
    assert len(inputs) == len(keys) == 89 and keys[:2] == [{"index": 0}, {"index": 1}]
    assert inputs[5][0].shape == (9,) and torch.equal(inputs[5][1], torch.zeros(2))
    inputs, _ = ray_dp.predict_inputs(ray_dp.Config(dataset=f"{OWN}:new_wines"), torch.tensor(0),
                                      {"config": {"dataset": "wine"}})
    assert isinstance(inputs, ray_dp.TensorDataset) and inputs.tensors[1].tolist() == [0] * 36
    # images in any layout, every one under the folder once, sorted by their path; other files left out
    from PIL import Image
    for name in ["b/2.png", "a b/1.jpg", "a/z/3.png", "0.png"]:
        (tmp_path / "new" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (40, 30)).save(tmp_path / "new" / name)
    (tmp_path / "new" / "a" / "notes.txt").write_text("not an image")
    (tmp_path / "new" / "a" / "loop").symlink_to(tmp_path / "new")  # a linked folder is not walked: no input twice
    cfg = ray_dp.Config(dataset="folder", data_dir=str(tmp_path / "new"), image_size=28,
                        normalize=((0.5,) * 3, (0.2,) * 3))
    inputs, keys = ray_dp.predict_inputs(cfg, torch.tensor(0), {"config": {"dataset": "folder"}})
    assert [key["path"] for key in keys] == ["0.png", "a b/1.jpg", "a/z/3.png", "b/2.png"]
    assert inputs[0][0].shape == (3, 28, 28) and inputs[0][0].min() == -2.5  # resized, cropped, normalised


def test_predict_reads_a_folder_of_images_for_a_digits_run_as_its_digits_were_read(tmp_path, capsys):
    # the README's `predict runs/myrun --inputs new_images/` after the offline quick start: PNGs of any size and
    # colour, converted to the run's inputs (1, 28, 28) in [0, 1]; the digits saved as PNGs come back as they were
    folder = digits_folder(tmp_path / "digits", sizes=(0, 40))
    from PIL import Image
    Image.open(sorted((folder / "val").rglob("*.png"))[0]).convert("RGB").resize((56, 56)).save(folder / "big.png")
    cfg = ray_dp.Config(dataset="folder", data_dir=str(folder))
    inputs, keys = ray_dp.predict_inputs(cfg, torch.tensor(0), {"config": {"dataset": "digits"},
                                                                 "inputs": [1, 28, 28]})
    assert "note: --inputs " in capsys.readouterr().out and len(keys) == 41
    by_path = {key["path"]: inputs[i][0] for i, key in enumerate(keys)}
    _, test = ray_dp.load_digits()
    for i, (image, label) in enumerate(zip(test.tensors[0][:40], test.tensors[1][:40].tolist())):
        got = by_path[f"val/{DIGIT_NAMES[label]}/{i:04d}.png"]
        assert got.shape == (1, 28, 28) and (got - image).abs().max() <= 0.5 / 255 + 1e-6
    assert by_path["big.png"].shape == (1, 28, 28)


def test_missing_fashion_mnist_says_how_to_fix(no_cluster, tmp_path, capsys):
    assert ray_dp.main(["--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"put its files there ({tmp_path}/FashionMNIST/raw/ holding " in err and "--dataset digits" in err


def test_real_command_line_bad_input_has_no_traceback():
    proc = subprocess.run([sys.executable, "ray_dp.py", "--workers", "0"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == "ray_dp.py: error: --workers must be at least 1, got 0\n"
    assert "Traceback" not in proc.stdout + proc.stderr


def test_help_documents_every_flag_with_its_default():
    text = " ".join(ray_dp.build_parser().format_help().split())  # as wrapped at any width
    for flag in ["--workers", "--cpus-per-worker", "--gpu", "--cpu", "--epochs", "--batch-size", "--lr",
                 "--accum-steps", "--sync-bn", "--model", "--dataset", "--data-dir", "--seed",
                 "--storage-path", "--name", "--address", "--mode"]:
        assert flag in text
    assert "GLOBAL batch" in text and "(default: 64)" in text


@pytest.mark.parametrize("command", ["train", "compare", "doctor", "predict"])
def test_every_flag_of_every_command_has_help_and_a_training_flag_its_section(command, capsys):
    parser = ray_dp.build_parser(command)
    assert all(action.help for action in parser._actions), [a.dest for a in parser._actions if not a.help]
    sections = [group.title for group in parser._action_groups if group._group_actions]
    assert sections == ["options", *ray_dp.HELP_SECTIONS] or command != "train"  # data, model, ..., output
    named = [name for names in ray_dp.HELP_SECTIONS.values() for name in names]
    assert sorted(named) == sorted(ray_dp.CLI_FIELDS)  # each flag in one section
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out == f"ray_dp {ray_dp.__version__}\n"


def test_address_auto_names_the_cluster_it_attached_to(monkeypatch, capsys):
    from types import SimpleNamespace
    monkeypatch.setattr(ray_dp, "start_ray", lambda *args, **kwargs: None)
    monkeypatch.setattr(ray_dp.ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="10.0.0.5:6379"))
    monkeypatch.setattr(ray_dp, "cluster_of", lambda cfg: ray_dp.Cluster({"CPU": 8.0}, None))
    assert ray_dp.connect(ray_dp.Config(address="auto", gpu=False)).gpu is False
    assert capsys.readouterr().out == "ray-dp: attached to the Ray cluster at 10.0.0.5:6379\n"


def test_a_sigusr1_to_a_command_whose_ranks_do_not_train_says_so_and_the_command_goes_on(no_cluster, capsys):
    import os
    import signal
    before = signal.getsignal(signal.SIGUSR1)
    try:
        assert ray_dp.main(["--workers", "0"]) == 2  # before (or after) its workers train: not SIGUSR1's default
        os.kill(os.getpid(), signal.SIGUSR1)  # which would end the process, result.json unwritten
        assert capsys.readouterr().out == "ray-dp: SIGUSR1: no rank trains now, so none writes its stacks\n"
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_scratch_and_compare_train_the_lessons_recipe_unless_told_otherwise():
    lesson = dict(batch_size=32, lr=0.2, lr_schedule="constant", epochs=20, momentum=0.0)
    for argv in (["--mode", "scratch"], ["compare"]):
        cfg = ray_dp.parse_command(argv)[1]
        assert {k: getattr(cfg, k) for k in lesson} == lesson
    typed = ray_dp.parse_command(["--mode", "scratch", "--lr-schedule", "cosine", "--epochs", "5"])[1]
    assert (typed.lr_schedule, typed.epochs, typed.lr) == ("cosine", 5, 0.2)  # what is typed is kept
    ddp = ray_dp.parse_command([])[1]
    assert (ddp.batch_size, ddp.lr, ddp.lr_schedule, ddp.epochs, ddp.momentum) == (64, 0.05, "cosine", 10, 0.9)
    # compare: every row trains the same global batch and schedule, ddp rows with the lesson's plain SGD
    rows = ray_dp.compare_configs(ray_dp.parse_command(["compare", "--workers", "2"])[1], scale_lr=False)
    assert {(c.batch_size, c.lr, c.lr_schedule, c.epochs, c.momentum) for c in rows} == {(32, 0.2, "constant", 20, 0)}
    header = ray_dp.describe(ray_dp.replace(ray_dp.parse_command(["--mode", "scratch"])[1], gpu=False), DIGITS_INFO)
    assert "global batch 32" in header and "lr 0.2 (constant), plain SGD, " in header and ", 20 epochs" in header


@pytest.mark.parametrize("workers, cpus, message", [
    (8, None, "note: 8 workers share this machine's 2 cores: 0.25 CPU and 1 thread each"),
    (3, None, "note: 3 workers share this machine's 2 cores: 0.6666 CPU and 1 thread each"),
    (2, None, None),  # they fit: one core each, no note
])
def test_more_workers_than_local_cores_share_the_cores(workers, cpus, message, capsys):
    local = ray_dp.Cluster({"CPU": 2}, None)
    cfg = ray_dp.settle_device(ray_dp.Config(workers=workers, batch_size=48, cpus_per_worker=cpus), local)
    assert cfg.cpus_per_worker * workers <= 2 if message else cfg.cpus_per_worker is None
    assert ray_dp.resources_per_worker(cfg)["CPU"] == (cfg.cpus_per_worker or 1.0)
    out = capsys.readouterr().out
    assert (message in out) if message else out == ""


@pytest.mark.parametrize("cfg, cluster", [
    (ray_dp.Config(workers=8, cpus_per_worker=1.0), ray_dp.Cluster({"CPU": 2}, None)),  # typed: kept
    (ray_dp.Config(workers=8, address="10.0.0.1:6379", gpu=False),  # a cluster shares nothing
     ray_dp.Cluster({"CPU": 2}, None)),
    (ray_dp.Config(workers=8, gpu=True), ray_dp.Cluster({"CPU": 16, "GPU": 2}, None)),
])
def test_core_sharing_never_hides_a_request_that_cannot_fit(cfg, cluster):
    with pytest.raises(ray_dp.ConfigError, match="8 workers need"):
        ray_dp.settle_device(cfg, cluster)


def test_help_names_each_value_not_a_word_of_its_flag():
    text = " ".join(ray_dp.build_parser().format_help().split())
    for shown in ["--cpus-per-worker CPUS", "--loader-workers N", "--epochs N", "--timeout SECONDS", "--seed N"]:
        assert shown in text
    assert "WORKER" not in text and "--min-workers" not in text and "--no-quiet" not in text


def summary(mode_loss_acc):
    loss, acc = mode_loss_acc
    return {"final": {"test_acc": acc, "train_loss": loss}, "epochs": [{"train_samples": 1408}] * 10}


def test_a_run_that_ends_at_chance_says_why_and_what_to_try():
    scratch = ray_dp.Config(mode="scratch", batch_size=64, lr=0.05, lr_schedule="cosine")
    note = ray_dp.near_chance(scratch, summary((2.3026, 0.09)))
    assert note.startswith("test acc 0.09 is near chance (1/10 = 0.10): the lesson's init (randn * 0.01) sits")
    assert "this run took 220 at lr 0.05 (cosine)" in note and "or a constant lr of 0.2 to 0.3" in note
    lesson = ray_dp.Config(mode="scratch", batch_size=32, lr=0.2, lr_schedule="constant")
    assert ray_dp.near_chance(lesson, summary((2.3026, 0.09))).endswith(
        "give it more steps (more --epochs, or a smaller --batch-size)")
    assert ray_dp.near_chance(ray_dp.Config(dataset="synthetic"), summary((2.3, 0.1))) is None  # random labels
    assert "lr 5.0 is too large" in ray_dp.near_chance(ray_dp.Config(lr=5.0), summary((float("nan"), 0.1)))
    assert ray_dp.near_chance(ray_dp.Config(), summary((0.1, 0.97))) is None


def test_compare_on_one_worker_trains_one_row_per_mode():
    rows = ray_dp.compare_configs(ray_dp.parse_command(["compare", "--workers", "1"])[1], scale_lr=False)
    assert [c.name for c in rows] == ["ddp-1w", "scratch-naive-1w"]


@pytest.mark.parametrize("address", ["10.0.0.5", "ray://127.0.0.1:10001"])
def test_an_address_without_a_port_is_one_line(address, no_cluster, capsys):
    assert ray_dp.main(["--address", address, "--dataset", "digits"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "give 'auto' or host:port" in err, err


def test_more_workers_than_ray_can_give_a_share_of_the_cores_is_one_line():
    with pytest.raises(ray_dp.ConfigError, match="30000 workers cannot share 2 cores"):
        ray_dp.settle_device(ray_dp.Config(workers=30000, batch_size=30000), ray_dp.Cluster({"CPU": 2}, None))


def test_compares_help_says_which_of_the_flags_it_lists_its_rows_set_or_refuse(tmp_path, no_cluster, capsys):
    with pytest.raises(SystemExit):
        ray_dp.main(["compare", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert ("Its rows set --mode and --allreduce and train the lesson's LeNet with plain SGD in fp32: flags of --mode "
            "ddp alone (--model, --optimizer, --amp, ...) are refused") in said
    for flags in (["--model", "mlp"], ["--optimizer", "adamw"], ["--amp"]):  # refused, in one line each
        assert ray_dp.main(["compare", "--storage-path", str(tmp_path), "--dataset", "digits", *flags]) == 2
        assert capsys.readouterr().err.count("\n") == 1


def test_model_list_from_python_is_one_error_for_train_and_predict_alike():
    for call in (lambda: ray_dp.train(model="list"), lambda: ray_dp.predict("runs/none", "photos/", model="list")):
        with pytest.raises(ray_dp.ConfigError, match=r"model='list' is the command line's listing"):
            call()
