"""Model-based search with pruning, on an Optuna study in the sweep directory's SQLite database.

    search: {sampler: tpe, trials: 12, seed: 0,            # tpe | random | grid
             params: {optimizer.learning_rate: {log_uniform: [1e-4, 1e-1]},
                      model.hidden_sizes: {choice: [[64], [128]]}}}
    pruner: {kind: median, startup_trials: 3, warmup_steps: 0}   # | successive_halving | hyperband

Each trial is a training run (`trial-NNNN` under the sweep directory) with the values the
sampler asks for. While it trains, this process reads the sweep's metric from the run's
metrics.jsonl as it is logged and reports it to the study; when the pruner says so the run
is stopped (SIGTERM: it saves and exits) and marked `pruned`. The study lives in
`study.db` (Optuna's RDB storage), so a stopped sweep resumes its study: a trial left
running by a dead sweep process (no trainer holds its workdir) is trained to its end
(resuming from its checkpoint) before new trials are asked for, and several sweep processes
(or SLURM array tasks) on one directory share the study without running a trial twice
(asking is a database transaction; a running trial's trainer holds its workdir's lock).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from engine.runtime.launcher import SELF
from engine.runtime.rundir import STATUS, final_metrics, lock_holder, read_status, write_json
from engine.sweep.judge import Judge
from engine.sweep.local import preload_report, write_index
from engine.sweep.spec import RunSpec, Sweep

STUDY = "study.db"
CLAIM_SECONDS = 60.0  # a trial asked for this recently, with no run status yet, belongs to whoever asked
BEAT_SECONDS = 30.0  # how often a sweep process on several hosts says its running trials are still its own
STALE_SECONDS = 180.0  # a trial of another host whose status has not beaten for this long is abandoned
STOP = threading.Event()  # this sweep process was told to stop: the running trial saves and stops too


TPE_STARTUP = 10  # optuna's TPESampler samples this many trials at random before modelling


def trial_seed(seed: int, number: int) -> int:
    """The sampler's seed for trial `number` of a study seeded with `seed`."""
    import numpy as np

    return int(np.random.SeedSequence([seed, number]).generate_state(1)[0])


def make_sampler(search: dict, seed: int):
    import optuna

    kind = search.get("sampler", "tpe")
    if kind == "grid":
        return optuna.samplers.GridSampler({k: v["choice"] for k, v in search["params"].items()}, seed=seed)
    return (optuna.samplers.TPESampler if kind == "tpe" else optuna.samplers.RandomSampler)(seed=seed)


def open_study(sweep: Sweep):
    """The sweep's study, created on first use. Several sweep processes may open it at once:
    creating the database's tables is serialised by a lock file beside it."""
    import fcntl

    import optuna

    search = sweep.search
    assert search is not None, "a search sweep (spec.load_sweep checked it)"

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    settings = dict(sweep.pruner or {"kind": "none"})
    kind = settings.pop("kind")
    pruners: dict[str, Callable] = {
        "median": lambda startup_trials=3, warmup_steps=0: optuna.pruners.MedianPruner(startup_trials, warmup_steps),
        "successive_halving": lambda **k: optuna.pruners.SuccessiveHalvingPruner(**k),
        "hyperband": lambda **k: optuna.pruners.HyperbandPruner(**k),
        "none": lambda: optuna.pruners.NopPruner(),
    }
    pruner = pruners[kind](**settings)
    sweep.directory.mkdir(parents=True, exist_ok=True)
    with open(sweep.directory / ".study.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        damaged = _set_aside_if_damaged(sweep.directory / STUDY)
        storage = optuna.storages.RDBStorage(
            f"sqlite:///{sweep.directory / STUDY}", engine_kwargs={"connect_args": {"timeout": 60}}
        )
        study = optuna.create_study(
            storage=storage,
            study_name="sweep",
            load_if_exists=True,
            sampler=make_sampler(search, search.get("seed", 0)),
            pruner=pruner,
            direction="minimize" if sweep.mode == "min" else "maximize",
        )
        if damaged:
            _rebuild(study, sweep)
        return study


def _set_aside_if_damaged(path: Path) -> bool:
    """A study database SQLite cannot read whole is moved to <path>.damaged (nothing deleted),
    with one line saying so; True if it was."""
    import sqlite3

    if not path.exists():
        return False
    try:
        with contextlib.closing(sqlite3.connect(path)) as db:
            verdict = db.execute("PRAGMA integrity_check").fetchone()[0]
    except sqlite3.DatabaseError as e:
        verdict = str(e)
    if verdict == "ok":
        return False
    aside = path.with_name(path.name + ".damaged")
    number = 1
    while aside.exists():
        aside, number = path.with_name(f"{path.name}.damaged.{number}"), number + 1
    path.rename(aside)
    print(
        f"warning: {path} is damaged ({verdict}); set aside as {aside.name}, rebuilding the study from the "
        f"trials on disk (sweep.jsonl and each trial's metrics)",
        file=sys.stderr,
        flush=True,
    )
    return True


def _distributions(search: dict) -> dict:
    import optuna.distributions as d

    made: dict[str, Any] = {}
    for key, dist in search["params"].items():
        kind, values = next(iter(dist.items()))
        if kind == "choice":  # (as _suggest stores them)
            made[key] = d.CategoricalDistribution(choices_as_stored(values))
        elif kind == "int_uniform":
            made[key] = d.IntDistribution(int(values[0]), int(values[1]))
        else:
            made[key] = d.FloatDistribution(float(values[0]), float(values[1]), log=kind == "log_uniform")
    return made


def _rebuild(study, sweep: Sweep) -> None:
    """The trials of sweep.jsonl back into a fresh study, numbered as before: a finished run as
    complete with its final metric, a pruned one as pruned, any other as failed (its workdir and
    checkpoints stay; a trial number is never given to a second run)."""
    import optuna

    index = sweep.directory / "sweep.jsonl"
    records = {}
    for line in index.read_text().splitlines() if index.is_file() else []:
        record = json.loads(line)
        if record.get("name", "").startswith("trial-"):
            records[int(record["name"].split("-")[1])] = record
    distributions = _distributions(sweep.search or {})
    states = {"finished": optuna.trial.TrialState.COMPLETE, "pruned": optuna.trial.TrialState.PRUNED}
    for number in range(max(records, default=-1) + 1):
        record = records.get(number, {})
        value = (record.get("final") or {}).get(sweep.metric)
        state = states.get(record.get("status", ""), optuna.trial.TrialState.FAIL)
        if state == optuna.trial.TrialState.COMPLETE and value is None:
            state = optuna.trial.TrialState.FAIL
        overrides = record.get("overrides") or {}
        params = {
            key: json.dumps(overrides[key]) if _json_choices(dist) else overrides[key]
            for key, dist in distributions.items()
            if key in overrides
        }
        study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions={k: distributions[k] for k in params},
                value=value if state == optuna.trial.TrialState.COMPLETE else None,
                state=state,
            )
        )
    print(f"rebuilt the study: {len(records)} trials from {index.name}", file=sys.stderr, flush=True)


SCALARS = (type(None), bool, int, float, str)  # what optuna stores as a categorical choice


def choices_as_stored(values: list) -> list:
    """A choice's values as the study stores them: themselves when every one is a number, string,
    bool or null (optuna's own API reads them back as they are); otherwise (lists, e.g. hidden
    sizes, which optuna cannot store) each one's JSON text."""
    if all(isinstance(v, SCALARS) for v in values):
        return list(values)
    return [json.dumps(v) for v in values]


def _json_choices(distribution) -> bool:
    """The categorical distribution holds JSON texts of lists or mappings (choices_as_stored)."""
    choices = getattr(distribution, "choices", None) or ()
    return bool(choices) and all(isinstance(c, str) and c[:1] in "[{" for c in choices)


def _suggest(trial, key: str, dist: dict):
    kind, values = next(iter(dist.items()))
    if kind == "choice":
        chosen = trial.suggest_categorical(key, choices_as_stored(values))
        return json.loads(chosen) if _json_choices(trial.distributions[key]) else chosen
    if kind == "int_uniform":
        return trial.suggest_int(key, int(values[0]), int(values[1]))
    return trial.suggest_float(key, float(values[0]), float(values[1]), log=kind == "log_uniform")


def trial_run(trial) -> RunSpec:
    """A trial's run: its name and the values it trains with."""
    return RunSpec(
        f"trial-{trial.number:04d}",
        {
            key: json.loads(value) if _json_choices(trial.distributions.get(key)) else value
            for key, value in trial.params.items()
        },
    )


def reported_steps(study, trial) -> set[int]:
    """Steps already reported for this trial (a resumed trial re-logs none of them)."""
    frozen = next(t for t in study.get_trials(deepcopy=False) if t.number == trial.number)
    return set(frozen.intermediate_values)


def train_trial(sweep: Sweep, study, trial, env: dict | None = None) -> str:
    """Trains (or resumes) one trial's run, reporting the metric as it is logged; tells the
    study how it ended. Returns the run's status: finished, pruned, failed or interrupted."""
    run = trial_run(trial)
    workdir = sweep.workdir(run)
    workdir.mkdir(parents=True, exist_ok=True)
    write_json(workdir / STATUS, running_status(trial=trial.number))
    split, name = sweep.metric.split("/", 1)
    seen, pruned, stopped, start = reported_steps(study, trial), False, False, time.time()
    judge = Judge()  # the run waits at each record it logs for the pruner's verdict (engine/sweep/judge.py)
    with open(workdir / "run.log", "a") as log:
        child = subprocess.Popen(
            [*SELF, *sweep.argv(run)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=judge.child_env(env or dict(os.environ)),
            pass_fds=judge.child_fds,
            start_new_session=True,
        )
        judge.started()
        preload_report()
        beaten = time.time()
        while True:
            if time.time() - beaten > BEAT_SECONDS:  # (a sweep process on another host sees it is still trained)
                write_json(workdir / STATUS, running_status(trial=trial.number))
                beaten = time.time()
            if STOP.is_set() and not pruned and not stopped:
                stopped = True  # it saves and exits 143: resumed by the next sweep process
                child.send_signal(signal.SIGTERM)
            try:
                record = judge.next_record(timeout=0.2)
            except EOFError:  # the run exited
                break
            if record is None:
                continue
            go = True
            if record["split"] == split and name in record and record["step"] not in seen:
                seen.add(record["step"])
                trial.report(float(record[name]), record["step"])
                if not pruned and trial.should_prune():
                    pruned, go = True, False  # it saves and exits 143; a re-run of the sweep does not train it again
            judge.answer(go)
        child.wait()
        judge.close()
    code = child.returncode
    status = _tell(study, trial, pruned, code, final_metrics(workdir).get(sweep.metric))
    write_json(
        workdir / STATUS,
        {"status": status, "exit_code": code, "trial": trial.number, "seconds": round(time.time() - start, 2)},
    )
    return status


def _tell(study, trial, pruned: bool, code: int, value) -> str:
    """Tells the study how a trial's run ended (pruned, its exit code, its final metric); its status."""
    import optuna

    if pruned:
        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return "pruned"
    if code == 0 and value is not None:
        study.tell(trial, value)
        return "finished"
    if code in (143, 130) or STOP.is_set():
        return "interrupted"  # the trial stays running in the study; the next sweep process resumes it
    study.tell(trial, state=optuna.trial.TrialState.FAIL)
    return "failed"


def running_status(**fields) -> dict:
    """A running trial's status: the sweep process that trains it (host and pid) and when it last
    said so (`beat`: a sub-mesh sweep on several hosts writes it again every BEAT_SECONDS)."""
    return {"status": "running", "host": socket.gethostname(), "pid": os.getpid(), "beat": time.time(), **fields}


def _alive(status: dict) -> bool:
    """Whether the sweep process a running status names still trains it: on this host, its pid
    lives; on another (whose pids this host cannot see), its status beat within STALE_SECONDS."""
    host = status.get("host")
    if host and host != socket.gethostname():
        return time.time() - float(status.get("beat", 0)) < STALE_SECONDS
    try:
        os.kill(int(status.get("pid")), 0)  # type: ignore[arg-type]
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


def abandoned_trials(sweep: Sweep, study) -> tuple[list, list]:
    """Running trials whose sweep process is gone (or said it stopped): (those no trainer
    holds: to resume now, those a trainer left by that process still trains: to wait for)."""
    import optuna

    orphans: list = []
    training: list = []
    for trial in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        workdir = sweep.workdir(trial_run(trial))
        status = read_status(workdir)
        if status.get("status") == "running" and _alive(status):
            continue  # its sweep process trains it
        if not status and time.time() - trial.datetime_start.timestamp() < CLAIM_SECONDS:
            continue  # just asked for by another sweep process, which has not written its status yet
        (training if lock_holder(workdir) is not None else orphans).append(trial)
    return orphans, training


def next_trial(sweep: Sweep, study):
    """An abandoned trial to finish, else a new one while the study has fewer than
    search.trials; None when there is nothing left to start (waits for trainers that a
    killed sweep process left running)."""
    import optuna

    search = sweep.search
    assert search is not None, "a search sweep (spec.load_sweep checked it)"
    while True:
        orphans, training = abandoned_trials(sweep, study)
        if orphans:
            trial = optuna.trial.Trial(study, orphans[0]._trial_id)
            print(f"resume {trial_run(trial).name}", flush=True)
            return trial
        if len(study.trials) < search["trials"]:
            break
        if not training or STOP.is_set():
            return None
        # a trainer left by a killed sweep process: it finishes (or stops), then its trial is resumed
        print(f"waiting for {trial_run(training[0]).name}: a trainer still runs in its workdir", flush=True)
        time.sleep(2.0)
    trial = study.ask()
    # trial n's values come from (seed, n): the same in one process or several (each process's
    # sampler would otherwise draw the same startup values as every other); hashed together, so
    # that seed 1's trials are not seed 0's shifted by one
    study.sampler = make_sampler(search, trial_seed(search.get("seed", 0), trial.number))
    for key, dist in search["params"].items():
        _suggest(trial, key, dist)
    print(f"start {trial_run(trial).name} {trial_run(trial).overrides}", flush=True)
    return trial


def run_search(sweep: Sweep) -> int:
    """Trials until the study has search.trials of them; 0 when none is left to start here
    (others may still run in other sweep processes), 143 if stopped."""
    study = open_study(sweep)
    search = sweep.search or {}
    if search.get("sampler", "tpe") == "tpe" and search.get("trials", 0) <= TPE_STARTUP:
        print(
            f"note: TPE draws its first {TPE_STARTUP} trials at random (optuna's n_startup_trials); with "
            f"search.trials={search.get('trials')} this search is random sampling",
            flush=True,
        )
    STOP.clear()
    previous = {sig: signal.signal(sig, lambda signum, frame: STOP.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not STOP.is_set():
            trial = next_trial(sweep, study)
            if trial is None:
                break
            status = train_trial(sweep, study, trial)
            print(f"{status:>11} {trial_run(trial).name}", flush=True)
            sweep.runs = [trial_run(t) for t in study.trials]
            write_index(sweep)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 143 if STOP.is_set() else 0


def study_report(sweep: Sweep) -> None:
    """Parameter importances (importances.json) and a slice plot (slice.png) of the study."""
    import matplotlib

    matplotlib.use("Agg")
    import optuna

    study = open_study(sweep)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    if len(complete) < 2:
        print("no parameter importances: fewer than 2 trials finished", file=sys.stderr)
        return
    importances = optuna.importance.get_param_importances(study)
    write_json(sweep.directory / "importances.json", importances)
    print("parameter importances: " + ", ".join(f"{k} {v:.2f}" for k, v in importances.items()))
    import warnings

    with warnings.catch_warnings():  # optuna marks its matplotlib plots experimental
        warnings.simplefilter("ignore")
        axes = optuna.visualization.matplotlib.plot_slice(study)
    figure: Any = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
    figure.savefig(Path(sweep.directory) / "slice.png", dpi=80, bbox_inches="tight")
