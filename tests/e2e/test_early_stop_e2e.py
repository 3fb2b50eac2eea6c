"""The best checkpoint (checkpoint.keep_best, export/sample --step best) and early stopping
(train.early_stop): what is kept, where a run ends, and that a resumed run decides as an
unbroken one."""

import shutil

import pytest
from support.cli import child_env, run_cli
from support.early_stop import meta, saved_steps
from support.fuzz_cli import refused_in_one_line, run_in_one_process

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


def records(workdir):
    """Every record but its timings: what an unbroken and a resumed run must agree on."""
    kept = ("step", "split", "loss", "accuracy", "grad_norm")
    return [{k: r[k] for k in kept if k in r} for r in read_records(workdir / "metrics.jsonl")]


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
    # re-running the finished run: said, nothing trained, nothing written
    result = fit(make_config("mnist_mlp.yaml", *EARLY, workdir=killed))
    assert f"already finished: the run stopped early at step {stopped} of 400" in capfd.readouterr().out
    assert result.steps == 0 and records(killed) == records(unbroken) and saved_steps(killed)[-1] == stopped
    # export --step best without keep_best: one line, exit 2; a sidecar evaluator watching the run
    # ends with it (not waiting for step 400); both commands in one process (tests/support/fuzz_cli.py)
    export = ["export", "--workdir", str(killed), "--out", str(tmp_path / "export"), "--step", "best"]
    watch = ["eval", "--config", "configs/mnist_mlp.yaml", "--workdir", str(killed), "--watch", *EARLY]
    refused, watched = run_in_one_process(tmp_path, [{"argv": export}, {"argv": watch}], env=child_env())
    assert refused["code"] == 2 and refused["stderr"].count("\n") == 1, refused["escaped"] or refused["stderr"]
    assert "--step best reads the checkpoint kept by checkpoint.keep_best, which the run in" in refused["stderr"]
    assert not (tmp_path / "export").exists()
    assert watched["code"] == 0 and not watched["escaped"], watched["escaped"] or watched["stderr"]


BAD = [  # (overrides, what the one line names)
    (["checkpoint.best_mode=maximum"], "checkpoint.best_mode='maximum' is not one of min, max"),
    (["train.early_stop.metric=loss"], "train.early_stop.metric='loss' must name an eval metric"),
    (["train.early_stop.metric=eval/loss", "eval.every_steps=0"], "eval.every_steps=0"),
    (["checkpoint.keep_best=eval/los"], "checkpoint.keep_best=eval/los is not an eval metric of this run"),
]


def test_bad_settings_exit_2_with_one_line(tmp_path):
    """The last through launch.py in a process of its own (what a user sees), the others through
    the CLI's main in one process (tests/support/fuzz_cli.py)."""
    quick = ["train.steps=20", "eval.every_steps=10", "log.progress=false", "log.tensorboard=false"]
    argv = lambda i, args: ["--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / f"run{i}"), *quick, *args]  # noqa: E731
    *rest, (args, named) = BAD
    proc = run_cli(*argv(len(rest), args))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and named in proc.stderr, proc.stderr
    results = run_in_one_process(tmp_path, [{"argv": argv(i, args)} for i, (args, _) in enumerate(rest)])
    assert len(results) == len(rest) == 3
    for result, (_, named) in zip(results, rest):
        refused_in_one_line(result, named)
    assert not list(tmp_path.glob("run*"))  # refused before training or writing anything
