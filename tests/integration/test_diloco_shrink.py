"""DiLoCo onto fewer replicas (engine/parallel/diloco_shrink.py): a mid-round checkpoint of 4 replicas
restored onto 3 keeps the global parameters, the outer momentum and the pending change, goes back
to the round's start with every replica at the global parameters and the replicas' mean inner
optimizer state; the run goes on from there; the elastic plan refuses a job left with one replica."""

import jax
import numpy as np

from engine.checkpoint.store import open_checkpoints
from engine.parallel import diloco_shrink
from engine.run.setup import build_run
from engine.run.single import fit

INNER, SAVED = 4, 6  # the checkpoint at step 6 is mid-round: the round began at step 4


RUN = [
    "train.sync=diloco",
    "diloco.replica_axis=data",
    "diloco.delay=1",
    f"diloco.inner_steps={INNER}",
    "mesh.fsdp=2",
    "model.hidden_sizes=[8]",
    "train.global_batch_size=24",
    f"checkpoint.every_steps={SAVED}",
    "eval.every_steps=0",
]


def replicas(make_config, count, steps, workdir):
    return make_config(
        "mnist_mlp.yaml",
        *RUN,
        f"mesh.data={count}",
        f"mesh.num_devices={2 * count}",
        f"train.steps={steps}",
        workdir=workdir,
    )


def test_four_replicas_mid_round_go_on_as_three_from_the_last_outer_step(make_config, tmp_path):
    four = replicas(make_config, 4, SAVED, tmp_path / "run")
    saved_run = build_run(four)
    fit(four, saved_run)
    reader = open_checkpoints(tmp_path / "run" / "checkpoints", four)
    saved = reader.restore(saved_run.abstract_state)
    assert saved.step == SAVED and diloco_shrink.replica_count(saved.state) == 4
    three = replicas(make_config, 3, 10, tmp_path / "run")
    run = build_run(three)
    got = diloco_shrink.restore(reader, run.abstract_state, INNER)  # (read-only: nothing discarded)
    reader.close()
    state, old = got.state, saved.state
    assert got.step == 4 and int(state.step) == 4 and got.meta["data"]["next_step"] == 4
    assert "saved with 4 DiLoCo replicas: 3 go on from its last outer step, step 4" in got.meta["restored_from"]
    assert diloco_shrink.replica_count(state) == 3
    for field in ("params", "momentum", "pending", "model_state", "rng", "hparams"):  # the last outer step's
        jax.tree.map(np.testing.assert_array_equal, getattr(state, field), getattr(old, field))
    jax.tree.map(
        lambda r, g: np.testing.assert_array_equal(r, np.broadcast_to(g, r.shape)),
        state.replicas["params"],
        state.params,
    )
    assert np.abs(np.asarray(jax.tree.leaves(old.pending)[0])).max() > 0  # (a pending change to keep)

    def inner(new, before):
        before = np.asarray(before)
        if np.issubdtype(before.dtype, np.integer):  # the step counts: back to the round's start
            np.testing.assert_array_equal(new, np.broadcast_to(before[0] - (SAVED - 4), new.shape))
        else:
            np.testing.assert_allclose(new, np.broadcast_to(before.mean(0), new.shape), rtol=1e-6, atol=1e-9)

    jax.tree.map(inner, state.opt_state, old.opt_state)
    assert any(np.ptp(np.asarray(x), axis=0).max() > 0 for x in jax.tree.leaves(old.opt_state))  # (a real mean)
    shardings = jax.tree.map(lambda x: x.sharding, run.abstract_state)
    assert jax.tree.map(lambda x: x.sharding, state) == shardings
    # the run itself: restores step 6 onto 3 replicas, trains steps 5..10, saves step 6 anew
    result = fit(three, run)
    assert sorted(result.losses) == list(range(5, 11)) and result.steps == 10
    assert int(result.state.step) == 10 and diloco_shrink.replica_count(result.state) == 3
