"""The best checkpoint (checkpoint.keep_best, export/sample --step best) and early stopping
(train.early_stop): what is kept, where a run ends, and that a resumed run decides as an
unbroken one."""

import json

import numpy as np
import pytest
from support.early_stop import meta, saved_steps

from engine.checkpoint.store import Checkpointer
from engine.errors import UsageError
from engine.run.setup import build_run
from engine.run.single import fit
from engine.runtime.rundir import read_records


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
    from engine.hub.inference import export_run

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


@pytest.mark.slow
def test_sample_step_best_reads_the_best_checkpoint(make_config, tmp_path):
    from engine.hub.generate import sample

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
