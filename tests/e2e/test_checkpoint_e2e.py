"""Checkpointing and fault tolerance: exact resume after SIGKILL, SIGTERM, damaged
checkpoints, incompatible models, restore onto other meshes, the evaluator, export."""

import json
import signal
import time

import jax
import numpy as np
import pytest
from support.checkpoint import saved_arrays, train_briefly
from support.cli import run_cli, start_cli

from engine.checkpoint.store import Checkpointer
from engine.run.setup import build_run
from engine.runtime.rundir import read_records

# dropout on, a warm-up + cosine schedule, a log line per step: every step's loss is compared
RUN = [
    "train.steps=120",
    "checkpoint.every_steps=10",
    "checkpoint.keep=20",
    "log.every_steps=1",
    "log.progress=false",
    "eval.every_steps=0",
    "optimizer.schedule=warmup_cosine",
    "optimizer.warmup_steps=10",
]


def losses(workdir):
    records = read_records(workdir / "metrics.jsonl")  # a line still being written is not read
    return [(r["step"], r["loss"]) for r in records if r["split"] == "train"]


def start_training(workdir, *extra):
    return start_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), *RUN, *extra)


def wait_for_step(workdir, step, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (workdir / "metrics.jsonl").exists() and losses(workdir) and losses(workdir)[-1][0] >= step:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """A run never stopped, watched while it trains by an evaluator (`eval --watch`) started
    before it: the reference of the resume tests, and the evaluator test's live run."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    evaluator = start_cli("eval", "--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), "--watch", *RUN)
    proc = start_training(workdir)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    _, err = evaluator.communicate(timeout=300)
    assert evaluator.returncode == 0, err
    return workdir


def assert_same_run(workdir, reference):
    assert losses(workdir) == losses(reference)  # bit-identical: JSON floats round-trip exactly
    for a, b in zip(saved_arrays(workdir, 120), saved_arrays(reference, 120)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_all_checkpoints_corrupt_is_exit_2_and_nothing_deleted(tmp_path):
    workdir = tmp_path / "run"
    args = [
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "train.steps=20",
        "checkpoint.every_steps=10",
        "log.progress=false",
    ]
    assert run_cli(*args).returncode == 0
    files = sorted(p for p in (workdir / "checkpoints").rglob("*") if p.is_file())
    for path in files:
        if path.parent.name in ("d", "ocdbt.process_0") or path.name == "manifest.ocdbt":
            path.write_bytes(b"garbage")
    before = sorted(p for p in (workdir / "checkpoints").rglob("*"))
    proc = run_cli(*args[:4], "train.steps=30", "log.progress=false")
    assert proc.returncode == 2, proc.stderr
    assert f"every checkpoint in {workdir / 'checkpoints'} is unreadable" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p for p in (workdir / "checkpoints").rglob("*")) == before


@pytest.mark.slow
def test_evaluator_evaluates_each_checkpoint_of_a_live_run_once(tmp_path, uninterrupted):
    import shutil

    workdir = tmp_path / "live"  # (a copy: the eval below adds a record; the fixture is shared)
    shutil.copytree(uninterrupted, workdir)
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    evaluated = [r["step"] for r in records if r.get("source") == "evaluator"]
    assert sorted(evaluated) == list(range(10, 121, 10))  # every checkpoint, each once
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in records if r.get("source") == "evaluator")
    assert list((workdir / "evaluator").glob("events.out.tfevents.*"))
    # without --watch: the newest checkpoint once
    proc = run_cli("eval", "--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), *RUN)
    assert proc.returncode == 0, proc.stderr


def test_export_reloads_and_reproduces_outputs(make_config, tmp_path):
    workdir = tmp_path / "run"
    cfg = train_briefly(make_config, workdir)
    out = tmp_path / "export"
    proc = run_cli("export", "--workdir", str(workdir), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    import orbax.checkpoint as ocp

    exported = jax.export.deserialize(bytearray((out / "forward.stablehlo").read_bytes()))
    variables = ocp.StandardCheckpointer().restore(out / "variables")
    run = build_run(cfg)
    state = Checkpointer(workdir / "checkpoints", 5).restore(run.abstract_state).state
    images = run.dataset.eval["image"][:7]
    expected = run.model.module.apply({"params": state.params}, images, train=False)
    np.testing.assert_allclose(exported.call(variables, images), expected, rtol=1e-6)
    assert run_cli("export", "--workdir", str(workdir), "--out", str(out)).returncode == 2  # never overwrites
    from engine.runtime.rundir import check_sums

    assert check_sums(out) is None and "variables/" in (out / "SHA256SUMS").read_text()
    data = max((p for p in (out / "variables").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1  # one flipped bit in the variables: named
    data.write_bytes(bytes(raw))
    assert (
        check_sums(out)
        == f"{data.relative_to(out)} does not match its checksum in SHA256SUMS (the file changed on disk)"
    )


@pytest.mark.slow
def test_sigterm_sigkill_with_device_staging_and_kills_at_seeded_moments_resume_bit_identically(
    tmp_path, uninterrupted
):
    """One run stopped every way, each re-run resuming the last one's save, then finished:
    bit-identical to a run never stopped.
    1. SIGTERM at step 30+ (checkpoint.every_steps=1000): exit 143, its one save at the last step run.
    2. Re-run with checkpoint.staging=device (the background save writes the state of its own
       step), resumed from that save, SIGKILLed at step 67+.
    3. Its newest save put back as orbax leaves one mid-write (under its temporary name, a file
       cut short), then killed at seeded random moments of the re-runs (start-up, restore,
       training, saves); each re-run resumes a step saved with device staging (or later), the
       half-written save is never read as whole and that step is saved again."""
    import random
    import shutil

    workdir = tmp_path / "stopped"
    proc = start_training(workdir, "checkpoint.every_steps=1000")  # only the preemption save
    wait_for_step(workdir, 30, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "preempted by SIGTERM: saved a checkpoint at step" in err
    checkpoints = workdir / "checkpoints"
    saved = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert saved == [losses(workdir)[-1][0]]  # the one save is at the last step run

    proc = start_training(workdir, "checkpoint.staging=device")
    wait_for_step(workdir, max(67, saved[0] + 25), proc)  # two device-staged saves at least
    proc.kill()
    proc.wait()
    assert losses(workdir)[-1][0] < 120  # it really was cut short

    rng = random.Random(1123)
    newest = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert newest > saved[0]  # a device-staged save
    partial = checkpoints / f"{newest}.orbax-checkpoint-tmp-1795500000000000"
    shutil.move(checkpoints / str(newest), partial)
    largest = max((f for f in partial.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    for moment in [rng.uniform(0.5, 8.0) for _ in range(3)]:
        proc = start_training(workdir)
        time.sleep(moment)
        proc.kill()
        proc.wait()
    proc = start_training(workdir)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert (checkpoints / str(newest)).is_dir()  # that step was saved again, whole
    assert_same_run(workdir, uninterrupted)
