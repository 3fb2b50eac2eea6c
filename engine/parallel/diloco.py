"""DiLoCo (train.sync=diloco): R replicas of the model, each on its own devices and its own
share of every batch, take diloco.inner_steps (H) optimizer steps alone; then their mean
parameter change is applied to the global parameters by an outer optimizer (Nesterov
momentum by default), and every replica starts the next round from the result.

The replicas live on a `replica` mesh axis taken from mesh.data or its slices (mesh.dcn_data):
inside a replica a step is the run's own step (fsdp, tensor, accumulation), `jax.vmap`ped over
the replicas with `spmd_axis_name`, so the compiled inner step moves nothing between replicas
(its metrics stay split over them too, summed only when a log line is written). The outer step
is a second compiled program, run at the end of each round: the mean over replicas is the one
all-reduce of the parameters per round, H times fewer than data parallelism's every step
(engine/parallel/sync.py compiles and runs it as train.sync's `diloco` strategy).

The overlapped outer step (diloco.delay=1; Kale et al. 2025's "delayed outer gradients", the
one-round-stale update of asynchronous parameter-server training). Round t starts every replica
at the global parameters θ_t; at its end each replica r has θ_t^r and
    Δ̄_t = θ_t − mean_r(θ_t^r)                          (the round's all-reduce, float32)
    θ_{t+1} = OuterOpt(θ_t, Δ̄_{t−1}),   Δ̄_{−1} = 0      (delay=0: OuterOpt(θ_t, Δ̄_t))
and every replica starts round t+1 at θ_{t+1}: its own progress of round t reaches the global
parameters only through Δ̄_t, one round later. The step applies nothing at t=0 (the momentum
stays zero); Δ̄_t waits in the state (`pending`) until the end of round t+1, so the new round's
start does not depend on round t's all-reduce, which can run beside round t+1's inner steps
(here the outer step is still its own program between two rounds: the rule is the overlapped
one, the schedule not yet).
OuterOpt is diloco.outer_optimizer on the momentum m (nesterov: m ← μm + g, θ ← θ − lr(g + μm);
momentum: θ ← θ − lr·m; sgd: θ ← θ − lr·g). Non-trainable model state (batch statistics) is
averaged over the replicas at each round's end, undelayed.

The state (DilocoState) holds what exact resumption needs at any step, mid-round too: the
global parameters (what evaluation, export and sampling read: `step.weights_of`), the
replicas' parameters and inner optimizer states (a leading replica axis), the outer
momentum and, with diloco.delay=1, the pending Δ̄ (float32, sharded as the parameters).
Checkpoints are ordinary orbax checkpoints of that tree.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from engine.parallel.axes import BATCH_AXES
from engine.state.train_state import TrainState

REPLICA = "replica"  # the mesh axis over replicas (engine/parallel/axes.py)
INNER_BATCH_AXES = tuple(a for a in BATCH_AXES if a != REPLICA)


@flax.struct.dataclass
class DilocoState:
    """A TrainState's fields (global parameters; the replicas' inner optimizer states in
    `opt_state`, with a leading replica axis) and the replicas' own parameters and the outer
    momentum."""

    step: Any
    params: Any  # the global parameters θ (evaluation, export and sampling read these)
    model_state: Any
    opt_state: Any  # each replica's inner optimizer state: [replicas, ...] leaves
    rng: Any
    hparams: Any
    replicas: Any  # {"params": [replicas, ...], "model_state": [replicas, ...]}: where each replica is
    momentum: Any  # the outer optimizer's momentum (float32, like params)
    pending: Any = None  # diloco.delay=1: the last round's mean change Δ̄, applied at the next round's end (float32)

    if TYPE_CHECKING:

        def replace(self, **changes) -> DilocoState: ...


@dataclasses.dataclass(frozen=True)
class Layout:
    """The replicas of a mesh, and what one round exchanges."""

    replicas: int
    inner_steps: int
    param_count: int

    @property
    def bytes_per_round(self) -> int:
        """The outer gradient each replica contributes to the all-reduce (float32 parameters)."""
        return 4 * self.param_count

    def text(self) -> str:
        from engine.runtime.units import human_bytes

        return (
            f"DiLoCo: {self.replicas} replicas, each {self.inner_steps} steps alone per round; "
            f"{human_bytes(self.bytes_per_round)} of outer gradient per replica per round "
            f"({human_bytes(self.bytes_per_round / self.inner_steps)}/step; data parallelism: "
            f"{human_bytes(self.bytes_per_round)}/step)"
        )


def _stacked_sharding(mesh: Mesh, sharding: NamedSharding) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(REPLICA, *sharding.spec))


def _broadcast(tree, replicas: int):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)


def _zeros_f32(params):
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)


def from_train_state(base: TrainState, replicas: int, delay: int = 0) -> DilocoState:
    """A fresh round: every replica at the global parameters, with the base's optimizer state
    (delay=1: a zero pending change, so the first round's outer step applies nothing)."""
    return DilocoState(
        step=base.step,
        params=base.params,
        model_state=base.model_state,
        opt_state=_broadcast(base.opt_state, replicas),
        rng=base.rng,
        hparams=base.hparams,
        replicas={"params": _broadcast(base.params, replicas), "model_state": _broadcast(base.model_state, replicas)},
        momentum=_zeros_f32(base.params),
        pending=_zeros_f32(base.params) if delay else None,
    )


def state_shardings(mesh: Mesh, base: TrainState, delay: int = 0) -> DilocoState:
    """The DiLoCo state's shardings from a TrainState's: replica-stacked leaves split over the
    replica axis, each replica's share laid out as a run's state is."""
    stacked = lambda tree: jax.tree.map(lambda s: _stacked_sharding(mesh, s), tree)  # noqa: E731
    return DilocoState(
        step=base.step,
        params=base.params,
        model_state=base.model_state,
        opt_state=stacked(base.opt_state),
        rng=base.rng,
        hparams=base.hparams,
        replicas={"params": stacked(base.params), "model_state": stacked(base.model_state)},
        momentum=base.params,
        pending=base.params if delay else None,
    )


def replica_view(state: DilocoState) -> TrainState:
    """The replicas as a TrainState with a leading replica axis on params, model_state and opt_state."""
    return TrainState(
        step=state.step,
        params=state.replicas["params"],
        model_state=state.replicas["model_state"],
        opt_state=state.opt_state,
        rng=state.rng,
        hparams=state.hparams,
    )


REPLICA_AXES = TrainState(step=None, params=0, model_state=0, opt_state=0, rng=None, hparams=None)


def make_inner_step(train_step: Callable, mesh: Mesh) -> Callable:
    """A run's one-step train_step → the same step taken by every replica on its rows of the
    batch ([batch, ...] → [replicas, batch / replicas, ...]; each example keeps its row of the
    global batch for its dropout mask): (DilocoState, batch) → (state, metrics [replicas])."""
    replicas = mesh.shape[REPLICA]
    split = NamedSharding(mesh, PartitionSpec(REPLICA, INNER_BATCH_AXES))
    stepped = jax.vmap(train_step, in_axes=(REPLICA_AXES, 0), out_axes=(REPLICA_AXES, 0), spmd_axis_name=REPLICA)

    def inner_step(state: DilocoState, batch):
        rows = next(iter(batch.values())).shape[0]
        batch = dict(batch, example_id=jnp.arange(rows, dtype=jnp.int32))
        batch = jax.tree.map(
            lambda x: jax.lax.with_sharding_constraint(x.reshape(replicas, rows // replicas, *x.shape[1:]), split),
            batch,
        )
        new, metrics = stepped(replica_view(state), batch)
        state = state.replace(
            step=new.step,
            opt_state=new.opt_state,
            replicas={"params": new.params, "model_state": new.model_state},
        )
        return state, metrics  # (vmap's out_axes give every metric its replica axis)

    return inner_step


def outer_update(cfg, params, momentum, outer_grad):
    """diloco.outer_optimizer's step with outer gradient `outer_grad` (float32): (params, momentum)."""
    kind, lr, mu = cfg.outer_optimizer, cfg.outer_learning_rate, cfg.outer_momentum
    if kind == "sgd":
        update = outer_grad
    else:
        momentum = jax.tree.map(lambda m, d: mu * m + d, momentum, outer_grad)
        update = momentum if kind == "momentum" else jax.tree.map(lambda m, d: d + mu * m, momentum, outer_grad)
    params = jax.tree.map(lambda g, u: (g.astype(jnp.float32) - lr * u).astype(g.dtype), params, update)
    return params, momentum


def make_sync_step(cfg) -> Callable:
    """The outer step: (DilocoState) → (state with new global parameters and every replica at
    them, {"drift", "outer_grad_norm"}). The outer gradient is θ − mean(θ_replica), in float32
    (diloco.delay=1: this round's is kept in `pending` and the last round's applied; the module
    docstring); drift is the replicas' root-mean-square distance from θ before the exchange, and
    outer_grad_norm this round's outer gradient's norm."""

    def sync_step(state: DilocoState):
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        replica_params = state.replicas["params"]
        outer_grad = jax.tree.map(lambda g, r: f32(g) - jnp.mean(f32(r), axis=0), state.params, replica_params)
        squares = [
            jnp.sum(jnp.square(f32(r) - f32(g)[None]), axis=tuple(range(1, r.ndim)))
            for g, r in zip(jax.tree.leaves(state.params), jax.tree.leaves(replica_params))
        ]
        drift = jnp.sqrt(jnp.mean(sum(squares))) if squares else jnp.zeros(())
        applied = state.pending if cfg.delay else outer_grad
        params, momentum = outer_update(cfg, state.params, state.momentum, applied)
        model_state = jax.tree.map(lambda r: jnp.mean(f32(r), axis=0).astype(r.dtype), state.replicas["model_state"])
        replicas = jax.tree.leaves(replica_params)[0].shape[0] if replica_params else 1
        new = state.replace(
            params=params,
            model_state=model_state,
            momentum=momentum,
            replicas={"params": _broadcast(params, replicas), "model_state": _broadcast(model_state, replicas)},
            pending=outer_grad if cfg.delay else None,
        )
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(d)) for d in jax.tree.leaves(outer_grad)))
        return new, {"drift": drift, "outer_grad_norm": norm}

    return sync_step


def state_functions(base, mesh: Mesh, delay: int = 0) -> tuple[Callable, Callable, DilocoState]:
    """From a run's state plan (setup._StatePlan): DiLoCo's (init(seed, hparams), init with
    given parameters (seed, hparams, params), shardings). Each replica's parameters and inner
    optimizer state are stacked over the replica axis, the global ones beside them (delay=1:
    and the pending outer gradient, laid out as the parameters)."""
    replicas = mesh.shape[REPLICA]

    def init_state(seed, hparams):
        return from_train_state(base.init(seed, hparams), replicas, delay)

    def with_params(seed, hparams, params):
        return from_train_state(base.init(seed, hparams).replace(params=params), replicas, delay)

    return init_state, with_params, state_shardings(mesh, base.shardings, delay)


def param_count(abstract_params) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(abstract_params)))
