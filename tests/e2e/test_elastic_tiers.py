"""fault.elastic's recoveries by kind: a hung process ended by its watchdog, and the smaller job
precompiled in the background (fault.precompile: local processes, and pods' shares). (A lost
host's local tier, the peer's copy then the persistent tier, is test_elastic.py's killed-process
test; the SLURM steps' precompile is test_elastic_slurm.py's.)"""

import os
import time

import pytest
from support.cli import child_env, run_cli
from support.elastic import JOB, local_job, records
from support.faults import HANG, INJECT, FaultAt

from engine.config import load_config
from engine.elastic.pods import PodDryRun
from engine.elastic.precompile import Precompiles, local_dry_run
from engine.runtime.launcher import distributed_args, free_port

STEPS = 12  # (test_elastic.JOB's train.steps)


def losses(workdir, after=0):
    return {r["step"]: r["loss"] for r in records(workdir, "train") if r["step"] > after}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_hung_process_is_ended_by_its_watchdog_and_the_job_goes_on(tmp_path):
    workdir = tmp_path / "run"
    hang = FaultAt(workdir, 1, 4, sig=HANG)  # process 1's main thread sleeps for ever once step 4 is logged
    overrides = ["watchdog.step=4", "checkpoint.every_steps=2", "fault.grow_back=false"]
    job = local_job(workdir, *overrides, processes=2, devices=1, env=INJECT)
    hang.stop()
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "no progress for" in job.stdout and "(watchdog.step=4)" in job.stdout  # (the first watchdog to fire)
    (recovery,) = records(workdir, "recovery")
    # (the peer, waiting in a collective, may die of SIGABRT or its own watchdog first: the stuck one is blamed)
    assert recovery["lost_process"] == 1 and recovery["recovered"]
    # (named by its own hang file, or by its answer to the census of the peer whose watchdog fired first)
    assert recovery["how"].startswith("hung (") and ": hang-" in recovery["how"], recovery["how"]
    assert recovery["step_restored"] in (2, 4) and recovery["processes_now"] == 1  # (the hung one saves no more)
    assert sorted(losses(workdir)) == list(range(1, STEPS + 1))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_smaller_job_precompiled_in_the_background_compiles_nothing(tmp_path):
    workdir, cache = tmp_path / "run", [f"train.compilation_cache_dir={tmp_path / 'xla'}", "fault.precompile=true"]
    args = ["--config", JOB[0], "--workdir", str(workdir), *JOB[1:], *cache]
    precompiles = Precompiles(args, {1: []}, 1, load_config(JOB[0], [*JOB[1:], *cache], str(workdir)), local_dry_run)
    precompiles.start(2)  # as the launcher does beside a job of 2 processes, once the job has written metrics
    workdir.mkdir()
    (workdir / "metrics.jsonl").touch()
    later = time.time() + 1
    os.utime(workdir / "metrics.jsonl", (later, later))  # (a file's mtime may lag time.time() by a clock tick)
    precompiles.wait()
    assert "joined the job" in (workdir / "precompile-1.log").read_text()
    restart = local_job(workdir, *cache, "fault.elastic=false", "train.steps=2", processes=1, devices=1)
    assert restart.returncode == 0, restart.stderr[-3000:]
    (summary,) = records(workdir, "summary")
    assert summary["compile_cache_misses"] == 0 and summary["compile_cache_hits"] > 0, summary


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_pod_s_share_of_the_smaller_job_precompiled_in_the_background_compiles_nothing(tmp_path, monkeypatch):
    """Under --rendezvous (engine/elastic/pods.py) the round's leader names each smaller size's
    coordinator and the pods of the first ranks each run their process of its dry run; the pod
    ranked past the smaller size takes no part. A round of that size then compiles nothing."""
    workdir, cache = tmp_path / "run", [f"train.compilation_cache_dir={tmp_path / 'xla'}", "fault.precompile=true"]
    args = ["--config", JOB[0], "--workdir", str(workdir), *JOB[1:], *cache]
    cfg = load_config(JOB[0], [*JOB[1:], *cache], str(workdir))
    coordinator = f"127.0.0.1:{free_port()}"
    found = {"round": 0, "members": ["pod-0", "pod-1"], "precompile": {"1": coordinator}}
    monkeypatch.setenv("XLA_FLAGS", child_env()["XLA_FLAGS"])  # (a pod's process: 1 CPU device here)
    pods = [Precompiles(args, {1: []}, 1, cfg, PodDryRun.launcher(found, rank)) for rank in (0, 1)]
    for precompiles in pods:
        precompiles.start(2)  # as each pod's supervisor does beside its process of a round of 2
    workdir.mkdir()
    (workdir / "metrics.jsonl").touch()
    later = time.time() + 1
    os.utime(workdir / "metrics.jsonl", (later, later))
    for precompiles in pods:
        precompiles.wait()
    assert "joined the job" in (workdir / "precompile-1-process0.log").read_text()
    assert not (workdir / "precompile-1-process1.log").exists()  # (rank 1 takes no part in a job of 1)
    alone = distributed_args(f"127.0.0.1:{free_port()}", 1, 0)  # the round of one, as pods.py starts its process
    restart = run_cli(*args, "fault.elastic=false", "train.steps=2", *alone)
    assert restart.returncode == 0, restart.stderr[-3000:]
    (summary,) = records(workdir, "summary")
    assert summary["compile_cache_misses"] == 0 and summary["compile_cache_hits"] > 0, summary
