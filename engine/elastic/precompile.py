"""Between an elastic job's starts: the background precompiles of its smaller sizes.

fault.precompile: while a job of n processes trains, the launcher runs `launch.py ... --dry-run`
(the engine's own ahead-of-time compile of the train and eval steps, engine/plan/dryrun.py) as a
job of n-1 processes with that size's mesh overrides, at the lowest CPU priority (nice 19),
writing into JAX's persistent compilation cache (train.compilation_cache_dir); then n-2, down to
fault.min_processes, one size at a time. A restart on n-1 processes then finds its programs in
the cache (its summary's compile_cache_hits) and skips XLA compilation. The cache's key is the
program, its device assignment, the XLA flags and the jax/XLA versions, so the dry run of the same
command on the same process and device counts compiles exactly what the restarted job asks for
(jax 0.10.2, CPU, 3 processes x 2 devices: the training job's build had 6 hits and no miss after
one dry run). The precompiles start once the job has written to metrics.jsonl (its own compile is
over: they never compete with it), each size's output goes to WORKDIR/precompile-<n>.log and one
line on stderr says when it is in the cache; a failed precompile is a warning, never the job's
end. A restart stops the precompiles still running (SIGKILL: they only write complete cache
entries) and starts those of the sizes below the new one.

Where a smaller job's dry run runs is the launcher's (`Membership.precompile`): on this machine
(local processes, `LocalDryRun`); as an `srun --overlap` step of the allocation's tasks
(engine/elastic/srun_steps.py: on the nodes that will run the restart, with a coordinator port of
its own); one process per pod of the first n-1 pods of the round (engine/elastic/pods.py: the
round's leader names each size's coordinator). Each takes part only where the workdir is shared,
as an elastic job's checkpoints already require.

Imports no jax.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Protocol

from engine.errors import UsageError
from engine.runtime.launcher import start_background


class DryRun(Protocol):
    """A smaller job's dry run started in the background."""

    def wait(self) -> list[int]:
        """Until it ends: its processes' exit codes."""
        ...

    def kill(self) -> None:
        """Ends it now (SIGKILL: the cache only takes complete entries), and waits for it."""
        ...

    @property
    def log(self) -> Path:
        """The file its output goes to."""
        ...


# (args, processes, devices per process, the log's path) → the dry run started (its output written to that
# file, or to a file named after it: a pod's share), or None where this place takes no part
Launch = Callable[[list[str], int, int, Path], Optional[DryRun]]


class LocalDryRun:
    """A dry run as local processes at nice 19 (the local launcher's, engine/runtime/launcher.py)."""

    def __init__(self, args: list[str], processes: int, devices: int, log: Path):
        self.log = log
        with open(log, "w") as out:
            self.children = start_background(args, processes, devices, out)

    def wait(self) -> list[int]:
        return [child.wait() for child in self.children]

    def kill(self) -> None:
        for child in self.children:
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def local_dry_run(args: list[str], processes: int, devices: int, log: Path) -> DryRun:
    return LocalDryRun(args, processes, devices, log)


def check_precompile(cfg) -> None:
    """fault.precompile needs the persistent compilation cache (UsageError naming the fix)."""
    if cfg.fault.precompile and not cfg.train.compilation_cache_dir:
        raise UsageError(
            "fault.precompile=true compiles the smaller jobs into the persistent compilation cache, but "
            'train.compilation_cache_dir="" turns it off; set train.compilation_cache_dir to a folder '
            "(the default ~/.cache/jax-engine/xla) or fault.precompile=false"
        )


class Precompiles:
    """The background dry runs of the job's smaller sizes (nothing unless fault.precompile),
    each started by `launch` (the membership's: where a dry run of that size runs)."""

    def __init__(self, args: list[str], plans: dict[int, list[str]], devices: int, cfg, launch: Launch):
        self.args, self.plans, self.devices, self.launch = args, plans, devices, launch
        self.enabled, self.workdir = cfg.fault.precompile, Path(cfg.workdir)
        self.stopped = threading.Event()
        self.running: Optional[DryRun] = None
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def start(self, alive: int) -> None:
        """Precompiles the sizes below `alive`, largest first, once the job of `alive` has compiled."""
        sizes = sorted((n for n in self.plans if n < alive), reverse=True)
        if not self.enabled or not sizes:
            return
        self.stopped.clear()
        self.thread = threading.Thread(target=self._run, args=(sizes, time.time()), name="precompile", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Until every size started has been precompiled (or failed)."""
        if self.thread is not None:
            self.thread.join()

    def stop(self) -> None:
        """Ends the precompile running now (and the ones after it)."""
        self.stopped.set()
        with self.lock:
            if self.running is not None:
                self.running.kill()
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    def _run(self, sizes: list[int], since: float) -> None:
        metrics = self.workdir / "metrics.jsonl"
        while not (metrics.is_file() and metrics.stat().st_mtime > since):  # the job's own compile first
            if self.stopped.wait(1.0):
                return
        for count in sizes:
            began = time.monotonic()
            args = [*self.args, *self.plans[count], "fault.elastic=false", "--dry-run"]
            with self.lock:
                if self.stopped.is_set():
                    return
                self.running = self.launch(args, count, self.devices, self.workdir / f"precompile-{count}.log")
            if self.running is None:  # (this place takes no part in that size's job)
                continue
            codes = self.running.wait()
            if self.stopped.is_set():
                return
            took = time.monotonic() - began
            if any(codes):
                sys.stderr.write(
                    f"warning: precompile of the {count}-process job failed ({self.running.log}); not cached\n"
                )
                continue
            sys.stderr.write(
                f"precompile: the {count}-process job's programs are in the compilation cache ({took:.1f}s)\n"
            )
