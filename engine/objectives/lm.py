"""train.objective=lm's step part: the family's loss (engine/run/step.py make_loss_fn; its record is
engine/config/objective.py LM)."""

from __future__ import annotations

from engine.objectives import StepPart
from engine.run.step import make_loss_fn


def part(cfg) -> StepPart:
    del cfg

    def loss_fn(module, family, num_sources: int = 0):
        return make_loss_fn(module, family.task, family.hparams, num_sources)

    return StepPart(loss_fn)
