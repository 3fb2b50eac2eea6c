"""Vectorised runs (a sweep's `vectorize:`): K configs trained as one program give each
config's own losses, keep each run's files, stop a diverging run alone, resume exactly,
and never share a program between configs of different shapes."""

import gc
import weakref

import numpy as np
import pytest

import engine.run.group
from engine.run.group import fit_group
from engine.run.single import fit
from engine.run.vectorize import group_mesh
from engine.runtime.rundir import StorageError, read_records

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
def test_vectorised_runs_equal_the_same_configs_alone_a_trial_resumes_alone_and_a_big_group_splits(
    make_config, tmp_path, monkeypatch, capsys
):
    """On one device, and on 8 with the trial axis on the mesh (4 trials x data=2): both groups
    against the same four runs alone. A trial's checkpoints are a run's own: `launch.py train`
    continues one alone, exactly. With room on the device for the step of 2 trials and not 3, a
    group of 4 trains as two groups of 2, one after the other, each run with the losses the group
    of 4 (the one-device group above) gives it."""
    alone = [
        fit(make_config("mnist_mlp.yaml", *COMMON, *variant, workdir=tmp_path / f"alone{i}"))
        for i, variant in enumerate(VARIANTS)
    ]
    for devices in (1, 8):
        mesh = [f"mesh.num_devices={devices}"]
        cfgs = [
            make_config("mnist_mlp.yaml", *COMMON, *mesh, *v, workdir=tmp_path / f"d{devices}v{i}")
            for i, v in enumerate(VARIANTS)
        ]
        mesh_shape = dict(group_mesh(cfgs[0], len(cfgs)).shape)
        assert (mesh_shape["trial"], mesh_shape["data"]) == ((4, 2) if devices == 8 else (1, 1))
        trials = fit_group(cfgs)
        if devices == 1:
            one_device = trials  # the reference of the group too big for its device, below
        for i, (trial, solo) in enumerate(zip(trials, alone)):
            assert trial.error is None
            assert sorted(trial.losses) == list(range(1, 21))
            np.testing.assert_allclose(_losses(trial.losses), _losses(solo.losses), rtol=1e-6, err_msg=str(devices))
            assert trial.eval_metrics["loss"] == pytest.approx(solo.eval_metrics["loss"], rel=1e-6)
            workdir = tmp_path / f"d{devices}v{i}"  # each run's own files, as a run alone writes them
            assert (workdir / "config.yaml").is_file()
            assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20"]
            records = read_records(workdir / "metrics.jsonl")
            assert [r["step"] for r in records if r["split"] == "train"] == [5, 10, 15, 20]
            assert [r["step"] for r in records if r["split"] == "eval"] == [10, 20]
        # the configs differ: so do their losses (the comparison above is not of one run four times)
        assert len({round(float(_losses(t.losses)[-1]), 6) for t in trials}) == 4
    longer = ["train.steps=30"]  # a trial resumed alone
    resumed = fit(make_config("mnist_mlp.yaml", *COMMON, *VARIANTS[1], *longer, workdir=tmp_path / "d8v1"))
    unbroken = fit(make_config("mnist_mlp.yaml", *COMMON, *VARIANTS[1], *longer, workdir=tmp_path / "alone"))
    assert sorted(resumed.losses) == list(range(21, 31))
    expected = {s: unbroken.losses[s] for s in range(21, 31)}
    np.testing.assert_allclose(_losses(resumed.losses), _losses(expected), rtol=1e-6)

    # a group too big for its device
    import engine.run.vectorize as vectorize

    def group(name, variants):
        return [
            make_config("mnist_mlp.yaml", *COMMON, "mesh.num_devices=1", *v, workdir=tmp_path / f"{name}{i}")
            for i, v in enumerate(variants)
        ]

    def need(cfgs):  # as check_fits counts it: the larger of the train and eval steps
        group = vectorize.build_group(cfgs)
        return max(vectorize.program_bytes(group.compiled.program), vectorize.program_bytes(group.compiled.eval_step))

    whole = one_device  # the group of 4 on one device, never split
    cfgs = group("v", VARIANTS)
    one, two = need(cfgs[:1]), need(cfgs[:2])
    room = two + (two - one) / 2  # two trials fit, three do not
    monkeypatch.setattr(vectorize, "device_memory_bytes", lambda mesh: room / vectorize.MEMORY_FRACTION)
    built, alive, groups, build = [], [], [], vectorize.build_group

    def recorded(cfgs, devices=None):
        gc.collect()
        alive.append(sum(group() is not None for group in groups))
        built.append(len(cfgs))
        group = build(cfgs, devices)
        groups.append(weakref.ref(group))
        return group

    monkeypatch.setattr(engine.run.group, "build_group", recorded)
    capsys.readouterr()
    trials = fit_group(cfgs)
    assert built == [4, 2, 2]  # the group of 4 was compiled, found too big, and not trained
    assert alive == [0, 0, 0]  # each group (its device arrays) freed before the next is built
    assert "the group of 4 runs needs" in capsys.readouterr().out
    assert [t.cfg.workdir for t in trials] == [c.workdir for c in cfgs]
    for trial, unsplit in zip(trials, whole):
        assert trial.error is None
        np.testing.assert_allclose(_losses(trial.losses), _losses(unsplit.losses), rtol=1e-6)
        assert trial.eval_metrics["loss"] == pytest.approx(unsplit.eval_metrics["loss"], rel=1e-6)
    assert sorted(p.name for p in (tmp_path / "v3" / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20"]


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
