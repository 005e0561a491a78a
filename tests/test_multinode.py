"""Multi-node: cluster.yaml validated as `ray up` does; a real 2-node Ray cluster on two loopback
addresses; the tutorial's torchrun launch. Each must train exactly like one node with 2 workers."""
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml

import ray_dp
from helpers import REPO, assert_bitwise_equal, assert_ledger_adds_up, final_weights

pytestmark = [pytest.mark.timeout(600)]
BIN = os.path.dirname(sys.executable)
# Batch 8: epochs long enough (179 steps) to lose a node in the middle of one.
RUN = ["--workers", "2", "--dataset", "digits", "--epochs", "2", "--seed", "3", "--batch-size", "8"]


def validate(config):
    from ray.autoscaler._private.util import prepare_config, validate_config
    validate_config(prepare_config(copy.deepcopy(config)))


def test_cluster_yaml_passes_rays_own_validation_and_a_broken_copy_fails():
    with open(os.path.join(REPO, "cluster.yaml")) as f:
        config = yaml.safe_load(f)
    validate(config)
    assert config["provider"]["type"] == "aws"
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token" in c for c in starts if "ray start" in c)  # token auth on every node
    assert "--dashboard-host=127.0.0.1" in " ".join(config["head_start_ray_commands"])
    # A virtual environment on every node (PEP 668 images refuse pip into the system Python), and
    # Ray started from it.
    setup = " ".join(config["setup_commands"])
    assert "python3 -m venv" in setup and "/bin/python -m pip install --quiet -r ~/ray-dp/requirements.txt" in setup
    assert all("ray-dp-venv}/bin/ray " in c for c in starts)
    broken = copy.deepcopy(config)
    del broken["available_node_types"]["gpu_worker"]["node_config"]
    with pytest.raises(Exception, match="node_config"):
        validate(broken)
    broken = copy.deepcopy(config)
    broken["head_node_type"] = "no_such_type"
    with pytest.raises(ValueError, match="head_node_type"):
        validate(broken)


@pytest.fixture(scope="module")
def single_node_result(tmp_path_factory, ray_cluster):
    tmp = tmp_path_factory.mktemp("single")
    assert ray_dp.main([*RUN, "--storage-path", str(tmp), "--name", "single", "--logdir", str(tmp / "tb")]) == 0
    return json.loads((tmp / "single" / "result.json").read_text())


def start_node(args, log, env=None):
    """`ray start --block` in its own process group: stopping the group stops everything it started
    (never `ray stop`, which would stop every Ray on the machine)."""
    return subprocess.Popen([os.path.join(BIN, "ray"), "start", "--block", "--disable-usage-stats", *args],
                            env=env or dict(os.environ, RAY_AUTH_MODE="disabled"), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def stop_node(process):
    for sig, wait in [(signal.SIGTERM, 10), (signal.SIGKILL, 10)]:
        try:
            os.killpg(process.pid, sig)
            process.wait(wait)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def node_ports(base):
    # below the ephemeral ports (32768 on): another test's sockets, run meanwhile on the other pytest-xdist worker,
    # cannot hold them; above Ray's default worker ports (10002-19999: each pytest worker's Ray instance)
    names = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
             "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
    return [arg for i, name in enumerate(names) for arg in (name, str(base + i))] + [
        "--min-worker-port", str(base + 100), "--max-worker-port", str(base + 999)]


class TwoNodes:
    """A head on 127.0.0.3 and a worker node on 127.0.0.4, 1 CPU each: 2 workers land one per node."""

    address = "127.0.0.3:26379"

    def __init__(self, log):
        self.log, self.temp_dirs = log, []
        self.head = start_node(["--head", "--node-ip-address", "127.0.0.3", "--port", "26379", "--num-cpus", "1",
                                "--include-dashboard", "false", "--ray-client-server-port", "26380",
                                *node_ports(21000)], log)
        time.sleep(5)
        self.workers = [self.add_worker_node(23000)]

    def add_worker_node(self, ports):
        # A temp dir of its own, as on a machine of its own: the head's log monitor reads only its session's
        # logs, this node's only these (sharing one, both would forward every line).
        temp_dir = tempfile.mkdtemp(prefix="ray-node-")  # short: Ray's socket paths must stay under 108 bytes
        self.temp_dirs.append(temp_dir)
        return start_node(["--address", self.address, "--node-ip-address", "127.0.0.4", "--num-cpus", "1",
                           "--temp-dir", temp_dir, *node_ports(ports)], self.log)

    def kill_worker_node(self):
        kill_node(self.workers[-1])

    def stop(self):
        stop_nodes([self.head, *self.workers], self.temp_dirs)


def kill_node(node):
    """As if the machine died: every process of the node at once, the training worker included (Ray starts
    workers in sessions of their own, so the node's process group alone would miss them)."""
    for pid in [node.pid, *descendants(node.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    node.wait()


def stop_nodes(nodes, temp_dirs):
    for node in reversed(nodes):
        stop_node(node)
    for temp_dir in temp_dirs:
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture
def two_nodes(tmp_path):
    yield from started(TwoNodes, tmp_path)


def started(cluster, tmp_path):
    log = open(tmp_path / "nodes.log", "w")
    nodes = cluster(log)
    try:
        yield nodes
    finally:
        nodes.stop()
        log.close()


def train_on(nodes, tmp_path, name, *flags, during_epoch_2=None):
    """ray_dp.py attached to the two nodes; during_epoch_2(nodes) runs once epoch 1 is committed."""
    command = [sys.executable, "ray_dp.py", *RUN, "--cpu", "--address", nodes.address, "--storage-path",
               str(tmp_path / "runs"), "--name", name, "--logdir", str(tmp_path / "tb"), *flags]
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    deadline = both_nodes_joined(nodes, env)
    driver = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if during_epoch_2:
        snapshot = tmp_path / "runs" / name / "checkpoint_manager_snapshot.json"
        while not (snapshot.exists() and "checkpoint_epoch_001" in snapshot.read_text()):
            assert driver.poll() is None and time.time() < deadline + 240, "epoch 1 was never committed"
            time.sleep(0.1)
        during_epoch_2(nodes)
    stdout, stderr = driver.communicate(timeout=400)
    assert driver.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stdout + stderr and "Connection reset" not in stdout + stderr  # in ray.log
    return stdout, json.loads((tmp_path / "runs" / name / "result.json").read_text())


def summary_line(stdout):
    return next(line for line in stdout.splitlines() if line.startswith("test acc: "))


def both_nodes_joined(nodes, env):
    """Wait until the worker node has joined (it may still be starting); then a deadline a minute on."""
    deadline = time.time() + 60
    while not ray_nodes_alive(nodes.address, env) == 2:
        assert time.time() < deadline, "the worker node never joined"
        time.sleep(2)
    return deadline


def ray_nodes_alive(address, env, ip=None):
    """How many nodes are alive; with ip, the ID of the one at that address."""
    probe = ("import ray; ray.init(address=%r, logging_level='ERROR'); nodes = [n for n in ray.nodes() if n['Alive']]; "
             "print(len(nodes) if %r is None else [n['NodeID'] for n in nodes if n['NodeManagerAddress'] == %r][0])")
    out = subprocess.run([sys.executable, "-c", probe % (address, ip, ip)], env=env, capture_output=True, text=True,
                         timeout=60)
    return out.stdout.strip() if ip else int(out.stdout.strip() or 0)


@pytest.mark.ray
def test_a_lost_node_is_replaced_and_the_run_resumes_exactly_with_one_line_per_event(tmp_path, two_nodes,
                                                                                    single_node_result):
    def kill_and_replace(nodes):
        nodes.kill_worker_node()
        nodes.workers.append(nodes.add_worker_node(24000))

    stdout, result = train_on(two_nodes, tmp_path, "two-nodes", "--max-failures", "3", during_epoch_2=kill_and_replace)
    events = [line for line in stdout.splitlines() if line.startswith("ray-dp: ") and "epoch 2 of" not in line]
    lost = [line for line in events if line.startswith("ray-dp: lost worker rank")]
    assert len(lost) == 1 and lost[0].endswith(
        "on 127.0.0.4 (its process or node died) during epoch 2; failure 1 (--max-failures: 3 allowed): "
        "restarting the workers from the last checkpoint"), stdout
    assert "ray-dp: 2 workers started on 127.0.0.3, 127.0.0.4" in events
    assert "ray-dp: resuming at epoch 2 of 2 with 2 workers, from the checkpoint of epoch 1" in stdout
    assert re.search(r"on 2 workers \(cpu\)(, replicas alike at all \d+ checks?)?; survived 1 failure, 1 restart "
                     r"\(workers 2 -> 2\), epochs redone: 2$", summary_line(stdout)), summary_line(stdout)
    recovery = result["recovery"]
    assert (recovery["failures"], recovery["restarts"], recovery["epochs_redone"]) == (1, 1, [2])
    assert [size for _, size in recovery["world_sizes"]] == [2, 2]
    # each failed rank's error, kept off the console: a traceback, or the type and text of a collective's error
    logged = (tmp_path / "runs" / "two-nodes" / "ray.log").read_text()
    assert re.search(r"^\S+ \S+ rank \d: (Traceback|[\w.]+(Error|Exception)\b)", logged, re.MULTILINE), logged
    # The same training as without the failure: rank 0 on the head, rank 1 on the (new) other node.
    assert result["node_ranks"] == [0, 1]
    assert result["final"]["test_acc"] == single_node_result["final"]["test_acc"]
    assert_bitwise_equal(final_weights(result), final_weights(single_node_result))
    # Where the README says: checkpoints under --storage-path/--name, events under --logdir/--name.
    assert sorted(p.name for p in (tmp_path / "runs" / "two-nodes").glob("checkpoint_epoch_*")) == [
        "checkpoint_epoch_001", "checkpoint_epoch_002"]
    assert list((tmp_path / "tb" / "two-nodes").glob("events.out.tfevents.*"))


def doctor_on(nodes, tmp_path):
    """`ray_dp.py doctor` attached to the two nodes: its output, once it passed."""
    command = [sys.executable, "ray_dp.py", "doctor", "--address", nodes.address, "--workers", "2", "--cpu",
               "--dataset", "digits", "--storage-path", str(tmp_path / "runs")]
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    both_nodes_joined(nodes, env)
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stdout + done.stderr
    return done.stdout


@pytest.mark.ray
def test_the_doctor_passes_on_two_nodes_and_an_elastic_run_that_loses_one_goes_on_with_the_workers_left(
        tmp_path, two_nodes):
    # (one test, to start the two nodes once)
    doctor = doctor_on(two_nodes, tmp_path)
    assert "ok      versions   2 nodes, the same as the driver's: python " in doctor
    assert "ok      resources  2 nodes, 2 CPUs, 0 GPUs now; no autoscaler configuration found; --workers 2: " \
           "CPU workers (gloo), 1 CPU each" in doctor
    assert f"ok      storage    {tmp_path / 'runs'}: 2 nodes each wrote a marker and each read all 2 back (shared)" \
        in doctor
    workers = re.search(r"ok      workers    2 workers up in [\d.]+ s \(placed, started, gloo process group\); "
                        r"rank 0 on ([\d.]+), rank 1 on ([\d.]+)$", doctor, re.MULTILINE)
    assert workers and set(workers.groups()) == {"127.0.0.3", "127.0.0.4"}, doctor  # one rank on each node
    assert doctor.splitlines()[-1].startswith("doctor: all 6 checks passed in ")

    stdout, result = train_on(two_nodes, tmp_path, "elastic", "--workers", "1:2", "--start-timeout", "10",
                              "--max-failures", "3", during_epoch_2=TwoNodes.kill_worker_node)
    assert "on 127.0.0.4 (its process or node died) during epoch 2; failure 1" in stdout
    assert "ray-dp: resuming at epoch 2 of 2 with 1 worker, from the checkpoint of epoch 1" in stdout
    assert [size for _, size in result["recovery"]["world_sizes"]] == [2, 1]
    assert result["world_size"] == 1 and result["recovery"]["epochs_redone"] == [2]
    # The global batch is kept across the resize: 179 steps of 8 samples, 8 per worker on 1 worker.
    assert [m["train_samples"] for m in result["epochs"]] == [1432, 1432]
    assert summary_line(stdout).endswith("(workers 2 -> 1), epochs redone: 2")
    assert_ledger_adds_up(result["ledger"], failed=1)  # the lost node's time charged to its failure
    assert result["ledger"]["failures"] > 0


@pytest.mark.ray
def test_torchrun_runs_the_same_loop_with_the_same_result(tmp_path, single_node_result):
    proc = subprocess.run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "ray_dp.py", *RUN,
                           "--storage-path", str(tmp_path), "--name", "torchrun", "--logdir", str(tmp_path / "tb")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "torchrun" / "result.json").read_text())
    assert result["world_size"] == 2 and result["node_ranks"] == [0, 0]
    assert [m["test_acc"] for m in result["epochs"]] == [m["test_acc"] for m in single_node_result["epochs"]]
    assert_bitwise_equal(final_weights(result), final_weights(single_node_result))
    assert proc.stdout.count("epoch 1/2:") == 1  # rank 0 prints, the other process does not
    assert_ledger_adds_up(result["ledger"])  # where torchrun's time went: the same ledger as Ray's
    assert list((tmp_path / "tb" / "torchrun").glob("events.out.tfevents.*"))


@pytest.mark.ray
def test_torchrun_killed_mid_epoch_then_sigterm_resumes_from_its_step_checkpoints_bitwise(tmp_path, single_node_result):
    """A torchrun worker killed (SIGKILL) in epoch 2, the same command again, that one stopped by SIGTERM to torchrun
    (what a reclaimed node's processes get), and the same command a third time: the run ends where the
    uninterrupted one does."""
    import psutil
    command = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "ray_dp.py", *RUN, "--storage-path",
               str(tmp_path), "--name", "spot", "--logdir", str(tmp_path / "tb"), "--checkpoint-every", "25"]
    run_dir = tmp_path / "spot"

    def started_then(kill, after):
        """The command until a checkpoint later than `after` appears, then kill(torchrun); what it printed."""
        agent = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.time() + 240
        while not [p for p in run_dir.glob("checkpoint_epoch_*_step_*") if ray_dp.checkpoint_order(p.name) > after]:
            assert agent.poll() is None and time.time() < deadline, "no checkpoint came"
            time.sleep(0.02)
        kill(agent)
        return agent.communicate(timeout=120)[0]

    def kill_rank_1(agent):
        rank_1 = [c for c in psutil.Process(agent.pid).children() if c.environ().get("LOCAL_RANK") == "1"]
        rank_1[0].kill()

    first = started_then(kill_rank_1, after=(1, 0))
    assert "epoch 1/2:" in first and "epoch 2/2:" not in first
    latest = max((p.name for p in run_dir.glob("checkpoint_epoch_*")), key=ray_dp.checkpoint_order)
    assert latest.startswith("checkpoint_epoch_002_step_")
    second = started_then(lambda agent: agent.send_signal(signal.SIGTERM), after=ray_dp.checkpoint_order(latest))
    step = int(latest.rpartition("_")[2])
    assert f"from the checkpoint at epoch 2, step {step}" in second
    assert "ray_dp.py: stopped at epoch 2, step " in second and "(SIGTERM), its checkpoint saved" in second
    third = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert third.returncode == 0, third.stderr[-3000:]
    assert "from the checkpoint at epoch 2, step " in third.stdout
    result = json.loads((run_dir / "result.json").read_text())
    assert [m["train_samples"] for m in result["epochs"]] == [1432, 1432]
    assert_bitwise_equal(final_weights(result), final_weights(single_node_result))
    # the epochs' checkpoints stay, and no mid-epoch one after the last epoch's
    assert sorted(p.name for p in run_dir.glob("checkpoint_epoch_*")) == ["checkpoint_epoch_001",
                                                                         "checkpoint_epoch_002"]


@pytest.fixture
def sshd(tmp_path):
    """An SSH server on 127.0.0.3 and 127.0.0.4 that lets in a throw-away key: the 'machines' of ray up."""
    if not os.path.exists("/usr/sbin/sshd") and not os.environ.get("CI"):
        pytest.skip("needs openssh-server and rsync (.ci/run installs them)")
    for name in ("key", "host_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "key.pub").read_text())
    (tmp_path / "sshd_config").write_text("\n".join([
        "ListenAddress 127.0.0.3", "ListenAddress 127.0.0.4", "Port 22", f"HostKey {tmp_path / 'host_key'}",
        f"AuthorizedKeysFile {tmp_path / 'authorized_keys'}", "PermitRootLogin prohibit-password",
        # cluster.yaml's commands install into and run from $RAY_DP_VENV: here, the tests' own venv.
        f"SetEnv RAY_DP_VENV={os.path.dirname(BIN)}",
        "PasswordAuthentication no", "StrictModes no", "UsePAM no", f"PidFile {tmp_path / 'sshd.pid'}", ""]))
    os.makedirs("/run/sshd", exist_ok=True)
    server = subprocess.Popen(["/usr/sbin/sshd", "-D", "-f", str(tmp_path / "sshd_config"), "-E",
                               str(tmp_path / "sshd.log")])
    time.sleep(1)
    yield str(tmp_path / "key")
    server.kill()
    server.wait()


def local_cluster_config(key):
    """cluster.yaml for the local provider: the shipped file mounts, setup and start commands, adapted only
    where one machine playing two must differ (explicit node IPs and ports, no `ray stop`)."""
    with open(os.path.join(REPO, "cluster.yaml")) as f:
        shipped = yaml.safe_load(f)

    def adapt(commands, ip, extra=""):
        # `ray stop` would stop every Ray on this machine, the test session's own cluster included.
        return [c.replace("6379", "26479") + f" --node-ip-address={ip} --num-cpus=1" + extra
                for c in commands if "ray stop" not in c]
    head = adapt(shipped["head_start_ray_commands"], "127.0.0.3", " --ray-client-server-port=26480")
    # Ray 2.60's local provider starts worker nodes only with the v1 autoscaler (RAY_NOTES.md).
    head = [c.replace("RAY_AUTH_MODE=token", "RAY_enable_autoscaler_v2=0 RAY_AUTH_MODE=token") for c in head]
    return {"cluster_name": "ray-dp-test",
            "provider": {"type": "local", "head_ip": "127.0.0.3", "worker_ips": ["127.0.0.4"]},
            "auth": {"ssh_user": "root", "ssh_private_key": key},
            "file_mounts": shipped["file_mounts"], "rsync_filter": shipped["rsync_filter"],
            "rsync_exclude": shipped["rsync_exclude"],
            "setup_commands": shipped["setup_commands"],
            "head_start_ray_commands": head,
            "worker_start_ray_commands": adapt(shipped["worker_start_ray_commands"], "127.0.0.4")}


def stop_cluster_processes():
    """Stop what ray up started, by process group: the processes that name this test's node addresses."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in processes_naming("127.0.0.3", "127.0.0.4"):
            try:
                group = os.getpgid(pid)
                if group == os.getpgid(0):  # e.g. an ssh control master of `ray up`, in pytest's own group
                    os.kill(pid, sig)
                else:
                    os.killpg(group, sig)  # its group: the workers and agents it started too
            except ProcessLookupError:
                pass
        time.sleep(3)
    assert not processes_naming("127.0.0.3", "127.0.0.4"), "ray up's processes outlived the test"


def descendants(pid):
    """Every process below pid, from /proc's parent links."""
    children = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def processes_naming(*words):
    pids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace")
            if entry.isdigit() and any(word in args for word in words):
                pids.append(int(entry))
        except (OSError, ValueError):
            continue
    return pids


@pytest.mark.ray
def test_ray_up_with_the_shipped_config_trains_on_two_nodes(tmp_path, sshd, single_node_result):
    config_path = tmp_path / "local-cluster.yaml"
    config_path.write_text(yaml.safe_dump(local_cluster_config(sshd)))
    ray = os.path.join(BIN, "ray")
    bootstrap = os.path.expanduser("~/ray_bootstrap_config.yaml")  # ray up writes it on the head: here
    had_bootstrap = os.path.exists(bootstrap)
    try:
        up = subprocess.run([ray, "up", "-y", str(config_path)], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        # No --gpu / --cpu: ray_dp reads the node types from the head's bootstrap config (no GPU types here).
        job = (f"cd ~/ray-dp && RAY_AUTH_MODE=token {sys.executable} ray_dp.py {' '.join(RUN)} "
               f"--address 127.0.0.3:26479 --storage-path {tmp_path}/runs --name via-ray-up --logdir {tmp_path}/tb")
        deadline = time.time() + 120
        while True:  # the autoscaler on the head starts the worker node over SSH; it may still be joining
            run = subprocess.run([ray, "exec", str(config_path), job], cwd=REPO, capture_output=True, text=True,
                                 timeout=300)
            if run.returncode == 0 or time.time() > deadline:
                break
            time.sleep(5)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        result = json.loads((tmp_path / "runs" / "via-ray-up" / "result.json").read_text())
        assert result["node_ranks"] == [0, 1] and result["device"] == "cpu"
        assert_bitwise_equal(final_weights(result), final_weights(single_node_result))
    finally:
        stop_cluster_processes()  # never `ray down`: it runs a bare `ray stop` on the head
        if not had_bootstrap and os.path.exists(bootstrap):
            os.remove(bootstrap)


# A spot node's notice: three loopback nodes with token auth, the one on 127.0.0.34 drained for preemption (Ray's
# notice, as the autoscaler gives a spot node's) and stopped after its deadline.
SLOW = """
import time
from pathlib import Path
import torch.nn as nn

class Slow(nn.Module):
    # An MLP whose training steps take 0.15 s longer (an epoch long enough to reclaim a node in); its 20th
    # step touches MARK (the test drains a node then).

    def __init__(self):
        super().__init__()
        self.net, self.calls = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10)), 0

    def forward(self, x):
        if self.training:
            self.calls += 1
            time.sleep(0.15)
            if self.calls == 20:
                Path(%r).touch()
        return self.net(x)
"""
RECLAIM_S = 15  # the notice's lead: a spot node's is 30 s (GKE) to 120 s (AWS)


def slow_run(tmp_path):
    (tmp_path / "slow.py").write_text(SLOW % str(tmp_path / "step-20"))
    return ["--dataset", "digits", "--epochs", "1", "--seed", "3", "--batch-size", "8", "--model",
            f"{tmp_path}/slow.py:Slow", "--checkpoint-every", "0"]  # nothing but the notice saves within the epoch


@pytest.fixture(scope="module")
def slow_baseline(tmp_path_factory):
    """The same training uninterrupted, under torchrun (bitwise Ray's: test_torchrun_runs_the_same_loop...)."""
    tmp = tmp_path_factory.mktemp("slow")
    proc = subprocess.run([os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "ray_dp.py", *slow_run(tmp),
                           "--storage-path", str(tmp), "--name", "base", "--logdir", str(tmp / "tb")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((tmp / "base" / "result.json").read_text())


class ReclaimedNodes:
    """A head on 127.0.0.33 and a node on 127.0.0.34, 1 CPU each, token auth; a replacement on 127.0.0.35."""

    address = "127.0.0.33:29379"

    def __init__(self, log):
        self.log, self.temp_dirs = log, []
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=os.urandom(16).hex())
        self.head = start_node(["--head", "--node-ip-address", "127.0.0.33", "--port", "29379", "--num-cpus", "1",
                                "--include-dashboard", "false", "--ray-client-server-port", "29380",
                                *node_ports(25000)], log, self.env)
        time.sleep(5)
        self.nodes = {"127.0.0.34": self.add_node("127.0.0.34", 26000)}

    def add_node(self, ip, ports):
        temp_dir = tempfile.mkdtemp(prefix="ray-node-")
        self.temp_dirs.append(temp_dir)
        return start_node(["--address", self.address, "--node-ip-address", ip, "--num-cpus", "1", "--temp-dir",
                           temp_dir, *node_ports(ports)], self.log, self.env)

    def drain(self, ip, seconds):
        """Ray's preemption notice for the node at ip, as the autoscaler gives a spot node's."""
        node_id = ray_nodes_alive(self.address, self.env, ip)
        subprocess.run([os.path.join(BIN, "ray"), "drain-node", "--address", self.address, "--node-id", node_id,
                        "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot",
                        "--deadline-remaining-seconds", str(seconds)], env=self.env, check=True, timeout=60,
                       capture_output=True)

    def kill(self, ip):
        kill_node(self.nodes[ip])

    def stop(self):
        stop_nodes([self.head, *self.nodes.values()], self.temp_dirs)


@pytest.fixture
def reclaimed_nodes(tmp_path):
    yield from started(ReclaimedNodes, tmp_path)


def reclaimed(nodes, tmp_path, name, *flags, replacement=True):
    """ray_dp.py attached to the nodes: at rank 0's 20th step the node on 127.0.0.34 is drained with RECLAIM_S
    seconds' notice (a replacement on 127.0.0.35 joins then), and stopped once its deadline passed."""
    command = [sys.executable, "ray_dp.py", *slow_run(tmp_path), "--cpu", "--address", nodes.address,
               "--storage-path", str(tmp_path / "runs"), "--name", name, "--logdir", str(tmp_path / "tb"), *flags]
    deadline = both_nodes_joined(nodes, nodes.env)
    driver = subprocess.Popen(command, cwd=REPO, env=nodes.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    while not (tmp_path / "step-20").exists():
        assert driver.poll() is None and time.time() < deadline + 240, "training never reached step 20"
        time.sleep(0.1)
    nodes.drain("127.0.0.34", RECLAIM_S)
    drained = time.time()  # the deadline: RECLAIM_S from Ray's drain (the CLI returns once it is set)
    if replacement:
        nodes.nodes["127.0.0.35"] = nodes.add_node("127.0.0.35", 27000)
    time.sleep(max(drained + RECLAIM_S + 1 - time.time(), 0))
    nodes.kill("127.0.0.34")
    stdout, stderr = driver.communicate(timeout=400)
    assert driver.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    return stdout, json.loads((tmp_path / "runs" / name / "result.json").read_text())


@pytest.mark.ray
def test_a_spot_nodes_notice_saves_at_once_and_before_its_deadline_and_the_run_ends_as_if_never_reclaimed(
        tmp_path, reclaimed_nodes, slow_baseline):
    stdout, result = reclaimed(reclaimed_nodes, tmp_path, "spot")
    notice = re.search(r"^ray-dp: node 127\.0\.0\.34 \(rank ([01])\) is being reclaimed by \d\d:\d\d:\d\d: "
                       r"saved epoch 1, step (\d+)$", stdout, re.MULTILINE)  # Ray places the ranks
    assert notice and int(notice[2]) >= 20, stdout
    (event,) = result["recovery"]["preemptions"]
    assert event["nodes"] == {"127.0.0.34": [int(notice[1])]} and event["deadline"] - event["notice_at"] <= RECLAIM_S
    first, last = event["saved"]  # at the notice, and the last before its deadline
    assert first == f"checkpoint_epoch_001_step_{int(notice[2]):06d}" and last > first
    step = int(last.rpartition("_")[2])
    assert (f"resuming at epoch 1 of 1, step {step + 1} of 179, with 2 workers, from the checkpoint at epoch 1, "
            f"step {step}") in stdout
    assert event["steps_redone"] <= 1 and result["recovery"]["steps_redone"] <= 1
    assert re.search(r"; survived 1 preemption, [01] steps? redone$", summary_line(stdout)), summary_line(stdout)
    assert result["recovery"]["failures"] == 0 and [n for _, n in result["recovery"]["world_sizes"]] == [2, 2]
    assert_bitwise_equal(final_weights(result), final_weights(slow_baseline))
    assert_ledger_adds_up(result["ledger"])
    assert result["ledger"]["preemptions"] > 0
    recorded = json.loads((tmp_path / "runs" / "spot" / "recovery.json").read_text())["events"]
    assert [e["event"] for e in recorded] == ["command", "started", "preempted", "started"]


@pytest.mark.ray
def test_without_the_notice_a_reclaimed_node_redoes_the_epoch_so_far(tmp_path, reclaimed_nodes, slow_baseline):
    # (without the notice, the rank whose peer goes first may fail rather than be preempted: --max-failures 1)
    stdout, result = reclaimed(reclaimed_nodes, tmp_path, "ignored", "--no-spot-notices", "--max-failures", "1")
    assert "is being reclaimed" not in stdout and "resuming" not in stdout  # no checkpoint within the epoch
    assert result["recovery"]["steps_redone"] >= 20  # Ray's restart: a preemption or, by a rank's error, a failure
    assert_bitwise_equal(final_weights(result), final_weights(slow_baseline))


@pytest.mark.ray
def test_an_elastic_run_whose_node_is_reclaimed_with_no_replacement_goes_on_with_the_workers_left(
        tmp_path, reclaimed_nodes):
    stdout, result = reclaimed(reclaimed_nodes, tmp_path, "elastic", "--workers", "1:2", replacement=False)
    assert re.search(r"node 127\.0\.0\.34 \(rank [01]\) is being reclaimed by", stdout), stdout
    (event,) = result["recovery"]["preemptions"]
    step = int(event["saved"][-1].rpartition("_")[2])
    assert (f"resuming at epoch 1 of 1, step {step + 1} of 179, with 1 worker, from the checkpoint at epoch 1, "
            f"step {step}") in stdout
    assert [n for _, n in result["recovery"]["world_sizes"]] == [2, 1] and result["recovery"]["steps_redone"] <= 1
    assert result["epochs"][0]["train_samples"] == 1432  # the global batch kept: every sample once
