"""The local checkpoint tier (checkpoint.local_dir): frequent saves of each process's shards to
node-local storage and a peer's, restored when newer than the persistent tier, bit-identically;
damaged or lost copies skipped; the config's keys checked."""

import json
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from conftest import QUIET, ROOT, run_cli, start_cli, wait_until
from engine.checkpoint.local_tier import run_directory
from engine.checkpoint.packing import LayoutMismatch, check_fits, pack, unpack
from engine.checkpoint.peers import HOST_VARIABLE
from engine.checkpoint.store import open_checkpoints
from engine.config import load_config
from engine.errors import UsageError
from engine.run.setup import build_run
from engine.run.single import fit
from engine.runtime.rundir import read_records


def losses(workdir):
    return [(r["step"], r["loss"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]


def local_steps(local_dir, workdir, process=0, owner=0):
    folder = run_directory(str(local_dir), workdir / "checkpoints") / f"process_{process}" / f"owner_{owner}"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


@pytest.mark.nocompile
def test_local_tier_keys_are_checked(tmp_path):
    def load(*overrides):
        return load_config(ROOT / "configs" / "mnist_mlp.yaml", list(overrides), str(tmp_path / "run"))

    with pytest.raises(UsageError, match=r"checkpoint.local_every_steps=5 .* checkpoint.local_dir is not set"):
        load("checkpoint.local_every_steps=5")
    with pytest.raises(UsageError, match=r"checkpoint.local_dir=/dev/shm/x .*checkpoint.local_every_steps=0 never"):
        load("checkpoint.local_dir=/dev/shm/x")
    with pytest.raises(UsageError, match=r"checkpoint.local_dir=shm/x must be an absolute path"):
        load("checkpoint.local_dir=shm/x", "checkpoint.local_every_steps=5")
    cfg = load(f"checkpoint.local_dir={tmp_path}/shm", "checkpoint.local_every_steps=5", "log.every_steps=10")
    assert cfg.checkpoint.local_keep == 2 and cfg.checkpoint.local_replicas == 1
    assert cfg.train.steps_per_call == 5  # calls end at every local save


def test_pack_unpack_is_exact_and_refuses_another_layout(mesh2x4):
    mesh = mesh2x4
    values = np.arange(64, dtype=np.float32).reshape(8, 8) / 7
    split = jax.device_put(values, NamedSharding(mesh, PartitionSpec("data", "fsdp")))
    whole = jax.device_put(np.arange(3, dtype=np.int32), NamedSharding(mesh, PartitionSpec()))
    state = {"split": split, "whole": whole}
    buffer, index = pack(state)
    assert len(buffer) == values.nbytes + 3 * 4  # each distinct shard once: the replicated array once
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    check_fits(index, abstract)
    again = unpack(buffer, index, abstract)
    np.testing.assert_array_equal(np.asarray(again["split"]), values)
    np.testing.assert_array_equal(np.asarray(again["whole"]), np.arange(3))
    assert again["split"].sharding == split.sharding
    other = {
        **abstract,
        "split": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=NamedSharding(mesh, PartitionSpec("fsdp"))),
    }
    with pytest.raises(LayoutMismatch, match="another sharding"):
        check_fits(index, other)
    with pytest.raises(LayoutMismatch, match="another train state structure"):
        check_fits(index, {"split": abstract["split"]})


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_local_step_is_set_aside_like_a_persistent_one(make_config, tmp_path, capfd):
    local_dir, workdir = tmp_path / "shm", tmp_path / "run"
    cfg = make_config(
        "mnist_mlp.yaml",
        "mesh.num_devices=1",
        "train.steps=30",
        "checkpoint.every_steps=20",
        "log.every_steps=10",
        f"checkpoint.local_dir={local_dir}",
        "checkpoint.local_every_steps=4",
        workdir=workdir,
    )
    fit(cfg)
    assert local_steps(local_dir, workdir) == [24, 28]  # every 4 steps, the newest local_keep=2 kept
    shutil.rmtree(workdir / "checkpoints" / "30")  # the persistent tier's newest is 20 now
    steps_dir = run_directory(str(local_dir), workdir / "checkpoints") / "process_0" / "owner_0"
    _flip(steps_dir / "28" / "shards.bin")
    run = build_run(cfg)
    checkpointer = open_checkpoints(workdir / "checkpoints", cfg, write=True)
    restored = checkpointer.restore(run.abstract_state)
    assert restored.step == 24 and int(restored.state.step) == 24 and restored.meta["tier"] == "local"
    assert restored.meta["data"]["next_step"] == 24
    assert "local checkpoint" in capfd.readouterr().err
    aside = list((steps_dir.parent / "damaged").glob("owner_0-28-*.reason.txt"))
    assert aside and "does not match its checksum" in aside[0].read_text()
    _flip(steps_dir / "24" / "index.json")  # every local step damaged: the persistent tier
    restored = checkpointer.restore(run.abstract_state)
    checkpointer.close()
    assert restored.step == 20 and restored.meta["tier"] == "persistent"
    assert "the persistent tier" in restored.meta["restored_from"]
    assert restored.meta["restored_from"].endswith(
        "the persistent tier: the local tier holds no complete step of this run"
    )


RUN = [
    *QUIET,
    "--config",
    "configs/mnist_mlp.yaml",
    "log.every_steps=1",
    "eval.every_steps=0",
    "train.steps_per_call=1",
]


@pytest.mark.slow
def test_sigkilled_run_resumes_from_the_newer_local_step(tmp_path):
    local_dir = tmp_path / "shm"
    tier = [f"checkpoint.local_dir={local_dir}", "checkpoint.local_every_steps=3"]
    reference = run_cli(*RUN, "--workdir", str(tmp_path / "ref"), "train.steps=200")
    assert reference.returncode == 0, reference.stderr
    workdir = tmp_path / "killed"
    first = run_cli(*RUN, "--workdir", str(workdir), "train.steps=20", *tier)  # the persistent tier: step 20
    assert first.returncode == 0, first.stderr
    proc = start_cli(*RUN, "--workdir", str(workdir), "train.steps=1000000", *tier)  # persistent saves at the end only
    wait_until(lambda: len([s for s in local_steps(local_dir, workdir) if s >= 26]) == 2, proc, poll=0.01)
    proc.kill()
    proc.wait()
    kept = local_steps(local_dir, workdir)
    # local_keep=2, pruned after each save: a kill between a save and its pruning leaves three
    assert len(kept) in (2, 3) and all(b - a == 3 for a, b in zip(kept, kept[1:])) and 20 < kept[0] < kept[-1] < 200
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == [20]
    again = run_cli(*RUN, "--workdir", str(workdir), "train.steps=200", *tier)
    assert again.returncode == 0, again.stderr
    assert f"resuming from step {kept[-1]} (the local tier, checkpoint.local_dir={local_dir})" in again.stdout
    assert losses(workdir) == losses(tmp_path / "ref")  # bit-identical: JSON floats round-trip exactly


def _two_processes(workdir, local_dir, env=None):
    return run_cli(
        "--config",
        "configs/mnist_mlp.yaml",
        "--workdir",
        str(workdir),
        "--local-processes",
        "2",
        "--devices-per-process",
        "2",
        "mesh.fsdp=4",  # each process holds its own half of every parameter
        "train.global_batch_size=32",
        "train.steps=8",
        "checkpoint.every_steps=4",
        f"checkpoint.local_dir={local_dir}",
        "checkpoint.local_every_steps=2",
        *QUIET,
        "log.every_steps=1",
        "eval.every_steps=0",
        env=env,
        timeout=400,
    )


ONE_HOST = "note: every process of this job runs on one host: the local tier's peer copies guard against a lost"


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_restore_from_a_peers_copy_then_the_persistent_tier(tmp_path):
    workdir, local_dir = tmp_path / "run", tmp_path / "shm"
    first = _two_processes(workdir, local_dir, env={HOST_VARIABLE: "host{process}"})  # two hosts, as it seems
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert ONE_HOST not in first.stdout
    reference = losses(workdir)
    assert [s for s, _ in reference] == list(range(1, 9))
    run_dir = run_directory(str(local_dir), workdir / "checkpoints")
    halves = [json.loads((run_dir / "process_0" / f"owner_{o}" / "6" / "index.json").read_text()) for o in (0, 1)]
    assert halves[0]["shards"] != halves[1]["shards"]  # process 1's shards exist only at process 1 and its peer
    # process 1's host lost its local storage, and the persistent save of step 8 never happened
    shutil.rmtree(run_dir / "process_1")
    shutil.rmtree(workdir / "checkpoints" / "8")
    second = _two_processes(workdir, local_dir)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert ONE_HOST in second.stdout  # (both processes on this host)
    assert "resuming from step 6 (the local tier" in second.stdout
    assert "the shards of process(es) 1 from a peer's copy" in second.stdout
    assert losses(workdir) == reference
    # both copies of process 1's shards lost: the persistent tier
    shutil.rmtree(run_dir / "process_1")
    shutil.rmtree(run_dir / "process_0" / "owner_1")
    shutil.rmtree(workdir / "checkpoints" / "8")
    third = _two_processes(workdir, local_dir)
    assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
    assert "resuming from step 4 (checkpoint " in third.stdout and "the persistent tier" in third.stdout
    assert losses(workdir) == reference


@pytest.mark.nocompile
def test_a_killed_save_s_leftover_is_removed_at_the_next_save(tmp_path):
    """Issue 57: a persistent save killed mid-write left `N.orbax-checkpoint-tmp-*` behind for good."""
    cfg = load_config(ROOT / "configs" / "mnist_mlp.yaml", [], str(tmp_path / "run"))
    checkpointer = open_checkpoints(tmp_path / "run" / "checkpoints", cfg, write=True)
    leftover = tmp_path / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-1764288000"
    (leftover / "state").mkdir(parents=True)
    checkpointer.save(5, {"w": jax.device_put(np.ones(4, np.float32))}, {"step": 5})
    checkpointer.close()
    assert checkpointer.steps() == [5] and not leftover.exists()
    assert not list(leftover.parent.glob("*.orbax-checkpoint-tmp*"))
