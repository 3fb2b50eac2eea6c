"""The run configuration's `grpo` section (train.objective=grpo: group-relative policy optimisation
with verifiable rewards, as Hugging Face TRL's GRPOTrainer and its GRPOConfig's names), and its
checks against the rest of the config (`check_grpo`).

Imports no jax: a sweep's process reads every run's config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from contract.fields import option
from engine.errors import UsageError

OBJECTIVE = "grpo"
PROMPTS = "prompts"  # the data source of prompts (engine/data/prompts.py)
REWARD_FORM = "module:function or path/to/file.py:function (a file's path relative to the working directory)"


@dataclass(frozen=True)
class GrpoConfig:
    """train.objective=grpo: completions sampled from the policy for each prompt of data.name=prompts,
    scored by reward functions, the policy moved towards the better ones of each group (docs/language-models.md)."""

    num_generations: int = option(
        8, "completions sampled per prompt (a group; train.global_batch_size counts prompts)", at_least=2
    )
    max_prompt_tokens: int = option(
        256,
        "tokens of a prompt at most (prompts are left-padded to this; a longer one is refused naming its file and "
        "line)",
        at_least=1,
    )
    max_completion_tokens: int = option(
        256,
        "tokens a completion may have at most (it ends earlier at the end-of-turn or end-of-text token)",
        at_least=1,
    )
    temperature: float = option(1.0, "sampling temperature of the completions", above=0.0)
    top_p: float = option(1.0, "nucleus sampling's share of the probability mass, in (0, 1] (1 = all)", above=0.0)
    top_k: int = option(0, "sample among the k likeliest tokens only (0 = all)", at_least=0)
    rewards: list[str] = option(
        [],
        "reward functions with TRL's signature f(prompts, completions, **fields) -> list[float], each named as "
        f"{REWARD_FORM}; at least one; shipped: engine.lm.rewards:exact_match, engine.lm.rewards:format_match",
    )
    reward_weights: Optional[list[float]] = option(
        None, "the weight of each reward function in the reward, in grpo.rewards' order (null = 1 each)"
    )
    scale_rewards: str = option(
        "group",
        "advantages are the reward minus its group's mean, divided by the std of the group (group), of the "
        "whole batch (batch) or by nothing (none), as TRL's scale_rewards",
        choices=("group", "batch", "none"),
    )
    loss_type: str = option(
        "dapo",
        "TRL's loss_type: how the per-token losses are averaged: grpo (each completion's mean, then over "
        "completions), bnpo (over the batch's tokens), dr_grpo (over completions x max_completion_tokens), dapo "
        "(over the tokens of the whole generation batch)",
        choices=("grpo", "bnpo", "dr_grpo", "dapo"),
    )
    epsilon: float = option(
        0.2, "the clipping range below 1 of the probability ratio (and above, see epsilon_high)", above=0.0
    )
    epsilon_high: Optional[float] = option(
        None, "the clipping range above 1 of the ratio (DAPO's clip-higher; null = grpo.epsilon)"
    )
    beta: float = option(
        0.0,
        "weight of the KL penalty to the reference (k3 estimator; 0 = none, and no reference is kept)",
        at_least=0.0,
    )
    num_iterations: int = option(
        1,
        "updates per batch of rollouts (TRL's num_iterations, GRPO's mu; the old log-probs are the sampler's)",
        at_least=1,
    )


def check_grpo(cfg) -> None:
    """UsageError naming the key and the fix when train.objective, the `grpo` section and data.name disagree,
    or the section's keys do among themselves."""
    objective, data = cfg.train.objective, cfg.data.name
    if objective != OBJECTIVE:
        if data == PROMPTS:
            raise UsageError(
                f"data.name={PROMPTS} holds prompts without completions, which train.objective={objective} cannot "
                f"train on; set train.objective={OBJECTIVE} (and the grpo section's rewards)"
            )
        changed = [
            f"grpo.{f.name}={getattr(cfg.grpo, f.name)}"
            for f in dataclasses.fields(GrpoConfig)
            if getattr(cfg.grpo, f.name) != getattr(GrpoConfig(), f.name)
        ]
        if changed:
            raise UsageError(
                f"{', '.join(changed)} set with train.objective={objective}, which has no use for it; set "
                f"train.objective={OBJECTIVE}, or leave the grpo section out"
            )
        return
    if data != PROMPTS:
        raise UsageError(
            f"train.objective={OBJECTIVE} samples completions of prompts, but data.name={data}; set "
            f'data.name={PROMPTS} (JSON Lines of {{"prompt": ..., and the fields your rewards read}})'
        )
    _check_section(cfg.grpo)
    _check_run(cfg)


def _check_section(grpo: GrpoConfig) -> None:
    if not grpo.rewards:
        raise UsageError(
            f"train.objective={OBJECTIVE} needs a reward: set grpo.rewards=[{REWARD_FORM.split(' (')[0]}], e.g. "
            "grpo.rewards=[engine.lm.rewards:exact_match] (the completion's answer against each record's answer)"
        )
    for spec in grpo.rewards:
        where, _, name = str(spec).rpartition(":")
        if not where or not name:
            raise UsageError(f"grpo.rewards: {spec!r} is not {REWARD_FORM}; e.g. engine.lm.rewards:exact_match")
    weights = grpo.reward_weights
    if weights is not None and len(weights) != len(grpo.rewards):
        raise UsageError(
            f"grpo.reward_weights={list(weights)} has {len(weights)} weight(s) for {len(grpo.rewards)} reward "
            f"function(s) in grpo.rewards; give one weight each, or grpo.reward_weights=null (1 each)"
        )
    if not grpo.top_p <= 1.0:
        raise UsageError(f"grpo.top_p={grpo.top_p} must be in (0, 1], e.g. grpo.top_p=1.0 (all the mass)")
    if grpo.epsilon_high is not None and not grpo.epsilon_high > 0:
        raise UsageError(
            f"grpo.epsilon_high={grpo.epsilon_high} must be more than 0, e.g. grpo.epsilon_high=0.28 (DAPO's), or "
            "null (grpo.epsilon)"
        )


def _check_run(cfg) -> None:
    """The rest of the run's keys that GRPO constrains."""
    grpo = cfg.grpo
    lora_dropout = cfg.finetune.lora.dropout
    if lora_dropout:
        raise UsageError(
            f"finetune.lora.dropout={lora_dropout} has no effect with train.objective={OBJECTIVE}, which samples "
            "and scores the completions without dropout (the ratio to the sampling policy is 1 at its first "
            "update); set finetune.lora.dropout=0"
        )
    for key, value, fix in (("mesh.pipeline", cfg.mesh.pipeline, 1), ("train.sync", cfg.train.sync, "every_step")):
        if value != fix:
            raise UsageError(f"train.objective={OBJECTIVE} does not run with {key}={value} yet; set {key}={fix}")
    every = cfg.checkpoint.every_steps
    if grpo.num_iterations > 1 and every and every % grpo.num_iterations:
        raise UsageError(
            f"checkpoint.every_steps={every} is not a multiple of grpo.num_iterations={grpo.num_iterations}: a "
            "resume regenerates a batch's rollouts only at its first update; use a multiple of "
            f"{grpo.num_iterations}"
        )
