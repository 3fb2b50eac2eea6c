"""The training objective's keys checked together: train.objective, the `dpo` section and data.name."""

from __future__ import annotations

import dataclasses

from engine.config.grpo_section import check_grpo
from engine.config.schema import DpoConfig
from engine.errors import UsageError

PREFERENCES = "preferences"  # the data source of preference pairs (engine/data/preferences.py)
UNSMOOTHED = ("ipo", "hinge")  # TRL's losses that take no label smoothing


def check_objective(cfg) -> None:
    """UsageError naming the key and the fix when train.objective, `dpo.*` and data.name disagree."""
    check_grpo(cfg)
    objective, data = cfg.train.objective, cfg.data.name
    if objective == "dpo" and data != PREFERENCES:
        raise UsageError(
            f"train.objective=dpo trains on preference pairs, but data.name={data}; set "
            f"data.name={PREFERENCES} (JSON Lines of prompt, chosen, rejected), or train.objective=lm"
        )
    if objective != "dpo" and data == PREFERENCES:
        raise UsageError(
            f"data.name={PREFERENCES} holds preference pairs, which train.objective={objective} cannot train "
            f"on; set train.objective=dpo"
        )
    if objective != "dpo":
        changed = [
            f"dpo.{f.name}={getattr(cfg.dpo, f.name)}"
            for f in dataclasses.fields(DpoConfig)
            if getattr(cfg.dpo, f.name) != getattr(DpoConfig(), f.name)
        ]
        if changed:
            raise UsageError(
                f"{', '.join(changed)} set with train.objective={objective}, which has no use for it; set "
                f"train.objective=dpo, or leave the dpo section out"
            )
        return
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
