"""train.objective=grpo's record (engine/config/objective.py's table): prompts (data.name=prompts)
whose completions the run samples, the `grpo` section (engine/config/grpo_section.py, its checks),
num_generations rows per prompt, β a step input; its step part is engine/objectives/grpo.py."""

from __future__ import annotations

import math

from engine.config.grpo_section import PROMPTS, check_grpo
from engine.config.objective_record import Objective
from engine.errors import UsageError

GRPO_BETA = "grpo_beta"  # β of the KL penalty, a step input in the state's hparams
# the update's sums over the rollout batch's completions and tokens, after the train metrics
# (engine/objectives/grpo.py); a record divides them (grpo_record)
GRPO_SUMS = (
    "completions",
    "completion_tokens",
    "kl_sum",
    "clip_region_sum",
    "ratio_sum",
    "reward_sum",
    "reward_square_sum",
    "zero_std_sum",
    "truncated_sum",
)


def grpo_record(sums: dict) -> dict:
    """Summed GRPO metrics (loss_sum, count, GRPO_SUMS) → TRL's GRPOTrainer's names: reward and
    reward_std (Bessel's) over the completions, frac_reward_zero_std (each completion of a group
    whose rewards were equal counts), completions/mean_length and /clipped_ratio, kl and
    clip_ratio/region_mean over the completions' tokens."""
    rows, tokens = max(float(sums["completions"]), 1.0), max(float(sums["completion_tokens"]), 1.0)
    reward, square = float(sums["reward_sum"]), float(sums["reward_square_sum"])
    variance = (square - reward * reward / rows) / (rows - 1) if rows > 1 else 0.0
    return {
        "loss": float(sums["loss_sum"]) / max(float(sums["count"]), 1e-30),
        "reward": reward / rows,
        "reward_std": math.sqrt(max(variance, 0.0)),
        "frac_reward_zero_std": float(sums["zero_std_sum"]) / rows,
        "completions/mean_length": float(sums["completion_tokens"]) / rows,
        "completions/clipped_ratio": float(sums["truncated_sum"]) / rows,
        "kl": float(sums["kl_sum"]) / tokens,
        "clip_ratio/region_mean": float(sums["clip_region_sum"]) / tokens,
    }


def check_vectorised(cfg, where: str) -> None:
    raise UsageError(
        f"{where}: train.objective=grpo is not vectorised (each trial samples its own completions); run the "
        "sweep without vectorize (each trial trains in its own process)"
    )


def flops(cfg, policy: float, full: float, formula: str) -> tuple[float, str]:
    """A prompt: num_generations completions through the policy (forward and backward) each update
    and, with β > 0, through the reference (forward alone); the sampling's decode is not counted."""
    generations = cfg.grpo.num_generations
    reference = generations * full / 3 if cfg.grpo.beta > 0 else 0.0
    what = " + the reference's forward on each (a third of the full step)" if cfg.grpo.beta > 0 else ""
    return (
        generations * policy + reference,
        f"GRPO prompt: the policy on {generations} completions, {formula} each{what}",
    )


GRPO = Objective(
    name="grpo",
    part="engine.objectives.grpo:part",
    data_sources=(PROMPTS,),
    section="grpo",
    check=check_grpo,
    check_vectorised=check_vectorised,
    step_hparams={GRPO_BETA: "grpo.beta"},
    sums=GRPO_SUMS,
    record=grpo_record,
    console_keys=("reward", "reward_std", "kl", "completions/mean_length"),
    brief_keys=("reward",),
    rows_per_example=lambda cfg: cfg.grpo.num_generations,
    flops=flops,
    keeps_reference=lambda cfg: cfg.grpo.beta > 0,
)
