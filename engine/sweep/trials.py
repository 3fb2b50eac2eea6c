"""A sub-mesh sweep's queue (engine/sweep/submesh.py): the trials still to start, a job's shared
through the coordination service's store. Imports no jax at import time."""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Optional

from engine.sweep.local import pending_runs, units, write_index
from engine.sweep.spec import RunSpec, Sweep

KEY = "engine_sweep"  # the job's keys in the coordination service's store
WAIT_MS = 7 * 24 * 3600 * 1000  # a process waits this long for the others (their trials may take days)


class Queue:
    """The trials still to start: a grid/zip/random sweep's pending runs in order (with
    `vectorize`: packed into groups that share a compiled program, local.units), or a search's
    next trials (an abandoned one first, as search.py does); thread-safe. An item is a list of
    runs: one, or a vectorised group's."""

    def __init__(self, sweep: Sweep, retry_failed: bool, client=None):
        # (a job's search: its processes share the study, which hands each trial to one of them)
        self.sweep, self.lock, self.client = sweep, threading.RLock(), None if sweep.search else client
        self.study: Any = None  # (a search's Optuna study)
        self.todo: list[list[RunSpec]] = []
        if sweep.search:
            from engine.sweep.search import open_study

            self.study = open_study(sweep)
        elif self.client is None:
            self.todo = units(sweep, pending_runs(sweep, retry_failed))
        else:  # a job's: process 0's list, the same on every process
            import jax

            if jax.process_index() == 0:
                todo = units(sweep, pending_runs(sweep, retry_failed))
                client.key_value_set(f"{KEY}/todo", json.dumps([[run.name for run in unit] for unit in todo]))
            names = json.loads(client.blocking_key_value_get(f"{KEY}/todo", WAIT_MS))
            self.todo = [[self.run(name) for name in unit] for unit in names]

    def run(self, name: str) -> RunSpec:
        return next(run for run in self.sweep.runs if run.name == name)

    def take(self, stopping: threading.Event) -> Optional[tuple[list[RunSpec], Any]]:
        """(the next runs: one, or a vectorised group's; the Optuna trial or None), or None when
        nothing is left to start."""
        with self.lock:
            if stopping.is_set():
                return None
            if self.client is not None:  # the job's next: the store's counter
                taken = self.client.key_value_increment(f"{KEY}/next", 1) - 1
                return (self.todo[taken], None) if taken < len(self.todo) else None
            if self.study is None:
                return (self.todo.pop(0), None) if self.todo else None
            from engine.sweep.search import next_trial, trial_run

            trial = next_trial(self.sweep, self.study)
            return ([trial_run(trial)], trial) if trial is not None else None

    def ended(self, trial, status: str, value: Optional[float]) -> None:
        """Tells the study how a search trial ended, and writes the sweep's index."""
        self.tell(trial, status, value)
        self.index()

    def tell(self, trial, status: str, value: Optional[float]) -> None:
        """Tells the study how a search trial ended (None: not a search's). Before the run's final
        status is written: a trial the study still calls running whose status says it ended is
        taken for abandoned by the search's other processes (search.abandoned_trials)."""
        import optuna

        if trial is None:
            return
        with self.lock:
            states = {"pruned": optuna.trial.TrialState.PRUNED, "failed": optuna.trial.TrialState.FAIL}
            if status == "finished" and value is not None:
                self.study.tell(trial, value)
            elif status in states or status == "finished":  # (finished without the metric: failed)
                self.study.tell(trial, state=states.get(status, optuna.trial.TrialState.FAIL))
            # interrupted: the trial stays running in the study; the next sweep process resumes it

    def index(self) -> None:
        """Writes the sweep's index (a search's: every process's trials)."""
        with self.lock:
            if self.study is not None:  # (its trials: this process's and any other's)
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
