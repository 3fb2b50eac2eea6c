"""Which checkpoints a run keeps and which one a reader gets: checkpoint.keep_best's retention
(the best step beside the newest checkpoint.keep; orbax's preservation policy), `--step best`
and `--step N`, and the step train.early_stop ended a run at, all read from the checkpoints'
meta (written by engine/run/best.py's Monitor)."""

from __future__ import annotations

import math
import sys
from typing import Optional

import orbax.checkpoint as ocp

from engine.errors import UsageError


def retention(keep: Optional[int], best: Optional[tuple[str, str]]) -> dict:
    """CheckpointManagerOptions' keys for what a save's clean-up keeps: the newest `keep`
    (None: every step, a reader's), and with `best` (metric, min|max) also the step whose save's
    metrics hold the best value of `metric` (only a new best's save is given a value)."""
    if keep is None or best is None:
        return {"max_to_keep": keep}
    metric, mode = best
    worst = math.inf if mode == "min" else -math.inf

    def value(metrics: dict) -> float:  # a save given no value (`{}`) is never the best
        return metrics.get(metric, worst)

    policies = ocp.checkpoint_managers
    return {
        "best_fn": value,  # (orbax writes a save's metrics only when best_fn is set)
        "best_mode": mode,
        "preservation_policy": policies.AnyPreservationPolicy(
            [
                policies.LatestN(n=keep),
                policies.BestN(get_metric_fn=value, reverse=mode == "min", n=1, keep_checkpoints_without_metrics=False),
            ]
        ),
    }


def chosen_step(checkpointer, cfg, step: Optional[str]) -> Optional[int]:
    """The checkpoint a reader's --step names: None: the newest readable one; "best":
    checkpoint.keep_best's, as the newest readable checkpoint's meta records it; N: step N."""
    if step is None:
        return None
    saved = checkpointer.steps()
    if step == "best":
        number = _best_step(checkpointer, cfg, saved)
    else:
        try:
            number = int(step)
        except ValueError:
            raise UsageError(f"--step {step!r} must be best or a checkpoint's step number") from None
    if number not in saved:
        raise UsageError(
            f"--step {step}: {checkpointer.directory} holds no checkpoint {number}; it holds steps "
            f"{', '.join(map(str, saved)) or 'none'}"
        )
    return number


def stopped_at(checkpointer, step: int) -> tuple[bool, Optional[int]]:
    """(whether checkpoint `step`'s meta could be read, the step train.early_stop ended the run
    at as it records it: None if it did not stop early)."""
    meta = _meta(checkpointer, step)
    stopped = ((meta or {}).get("early_stop") or {}).get("stopped_at")
    return meta is not None, int(stopped) if stopped is not None else None


def _meta(checkpointer, step: int) -> Optional[dict]:
    """Checkpoint `step`'s meta JSON; None when it cannot be read (a step being written, set
    aside or damaged: orbax and tensorstore raise these)."""
    try:
        meta = checkpointer.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if isinstance(meta, dict) else None


def _best_step(checkpointer, cfg, saved: list[int]) -> int:
    if not cfg.checkpoint.keep_best:
        raise UsageError(
            f"--step best reads the checkpoint kept by checkpoint.keep_best, which the run in "
            f"{checkpointer.directory.parent} did not set; train with checkpoint.keep_best=eval/loss (or another "
            f"eval metric), or give --step N"
        )
    for candidate in reversed(saved):
        meta = _meta(checkpointer, candidate)
        if meta is None:
            print(
                f"warning: checkpoint {checkpointer.directory}/{candidate}'s record cannot be read; the best step "
                "is taken from the one before it",
                file=sys.stderr,
            )
            continue
        record = meta.get("keep_best") or {}
        if record.get("metric") == cfg.checkpoint.keep_best and record.get("step") is not None:
            return int(record["step"])
    raise UsageError(
        f"--step best: no checkpoint in {checkpointer.directory} records a best {cfg.checkpoint.keep_best} "
        f"yet (it is recorded at each evaluation); give --step N or train until an evaluation"
    )
