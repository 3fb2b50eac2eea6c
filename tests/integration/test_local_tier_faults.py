"""The local checkpoint tier's peers and failures: peers on other hosts, steps of another run not
restored, any unreadable step directory set aside, a step that does not read after all agreed
on falls back to the persistent tier, and a failed background write is a warning."""

import json
import tracemalloc

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from support.local_tier_faults import _tier

from engine.checkpoint import local_tier
from engine.checkpoint.local_tier import run_directory
from engine.checkpoint.packing import pack
from engine.checkpoint.peers import RUN_ID_FILE


def _state(mesh, scale=1.0):
    sharding = NamedSharding(mesh, PartitionSpec("data", "fsdp"))
    return {"w": jax.device_put(np.arange(64, dtype=np.float32).reshape(8, 8) * scale, sharding)}


def _abstract(state):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)


def _saved(tmp_path, mesh, steps=(2, 4), verify=False):
    """A run whose local tier holds `steps` (the state at step s is arange * s)."""
    tier = _tier(tmp_path, fresh=True, verify=verify)
    assert tier.restore(_abstract(_state(mesh)), None) is None and tier.declined == "the run begins afresh"
    for step in steps:
        tier.save(step, _state(mesh, step), {"step": step})
    tier.close()
    return run_directory(str(tmp_path / "shm"), tmp_path / "run" / "checkpoints") / "process_0" / "owner_0"


def test_any_unreadable_step_directory_is_set_aside(tmp_path, mesh2x4, capfd):
    folder = _saved(tmp_path, mesh2x4)
    tier_file = folder / "4" / "tier.json"
    assert json.loads(tier_file.read_text())["peers"] == []  # one process: no peer
    abstract = _abstract(_state(mesh2x4))
    got = _tier(tmp_path).restore(abstract, None)
    assert got.step == 4 and np.array_equal(np.asarray(got.state["w"]), np.asarray(_state(mesh2x4, 4)["w"]))
    tier = json.loads(tier_file.read_text())
    tier_file.write_text(json.dumps({k: v for k, v in tier.items() if k != "processes"}))  # a KeyError on reading
    shards = folder / "2" / "shards.bin"
    shards.write_bytes(shards.read_bytes()[:100])  # truncated, and checkpoint.verify=false
    tier = _tier(tmp_path)
    assert tier.restore(abstract, None) is None
    assert tier.declined == "the local tier holds no complete step of this run"
    reasons = sorted(p.read_text() for p in (folder.parent / "damaged").glob("*.reason.txt"))
    assert len(reasons) == 2 and "'processes'" in reasons[0] + reasons[1]
    assert any("shards.bin holds 100 bytes; its index needs 256" in r for r in reasons)
    assert "local checkpoint" in capfd.readouterr().err


def test_with_verify_a_step_without_its_checksums_is_damaged(tmp_path, mesh2x4):
    """The writer hashes a step before renaming it complete: a step with no SHA256SUMS was not
    written so (or lost them), and is not restored unchecked."""
    folder = _saved(tmp_path, mesh2x4, verify=True)
    (folder / "4" / "SHA256SUMS").unlink()
    got = _tier(tmp_path, verify=True).restore(_abstract(_state(mesh2x4)), None)
    assert got.step == 2
    reasons = [p.read_text() for p in (folder.parent / "damaged").glob("*.reason.txt")]
    assert len(reasons) == 1 and "SHA256SUMS is missing" in reasons[0]


def test_a_step_of_another_run_is_removed_not_restored(tmp_path, mesh2x4, capfd):
    folder = _saved(tmp_path, mesh2x4)
    kept = json.loads((tmp_path / "run" / RUN_ID_FILE).read_text())["run"]
    tier_file = folder / "4" / "tier.json"
    tier_file.write_text(json.dumps({**json.loads(tier_file.read_text()), "run": kept + 1}))  # an earlier run's
    got = _tier(tmp_path).restore(_abstract(_state(mesh2x4)), None)
    assert got.step == 2 and not (folder / "4").exists()
    assert "removed local checkpoint(s) owner_0/4" in capfd.readouterr().err
    fresh = _tier(tmp_path, fresh=True)  # a workdir begun afresh: a new run id
    assert fresh.restore(_abstract(_state(mesh2x4)), None) is None
    assert json.loads((tmp_path / "run" / RUN_ID_FILE).read_text())["run"] not in (kept, 0)


def test_a_step_that_does_not_fit_or_read_falls_back_to_the_persistent_tier(tmp_path, mesh2x4, monkeypatch, capfd):
    _saved(tmp_path, mesh2x4)
    other = {"w": jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh2x4, PartitionSpec()))}
    tier = _tier(tmp_path)
    assert tier.restore(other, None) is None
    assert tier.declined.startswith("the local tier's step 4 does not fit this run (['w'] was saved with shape")
    assert tier.restore(_abstract(_state(mesh2x4)), 6) is None  # the persistent tier's step 6 is newer
    assert tier.declined == "the local tier's newest complete step, 4, is older than step 6"

    def unreadable(*args):
        raise ValueError("buffer is smaller than requested size")

    monkeypatch.setattr(local_tier, "unpack", unreadable)
    assert tier.restore(_abstract(_state(mesh2x4)), None) is None
    assert tier.declined == (
        "the local tier's step 4 does not read (buffer is smaller than requested size) on process(es) 0"
    )
    assert "restoring the persistent tier" in capfd.readouterr().err


def test_a_failed_local_write_is_a_warning_and_the_next_save_writes(tmp_path, mesh2x4, monkeypatch, capfd):
    folder = _saved(tmp_path, mesh2x4, steps=(2,))
    write = local_tier.write_copy

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local_tier, "write_copy", full)
    tier = _tier(tmp_path)
    tier.restore(_abstract(_state(mesh2x4)), None)
    tier.save(4, _state(mesh2x4, 4), {"step": 4})
    monkeypatch.setattr(local_tier, "write_copy", write)
    tier.save(6, _state(mesh2x4, 6), {"step": 6})  # says step 4 failed; writes step 6
    tier.wait()
    err = capfd.readouterr().err
    assert "local checkpoint step 4 was not written on process 0" in err and "No space left on device" in err
    assert "the next local saves try again" in err
    assert sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) == [2, 6]
    monkeypatch.setattr(local_tier, "write_copy", full)
    tier.save(8, _state(mesh2x4, 8), {"step": 8})
    tier.close()  # the last write's failure: said at close
    assert "local checkpoint step 8 was not written" in capfd.readouterr().err


def test_processes_agree_on_the_newest_persistent_step(tmp_path, mesh2x4, monkeypatch):
    _saved(tmp_path, mesh2x4)  # local steps 2 and 4
    gather = local_tier.gather_rows

    def with_another_process(rows):  # one more process, whose listing of the persistent tier ends at step 6
        tables = gather(rows)
        if rows.shape[1] != 5:  # (the first gather's row: fresh, host, persistent newest, run ids)
            return tables
        other = rows.copy()
        other[0, 2] = 6
        return [*tables, other]

    monkeypatch.setattr(local_tier, "gather_rows", with_another_process)
    tier = _tier(tmp_path)
    assert tier.restore(_abstract(_state(mesh2x4)), None) is None  # this process lists no persistent step
    assert tier.declined == "the local tier's newest complete step, 4, is older than step 6"


def test_packing_holds_one_copy_of_the_shards_in_host_memory(mesh2x4):
    state = {"w": jax.device_put(np.ones((512, 512), np.float32), NamedSharding(mesh2x4, PartitionSpec("data")))}
    pack(state)  # (compiled and cached first)
    tracemalloc.start()
    try:
        buffer, _ = pack(state)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert buffer.nbytes == 2**20 and peak < 1.5 * buffer.nbytes  # no copy of the whole buffer beside it
