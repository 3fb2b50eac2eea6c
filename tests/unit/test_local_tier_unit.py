"""The local checkpoint tier (checkpoint.local_dir): frequent saves of each process's shards to
node-local storage and a peer's, restored when newer than the persistent tier, bit-identically;
damaged or lost copies skipped; the config's keys checked."""

import jax
import numpy as np
import pytest
from support.configs import ROOT

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
    checkpointer = open_checkpoints(tmp_path / "run" / "checkpoints", cfg, write=True)
    leftover = tmp_path / "run" / "checkpoints" / "3.orbax-checkpoint-tmp-1764288000"
    (leftover / "state").mkdir(parents=True)
    checkpointer.save(5, {"w": jax.device_put(np.ones(4, np.float32))}, {"step": 5})
    checkpointer.close()
    assert checkpointer.steps() == [5] and not leftover.exists()
    assert not list(leftover.parent.glob("*.orbax-checkpoint-tmp*"))
