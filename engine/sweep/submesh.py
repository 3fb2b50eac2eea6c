"""`launch.py sweep SWEEP.yaml --devices-per-trial N`: one process splits its devices into
sub-meshes of N and trains a trial on each at once, one thread per sub-mesh.

Each trial is an ordinary run (engine/run/single.py `fit`) built on its sub-mesh's devices:
its own config, mesh layout within the sub-mesh, compiled programs, data pipeline, workdir,
checkpoints and records, so its outputs are those of the same config trained alone on N
devices. The trials form a queue (a grid/zip/random sweep's pending runs, or an Optuna
study's next trials); when a trial finishes, is pruned or fails, its sub-mesh takes the
next one. A failure (a NaN loss, a layout that does not fit the sub-mesh, an exception in
its data or step) ends that trial alone, recorded with its reason in its status.json and
sweep.jsonl; the others train on.

JAX dispatch is thread-safe; what the run path keeps per process is made per thread here:
its console output (each trial's goes to its workdir's run.log: `Routed`), its stop (SIGTERM
to the sweep stops every trial at its next step, which saves: engine.runtime.preemption.
thread_stop) and its judge (a search trial's records go to the pruner on its own thread:
engine.sweep.judge.InProcess). `DIRECTORY/submesh.jsonl` logs each trial's start, its train
and eval records and its end, with times and sub-meshes (the benchmark reads it).
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

from engine.errors import UsageError
from engine.runtime.judged import InProcess, judged_here
from engine.runtime.rundir import STATUS, append_line, read_status, write_json
from engine.sweep.local import pending_runs, write_index
from engine.sweep.progress import Progress
from engine.sweep.spec import RunSpec, Sweep

EVENTS = "submesh.jsonl"


def submeshes(devices: list, per_trial: int) -> list[list]:
    """The devices in consecutive groups of `per_trial` (each process's devices are consecutive
    in jax.devices(), so a group lies within a process where the sizes allow)."""
    if per_trial < 1 or len(devices) % per_trial:
        raise UsageError(
            f"--devices-per-trial {per_trial} does not divide the {len(devices)} devices of this job; "
            f"use a divisor of {len(devices)}"
        )
    return [devices[i : i + per_trial] for i in range(0, len(devices), per_trial)]


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


class Queue:
    """The trials still to start: a grid/zip/random sweep's pending runs in order, or a search's
    next trials (an abandoned one first, as search.py does); thread-safe."""

    def __init__(self, sweep: Sweep, retry_failed: bool):
        self.sweep, self.lock = sweep, threading.RLock()
        self.study: Any = None  # (a search's Optuna study)
        if sweep.search:
            from engine.sweep.search import open_study

            self.study, self.todo = open_study(sweep), []
        else:
            self.todo = pending_runs(sweep, retry_failed)

    def take(self, stopping: threading.Event) -> Optional[tuple[RunSpec, Any]]:
        """(the next run, its Optuna trial or None), or None when nothing is left to start."""
        with self.lock:
            if stopping.is_set():
                return None
            if self.study is None:
                return (self.todo.pop(0), None) if self.todo else None
            from engine.sweep.search import next_trial, trial_run

            trial = next_trial(self.sweep, self.study)
            return (trial_run(trial), trial) if trial is not None else None

    def ended(self, trial, status: str, value: Optional[float]) -> None:
        """Tells the study how a search trial ended, and writes the sweep's index."""
        import optuna

        with self.lock:
            if trial is not None:
                states = {"pruned": optuna.trial.TrialState.PRUNED, "failed": optuna.trial.TrialState.FAIL}
                if status == "finished" and value is not None:
                    self.study.tell(trial, value)
                elif status in states or status == "finished":  # (finished without the metric: failed)
                    self.study.tell(trial, state=states.get(status, optuna.trial.TrialState.FAIL))
                # interrupted: the trial stays running in the study; the next sweep process resumes it
                from engine.sweep.search import trial_run

                self.sweep.runs = [trial_run(t) for t in self.study.trials]
            write_index(self.sweep)

    def verdict(self, trial) -> Callable[[dict], bool]:
        """A search trial's judge: reports the sweep's metric to the study; False to prune."""
        split, name = self.sweep.metric.split("/", 1)
        seen = set()
        if trial is not None:
            from engine.sweep.search import reported_steps

            with self.lock:
                seen = reported_steps(self.study, trial)

        def judge(record: dict) -> bool:
            if trial is None or record["split"] != split or name not in record or record["step"] in seen:
                return True
            seen.add(record["step"])
            with self.lock:
                trial.report(float(record[name]), record["step"])
                return not trial.should_prune()

        return judge


class Scheduler:
    """One worker thread per sub-mesh, each training the queue's next trial until none is left."""

    def __init__(self, sweep: Sweep, meshes: list[list], queue: Queue, progress: Progress):
        self.sweep, self.meshes, self.queue, self.progress = sweep, meshes, queue, progress
        self.stopping = threading.Event()
        self.stops: dict[int, threading.Event] = {}  # sub-mesh → its trial's stop
        self.events_lock, self.config_lock = threading.Lock(), threading.Lock()
        self.stdout, self.stderr = Routed(sys.stdout), Routed(sys.stderr)

    def event(self, kind: str, mesh: int, run: str, **fields) -> None:
        line = json.dumps({"time": time.time(), "event": kind, "submesh": mesh, "run": run, **fields})
        with self.events_lock:
            append_line(self.sweep.directory / EVENTS, line + "\n")

    def stop(self) -> None:
        """Every trial saves at its next step and stops (interrupted: a re-run resumes it)."""
        self.stopping.set()
        for event in list(self.stops.values()):
            event.set()

    def work(self, index: int) -> None:
        devices = self.meshes[index]
        while True:
            taken = self.queue.take(self.stopping)
            if taken is None:
                self.progress.idle(index)
                return
            run, trial = taken
            status = self.train(index, devices, run, trial)
            value = status.get("final", {}).get(self.sweep.metric)
            self.queue.ended(trial, status["status"], value)
            self.progress.ended(index, run.name, status)

    def train(self, index: int, devices: list, run: RunSpec, trial) -> dict:
        """Trains (or resumes) one run on `devices` on this thread; its status, as recorded."""
        from engine.run.single import NonFiniteLoss, Preempted, fit
        from engine.runtime.preemption import thread_stop
        from engine.runtime.rundir import final_metrics

        workdir = self.sweep.workdir(run)
        workdir.mkdir(parents=True, exist_ok=True)
        started = time.time()
        write_json(workdir / STATUS, {"status": "running", "pid": os.getpid(), "submesh": index})
        stop = self.stops[index] = threading.Event()
        if self.stopping.is_set():
            stop.set()
        verdict = self.queue.verdict(trial)
        pruned: list[bool] = []

        def judge(record: dict) -> bool:
            self.progress.record(index, record)
            self.event(record["split"], index, run.name, step=record["step"])
            go = verdict(record)
            if not go:
                pruned.append(True)
            return go

        self.progress.started(index, run.name, devices)
        self.event("start", index, run.name, devices=[d.id for d in devices])
        ident = threading.get_ident()
        record: dict[str, Any] = {"status": "failed", "submesh": index}
        with open(workdir / "run.log", "a") as log, judged_here(InProcess(judge, stop)), thread_stop(stop):
            self.stdout.files[ident] = self.stderr.files[ident] = log
            try:
                with self.config_lock:  # (the sweep's cache of loaded configs)
                    cfg = self.sweep.config(run)
                fit(cfg, started=started, devices=devices)
                record["status"] = "finished"
            except Preempted:
                record["status"] = "pruned" if pruned else "interrupted"
            except NonFiniteLoss as e:
                record["error"] = f"error: training stopped: {e}"
            except UsageError as e:  # (a layout its sub-mesh cannot hold, a bad value)
                record["error"] = f"error: {e}"
            except Exception as e:  # (its data, its step): this trial ends, the others train on
                traceback.print_exc(file=log)
                record["error"] = f"error: {type(e).__name__}: {e}"
            finally:
                del self.stdout.files[ident], self.stderr.files[ident]
            if "error" in record:
                print(record["error"], file=log, flush=True)
        record.update(seconds=round(time.time() - started, 2), exit_code=0 if record["status"] == "finished" else 1)
        if trial is not None:
            record["trial"] = trial.number
        write_json(workdir / STATUS, record)
        self.event("end", index, run.name, status=record["status"], error=record.get("error"))
        return {**record, "final": final_metrics(workdir)}

    def run(self) -> None:
        previous = {
            sig: signal.signal(sig, lambda signum, frame: self.stop()) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        old = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = self.stdout, self.stderr
        threads = [threading.Thread(target=self.work, args=(i,), name=f"submesh-{i}") for i in range(len(self.meshes))]
        try:
            for thread in threads:
                thread.start()
            while any(thread.is_alive() for thread in threads):
                self.progress.refresh()
                for thread in threads:
                    thread.join(timeout=0.5 / len(threads))
        finally:
            sys.stdout, sys.stderr = old
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.progress.close()


def run_submeshes(sweep: Sweep, per_trial: int, retry_failed: bool) -> int:
    """Trains the sweep's pending runs (or its search's trials) on sub-meshes of `per_trial`
    devices of this process; 0 if every run finished (a search: if none is left to start),
    143 if stopped, else 1."""
    import jax

    if sweep.vectorize:
        raise UsageError(
            "vectorize and --devices-per-trial do not combine: remove vectorize from the sweep file (each trial "
            "trains on its own sub-mesh), or drop --devices-per-trial"
        )
    from engine.checkpoint.store import serial_saves

    meshes = submeshes(jax.devices(), per_trial)
    serial_saves()  # (orbax's saves share one process-wide operation id)
    queue = Queue(sweep, retry_failed)
    total = sweep.search["trials"] if sweep.search else len(sweep.runs)
    print(
        f"sweep {sweep.path.name}: {total} runs on {len(meshes)} sub-meshes of {per_trial} device(s) "
        f"({jax.device_count()} {jax.devices()[0].platform} devices) in {sweep.directory}",
        flush=True,
    )
    progress = Progress(len(meshes), sweep.metric, sys.stderr)
    scheduler = Scheduler(sweep, meshes, queue, progress)
    scheduler.run()
    write_index(sweep)
    if scheduler.stopping.is_set():
        return 143
    statuses = [read_status(sweep.workdir(run)).get("status") for run in sweep.runs]
    if sweep.search:
        return 0
    return 0 if all(s == "finished" for s in statuses) else 1


def events(directory: Path) -> list[dict]:
    """The records of DIRECTORY/submesh.jsonl, in the order they were written."""
    path = Path(directory) / EVENTS
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
