"""The pure train and eval steps. Nothing here knows about files, logging or meshes."""

from __future__ import annotations

from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax

from engine.config.objective import step_hparam_names
from engine.objectives.lm import make_loss_fn as make_loss_fn  # (its home; run/cost and tests read it here)
from engine.optim.optimizer import learning_rate_at
from engine.state.columns import pack_metrics
from engine.state.train_state import (
    UNTRAINED,
    TrainState,
)


def _example_ids(batch, axis_name: Optional[str]) -> jax.Array:
    """Each example's row in the global batch (dropout masks are drawn per row)."""
    local = next(iter(batch.values())).shape[0]
    ids = jnp.arange(local, dtype=jnp.int32)
    if axis_name is not None:  # under pmap each device holds rows [index * local, (index + 1) * local)
        ids = ids + jax.lax.axis_index(axis_name) * local
    return ids


def make_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    schedule: str,
    grad_accum_steps: int = 1,
    axis_name: Optional[str] = None,
) -> Callable:
    """train_step(state, batch) → (state, metrics); pure, so jit, pmap and eager all run it."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def train_step(state: TrainState, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        if "example_id" not in batch:  # (DiLoCo's replicas are given their rows of the global batch)
            batch = dict(batch, example_id=_example_ids(batch, axis_name))
        if grad_accum_steps == 1:
            (_, (metrics, model_state)), grads = grad_fn(
                state.params, state.model_state, batch, rng, True, state.hparams
            )
        else:
            # Microbatch k takes rows k, k + n, k + 2n, … (n = grad_accum_steps): each device keeps
            # its own rows, so splitting a batch sharded on dim 0 needs no communication.
            micro = jax.tree.map(
                lambda x: x.reshape(x.shape[0] // grad_accum_steps, grad_accum_steps, *x.shape[1:]).swapaxes(0, 1),
                batch,
            )

            def accumulate(carry, microbatch):
                grad_sum, model_state = carry
                (_, (metrics, model_state)), grads = grad_fn(
                    state.params, model_state, microbatch, rng, True, state.hparams
                )
                # weighted by the microbatch's counted targets: the sum is the gradient of the
                # whole batch's loss sum, also when microbatches count different numbers of
                # targets (packed documents, padding)
                weighted = jax.tree.map(lambda total, g: total + g * metrics["count"], grad_sum, grads)
                return (weighted, model_state), metrics

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            (grads, model_state), metrics = jax.lax.scan(accumulate, (zeros, state.model_state), micro)
            metrics = jax.tree.map(lambda m: jnp.sum(m, axis=0), metrics)
            grads = jax.tree.map(lambda g: g / jnp.maximum(metrics["count"], 1.0), grads)  # = one big batch's mean
        if axis_name is not None:  # pmap: average over replicas (jit does this from the shardings)
            grads = jax.lax.pmean(grads, axis_name)
            metrics = jax.lax.psum(metrics, axis_name)
            # (the untrained collections, a frozen base and DPO's reference, are alike on every replica)
            model_state = {k: v if k in UNTRAINED else jax.lax.pmean(v, axis_name) for k, v in model_state.items()}
        learning_rate = learning_rate_at(schedule, state.step, state.hparams)
        opt_state = state.opt_state._replace(
            hyperparams={**state.opt_state.hyperparams, "learning_rate": learning_rate}
        )
        updates, new_opt_state = tx.update(grads, opt_state, state.params)
        # the state keeps its dtypes (float32 hyperparameters would promote bfloat16 moments)
        opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_opt_state, opt_state)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(metrics, grad_norm=optax.tree.norm(grads), learning_rate=learning_rate)
        new_state = state.replace(step=state.step + 1, params=params, model_state=model_state, opt_state=opt_state)
        return new_state, metrics

    return train_step


def make_block_step(
    train_step: Callable, steps: int, steps_per_call: int = 1, resident: bool = False, sums: tuple[str, ...] = ()
) -> Callable:
    """`steps_per_call` train steps over a block of `steps` batches ([steps, batch, ...]):
    step s uses batch s % steps → (state, metrics packed as float32 [steps_per_call, columns]
    (engine/state/columns.py); `sums`: the objective's own metric columns).

    Batches travel to the device a block at a time, so per step the host only dispatches;
    with steps_per_call > 1 (a divisor of `steps`) the steps run in a device-side loop and
    the host dispatches once per call. The metrics come back as one array per call, not one
    per metric: fewer buffers to create per call and to fetch per log line.

    resident: the block is (the whole train split on the device, {"index": [steps, batch]});
    each step gathers its batch's rows from the split (data.placement=device)."""

    def one_step(state: TrainState, block):
        if resident:
            data, indices = block
            index = jax.lax.dynamic_index_in_dim(indices["index"], state.step % steps, keepdims=False)
            batch = {name: jnp.take(array, index, axis=0, mode="clip") for name, array in data.items()}
        else:
            batch = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, state.step % steps, keepdims=False), block)
        state, metrics = train_step(state, batch)
        return state, pack_metrics(metrics, sums)  # (a leading replica axis stays: [replicas, columns])

    def block_step(state: TrainState, block):
        if steps_per_call == 1:
            state, packed = one_step(state, block)
            return state, packed[None]
        return jax.lax.scan(lambda state, _: one_step(state, block), state, length=steps_per_call)

    return block_step


def weights_of(state) -> dict:
    """What evaluation, export and sampling read of a train state: {"params", "model_state"} (a
    TrainState's, or the global ones of another state kind: engine/parallel/diloco.py's), and
    {"hparams"} where the state holds an objective's step hparams (DPO's β scores the eval split too)."""
    weights = {"params": state.params, "model_state": state.model_state}
    hparams = getattr(state, "hparams", None)
    read = {name: hparams[name] for name in step_hparam_names() if isinstance(hparams, dict) and name in hparams}
    return {**weights, "hparams": read} if read else weights


def make_eval_step(loss_fn: Callable, axis_name: Optional[str] = None) -> Callable:
    """eval_step(weights, batch) → metric sums over the batch's real (mask = 1) examples
    (weights: weights_of(state))."""

    def eval_step(weights: dict, batch):
        _, (metrics, _) = loss_fn(weights["params"], weights["model_state"], batch, None, False, weights.get("hparams"))
        if axis_name is not None:
            metrics = jax.lax.psum(metrics, axis_name)
        return metrics

    return eval_step
