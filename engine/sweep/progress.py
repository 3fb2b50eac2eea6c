"""A sub-mesh sweep's console (engine/sweep/submesh.py): on a terminal one line per sub-mesh,
updated in place (tqdm bars at fixed positions: its trial, state, step and the sweep's metric);
elsewhere (a log file, a pipe) plain lines as trials start, evaluate and end. Then the
sweep's summary: how many trials ended how, and the time. `Routed`: sys.stdout and sys.stderr
while the trials train, each trial thread's text going to its own log.

Imports no jax."""

from __future__ import annotations

import io
import threading
import time
from collections import Counter
from typing import Any, Optional

from tqdm import tqdm


class Progress:
    def __init__(
        self, slots: int, metric: str, stream, terminal: Optional[bool] = None, labels: Optional[list[int]] = None
    ):
        """`labels`: the sub-meshes' numbers in the job (a process of several shows its own: default 0..slots-1)."""
        self.metric, self.stream, self.lock = metric, stream, threading.Lock()
        self.labels = labels if labels is not None else list(range(slots))
        self.split, self.name = metric.split("/", 1)
        self.terminal = stream.isatty() if terminal is None else terminal
        self.lines: list[dict[str, Any]] = [{"run": "", "state": "waiting", "step": 0} for _ in range(slots)]
        self.ended_counts: Counter = Counter()
        self.began = time.time()
        self.bars: list[tqdm] = []
        if self.terminal:
            self.bars = [
                tqdm(total=None, position=i, file=stream, bar_format="{desc}", leave=True, dynamic_ncols=True)
                for i in range(slots)
            ]

    def started(self, slot: int, run: str, devices: list) -> None:
        with self.lock:
            self.lines[slot] = {"run": run, "state": "starting", "step": 0, "devices": [d.id for d in devices]}
        if not self.terminal:
            self._say(f"start {run} on sub-mesh {self.labels[slot]} (devices {self.lines[slot]['devices']})")

    def record(self, slot: int, record: dict) -> None:
        """A train or eval record the slot's trial logged."""
        with self.lock:
            line = self.lines[slot]
            line.update(state="training", step=record["step"])
            if record["split"] == self.split and self.name in record:
                line["metric"] = record[self.name]
            elif record["split"] == "train" and "loss" in record:
                line["loss"] = record["loss"]
        if not self.terminal and record["split"] == self.split and self.name in record:
            run = record.get("run", line["run"])  # (a vectorised group's trial names itself)
            self._say(f"{run} step {record['step']}: {self.metric}={record[self.name]:.4g}")

    def ended(self, slot: int, run: str, status: dict) -> None:
        state = status.get("status", "?")
        with self.lock:
            self.lines[slot].update(state=state)
            self.ended_counts[state] += 1
        error = f": {status['error']}" if status.get("error") else ""
        if self.terminal:
            tqdm.write(f"{state:>11} {run}{error}", file=self.stream)
        else:
            self._say(f"{state:>11} {run}{error}")

    def idle(self, slot: int) -> None:
        with self.lock:
            self.lines[slot] = {"run": "", "state": "idle", "step": 0}

    def text(self, slot: int) -> str:
        line = self.lines[slot]
        if not line["run"]:
            return f"[{self.labels[slot]}] {line['state']}"
        shown = f" {self.metric}={line['metric']:.4g}" if "metric" in line else ""
        shown += f" loss={line['loss']:.4g}" if "loss" in line else ""
        return f"[{self.labels[slot]}] {line['run']}: {line['state']} step {line['step']}{shown}"

    def refresh(self) -> None:
        if not self.terminal:
            return
        with self.lock:
            texts = [self.text(slot) for slot in range(len(self.lines))]
        for bar, text in zip(self.bars, texts):
            bar.set_description_str(text, refresh=True)

    def close(self) -> None:
        self.refresh()
        for bar in self.bars:
            bar.close()
        counts = ", ".join(f"{n} {state}" for state, n in sorted(self.ended_counts.items())) or "nothing trained"
        self._say(f"sweep: {counts} in {time.time() - self.began:.0f}s")

    def _say(self, line: str) -> None:
        with self.lock:
            print(line, file=self.stream, flush=True)


class Routed(io.TextIOBase):
    """sys.stdout or sys.stderr, writing each thread's text to that thread's file if it has one
    (a trial's run.log), else to the stream it replaced."""

    def __init__(self, stream):
        self.stream, self.files = stream, {}

    def write(self, text: str) -> int:
        target = self.files.get(threading.get_ident(), self.stream)
        target.write(text)
        return len(text)

    def flush(self) -> None:
        self.files.get(threading.get_ident(), self.stream).flush()

    def isatty(self) -> bool:
        return threading.get_ident() not in self.files and self.stream.isatty()

    def fileno(self) -> int:  # (faulthandler's stacks, a hang's: the process's own stream)
        return self.stream.fileno()

    @property
    def encoding(self):
        return self.stream.encoding
