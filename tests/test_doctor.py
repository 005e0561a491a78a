"""`ray_dp.py doctor`: one line per check, exit 0 only when all pass; every failure that can be
provoked on one machine is provoked (an unreachable address, another torch on a node, storage a
node cannot write or another node cannot see, a rank that never comes to the probe)."""
import os
import re
import shutil
import time

import pytest

import ray_dp
from helpers import run_distributed

CHECKS = ["Ray", "versions", "resources", "storage", "workers", "data"]


def lines_by_check(stdout):
    """{check name: (status, what it says)} from the doctor's output."""
    found = {}
    for line in stdout.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("ok", "FAILED", "skipped"):
            name, _, says = rest.strip().partition(" ")
            found[name] = (status, says.strip())
    return found


def test_an_unreachable_address_fails_the_first_check_and_skips_the_rest(no_cluster, capsys):
    assert ray_dp.main(["doctor", "--address", "127.0.0.9:1"]) == 1
    checks = lines_by_check(capsys.readouterr().out)
    assert list(checks) == CHECKS
    assert checks["Ray"] == ("FAILED", "no Ray cluster answers at 127.0.0.9:1: start one (ray start --head, or "
                                       "ray up cluster.yaml), or drop --address to run on this machine")
    assert {status for status, _ in list(checks.values())[1:]} == {"skipped"}


@pytest.mark.parametrize("flags, message", [
    (["--hang-timeout", "0"], "--hang-timeout must be a number of seconds, at least 1, got 0.0"),
    (["--workers", "0"], "--workers must be at least 1"),
    (["--storage-path", "foo://bar"], None),  # tried on every node, not refused here
])
def test_the_doctors_flags_are_checked_before_any_cluster_starts(no_cluster, flags, message):
    if message is None:
        _, cfg, options = ray_dp.parse_command(["doctor", *flags])
        assert cfg.storage_path == "foo://bar" and options == {"hang_timeout": 30.0}
        return
    with pytest.raises(ray_dp.ConfigError, match=re.escape(message)):
        ray_dp.parse_command(["doctor", *flags])


def test_the_doctor_takes_only_its_own_flags(no_cluster, capsys):
    assert ray_dp.main(["doctor", "--batch-size", "3"]) == 2
    assert capsys.readouterr().err == "ray_dp.py: error: unrecognized arguments: --batch-size 3 (see --help)\n"


def failure(*args):
    """What storage_verdict fails with (its one line)."""
    with pytest.raises(ray_dp.ConfigError) as failed:
        ray_dp.storage_verdict(*args)
    return str(failed.value)


def test_storage_is_shared_only_when_every_node_reads_what_every_node_wrote():
    ids = {"10.0.0.1": "id-a", "10.0.0.2": "id-b"}
    wrote = None  # the node made no directory: the storage path was there
    written = {"10.0.0.1": wrote, "10.0.0.2": wrote}
    shared = ray_dp.storage_verdict("/nfs/runs", written, {"10.0.0.1": ["id-a", "id-b"],
                                                          "10.0.0.2": ["id-b", "id-a"]}, ids)
    assert shared == "/nfs/runs: 2 nodes each wrote a marker and each read all 2 back (shared)"
    local = failure("/home/me/runs", written, {"10.0.0.1": ["id-a"], "10.0.0.2": ["id-b"]}, ids)
    assert local.startswith(
        "node 10.0.0.1 cannot see what node 10.0.0.2 wrote under /home/me/runs: use s3:// or a shared file system")
    # two nodes on one address (containers on one host): told apart by node ID, not by address
    same_host = {"10.0.0.1 (id-a)": "id-a", "10.0.0.1 (id-b)": "id-b"}
    apart = failure("/runs", dict.fromkeys(same_host, wrote),
                    {"10.0.0.1 (id-a)": ["id-a"], "10.0.0.1 (id-b)": ["id-b"]}, same_host)
    assert "cannot see what node 10.0.0.1 (id-b) wrote" in apart
    unwritable = failure("/runs", {"10.0.0.1": wrote, "10.0.0.2": PermissionError("Permission denied")},
                         {"10.0.0.1": ["id-a"], "10.0.0.2": ["id-a"]}, ids)
    assert unwritable.startswith("node 10.0.0.2 cannot write under /runs: PermissionError: Permission denied")
    lost = failure("/runs", {"10.0.0.1": wrote, "10.0.0.2": TimeoutError("no answer within 60 s")}, {}, ids)
    assert lost.startswith("node 10.0.0.2 cannot write under /runs: TimeoutError: no answer within 60 s")


def test_nodes_are_named_by_address_and_by_id_where_two_share_one():
    nodes = [{"NodeManagerAddress": "10.0.0.1", "NodeID": "a" * 56}, {"NodeManagerAddress": "10.0.0.1", "NodeID": "b" * 56},
             {"NodeManagerAddress": "10.0.0.2", "NodeID": "c" * 56}]
    assert ray_dp.node_names(nodes) == {"10.0.0.1 (aaaaaaaa)": "a" * 56, "10.0.0.1 (bbbbbbbb)": "b" * 56,
                                        "10.0.0.2": "c" * 56}


def test_the_doctor_checks_the_most_workers_and_leaves_logs_and_batches_alone(no_cluster, tmp_path, monkeypatch):
    (tmp_path / "runs").write_text("a file where a run would keep its TensorBoard events")
    monkeypatch.chdir(tmp_path)
    _, cfg, options = ray_dp.parse_command(["doctor", "--workers", "1:3"])
    assert (cfg.workers, cfg.min_workers, cfg.processes) == (3, 0, 3)


def test_a_folder_with_a_file_that_is_no_image_fails_the_data_check(tmp_path):
    for split in ("train", "val"):
        (tmp_path / split / "cat").mkdir(parents=True)
        (tmp_path / split / "cat" / "a.png").write_text("not an image")
    cfg = ray_dp.Config(dataset="folder", data_dir=str(tmp_path))
    with pytest.raises(Exception, match="cannot identify image file"):
        ray_dp.data_files(cfg)


def test_a_built_in_data_set_not_yet_on_the_driver_passes_only_when_a_run_may_download_it(tmp_path):
    cfg = ray_dp.Config(dataset="fashion-mnist", data_dir=str(tmp_path))
    doctor = ray_dp.Doctor(cfg, 30)
    try:
        assert doctor.data() == (f"fashion-mnist is not in {tmp_path} yet: a run downloads it there first (not "
                                 f"tried here)")
        doctor.cfg = ray_dp.replace(cfg, download=False)
        with pytest.raises(ray_dp.DataError, match=re.escape(f"FashionMNIST is not in {tmp_path} (--no-download): "
                                                             f"put its files there")):
            doctor.data()
    finally:
        shutil.rmtree(doctor.logs)
    assert os.listdir(tmp_path) == []  # nothing downloaded, nothing left


def rank_1_does_not_come(hang_timeout, answered):
    """On every rank of a gloo group: rank 1 does not come to the doctor's barrier; it waits (to leave the group) until
    rank 0 has answered with what the doctor would say of rank 0's error."""
    from datetime import timedelta

    import torch.distributed as dist
    from ray.train import WorkerGroupError
    if dist.get_rank() == 1:
        while not os.path.exists(answered):
            time.sleep(0.05)
        return "did not come"
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=hang_timeout), wait_all_ranks=True)
    except RuntimeError as exc:
        return ray_dp.probe_failure(WorkerGroupError("a worker failed", {0: exc}), hang_timeout)
    finally:
        if dist.get_rank() == 0:
            open(answered, "w").close()
    return "came"


@pytest.mark.timeout(120)
def test_a_rank_that_does_not_come_is_named_after_the_hang_timeout(tmp_path):
    said = run_distributed(rank_1_does_not_come, 3, 1, str(tmp_path / "answered"))
    assert said[0] == "rank 1 did not come to the first collective within 1 s (--hang-timeout)"


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("ray_cluster")
def test_the_doctor_passes_on_the_local_cluster_and_leaves_nothing_behind(tmp_path, capsys):
    storage = tmp_path / "runs" / "of" / "mine"
    assert ray_dp.main(["doctor", "--workers", "2", "--dataset", "digits", "--storage-path", str(storage)]) == 0
    stdout = capsys.readouterr().out
    checks = lines_by_check(stdout)
    assert list(checks) == CHECKS and {status for status, _ in checks.values()} == {"ok"}, stdout
    import ray
    import torch
    assert f"ray {ray.__version__}, torch {torch.__version__}" in checks["versions"][1]
    assert "--workers 2: CPU workers (gloo), 1 CPU each" in checks["resources"][1]
    assert re.match(r"2 workers up in [\d.]+ s .*; rank 0 on .*, rank 1 on ", checks["workers"][1])
    assert checks["data"][1].startswith("digits: 1437 train / 360 test samples on the driver")
    assert stdout.splitlines()[-1].startswith("doctor: all 6 checks passed in ")
    assert not (tmp_path / "runs").exists()  # the markers are gone, and the directories made for them


@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.usefixtures("ray_cluster")
def test_another_torch_on_a_node_storage_it_cannot_write_and_a_hang_each_fail_with_what_to_do(
        tmp_path, monkeypatch, capsys):
    driver, real_software = os.getpid(), ray_dp.node_software

    def node_with_other_torch():  # a closure: Ray ships it by value to the node
        found = real_software()
        return found if os.getpid() == driver else {**found, "torch": "0.0.0"}

    real_loop = ray_dp.doctor_loop_per_worker

    def rank_1_never_comes(config):
        import torch.distributed as dist
        if dist.get_rank() == 1:
            time.sleep(300)
        return real_loop(config)

    monkeypatch.setattr(ray_dp, "node_software", node_with_other_torch)
    monkeypatch.setattr(ray_dp, "doctor_loop_per_worker", rank_1_never_comes)
    (tmp_path / "a-file").write_text("x")
    blocked = tmp_path / "a-file" / "runs"
    begun = time.time()
    assert ray_dp.main(["doctor", "--workers", "2", "--dataset", "digits", "--storage-path", str(blocked),
                        "--hang-timeout", "3"]) == 1
    stdout = capsys.readouterr().out
    checks = lines_by_check(stdout)
    import torch
    assert checks["versions"][0] == "FAILED" and re.match(
        rf"node [\d.]+ \(.*\) has torch 0.0.0 \(the driver {re.escape(torch.__version__)}\): install "
        rf"requirements.txt into the same Python on every node", checks["versions"][1])
    assert checks["storage"][0] == "FAILED" and checks["storage"][1].startswith("node ")
    assert f"cannot write under {blocked}: " in checks["storage"][1]
    assert checks["workers"] == ("FAILED", "rank 1 did not come to the first collective within 3 s (--hang-timeout); "
                                           "a rank that never answers is most often bound to a network interface "
                                           "the others cannot reach: set GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME) on "
                                           "every node")
    assert checks["Ray"][0] == checks["resources"][0] == checks["data"][0] == "ok"
    last = stdout.splitlines()[-1]
    assert last.startswith("doctor: 3 of 6 checks failed or were skipped") and last.endswith("/ray.log")
    log = last.rpartition(" ")[2]
    assert "failed to pass monitoredBarrier" in open(log).read()  # the workers' tracebacks: in the log
    shutil.rmtree(os.path.dirname(log))
    assert time.time() - begun < 120  # the sleeping rank was not waited for


def test_an_unreachable_address_is_named_as_typed_not_as_ray_reads_it(no_cluster, capsys):
    """Ray reads 127.0.0.1 as this host's own address (192.0.2.2, say): the user typed 127.0.0.1."""
    typed = "no Ray cluster answers at 127.0.0.1:1: start one"
    assert ray_dp.main(["--address", "127.0.0.1:1", "--dataset", "digits"]) == 2
    assert capsys.readouterr().err.startswith(f"ray_dp.py: error: {typed}")
    assert ray_dp.main(["doctor", "--address", "127.0.0.1:1"]) == 1
    assert lines_by_check(capsys.readouterr().out)["Ray"][1].startswith(typed)
