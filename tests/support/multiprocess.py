"""Helpers of tests/**/test_multiprocess*.py that other test files (or its other tiers) share."""

import json

from support.cli import run_cli

COMMON = ["log.every_steps=1", "log.progress=false", "eval.every_steps=0", "eval.max_batches=2"]


FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def train_losses(workdir):
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["split"] == "train"}


def local_job(workdir, config, *overrides, processes=2, devices=2, timeout=400):
    return run_cli(
        "--config",
        config,
        "--workdir",
        str(workdir),
        "--local-processes",
        str(processes),
        "--devices-per-process",
        str(devices),
        *overrides,
        *COMMON,
        timeout=timeout,
    )


def one_process(workdir, config, *overrides, timeout=400):
    return run_cli(
        "--config", config, "--workdir", str(workdir), *overrides, *COMMON, env=FOUR_DEVICES, timeout=timeout
    )
