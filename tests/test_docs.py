"""The commands of README.md and docs/*.md as typed (#46): every `python ray_dp.py ...` line of their code blocks
parses; those a reader can run offline on one CPU machine run (in this process, on the shared Ray, with few epochs),
and the rest are checked as far as this machine can (validated, or parsed where they name a bucket, a GPU cluster or
the reader's own files). torchrun's and tensorboard's lines parse, and both programs are installed."""
import dataclasses
import glob
import os
import shlex
import sys
from dataclasses import dataclass

import pytest

import ray_dp
from helpers import REPO, digits_folder

DOCS = [os.path.join(REPO, "README.md"), *sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))]
# What a command needs that this machine has not: the first error parse_command gives for it here
NOT_HERE = {"--mode dp": "--mode dp needs CUDA GPUs",
            "my_models.py": "there is no file",  # the reader's own files
            "runs/RUN": "does not exist",  # the reader's run
            "/data/flowers": "resnet50-11ad3fa6.pth is not a file"}  # the reader's images and weights
# runnable here, and run as typed by another test
RUN_ELSEWHERE = {"compare": "test_ray_e2e.py: compare --workers 2 --dataset digits --epochs 1",
                 "doctor": "test_doctor.py: doctor --workers 2 --dataset digits"}


@dataclass
class Command:
    where: str  # file:line
    launcher: str  # python, torchrun or tensorboard
    before: list  # the launcher's own arguments (torchrun's)
    args: list  # ray_dp.py's (or tensorboard's)

    def __str__(self):
        return f"{self.where}: {self.launcher} {' '.join(self.before + self.args)}"


def shell_commands(path):
    """(line number, command) of each shell line in the file's code blocks: continuation lines joined."""
    lines, block, joined, first = open(path).read().splitlines(), None, "", 0
    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            block = None if block is not None else line[3:].strip()
            continue
        if block in ("bash", "sh"):
            first, joined = first or number, joined + line
            if joined.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            yield first, joined
        joined, first = "", 0


def doc_commands():
    """Every command of the docs that starts ray_dp.py, torchrun or tensorboard, '...' placeholders left out; a
    command inside `ray exec '...'` too."""
    found = []
    for path in DOCS:
        for number, line in shell_commands(path):
            words = shlex.split(line, comments=True)
            inner = [word for word in words if " " in word and "ray_dp.py" in word]  # ray exec '... ray_dp.py ...'
            words = [word for word in (shlex.split(inner[0]) if inner else words) if word != "..."]
            where = f"{os.path.relpath(path, REPO)}:{number}"
            if "ray_dp.py" in words:
                start, end = words.index("ray_dp.py"), len(words)
                end = next((i for i in range(start, end) if words[i] in ("&&", ";", "|")), end)
                launcher = "torchrun" if "torchrun" in words[:start] else "python"
                before = words[words.index("torchrun") + 1:start] if launcher == "torchrun" else []
                found.append(Command(where, launcher, before, words[start + 1:end]))
            elif words[:1] == ["tensorboard"]:
                found.append(Command(where, "tensorboard", [], words[1:]))
    return found


COMMANDS = doc_commands()
SETTINGS = ray_dp.fields_where("rerun", "free")  # flags of how a run runs, not of what it trains


def parsed(command):
    """ray_dp.py's parser's reading of the command (its errors are ConfigError)."""
    name = command.args[0] if command.args[:1] and command.args[0] in ray_dp.COMMANDS else "train"
    return ray_dp.build_parser(name).parse_args(command.args[1:] if command.args[:1] == [name] else command.args)


def test_the_docs_commands_are_found_and_every_one_parses():
    typed = {str(c).split(": ", 1)[1] for c in COMMANDS}
    assert {"python --workers 2 --dataset digits", "torchrun --nproc_per_node 4 --dataset digits",
            "tensorboard --logdir runs/tensorboard"} <= typed
    assert len([c for c in COMMANDS if c.launcher == "python"]) >= 40
    for command in COMMANDS:
        if command.launcher != "tensorboard" and command.args not in (["--help"], ["--model", "list"]):
            parsed(command)


def test_the_flags_a_rerun_may_change_are_listed_as_the_flags_declare_them():
    text = open(os.path.join(REPO, "docs", "fault-tolerance.md")).read()
    listed = text.split("A rerun may change: ", 1)[1].split("\n\n", 1)[0]
    named = {word.strip("`,.").removeprefix("--").replace("-", "_") for word in listed.replace("/", " ").split()
             if word.startswith("`--")}
    named = {{"no_download": "download", "cpu": "gpu"}.get(name, name) for name in named}
    # the commands' own settings (--eval-only, --predict-out), --name and --fresh say which run, not how it trains
    assert named == ray_dp.RERUN_MAY_CHANGE - {"eval_only", "predict_out", "name", "fresh"}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # tensorboard's vendored html5lib, as it is imported
def test_torchrun_and_tensorboard_lines_parse_with_their_own_programs_which_the_venv_installs():
    from tensorboard import program
    from torch.distributed.run import get_args_parser
    bin_dir = os.path.dirname(sys.executable)
    for command in COMMANDS:
        if command.launcher == "torchrun":
            launch = get_args_parser().parse_args([*command.before, "ray_dp.py", *command.args])
            assert launch.training_script == "ray_dp.py" and launch.nproc_per_node, command
        elif command.launcher == "tensorboard":
            program.TensorBoard().configure(argv=[None, *command.args])
    for name in ("torchrun", "tensorboard"):
        assert os.access(os.path.join(bin_dir, name), os.X_OK), f"{name} is not in {bin_dir}"


def runnable(command, cfg):
    """Offline on one CPU machine: no cluster, no GPU, no download, no bucket (predict's new_images/: the test's)."""
    return (command.launcher == "python" and not cfg.address and not cfg.gpu
            and (cfg.dataset not in ("fashion-mnist", "cifar10", "folder") or command.args[0] == "predict"))


def as_run(args, cfg):
    """The command with few epochs and at most 3 workers (the shared Ray holds 4 CPUs)."""
    return [*args, *(["--epochs", "4"] if not cfg.eval_only else []),
            *(["--workers", "2"] if cfg.workers > 3 else [])]


@pytest.mark.ray
@pytest.mark.usefixtures("ray_cluster")
@pytest.mark.timeout(900)
def test_every_ray_dp_command_of_the_docs_runs_or_validates_as_typed(tmp_path, monkeypatch, capsys):
    import hashlib
    import json
    monkeypatch.chdir(tmp_path)  # ./runs, ./data, preds.csv: here
    (tmp_path / "tests").symlink_to(os.path.join(REPO, "tests"))  # tests/user_code.py, as from the repository
    digits_folder(tmp_path / "digits", sizes=(0, 30))  # the README's new_images/: 30 digits as a reader's PNGs
    (tmp_path / "digits" / "val").rename(tmp_path / "new_images")
    def same(cfg):  # what a run trains, or that it evaluates: a command that differs in settings alone (how it
        # runs, which checkpoint of the run it scores) is validated above, not run again
        return {**{k: v for k, v in dataclasses.asdict(cfg).items() if k not in SETTINGS}, "eval": bool(cfg.eval_only)}
    # the quick start, named as the docs' --eval-only lines name it (runs/myrun, with checkpoint_epoch_004)
    quick_start = ["--workers", "2", "--dataset", "digits", "--name", "myrun", "--epochs", "4"]
    ran, problems = [same(ray_dp.parse_command(quick_start)[1])], []
    assert ray_dp.main(quick_start) == 0
    for command in [c for c in COMMANDS if c.launcher == "python"]:
        try:
            if command.args in (["--help"], ["--model", "list"]):  # a listing: it exits 0
                with pytest.raises(SystemExit) as done:
                    ray_dp.main(command.args)
                assert done.value.code == 0
                continue
            if any("://" in arg for arg in command.args):  # a bucket of the reader's: parsed only (above)
                continue
            need = next((NOT_HERE[key] for key in NOT_HERE if key in " ".join(command.args)), None)
            if need:
                with monkeypatch.context() as here, pytest.raises(ray_dp.ConfigError, match=need):
                    here.setattr(ray_dp.ray, "is_initialized", lambda: False)  # a fresh command, Ray not started
                    ray_dp.parse_command(command.args)
                continue
            name, cfg, _ = ray_dp.parse_command(command.args)  # validated: what a run checks before Ray
            if name in RUN_ELSEWHERE or not runnable(command, cfg):
                continue
            _, cfg, _ = ray_dp.parse_command(as_run(command.args, cfg))
            if same(cfg) in ran:
                continue
            ran.append(same(cfg))
            capsys.readouterr()
            assert ray_dp.main(as_run(command.args, cfg)) == 0, capsys.readouterr().err
        except (AssertionError, ray_dp.ConfigError, pytest.fail.Exception) as exc:
            problems.append(f"{command}: {exc}")
    assert not problems, "\n".join(problems)
    print(f"ran {len(ran)} of the docs' commands")
    assert len(ran) >= 5  # the quick start, scratch, your own code twice, --eval-only
    assert (tmp_path / "preds.csv").read_text().startswith("index,label,predicted,probability")
    predicted = (tmp_path / "new.csv").read_text().splitlines()  # predict on the quick start's digits run
    assert predicted[0] == "path,predicted,predicted_name,probability" and len(predicted) == 31
    wine = next(tmp_path.glob("runs/ddp-TabularMLP-wine-*/result.json"))
    code = hashlib.sha256(open(os.path.join(REPO, "tests", "user_code.py"), "rb").read()).hexdigest()[:16]
    assert json.loads(wine.read_text())["code"]["model"]["sha256"] == code
