"""train.objective=dpo's record (engine/config/objective.py): preference pairs (data.name=preferences),
the `dpo` section, β a step input, TRL's DPOTrainer's metric names; its step part is engine/objectives/dpo_part.py."""

from __future__ import annotations

from engine.config.objective_record import Objective
from engine.errors import UsageError

PREFERENCES = "preferences"  # the data source of preference pairs (engine/data/preferences.py)
UNSMOOTHED = ("ipo", "hinge")  # TRL's losses that take no label smoothing
DPO_BETA = "dpo_beta"  # β, a step input in the state's hparams
REF_LOGPS = "ref_logps"  # a batch's precomputed reference log-probabilities [pairs, 2] (float32)
# sums over the pairs, after the train metrics (whose `correct` then counts the pairs whose chosen
# reward is the higher, `count` the pairs)
DPO_SUMS = ("rewards_chosen", "rewards_rejected", "logps_chosen", "logps_rejected")


def dpo_record(sums: dict) -> dict:
    """Summed DPO metrics (`loss_sum`, `correct`, `count`, DPO_SUMS) → the means over the pairs
    under Hugging Face TRL's names."""
    pairs = max(float(sums["count"]), 1.0)
    mean = {name: float(sums[name]) / pairs for name in DPO_SUMS}
    return {
        "loss": float(sums["loss_sum"]) / pairs,
        "rewards/chosen": mean["rewards_chosen"],
        "rewards/rejected": mean["rewards_rejected"],
        "rewards/accuracies": float(sums["correct"]) / pairs,
        "rewards/margins": mean["rewards_chosen"] - mean["rewards_rejected"],
        "logps/chosen": mean["logps_chosen"],
        "logps/rejected": mean["logps_rejected"],
    }


def check(cfg) -> None:
    """UsageError naming the key and the fix when the `dpo` section or the layout does not fit."""
    dpo = cfg.dpo
    if not dpo.label_smoothing < 0.5:
        raise UsageError(
            f"dpo.label_smoothing={dpo.label_smoothing} must be in [0, 0.5) (the share of pairs taken as "
            f"mislabelled), e.g. 0.1"
        )
    if dpo.loss in UNSMOOTHED and dpo.label_smoothing > 0:
        raise UsageError(
            f"dpo.loss={dpo.loss} takes no label smoothing (TRL ignores it there), but dpo.label_smoothing="
            f"{dpo.label_smoothing}; set dpo.label_smoothing=0, or dpo.loss=sigmoid"
        )
    if cfg.finetune.lora.dropout:
        raise UsageError(
            f"finetune.lora.dropout={cfg.finetune.lora.dropout} has no effect with train.objective=dpo, which "
            "scores the policy and the reference without dropout (as TRL's disable_dropout); set "
            "finetune.lora.dropout=0"
        )
    for key, value, fix in (("mesh.pipeline", cfg.mesh.pipeline, 1), ("train.sync", cfg.train.sync, "every_step")):
        if value != fix:
            raise UsageError(f"train.objective=dpo does not run with {key}={value} yet; set {key}={fix}")


def check_vectorised(cfg, where: str) -> None:
    if cfg.dpo.precompute_reference:  # (one dataset, each trial's reference)
        raise UsageError(
            f"{where}: dpo.precompute_reference is not vectorised yet; set "
            "dpo.precompute_reference=false, or run the sweep without vectorize"
        )


def flops(cfg, policy: float, full: float, formula: str) -> tuple[float, str]:
    """A pair: two sequences through the policy (forward and backward) and, unless
    dpo.precompute_reference, two through the reference (forward alone: a third of a full step's work)."""
    reference = 0.0 if cfg.dpo.precompute_reference else 2 * full / 3
    what = "" if cfg.dpo.precompute_reference else " + the reference's forward on both (a third of the full step each)"
    return 2 * policy + reference, f"DPO pair: the policy on chosen and rejected, {formula} each{what}"


DPO = Objective(
    name="dpo",
    part="engine.objectives.dpo_part:part",
    data_sources=(PREFERENCES,),
    section="dpo",
    check=check,
    check_vectorised=check_vectorised,
    step_hparams={DPO_BETA: "dpo.beta"},
    sums=DPO_SUMS,
    record=dpo_record,
    console_keys=("rewards/accuracies", "rewards/margins"),
    brief_keys=("rewards/accuracies",),
    rows_per_example=lambda cfg: 2,
    flops=flops,
    keeps_reference=lambda cfg: not cfg.dpo.precompute_reference,
    prepass=lambda cfg: cfg.dpo.precompute_reference,
)
