"""Faults and abuse, storage: damaged checkpoints and metrics files, changed parameter dtypes
and optimizers on resume, a full disk and a read-only one. Each test reproduces one way real
runs break on disk and checks that the run names it, keeps what it had and resumes exactly."""

import json

import numpy as np
import pytest


@pytest.mark.slow
def test_bfloat16_parameters_train_resume_from_float32_and_an_optimizer_change_is_named(make_config, tmp_path):
    """param_dtype=bfloat16 trains (its Adam state keeps its dtype; b2=0.999 is not rounded to
    1.0), one or several steps per call alike; a float32 run resumes in bfloat16; a changed
    optimizer is named as such, and no checkpoint is set aside."""
    from engine.errors import UsageError
    from engine.run.single import fit

    common = [
        "train.steps=20",
        "log.every_steps=10",
        "eval.every_steps=0",
        "checkpoint.every_steps=10",
        "mesh.num_devices=1",
    ]
    per_step = fit(make_config("mnist_mlp.yaml", *common, "train.param_dtype=bfloat16", workdir=tmp_path / "one"))
    per_call = fit(
        make_config(
            "mnist_mlp.yaml", *common, "train.param_dtype=bfloat16", "train.steps_per_call=10", workdir=tmp_path / "ten"
        )
    )
    assert per_call.losses == per_step.losses and all(np.isfinite(list(per_step.losses.values())))
    assert per_step.losses[20] < per_step.losses[1]
    fit(make_config("mnist_mlp.yaml", *common, workdir=tmp_path / "run"))  # float32
    resumed = fit(
        make_config(
            "mnist_mlp.yaml", *common[1:], "train.steps=30", "train.param_dtype=bfloat16", workdir=tmp_path / "run"
        )
    )
    assert sorted(resumed.losses) == list(range(21, 31)) and np.isfinite(resumed.losses[30])
    with pytest.raises(UsageError, match="another structure .* optimizer .* checkpoint.restore_mode=params"):
        fit(
            make_config("mnist_mlp.yaml", *common[1:], "train.steps=40", "optimizer.name=sgd", workdir=tmp_path / "run")
        )
    assert sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit()) == [10, 20, 30]


def test_a_damaged_metrics_line_is_skipped_by_name_and_dropped_on_resume(make_config, tmp_path, capsys):
    """A line of metrics.jsonl damaged mid-file (a disk error, a hand edit): readers skip it
    and say which; the resumed run rewrites the file without it and trains on."""
    from engine.run.single import fit
    from engine.runtime.rundir import read_records

    workdir = tmp_path / "run"
    args = ["mesh.num_devices=1", "log.every_steps=2", "checkpoint.every_steps=2", "eval.every_steps=0"]
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=4", workdir=workdir))
    path = workdir / "metrics.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(1, '{"step": 2, "split": "tr\x00\x00')  # torn
    lines.insert(3, "[1, 2]")  # JSON, not a record
    path.write_text("\n".join(lines) + "\n")
    records = read_records(path)
    assert [r["step"] for r in records] == [
        json.loads(line)["step"] for line in lines if line.startswith('{"step": ') and line.endswith("}")
    ]
    assert "metrics.jsonl: 2 damaged line(s) skipped (line 2, 4)" in capsys.readouterr().err
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=6", workdir=workdir))
    capsys.readouterr()
    assert [r["step"] for r in read_records(path) if r["split"] == "train"] == [2, 4, 6]
    assert "damaged" not in capsys.readouterr().err  # the resume rewrote the file without them
    kept = (workdir / "metrics.jsonl.damaged").read_text().splitlines()
    assert kept == ['{"step": 2, "split": "tr\x00\x00', "[1, 2]"]  # nothing lost: set aside
