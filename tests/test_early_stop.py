"""The best checkpoint (checkpoint.keep_best, export/sample --step best) and early stopping
(train.early_stop): what is kept, where a run ends, and that a resumed run decides as an
unbroken one."""

import json
import shutil

import numpy as np
import pytest

from conftest import run_cli
from engine.checkpoint.store import Checkpointer
from engine.errors import UsageError
from engine.run.best import Watched
from engine.run.setup import build_run
from engine.run.single import fit
from engine.runtime.rundir import read_records

# eval every 20 steps; saves every 10 (each one kept) so that a resume can start from any of them
EARLY = [
    "mesh.num_devices=1",
    "train.steps=400",
    "eval.every_steps=20",
    "log.every_steps=30",  # windows cut by saves and by the early end: carried and logged
    "checkpoint.every_steps=10",
    "checkpoint.keep=50",
    "train.early_stop.metric=eval/loss",
    "train.early_stop.min_delta=0.05",
    "train.early_stop.patience=2",
    "log.progress=false",
]


def saved_steps(workdir):
    return sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())


def records(workdir):
    """Every record but its timings: what an unbroken and a resumed run must agree on."""
    kept = ("step", "split", "loss", "accuracy", "grad_norm")
    return [{k: r[k] for k in kept if k in r} for r in read_records(workdir / "metrics.jsonl")]


def meta(workdir, step):
    return json.loads((workdir / "checkpoints" / str(step) / "meta" / "metadata").read_text())


@pytest.mark.nocompile
def test_watched_counts_evaluations_without_an_improvement_beyond_min_delta():
    """Keras's rule: an improvement beats the best so far (not the last value) by more than min_delta."""
    watched = Watched("train.early_stop.metric", "eval/loss", "min", min_delta=0.1)
    course = [(1.0, True), (0.95, False), (0.85, True), (0.8, False), (float("nan"), False), (0.76, False)]
    for step, (loss, improved) in enumerate(course, 1):
        assert watched.update({"loss": loss, "accuracy": 0.5}, step) == improved, step
    assert (watched.best, watched.step, watched.since) == (0.85, 3, 3)
    highest = Watched("checkpoint.keep_best", "eval/accuracy", "max")
    assert [highest.update({"accuracy": a}, s) for s, a in enumerate([0.5, 0.5, 0.6])] == [True, False, True]
    with pytest.raises(UsageError, match="eval/los is not an eval metric of this run; it records eval/loss"):
        Watched("checkpoint.keep_best", "eval/los", "min").update({"loss": 1.0}, 1)

    for patience in (0, 1, 2):  # a first evaluation (a new best) never ends the run; patience 0 acts as 1
        watched = Watched("train.early_stop.metric", "eval/loss", "min")
        ends = [watched.update({"loss": loss}, step) is None or watched.exhausted(patience) for step, loss in
                enumerate([1.0, 0.5, 0.7, 0.8], 1)]  # fmt: skip
        assert ends == [False, False, patience <= 1, True], patience


@pytest.mark.slow
def test_keep_best_survives_beside_the_newest_and_export_step_best_reads_it(make_config, tmp_path):
    workdir = tmp_path / "run"
    cfg = make_config(
        "mnist_mlp.yaml",
        "mesh.num_devices=1",
        "train.steps=280",
        "eval.every_steps=20",
        "log.every_steps=20",
        "checkpoint.every_steps=50",
        "checkpoint.keep=1",
        "checkpoint.keep_best=eval/accuracy",
        "checkpoint.best_mode=max",
        workdir=workdir,
    )
    fit(cfg)
    evals = [(r["step"], r["accuracy"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "eval"]
    best = max(evals, key=lambda e: (e[1], -e[0]))[0]  # the first step at the highest accuracy
    assert best != 280, "the setting must make an earlier evaluation the best"
    assert saved_steps(workdir) == [best, 280]  # keep=1: the newest, and the best beside it
    assert meta(workdir, 280)["keep_best"]["step"] == best
    from engine.checkpoint.inference import export_run

    out = export_run(str(workdir), str(tmp_path / "export"), "best")  # (the CLI's --step: the early-stop test)
    assert json.loads((out / "export.json").read_text())["step"] == best
    import orbax.checkpoint as ocp

    exported = ocp.StandardCheckpointer().restore(out / "variables")["params"]
    state = Checkpointer(workdir / "checkpoints", 1, read_only=True).restore(build_run(cfg).abstract_state, best).state
    for a, b in zip(jax_leaves(exported), jax_leaves(state.params)):
        np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def train(workdir):
    return run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), *EARLY)


@pytest.mark.slow
def test_early_stop_ends_the_run_and_a_resumed_run_stops_at_the_same_step(make_config, tmp_path, capfd):
    unbroken = tmp_path / "unbroken"
    proc = train(unbroken)
    assert proc.returncode == 0, proc.stderr
    stopped = saved_steps(unbroken)[-1]
    assert f"stopped early at step {stopped} of 400: eval/loss has not improved" in proc.stdout and stopped < 400
    assert f"done: {stopped} steps;" in proc.stdout
    last = read_records(unbroken / "metrics.jsonl")[-1]
    assert (last["step"], last["split"]) == (stopped, "summary")  # written as at a normal end
    record = meta(unbroken, stopped)["early_stop"]
    assert record["stopped_at"] == stopped and record["since"] == 2
    # killed after the save of a step past the best, with an evaluation since it that did not improve
    resume_at = record["step"] + 20
    assert meta(unbroken, resume_at)["early_stop"]["since"] == 1 and resume_at < stopped
    killed = tmp_path / "killed"
    shutil.copytree(unbroken, killed)
    for step in saved_steps(killed):
        if step > resume_at:
            shutil.rmtree(killed / "checkpoints" / str(step))
    proc = train(killed)
    assert proc.returncode == 0, proc.stderr
    assert f"resuming from step {resume_at}" in proc.stdout
    assert f"stopped early at step {stopped} of 400" in proc.stdout
    assert records(killed) == records(unbroken)
    proc = run_cli("export", "--workdir", str(killed), "--out", str(tmp_path / "export"), "--step", "best")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "--step best reads the checkpoint kept by checkpoint.keep_best, which the run in" in proc.stderr
    assert not (tmp_path / "export").exists()
    # re-running the finished run: said, nothing trained, nothing written
    result = fit(make_config("mnist_mlp.yaml", *EARLY, workdir=killed))
    assert f"already finished: the run stopped early at step {stopped} of 400" in capfd.readouterr().out
    assert result.steps == 0 and records(killed) == records(unbroken) and saved_steps(killed)[-1] == stopped
    # a sidecar evaluator watching it ends with it (not waiting for step 400)
    proc = run_cli("eval", "--config", "configs/mnist_mlp.yaml", "--workdir", str(killed), "--watch", *EARLY)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize(
    "args, named",
    [
        (["checkpoint.best_mode=maximum"], "checkpoint.best_mode='maximum' is not one of min, max"),
        (["train.early_stop.metric=loss"], "train.early_stop.metric='loss' must name an eval metric"),
        (["train.early_stop.metric=eval/loss", "eval.every_steps=0"], "eval.every_steps=0"),
        (["checkpoint.keep_best=eval/los"], "checkpoint.keep_best=eval/los is not an eval metric of this run"),
    ],
)
def test_bad_settings_exit_2_with_one_line(tmp_path, args, named):
    quick = ["train.steps=20", "eval.every_steps=10", "log.progress=false", "log.tensorboard=false"]
    proc = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "run"), *quick, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and named in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()  # refused before training or writing anything


@pytest.mark.slow
def test_sample_step_best_reads_the_best_checkpoint(make_config, tmp_path):
    from engine.lm.generate import sample

    gpt = tmp_path / "gpt"
    quick = ["data.name=python_source", "data.tokenizer=bytes", "data.max_bytes=40000", "train.steps=4"]
    tiny = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "mesh.num_devices=1"]
    # eval/loss at its max: a setting that makes the first evaluation (step 2) the best
    kept = ["eval.every_steps=2", "eval.max_batches=1", "checkpoint.keep=1", "checkpoint.best_mode=max"]
    fit(make_config("gpt_small.yaml", *quick, *tiny, *kept, "checkpoint.keep_best=eval/loss", workdir=gpt))
    assert saved_steps(gpt) == [2, 4]

    def text(step):
        return sample(str(gpt), ["def "], 5, temperature=0.0, step=step)

    best = text("best")
    assert best != text(None)  # (greedy: the two checkpoints continue the prompt differently)
    assert best == text("2")


def test_a_vectorised_group_refuses_keep_best_and_early_stop(make_config, tmp_path):
    from engine.run.group import fit_group

    for setting in ("checkpoint.keep_best=eval/loss", "train.early_stop.metric=eval/loss"):
        cfg = make_config("mnist_mlp.yaml", setting, "eval.every_steps=10", workdir=tmp_path / "run")
        with pytest.raises(UsageError, match=f"{setting.split('=')[0]}=eval/loss is not supported by a vectorised"):
            fit_group([cfg])
        assert not (tmp_path / "run").exists()
