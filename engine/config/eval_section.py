"""The run configuration's `eval` section: how often and on how much the eval split is evaluated,
and the generation-based eval of language models (`eval.generate`, engine/run/generation_eval.py).

Imports no jax: a sweep's process reads every run's config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from contract.fields import option


@dataclass(frozen=True)
class GenerateEvalConfig:
    """A language model's generation-based eval: completions of the eval split's prompts (data.name=chat
    or preferences) at each evaluation, scored by exact match or reward functions (docs/language-models.md)."""

    num_prompts: int = option(
        0, "eval records whose prompts are completed at each eval, the first N, in one batch (0 = off)", at_least=0
    )
    max_tokens: int = option(32, "new tokens at most per completion (it ends earlier at end-of-text)", at_least=1)
    temperature: float = option(0.0, "sampling temperature (0 = greedy)", at_least=0.0)
    top_p: float = option(1.0, "nucleus sampling's share of the probability mass (1 = all)", above=0.0)
    answer_field: str = option(
        "",
        "exact match (eval/generate/exact_match) against this field of each eval record: completion (a messages "
        'record: its last assistant message), chosen, or a field of yours; "" = none',
    )
    rewards: list[str] = option(
        [],
        "reward functions with TRL's signature f(prompts, completions, **fields) -> list[float], as "
        "module:function or path/to/file.py:function; their mean is eval/generate/reward",
    )


@dataclass(frozen=True)
class EvalConfig:
    every_steps: int = option(0, "evaluate every N steps (0 = only at the end)", at_least=0)
    batch_size: int = option(0, "examples per eval batch (0 = train.global_batch_size)", at_least=0)
    max_batches: int = option(0, "cap on eval batches (0 = the whole eval split)", at_least=0)
    generate: GenerateEvalConfig = dataclasses.field(default_factory=GenerateEvalConfig)
