"""Helpers of tests/**/test_elastic*.py that other test files (or its other tiers) share."""

import numpy as np

from engine.runtime.rundir import read_records
from support.cli import run_cli

STEPS, LOCAL_EVERY = 12, 4


JOB = [
    "configs/mnist_mlp.yaml",
    "train.global_batch_size=48",  # 6 batch shards on 3 processes x 2 devices, 4 on 2
    f"train.steps={STEPS}",
    "train.steps_per_call=1",
    "log.every_steps=1",
    "log.progress=false",
    "eval.every_steps=0",
    "eval.max_batches=2",
    "fault.elastic=true",
]


def records(workdir, split):
    return [r for r in read_records(workdir / "metrics.jsonl") if r["split"] == split]


def local_job(workdir, *overrides, processes, devices=2, env=None, timeout=600):
    flags = ["--local-processes", str(processes), "--devices-per-process", str(devices)]
    args = ["--config", JOB[0], "--workdir", str(workdir), *flags, *JOB[1:], *overrides]
    return run_cli(*args, env=env, timeout=timeout)


_UNBROKEN: dict[int, dict[int, float]] = {}  # steps → the unbroken run's losses, once run in this test process


def assert_unbroken_losses(workdir, unbroken, steps=STEPS):
    """The job's losses at every step are those of the unbroken run (JOB, train.steps=`steps`): the
    same mesh of 6 devices in one process (rtol 1e-5: float summation order). The unbroken run (in
    `unbroken`) is run once per test process: elastic jobs of JOB (local processes, pods) compare
    with the same."""
    losses = {r["step"]: r["loss"] for r in records(workdir, "train")}
    assert sorted(losses) == list(range(1, steps + 1))
    if steps not in _UNBROKEN:
        env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=6"}
        one = run_cli("--config", JOB[0], "--workdir", str(unbroken), *JOB[1:], f"train.steps={steps}", env=env)
        assert one.returncode == 0, one.stderr[-3000:]
        _UNBROKEN[steps] = {r["step"]: r["loss"] for r in records(unbroken, "train")}
    expected = _UNBROKEN[steps]
    assert sorted(expected) == sorted(losses)
    np.testing.assert_allclose([losses[s] for s in sorted(losses)], [expected[s] for s in sorted(losses)], rtol=1e-5)
