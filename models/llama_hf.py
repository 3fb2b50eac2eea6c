"""The Llama family in Hugging Face's layout: `config.json` ↔ LlamaConfig, and each of our
parameters ↔ its Hugging Face tensor(s) (`LlamaForCausalLM`, `MistralForCausalLM`,
`Qwen2ForCausalLM` without biases, `Qwen3ForCausalLM`). Pure mapping, no file access: the
engine's `import-hf` and `export --format hf` read and write the files.

Hugging Face keeps a linear layer as weight [out, in]; ours are kernels [in, out] with the
heads split out ([embed, heads, head_dim]), so each mapping is a transpose and a reshape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from models.configs import ModelError

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class HFTensor:
    path: tuple[str, ...]  # our parameter, e.g. ("layers", "block", "attn", "query", "kernel")
    names: tuple[str, ...]  # its Hugging Face tensor: one name, or one per layer (stacked on axis 0)
    to_ours: Callable[[np.ndarray], np.ndarray]  # one Hugging Face tensor → our layout (one layer)
    to_hf: Callable[[np.ndarray], np.ndarray]  # the inverse
    stacked: bool = False  # our parameter stacks `names` on a leading layers axis (scanned layers)


def config_from_hf(hf: dict) -> dict:
    """`config.json` → `model.*` settings; ModelError naming the field for what we cannot run."""
    architecture = (hf.get("architectures") or ["?"])[0]
    if architecture not in ARCHITECTURES:
        raise ModelError(
            f"config.json architectures={architecture!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    refuse = {
        "hidden_act": (hf.get("hidden_act", "silu") != "silu", "only silu (SwiGLU) is supported"),
        "attention_bias": (
            bool(hf.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            "attention biases are not supported",
        ),
        "mlp_bias": (bool(hf.get("mlp_bias", False)), "MLP biases are not supported"),
        "sliding_window": (
            bool(hf.get("sliding_window")) and hf.get("use_sliding_window", True),
            "sliding-window attention is not supported",
        ),
    }
    for field, (bad, why) in refuse.items():
        if bad:
            value = hf.get(field, "absent: true for " + architecture if field == "attention_bias" else None)
            raise ModelError(f"config.json {field}={value!r}: {why}")
    model = {
        "name": "llama",
        "num_layers": hf["num_hidden_layers"],
        "d_model": hf["hidden_size"],
        "num_heads": hf["num_attention_heads"],
        "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
        "mlp_dim": hf["intermediate_size"],
        "vocab_size": hf["vocab_size"],
        "rope_theta": float(hf.get("rope_theta", 10000.0)),
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qk_norm": architecture == "Qwen3ForCausalLM",
    }
    head_dim = hf.get("head_dim")
    if head_dim and head_dim != hf["hidden_size"] // hf["num_attention_heads"]:
        model["head_dim"] = head_dim
    scaling = hf.get("rope_scaling")
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            raise ModelError(f"config.json rope_scaling.rope_type={kind!r} is not supported (only llama3)")
        model.update(
            rope_scaling_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_len=int(scaling["original_max_position_embeddings"]),
        )
    return model


def config_to_hf(cfg, info, dtype: str = "float32") -> dict:
    """LlamaConfig (and the run's DataInfo) → a `config.json` that transformers'
    AutoModelForCausalLM loads."""
    if cfg.num_experts:
        raise ModelError(
            f"model.num_experts={cfg.num_experts}: a mixture-of-experts model has no Hugging Face "
            f"Llama layout here; export it in the default format (without --format hf)"
        )
    vocab_size, max_positions = cfg.vocab_size or info.vocab_size, info.seq_len
    qwen3 = cfg.qk_norm  # Llama has no QK-norm; Qwen3 is the same architecture with it
    hf = {
        "architectures": ["Qwen3ForCausalLM" if qwen3 else "LlamaForCausalLM"],
        "model_type": "qwen3" if qwen3 else "llama",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_width,
        "vocab_size": vocab_size,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "max_position_embeddings": max_positions,
        "torch_dtype": dtype,
        "rope_scaling": None,
    }
    if cfg.rope_scaling_factor:
        hf["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len,
        }
    return hf


def _linear(out_shape: tuple[int, ...]):
    """HF weight [out, in] ↔ our kernel [in, *out_shape] (out_shape () = [in, out])."""
    return (
        lambda w: np.ascontiguousarray(w.T).reshape(w.shape[1], *(out_shape or (w.shape[0],))),
        lambda k: np.ascontiguousarray(k.reshape(k.shape[0], -1).T),
    )


def _output(in_shape: tuple[int, ...]):
    """HF weight [out, in] ↔ our kernel [*in_shape, out] (the attention output projection)."""
    return (
        lambda w: np.ascontiguousarray(w.T).reshape(*in_shape, w.shape[0]),
        lambda k: np.ascontiguousarray(k.reshape(-1, k.shape[-1]).T),
    )


def _same():
    return (lambda a: a, lambda a: a)


def tensors(cfg) -> list[HFTensor]:
    """Every parameter of `cfg`'s model with its Hugging Face tensor(s)."""
    heads, kv_heads, width = cfg.num_heads, cfg.kv_heads, cfg.head_width
    per_layer = {
        ("attn_norm", "scale"): ("input_layernorm.weight", _same()),
        ("attn", "query", "kernel"): ("self_attn.q_proj.weight", _linear((heads, width))),
        ("attn", "key", "kernel"): ("self_attn.k_proj.weight", _linear((kv_heads, width))),
        ("attn", "value", "kernel"): ("self_attn.v_proj.weight", _linear((kv_heads, width))),
        ("attn", "out", "kernel"): ("self_attn.o_proj.weight", _output((heads, width))),
        ("mlp_norm", "scale"): ("post_attention_layernorm.weight", _same()),
        ("gate", "kernel"): ("mlp.gate_proj.weight", _linear(())),
        ("up", "kernel"): ("mlp.up_proj.weight", _linear(())),
        ("down", "kernel"): ("mlp.down_proj.weight", _linear(())),
    }
    if cfg.qk_norm:
        per_layer[("attn", "query_norm", "scale")] = ("self_attn.q_norm.weight", _same())
        per_layer[("attn", "key_norm", "scale")] = ("self_attn.k_norm.weight", _same())
    found = [
        HFTensor(("embed", "embedding"), ("model.embed_tokens.weight",), *_same()),
        HFTensor(("final_norm", "scale"), ("model.norm.weight",), *_same()),
    ]
    if not cfg.tie_embeddings:
        found.append(
            HFTensor(
                ("lm_head", "kernel"),
                ("lm_head.weight",),
                lambda w: np.ascontiguousarray(w.T),
                lambda k: np.ascontiguousarray(k.T),
            )
        )
    for ours, (name, (to_ours, to_hf)) in per_layer.items():
        names = tuple(f"model.layers.{i}.{name}" for i in range(cfg.num_layers))
        if cfg.scan_layers:  # one parameter, the layers stacked on axis 0
            found.append(HFTensor(("layers", "block", *ours), names, to_ours, to_hf, stacked=True))
        else:
            found += [HFTensor((f"layer_{i}", *ours), (names[i],), to_ours, to_hf) for i in range(cfg.num_layers)]
    return found
