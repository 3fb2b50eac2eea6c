"""What fine-tuning changes in a model's projections (an Adaptation, which the engine passes to
a family's build, models/family.py BuildOptions): LoRA adapters on the named projections and
the dtype their matmuls run in. A quantised frozen base needs nothing here: a projection
dequantises a kernel it is given quantised."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping

# target groups every family with named projections understands (models/llama.py's names)
TARGET_GROUPS = {
    "attention": ("query", "key", "value", "out"),
    "mlp": ("gate", "up", "down"),
}
TARGET_GROUPS["all"] = TARGET_GROUPS["attention"] + TARGET_GROUPS["mlp"]
# Hugging Face's (and PEFT's target_modules) names for the same projections
HF_NAMES = {
    "q_proj": "query",
    "k_proj": "key",
    "v_proj": "value",
    "o_proj": "out",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}


@dataclass(frozen=True)
class Adaptation:
    lora_rank: int = 0  # 0: no adapters
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ()  # projection names (targeted(…) resolved them)
    lora_init: str = "gaussian"  # A's initialiser: gaussian (std 1/rank) or kaiming (uniform); B is zero
    matmul_dtype: str = "none"  # none | fp8 | int8: the projections' matmuls, quantised (qwix)

    def lora_on(self, projection: str) -> bool:
        return self.lora_rank > 0 and projection in self.lora_targets


NO_ADAPTATION = Adaptation()


def targeted(patterns: list[str], projections: Mapping[str, object]) -> tuple[str, ...]:
    """The projection names that `patterns` match: a group (attention, mlp, all), a name
    (query, …) or Hugging Face's (q_proj, …), or a glob over them (*_proj, q*). ValueError
    naming a pattern that matches none."""
    found: list[str] = []
    for pattern in patterns:
        names = TARGET_GROUPS.get(pattern) or tuple(
            HF_NAMES.get(name, name) for name in fnmatch.filter([*projections, *HF_NAMES], pattern)
        )
        names = tuple(n for n in names if n in projections)
        if not names:
            raise ValueError(
                f"finetune.lora.targets: {pattern!r} matches no projection of this model; use attention, mlp, "
                f"all, or names or globs over {', '.join(projections)} (or {', '.join(HF_NAMES)})"
            )
        found += [n for n in names if n not in found]
    return tuple(found)
