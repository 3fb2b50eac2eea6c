"""The best checkpoint (checkpoint.keep_best) and early stopping (train.early_stop): each
watches one eval metric over a run's evaluations. What they know (the best value and its step,
the evaluations since it, the step an early stop ended the run at) goes into every checkpoint's
meta, so a resumed run decides exactly as an unbroken one (nothing is recomputed). A save at an
evaluation that improves checkpoint.keep_best is given that value as its orbax metrics; orbax's
preservation policy keeps that step beside the newest checkpoint.keep (engine/checkpoint/choice.py,
which also reads the meta back: `--step best`, the step an early stop ended a run at)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from engine.errors import UsageError

PREFIX = "eval/"  # a watched metric is a key of the eval records: eval/loss, eval/accuracy, ...


@dataclass
class Watched:
    """One eval metric's course: its best value, the step it was reached at, and the
    evaluations since then that did not improve on it by more than `min_delta`."""

    key: str  # the config key that names it, for messages
    metric: str  # eval/NAME
    mode: str  # min (a loss) or max (an accuracy)
    min_delta: float = 0.0
    best: Optional[float] = None
    step: Optional[int] = None
    since: int = 0

    def update(self, metrics: dict[str, float], step: int) -> bool:
        """Takes the evaluation at `step`; True when it is a new best."""
        name = self.metric[len(PREFIX) :]
        if name not in metrics:
            names = ", ".join(PREFIX + n for n in metrics)
            raise UsageError(f"{self.key}={self.metric} is not an eval metric of this run; it records {names}")
        value = float(metrics[name])
        better = math.isfinite(value) and (
            self.best is None
            or (value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta)
        )
        if better:
            self.best, self.step, self.since = value, step, 0
        else:
            self.since += 1
        return better

    def exhausted(self, patience: int) -> bool:
        """Keras's rule: the run ends once `patience` evaluations (at least one) went without a
        new best; patience 0 and 1 both end it at the first evaluation without one."""
        return self.since > 0 and self.since >= patience

    def record(self) -> dict:
        return {"metric": self.metric, "mode": self.mode, "best": self.best, "step": self.step, "since": self.since}

    def resume(self, record: Optional[dict]) -> bool:
        """Takes a checkpoint's record of the same metric and mode (another one's is ignored)."""
        if not record or (record.get("metric"), record.get("mode")) != (self.metric, self.mode):
            return False
        self.best, self.step, self.since = record["best"], record["step"], record["since"]
        return True


@dataclass(frozen=True)
class Verdict:
    """What an evaluation means to the loop: save now (a new best to keep), end the run here."""

    save: bool = False
    stop: bool = False


@dataclass
class Monitor:
    """A run's watched metrics: checkpoint.keep_best's and train.early_stop's (None when off)."""

    keep_best: Optional[Watched]
    early_stop: Optional[Watched]
    patience: int
    total: int  # train.steps: an early stop is one before it
    stopped_at: Optional[int] = None  # the step train.early_stop ended the run at

    @classmethod
    def resumed(cls, cfg, meta: dict) -> "Monitor":
        """The config's watched metrics, with what the checkpoint's `meta` knows of them."""
        best, stop = cfg.checkpoint.keep_best, cfg.train.early_stop
        monitor = cls(
            Watched("checkpoint.keep_best", best, cfg.checkpoint.best_mode) if best else None,
            Watched("train.early_stop.metric", stop.metric, stop.mode, stop.min_delta) if stop.metric else None,
            stop.patience,
            cfg.train.steps,
        )
        if monitor.keep_best is not None:
            monitor.keep_best.resume(meta.get("keep_best"))
        record = meta.get("early_stop") or {}
        if monitor.early_stop is not None and monitor.early_stop.resume(record):
            stopped = record.get("stopped_at")
            # honoured while this config would stop there too (a raised patience trains on)
            if stopped is not None and monitor.early_stop.exhausted(stop.patience) and stopped < cfg.train.steps:
                monitor.stopped_at = stopped
        return monitor

    def evaluated(self, metrics: dict[str, float], step: int) -> Verdict:
        """Takes the evaluation at `step`: a save is due at a new best of checkpoint.keep_best;
        the run ends when train.early_stop's metric went `patience` evaluations without one."""
        improved = self.keep_best is not None and self.keep_best.update(metrics, step)
        watched = self.early_stop
        if watched is not None:
            watched.update(metrics, step)
            if watched.exhausted(self.patience) and step < self.total:
                self.stopped_at = step
        return Verdict(save=improved, stop=self.stopped_at == step)

    def why(self) -> str:
        """Why the run ended early, with where its best was."""
        watched = self.early_stop
        assert watched is not None and self.stopped_at is not None
        return (
            f"stopped early at step {self.stopped_at} of {self.total}: {watched.metric} has not improved by more "
            f"than train.early_stop.min_delta={watched.min_delta:g} for {watched.since} evaluations "
            f"(train.early_stop.patience={self.patience}; best {watched.best:.6g} at step {watched.step})"
        )

    def record(self) -> dict:
        """For a checkpoint's meta."""
        record: dict[str, Any] = {}
        if self.keep_best is not None:
            record["keep_best"] = self.keep_best.record()
        if self.early_stop is not None:
            record["early_stop"] = {**self.early_stop.record(), "stopped_at": self.stopped_at}
        return record

    def metrics(self, step: int) -> Optional[dict]:
        """The orbax metrics of a save at `step`: checkpoint.keep_best's value where it is the
        best so far, `{}` elsewhere (orbax warns of a save without metrics); None when off."""
        watched = self.keep_best
        if watched is None:
            return None
        return {watched.metric: watched.best} if watched.step == step else {}


def check_names(cfg, names: set[str]) -> None:
    """UsageError, before a run writes anything, when checkpoint.keep_best or
    train.early_stop.metric names an eval metric this run does not record (`names`)."""
    for key, metric in (
        ("checkpoint.keep_best", cfg.checkpoint.keep_best),
        ("train.early_stop.metric", cfg.train.early_stop.metric),
    ):
        if metric and metric[len(PREFIX) :] not in names:
            recorded = ", ".join(PREFIX + name for name in sorted(names))
            raise UsageError(f"{key}={metric} is not an eval metric of this run; it records {recorded}")
