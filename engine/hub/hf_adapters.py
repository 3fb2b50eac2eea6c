"""A fine-tuned run's adapters for Hugging Face: folded into the base (`export --format hf
--merge`: a plain checkpoint transformers loads), or as a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors) that `peft` loads onto the base model.

PEFT's LoRA computes x·Aᵀ·Bᵀ·(alpha / r) with lora_A.weight [r, in] and lora_B.weight
[out, r], the inputs and outputs flattened as in the base's own weight [out, in]; ours are
lora_a [inputs…, r] and lora_b [r, outputs…] (models/projection.py), so A goes through the
kernel's own Hugging Face conversion and B is flattened and transposed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax.traverse_util import flatten_dict

from contract.adapters import HF_NAMES
from engine.checkpoint.store import open_checkpoints
from engine.errors import UsageError
from engine.lm.finetune import base_weights
from engine.lm.finetune import merged as merged  # (export --merge's, hf.py)
from engine.runtime.rundir import write_atomic

HF_OF = {ours: hf for hf, ours in HF_NAMES.items()}  # query → q_proj, …


def adapter_tensors(params, layout_tensors) -> tuple[dict[str, np.ndarray], list[str]]:
    """PEFT's tensors (base_model.model.<module>.lora_A/B.weight) and target module names."""
    flat = flatten_dict(params)
    tensors, targets = {}, []
    for tensor in layout_tensors:
        *module, leaf = tensor.path
        if leaf != "kernel" or (*module, "lora_a") not in flat:
            continue
        a = np.asarray(jax.device_get(flat[(*module, "lora_a")]), np.float32)
        b = np.asarray(jax.device_get(flat[(*module, "lora_b")]), np.float32)
        a_layers, b_layers = (a, b) if tensor.stacked else ([a], [b])
        for name, a_one, b_one in zip(tensor.names, a_layers, b_layers):
            prefix = "base_model.model." + name.removesuffix(".weight")
            tensors[f"{prefix}.lora_A.weight"] = np.asarray(tensor.to_hf(a_one))  # [r, in]
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b_one.reshape(b_one.shape[0], -1).T)  # [out, r]
        targets.append(HF_OF[module[-1]])
    return tensors, sorted(set(targets))


def peft_base(cfg, given: Optional[str] = None) -> str:
    """PEFT's base_model_name_or_path: `given` (export --base-model), else the Hugging Face directory
    the LoRA run's base was imported from, read from the base's newest checkpoint (an import's step 0
    records it); UsageError when no Hugging Face directory holds the base's weights."""
    if given:
        return given
    fix = (
        "give export --base-model NAME_OR_PATH (a hub name, or the base exported with launch.py export --workdir "
        "BASE --format hf --out DIR), or export with --merge"
    )
    base = base_weights(cfg)
    if base is None:
        raise UsageError(
            f"the LoRA run's base is its model's seeded initialisation (finetune.base is empty), which no Hugging "
            f"Face directory holds, so the adapter directory cannot name it; {fix}"
        )
    step = base.identity["step"]
    reader = open_checkpoints(base.checkpoints, base.cfg, frozen_base=False)
    try:
        meta = reader.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    finally:
        reader.close()
    imported = meta.get("imported_from") if isinstance(meta, dict) else None
    if not imported:
        raise UsageError(
            f"finetune.base={cfg.finetune.base}: its newest checkpoint (step {step}) is not the weights import-hf "
            f"wrote (it trained after the import, or was never imported), so no Hugging Face directory holds the "
            f"base the adapters were trained on; {fix}"
        )
    return str(imported)


def write_peft(out: Path, cfg, tensors: dict[str, np.ndarray], targets: list[str], base_model: str) -> None:
    from safetensors.numpy import save_file

    lora = cfg.finetune.lora
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    write_atomic(out / "adapter_config.json", json.dumps(config, indent=2) + "\n")
