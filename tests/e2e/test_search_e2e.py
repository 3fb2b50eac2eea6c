"""Model-based search with pruning (engine/sweep/search.py) on the digits MLP: an Optuna study
in the sweep directory's SQLite database, pruned trials stopped early, a killed sweep
resuming its study, two sweep processes sharing one study without running a trial twice.
And `launch.py plan --search`'s candidates (engine/plan/layouts.py): the attention, remat and
loss-chunk variants a family supports, their overrides, and the order they are compiled in."""

import json
import subprocess
import time

import pytest
from support.cli import start_cli
from support.search import PARAMS, sweep_file

from engine.runtime.rundir import read_records


def start_sweep(path):
    return start_cli("sweep", str(path), stderr=subprocess.STDOUT, start_new_session=True)


def index(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "sweep" / "sweep.jsonl").read_text().splitlines()]


def train_steps(workdir) -> list[int]:
    return [r["step"] for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]


@pytest.mark.slow
def test_tpe_with_the_median_pruner_stops_bad_trials_early_and_reports_importances(tmp_path):
    """4 trials: 2 to start the pruner, and trial 3 is pruned (with seed 0; of 3, none is)."""
    proc = start_sweep(sweep_file(tmp_path, 4, {"kind": "median", "startup_trials": 2, "warmup_steps": 10}))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    runs = {r["name"]: r for r in index(tmp_path)}
    assert sorted(runs) == [f"trial-{i:04d}" for i in range(4)]
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
def test_a_killed_search_resumes_its_study_two_processes_share_it_and_a_damaged_study_is_rebuilt(tmp_path):
    """Two sweep processes on one study: one is SIGKILLed during a trial (its trainer, in a
    session of its own, trains on); the other waits for that trainer and resumes the trial
    (the trainer finds it finished, or resumes it from its checkpoint) and finishes the
    study. Every trial is asked for once; the study ends with exactly `trials` trials.
    Then the study's database is cut short: it is set aside and rebuilt from the trials on disk."""
    path = sweep_file(tmp_path, 2)
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
    assert len(started) == len(set(started)) == 2, started  # no trial asked for twice
    runs = {r["name"]: r["status"] for r in index(tmp_path)}
    assert sorted(runs) == [f"trial-{i:04d}" for i in range(2)] and set(runs.values()) == {"finished"}, runs
    assert "resume trial-" in out_second  # the killed process's trial, finished by the other
    for name in runs:
        assert train_steps(tmp_path / "sweep" / name)[-1] == 40

    # Before: study.db cut to 3 kB ended every re-run in a SQLAlchemy traceback (exit 1).
    import optuna

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
