"""GRPO's rollout batch (train.objective=grpo): a batch of prompts → num_generations completions of
each, sampled by the decode program (engine/lm/rollouts.py) from the policy's current weights →
their text → the reward functions on the host (engine/lm/rewards.py, TRL's signature) →
group-normalised advantages (engine/lm/grpo_math.py) → the arrays the update (grpo.py) trains on,
and TRL's reward metrics, which come from the host (rewards/<function>/mean among them).

The decode key is the caller's: rollouts.rollout_key(state.rng, step), a function of (seed, step),
so a resumed run samples the same completions.

In a job of several processes each gives its own rows of the batch of prompts (those its devices
hold: data.process_rows), the decode runs on the run's mesh, and its completions and the prompts'
record indices are gathered to every process (`sampled_rows`); process 0 alone calls the reward
functions (user code, which may not be deterministic or safe to run N times) and broadcasts their
numbers bit for bit (`scored_on_process_0`), so every process computes the same advantages and
metrics. A reward function's error on process 0 is broadcast too: every process stops with it
(exit 2 naming the function and the prompt), none waits for rewards that never come."""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import numpy as np

from engine.errors import UsageError
from engine.lm import grpo_math
from engine.lm.rewards import RewardFunction, grpo_rewards
from engine.lm.rollouts import Decode
from engine.runtime.processes import current

ROLLOUT_FIELDS = ("completion_tokens", "logprobs", "completion_mask", "stopped")


def repeated(prompts: dict, generations: int) -> dict:
    """Each prompt's row repeated for its completions (consecutive: a group)."""
    return {name: np.repeat(np.asarray(array), generations, axis=0) for name, array in prompts.items()}


def sampled_rows(decode: Decode, params, rows: dict, record_index, key, sharding=None) -> tuple[dict, dict, np.ndarray]:
    """(the whole batch's rows `prompt_tokens`, `prompt_mask`; its rollout's fields, host arrays;
    the whole batch's prompts' record indices) from this process's `rows` (its prompts repeated)
    and `record_index` (its prompts'). One process: its rows are the batch. Several: each
    process's rows become the global arrays `sharding` (the decode's batch sharding) places, the
    decode runs on them, and everything is gathered to every process in the batch's order. (The
    run's processes: a sweep trial's may be some of the job's, engine/runtime/processes.py.)"""
    if current().count == 1 or sharding is None:
        rollout = jax.device_get(decode(params, rows["prompt_tokens"], rows["prompt_mask"], key))
        return rows, {name: np.asarray(getattr(rollout, name)) for name in ROLLOUT_FIELDS}, np.asarray(record_index)
    from jax.experimental import multihost_utils

    total = decode.batch  # (the decode's rows: the whole batch's completions)
    per_prompt = len(rows["prompt_tokens"]) // max(len(record_index), 1)  # (num_generations)
    placed = {
        name: jax.make_array_from_process_local_data(sharding, np.asarray(value), (total, *value.shape[1:]))
        for name, value in rows.items()
    }
    index = jax.make_array_from_process_local_data(sharding, np.asarray(record_index), (total // per_prompt,))
    rollout = decode(params, placed["prompt_tokens"], placed["prompt_mask"], key)
    every = multihost_utils.process_allgather(
        {**placed, "record_index": index, **{name: getattr(rollout, name) for name in ROLLOUT_FIELDS}}, tiled=True
    )
    every = {name: np.asarray(value) for name, value in every.items()}
    return {name: every[name] for name in rows}, {name: every[name] for name in ROLLOUT_FIELDS}, every["record_index"]


def scored_on_process_0(score: Callable[[], np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
    """score()'s float64 array of `shape`, called on the run's chief alone (process 0 of a run on
    the whole job) and broadcast to the run's every process bit for bit (as uint32 halves: without
    jax_enable_x64 a float64 would be cut to float32 on its way). Its failure reaches every
    process: a UsageError (a reward function that raised or answered wrongly) is raised on each
    with the chief's message, anything else is re-raised on the chief and a RuntimeError naming
    it on the others."""
    processes = current()
    if processes.count == 1:
        return score()
    chief = processes.chief
    scores, code = np.zeros(shape, np.float64), 0
    failure: Optional[Exception] = None
    if chief:
        try:
            scores = np.ascontiguousarray(score(), np.float64)
        except UsageError as e:  # (the user's function: said on every process, exit 2)
            failure, code = e, 2
        except Exception as e:  # (a fault of ours: said on process 0 with its traceback, named on the others)
            failure, code = e, 1
    text = str(failure).encode() if failure is not None else b""
    header = processes.broadcast(np.array([code, len(text)], np.int32))
    code, size = int(header[0]), int(header[1])
    if code:
        said = np.frombuffer(text, np.uint8).astype(np.int32) if chief else np.zeros(size, np.int32)
        message = bytes(np.asarray(processes.broadcast(said), np.uint8)).decode()
        if failure is not None:
            raise failure
        if code == 2:
            raise UsageError(message)
        raise RuntimeError(f"process {processes.ids[0]} failed scoring the rollouts' rewards: {message}")
    halves = processes.broadcast(scores.view(np.uint32))
    return np.ascontiguousarray(np.asarray(halves, np.uint32)).view(np.float64).reshape(shape)


def rollout_batch(
    decode: Decode,
    params,
    prompts: dict,
    key,
    records: Sequence,
    rewards: Sequence[RewardFunction],
    detokenize: Callable[[list[int]], str],
    grpo,
    sharding: Optional[jax.sharding.Sharding] = None,
) -> tuple[dict, dict]:
    """(the update's batch of host arrays, one row a completion of the whole batch: grpo.py's
    ROLLOUT_ARRAYS with `rewards`, `zero_std`, `truncated`; TRL's reward and completion metrics)
    of a batch of prompts (host arrays `prompt_tokens` [B, P], `prompt_mask` [B, P],
    `record_index` [B], a data.name=prompts batch: this process's rows of it; `records`: the
    split's PromptRecords). `decode`: build_decode's program for the whole batch's B x
    num_generations rows; `detokenize`: token ids → text; `sharding`: the decode's batch sharding
    (needed in a job of several processes: see the module's docstring)."""
    generations = grpo.num_generations
    local = repeated({k: prompts[k] for k in ("prompt_tokens", "prompt_mask")}, generations)
    rows, rollout, record_index = sampled_rows(decode, params, local, prompts["record_index"], key, sharding)
    tokens, mask = rollout["completion_tokens"], rollout["completion_mask"]
    ids = [row[keep].tolist() for row, keep in zip(tokens, mask)]
    chosen = [records[int(i)] for i in record_index]

    def score() -> np.ndarray:  # [completions, functions], NaN where a function does not apply
        texts = [detokenize(row) for row in ids]
        return grpo_rewards(rewards, [r.prompt for r in chosen], [r.fields for r in chosen], texts, ids, generations)

    scores = scored_on_process_0(score, (len(ids), len(rewards)))
    names = [reward.name for reward in rewards]
    advantages, metrics = grpo_math.reward_metrics(scores, names, generations, grpo.reward_weights, grpo.scale_rewards)
    total = grpo_math.weighted_rewards(np.asarray(scores, np.float32), grpo.reward_weights)
    _, zero_std = grpo_math.group_advantages(total, generations, grpo.scale_rewards)
    truncated = ~np.asarray(rollout["stopped"])
    batch = {
        **rows,
        "completion_tokens": tokens.astype(np.int32),
        "completion_mask": mask,
        "old_logps": np.asarray(rollout["logprobs"], np.float32),
        "advantages": np.asarray(advantages, np.float32),
        "rewards": np.nan_to_num(np.asarray(total, np.float32)),
        "zero_std": np.asarray(zero_std, np.float32),
        "truncated": truncated.astype(np.float32),
    }
    host = {name: float(value) for name, value in jax.device_get(metrics).items()}
    host.update({name: float(value) for name, value in grpo_math.completion_metrics(mask, truncated).items()})
    return batch, host
