"""The local checkpoint tier (checkpoint.local_dir): frequent saves of each process's shards to
node-local storage and a peer's, restored when newer than the persistent tier, bit-identically;
damaged or lost copies skipped; the config's keys checked."""

import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from support.local_tier import local_steps

from engine.checkpoint.local_tier import run_directory
from engine.checkpoint.packing import LayoutMismatch, check_fits, pack, unpack
from engine.checkpoint.store import open_checkpoints
from engine.run.setup import build_run
from engine.run.single import fit


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
        "train.steps=10",
        "checkpoint.every_steps=5",
        "log.every_steps=3",
        f"checkpoint.local_dir={local_dir}",
        "checkpoint.local_every_steps=3",
        workdir=workdir,
    )
    fit(cfg)
    assert local_steps(local_dir, workdir) == [6, 9]  # every 3 steps, the newest local_keep=2 kept
    shutil.rmtree(workdir / "checkpoints" / "10")  # the persistent tier's newest is 5 now
    steps_dir = run_directory(str(local_dir), workdir / "checkpoints") / "process_0" / "owner_0"
    _flip(steps_dir / "9" / "shards.bin")
    run = build_run(cfg)
    checkpointer = open_checkpoints(workdir / "checkpoints", cfg, write=True)
    restored = checkpointer.restore(run.abstract_state)
    assert restored.step == 6 and int(restored.state.step) == 6 and restored.meta["tier"] == "local"
    assert restored.meta["data"]["next_step"] == 6
    assert "local checkpoint" in capfd.readouterr().err
    aside = list((steps_dir.parent / "damaged").glob("owner_0-9-*.reason.txt"))
    assert aside and "does not match its checksum" in aside[0].read_text()
    _flip(steps_dir / "6" / "index.json")  # every local step damaged: the persistent tier
    restored = checkpointer.restore(run.abstract_state)
    checkpointer.close()
    assert restored.step == 5 and restored.meta["tier"] == "persistent"
    assert "the persistent tier" in restored.meta["restored_from"]
    assert restored.meta["restored_from"].endswith(
        "the persistent tier: the local tier holds no complete step of this run"
    )
