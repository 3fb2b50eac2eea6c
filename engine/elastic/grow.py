"""Growing an elastic job back to its full size at its next persistent checkpoint, once the lost processes can run.

A job that fault.elastic shrank (engine/elastic/supervisor.py) runs on fewer processes than it was
started with. With fault.grow_back (the default) the launcher asks it to grow back once the lost
processes' places are there again: it writes WORKDIR/grow-request.json, and the training loop of
a smaller job (started with ENGINE_ELASTIC_GROW=<full size>) checks, at each persistent checkpoint
it saves, whether that file is there (process 0 reads it and tells the others, so every process
agrees on the step: engine/runtime/recovery.py `GrowWatch`). If it is, every process waits for that
checkpoint to be complete and exits with GROW_EXIT; the launcher starts the job again on its full
size, which restores that step (either tier: the new processes take their shards from the
persistent tier or a peer's copy, engine/checkpoint/local_reshard.py) and writes one
`split: "grow"` record (the stop's time and step, the processes before and now, the seconds from
the stop to the first step; ENGINE_ELASTIC_GREW carries the stop to the new job).

When the places are there again:
- the local launcher (--local-processes N): at once, since a process that died can be started
  again on the same machine, so a shrunk job grows back at its first persistent checkpoint;
- the SLURM driver (`launch.py train --elastic`, engine/elastic/srun_steps.py): when no node of the
  allocation is reported down, drained or failing (sinfo, polled every POLL_SECONDS while the
  smaller step runs): a requeued or resumed node, or a task that died on a node that stayed up.
Growing costs one restart (start-up, joining, the restore, compilation or the persistent cache's
hit), not a checkpoint: the job stops at a step it saves anyway. fault.max_restarts counts the
restarts after failures since the job last ran at its full size: a job that keeps reaching
persistent checkpoints between failures goes on. Imports no jax.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from engine.errors import UsageError
from engine.parallel.strategies import strategy_of
from engine.runtime.restart_protocol import GREW as GREW
from engine.runtime.restart_protocol import GROW as GROW
from engine.runtime.restart_protocol import GROW_EXIT as GROW_EXIT
from engine.runtime.restart_protocol import REQUEST as REQUEST

POLL_SECONDS = 30.0  # SLURM: how often the driver asks sinfo whether the allocation's nodes are back


def note_growth(cfg) -> None:
    """Says at start when a job that shrinks could not grow back as fault.grow_back means (no
    persistent checkpoint before the end; a strategy with rounds, DiLoCo's, only at the checkpoints that end one)."""
    every, strategy = cfg.checkpoint.every_steps, strategy_of(cfg)
    if not cfg.fault.grow_back:
        return
    if not every:
        sys.stderr.write(
            "note: fault.grow_back: checkpoint.every_steps=0 saves no persistent checkpoint before the end, so a job "
            "that shrinks does not grow back; set checkpoint.every_steps\n"
        )
    elif every % (round_steps := strategy.round_steps(cfg)):
        sys.stderr.write(
            f"note: fault.grow_back: a train.sync={cfg.train.sync} job grows back only at a persistent checkpoint that "
            f"ends a round (every {math.lcm(every, round_steps)} steps here); make checkpoint.every_steps a multiple "
            f"of {strategy.round_setting} ({round_steps})\n"
        )


def start_env(alive: int, full: int, grew: Optional[dict], cfg) -> dict[str, str]:
    """The environment that tells a start of `alive` processes (of a job of `full`) it may be asked
    to grow back, and what it grew from."""
    env = {GROW: str(full)} if cfg.fault.grow_back and alive < full else {}
    return {**env, **({GREW: json.dumps(grew)} if grew else {})}


def request(workdir: Path, processes: int, why: str) -> None:
    """Asks the running job to grow back to `processes` at its next persistent checkpoint (a
    request that cannot be written is a warning: the job goes on at its size)."""
    path = Path(workdir) / REQUEST
    temporary = path.with_name(f".{REQUEST}.{os.getpid()}")
    try:
        temporary.write_text(json.dumps({"processes": processes, "why": why, "time": time.time()}) + "\n")
        os.replace(temporary, path)
    except OSError as e:
        temporary.unlink(missing_ok=True)
        sys.stderr.write(f"warning: elastic: could not ask the job to grow back ({path}: {e.strerror or e})\n")


def withdraw(workdir: Path) -> None:
    """Removes a request (before each start: a new job is asked afresh); UsageError when something
    else than a request file is in its place (the job could not be asked to grow back)."""
    path = Path(workdir) / REQUEST
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise UsageError(
            f"{path} is not a regular file (a directory or a link), so a shrunk job cannot be asked to grow back; "
            "remove it (the launcher writes that file itself)"
        )
    path.unlink(missing_ok=True)


def grew_from(alive: int, full: int) -> dict:
    """What a start grown back from `alive` processes carries to its record (ENGINE_ELASTIC_GREW)."""
    return {"time": time.time(), "processes": alive, "full": full}


class WhenBack:
    """While a smaller SLURM step runs: a thread that asks it to grow back once `back()` says the
    lost nodes are back (asked at once, then every `every` seconds)."""

    def __init__(self, workdir: Path, full: int, back: Callable[[], bool], every: float = POLL_SECONDS):
        self.workdir, self.full, self.back, self.every = Path(workdir), full, back, every
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._poll, name="elastic-grow", daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.stopped.is_set():
            if self.back() and not self.stopped.is_set():  # (sinfo may take a while: not after the step ended)
                request(self.workdir, self.full, "the allocation's nodes are up")
                return
            self.stopped.wait(self.every)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()  # (a request it writes later would reach the next start)
