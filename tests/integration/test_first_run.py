"""What a new user meets first: TensorBoard after resumes, the evaluator's config, and the
README's own commands."""

import shutil

import pytest

from engine.run.single import fit
from engine.runtime.rundir import read_records


def tensorboard_scalars(workdir, tag):
    """(step, value) pairs of a tag as TensorBoard itself loads the run directory."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(workdir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(event.step, pytest.approx(event.value, rel=1e-6)) for event in accumulator.Scalars(tag)]


def jsonl_scalars(workdir, split, name):
    return [(r["step"], r[name]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == split]


def test_tensorboard_shows_what_metrics_jsonl_holds_after_resumes(make_config, tmp_path):
    pytest.importorskip("tensorboard")
    workdir = tmp_path / "run"
    args = [
        "mesh.num_devices=1",
        "log.tensorboard=true",
        "log.every_steps=5",
        "checkpoint.every_steps=10",
        "eval.every_steps=10",
    ]
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=25", workdir=workdir))
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=25", workdir=workdir))  # already finished
    shutil.rmtree(workdir / "checkpoints" / "25")  # as if killed after logging step 25, before its save
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=30", workdir=workdir))  # resumes at 20
    train = jsonl_scalars(workdir, "train", "loss")
    assert [step for step, _ in train] == [5, 10, 15, 20, 25, 30]
    assert tensorboard_scalars(workdir, "train/loss") == train
    assert tensorboard_scalars(workdir, "eval/loss") == jsonl_scalars(workdir, "eval", "loss")
    assert [step for step, _ in jsonl_scalars(workdir, "eval", "loss")] == [10, 20, 30]


def test_a_rerun_that_finds_no_checkpoint_says_it_starts_again_from_step_0(make_config, tmp_path, capsys):
    workdir = tmp_path / "run"
    args = ["mesh.num_devices=1", "train.steps=2", "eval.every_steps=0", "log.every_steps=1"]
    fit(make_config("mnist_mlp.yaml", *args, workdir=workdir))
    assert "starting again" not in capsys.readouterr().out  # a first run: nothing to say
    shutil.rmtree(workdir / "checkpoints")  # as if killed before its first save
    fit(make_config("mnist_mlp.yaml", *args, workdir=workdir))
    assert f"no checkpoint in {workdir / 'checkpoints'}: starting again from step 0" in capsys.readouterr().out


def test_a_watcher_started_before_the_run_follows_the_runs_own_config_once_written(make_config, tmp_path, capsys):
    """Before: an evaluator started with --config (train.steps=20) before the run existed kept
    its 20 after the run wrote train.steps=40, and exited 0 at step 20 with steps 30-40 never
    evaluated."""
    import yaml

    from engine.run.evaluator import run_evaluator

    workdir = tmp_path / "run"
    args = ["mesh.num_devices=1", "train.steps=20", "checkpoint.every_steps=10"]
    fit(make_config("mnist_mlp.yaml", *args, workdir=workdir))
    written = yaml.safe_load((workdir / "config.yaml").read_text())
    written["train"]["steps"] = 40  # the run's own config: it goes on to step 40 (and has stopped)
    (workdir / "config.yaml").write_text(yaml.safe_dump(written))
    watcher = make_config("mnist_mlp.yaml", *args, workdir=workdir)  # what --config gave it, before
    assert run_evaluator(watcher, watch=True, poll_seconds=0.05, dead_after=0.5) == 1
    assert "newest checkpoint is step 20 of 40" in capsys.readouterr().err


def test_the_readme_stays_a_front_page():
    """README.md is the setup, the run and the test commands and a map of the docs, in at most
    150 lines; recipes and snippets live in docs/, where their tests follow them."""
    from support.configs import ROOT

    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "README.md is over 150 lines: move the detail into docs/"
    for kept in (
        'pip install -e ".[dev]"',
        "python launch.py --config configs/mnist_mlp.yaml",
        "# the test suite (about",  # the test command, with the suite's time
        "(docs/architecture.md)",
        "(docs/debugging.md)",
    ):
        assert kept in readme, kept
