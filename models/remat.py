"""Activation rematerialisation policies by name (`model.remat`): what a layer keeps for the
backward pass, what it recomputes, and what it sends to host memory.

The layers name the values a policy may keep with `jax.ad_checkpoint.checkpoint_name` (the
names below); `policy(name)` is the `jax.checkpoint` policy of a `model.remat` setting. This
module loads without jax (models/configs.py reads the names; jax is imported when a policy is
made), so a config is checked without it.
"""

from __future__ import annotations

from typing import Any

# The values the layers name (models/llama.py, models/transformer.py), MaxText's names where it has one.
LAYER_INPUT = "decoder_layer_input"  # a layer's input: its residual stream [batch, seq, embed]
QUERY, KEY, VALUE = "query_proj", "key_proj", "value_proj"  # the attention's projections, before RoPE
ATTENTION_OUT = "out_proj"  # the attention's output projection [batch, seq, embed]
MLP_OUT = "mlp_out"  # the MLP's (or the mixture of experts') output projection [batch, seq, embed]

# The named values each saving policy keeps on the device (the rest is recomputed). No policy
# names MLP_OUT: the backward pass never needs it (it is only added to the residual stream, and
# an add's backward pass needs no value of its inputs), so naming it would keep nothing more.
SAVED: dict[str, tuple[str, ...]] = {
    "minimal": (QUERY, KEY, VALUE, ATTENTION_OUT),  # embed width or less: not the MLP's inner ones
    "save_qkv_proj": (QUERY, KEY, VALUE),
    "save_out_proj": (ATTENTION_OUT,),
}
OFFLOADED: dict[str, tuple[str, ...]] = {"offload": (LAYER_INPUT,)}  # kept in host memory (pinned_host)

# The training FLOPs of each policy relative to none (forward 1 + backward 2 = 3 units; a
# policy that recomputes the whole forward adds 1): the estimate `plan --search` ranks by.
RECOMPUTE = {
    "none": 1.0,
    "dots": 7 / 6,  # recompute the elementwise work, keep every matmul's output
    "minimal": 7 / 6,  # keep the attention's projections, recompute the MLP's inner activations
    "save_qkv_proj": 5 / 4,  # keep the query, key and value projections
    "save_out_proj": 5 / 4,  # keep the attention's output projection
    "full": 4 / 3,  # keep each layer's input, recompute the whole layer
    "offload": 4 / 3,  # as full, with each layer's input in host memory (pinned_host)
}

REMAT_NAMES = ("none", "full", "dots", *SAVED, *OFFLOADED)  # model.remat's choices

DESCRIPTION = (
    "none (keep every activation), full (keep each layer's input, recompute the layer), dots (keep "
    "every matmul's output), minimal (keep the query, key, value and attention-output projections; "
    "recompute the MLP's inner activations, norms, RoPE and attention), save_qkv_proj "
    "(keep the query, key and value projections), save_out_proj (keep the attention's output "
    "projection) or offload (as full, with each layer's input in host memory, pinned_host)"
)


def policy(name: str) -> Any:
    """The `jax.checkpoint` policy of a `model.remat` name; None for none (no remat at all)."""
    import jax  # (here: the names above load without jax)

    policies = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":
        return policies.nothing_saveable  # recompute every activation from the layer's input
    if name == "dots":
        return policies.checkpoint_dots_with_no_batch_dims  # keep the matmuls' outputs
    if name in SAVED:
        return policies.save_only_these_names(*SAVED[name])
    if name in OFFLOADED:
        return policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=list(OFFLOADED[name]),
            offload_src="device",
            offload_dst="pinned_host",
        )
    raise ValueError(f"model.remat={name!r} is not one of {', '.join(REMAT_NAMES)}")
