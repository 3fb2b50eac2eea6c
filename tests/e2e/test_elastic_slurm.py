"""`launch.py train --elastic` inside a SLURM allocation: a job whose task is SIGKILLed goes on as a new
srun step on the task left, from the local tier, with the unbroken run's losses; a smaller job
precompiled as an srun --overlap step (fault.precompile) compiles nothing when it runs; the driver is
refused outside an allocation or without fault.elastic; srun's lines about failed tasks are read."""

import subprocess
import sys

import numpy as np
import pytest
from support import slurm_cluster
from support.cli import child_env, run_cli
from support.configs import ROOT
from support.faults import FaultAt

from engine.runtime.rundir import read_records

STEPS = 8


JOB = [
    "--config",
    "configs/mnist_mlp.yaml",
    f"train.steps={STEPS}",
    "train.global_batch_size=32",  # 2 batch shards on 2 tasks, 1 on 1
    "train.steps_per_call=1",
    "log.every_steps=1",
    "log.progress=false",
    "eval.every_steps=0",
    "eval.max_batches=2",
    "fault.elastic=true",
]


# In an allocation of 2 tasks: the job of 1 task precompiled as the elastic driver does beside a job of 2
# (engine/elastic/srun_steps.py SrunSteps.precompile: an srun --overlap step), then run as a step: argv is
# WORKDIR, then the job's arguments.
PRECOMPILE = """
import os, subprocess, sys, time
from pathlib import Path
from engine.config import load_config
from engine.elastic.precompile import Precompiles
from engine.elastic.srun_steps import SrunSteps
from engine.runtime.launcher import SELF
workdir, job = Path(sys.argv[1]), sys.argv[2:]
args = ["--workdir", str(workdir), *job]
precompiles = Precompiles(args, {1: []}, 1, load_config(job[1], job[2:], str(workdir)), SrunSteps().precompile)
precompiles.start(2)
workdir.mkdir()
(workdir / "metrics.jsonl").touch()  # (the job of 2 has logged: the precompiles begin)
later = time.time() + 1
os.utime(workdir / "metrics.jsonl", (later, later))
precompiles.wait()
(workdir / "metrics.jsonl").unlink()
sys.exit(subprocess.run(["srun", "-n", "1", *SELF, "train", *args, "fault.elastic=false", "train.steps=2"]).returncode)
"""


def records(workdir, split):
    return [r for r in read_records(workdir / "metrics.jsonl") if r["split"] == split]


def losses(workdir):
    return {r["step"]: r["loss"] for r in records(workdir, "train")}


@pytest.mark.multiprocess
@pytest.mark.skipif(
    not slurm_cluster.available(), reason="needs root and Debian's slurm-wlm and munge (.ci/run installs them)"
)
def test_a_killed_task_s_job_goes_on_as_a_new_srun_step_then_grows_back(tmp_path):
    workdir, local = tmp_path / "elastic", tmp_path / "shm"
    tier = [f"checkpoint.local_dir={local}", "checkpoint.local_every_steps=2", "checkpoint.every_steps=6"]
    env = {"JAX_PLATFORMS": "cpu"}
    kill = FaultAt(workdir, 1, 5)  # task 1 SIGKILLed once step 5 is logged
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    try:
        cluster = slurm_cluster.SlurmCluster(tmp_path / "cluster").__enter__()
    except (RuntimeError, subprocess.CalledProcessError) as e:
        pytest.skip(f"the SLURM test cluster did not start: {e}")
    try:
        driver = [sys.executable, str(ROOT / "launch.py"), "train", "--elastic", "--workdir", str(workdir)]
        job = subprocess.run(
            ["salloc", "-n", "2", *driver, *JOB, *tier],
            env=dict(child_env(env), SLURM_CONF=cluster.env["SLURM_CONF"]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        narrow = tmp_path / "narrow"
        precompiled = subprocess.run(
            [
                "salloc",
                "-n",
                "2",
                sys.executable,
                "-c",
                PRECOMPILE,
                str(narrow),
                *JOB,
                "model.hidden_sizes=[96]",
                "fault.precompile=true",
            ],
            env=dict(child_env(env), SLURM_CONF=cluster.env["SLURM_CONF"]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        kill.stop()
        cluster.__exit__(None, None, None)
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    assert "task 1: Killed" in job.stderr
    assert "elastic: restarting the job on 1 processes as a new srun step (restart 1 of" in job.stderr
    (recovery,) = records(workdir, "recovery")
    assert recovery["lost_process"] == 1 and "SIGKILL" in recovery["how"] and recovery["recovered"]
    assert (recovery["processes_before"], recovery["processes_now"], recovery["tier"]) == (2, 1, "local")
    # (the newest local save, or the one before it when the kill came while that save was still in flight)
    assert 0 <= recovery["step_reached"] - recovery["step_restored"] <= 4
    # the node stayed up, so the job of 1 grows back to 2 tasks at its persistent checkpoint of step 6
    (grown,) = records(workdir, "grow")
    assert (grown["processes_before"], grown["processes_now"], grown["step_restored"]) == (1, 2, 6), grown
    assert "elastic: growing back to 2 tasks as a new srun step" in job.stderr
    assert job.stdout.count(f"done: {STEPS} steps") == 2  # (each task of the last step, the grown one, once)
    # fault.precompile: the job of 1 task, dry-run as an srun --overlap step beside a job of 2 (SrunSteps'), then
    # run as a step of its own, compiles nothing (a model of another width: programs the job above never compiled)
    assert precompiled.returncode == 0, precompiled.stdout[-3000:] + precompiled.stderr[-3000:]
    assert "precompile: the 1-process job's programs are in the compilation cache" in precompiled.stderr
    assert "compile time" in (narrow / "precompile-1.log").read_text()
    (summary,) = records(narrow, "summary")
    assert summary["compile_cache_misses"] == 0 and summary["compile_cache_hits"] > 0, summary
    broken = losses(workdir)
    assert sorted(broken) == list(range(1, STEPS + 1))
    # the unbroken run: the same mesh of 2 devices in one process
    one = run_cli(*JOB, "--workdir", str(tmp_path / "unbroken"), env={"XLA_FLAGS": env["XLA_FLAGS"][:-1] + "2"})
    assert one.returncode == 0, one.stderr[-3000:]
    expected = losses(tmp_path / "unbroken")
    assert sorted(expected) == sorted(broken)
    np.testing.assert_allclose([broken[s] for s in sorted(broken)], [expected[s] for s in sorted(broken)], rtol=1e-5)


@pytest.mark.nocompile
def test_the_driver_outside_an_allocation_is_one_line_and_exit_2(tmp_path):
    """(Its other refusals, in this process: tests/unit/test_elastic_cli_unit.py.)"""
    outside = run_cli("train", "--elastic", "--workdir", str(tmp_path / "run"), *JOB, env={"SLURM_JOB_ID": ""})
    assert outside.returncode == 2 and outside.stderr.count("\n") == 1, outside.stderr
    assert outside.stderr.startswith("error: ") and "runs inside a SLURM allocation (an sbatch script" in outside.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
