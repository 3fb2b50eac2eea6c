"""fault.elastic under train.sync=diloco: 4 processes holding a replica each, one SIGKILLed mid-round;
the job goes on with 3 replicas from the last outer step (the round's inner steps dropped) and the
default job still reaches 95% eval accuracy."""

import re

import pytest
from support.elastic import local_job, records
from support.faults import FaultAt

INNER, LOCAL_EVERY, STEPS = 8, 5, 320


JOB = [
    "train.sync=diloco",
    "diloco.replica_axis=data",
    f"diloco.inner_steps={INNER}",
    "train.global_batch_size=48",  # 12 rows a replica on 4, 16 on 3
    f"train.steps={STEPS}",
    "eval.every_steps=0",
    "eval.max_batches=0",
    "fault.min_processes=2",  # (DiLoCo needs 2 replicas)
    "checkpoint.every_steps=100",
    f"log.every_steps={INNER}",
]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_replica_s_job_goes_on_with_three_and_converges(tmp_path):
    workdir = tmp_path / "elastic"
    tier = [f"checkpoint.local_dir={tmp_path / 'shm'}", f"checkpoint.local_every_steps={LOCAL_EVERY}"]
    kill = FaultAt(workdir, 2, 207)  # (logged at 208) the local save at 205 mid-round (rounds of 8); persistent at 200
    job = local_job(workdir, *JOB, *tier, processes=4, devices=1)
    kill.stop()
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-3000:]
    assert "process 2 was killed by signal 9 (SIGKILL)" in job.stderr, job.stderr
    assert "elastic: restarting the job on 3 processes" in job.stderr
    assert "DiLoCo: 4 replicas" in job.stdout and "DiLoCo: 3 replicas" in job.stdout
    (recovery,) = records(workdir, "recovery")
    assert recovery["processes_before"] == 4 and recovery["processes_now"] == 3 and recovery["recovered"]
    assert recovery["tier"] == "local", recovery
    restored = recovery["step_restored"]
    assert restored % INNER == 0 and 0 <= recovery["step_reached"] - restored <= LOCAL_EVERY + INNER, recovery
    saved = int(re.search(r"at step (\d+), saved with 4 DiLoCo replicas: 3 go on", recovery["restored_from"])[1])
    assert saved % INNER and saved - saved % INNER == restored, recovery  # a mid-round step: the round dropped
    train = records(workdir, "train")
    assert sorted(r["step"] for r in train) == list(range(INNER, STEPS + 1, INNER))  # the dropped steps again
    (final,) = [r for r in records(workdir, "eval") if r["step"] == STEPS]
    assert final["accuracy"] >= 0.95, final
