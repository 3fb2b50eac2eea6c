"""The local checkpoint tier restored onto another process count or mesh (local_reshard.py): every
saved process's shards gathered and each array rebuilt in the new shardings, bit for bit; a copy
missing at every process, or another model, falls back to the persistent tier."""

import json
import shutil

import pytest
from support.cli import run_cli
from support.configs import QUIET

from engine.checkpoint.local_tier import run_directory
from engine.checkpoint.peers import HOST_VARIABLE
from engine.runtime.rundir import read_records


def losses(workdir):
    """(step, loss, gradient norm) of each train record: the norm shows a change in a parameter's last bit."""
    records = read_records(workdir / "metrics.jsonl")
    return [(r["step"], r["loss"], r["grad_norm"]) for r in records if r["split"] == "train"]


def _run(workdir, local_dir, processes, fsdp, steps, env=None):
    tier = [f"checkpoint.local_dir={local_dir}", "checkpoint.local_every_steps=2"] if local_dir else []
    return run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "--local-processes",
        str(processes),
        "--devices-per-process",
        "2",
        f"mesh.fsdp={fsdp}",
        "train.global_batch_size=32",
        f"train.steps={steps}",
        "checkpoint.every_steps=2",
        *tier,
        *QUIET,
        "log.every_steps=1",
        "eval.every_steps=0",
        env=env,
        timeout=400,
    )


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_resume_on_one_from_the_local_tier(tmp_path):
    workdir, local_dir, kept = tmp_path / "run", tmp_path / "shm", tmp_path / "kept"
    first = _run(workdir, local_dir, 2, 4, 8, env={HOST_VARIABLE: "host{process}"})  # local 4, 6 kept; 8 persistent
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    run_dir = run_directory(str(local_dir), workdir / "checkpoints")
    assert json.loads((run_dir / "process_0" / "owner_1" / "6" / "tier.json").read_text())["processes"] == 2
    for name in ("run", "shm"):
        shutil.copytree(tmp_path / name, kept / name)
    shutil.rmtree(workdir / "checkpoints" / "8")  # (the newest persistent step is 6, as new as the local tier's)
    shutil.rmtree(run_dir / "process_1")  # process 1's host is lost: the job goes on with one process
    second = _run(workdir, local_dir, 1, 2, 8)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert (
        f"resuming from step 6 (the local tier, checkpoint.local_dir={local_dir}; saved by 2 process(es), "
        "resharded onto 1; the shards of process(es) 1 from a peer's copy)" in second.stdout
    )
    resumed = losses(workdir)[-2:]
    # both copies of process 1's shards lost: the persistent tier's step 6, read by orbax onto one process
    for name in ("run", "shm"):
        shutil.rmtree(tmp_path / name)
        shutil.copytree(kept / name, tmp_path / name)
    shutil.rmtree(workdir / "checkpoints" / "8")
    shutil.rmtree(run_dir / "process_1")
    shutil.rmtree(run_dir / "process_0" / "owner_1")
    third = _run(workdir, local_dir, 1, 2, 8)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "resuming from step 6 (checkpoint " in third.stdout
    assert "the persistent tier: the local tier holds no complete step of this run" in third.stdout
    assert [s for s, _, _ in resumed] == [7, 8] and losses(workdir)[-2:] == resumed  # bit-identical parameters
