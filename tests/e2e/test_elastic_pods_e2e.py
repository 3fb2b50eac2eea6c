"""fault.elastic on Kubernetes (`launch.py train --rendezvous DIR`): three supervisors stand in for
three pods on this machine; one pod's death (its supervisor and process SIGKILLed) leaves a job of
two with the unbroken run's losses, and the pod's return grows it back to three. The rendezvous
forms rounds of the live ready members, led by the lowest; the leader's accounting records the
lost processes, refuses to go on past the limits, and ends a job whose every process failed on its own."""

import os
import signal
import subprocess
import time

import pytest
from support.cli import run_cli, start_cli
from support.elastic import JOB, assert_unbroken_losses, records
from support.faults import FaultAt

from engine.elastic.pods import STOPPED
from engine.elastic.rendezvous import Rendezvous

PODS = 3


DEVICES = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}


def pod(tmp_path, k: int, env: dict) -> subprocess.Popen:
    """Pod k's supervisor (its own process group, as a pod's processes are), its output to pod-k.log."""
    flags = ["--rendezvous", str(tmp_path / "rendezvous"), "--processes", str(PODS), "--member", f"pod-{k}"]
    flags += ["--member-address", "127.0.0.1", "--devices-per-process", "2"]
    args = ["train", *flags, "--config", JOB[0], "--workdir", str(tmp_path / "elastic"), *JOB[1:]]
    log = open(tmp_path / f"pod-{k}.log", "a")
    return start_cli(
        *args, "checkpoint.every_steps=4", env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_for(ready, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not ready():
        assert time.time() < deadline, "not ready in time"
        time.sleep(0.1)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lost_pod_s_job_goes_on_with_the_others_then_grows_back_when_it_returns(tmp_path):
    env = DEVICES
    workdir = tmp_path / "elastic"
    stop = FaultAt(workdir, 1, 5, sig=signal.SIGSTOP)  # pod-1's process stops at step 5 of round 0; then its pod dies
    pods = [pod(tmp_path, k, env) for k in range(PODS)]
    workdir, view = tmp_path / "elastic", Rendezvous(tmp_path / "rendezvous", "test", "", PODS)
    try:
        wait_for(stop.done.is_set)
        os.killpg(pods[1].pid, signal.SIGKILL)  # the pod's death: its supervisor, and its process with it
        wait_for(lambda: view.round(1) is not None)
        pods.append(pod(tmp_path, 1, env))  # the pod comes back (as a Job's restartPolicy brings it)
        codes = [p.wait(timeout=240) for p in pods]
    finally:
        stop.stop()
        for p in pods:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    logs = {k: (tmp_path / f"pod-{k}.log").read_text() for k in range(PODS)}
    assert codes == [0, -9, 0, 0], logs
    assert view.round(1)["members"] == ["pod-0", "pod-2"]
    assert view.round(2)["members"] == ["pod-0", "pod-1", "pod-2"]
    # (pod-0's supervisor stops its process on seeing pod-1's heartbeat stop, unless the process, its
    # collective broken by the lost peer, ended first: either way pod-0 goes on in round 1)
    assert "elastic: pod pod-0: joining round 1" in logs[0], logs[0][-3000:]
    assert "pod-1 ready; asked the job to grow back" in logs[0]
    (recovery,) = records(workdir, "recovery")
    assert (recovery["lost_process"], recovery["how"], recovery["recovered"]) == (1, STOPPED, True), recovery
    assert (recovery["processes_before"], recovery["processes_now"], recovery["attempt"]) == (3, 2, 0), recovery
    assert recovery["step_restored"] <= recovery["step_reached"] and recovery["seconds_lost"] > 0
    (grown,) = records(workdir, "grow")
    assert (grown["processes_before"], grown["processes_now"], grown["tier"]) == (2, 3, "persistent"), grown
    # the job of two stopped at a persistent checkpoint it saved once pod-1 was back: its first, or
    # its second when pod-1's new supervisor started slowly (whether the job of three committed step
    # 4 before its process hung at step 5 or not)
    assert grown["step_restored"] in (recovery["step_restored"] + 4, recovery["step_restored"] + 8), (recovery, grown)
    assert_unbroken_losses(workdir, tmp_path / "unbroken")


@pytest.mark.nocompile
def test_a_rendezvous_directory_a_pod_cannot_use_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "rendezvous").write_text("a file\n")
    flags = ["--rendezvous", str(tmp_path / "rendezvous"), "--processes", "2", "--member", "pod-0"]
    args = ["train", *flags, "--member-address", "127.0.0.1", "--devices-per-process", "2", "--config", *JOB]
    job = run_cli(*args, "--workdir", str(tmp_path / "run"), "checkpoint.every_steps=4")
    assert job.returncode == 2 and job.stderr.count("\n") == 1, job.stderr[-2000:]
    assert job.stderr.startswith("error: --rendezvous ") and "not a directory this pod can use" in job.stderr
