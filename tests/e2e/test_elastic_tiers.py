"""fault.elastic's recoveries by kind: a hung process ended by its watchdog, and the smaller job
precompiled in the background (fault.precompile). (A lost host's local tier, the peer's copy then
the persistent tier, is test_elastic.py's killed-process test.)"""

import os
import time

import pytest
from support.elastic import JOB, local_job, records
from support.faults import HANG, INJECT, FaultAt

from engine.config import load_config
from engine.elastic.precompile import Precompiles

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
    precompiles = Precompiles(args, {1: []}, 1, load_config(JOB[0], [*JOB[1:], *cache], str(workdir)))
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
