"""Real multi-process jobs on localhost (gloo CPU collectives): equal to one process, checkpoints
across process counts, TF_CONFIG, a killed process, and a run under a real SLURM cluster."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support import slurm_cluster
from support.cli import run_cli, start_cli, wait_until, wrote_metrics
from support.configs import ROOT
from support.in_process import train_here
from support.multiprocess import COMMON, local_job, train_losses

pytestmark = pytest.mark.multiprocess


MLP = ["configs/mnist_mlp.yaml", "train.global_batch_size=32", "model.dropout_rate=0.2"]


GPT = [
    "configs/gpt_small.yaml",
    "data.name=synthetic_text",
    "data.seq_len=16",
    "data.num_examples=256",
    "data.vocab_size=64",
    "model.num_layers=1",
    "model.d_model=32",
    "model.num_heads=2",
    "model.mlp_dim=64",
    "train.global_batch_size=8",
    "optimizer.warmup_steps=2",
]


@pytest.mark.slow
def test_two_processes_match_one_process_and_checkpoints_move_between_process_counts(tmp_path, capsys):
    """The MLP (dropout on) on 2 processes of 2 devices gives one process's losses; the step 4
    checkpoint saved by 2 processes resumes on 1, the one saved by 1 on 2, each with those losses.
    (The one process of 4 devices is this test's own: support/in_process.py.)"""
    config, *overrides = MLP
    args = [*overrides, "train.steps=8", "mesh.data=2", "mesh.fsdp=2", "checkpoint.every_steps=4"]
    two = local_job(tmp_path / "two", config, *args)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "[1] " in two.stdout and "[0] " in two.stdout  # output prefixed by process id
    code, said = train_here(capsys, tmp_path / "one", config, *args)
    assert code == 0, said[-3000:]
    a, expected = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
    assert sorted(a) == list(range(1, 9))
    np.testing.assert_allclose([a[s] for s in sorted(a)], [expected[s] for s in sorted(a)], rtol=1e-5)
    for saved_by in ("two", "one"):  # saved by 2, resumed by 1; and back
        workdir = tmp_path / f"from-{saved_by}"
        shutil.copytree(tmp_path / saved_by / "checkpoints" / "4", workdir / "checkpoints" / "4")
        if saved_by == "two":
            code, said = train_here(capsys, workdir, config, *args)
        else:
            resumed = local_job(workdir, config, *args)
            code, said = resumed.returncode, resumed.stdout + resumed.stderr
        assert code == 0, said[-3000:]
        assert "resuming from step 4" in said
        losses = train_losses(workdir)
        assert sorted(losses) == list(range(5, 9))
        np.testing.assert_allclose([losses[s] for s in range(5, 9)], [expected[s] for s in range(5, 9)], rtol=1e-5)


@pytest.mark.slow
def test_two_processes_match_one_process_on_a_transformer(tmp_path, capsys):
    config, *overrides = GPT
    two = local_job(tmp_path / "two", config, *overrides, "train.steps=8", "mesh.data=2", "mesh.fsdp=2")
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    code, said = train_here(capsys, tmp_path / "one", config, *overrides, "train.steps=8", "mesh.data=2", "mesh.fsdp=2")
    assert code == 0, said[-3000:]
    a, b = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
    assert sorted(a) == list(range(1, 9))
    np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(a)], rtol=1e-5)


@pytest.mark.slow
def test_tf_config_two_workers_train(tmp_path):
    from engine.runtime.launcher import free_port

    port = free_port()
    cluster = {"worker": [f"127.0.0.1:{port}", f"127.0.0.1:{free_port()}"]}
    procs = []
    for index in range(2):
        env = {
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "",
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        }
        args = ["--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "tf"), "train.steps=6", *COMMON]
        procs.append(start_cli(*args, env=env))
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    assert "TF_CONFIG" in outputs[1][1]  # process 1 says how it found the job
    assert sorted(train_losses(tmp_path / "tf")) == list(range(1, 7))
    finals = {out.strip().splitlines()[-1] for out, _ in outputs}
    assert len(finals) == 1 and finals.pop().startswith("done: 6 steps")  # both end with the same eval


def test_tf_config_parameter_server_is_refused(tmp_path):
    env = {
        "TF_CONFIG": json.dumps(
            {"cluster": {"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]}, "task": {"type": "ps", "index": 0}}
        )
    }
    proc = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "ps"), env=env)
    assert proc.returncode == 2 and "sharded over the mesh's fsdp axis" in proc.stderr


def _two_local_processes(workdir, *overrides, stdout=subprocess.PIPE):
    """launch.py training mnist_mlp in two local processes (1 CPU device each), started."""
    args = ["--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), "--local-processes", "2", *overrides]
    return start_cli(*args, stdout=stdout, stderr=stdout)


def _children(pid: int) -> dict[int, str]:
    """This test's own processes: pid → command line of each direct child of `pid` (from /proc)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found[int(entry.name)] = (entry / "cmdline").read_text().replace("\0", " ")
        except OSError:  # it ended while we looked
            continue
    return found


def _running(pid: int) -> bool:
    """Whether `pid` still runs (an orphan that exited may stay a zombie until init reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_killed_process_stops_the_job_within_60_seconds(tmp_path):
    workdir = tmp_path / "kill"
    launcher = _two_local_processes(workdir, "train.steps=1000000", *COMMON)
    workers = {}
    try:
        wait_until(lambda: wrote_metrics(workdir), launcher, 180, poll=0.2)
        workers = _children(launcher.pid)  # the launcher's own workers, not any process on the machine
        (victim,) = [pid for pid, command in workers.items() if "distributed.process_id=1" in command]
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        _, err = launcher.communicate(timeout=90)
        assert time.monotonic() - killed_at < 60
        assert launcher.returncode != 0
        assert "process 1 was killed by signal 9 (SIGKILL)" in err
        assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]  # none left
    finally:  # whatever failed above, nothing this test started keeps running
        for pid in [launcher.pid, *workers]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


def test_unreachable_coordinator_fails_cleanly(tmp_path):
    from engine.runtime.launcher import free_port

    proc = run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(tmp_path / "w"),
        "--coordinator-address",
        f"127.0.0.1:{free_port()}",
        "--num-processes",
        "2",
        "--process-id",
        "1",
        "distributed.initialization_timeout=2",
    )
    assert proc.returncode == 1
    assert "process 1 could not reach the coordinator (process 0)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(
    not slurm_cluster.available(), reason="needs root and Debian's slurm-wlm and munge (.ci/run installs them)"
)
def test_srun_two_processes_found_through_slurm(tmp_path):
    workdir = tmp_path / "slurm"
    with slurm_cluster.SlurmCluster(tmp_path / "cluster") as cluster:
        env = dict(cluster.env, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
        proc = subprocess.run(
            [
                "srun",
                "-n",
                "2",
                "--kill-on-bad-exit=1",
                sys.executable,
                str(ROOT / "launch.py"),
                "--config",
                "configs/mnist_mlp.yaml",
                "--workdir",
                str(workdir),
                "train.steps=6",
                "train.global_batch_size=32",
                *COMMON,
            ],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for index in range(2):  # both processes found the job through SLURM's environment
        assert f"process {index} of 2: joined the job (SLURM); 4 devices in all, 2 here" in proc.stderr
    assert sorted(train_losses(workdir)) == list(range(1, 7))
    assert proc.stdout.count("done: 6 steps") == 2


@pytest.mark.parametrize(
    "extra, sig",
    [
        ([], signal.SIGTERM),
        (["train.steps_per_call=4", "log.every_steps=4", "checkpoint.staging=device"], signal.SIGINT),
    ],
    ids=["one-step-per-call", "four-steps-per-call-device-staging-ctrl-c"],
)
@pytest.mark.slow
def test_sigterm_to_a_multi_process_job_saves_at_one_agreed_step(tmp_path, extra, sig):
    """JAX's preemption sync point agrees on one exact step; with several steps per call every
    step is reported to it, and the stop comes at the end of the call that holds that step.
    Ctrl-C (SIGINT) to the launcher does the same and exits 130 (before: a KeyboardInterrupt
    traceback)."""
    workdir = tmp_path / "preempt"
    launcher = _two_local_processes(workdir, "train.steps=1000000", *COMMON, *extra)
    wait_until(lambda: wrote_metrics(workdir), launcher, 180, poll=0.2)
    launcher.send_signal(sig)
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + sig and "Traceback" not in err, out[-2000:] + err[-2000:]
    saved = [line.split("step ")[-1].split(";")[0] for line in out.splitlines() if "preempted by SIGTERM" in line]
    assert len(saved) == 2 and saved[0] == saved[1]  # both processes saved at the same step
    assert (workdir / "checkpoints" / saved[0]).is_dir()


@pytest.mark.slow
def test_workers_stop_when_their_launcher_is_killed(tmp_path):
    """SIGKILL to the local launcher: its workers (in their own sessions) get SIGTERM from the
    kernel, save at one agreed step and exit, instead of training on unattended."""
    workdir = tmp_path / "orphans"
    launcher = _two_local_processes(
        workdir, "train.steps=1000000", "checkpoint.every_steps=0", *COMMON, stdout=subprocess.DEVNULL
    )
    workers = {}
    try:
        wait_until(lambda: wrote_metrics(workdir), launcher, 180, poll=0.2)
        workers = _children(launcher.pid)
        assert len(workers) == 2
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 60
        while [pid for pid in workers if _running(pid)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [pid for pid in workers if _running(pid)], "workers outlived their launcher by 60 s"
        saved = [int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()]
        assert saved, "the workers stopped without saving"
    finally:
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.nocompile
@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (["train.global_batch_size=13"], "train.global_batch_size=13 is not divisible by data*fsdp*expert=2*1*1=2"),
    ],
    ids=["batch"],  # (the others, in this process: tests/unit/test_elastic_cli_unit.py)
)
def test_a_local_job_s_usage_error_is_one_line_and_exit_2_before_any_process_starts(tmp_path, overrides, reason):
    started = time.monotonic()
    job = run_cli("--config", MLP[0], "--workdir", str(tmp_path / "run"), "--local-processes", "2", *overrides)
    assert job.returncode == 2 and job.stderr.count("\n") == 1, (job.returncode, job.stderr[-2000:])
    assert job.stderr.startswith("error: ") and reason in job.stderr, job.stderr
    assert "[0]" not in job.stdout and not (tmp_path / "run").exists()  # no process started, nothing written
    assert time.monotonic() - started < 30


@pytest.mark.slow
def test_a_process_that_fails_alone_ends_the_job_within_seconds_with_its_reason(tmp_path):
    """Issue 53: a process that failed alone waited 300 s in JAX's shutdown barrier before its launcher
    saw it. Here process 1's part of checkpoint.local_dir cannot be created (a file is in its way)."""
    from engine.checkpoint.local_tier import run_directory

    workdir, local = tmp_path / "run", tmp_path / "shm"
    run_directory(str(local), workdir / "checkpoints").mkdir(parents=True)
    (run_directory(str(local), workdir / "checkpoints") / "process_1").write_text("in the way\n")
    tier = [f"checkpoint.local_dir={local}", "checkpoint.local_every_steps=2", "train.steps=4", *MLP[1:], *COMMON]
    started = time.monotonic()
    job = run_cli("--config", MLP[0], "--workdir", str(workdir), "--local-processes", "2", *tier, timeout=240)
    took = time.monotonic() - started
    assert job.returncode == 2, job.stdout[-3000:] + job.stderr[-3000:]
    assert job.stderr.startswith("error: checkpoint.local_dir=") and "process_1 cannot be created" in job.stderr
    assert job.stderr.count("\n") == 1, job.stderr
    assert took < 90, took  # (JAX's shutdown barrier alone waits 300 s)


@pytest.mark.nocompile
def test_the_launcher_relays_each_line_prefixed_less_gloo_s_connection_lines():
    import io

    from engine.runtime.launcher import _relay

    lines = ["[Gloo] Rank 1 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3\n"] * 3
    lines += ["process 1 of 4: joined the job\n", "error: train.steps=-1 must be positive\n", "[Gloo] a warning\n"]
    sink, said = io.StringIO(), {}
    _relay(1, iter(lines), sink, said)
    assert sink.getvalue() == (
        "[1] process 1 of 4: joined the job\n[1] error: train.steps=-1 must be positive\n[1] [Gloo] a warning\n"
    )
    assert said == {1: "error: train.steps=-1 must be positive\n"}  # (said once by the launcher on a usage error)
