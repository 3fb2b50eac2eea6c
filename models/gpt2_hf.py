"""The GPT family (models/transformer.py) in Hugging Face's GPT-2 layout, for export only.

What maps, per block: pre-norm LayerNorms (ln_1, ln_2), causal attention scaled by
1/sqrt(head_dim), a GELU MLP with the tanh approximation (flax's nn.gelu, GPT-2's
"gelu_new"), learned positions (wpe) and an untied LM head. GPT-2's Conv1D weights are
[in, out], as our kernels; its fused query/key/value weight is ours concatenated. Our
attention has no biases: GPT-2's c_attn and attn.c_proj biases are written as zeros.

Import is refused: a published GPT-2 has attention biases, which this family does not model,
and its LayerNorm epsilon (1e-5) differs from ours (1e-6); importing would change its outputs."""

from __future__ import annotations

import numpy as np

from models.configs import ModelError
from models.llama_hf import HFTensor

ARCHITECTURES = ("GPT2LMHeadModel",)
LAYER_NORM_EPSILON = 1e-6  # flax's nn.LayerNorm default, which models/transformer.py uses


def config_from_hf(hf: dict) -> dict:
    raise ModelError(
        "GPT2LMHeadModel is exported, not imported: a published GPT-2 has attention biases this GPT "
        "family does not model; import a Llama-family model (LlamaForCausalLM, Qwen2/Qwen3, Mistral)"
    )


def config_to_hf(cfg, info, dtype: str = "float32") -> dict:
    return {
        "architectures": list(ARCHITECTURES),
        "model_type": "gpt2",
        "vocab_size": info.vocab_size,
        "n_positions": info.seq_len,
        "n_embd": cfg.d_model,
        "n_layer": cfg.num_layers,
        "n_head": cfg.num_heads,
        "n_inner": cfg.mlp_dim,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
    }


def _export_only(_):
    raise ModelError("the GPT-2 layout is for export only")


def _same(a):
    return a


def _block(i: int, d_model: int) -> list[HFTensor]:
    """Block i's tensors; the fused and the zero ones read the whole block's parameters."""

    def qkv(block):
        return np.concatenate([block[n]["kernel"].reshape(d_model, d_model) for n in ("query", "key", "value")], 1)

    def zeros(width):
        return lambda block: np.zeros(width, block["attn_norm"]["scale"].dtype)

    name = f"transformer.h.{i}."
    ours = f"block_{i}"
    tensors = [
        HFTensor((ours,), (name + "attn.c_attn.weight",), _export_only, qkv),
        HFTensor((ours,), (name + "attn.c_attn.bias",), _export_only, zeros(3 * d_model)),
        HFTensor((ours,), (name + "attn.c_proj.bias",), _export_only, zeros(d_model)),
        HFTensor(
            (ours, "attn_out", "kernel"), (name + "attn.c_proj.weight",), _export_only, lambda k: k.reshape(-1, d_model)
        ),
    ]
    pairs = {
        ("attn_norm", "scale"): "ln_1.weight",
        ("attn_norm", "bias"): "ln_1.bias",
        ("mlp_norm", "scale"): "ln_2.weight",
        ("mlp_norm", "bias"): "ln_2.bias",
        ("mlp_in", "kernel"): "mlp.c_fc.weight",
        ("mlp_in", "bias"): "mlp.c_fc.bias",
        ("mlp_out", "kernel"): "mlp.c_proj.weight",
        ("mlp_out", "bias"): "mlp.c_proj.bias",
    }
    return tensors + [HFTensor((ours, *path), (name + hf,), _export_only, _same) for path, hf in pairs.items()]


def tensors(cfg) -> list[HFTensor]:
    """Every Hugging Face tensor of `cfg`'s model with the parameter (or block) it comes from."""
    found = [
        HFTensor(("embed", "embedding"), ("transformer.wte.weight",), _export_only, _same),
        HFTensor(("positions",), ("transformer.wpe.weight",), _export_only, _same),
        HFTensor(("final_norm", "scale"), ("transformer.ln_f.weight",), _export_only, _same),
        HFTensor(("final_norm", "bias"), ("transformer.ln_f.bias",), _export_only, _same),
        HFTensor(("lm_head", "kernel"), ("lm_head.weight",), _export_only, lambda k: np.ascontiguousarray(k.T)),
    ]
    for i in range(cfg.num_layers):
        found += _block(i, cfg.d_model)
    return found
