"""Vectorised runs (a sweep's `vectorize:`): K configs trained as one program give each
config's own losses, keep each run's files, stop a diverging run alone, resume exactly,
and never share a program between configs of different shapes."""

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support.cli import run_cli, start_cli
from support.vectorize import _sweep_file

from engine.runtime.rundir import read_records


def _train_losses(directory) -> dict:
    losses = {}
    for workdir in sorted(p for p in directory.iterdir() if (p / "metrics.jsonl").is_file()):
        losses[workdir.name] = [
            (r["step"], r["loss"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"
        ]
    return losses


def _pids_running(sweep_file) -> list[int]:
    """Processes started with `sweep_file` in their command line (a sweep and its children)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(sweep_file).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # ended meanwhile
            continue
    return pids


@pytest.mark.slow
def test_a_killed_vectorised_sweep_resumes_exactly(tmp_path):
    """SIGKILL of the sweep and its group mid-way; the re-run resumes every run from its
    checkpoint and ends with the metrics of a sweep that never stopped (step 20's checkpoint
    cuts a 25-step log window: it carries the window's first steps)."""
    whole = _sweep_file(tmp_path / "whole.yaml", tmp_path / "whole")
    assert run_cli("sweep", str(whole), timeout=600).returncode == 0
    cut = _sweep_file(tmp_path / "cut.yaml", tmp_path / "cut")
    sweep = start_cli("sweep", str(cut), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    checkpoints = [tmp_path / "cut" / run / "checkpoints" / "20" for run in _train_losses(tmp_path / "whole")]
    while not all(p.is_dir() for p in checkpoints) and time.time() < deadline and sweep.poll() is None:
        time.sleep(0.05)
    for pid in [sweep.pid, *_pids_running(cut)]:  # the sweep and its group's process, no chance to save
        os.kill(pid, signal.SIGKILL)
    sweep.wait()
    while _pids_running(cut):
        time.sleep(0.05)
    assert all(p.is_dir() for p in checkpoints), "the sweep ended before every run had saved step 20"
    for step_dir in (tmp_path / "cut").glob("*/checkpoints/*"):  # as if killed right after step 20:
        if not step_dir.name.isdigit() or int(step_dir.name) > 20:  # its window carries steps 1..20 of 25
            shutil.rmtree(step_dir)
    statuses = [json.loads(line)["status"] for line in (tmp_path / "cut" / "sweep.jsonl").read_text().splitlines()]
    assert "finished" not in statuses
    rerun = run_cli("sweep", str(cut), timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "4 to run (4 resuming from a checkpoint" in rerun.stdout
    resumed = [
        int(step)
        for log in (tmp_path / "cut" / "groups").glob("*.log")
        for step in re.findall(r"resuming from step (\d+)", log.read_text())
    ]
    assert resumed == [20]
    expected, got = _train_losses(tmp_path / "whole"), _train_losses(tmp_path / "cut")
    assert len(expected) == 4 and got == expected
    index = [json.loads(line) for line in (tmp_path / "cut" / "sweep.jsonl").read_text().splitlines()]
    assert [entry["status"] for entry in index] == ["finished"] * 4


@pytest.mark.slow
def test_a_preempted_vectorised_sweep_saves_every_run_and_exits_143(tmp_path):
    """SIGTERM to the sweep (a pod's preemption): the group saves every run at one step and
    exits 143, the runs are `interrupted`, and the re-run resumes them from that step."""
    path = _sweep_file(
        tmp_path / "s.yaml",
        tmp_path / "out",
        overrides={
            "train.steps": 400,
            "train.steps_per_call": 5,
            "log.every_steps": 25,
            "eval.every_steps": 0,
            "checkpoint.every_steps": 0,
            "train.global_batch_size": 32,
            "log.tensorboard": False,
            "optimizer.name": "adamw",
        },
    )  # checkpoint.every_steps=0: only the signal's save, and the last
    sweep = start_cli("sweep", str(path), stderr=subprocess.STDOUT)
    metrics = list((tmp_path / "out").glob("*/metrics.jsonl"))
    deadline = time.time() + 300
    while len(metrics) < 4 and time.time() < deadline and sweep.poll() is None:  # training has begun
        time.sleep(0.05)
        metrics = list((tmp_path / "out").glob("*/metrics.jsonl"))
    sweep.send_signal(signal.SIGTERM)
    out, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 143, out
    index = [json.loads(line) for line in (tmp_path / "out" / "sweep.jsonl").read_text().splitlines()]
    assert [entry["status"] for entry in index] == ["interrupted"] * 4
    newest = {
        max(int(p.name) for p in (tmp_path / "out" / entry["name"] / "checkpoints").iterdir() if p.name.isdigit())
        for entry in index
    }
    assert len(newest) == 1  # one step for every run: the step the signal stopped them at
    (log,) = (tmp_path / "out" / "groups").glob("*.log")
    stopped = re.findall(r"preempted by SIGTERM: saved a checkpoint at step (\d+)", log.read_text())
    assert [int(step) for step in stopped] == list(newest) and 0 < newest.pop() < 400
    rerun = run_cli("sweep", str(path), timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "4 to run (4 resuming from a checkpoint" in rerun.stdout
