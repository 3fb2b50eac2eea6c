"""A run's train state before it exists: its shapes and shardings from the model's logical
axes (nothing allocated), and compiled inits that create it already sharded (setup.trace_run;
DiLoCo's replicas: engine/parallel/diloco.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from engine.config import Config
from engine.config.objective import objective_of
from engine.errors import UsageError
from engine.lm import finetune
from engine.parallel import sharding
from engine.runtime.units import human_bytes
from engine.state.train_state import FROZEN, REFERENCE, TrainState, split_variables
from models import ModelFamily
from models.family import projections


@dataclass(frozen=True)
class StatePlan:
    abstract: TrainState  # ShapeDtypeStructs with their target shardings (DiLoCo: a DilocoState's)
    shardings: TrainState  # NamedShardings
    param_layouts: list
    create: Callable  # (params=None) → a fresh TrainState, created already sharded (with these parameters)
    init: Callable  # (seed, run_hparams) → a fresh TrainState: pure, not compiled (vectorize.py maps it)
    seed: Any = None  # the config's, as init takes it
    hparams: Any = None  # setup.run_hparams(cfg)


def state_plan_of(init_state, with_params, shardings, param_layouts, seed, hparams) -> StatePlan:
    """A state plan from its pure init (seed, hparams) and init with given parameters (seed,
    hparams, params): both compiled to create the state already sharded."""
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        jax.eval_shape(init_state, seed, hparams),
        shardings,
    )
    # Created inside jit with output shardings: no device ever holds the whole state.
    create = jax.jit(init_state, out_shardings=shardings)
    create_with = jax.jit(with_params, out_shardings=shardings)

    def make(params=None):
        return create(seed, hparams) if params is None else create_with(seed, hparams, params)

    return StatePlan(abstract, shardings, param_layouts, make, init_state, seed, hparams)


def state_plan(cfg: Config, mesh: Mesh, family: ModelFamily, module, info, tx, hparams: dict) -> StatePlan:
    """The train state's shapes and shardings from the model's logical axes (no allocation),
    and a jitted init that creates it already sharded."""
    sample = family.task.sample_input(info)
    lora, adapted = finetune.lora_on(cfg), projections(family)

    def init_state(seed, hparams) -> TrainState:
        """Seed and hyperparameters are traced inputs: one compiled init serves every value."""
        init_key, train_key = jax.random.split(jax.random.key(seed))
        variables = module.init({"params": init_key, "dropout": init_key}, sample, train=False)
        params, variables = split_variables(sharding.unbox(variables))
        if lora:  # only the adapters train; the rest is the frozen base (engine/lm/finetune.py)
            params, base = finetune.split(params)
            variables = {**variables, FROZEN: finetune.quantize_base(base, adapted, cfg.finetune.base_dtype)}
        opt_state = tx.init(params)
        opt_state = opt_state._replace(
            hyperparams={k: jnp.asarray(hparams["optimizer"][k], v.dtype) for k, v in opt_state.hyperparams.items()}
        )
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            model_state=variables,
            opt_state=opt_state,
            rng=jax.random.key_data(train_key),
            hparams=hparams["schedule"],
        )

    # Shapes first, no allocation: the logical axes on the abstract parameters give the layout.
    abstract_vars = jax.eval_shape(
        lambda: module.init({"params": jax.random.key(0), "dropout": jax.random.key(0)}, sample, train=False)
    )
    param_layouts = sharding.layouts(abstract_vars["params"], cfg.mesh.rules, mesh)
    replicated = sharding.replicated(mesh)
    param_shardings = sharding.tree_shardings(abstract_vars["params"], param_layouts, mesh)
    abstract_params = sharding.unbox(abstract_vars["params"])
    model_state = split_variables(sharding.unbox(abstract_vars))[1]
    state_shardings = jax.tree.map(lambda _: replicated, model_state)
    if lora:  # the adapters' shapes and shardings; the frozen base's
        abstract_params, param_shardings, state_shardings[FROZEN] = finetune.split_plan(
            abstract_params, param_shardings, adapted, cfg.finetune.base_dtype
        )
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        tx, lambda _, s: s, abstract_opt, param_shardings, transform_non_params=lambda _: replicated
    )
    shardings = TrainState(
        step=replicated,
        params=param_shardings,
        model_state=state_shardings,
        opt_state=opt_shardings,
        rng=replicated,
        hparams=jax.tree.map(lambda _: replicated, hparams["schedule"]),
    )

    def with_params(seed, hparams, params) -> TrainState:  # (the unused init is left out by XLA)
        return init_state(seed, hparams).replace(params=params)

    if objective_of(cfg).keeps_reference(cfg) and not lora:  # (DPO's reference, engine/objectives/dpo_part.py)
        init_state, with_params, shardings = with_reference(init_state, with_params, shardings)
    return state_plan_of(init_state, with_params, shardings, param_layouts, np.int32(cfg.seed), hparams)


def with_reference(init_state, with_params, shardings) -> tuple[Callable, Callable, TrainState]:
    """(init, init with given parameters, shardings) of a state whose model state also holds
    REFERENCE: a copy of the starting parameters (DPO's reference model under full fine-tuning),
    laid out as the parameters."""

    def init(seed, hparams) -> TrainState:
        state = init_state(seed, hparams)
        return state.replace(model_state={**state.model_state, REFERENCE: jax.tree.map(jnp.copy, state.params)})

    def init_with(seed, hparams, params) -> TrainState:
        state = with_params(seed, hparams, params)
        return state.replace(model_state={**state.model_state, REFERENCE: jax.tree.map(jnp.copy, params)})

    return init, init_with, shardings.replace(model_state={**shardings.model_state, REFERENCE: shardings.params})


def check_fits(abstract_state, room: int) -> None:
    """UsageError when one device's share of the train state alone exceeds `room` bytes (its
    memory): a size that cannot fit (a LoRA rank, an embedding's dimension, a hash table) is
    refused from shapes, before anything is allocated or written."""
    sizes = []
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_state):
        shard = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        sizes.append((int(np.prod(shard, dtype=np.int64)) * getattr(leaf.dtype, "itemsize", 4), path, leaf.shape))
    total = sum(size for size, _, _ in sizes)
    if total <= room:
        return
    size, path, shape = max(sizes, key=lambda s: s[0])
    raise UsageError(
        f"the train state needs {human_bytes(total)} per device, more than a device's {human_bytes(room)} "
        f"(the largest part: {sharding.path_name(path)} {list(shape)}, {human_bytes(size)}); make the setting "
        "that sizes it smaller, or shard it over more devices (mesh.fsdp)"
    )
