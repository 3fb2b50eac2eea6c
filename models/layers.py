"""Layers shared by the models: parameter initialisers that carry logical axis names, and
a dropout whose mask depends on each example's position in the global batch, not on how
the batch is split over devices, microbatches or a pmap axis."""
from __future__ import annotations

import contextvars
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp


# Set by the engine while it traces a step: logical activation axes → a sharding constraint.
# Models only name the axes; unset (eager, pmap, tests of a bare module) it does nothing.
activation_constraint: contextvars.ContextVar[Optional[Callable]] = contextvars.ContextVar(
    "activation_constraint", default=None)


def constrain(x, axes: tuple[Optional[str], ...]):
    """Asks that activation `x` be laid out by its logical axes, e.g. ("batch", "seq", "embed")."""
    apply = activation_constraint.get()
    return x if apply is None else apply(x, axes)


def param_init(init, axes: tuple[Optional[str], ...]):
    """An initialiser whose parameter carries logical axis names (mapped to a mesh by config)."""
    return nn.with_logical_partitioning(init, axes)


def dense(features: int, axes: tuple[Optional[str], Optional[str]], dtype, param_dtype, name=None, use_bias=True):
    """nn.Dense with logical names on kernel [in, out] and bias [out]."""
    return nn.Dense(
        features,
        use_bias=use_bias,
        dtype=dtype,
        param_dtype=param_dtype,
        kernel_init=param_init(nn.initializers.lecun_normal(), axes),
        bias_init=param_init(nn.initializers.zeros_init(), (axes[1],)),
        name=name,
    )


class Dropout(nn.Module):
    """Inverted dropout; example i's mask is drawn from fold_in(rng, example_ids[i]).

    `rate` given at call time (a traced scalar from the engine) overrides the configured one,
    so runs that differ only in dropout rate share one compiled step."""

    rate: float

    @nn.compact
    def __call__(self, x, *, train: bool, example_ids: Optional[jax.Array] = None, rate=None):
        rate = self.rate if rate is None else rate
        if not train or (isinstance(rate, float) and rate == 0.0):
            return x
        if example_ids is None:  # a standalone call: ids are the row numbers
            example_ids = jnp.arange(x.shape[0])
        key = self.make_rng("dropout")
        keep = 1.0 - rate

        def row_mask(example_id):
            return jax.random.bernoulli(jax.random.fold_in(key, example_id), keep, x.shape[1:])

        mask = jax.vmap(row_mask)(example_ids)  # [batch, ...]
        return jnp.where(mask, x / keep, 0).astype(x.dtype)
