"""Model-based search with pruning (engine/sweep/search.py) on the digits MLP: an Optuna study
in the sweep directory's SQLite database, pruned trials stopped early, a killed sweep
resuming its study, two sweep processes sharing one study without running a trial twice."""

import json
import subprocess
import time

import pytest
import yaml

from conftest import ROOT, start_cli
from engine.errors import UsageError
from engine.runtime.rundir import read_records
from engine.sweep import load_sweep

OVERRIDES = {
    "train.steps": 40,
    "eval.every_steps": 10,
    "log.every_steps": 10,
    "checkpoint.every_steps": 10,
    "log.tensorboard": False,
    "mesh.num_devices": 1,
}
PARAMS = {"optimizer.learning_rate": {"log_uniform": [1.0e-5, 1.0e-1]}, "model.hidden_sizes": {"choice": [[16], [64]]}}


def sweep_file(tmp_path, trials, pruner=None, **search):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "overrides": OVERRIDES,
        "metric": "eval/loss",
        "mode": "min",
        "directory": str(tmp_path / "sweep"),
        "search": {"sampler": "tpe", "trials": trials, "seed": 0, "params": PARAMS, **search},
    }
    if pruner:
        spec["pruner"] = pruner
    path = tmp_path / "search.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start_sweep(path):
    return start_cli("sweep", str(path), stderr=subprocess.STDOUT, start_new_session=True)


def index(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "sweep" / "sweep.jsonl").read_text().splitlines()]


def train_steps(workdir) -> list[int]:
    return [r["step"] for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]


@pytest.mark.slow
def test_tpe_with_the_median_pruner_stops_bad_trials_early_and_reports_importances(tmp_path):
    proc = start_sweep(sweep_file(tmp_path, 5, {"kind": "median", "startup_trials": 2, "warmup_steps": 10}))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    runs = {r["name"]: r for r in index(tmp_path)}
    assert sorted(runs) == [f"trial-{i:04d}" for i in range(5)]
    statuses = [r["status"] for r in runs.values()]
    assert statuses.count("pruned") >= 1 and statuses.count("finished") >= 2, statuses
    import optuna

    study = optuna.load_study(study_name="sweep", storage=f"sqlite:///{tmp_path / 'sweep' / 'study.db'}")
    judged = {f"trial-{t.number:04d}": max(t.intermediate_values) for t in study.trials}
    for name, run in runs.items():
        steps = train_steps(tmp_path / "sweep" / name)
        if run["status"] == "pruned":  # stopped at exactly the eval the pruner judged, never later
            assert steps and steps[-1] == judged[name], (name, steps, judged[name])
        else:
            assert steps[-1] == 40
    assert min(judged[name] for name, run in runs.items() if run["status"] == "pruned") < 40
    assert [t.state.name for t in study.trials].count("PRUNED") == statuses.count("pruned")
    importances = json.loads((tmp_path / "sweep" / "importances.json").read_text())
    assert set(importances) == set(PARAMS)
    assert (tmp_path / "sweep" / "slice.png").stat().st_size > 0
    assert "pruned" in (tmp_path / "sweep" / "report.md").read_text()


@pytest.mark.slow
def test_a_killed_search_resumes_its_study_and_two_processes_share_it(tmp_path):
    """Two sweep processes on one study: one is SIGKILLed during a trial (its trainer, in a
    session of its own, trains on); the other waits for that trainer and resumes the trial
    (the trainer finds it finished, or resumes it from its checkpoint) and finishes the
    study. Every trial is asked for once; the study ends with exactly `trials` trials."""
    path = sweep_file(tmp_path, 4)
    first, second = start_sweep(path), start_sweep(path)
    deadline = time.time() + 300
    while not any(train_steps(d) for d in (tmp_path / "sweep").glob("trial-*")):
        assert time.time() < deadline and first.poll() is None, "no trial started"
        time.sleep(0.2)
    first.kill()  # the sweep process alone
    out_first, _ = first.communicate()
    out_second, _ = second.communicate(timeout=600)
    third = start_sweep(path)  # finds the study done
    out_third, _ = third.communicate(timeout=600)
    assert second.returncode == 0 and third.returncode == 0, out_second + out_third
    started = [
        line.split()[1]
        for out in (out_first, out_second, out_third)
        for line in out.splitlines()
        if line.startswith("start ")
    ]
    assert len(started) == len(set(started)) == 4, started  # no trial asked for twice
    runs = {r["name"]: r["status"] for r in index(tmp_path)}
    assert sorted(runs) == [f"trial-{i:04d}" for i in range(4)] and set(runs.values()) == {"finished"}, runs
    assert "resume trial-" in out_second  # the killed process's trial, finished by the other
    for name in runs:
        assert train_steps(tmp_path / "sweep" / name)[-1] == 40


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "search, extra, message",
    [
        ({"sampler": "cmaes"}, {}, "search.sampler='cmaes' is not one of tpe, random, grid"),
        ({"trials": 0}, {}, "search.trials=0 must be a whole number"),
        ({"sampler": "grid"}, {}, "search.sampler=grid needs choice lists; search.params.optimizer.learning_rate"),
        ({"params": {"optimizer.learning_rate": {"log_uniform": [0.1, 0.01]}}}, {}, "must be \\[low, high\\]"),
        ({}, {"pruner": {"kind": "median", "patience": 3}}, "pruner median takes startup_trials, warmup_steps"),
        ({}, {"grid": {"seed": [0, 1]}}, "a search replaces grid, zip and random"),
    ],
)
def test_malformed_search_fields_are_refused_by_name(tmp_path, search, extra, message):
    path = sweep_file(tmp_path, 3)
    spec = yaml.safe_load(path.read_text())
    spec["search"].update(search)
    spec.update(extra)
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(UsageError, match=message):
        load_sweep(path)


@pytest.mark.slow
def test_a_damaged_study_is_set_aside_and_rebuilt_from_the_trials_on_disk(tmp_path):
    """Before: study.db cut to 3 kB ended every re-run in a SQLAlchemy traceback (exit 1)."""
    import optuna

    first = start_sweep(sweep_file(tmp_path, 2))
    out, _ = first.communicate(timeout=600)
    assert first.returncode == 0, out
    before = {r["name"]: r["final"]["eval/loss"] for r in index(tmp_path)}
    study = tmp_path / "sweep" / "study.db"
    study.write_bytes(study.read_bytes()[:3000])
    again = start_sweep(sweep_file(tmp_path, 3))
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out
    assert "Traceback" not in out and "is damaged" in out and "rebuilt the study: 2 trials" in out
    assert (tmp_path / "sweep" / "study.db.damaged").stat().st_size == 3000  # kept, not deleted
    assert [line.split()[1] for line in out.splitlines() if line.startswith("start ")] == ["trial-0002"]
    rebuilt = optuna.load_study(study_name="sweep", storage=f"sqlite:///{study}")
    assert [t.state.name for t in rebuilt.trials] == ["COMPLETE"] * 3
    assert {f"trial-{t.number:04d}": t.value for t in rebuilt.trials[:2]} == before


@pytest.mark.nocompile
def test_choices_are_stored_natively_and_seeds_do_not_shift():
    """Optuna's own API reads a study's values as they are (a list choice, which optuna cannot
    store, as its JSON text), and seed 1's trials are not seed 0's shifted by one."""
    import optuna

    from engine.sweep.search import _suggest, trial_run, trial_seed

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    trial = study.ask()
    assert _suggest(trial, "train.global_batch_size", {"choice": [32, 64]}) in (32, 64)
    assert _suggest(trial, "model.activation", {"choice": ["relu", "gelu"]}) in ("relu", "gelu")
    assert _suggest(trial, "model.hidden_sizes", {"choice": [[16], [64, 64]]}) in ([16], [64, 64])
    stored = study.trials[0].params
    assert isinstance(stored["train.global_batch_size"], int) and stored["model.activation"] in ("relu", "gelu")
    assert stored["model.hidden_sizes"] in ("[16]", "[64, 64]")
    overrides = trial_run(trial).overrides
    assert overrides["model.hidden_sizes"] in ([16], [64, 64]) and isinstance(overrides["train.global_batch_size"], int)
    seeds = {(seed, n): trial_seed(seed, n) for seed in (0, 1) for n in range(5)}
    assert len(set(seeds.values())) == 10 and seeds[(1, 0)] != seeds[(0, 1)]
