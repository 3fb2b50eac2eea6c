"""TrainState, one pytree, and the collections of its model state: what the step, the sync
strategies, the objectives, checkpoints and LoRA all read (nothing here knows a config)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import flax
import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict


@flax.struct.dataclass
class TrainState:
    """The whole train state, one pytree (its leaves: arrays, or their shapes or shardings)."""

    step: Any  # int32 scalar: optimizer steps taken
    params: Any
    model_state: Any  # non-parameter collections, e.g. {"batch_stats": ...}
    opt_state: Any  # optax.inject_hyperparams state: optimizer numbers are arrays, not constants
    rng: Any  # uint32 key data; the step's key is fold_in(rng, step)
    hparams: Any  # schedule numbers (optim.schedule_hparams) and the model family's hparams: step inputs

    if TYPE_CHECKING:

        def replace(self, **changes) -> TrainState: ...  # (flax.struct.dataclass makes it)


AUX_COLLECTION = "aux"  # what a model sows while it runs (models/llama.py's MoE): not state
# the model state's frozen parameters (LoRA's base, engine/lm/finetune.py): they join the trained
# ones (the state's `params`, the adapters) in the model's `params`, and get no gradient
FROZEN = "frozen"
# train.objective=dpo under full fine-tuning: the starting parameters, the reference model
# (engine/objectives/); neither collection is the module's own state, nor ever updated
REFERENCE = "reference"
UNTRAINED = (FROZEN, REFERENCE)


def model_variables(params, model_state) -> dict:
    """The flax variables of (params, model_state): a fine-tuned model's frozen base and its
    trained adapters make one `params` tree."""
    rest = {k: v for k, v in model_state.items() if k not in UNTRAINED}
    if FROZEN not in model_state:
        return {"params": params, **rest}
    merged = {**flatten_dict(model_state[FROZEN]), **flatten_dict(params)}
    return {"params": unflatten_dict(merged), **rest}


AUX = ("aux_loss", "routed", "dropped")  # the values models may sow there


def split_variables(variables: Mapping) -> tuple[Any, dict]:
    """A module's variables → (params, model state): the other collections but the sown ones."""
    state = {k: v for k, v in variables.items() if k not in ("params", AUX_COLLECTION)}
    return variables.get("params"), state


def aux_totals(sown) -> dict[str, jax.Array]:
    """Each AUX value summed over every layer that sowed it (0 where none did)."""
    totals = {name: jnp.zeros((), jnp.float32) for name in AUX}
    for path, value in jax.tree_util.tree_flatten_with_path(sown)[0]:
        name = next(str(k.key) for k in reversed(path) if hasattr(k, "key"))
        totals[name] = totals[name] + jnp.sum(value.astype(jnp.float32))
    return totals
