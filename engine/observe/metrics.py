"""Metric output on process 0: a tqdm progress bar, metrics.jsonl, TensorBoard events and the
experiment trackers of log.trackers (engine/observe/trackers.py)."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from tqdm import tqdm

from engine.observe.trackers import Tracker, numbers
from engine.runtime.judged import Judged
from engine.runtime.rundir import METRICS, append_line, read_records

# what a plain (not a terminal's) train line shows of a train record, every log.every_steps (and
# the objective's own: MetricWriter's console_keys)
PLAIN_TRAIN_KEYS: tuple[str, ...] = ("loss", "accuracy", "learning_rate", "grad_norm", "steps_per_sec", "mfu")
PLAIN_TRAIN_KEYS += ("outer_step", "drift")
BRIEF_KEYS = ("loss", "accuracy")  # what a progress bar shows (and the objective's brief_keys)


class MetricWriter:
    """Writes each metrics record to every sink; on other processes it does nothing."""

    def __init__(
        self,
        workdir: str | Path,
        *,
        enabled: bool,
        total_steps: int,
        start_step: int,
        progress: bool,
        tensorboard: bool,
        name: str = "",
        judged: Optional[Judged] = None,
        trackers: Sequence[Tracker] = (),
        console_keys: Sequence[str] = (),
        brief_keys: Sequence[str] = (),
    ):
        """name: printed before each line (the runs of a vectorised group share one output);
        judged: a search trial's pipe to its sweep, asked after each train and eval record;
        trackers: W&B and MLflow runs, given every record (engine/observe/trackers.py);
        console_keys, brief_keys: the objective's names a plain line and a progress bar show too
        (engine/config/objective.py: DPO's TRL names)."""
        self.plain_keys, self.brief_keys = (*PLAIN_TRAIN_KEYS, *console_keys), (*BRIEF_KEYS, *brief_keys)
        self.enabled, self.judged, self.trackers = enabled, judged, list(trackers)
        self.prefix = f"{name}: " if name else ""
        self.total_steps = total_steps
        self.bar: Optional[tqdm] = None
        self.summary = None
        self.jsonl_path = Path(workdir) / METRICS
        self.console = True  # stdout has a reader (see _say)
        if not enabled:
            return
        workdir = Path(workdir)
        if tensorboard:
            self.summary = _fresh_event_file(workdir, read_records(self.jsonl_path))
        if progress and sys.stderr.isatty():  # not a terminal (a log file, a pipe): plain lines instead
            # smoothing=0: the rate is steps since the clock started / time since (see advance)
            self.bar = tqdm(
                total=total_steps,
                initial=start_step,
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
                mininterval=0.5,
                smoothing=0,
            )
        self._timed = False

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)
            if not self._timed:  # the first call compiled: the rate and ETA count from its end
                self._timed = True
                self.bar.start_t, self.bar.initial = self.bar._time(), self.bar.n

    def write(self, step: int, split: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "split": split, **{k: _plain(v) for k, v in values.items()}}
        # Opened per record: a trainer resuming beside a sidecar evaluator rewrites this file,
        # and a handle held open would keep appending to the replaced one.
        append_line(self.jsonl_path, json.dumps(record) + "\n")
        if self.summary is not None:
            _add_scalars(self.summary, step, split, values)
            self.summary.flush()
        for tracker in self.trackers:
            tracker.log(step, split, numbers(values))
        if self.judged is not None and split in ("train", "eval"):
            self.judged.ask(record)
        if split == "summary":  # the trainer prints its own one-paragraph summary
            return
        if self.bar is not None:
            brief: dict[str, Any] = {k: values[k] for k in self.brief_keys if k in values}
            if split == "train":
                self.bar.set_postfix({k: f"{v:.4g}" for k, v in brief.items()}, refresh=False)
            else:
                self.bar.write(f"step {step} {split}: " + " ".join(f"{k}={v:.4g}" for k, v in brief.items()))
        else:
            shown = {k: v for k, v in values.items() if split != "train" or k in self.plain_keys}
            self._say(
                f"{self.prefix}step {step} {split}: "
                + " ".join(f"{k}={v:.4g}" for k, v in shown.items() if isinstance(v, (int, float)))
                + (_eta(self.total_steps - step, values.get("steps_per_sec")) if split == "train" else "")
            )

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            self._say(self.prefix + text)

    def _say(self, line: str) -> None:  # (off a terminal: the lines a log file keeps)
        """A console line, while there is a console: when the reader of stdout is gone (a
        launcher killed, a closed pipe) the run goes on, its records still in metrics.jsonl."""
        if not self.console:
            return
        try:
            print(line, flush=True)
        except BrokenPipeError:
            self.console = False
            sys.stdout = open(os.devnull, "w")  # nor does the interpreter's last flush fail on it

    def close(self) -> None:
        if self.judged is not None:
            self.judged.close()
        if self.bar is not None:
            self.bar.close()
        if self.summary is not None:
            self.summary.close()
        for tracker in self.trackers:
            tracker.close()


def _add_scalars(summary, step: int, split: str, values: dict) -> None:
    for name, value in values.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            summary.add_scalar(f"{split}/{name}", value, step)


def _fresh_event_file(workdir: Path, records: list[dict]):
    """A SummaryWriter whose events are exactly `records` (the run's metrics.jsonl so far).

    TensorBoard reads every event file of a directory as one stream; a resumed run's new file
    (steps from the checkpoint on) after an old one that went further makes TensorBoard purge
    points as "out of order". So the old files go and the kept records are written again, in
    order, into the new file: TensorBoard then shows what metrics.jsonl holds."""
    from tensorboardX import SummaryWriter

    for old in workdir.glob("events.out.tfevents.*"):
        old.unlink()
    summary = SummaryWriter(str(workdir))
    for record in records:
        if record.get("source") != "evaluator":  # the evaluator writes its own directory
            _add_scalars(
                summary,
                record["step"],
                record["split"],
                {k: v for k, v in record.items() if k not in ("step", "split")},
            )
    summary.flush()
    return summary


def _plain(value):
    """JSON-safe numbers (NaN and Inf become strings, as JSON has no literal for them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _eta(steps_left: int, steps_per_sec: Any) -> str:
    """' eta=1h02m' for the steps left at the window's rate (the progress bar's ETA, for plain lines)."""
    if steps_left <= 0 or not isinstance(steps_per_sec, (int, float)) or steps_per_sec <= 0:
        return ""
    minutes, seconds = divmod(int(round(steps_left / steps_per_sec)), 60)
    hours, minutes = divmod(minutes, 60)
    return f" eta={hours}h{minutes:02d}m" if hours else f" eta={minutes}m{seconds:02d}s"
