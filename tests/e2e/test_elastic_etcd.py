"""fault.elastic on Kubernetes with `--rendezvous etcd://HOST:PORT/PREFIX`: two supervisors stand in
for two pods on this machine and meet through a real etcd server (tests/support/etcd_server.py);
one pod's death (its supervisor and process SIGKILLed from outside once the step 4 checkpoint
is committed) leaves a job of one that finishes from the newest checkpoint, its loss recorded."""

import os
import signal
import subprocess
import time

import pytest
from support.cli import start_cli
from support.elastic import JOB, records
from support.etcd_server import etcd_server  # noqa: F401 (a fixture)

from engine.elastic.rendezvous import Rendezvous

STEPS = 40  # (steps of ~0.1 s: the pod dies while the job runs, well after its step 4 checkpoint)
DEVICES = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def pod(tmp_path, k: int, rendezvous: str) -> subprocess.Popen:
    """Pod k's supervisor (its own process group, as a pod's processes are), its output to pod-k.log."""
    flags = ["--rendezvous", rendezvous, "--processes", "2", "--member", f"pod-{k}"]
    flags += ["--member-address", "127.0.0.1", "--devices-per-process", "2"]
    args = ["train", *flags, "--config", JOB[0], "--workdir", str(tmp_path / "elastic"), *JOB[1:]]
    log = open(tmp_path / f"pod-{k}.log", "a")
    return start_cli(
        *args,
        f"train.steps={STEPS}",
        "checkpoint.every_steps=4",
        env=DEVICES,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pods_meeting_through_etcd_go_on_without_a_lost_one(tmp_path, etcd_server):  # noqa: F811
    rendezvous = f"etcd://{etcd_server}/jobs/mnist"
    pods = [pod(tmp_path, k, rendezvous) for k in range(2)]
    workdir = tmp_path / "elastic"
    try:
        deadline = time.time() + 180
        while not (workdir / "checkpoints" / "4").is_dir():  # (committed: orbax renames it into place)
            assert time.time() < deadline and all(p.poll() is None for p in pods), "step 4 not saved"
            time.sleep(0.1)
        os.killpg(pods[1].pid, signal.SIGKILL)  # the pod's death: its supervisor, and its process with it
        codes = [p.wait(timeout=240) for p in pods]
    finally:
        for p in pods:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = {k: (tmp_path / f"pod-{k}.log").read_text() for k in range(2)}
    assert codes == [0, -9], logs
    view = Rendezvous(rendezvous, "test", "", 2)  # the rounds as etcd holds them
    assert view.round(0)["members"] == ["pod-0", "pod-1"] and view.round(1)["members"] == ["pod-0"]
    (recovery,) = records(workdir, "recovery")
    assert (recovery["lost_process"], recovery["processes_before"], recovery["processes_now"]) == (1, 2, 1)
    assert recovery["recovered"] and 4 <= recovery["step_restored"] < STEPS, recovery
    assert sorted({r["step"] for r in records(workdir, "train")}) == list(range(1, STEPS + 1))
