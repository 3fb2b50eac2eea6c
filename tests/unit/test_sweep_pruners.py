"""The sub-mesh scheduler's queue (engine/sweep/trials.py `Queue`) with each of Optuna's pruners
and with a random sweep: trials taken one after another, their eval records judged as a trial's
thread judges them, a pruned trial stopped at the rung its pruner judged, the study told how each
ended. (Trials trained on sub-meshes under the median pruner: tests/integration/test_submesh_sweep.py.)"""

import json
import threading

import optuna
import pytest
import yaml
from support.configs import ROOT

from engine.sweep import load_sweep
from engine.sweep.trials import Queue

EVALS = (40, 80, 120)  # the steps a trial logs its eval loss at (train.steps 120, eval every 40)


def sweep_file(tmp_path, **sections):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": {"train.steps": EVALS[-1], "eval.every_steps": EVALS[0]},
        "metric": "eval/loss",
        "mode": "min",
        "directory": str(tmp_path / "s"),
        **sections,
    }
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    return load_sweep(path)


def drive(queue: Queue, loss) -> dict[int, tuple[str, int]]:
    """Each trial taken in turn, its eval records judged until the judge stops it: trial number →
    (how it ended, the last step it logged). `loss(number, step)`: its eval loss at a step."""
    ended, stopping = {}, threading.Event()
    while (taken := queue.take(stopping)) is not None:
        _, trial = taken
        judge, status = queue.verdict(trial), "finished"
        for step in EVALS:
            if not judge({"split": "eval", "step": step, "loss": loss(trial.number, step)}):
                status = "pruned"  # (the trial's thread stops its run here)
                break
        queue.ended(trial, status, loss(trial.number, step) if status == "finished" else None)
        ended[trial.number] = (status, step)
    return ended


@pytest.mark.parametrize(
    "pruner",
    [
        {"kind": "successive_halving", "min_resource": 40, "reduction_factor": 2},
        {"kind": "hyperband", "min_resource": 40, "max_resource": 120, "reduction_factor": 2},
    ],
    ids=["successive_halving", "hyperband"],
)
def test_each_pruner_stops_worse_trials_at_a_rung_and_the_study_records_it(tmp_path, pruner):
    params = {"optimizer.learning_rate": {"log_uniform": [1.0e-4, 1.0e-1]}}
    sweep = sweep_file(tmp_path, search={"sampler": "random", "trials": 6, "seed": 0, "params": params}, pruner=pruner)
    ended = drive(Queue(sweep, retry_failed=False), lambda number, step: 1.0 + number - step / 1000)
    assert sorted(ended) == list(range(6))
    assert ended[0] == ("finished", EVALS[-1])  # (the first has no one to lose to)
    pruned = {n: step for n, (status, step) in ended.items() if status == "pruned"}
    assert pruned and set(pruned.values()) <= set(EVALS[:-1]), ended  # (stopped at a rung, before the end)
    study = Queue(sweep, retry_failed=False).study  # (read back from its storage)
    states = {t.number: t.state for t in study.trials}
    assert {n for n, s in states.items() if s == optuna.trial.TrialState.PRUNED} == set(pruned), states
    assert all(max(t.intermediate_values) == ended[t.number][1] for t in study.trials)


def test_a_random_sweep_s_draws_are_taken_once_each_in_order(tmp_path):
    params = {"optimizer.learning_rate": {"log_uniform": [1.0e-4, 1.0e-1]}}
    sweep = sweep_file(tmp_path, random={"samples": 5, "seed": 1, "params": params})
    queue, stopping = Queue(sweep, retry_failed=False), threading.Event()
    taken = [queue.take(stopping) for _ in range(6)]
    assert [t[0][0].name for t in taken[:5]] == [run.name for run in sweep.runs] and taken[5] is None
    assert len({t[0][0].overrides["optimizer.learning_rate"] for t in taken[:5]}) == 5
    stopping.set()
    assert Queue(sweep, retry_failed=False).take(stopping) is None  # (a stopped sweep starts nothing)


def test_a_running_trial_of_another_host_is_its_while_its_status_beats_then_abandoned(tmp_path):
    """A sweep on several hosts: a trial whose status names another host is that host's while its
    `beat` is fresh (this host cannot see its pid), and resumed here once it went stale; one of
    this host is its own while its pid lives."""
    import os
    import subprocess
    import sys
    import time

    from engine.runtime.rundir import STATUS, write_json
    from engine.sweep.search import STALE_SECONDS, running_status, trial_run

    params = {"optimizer.learning_rate": {"log_uniform": [1.0e-4, 1.0e-1]}}
    sweep = sweep_file(tmp_path, search={"sampler": "random", "trials": 1, "seed": 0, "params": params})
    queue, stopping = Queue(sweep, retry_failed=False), threading.Event()
    (run,), trial = queue.take(stopping)
    workdir = sweep.workdir(run)
    workdir.mkdir(parents=True)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cases = [  # (the status, whether a sweep process still trains it)
        ({**running_status(), "host": "another-host", "pid": os.getpid()}, True),
        ({**running_status(), "host": "another-host", "beat": time.time() - STALE_SECONDS - 1}, False),
        (running_status(), True),  # (this process's)
        ({**running_status(), "pid": int(gone.stdout)}, False),  # (a process of this host that ended)
    ]
    for status, alive in cases:
        write_json(workdir / STATUS, status)
        taken = Queue(sweep, retry_failed=False).take(stopping)
        assert (taken is None) == alive, status  # (the study has its one trial: only a resume is left to take)
        if taken is not None:
            assert trial_run(taken[1]).name == run.name == trial_run(trial).name
    from engine.sweep.submesh import Scheduler

    scheduler = Scheduler(sweep, [], queue, None, [])  # (its statuses alone)
    scheduler.set_status(workdir, {**running_status(), "host": "another-host", "beat": time.time() - STALE_SECONDS - 1})
    assert Queue(sweep, retry_failed=False).take(stopping) is not None  # (stale: abandoned)
    scheduler.beat()  # (what its wait loop does every BEAT_SECONDS)
    assert Queue(sweep, retry_failed=False).take(stopping) is None  # beating again: its own
    scheduler.set_status(workdir, {"status": "interrupted"})
    scheduler.beat()  # (an ended run's status is left as it ended)
    assert json.loads((workdir / STATUS).read_text()) == {"status": "interrupted"}
