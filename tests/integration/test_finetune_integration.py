"""Fine-tuning published weights (engine/lm/finetune.py): LoRA adapters on a frozen base start at
the base's logits and are all that trains and is checkpointed; QLoRA bases (int8, nf4) stay
close to the float base in a quarter and an eighth of its memory; the merged export loads in
transformers and the adapter directory in peft with the engine's logits; layouts over 8
devices give the one-device losses; resume is exact; bad settings exit 2 naming the key."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from support.finetune import DATA, LORA, logits

from engine.run.setup import build_run
from engine.state.train_state import FROZEN
from models.llama import PROJECTIONS
from models.projection import is_quantised

WIDE = [  # projections of 128 inputs (two nf4 blocks), so that their kernels dominate the base
    "model.name=llama", *DATA, "model.num_layers=2", "model.d_model=128", "model.num_heads=4",
    "model.num_kv_heads=2", "model.mlp_dim=256", *LORA,
]  # fmt: skip


def projection_bytes(run) -> int:
    """Per device, the frozen base's projection kernels as the compiled memory analysis counts them."""
    frozen = flatten_dict(run.abstract_state.model_state[FROZEN])
    kernels = [v for p, v in frozen.items() if p[-1] == "kernel" and p[-2] in PROJECTIONS]
    compiled = jax.jit(lambda ks: sum(jnp.sum(leaf.astype(jnp.float32)) for leaf in jax.tree.leaves(ks)))
    compiled = compiled.lower(kernels).compile()  # (every leaf used: codes and scales)
    return compiled.memory_analysis().argument_size_in_bytes


@pytest.mark.parametrize("dtype, tolerance, share", [("int8", 0.02, (0.25, 0.27)), ("nf4", 0.15, (0.125, 0.145))])
def test_a_quantised_base_stays_close_to_the_float_base_in_a_fraction_of_its_memory(
    make_config, dtype, tolerance, share
):
    """The seeded base, float and quantised (the same draw): logits within `tolerance` of the
    logits' spread, and the projections in `share` of their float32 bytes (scales included)."""
    float_run = build_run(make_config("llama_tiny.yaml", *WIDE), compile_train=False)
    quant_run = build_run(make_config("llama_tiny.yaml", *WIDE, f"finetune.base_dtype={dtype}"), compile_train=False)
    assert any(is_quantised(v) for v in flatten_dict(quant_run.init_state().model_state[FROZEN]).values())
    exact, approx = logits(float_run, float_run.init_state()), logits(quant_run, quant_run.init_state())
    error = np.abs(approx - exact).max() / (exact.max() - exact.min())
    assert 0 < error < tolerance, error
    ratio = projection_bytes(quant_run) / projection_bytes(float_run)
    assert share[0] <= ratio <= share[1], ratio
