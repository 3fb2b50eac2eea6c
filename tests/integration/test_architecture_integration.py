"""The engine's shape, where it needs a run: one loop for a run alone and a vectorised group
(the rest of these checks compile nothing: tests/unit/test_architecture.py)."""

import pytest


def test_a_run_and_a_vectorised_group_of_one_write_the_same_records(make_config, tmp_path):
    """One loop: a config trained alone and as a group of one gives the same metrics.jsonl
    records (steps, splits, keys, losses), the same summary keys, and the same checkpoints."""
    from engine.run.group import fit_group
    from engine.run.single import fit
    from engine.runtime.rundir import read_records

    args = [
        "mesh.num_devices=1",
        "train.steps=20",
        "log.every_steps=5",
        "eval.every_steps=10",
        "checkpoint.every_steps=10",
        "log.profile_steps=[2,4]",
    ]
    fit(make_config("mnist_mlp.yaml", *args, workdir=tmp_path / "alone"))
    fit_group([make_config("mnist_mlp.yaml", *args, workdir=tmp_path / "group")])
    alone, group = (read_records(tmp_path / name / "metrics.jsonl") for name in ("alone", "group"))
    assert [(r["step"], r["split"], sorted(r)) for r in alone] == [(r["step"], r["split"], sorted(r)) for r in group]
    for a, b in zip(alone, group):
        if a["split"] != "summary":
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-6), (a, b)
    assert (tmp_path / "group" / "profile").is_dir()  # the profiling window works for both
    assert sorted(p.name for p in (tmp_path / "group" / "checkpoints").iterdir() if p.name.isdigit()) == ["10", "20"]
