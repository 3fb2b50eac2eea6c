"""Vectorised runs (a sweep's `vectorize:`): K configs trained as one program give each
config's own losses, keep each run's files, stop a diverging run alone, resume exactly,
and never share a program between configs of different shapes."""

import dataclasses
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import time
import weakref
from pathlib import Path

import numpy as np
import pytest
import yaml

import engine.run.group
from conftest import ROOT, run_cli, start_cli
from engine.errors import UsageError
from engine.run.group import fit_group
from engine.run.single import fit
from engine.run.vectorize import group_mesh
from engine.runtime.rundir import StorageError, read_records
from engine.sweep import load_sweep
from engine.sweep.local import units

# four configs differing in learning rate, weight decay, dropout rate, seed and clipping norm
VARIANTS = [
    ["optimizer.learning_rate=0.001"],
    ["optimizer.learning_rate=0.004", "optimizer.weight_decay=0.3"],
    ["model.dropout_rate=0.5", "optimizer.b2=0.99"],
    ["seed=3", "optimizer.grad_clip_norm=0.5", "optimizer.eps=1e-6"],
]
COMMON = [
    "optimizer.name=adamw",
    "optimizer.grad_clip_norm=1.0",
    "train.steps=20",
    "train.steps_per_call=5",
    "log.every_steps=5",
    "eval.every_steps=10",
    "checkpoint.every_steps=10",
    "train.global_batch_size=32",
]


def _losses(losses: dict) -> np.ndarray:
    return np.array([losses[step] for step in sorted(losses)])


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 8])
def test_vectorised_runs_equal_the_same_configs_alone(make_config, tmp_path, devices):
    """On one device, and on 8 with the trial axis on the mesh (4 trials x data=2)."""
    mesh = [f"mesh.num_devices={devices}"]
    cfgs = [
        make_config("mnist_mlp.yaml", *COMMON, *mesh, *v, workdir=tmp_path / f"v{i}") for i, v in enumerate(VARIANTS)
    ]
    mesh_shape = dict(group_mesh(cfgs[0], len(cfgs)).shape)
    assert (mesh_shape["trial"], mesh_shape["data"]) == ((4, 2) if devices == 8 else (1, 1))
    trials = fit_group(cfgs)
    for i, (variant, trial) in enumerate(zip(VARIANTS, trials)):
        alone = fit(make_config("mnist_mlp.yaml", *COMMON, *variant, workdir=tmp_path / f"alone{i}"))
        assert trial.error is None
        assert sorted(trial.losses) == list(range(1, 21))
        np.testing.assert_allclose(_losses(trial.losses), _losses(alone.losses), rtol=1e-6)
        assert trial.eval_metrics["loss"] == pytest.approx(alone.eval_metrics["loss"], rel=1e-6)
        workdir = tmp_path / f"v{i}"  # each run's own files, as a run alone writes them
        assert (workdir / "config.yaml").is_file()
        assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20"]
        records = read_records(workdir / "metrics.jsonl")
        assert [r["step"] for r in records if r["split"] == "train"] == [5, 10, 15, 20]
        assert [r["step"] for r in records if r["split"] == "eval"] == [10, 20]
    # the configs differ: so do their losses (the comparison above is not of one run four times)
    assert len({round(float(_losses(t.losses)[-1]), 6) for t in trials}) == 4


@pytest.mark.slow
def test_a_vectorised_runs_checkpoint_resumes_alone(make_config, tmp_path):
    """A trial's checkpoints are a run's own: `launch.py train` continues one alone, exactly."""
    cfgs = [make_config("mnist_mlp.yaml", *COMMON, *v, workdir=tmp_path / f"v{i}") for i, v in enumerate(VARIANTS[:2])]
    fit_group(cfgs)
    longer = ["train.steps=30"]
    resumed = fit(make_config("mnist_mlp.yaml", *COMMON, *VARIANTS[1], *longer, workdir=tmp_path / "v1"))
    alone = fit(make_config("mnist_mlp.yaml", *COMMON, *VARIANTS[1], *longer, workdir=tmp_path / "alone"))
    assert sorted(resumed.losses) == list(range(21, 31))
    np.testing.assert_allclose(_losses(resumed.losses), _losses({s: alone.losses[s] for s in range(21, 31)}), rtol=1e-6)


def test_a_diverging_run_stops_alone(make_config, tmp_path):
    cfgs = [
        make_config(
            "mnist_mlp.yaml",
            *COMMON,
            f"optimizer.learning_rate={lr}",
            "optimizer.name=sgd",
            "optimizer.grad_clip_norm=0",
            workdir=tmp_path / f"v{i}",
        )
        for i, lr in enumerate([0.05, 1e30])
    ]
    stopped = []
    good, bad = fit_group(cfgs, on_stop=lambda cfg, why: stopped.append(cfg.workdir))  # the sweep's status
    assert stopped == [str(tmp_path / "v1")]
    assert bad.error is not None and "loss is nan" in bad.error
    assert good.error is None and sorted(good.losses) == list(range(1, 21))
    assert not [p for p in (tmp_path / "v1" / "checkpoints").iterdir() if p.name.isdigit()]  # nothing saved after
    assert sorted(p.name for p in (tmp_path / "v0" / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20"]


@pytest.mark.slow
def test_a_group_too_big_for_a_device_trains_as_smaller_groups(make_config, tmp_path, monkeypatch, capsys):
    """With room on the device for the step of 2 trials and not 3, a group of 4 trains as two
    groups of 2, one after the other, each run with the losses the group of 4 gives it."""
    import engine.run.vectorize as vectorize

    def group(name, variants):
        return [
            make_config("mnist_mlp.yaml", *COMMON, "mesh.num_devices=1", *v, workdir=tmp_path / f"{name}{i}")
            for i, v in enumerate(variants)
        ]

    def need(cfgs):  # as check_fits counts it: the larger of the train and eval steps
        group = vectorize.build_group(cfgs)
        return max(vectorize.program_bytes(group.compiled.program), vectorize.program_bytes(group.compiled.eval_step))

    whole = fit_group(group("whole", VARIANTS))
    cfgs = group("v", VARIANTS)
    one, two = need(cfgs[:1]), need(cfgs[:2])
    room = two + (two - one) / 2  # two trials fit, three do not
    monkeypatch.setattr(vectorize, "device_memory_bytes", lambda mesh: room / vectorize.MEMORY_FRACTION)
    built, alive, groups, build = [], [], [], vectorize.build_group

    def recorded(cfgs):
        gc.collect()
        alive.append(sum(group() is not None for group in groups))
        built.append(len(cfgs))
        group = build(cfgs)
        groups.append(weakref.ref(group))
        return group

    monkeypatch.setattr(engine.run.group, "build_group", recorded)
    capsys.readouterr()
    trials = fit_group(cfgs)
    assert built == [4, 2, 2]  # the group of 4 was compiled, found too big, and not trained
    assert alive == [0, 0, 0]  # each group (its device arrays) freed before the next is built
    assert "the group of 4 runs needs" in capsys.readouterr().out
    assert [t.cfg.workdir for t in trials] == [c.workdir for c in cfgs]
    for trial, alone in zip(trials, whole):
        assert trial.error is None
        np.testing.assert_allclose(_losses(trial.losses), _losses(alone.losses), rtol=1e-6)
        assert trial.eval_metrics["loss"] == pytest.approx(alone.eval_metrics["loss"], rel=1e-6)
    assert sorted(p.name for p in (tmp_path / "v3" / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20"]


@pytest.mark.slow
@pytest.mark.parametrize("staging", ["host", "device"])
def test_a_failed_save_stops_the_group(make_config, tmp_path, monkeypatch, staging):
    """A save that fails stops the group with one clear error. With checkpoint.staging=device
    the group's saves run on a background thread while training goes on; the error reaches
    the loop (at the next save or the end) instead of vanishing with the thread."""
    from engine.checkpoint.store import Checkpointer

    saved, real_save = [], Checkpointer.save

    def save(self, step, state, meta, metrics=None):
        if step == 10 and self.directory.parent.name == "v1":
            raise OSError(28, "No space left on device")
        saved.append((self.directory.parent.name, step))
        real_save(self, step, state, meta, metrics)

    monkeypatch.setattr(Checkpointer, "save", save)
    cfgs = [
        make_config("mnist_mlp.yaml", *COMMON, f"checkpoint.staging={staging}", workdir=tmp_path / f"v{i}")
        for i in range(2)
    ]
    with pytest.raises(StorageError, match="no space left"):  # one clear error, as for a run alone
        fit_group(cfgs)
    assert saved == [("v0", 10)]  # v1's save failed, and the group saved nothing after it


def _sweep_file(path, directory, **extra):
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "directory": str(directory),
        "overrides": {
            "train.steps": 100,
            "train.steps_per_call": 5,
            "log.every_steps": 25,
            "eval.every_steps": 50,
            "checkpoint.every_steps": 10,
            "train.global_batch_size": 32,
            "log.tensorboard": False,
            "optimizer.name": "adamw",
        },
        "grid": {"optimizer.learning_rate": [0.001, 0.003], "optimizer.weight_decay": [0.0, 0.1]},
        "vectorize": "auto",
        **extra,
    }
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.nocompile
def test_grouping_by_compiled_program(tmp_path, capsys):
    """Configs that change shapes (hidden size, batch size) never share a program; the sweep says why."""
    sweep = load_sweep(
        _sweep_file(
            tmp_path / "s.yaml",
            tmp_path / "out",
            vectorize=2,
            zip={"model.hidden_sizes": [[32], [64], [32]], "train.global_batch_size": [32, 32, 64]},
        )
    )
    groups = units(sweep, sweep.runs)
    said = capsys.readouterr().out
    assert "12 runs as 6 program(s) of 2, 2, 2, 2, 2, 2" in said
    assert "model.hidden_sizes change the compiled program" in said
    assert "train.global_batch_size change the compiled program" in said
    for group in groups:  # within a group only learning rate and weight decay differ
        shapes = {
            (json.dumps(r.overrides["model.hidden_sizes"]), r.overrides["train.global_batch_size"]) for r in group
        }
        assert len(shapes) == 1
    # a run that resumes from another step is grouped apart
    first = sweep.workdir(sweep.runs[0]) / "checkpoints" / "10"
    first.mkdir(parents=True)
    groups = units(sweep, sweep.runs)
    assert [sweep.runs[0]] in groups
    assert "they resume from step 0, it from step 10" in capsys.readouterr().out


@pytest.mark.nocompile
def test_vectorize_settings_are_checked(tmp_path):
    with pytest.raises(UsageError, match="vectorize='some' must be a whole number"):
        load_sweep(_sweep_file(tmp_path / "a.yaml", tmp_path / "o", vectorize="some"))
    with pytest.raises(UsageError, match="cannot vectorise"):
        load_sweep(
            _sweep_file(
                tmp_path / "b.yaml",
                tmp_path / "o",
                grid=None,
                search={"trials": 2, "params": {"optimizer.learning_rate": {"log_uniform": [1e-4, 1e-2]}}},
            )
        )
    # a number of runs per program asked for: a run that cannot be vectorised stops the sweep
    sweep = load_sweep(
        _sweep_file(tmp_path / "c.yaml", tmp_path / "o", overrides={"mesh.backend": "pmap"}, vectorize=2)
    )
    with pytest.raises(UsageError, match="set mesh.backend=jit"):
        units(sweep, sweep.runs)
    sweep = load_sweep(
        _sweep_file(
            tmp_path / "d.yaml",
            tmp_path / "o2",
            overrides={"checkpoint.restore_from": str(tmp_path / "pretrained")},
            vectorize=2,
        )
    )
    with pytest.raises(UsageError, match="not checkpoint.restore_from"):
        units(sweep, sweep.runs)


@pytest.mark.nocompile
def test_vectorize_auto_groups_only_what_a_group_can_train(tmp_path, capsys):
    """vectorize: auto asks each run the check a group's process would refuse it with (a LoRA run on
    finetune.base, a pipeline, ...): those train alone, with a line saying why."""
    from engine.config import check_vectorizable

    sweep = load_sweep(_sweep_file(tmp_path / "a.yaml", tmp_path / "o", zip={"mesh.backend": ["jit", "pmap"]}))
    groups = units(sweep, sweep.runs)
    said = capsys.readouterr().out
    assert sorted(map(len, groups)) == [1, 1, 1, 1, 4], said  # the 4 jit runs in one program, each pmap run alone
    assert all(sweep.config(run).mesh.backend == "pmap" for group in groups if len(group) == 1 for run in group)
    assert "vectorize: 4 runs as 1 program(s) of 4" in said and said.count("trains alone: ") == 4, said
    cfg = sweep.config(sweep.runs[0])
    lora = dataclasses.replace(cfg, finetune=dataclasses.replace(cfg.finetune, base=str(tmp_path / "base")))
    with pytest.raises(UsageError, match="finetune.base is not vectorised"):  # the check units() asks
        check_vectorizable(lora, "run 'x'")


def _train_losses(directory) -> dict:
    losses = {}
    for workdir in sorted(p for p in directory.iterdir() if (p / "metrics.jsonl").is_file()):
        losses[workdir.name] = [
            (r["step"], r["loss"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"
        ]
    return losses


def _pids_running(sweep_file) -> list[int]:
    """Processes started with `sweep_file` in their command line (a sweep and its children)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(sweep_file).encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # ended meanwhile
            continue
    return pids


@pytest.mark.slow
def test_a_killed_vectorised_sweep_resumes_exactly(tmp_path):
    """SIGKILL of the sweep and its group mid-way; the re-run resumes every run from its
    checkpoint and ends with the metrics of a sweep that never stopped (step 20's checkpoint
    cuts a 25-step log window: it carries the window's first steps)."""
    whole = _sweep_file(tmp_path / "whole.yaml", tmp_path / "whole")
    assert run_cli("sweep", str(whole), timeout=600).returncode == 0
    cut = _sweep_file(tmp_path / "cut.yaml", tmp_path / "cut")
    sweep = start_cli("sweep", str(cut), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    checkpoints = [tmp_path / "cut" / run / "checkpoints" / "20" for run in _train_losses(tmp_path / "whole")]
    while not all(p.is_dir() for p in checkpoints) and time.time() < deadline and sweep.poll() is None:
        time.sleep(0.05)
    for pid in [sweep.pid, *_pids_running(cut)]:  # the sweep and its group's process, no chance to save
        os.kill(pid, signal.SIGKILL)
    sweep.wait()
    while _pids_running(cut):
        time.sleep(0.05)
    assert all(p.is_dir() for p in checkpoints), "the sweep ended before every run had saved step 20"
    for step_dir in (tmp_path / "cut").glob("*/checkpoints/*"):  # as if killed right after step 20:
        if not step_dir.name.isdigit() or int(step_dir.name) > 20:  # its window carries steps 1..20 of 25
            shutil.rmtree(step_dir)
    statuses = [json.loads(line)["status"] for line in (tmp_path / "cut" / "sweep.jsonl").read_text().splitlines()]
    assert "finished" not in statuses
    rerun = run_cli("sweep", str(cut), timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "4 to run (4 resuming from a checkpoint" in rerun.stdout
    resumed = [
        int(step)
        for log in (tmp_path / "cut" / "groups").glob("*.log")
        for step in re.findall(r"resuming from step (\d+)", log.read_text())
    ]
    assert resumed == [20]
    expected, got = _train_losses(tmp_path / "whole"), _train_losses(tmp_path / "cut")
    assert len(expected) == 4 and got == expected
    index = [json.loads(line) for line in (tmp_path / "cut" / "sweep.jsonl").read_text().splitlines()]
    assert [entry["status"] for entry in index] == ["finished"] * 4


@pytest.mark.slow
def test_a_preempted_vectorised_sweep_saves_every_run_and_exits_143(tmp_path):
    """SIGTERM to the sweep (a pod's preemption): the group saves every run at one step and
    exits 143, the runs are `interrupted`, and the re-run resumes them from that step."""
    path = _sweep_file(
        tmp_path / "s.yaml",
        tmp_path / "out",
        overrides={
            "train.steps": 400,
            "train.steps_per_call": 5,
            "log.every_steps": 25,
            "eval.every_steps": 0,
            "checkpoint.every_steps": 0,
            "train.global_batch_size": 32,
            "log.tensorboard": False,
            "optimizer.name": "adamw",
        },
    )  # checkpoint.every_steps=0: only the signal's save, and the last
    sweep = start_cli("sweep", str(path), stderr=subprocess.STDOUT)
    metrics = list((tmp_path / "out").glob("*/metrics.jsonl"))
    deadline = time.time() + 300
    while len(metrics) < 4 and time.time() < deadline and sweep.poll() is None:  # training has begun
        time.sleep(0.05)
        metrics = list((tmp_path / "out").glob("*/metrics.jsonl"))
    sweep.send_signal(signal.SIGTERM)
    out, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 143, out
    index = [json.loads(line) for line in (tmp_path / "out" / "sweep.jsonl").read_text().splitlines()]
    assert [entry["status"] for entry in index] == ["interrupted"] * 4
    newest = {
        max(int(p.name) for p in (tmp_path / "out" / entry["name"] / "checkpoints").iterdir() if p.name.isdigit())
        for entry in index
    }
    assert len(newest) == 1  # one step for every run: the step the signal stopped them at
    (log,) = (tmp_path / "out" / "groups").glob("*.log")
    stopped = re.findall(r"preempted by SIGTERM: saved a checkpoint at step (\d+)", log.read_text())
    assert [int(step) for step in stopped] == list(newest) and 0 < newest.pop() < 400
    rerun = run_cli("sweep", str(path), timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "4 to run (4 resuming from a checkpoint" in rerun.stdout
