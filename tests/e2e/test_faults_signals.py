"""Faults and abuse, processes: a second job on the same workdir, Ctrl-C and SIGTERM at any
moment (while compiling, inside a log window), a data reader that hangs, a peer that never
starts. Each test checks the engine's answer: one line, the documented exit code, and a run
that resumes as if it had never stopped."""

import os
import time

import pytest
from support.cli import run_cli, start_cli, wait_until, wrote_metrics
from support.configs import QUIET


def _train(workdir, *extra):
    """launch.py training mnist_mlp in workdir, quietly, in a subprocess of 1 CPU device."""
    return start_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), *QUIET, *extra)


@pytest.mark.slow
def test_one_training_job_per_workdir_and_no_stale_lock_after_sigkill(tmp_path):
    workdir = tmp_path / "run"
    first = _train(workdir, "train.steps=1000000", "log.every_steps=10", "checkpoint.every_steps=50")
    wait_until(lambda: wrote_metrics(workdir), first)
    config_before = (workdir / "config.yaml").read_text()
    second = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), "train.steps=7")
    assert second.returncode == 2, second.stderr
    assert f"pid {first.pid}" in second.stderr and "in use by another training job" in second.stderr
    assert "Traceback" not in second.stderr
    assert (workdir / "config.yaml").read_text() == config_before  # the refused run wrote nothing
    first.kill()  # SIGKILL: no chance to clean up
    first.wait()
    third = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "train.steps=100",
        "log.progress=false",
        "log.tensorboard=false",
        "checkpoint.every_steps=50",
        "log.every_steps=10",
    )
    assert third.returncode == 0, third.stderr  # the OS released the lock with the process


def test_ctrl_c_saves_and_exits_130(tmp_path):
    """Before: a KeyboardInterrupt traceback, exit 130 and nothing saved."""
    import signal

    workdir = tmp_path / "run"
    proc = _train(workdir, "train.steps=1000000", "log.every_steps=10", "checkpoint.every_steps=100000")
    wait_until(lambda: wrote_metrics(workdir), proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "stopped by SIGINT: saved a checkpoint at step" in err
    step = int(err.split("saved a checkpoint at step ")[1].split(";")[0])
    assert (workdir / "checkpoints" / str(step)).is_dir()


def test_sigterm_while_compiling_exits_143_with_one_line_and_leaves_nothing(tmp_path):
    """Before: SIGTERM during start-up or restore ended the process by the signal (no 143)."""
    import signal

    workdir = tmp_path / "run"
    proc = _train(workdir)
    wait_until(lambda: (workdir / ".lock").exists(), proc, poll=0.02)  # claimed: compiling now
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err, err
    assert "preempted by SIGTERM while loading data and compiling: nothing new to save" in err
    assert not workdir.exists()  # the workdir it had just made held nothing: removed


def test_a_hung_data_reader_is_named_with_every_threads_stack(tmp_path):
    """No silent wait: a reader blocked forever (here a FIFO no one writes; in life a dead
    network mount) ends the run after watchdog.compile seconds with the stacks on disk."""
    data = tmp_path / "data"
    data.mkdir()
    os.mkfifo(data / "x_train.npy")
    workdir = tmp_path / "run"
    started = time.time()
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "data.name=npz",
        f"data.path={data}",
        "watchdog.compile=3",
        timeout=120,
    )
    assert proc.returncode == 1 and time.time() - started < 60, proc.stderr
    assert "error: no progress for 3s while loading data and compiling (watchdog.compile=3)" in proc.stderr
    (hang,) = workdir.glob("hang-*.txt")
    stacks = hang.read_text()
    assert "in load" in stacks and "engine/data/sources.py" in stacks and "in _watch" in stacks  # every thread


@pytest.mark.slow
def test_a_peer_that_never_starts_ends_the_job_with_one_line_not_sigabrt(tmp_path):
    """Before: process 0 waited the whole initialization timeout, then jaxlib aborted it
    (SIGABRT, exit 134) with a C++ stack."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.time()
    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "run"),
        "--coordinator-address",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        "0",
        "distributed.initialization_timeout=3",  # (seconds waited for the peer)
        timeout=120,
    )
    assert proc.returncode == 1 and time.time() - started < 60, proc.stderr
    assert "error: process 0 of 2: the job did not assemble within 3s" in proc.stderr
    assert "Check failure" not in proc.stderr and "Traceback" not in proc.stderr
