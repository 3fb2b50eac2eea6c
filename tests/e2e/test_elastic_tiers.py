"""fault.elastic's recoveries by tier and by kind: a lost host's local tier (the peer's copy, then the
persistent tier) with the losses of a run resumed by hand, and a hung process ended by its watchdog,
with its smaller job precompiled in the background (fault.precompile)."""

import os
import shutil
import time

import pytest
from support.cli import run_cli
from support.elastic import JOB, local_job, records
from support.faults import HANG, INJECT, FaultAt, drop_local_tier

from engine.config import load_config
from engine.elastic.precompile import Precompiles

STEPS = 12  # (test_elastic.JOB's train.steps)


def losses(workdir, after=0):
    return {r["step"]: r["loss"] for r in records(workdir, "train") if r["step"] > after}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_lost_host_s_local_tier_then_both_copies(tmp_path):
    workdir = tmp_path / "run"
    tiers = [
        f"checkpoint.local_dir={tmp_path / 'shm'}",
        "checkpoint.local_every_steps=2",
        "checkpoint.every_steps=2",
        "checkpoint.keep=20",
        "fault.grow_back=false",  # (the second kill is in the job of 2)
    ]
    # process 2 of 3 dies at step 5 with its host's local tier; then process 1 of 2 at step 9 with
    # both copies of its shards (its own and its peer's)
    own: list = []
    both: list = []
    kills = [
        FaultAt(workdir, 2, 5, then=lambda: own.extend(drop_local_tier(tmp_path / "shm", 2))),
        FaultAt(workdir, 1, 9, attempt=1, then=lambda: both.extend(drop_local_tier(tmp_path / "shm", 1, "all"))),
    ]
    job = local_job(workdir, *tiers, processes=3)
    for kill in kills:
        kill.stop()
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert [p.name for p in own] == ["process_2"] and [f"{p.parent.name}/{p.name}" for p in both][1:] == [
        "process_0/owner_1"
    ], (own, both)
    peer, persistent = records(workdir, "recovery")
    assert (peer["processes_now"], persistent["processes_now"]) == (2, 1)
    assert peer["tier"] == "local" and "the shards of process(es) 2 from a peer's copy" in peer["restored_from"]
    assert 0 <= peer["step_reached"] - peer["step_restored"] <= 2
    assert persistent["tier"] == "persistent", persistent
    assert 0 <= peer["seconds_to_stop"] < 2 and 0 <= persistent["seconds_to_stop"] < 2  # SIGKILL at once
    assert sorted(losses(workdir)) == list(range(1, STEPS + 1))
    # the losses after the last recovery: those of the same job resumed by hand, on 1 process of 2 devices
    restored = persistent["step_restored"]
    hand = tmp_path / "hand"
    shutil.copytree(workdir / "checkpoints" / str(restored), hand / "checkpoints" / str(restored))
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    again = run_cli("--config", JOB[0], "--workdir", str(hand), *JOB[1:], env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from step {restored}" in again.stdout + again.stderr
    assert losses(hand) == losses(workdir, after=restored)  # bit-identical


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
