"""Helpers of tests/**/test_llama*.py that other test files (or its other tiers) share."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.data import DataInfo
from models import REGISTRY
from models.llama import LlamaConfig
from support.configs import TINY_LLAMA

INFO = DataInfo("tokens", 8, 8, vocab_size=61, seq_len=12)


TINY = dict(num_layers=3, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=48, rope_theta=10000.0)


LLAMA = TINY_LLAMA


def write_hf_checkpoint(path, cfg: LlamaConfig, vocab: int, shards: int = 1):
    """A random model in Hugging Face's layout (config.json + safetensors), made without torch."""
    from safetensors.numpy import save_file

    from models import llama_hf

    rng = np.random.default_rng(0)
    path.mkdir(parents=True)
    hf = llama_hf.config_to_hf(dataclasses.replace(cfg, vocab_size=vocab), INFO)
    (path / "config.json").write_text(json.dumps(hf))
    tensors = {}
    for tensor in llama_hf.tensors(cfg):
        for name in tensor.names:
            shape = _hf_shape(name, cfg, vocab)
            tensors[name] = rng.standard_normal(shape).astype(np.float32) * 0.1
    names = sorted(tensors)
    parts = [names[i::shards] for i in range(shards)]
    weight_map = {}
    for i, part in enumerate(parts):
        file = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    if shards > 1:
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return tensors


def _hf_shape(name: str, cfg: LlamaConfig, vocab: int) -> tuple[int, ...]:
    d, q, kv, mlp = cfg.d_model, cfg.num_heads * cfg.head_width, cfg.kv_heads * cfg.head_width, cfg.mlp_dim
    table = {
        "embed_tokens": (vocab, d),
        "lm_head": (vocab, d),
        "q_proj": (q, d),
        "k_proj": (kv, d),
        "v_proj": (kv, d),
        "o_proj": (d, q),
        "gate_proj": (mlp, d),
        "up_proj": (mlp, d),
        "down_proj": (d, mlp),
        "q_norm": (cfg.head_width,),
        "k_norm": (cfg.head_width,),
    }
    for key, shape in table.items():
        if key in name:
            return shape
    return (d,)  # the RMSNorm scales


def ours_from_hf_dir(path, info=INFO):
    """Our module and parameters, read from a Hugging Face directory through models/llama_hf.py."""
    from engine.hub.hf import _Reader, _tensor_files
    from models import llama_hf

    read = _Reader(_tensor_files(path))
    settings = llama_hf.config_from_hf(json.loads((path / "config.json").read_text()))
    settings.pop("name")
    cfg = LlamaConfig(**settings)
    params = {}
    for tensor in llama_hf.tensors(cfg):
        layers = [tensor.to_ours(read(name)) for name in tensor.names]
        node = params
        for key in tensor.path[:-1]:
            node = node.setdefault(key, {})
        node[tensor.path[-1]] = np.stack(layers) if tensor.stacked else layers[0]
    return REGISTRY["llama"].build(cfg, info, jnp.float32, jnp.float32), params


def transformers_logits(path, tokens):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        return reference(torch.tensor(tokens)).logits.numpy()


@functools.partial(jax.jit, static_argnums=0)
def _logits(module, params, tokens):
    return module.apply({"params": params}, tokens, train=False)


def greedy_reference(module, params, prompt: list[int], max_tokens: int, length: int = 0) -> list[int]:
    """models/sampling.py's greedy_without_cache (the whole sequence through the model again for
    every new token, argmax), one compiled program for every step: the sequence is padded at the
    end to `length` (default: its final length), which a causal model's logits at the last
    token do not see. (Eager, each step's new length dispatched every op anew: ~1 s a token.)"""
    length = length or len(prompt) + max_tokens - 1
    sequence = list(prompt)
    for _ in range(max_tokens):
        tokens = np.zeros((1, length), np.int32)
        tokens[0, : len(sequence)] = sequence
        logits = _logits(module, params, jnp.asarray(tokens))
        sequence.append(int(np.argmax(np.asarray(logits[0, len(sequence) - 1], np.float32))))
    return sequence[len(prompt) :]
