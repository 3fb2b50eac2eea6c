"""The local checkpoint tier (checkpoint.local_dir): frequent saves of each process's shards to
node-local storage and a peer's, restored when newer than the persistent tier, bit-identically;
damaged or lost copies skipped; the config's keys checked; the exchange with the peers in the
background (a save returns before it, a restore never takes one that did not finish)."""

import shutil
import threading

import jax
import numpy as np
import pytest
from support.configs import ROOT
from support.local_tier import HeldTransport, two_process_tiers

from engine.checkpoint.local_files import read_copy
from engine.checkpoint.store import open_checkpoints
from engine.config import load_config
from engine.errors import UsageError


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


@pytest.mark.nocompile
def test_a_killed_save_s_leftover_is_removed_at_the_next_save(tmp_path):
    """Issue 57: a persistent save killed mid-write left `N.orbax-checkpoint-tmp-*` behind for good."""
    cfg = load_config(ROOT / "configs" / "mnist_mlp.yaml", [], str(tmp_path / "run"))
    leftover = tmp_path / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-1764288000"
    (leftover / "state").mkdir(parents=True)  # (there before the next run opens its checkpoints, as a killed save's is)
    checkpointer = open_checkpoints(tmp_path / "run" / "checkpoints", cfg, write=True)
    checkpointer.save(5, {"w": jax.device_put(np.ones(4, np.float32))}, {"step": 5})
    checkpointer.close()
    assert checkpointer.steps() == [5] and not leftover.exists()
    assert not list(leftover.parent.glob("*.orbax-checkpoint-tmp*"))


def _shards(process, step):
    return {"w": np.arange(4, dtype=np.float32) + 100 * process + step}  # (host arrays: packing compiles nothing)


def _newest_complete(tiers):
    """The step a restore would take now (a SIGKILL at this moment): the newest complete across the processes."""
    chosen = tiers[0]._choose([tier._inventory() for tier in tiers], None)
    return None if chosen is None else chosen[0]


def test_a_local_save_returns_before_its_peer_exchange_and_a_restore_never_takes_an_unfinished_one(tmp_path):
    transport = HeldTransport()
    tiers = two_process_tiers(tmp_path, transport)
    for tier in tiers:
        tier.save(2, _shards(tier.process, 2), {"step": 2})
    for tier in tiers:
        tier.wait()
    assert _newest_complete(tiers) == 2  # step 2 exchanged in full
    transport.hold()
    for tier in tiers:
        tier.save(4, _shards(tier.process, 4), {"step": 4})  # returns with the exchange held back
    transport.note("saves returned")
    assert _newest_complete(tiers) == 2  # no copy of step 4 is complete anywhere: not restored
    assert not list(tmp_path.glob("host*/*/process_*/owner_*/4"))
    # the next save, and the end, wait for the save in flight (its copies sent first)
    second = threading.Thread(
        target=lambda: (tiers[0].save(6, _shards(0, 6), {"step": 6}), transport.note("6 returned"))
    )
    second.start()
    second.join(0.3)
    transport.release()
    second.join()
    tiers[1].save(6, _shards(1, 6), {"step": 6})
    for tier in tiers:
        tier.close()
    sent = [event for event in transport.log if event.startswith("sent ")]
    assert transport.log.index("saves returned") < transport.log.index("sent 7/4/2/0-1")
    assert transport.log.index("sent 7/4/2/0-1") < transport.log.index("6 returned")
    assert sorted(sent) == sorted(
        f"sent 7/{s}/{n}/{a}-{b}" for s, n in ((2, 1), (4, 2), (6, 3)) for a, b in ((0, 1), (1, 0))
    )
    assert _newest_complete(tiers) == 6
    for process, owner in ((0, 0), (0, 1), (1, 1), (1, 0)):  # each process's copy at itself and at its peer
        got = read_copy(tiers[process]._owner_dir(owner) / "6", owner, False)
        assert np.array_equal(np.frombuffer(got.buffer, np.float32), _shards(owner, 6)["w"])


def test_a_failed_exchange_is_reported_once_and_leaves_no_step(tmp_path, capfd):
    tiers = two_process_tiers(tmp_path, HeldTransport(held=True), timeout=0.05)  # never released: the peers never send
    for tier in tiers:
        tier.save(2, _shards(tier.process, 2), {"step": 2})
    tiers[0].wait()
    err = capfd.readouterr().err
    assert err.count("local checkpoint step 2 was not written on process 0") == 1 and "7/2/1/0-1 was held back" in err
    tiers[0].wait()  # (reported once)
    tiers[1].close()
    err = capfd.readouterr().err
    assert "process 0" not in err and err.count("local checkpoint step 2 was not written on process 1") == 1
    assert _newest_complete(tiers) is None and not list(tmp_path.glob("host*/*/process_*/owner_*/2"))


def test_a_step_is_complete_while_each_process_s_shards_survive_somewhere(tmp_path):
    """A lost host's shards come from its peer's copy; once both copies are lost the step is not
    complete (the persistent tier restores: tests/e2e/test_local_tier_e2e.py shows the console)."""
    tiers = two_process_tiers(tmp_path, HeldTransport())
    for step in (2, 4):
        for tier in tiers:
            tier.save(step, _shards(tier.process, step), {"step": step})
    for tier in tiers:
        tier.close()
    shutil.rmtree(tiers[1].root)  # process 1's host lost its local storage
    step, saved, holders = tiers[0]._choose([tier._inventory() for tier in tiers], None)
    assert (step, saved, holders) == (4, 2, {0: 0, 1: 0}) and tiers[0]._from_peers == [1]
    assert tiers[0]._choose([tier._inventory() for tier in tiers], 6) is None  # older than the persistent step
    assert tiers[0].declined == "the local tier's newest complete step, 4, is older than step 6"
    shutil.rmtree(tiers[0]._owner_dir(1))  # and the peer's copy of its shards
    assert tiers[0]._choose([tier._inventory() for tier in tiers], None) is None
    assert tiers[0].declined == "the local tier holds no complete step of this run"
