"""The model FLOPs of one train step (StepCost): XLA's cost analysis of the compiled step, or of the
same step lowered without the settings that change the compiled work but not the model's, or the
model family's formula. Read by the run's throughput and MFU (engine/observe/perf.py) and by
`plan` (engine/plan/compiled.py)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from engine.data import example_spec
from engine.observe.perf import StepCost
from engine.run.step import make_loss_fn, make_train_step
from engine.state.train_state import FROZEN, TrainState, split_variables


def compiled_flops(compiled) -> float:
    """XLA's FLOP count of a compiled program (0 where it gives none)."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return float((analysis or {}).get("flops", 0.0))


def lowered_flops(lowered) -> Optional[float]:
    """XLA's FLOP count of a lowered program; None where the backend gives none."""
    analysis = lowered.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    return float(analysis["flops"]) if analysis and "flops" in analysis else None


def step_cost(
    cfg, family, module, dataset, tx, abstract_state, devices, compiled, copies: int = 1, auto_chunk=0, objective=None
) -> StepCost:
    """The model FLOPs of one train step per device.

    XLA's cost analysis of the compiled step counts them, except where the run's settings
    change the compiled work but not the model's: the family's FLOPs `work_settings` (remat
    recomputes, a chunked loss is a loop XLA counts once, fused attention a custom call it
    cannot count) and gradient accumulation or several steps per call (loops). Then the
    same step is lowered (a trace, no compile) without them and counted; where the backend
    cannot analyse a lowered program (GPU and TPU plugins may not), the family's formula.
    `copies`: runs the compiled program steps at once (a vectorised group's trials; XLA's count
    of the program already holds them all); `auto_chunk`: the loss chunk model.loss_chunk=0 chose
    as the step was traced (0: the whole sequence at once); `objective`: the run's record
    (engine/config/objective.py; None: a language model's), which counts an example."""
    info = dataset.info
    accounting = family.flops  # None: no formula, and no settings XLA would miscount
    per_example, formula = (
        analytic_per_example(cfg, accounting, info, abstract_state, objective) if accounting else (0.0, "")
    )
    analytic = per_example * cfg.train.global_batch_size * copies / devices
    formula = formula if analytic else ""
    flops = compiled_flops(compiled) if compiled is not None else 0.0
    if not flops:
        return StepCost(0.0, "none (the step was not compiled)", analytic, formula)
    reason = accounting.formula_only(cfg.model) if accounting else ""
    if reason and analytic:
        return StepCost(analytic, f"analytic formula ({formula}): {reason}", analytic, formula)
    # as the module resolved them (an `auto` setting names what it chose)
    plain = accounting.work_settings if accounting else {}
    resolved = accounting.settings_used(cfg.model, module) if accounting else {}
    differs = [f"{key}={resolved[key]}" for key, value in plain.items() if resolved[key] != value]
    differs += [f"loss_chunk={auto_chunk} (auto)"] if auto_chunk else []
    differs += [
        f"{key}={getattr(cfg.train, key)}"
        for key in ("grad_accum_steps", "steps_per_call")
        if getattr(cfg.train, key) > 1
    ]
    if not differs:
        return StepCost(flops, "XLA cost analysis of the compiled step", analytic, formula)
    settings = ", ".join(differs)
    reference = _reference_flops(cfg, family, dataset, tx, abstract_state, objective)
    if reference is not None:
        return StepCost(
            reference * copies / devices, f"XLA cost analysis of the same step without {settings}", analytic, formula
        )
    compiled_source = f"XLA cost analysis of the compiled step, with {settings}"
    if analytic:
        return StepCost(
            analytic, f"analytic formula ({formula}); {compiled_source} is not the model's", analytic, formula
        )
    return StepCost(flops, compiled_source, analytic, formula)


def analytic_per_example(cfg, accounting, info, abstract_state, objective=None) -> tuple[float, str]:
    """(the model FLOPs of one example of a train step by the family's formula, in words).

    The formula is a full training step's: forward, backward through the activations and the
    weights' gradients, 2 + 2 + 2 per parameter and token. LoRA (a FROZEN base in the model
    state): the base's weights get no gradient, so its parameters count 4 (forward and backward
    through the activations), the adapters 6. The objective's record counts an example from
    that (`objective`, engine/config/objective.py: a DPO pair is two rows through the policy and the reference's)."""
    trained = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_state.params))
    frozen_tree = abstract_state.model_state.get(FROZEN, {}) if isinstance(abstract_state.model_state, dict) else {}
    frozen = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(frozen_tree))
    full = accounting.per_example(cfg.model, info, trained + frozen)  # every parameter trained
    # the base's weight gradients, 2 of the formula's 6 per parameter (it is linear in them; an
    # embedding table the formula takes as a lookup is counted too: a slight undercount), at most
    # a third of the whole: never a negative count
    base_weight_grads = min((full - accounting.per_example(cfg.model, info, trained)) / 3, full / 3)
    policy = full - base_weight_grads
    formula = accounting.formula + (" (LoRA: the frozen base 4*N_base*tokens)" if frozen else "")
    if objective is None:
        return policy, formula
    return objective.flops(cfg, policy, full, formula)  # (DPO's pair: engine/config/dpo_objective.py)


def _reference_flops(cfg, family, dataset, tx, abstract_state, objective=None) -> Optional[float]:
    """FLOPs of one whole train step with the family's reference work settings and no
    gradient accumulation, from the lowered (not compiled) program; None if not analysable.
    The reference model's parameters may be laid out differently (unscanned layers): its
    state's shapes come from its own init."""
    if objective is not None and not objective.plain_step:  # (the plain step is a language model's, not DPO's)
        return None
    plain = {**family.flops.work_settings, **family.flops.reference_settings} if family.flops else {}
    model_cfg = dataclasses.replace(cfg.model, **plain)
    module = family.build(model_cfg, dataset.info, jnp.dtype(cfg.train.compute_dtype), jnp.dtype(cfg.train.param_dtype))
    step = make_train_step(
        make_loss_fn(module, family.task, family.hparams, len(dataset.info.sources)), tx, cfg.optimizer.schedule
    )
    batch = {
        name: jax.ShapeDtypeStruct((cfg.train.global_batch_size, *a.shape[1:]), a.dtype)
        for name, a in example_spec(dataset.train).items()
    }
    variables = jax.eval_shape(
        lambda: nn.meta.unbox(module.init(jax.random.key(0), family.task.sample_input(dataset.info), train=False))
    )
    params, variables = split_variables(variables)
    strip = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)  # noqa: E731
    state = TrainState(  # (a DiLoCo state's step, rng and hparams are a run's)
        step=strip(abstract_state.step),
        params=params,
        model_state=variables,
        opt_state=jax.eval_shape(tx.init, params),
        rng=strip(abstract_state.rng),
        hparams=jax.tree.map(strip, abstract_state.hparams),
    )
    return lowered_flops(jax.jit(step).lower(state, batch))
