"""DiLoCo on another replica count: a checkpoint of R_old replicas goes on with R_new from its last outer step.

An elastic job (engine/elastic/supervisor.py, fault.elastic) under train.sync=diloco that loses a
process restarts with fewer replicas: the replica axis (diloco.replica_axis) is the one that
shrinks. The restarted job reads the newest checkpoint of either tier with its replica-stacked
leaves (the replicas' parameters and model state, their inner optimizer states) in the count they
were saved with, unsplit over the replica axis (`refit`: for the moment of the restore each device
holds every saved replica's part of its piece, R_old times what one replica's state takes there),
and `resize` makes the state of R_new replicas from it, as torchft's DiLoCo does with a lost
replica's progress:
- kept: the global parameters and model state, the outer momentum and diloco.delay's pending
  change, which the last outer step left (so the outer optimizer goes on where it was);
- dropped: every replica's inner progress since that outer step (the survivors' alone would be the
  mean of another set of replicas than the one the round began with): the step goes back to the
  round's start B = step - step mod diloco.inner_steps, every replica starts from the global
  parameters and the survivors train the round again. The global batch is unchanged (each replica
  takes global_batch / R_new of its rows; data order and dropout keys, fold_in(rng, step), depend
  on the step only);
- the inner optimizer state of every replica: the saved replicas' mean (each float leaf averaged
  in float32; a leaf equal across them, such as the injected hyperparameters, kept as it is) and
  its integer leaves (optax's step counts) those of replica 0 less the dropped steps, so the counts
  agree with the step again. A mid-round checkpoint holds no inner state of the round's start:
  the moments keep what the dropped steps added to them.
A count that grows (a job restarted on more processes; a returning replica) goes the same way: every
replica starts from the global parameters with the mean inner state. The checkpoints after B, of
both tiers, belong to a past the job trains again: they are deleted (training saves those steps
anew). A checkpoint of the same replica count is restored as any other, exactly.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from engine.parallel.diloco import DilocoState

REPLICA_PARAMS = "replicas/params/"  # (a saved path, as packing.refitted gives it, of a replica-stacked leaf)


class Checkpoints(Protocol):
    """What `restore` asks of a run's checkpointer (engine/checkpoint/store.py's Checkpointer):
    the newest checkpoint read through a refit (a Restored: state, meta, step), and the ones
    after a step deleted."""

    def restore(self, abstract_state: Any) -> Any: ...

    def discard_after(self, step: int) -> None: ...


def replica_count(state: DilocoState) -> int:
    """How many replicas a DiLoCo state (arrays or ShapeDtypeStructs) holds."""
    leaves = jax.tree.leaves(state.replicas["params"])
    return int(leaves[0].shape[0]) if leaves else 1


def saved_replicas(shapes: dict[str, tuple]) -> Optional[int]:
    """The replica count of a saved DiLoCo state (its arrays' shapes by path), None when it holds none."""
    return next((int(shape[0]) for path, shape in shapes.items() if path.startswith(REPLICA_PARAMS) and shape), None)


def saved_layout(abstract: DilocoState, replicas: int) -> DilocoState:
    """`abstract` with `replicas` replicas, their stacked leaves unsplit over the replica axis (each
    replica's share split as in `abstract`): the target a checkpoint of another count is read into."""

    def widened(leaf):
        spec, mesh = leaf.sharding.spec, leaf.sharding.mesh
        sharding = NamedSharding(mesh, PartitionSpec(None, *spec[1:]))
        return jax.ShapeDtypeStruct((replicas, *leaf.shape[1:]), leaf.dtype, sharding=sharding)

    stacked = lambda tree: jax.tree.map(widened, tree)  # noqa: E731
    return abstract.replace(
        opt_state=stacked(abstract.opt_state),
        replicas={
            "params": stacked(abstract.replicas["params"]),
            "model_state": stacked(abstract.replicas["model_state"]),
        },
    )


def refit(abstract: DilocoState) -> Callable[[dict[str, tuple]], DilocoState]:
    """The Checkpointer's refit for a DiLoCo run: the saved arrays' shapes → the abstract state to
    read them into (`abstract` itself when the replica count is this run's)."""
    now = replica_count(abstract)

    def target(shapes: dict[str, tuple]) -> DilocoState:
        saved = saved_replicas(shapes)
        return abstract if saved in (None, now) else saved_layout(abstract, saved)

    return target


def _stacked(tree, replicas: int):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)


def _mean_inner(leaf, dropped):
    """One leaf of the inner optimizer states [R_old, ...] → the one every replica starts with."""
    if jnp.issubdtype(leaf.dtype, jnp.integer):  # a step count: back to the round's start
        return jnp.maximum(leaf[0] - dropped.astype(leaf.dtype), 0).astype(leaf.dtype)
    if not jnp.issubdtype(leaf.dtype, jnp.floating):
        return leaf[0]
    same = jnp.all(leaf == leaf[:1])
    return jnp.where(same, leaf[0], jnp.mean(leaf.astype(jnp.float32), axis=0).astype(leaf.dtype))


def resize(state: DilocoState, replicas: int, inner_steps: int) -> DilocoState:
    """The state of `replicas` replicas at the start of `state`'s round (the module docstring)."""
    dropped = state.step % inner_steps
    inner = jax.tree.map(lambda leaf: _mean_inner(leaf, dropped), state.opt_state)
    return state.replace(
        step=state.step - dropped,
        opt_state=_stacked(inner, replicas),
        replicas={"params": _stacked(state.params, replicas), "model_state": _stacked(state.model_state, replicas)},
    )


def restore(checkpointer: Checkpoints, abstract: Any, inner_steps: int) -> Optional[Any]:
    """The newest checkpoint of either tier in `abstract`'s replica count and shardings: as saved
    when that is its count, else resized at the start of its round (the steps after it discarded,
    `restored_from` saying so); None when there is none."""
    restored = checkpointer.restore(refit(abstract))
    if restored is None:
        return None
    saved, now = replica_count(restored.state), replica_count(abstract)
    if saved == now:
        return restored
    shardings = jax.tree.map(lambda leaf: leaf.sharding, abstract)
    resized = jax.jit(resize, static_argnums=(1, 2), out_shardings=shardings)(restored.state, now, inner_steps)
    step = restored.step - restored.step % inner_steps
    checkpointer.discard_after(step)
    meta: dict[str, Any] = {key: value for key, value in restored.meta.items() if key != "window"}
    meta.update(
        step=step,
        data={**meta.get("data", {}), "next_step": step},
        restored_from=(
            f"{meta.get('restored_from', 'a checkpoint')} at step {restored.step}, saved with {saved} DiLoCo "
            f"replicas: {now} go on from its last outer step, step {step} (the round's inner steps dropped)"
        ),
    )
    return restored._replace(state=resized, meta=meta, step=step)  # (the checkpointer's Restored)
