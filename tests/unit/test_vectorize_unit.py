"""Vectorised runs (a sweep's `vectorize:`): K configs trained as one program give each
config's own losses, keep each run's files, stop a diverging run alone, resume exactly,
and never share a program between configs of different shapes."""

import dataclasses
import json

import pytest
from support.vectorize import _sweep_file

from engine.errors import UsageError
from engine.sweep import load_sweep
from engine.sweep.local import units


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
