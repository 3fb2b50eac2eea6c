"""Config sweeps: expansion, validation, running (sequential, parallel, resumed), the report."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import slurm_cluster
import yaml

from conftest import ROOT, run_cli, start_cli
from engine.errors import UsageError
from engine.sweep import load_sweep

FAST = {
    "train.steps": 40,
    "log.every_steps": 20,
    "eval.every_steps": 20,
    "log.tensorboard": False,
    "checkpoint.every_steps": 20,
    "train.global_batch_size": 32,
}


def write_sweep(path, **spec):
    spec.setdefault("base", str(ROOT / "configs" / "mnist_mlp.yaml"))
    spec.setdefault("overrides", FAST)
    spec.setdefault("directory", str(path.parent / "out"))
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def index(directory):
    return [json.loads(line) for line in (directory / "sweep.jsonl").read_text().splitlines()]


@pytest.mark.nocompile
def test_grid_zip_and_random_expansion(tmp_path):
    sweep = load_sweep(
        write_sweep(
            tmp_path / "s.yaml",
            grid={"optimizer.learning_rate": [0.001, 0.01], "model.hidden_sizes": [[32], [64, 32]]},
            zip={"optimizer.warmup_steps": [0, 5], "optimizer.schedule": ["constant", "warmup_cosine"]},
        )
    )
    assert len(sweep.runs) == 8
    assert sweep.runs[0].name == "learning_rate=0.001,hidden_sizes=32,warmup_steps=0,schedule=constant"
    assert sweep.runs[2].name == "learning_rate=0.001,hidden_sizes=64-32,warmup_steps=0,schedule=constant"
    assert all(re.fullmatch(r"[A-Za-z0-9._+=,-]+", run.name) for run in sweep.runs)  # no quoting needed
    assert len({r.name for r in sweep.runs}) == 8
    spec = {
        "random": {
            "samples": 5,
            "seed": 7,
            "params": {
                "optimizer.learning_rate": {"log_uniform": [1e-4, 1e-2]},
                "model.dropout_rate": {"uniform": [0.0, 0.5]},
                "train.global_batch_size": {"choice": [16, 32]},
            },
        }
    }
    first = load_sweep(write_sweep(tmp_path / "r.yaml", **spec))
    second = load_sweep(write_sweep(tmp_path / "r2.yaml", **spec))
    assert [r.overrides for r in first.runs] == [r.overrides for r in second.runs]  # same seed, same configs
    assert all(1e-4 <= r.overrides["optimizer.learning_rate"] <= 1e-2 for r in first.runs)
    assert len({r.overrides["optimizer.learning_rate"] for r in first.runs}) == 5
    other = load_sweep(write_sweep(tmp_path / "r3.yaml", random={**spec["random"], "seed": 8}))
    assert [r.overrides for r in other.runs] != [r.overrides for r in first.runs]


@pytest.mark.nocompile
def test_malformed_sweep_files_are_refused(tmp_path):
    with pytest.raises(UsageError, match="zip lists must have equal lengths"):
        load_sweep(write_sweep(tmp_path / "a.yaml", zip={"a.b": [1, 2], "c.d": [1]}))
    with pytest.raises(UsageError, match=r"unknown key\(s\) \['gird'\]"):
        load_sweep(write_sweep(tmp_path / "b.yaml", gird={"a.b": [1]}))
    with pytest.raises(UsageError, match="log_uniform"):
        load_sweep(write_sweep(tmp_path / "c.yaml", random={"samples": 2, "params": {"x.y": {"normal": [0, 1]}}}))


def test_a_bad_value_stops_the_sweep_before_any_run(tmp_path):
    path = write_sweep(tmp_path / "bad.yaml", grid={"optimizer.learning_rate": [0.001, "fast"]})
    proc = run_cli("sweep", str(path))
    assert proc.returncode == 2
    assert "run 'learning_rate=fast': config key 'optimizer.learning_rate' got 'fast'" in proc.stderr
    assert not any((tmp_path / "out").glob("*/metrics.jsonl"))  # nothing ran


@pytest.mark.slow
def test_grid_runs_ranks_and_plots(tmp_path):
    path = write_sweep(
        tmp_path / "grid.yaml",
        grid={"optimizer.learning_rate": [0.001, 0.003], "model.hidden_sizes": [[32], [64]]},
        metric="eval/accuracy",
        mode="max",
    )
    proc = run_cli("sweep", str(path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = tmp_path / "out"
    runs = index(out)
    assert len(runs) == 4 and all(r["status"] == "finished" for r in runs)
    assert len([d for d in out.iterdir() if d.is_dir()]) == 4
    assert all(r["final"]["eval/accuracy"] > 0 for r in runs)
    with open(out / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4 and list(table[0])[:4] == ["rank", "run", "status", "eval/accuracy"]
    accuracies = [float(row["eval/accuracy"]) for row in table]
    assert accuracies == sorted(accuracies, reverse=True)  # best first
    assert [row["rank"] for row in table] == ["1", "2", "3", "4"]
    assert "| rank | run | status | eval/accuracy |" in (out / "report.md").read_text()
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    again = run_cli("report", str(out), "--out", str(tmp_path / "again"))
    assert again.returncode == 0 and (tmp_path / "again" / "report.png").exists()
    typo = run_cli("report", str(out), "--metric", "eval/acc", "--out", str(tmp_path / "typo"))
    assert typo.returncode == 2 and "--metric eval/acc is in no run's metrics.jsonl" in typo.stderr
    assert "eval/accuracy" in typo.stderr and not (tmp_path / "typo" / "report.csv").exists()


@pytest.mark.nocompile
def test_the_plot_grows_to_hold_a_large_sweeps_legend(tmp_path):
    """64 runs (vectorize's largest group): every name in the legend, under the panels."""
    from matplotlib.image import imread

    from engine.observe.ranking import _plot

    def curves(count):
        return [
            (
                f"learning_rate={i},weight_decay=0.1",
                {"train": ([100, 200], [2.0, 1.0 + i / 64]), "eval": ([200], [0.5]), "eval/accuracy": ([200], [0.9])},
            )
            for i in range(count)
        ]

    for count in (1, 64):
        _plot(curves(count), tmp_path / f"{count}.png", "eval/accuracy", "learning_rate=0,weight_decay=0.1")
    small, large = imread(tmp_path / "1.png"), imread(tmp_path / "64.png")
    assert (
        small.shape[1] == large.shape[1] and large.shape[0] > small.shape[0] + 21 * 0.17 * 110 * 0.9
    )  # 21 more rows of names


@pytest.mark.slow
def test_killed_sweep_resumes_only_what_is_missing(tmp_path):
    path = write_sweep(
        tmp_path / "kill.yaml",
        grid={"optimizer.learning_rate": [0.001, 0.002, 0.003]},
        overrides={**FAST, "train.steps": 300},
    )
    out = tmp_path / "out"
    sweep = start_cli("sweep", str(path), start_new_session=True)
    deadline = time.time() + 300
    while not (out / "sweep.jsonl").exists() or sum(r["status"] == "finished" for r in index(out)) < 1:
        assert time.time() < deadline and sweep.poll() is None, sweep.communicate()
        time.sleep(0.2)
    while read_metrics_steps(out / "learning_rate=0.002") < 40:  # the second run is under way
        assert time.time() < deadline and sweep.poll() is None, sweep.communicate()
        time.sleep(0.1)
    os.killpg(sweep.pid, signal.SIGKILL)  # the sweep and its run, with no chance to clean up
    sweep.wait()
    finished = {r["name"] for r in index(out) if r["status"] == "finished"}
    assert finished == {"learning_rate=0.001"}
    first_log = (out / "learning_rate=0.001" / "metrics.jsonl").read_text()
    proc = run_cli("sweep", str(path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "3 runs, 1 finished, 0 failed (--retry-failed runs them again), 2 to run (" in proc.stdout
    assert (out / "learning_rate=0.001" / "metrics.jsonl").read_text() == first_log  # not run again
    assert all(r["status"] == "finished" for r in index(out))
    resumed = (out / "learning_rate=0.002" / "run.log").read_text()
    assert resumed.count("done: 300 steps") == 1


def read_metrics_steps(workdir):
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line)["step"] for line in path.read_text().splitlines() if line]
    return max(steps, default=0)


@pytest.mark.slow
def test_parallel_finishes_the_same_runs_as_sequential(tmp_path):
    grid = {"optimizer.learning_rate": [0.001, 0.003], "model.hidden_sizes": [[32], [64]]}
    sequential = write_sweep(tmp_path / "seq.yaml", grid=grid, directory=str(tmp_path / "seq"))
    parallel = write_sweep(tmp_path / "par.yaml", grid=grid, directory=str(tmp_path / "par"))
    assert run_cli("sweep", str(sequential), timeout=600).returncode == 0
    proc = run_cli("sweep", str(parallel), "--parallel", "2", timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:]
    seq, par = index(tmp_path / "seq"), index(tmp_path / "par")
    assert [r["name"] for r in seq] == [r["name"] for r in par]
    assert all(r["status"] == "finished" for r in par)
    for a, b in zip(seq, par):  # same configs, same seeds: the same results
        assert a["final"]["eval/loss"] == pytest.approx(b["final"]["eval/loss"], rel=1e-6)


@pytest.mark.slow
def test_failed_runs_are_recorded_and_retried_only_when_asked(tmp_path):
    path = write_sweep(
        tmp_path / "fail.yaml",
        grid={"optimizer.learning_rate": [0.001, 1e30]},
        overrides={**FAST, "train.steps": 20, "optimizer.name": "sgd"},
    )
    proc = run_cli("sweep", str(path), timeout=600)
    assert proc.returncode == 1
    runs = {r["name"]: r for r in index(tmp_path / "out")}
    assert runs["learning_rate=0.001"]["status"] == "finished"
    assert runs["learning_rate=1e+30"]["status"] == "failed"
    assert "loss is" in runs["learning_rate=1e+30"]["error"]
    proc = run_cli("sweep", str(path))
    assert "0 to run" in proc.stdout
    proc = run_cli("sweep", str(path), "--retry-failed")
    assert "1 to run" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(
    not slurm_cluster.available(), reason="needs root and Debian's slurm-wlm and munge (.ci/run installs them)"
)
def test_slurm_backend_submits_a_job_array(tmp_path):
    """Three runs, vectorised two at a time: one array task trains a group of two, another the
    third run alone."""
    path = write_sweep(
        tmp_path / "array.yaml",
        grid={"optimizer.learning_rate": [0.001, 0.003, 0.01]},
        slurm={"cpus_per_task": 1, "time": "00:10:00"},
        vectorize=2,
    )
    out = tmp_path / "out"
    with slurm_cluster.SlurmCluster(tmp_path / "cluster") as cluster:
        env = {k: v for k, v in cluster.env.items() if k != "XLA_FLAGS"}
        proc = subprocess.run(
            [sys.executable, str(ROOT / "launch.py"), "sweep", str(path), "--backend", "slurm"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr
        assert "submitted job array" in proc.stdout and "(3 runs in 2 tasks)" in proc.stdout, proc.stdout
        script = (out / "sweep.sbatch").read_text()
        assert "#SBATCH --array=0-1" in script and "#SBATCH --cpus-per-task=1" in script
        deadline = time.time() + 400
        while not all(r["status"] in ("finished", "failed") for r in index(out)):
            assert time.time() < deadline, [r["status"] for r in index(out)]
            time.sleep(1)
    runs = index(out)
    assert [r["status"] for r in runs] == ["finished"] * 3, [r.get("error") for r in runs]
    assert all(r["final"]["eval/accuracy"] > 0 for r in runs)
    assert len(list((out / "groups").glob("*.log"))) == 1  # the group trained as one process


@pytest.mark.nocompile
def test_long_run_names_are_cut_and_stay_distinct(tmp_path):
    values = ["x" * 300 + str(i) for i in range(2)]
    sweep = load_sweep(write_sweep(tmp_path / "long.yaml", grid={"data.path": values}))
    names = [run.name for run in sweep.runs]
    assert len(set(names)) == 2 and all(len(name.encode()) <= 200 for name in names)


def test_a_bad_value_in_the_sweep_file_is_said_to_come_from_it(tmp_path):
    path = write_sweep(tmp_path / "bad.yaml", grid={"train.steps": ["many"]})
    proc = run_cli("sweep", str(path))
    assert proc.returncode == 2 and "from the sweep file bad.yaml" in proc.stderr, proc.stderr


def test_the_slurm_backend_without_sbatch_is_one_line_and_exit_2(tmp_path):
    path = write_sweep(tmp_path / "array.yaml", grid={"optimizer.learning_rate": [0.001, 0.003]})
    env = {"PATH": os.path.dirname(sys.executable)}  # python, and no sbatch
    proc = run_cli("sweep", str(path), "--backend", "slurm", env=env)
    assert proc.returncode == 2 and "sbatch, which is not on PATH" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "sweep.sbatch").exists()


@pytest.mark.nocompile
def test_a_failed_runs_reason_is_said_and_a_report_of_no_metrics_says_so(tmp_path):
    from engine.observe.ranking import report
    from engine.sweep.local import _ended_line

    failed = {"status": "failed", "error": "error: run 'a': finetune.base is not vectorised"}
    assert _ended_line("a", failed) == "     failed a: error: run 'a': finetune.base is not vectorised"
    assert _ended_line("b", {"status": "finished"}) == "   finished b"
    (tmp_path / "sweep.json").write_text(json.dumps({"metric": "eval/loss", "mode": "min", "runs": ["a"]}))
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "status.json").write_text(json.dumps(failed))
    with pytest.raises(UsageError, match=r"no run has logged a metric yet .*sweep.jsonl"):
        report([tmp_path])


@pytest.mark.nocompile
def test_a_metric_whose_name_holds_a_slash_is_taken_as_report_takes_it(tmp_path):
    sweep = load_sweep(write_sweep(tmp_path / "m.yaml", metric="eval/rewards/accuracies", mode="max"))
    assert sweep.metric == "eval/rewards/accuracies"
    for bad in ("accuracy", "eval/", "/accuracy"):
        with pytest.raises(UsageError, match="must be split/name"):
            load_sweep(write_sweep(tmp_path / "bad.yaml", metric=bad))
