"""The local checkpoint tier restored onto another process count or mesh (local_reshard.py): every
saved process's shards gathered and each array rebuilt in the new shardings, bit for bit; a copy
missing at every process, or another model, falls back to the persistent tier."""

import json
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine.checkpoint.local_files import Copy, write_copy
from engine.checkpoint.local_reshard import rebuild, to_all
from engine.checkpoint.local_tier import LocalTier, run_directory
from engine.checkpoint.packing import LayoutMismatch, pack


def _state(mesh):
    """Random bits in three dtypes: split over both axes, over one, and replicated."""
    bits = np.random.default_rng(0).integers(0, 2**32, size=(8, 8), dtype=np.uint32)
    weights = jax.device_put(bits.view(np.float32), NamedSharding(mesh, PartitionSpec("data", "fsdp")))
    bias = jax.device_put(
        bits[0].view(np.float32).astype(jax.numpy.bfloat16), NamedSharding(mesh, PartitionSpec("fsdp"))
    )
    step = jax.device_put(np.int32(7), NamedSharding(mesh, PartitionSpec()))
    return {"w": weights, "b": bias, "step": step}


def _owners(state, groups) -> dict[int, Copy]:
    """The copies that processes holding the devices of each of `groups` would have saved: pack's
    buffer of all the shards, split into each group's distinct shards."""
    buffer, index = pack(state)
    leaves = jax.tree_util.tree_leaves(state)
    copies = {}
    for owner, group in enumerate(groups):
        shards, parts, offset = [], [], 0
        for shard in index["shards"]:
            leaf = leaves[shard["leaf"]]
            held = [leaf.sharding.devices_indices_map(leaf.shape)[d] for d in group]
            if not any([list(s.indices(n)[:2]) for s, n in zip(w, leaf.shape)] == shard["slices"] for w in held):
                continue
            size = int(np.prod([b - a for a, b in shard["slices"]])) * np.dtype(shard["dtype"]).itemsize
            parts.append(buffer[shard["offset"] : shard["offset"] + size])
            shards.append({**shard, "offset": offset})
            offset += size
        layout = {**index, "shards": shards, "processes": len(groups)}
        copies[owner] = Copy(owner, np.concatenate(parts), layout, {"step": 7, "owner": owner})
    return copies


def _abstract(mesh, specs):
    shapes = {"w": ((8, 8), np.float32), "b": ((8,), jax.numpy.bfloat16), "step": ((), np.int32)}
    return {
        name: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, specs[name]))
        for name, (shape, dtype) in shapes.items()
    }


def _bits(array):
    value = np.asarray(array)
    return value.view(np.uint16 if value.dtype.itemsize == 2 else np.uint32)


def test_rebuild_onto_other_meshes_is_bit_exact(mesh2x4):
    state = _state(mesh2x4)
    copies = _owners(state, [list(mesh2x4.devices[0]), list(mesh2x4.devices[1])])  # two processes, a row each
    assert set(copies) == {0, 1} and all(len(c.buffer) < len(pack(state)[0]) for c in copies.values())
    devices = jax.devices()
    targets = [
        (Mesh(np.array(devices[:2]).reshape(1, 2), ("data", "fsdp")), ("data", "fsdp")),  # one process, 2 devices
        (Mesh(np.array(devices[:4]).reshape(4, 1), ("data", "fsdp")), ("data", "fsdp")),
        (Mesh(np.array(devices[2:5]).reshape(3, 1), ("data", "fsdp")), ()),  # three devices, replicated
        (Mesh(np.array(devices[::-1]).reshape(2, 4), ("data", "fsdp")), ("fsdp", "data")),  # transposed
    ]
    for mesh, axes in targets:
        specs = {"w": PartitionSpec(*axes), "b": PartitionSpec(*axes[:1]), "step": PartitionSpec()}
        abstract = _abstract(mesh, specs)
        again = rebuild(copies, abstract)
        for name in state:
            assert again[name].sharding == abstract[name].sharding and again[name].dtype == state[name].dtype
            assert np.array_equal(_bits(again[name]), _bits(state[name])), (name, mesh.shape)


def test_rebuild_refuses_missing_shards_and_another_model(mesh2x4):
    copies = _owners(_state(mesh2x4), [list(mesh2x4.devices[0]), list(mesh2x4.devices[1])])
    abstract = _abstract(mesh2x4, {"w": PartitionSpec(), "b": PartitionSpec(), "step": PartitionSpec()})
    with pytest.raises(LayoutMismatch, match=r"the saved shards of \['w'\] cover 32 of its 64 values"):
        rebuild({0: copies[0]}, abstract)  # the other process's half of w is missing
    with pytest.raises(LayoutMismatch, match=r"\['w'\] was saved with shape \[8, 8\], not \[8, 4\]"):
        rebuild(copies, {**abstract, "w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=abstract["w"].sharding)})
    with pytest.raises(LayoutMismatch, match=r"\['b'\] was saved as bfloat16, not float32"):
        rebuild(copies, {**abstract, "b": jax.ShapeDtypeStruct((8,), np.float32, sharding=abstract["b"].sharding)})
    with pytest.raises(LayoutMismatch, match="another train state structure"):
        rebuild(copies, {"w": abstract["w"]})
    # each copy goes to every process that does not serve it (several in turn from one process)
    assert to_all({0: 0, 1: 0, 2: 1}, 2) == [(0, 1, 0), (0, 1, 1), (1, 0, 2)]


def _tier(tmp_path, fresh=False):
    return LocalTier(str(tmp_path / "shm"), tmp_path / "run" / "checkpoints", 3, 1, False, fresh)


def test_a_step_saved_by_2_processes_is_restored_on_1(tmp_path, mesh2x4):
    """Process 0's storage holds both owners' copies of step 7 (its own and its peer's), saved by
    two processes: restored on this one process, resharded; with owner 1's copy gone, declined."""
    state = _state(mesh2x4)
    abstract = _abstract(mesh2x4, {"w": PartitionSpec("fsdp"), "b": PartitionSpec(), "step": PartitionSpec()})
    tier = _tier(tmp_path, fresh=True)
    assert tier.restore(abstract, None) is None  # (the run id agreed)
    root = run_directory(str(tmp_path / "shm"), tmp_path / "run" / "checkpoints") / "process_0"
    for owner, copy in _owners(state, [list(mesh2x4.devices[0]), list(mesh2x4.devices[1])]).items():
        tier_record = dict(step=7, owner=owner, processes=2, peers=[1 - owner], run=tier.run)
        write_copy(root / f"owner_{owner}", 7, copy, tier_record, False)
    got = _tier(tmp_path).restore(abstract, 6)
    assert got is not None and got.step == 7 and got.meta == {"step": 7, "owner": 0}
    assert got.source.endswith(
        "; saved by 2 process(es), resharded onto 1; the shards of process(es) 1 from a peer's copy"
    )
    for name in state:
        assert (
            np.array_equal(_bits(got.state[name]), _bits(state[name]))
            and got.state[name].sharding == abstract[name].sharding
        )
    shutil.rmtree(root / "owner_1")
    tier = _tier(tmp_path)
    assert tier.restore(abstract, 6) is None and tier.declined == "the local tier holds no complete step of this run"


def test_a_survivor_s_copies_under_its_old_process_index_are_restored(tmp_path, mesh2x4):
    """An elastic job's survivors are renumbered: the copies of step 7 (saved by 2 processes) lie in
    `process_2/`, an index this job of one process does not have. Restored from there (not the
    persistent tier); a later step there is discarded with the past it belongs to; the folder is
    removed once this job has saved a step of its own."""
    state = _state(mesh2x4)
    abstract = _abstract(mesh2x4, {"w": PartitionSpec("fsdp"), "b": PartitionSpec(), "step": PartitionSpec()})
    tier = _tier(tmp_path, fresh=True)
    assert tier.restore(abstract, None) is None  # (the run id agreed)
    run = run_directory(str(tmp_path / "shm"), tmp_path / "run" / "checkpoints")
    for owner, copy in _owners(state, [list(mesh2x4.devices[0]), list(mesh2x4.devices[1])]).items():
        for step in (7, 9) if owner else (7,):  # (step 9 incomplete: owner 0's copy is missing)
            tier_record = dict(step=step, owner=owner, processes=2, peers=[1 - owner], run=tier.run)
            write_copy(run / "process_2" / f"owner_{owner}", step, copy, tier_record, False)
    tier = _tier(tmp_path)
    got = tier.restore(abstract, 6)
    assert got is not None and got.step == 7, tier.declined
    assert got.source.endswith("resharded onto 1; the shards of process(es) 0, 1 from a peer's copy")  # (process_2/)
    assert all(np.array_equal(_bits(got.state[name]), _bits(state[name])) for name in state)
    tier.discard_after(7)
    assert sorted(p.name for p in (run / "process_2" / "owner_1").iterdir()) == ["7"]
    tier.save(8, got.state, {"step": 8})
    tier.close()
    assert sorted(p.name for p in run.iterdir()) == ["process_0"]


def test_a_step_in_another_sharding_is_resharded(tmp_path, mesh2x4):
    """The same process count, another mesh: the copy does not fit as it is, and is resharded."""
    state = _state(mesh2x4)
    tier = _tier(tmp_path, fresh=True)
    tier.restore(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state), None)
    tier.save(4, state, {"step": 4})
    tier.close()
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(4, 1), ("data", "fsdp"))
    abstract = _abstract(mesh, {"w": PartitionSpec(None, "data"), "b": PartitionSpec("data"), "step": PartitionSpec()})
    got = _tier(tmp_path).restore(abstract, None)
    assert got is not None and got.step == 4 and got.meta == {"step": 4}
    assert got.source.endswith("; saved by 1 process(es) in another sharding, resharded onto this run's")
    for name in state:
        assert (
            np.array_equal(_bits(got.state[name]), _bits(state[name]))
            and got.state[name].sharding == abstract[name].sharding
        )


def test_one_process_sends_several_owners_copies_to_one_destination_in_turn(tmp_path, mesh2x4):
    copies = _owners(_state(mesh2x4), [list(mesh2x4.devices[0]), list(mesh2x4.devices[1])])
    got = _tier(tmp_path)._transfer([(0, 0, 0), (0, 0, 1)], copies)  # (one process: to itself, in two rounds)
    assert [json.loads(bytes(head))["owner"] for head, _ in got] == [0, 1]
    assert [bytes(buffer) for _, buffer in got] == [bytes(copies[0].buffer), bytes(copies[1].buffer)]
