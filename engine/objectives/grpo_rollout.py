"""GRPO's rollout batch (train.objective=grpo): a batch of prompts → num_generations completions of
each, sampled by the decode program (engine/lm/rollouts.py) from the policy's current weights →
their text → the reward functions on the host (engine/lm/rewards.py, TRL's signature) →
group-normalised advantages (engine/lm/grpo_math.py) → the arrays the update (grpo.py) trains on,
and TRL's reward metrics, which come from the host (rewards/<function>/mean among them).

The decode key is the caller's: rollouts.rollout_key(state.rng, step), a function of (seed, step),
so a resumed run samples the same completions."""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import numpy as np

from engine.lm import grpo_math
from engine.lm.rewards import RewardFunction, grpo_rewards


def repeated(prompts: dict, generations: int) -> dict:
    """Each prompt's row repeated for its completions (consecutive: a group)."""
    return {name: np.repeat(np.asarray(array), generations, axis=0) for name, array in prompts.items()}


def rollout_batch(
    decode: Callable,
    params,
    prompts: dict,
    key,
    records: Sequence,
    rewards: Sequence[RewardFunction],
    detokenize: Callable[[list[int]], str],
    grpo,
) -> tuple[dict, dict]:
    """(the update's batch of host arrays, one row a completion: grpo.py's ROLLOUT_ARRAYS with
    `rewards`, `zero_std`, `truncated`; TRL's reward and completion metrics) of a batch of
    prompts (host arrays `prompt_tokens` [B, P], `prompt_mask` [B, P], `record_index` [B], a
    data.name=prompts batch; `records`: the split's PromptRecords). `decode`: build_decode's
    program for B x num_generations rows; `detokenize`: token ids → text."""
    generations = grpo.num_generations
    rows = repeated({k: prompts[k] for k in ("prompt_tokens", "prompt_mask")}, generations)
    rollout = jax.device_get(decode(params, rows["prompt_tokens"], rows["prompt_mask"], key))
    tokens, mask = np.asarray(rollout.completion_tokens), np.asarray(rollout.completion_mask)
    ids = [row[keep].tolist() for row, keep in zip(tokens, mask)]
    texts = [detokenize(row) for row in ids]
    chosen = [records[int(i)] for i in np.asarray(prompts["record_index"])]
    scores = grpo_rewards(
        rewards, [r.prompt for r in chosen], [r.fields for r in chosen], texts, ids, generations
    )  # [completions, functions], NaN where a function does not apply
    names = [reward.name for reward in rewards]
    advantages, metrics = grpo_math.reward_metrics(scores, names, generations, grpo.reward_weights, grpo.scale_rewards)
    total = grpo_math.weighted_rewards(np.asarray(scores, np.float32), grpo.reward_weights)
    _, zero_std = grpo_math.group_advantages(total, generations, grpo.scale_rewards)
    truncated = ~np.asarray(rollout.stopped)
    batch = {
        **rows,
        "completion_tokens": tokens.astype(np.int32),
        "completion_mask": mask,
        "old_logps": np.asarray(rollout.logprobs, np.float32),
        "advantages": np.asarray(advantages, np.float32),
        "rewards": np.nan_to_num(np.asarray(total, np.float32)),
        "zero_std": np.asarray(zero_std, np.float32),
        "truncated": truncated.astype(np.float32),
    }
    host = {name: float(value) for name, value in jax.device_get(metrics).items()}
    host.update({name: float(value) for name, value in grpo_math.completion_metrics(mask, truncated).items()})
    return batch, host
