"""The DPO objective's step part (train.objective=dpo; its record: engine/config/dpo_objective.py):
preference pairs scored by the policy and the reference.

A batch of preference pairs (engine/data/preferences.py) holds `tokens`, `segments`, `positions`
and `loss_mask` of shape [pairs, 2, seq_len + 1] (index 0 the chosen response, 1 the rejected
one). Both are scored in one forward pass of the module ([2 * pairs, seq_len + 1] rows); a
response's log-probability is the sum of log p(target) over the targets the language-model task
counts (NextToken.target_weights: within the sequence, and on the response's tokens only).

The reference model is the frozen starting point: under LoRA the same base with every adapter's
B set to zero (B @ A adds nothing: the base alone; no second copy of the weights), under full
fine-tuning the starting parameters, kept in the model state's REFERENCE collection (never
trained; checkpointed with the state). With dpo.precompute_reference the batches carry the
reference's log-probabilities (`ref_logps` [pairs, 2], engine/run/reference_logps.py) and no
reference model runs in the step. Losses and metrics follow Hugging Face TRL's DPOTrainer.

β is a step input (the state's hparams[DPO_BETA], as the learning rate's schedule numbers are),
so runs that differ in dpo.beta share one compiled program (a vectorised sweep).

Dropout: as TRL's DPOTrainer (disable_dropout=True, its default), both the policy and the
reference are scored without dropout: neither the model's own dropout nor the
adapters' (finetune.lora.dropout, refused with dpo) is applied, so at step 0 policy = reference.
"""

from __future__ import annotations

from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from engine.config.dpo_objective import DPO_BETA, DPO_SUMS, REF_LOGPS
from engine.objectives import StepPart
from engine.state.train_state import AUX_COLLECTION, FROZEN, REFERENCE, UNTRAINED, aux_totals, model_variables


def pair_rows(batch) -> dict:
    """A batch of pairs → one of rows, chosen and rejected side by side: each array of a pair's two
    rows ([pairs, 2, L]) → [2 * pairs, L] (the arrays of one value per pair are left out)."""
    rows = {name: x.reshape(-1, *x.shape[2:]) for name, x in batch.items() if x.ndim >= 3}
    if "example_id" in batch:  # dropout masks drawn per row: each pair's two rows their own
        ids = batch["example_id"].astype(jnp.int32)
        rows["example_id"] = (ids[:, None] * 2 + jnp.arange(2, dtype=jnp.int32)).reshape(-1)
    return rows


def sequence_logps(out, weights) -> tuple[jax.Array, jax.Array]:
    """(each response's log-probability [pairs, 2], its counted targets [pairs, 2]) from the
    module's per-target cross-entropy (`out`: (losses, hits) [2 * pairs, L]) and the targets
    counted (`weights`): a sum over the counted targets, as TRL's (its IPO divides the loss's
    log-ratios by the counted targets, pair_metrics)."""
    losses, _ = out
    total = -jnp.sum(losses * weights, axis=-1)
    return total.reshape(-1, 2), jnp.sum(weights, axis=-1).reshape(-1, 2)


def dpo_losses(chosen, rejected, ref_chosen, ref_rejected, beta: float, loss: str, label_smoothing: float = 0.0):
    """Per-pair loss of TRL's DPOTrainer (loss_type sigmoid, ipo or hinge) from the policy's and
    the reference's response log-probabilities."""
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    if loss == "sigmoid":
        return -jax.nn.log_sigmoid(beta * h) * (1 - label_smoothing) - jax.nn.log_sigmoid(-beta * h) * label_smoothing
    if loss == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if loss == "hinge":
        return jax.nn.relu(1 - beta * h)
    raise ValueError(f"dpo.loss={loss} is not one of sigmoid, ipo, hinge")


def reference_variables(params, model_state) -> dict:
    """The flax variables of the reference model: the full fine-tuning run's starting parameters
    (REFERENCE), or a LoRA run's base with its adapters switched off (each lora_b zero)."""
    if REFERENCE in model_state:
        rest = {k: v for k, v in model_state.items() if k != REFERENCE}
        return model_variables(jax.lax.stop_gradient(model_state[REFERENCE]), rest)
    if FROZEN not in model_state:
        raise ValueError("train.objective=dpo needs a reference: LoRA's frozen base or the starting parameters")

    def off(path, leaf):
        return jnp.zeros_like(leaf) if getattr(path[-1], "key", None) == "lora_b" else leaf

    return model_variables(jax.lax.stop_gradient(jax.tree_util.tree_map_with_path(off, params)), model_state)


def pair_metrics(logps, ref_logps, targets, pair_weights, dpo, beta=None) -> tuple[jax.Array, dict]:
    """(the loss summed over the pairs, TRL's metrics as sums over the pairs: DPO_SUMS, `correct`
    (rewards/accuracies) and `count` (the pairs)); `beta`: the state's β (None: dpo.beta).
    `logps`, `ref_logps`: sums over each response's counted targets ([pairs, 2]); `targets`: how
    many each counts ([pairs, 2]). As TRL 1.x, IPO's loss takes the log-ratios per counted target
    (the policy's and the reference's sums each divided by the response's targets), while the
    rewards and log-probabilities it reports stay sums."""
    beta = dpo.beta if beta is None else beta
    (chosen, rejected), (ref_chosen, ref_rejected) = logps.T, ref_logps.T  # (each [pairs])
    if dpo.loss == "ipo":
        per = 1.0 / jnp.maximum(targets, 1.0).T
        scored = (chosen * per[0], rejected * per[1], ref_chosen * per[0], ref_rejected * per[1])
    else:
        scored = (chosen, rejected, ref_chosen, ref_rejected)
    losses = dpo_losses(*scored, beta, dpo.loss, dpo.label_smoothing)
    reward_chosen = jax.lax.stop_gradient(beta * (chosen - ref_chosen))
    reward_rejected = jax.lax.stop_gradient(beta * (rejected - ref_rejected))
    per_pair = {
        "rewards_chosen": reward_chosen,
        "rewards_rejected": reward_rejected,
        "logps_chosen": jax.lax.stop_gradient(chosen),
        "logps_rejected": jax.lax.stop_gradient(rejected),
    }
    sums = {name: jnp.sum(per_pair[name] * pair_weights) for name in DPO_SUMS}
    sums["correct"] = jnp.sum((reward_chosen > reward_rejected).astype(jnp.float32) * pair_weights)
    sums["count"] = jnp.sum(pair_weights)
    return jnp.sum(losses * pair_weights), sums


def make_scorer(module: nn.Module, task) -> Callable:
    """score(variables, rows, mutable) → ((each response's log-probability, its counted targets)
    ([pairs, 2] each, sequence_logps'), the collections made): the module run on a batch's rows
    without dropout (see the docstring)."""

    def score(variables, rows, mutable):
        inputs, targets, extra = task.model_inputs(rows)
        out, collections = module.apply(
            variables, inputs, train=False, example_ids=rows.get("example_id"), mutable=mutable, **extra
        )
        return sequence_logps(task.losses(out, targets), task.target_weights(rows)), collections

    return score


def make_reference_fn(module: nn.Module, task, dpo) -> Callable:
    """reference(params, model_state, batch) → the reference's log-probabilities [pairs, 2] of a
    batch of pairs (dpo.precompute_reference's pass, engine/run/reference_logps.py): a LoRA
    state's base with the adapters off, or (full fine-tuning) the given starting parameters."""
    del dpo  # (every loss caches sums: IPO divides them by the targets in its loss)
    score = make_scorer(module, task)

    def reference(params, model_state, batch):
        given = FROZEN in model_state or REFERENCE in model_state
        variables = reference_variables(params, model_state) if given else model_variables(params, model_state)
        return score(variables, pair_rows(batch), [AUX_COLLECTION])[0][0]

    return reference


def make_dpo_loss_fn(module: nn.Module, task, dpo, hparam_names: tuple[str, ...] = ()) -> Callable:
    """loss(params, model_state, batch, rng, train, hparams) → (mean loss over the pairs, (metric
    sums, new model_state)), as engine/objectives/lm.py make_loss_fn's: `loss_sum`, `correct` and
    `count` count pairs, and DPO_SUMS add TRL's rewards and log-probabilities (`dpo`: the config's
    `dpo` section; β from hparams[DPO_BETA] where given; a batch's REF_LOGPS stand for the
    reference's forward pass). The family's hparams (dropout rates) have no use: no dropout."""
    del hparam_names
    score = make_scorer(module, task)

    def loss_fn(params, model_state, batch, rng, train: bool, hparams=None):
        del rng  # (no dropout)
        rows = pair_rows(batch)
        mutable = [*(c for c in model_state if train and c not in UNTRAINED), AUX_COLLECTION]
        (logps, targets), collections = score(model_variables(params, model_state), rows, mutable)
        if REF_LOGPS in batch:
            ref_logps = batch[REF_LOGPS].astype(jnp.float32)
        else:
            (ref_logps, _), _ = score(reference_variables(params, model_state), rows, [AUX_COLLECTION])
        pairs = jax.tree.leaves(batch)[0].shape[0]
        pair_weights = batch.get("mask", jnp.ones((pairs,), jnp.float32)).astype(jnp.float32)
        beta = hparams[DPO_BETA] if hparams and DPO_BETA in hparams else None
        loss_sum, metrics = pair_metrics(logps, jax.lax.stop_gradient(ref_logps), targets, pair_weights, dpo, beta)
        new_state = {k: v for k, v in collections.items() if k != AUX_COLLECTION}
        new_model_state = {**model_state, **new_state} if train else model_state
        aux = aux_totals(collections.get(AUX_COLLECTION, {}))
        metrics.update(
            loss_sum=loss_sum, aux_loss=aux["aux_loss"] * metrics["count"], routed=aux["routed"], dropped=aux["dropped"]
        )
        return loss_sum / jnp.maximum(metrics["count"], 1.0) + aux["aux_loss"], (metrics, new_model_state)

    return loss_fn


def part(cfg) -> StepPart:
    """train.objective=dpo's step part: the pair loss with the config's `dpo` section, and the
    reference's pass over a batch (dpo.precompute_reference's)."""
    dpo = cfg.dpo

    def loss_fn(module: nn.Module, family, num_sources: int = 0) -> Callable:
        del num_sources  # (one source: preference pairs)
        return make_dpo_loss_fn(module, family.task, dpo, family.hparams)

    def reference_fn(module: nn.Module, task) -> Callable:
        return make_reference_fn(module, task, dpo)

    return StepPart(loss_fn, reference_fn)
