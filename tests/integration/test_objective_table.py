"""The objectives' table (engine/config/objective.py): an objective defined here, in the test,
plugs in as one entry of a copy of the table and trains, with no edit of the engine."""

import json
from pathlib import Path

import jax.numpy as jnp
import pytest
from support.configs import TINY_LLAMA

from engine.config import objective as objective_table
from engine.config.objective_record import Objective
from engine.errors import UsageError
from engine.objectives import StepPart
from engine.run.single import fit
from engine.state.train_state import AUX_COLLECTION, model_variables

SUMS = ("square_sum",)


def half_square_part(cfg) -> StepPart:
    """Half the square of each target's cross-entropy (a function of the logits), its mean the loss."""
    del cfg

    def loss_fn(module, family, num_sources=0):
        task = family.task

        def loss(params, model_state, batch, rng, train, hparams=None):
            inputs, targets, extra = task.model_inputs(batch)
            out, _ = module.apply(
                model_variables(params, model_state), inputs, train=False, mutable=[AUX_COLLECTION], **extra
            )
            losses, hits = task.losses(out, targets)
            weights = batch.get("mask", jnp.ones(targets.shape[:1], jnp.float32))[:, None] * jnp.ones_like(losses)
            count = jnp.sum(weights)
            square = 0.5 * jnp.square(losses)
            zero = jnp.zeros((), jnp.float32)
            metrics = {
                "loss_sum": jnp.sum(square * weights),
                "correct": jnp.sum(hits * weights),
                "count": count,
                "aux_loss": zero,
                "routed": zero,
                "dropped": zero,
                "square_sum": jnp.sum(jnp.square(losses) * weights),
            }
            return metrics["loss_sum"] / jnp.maximum(count, 1.0), (metrics, model_state)

        return loss

    return StepPart(loss_fn)


def named(sums: dict) -> dict:
    count = max(float(sums["count"]), 1.0)
    return {"loss": float(sums["loss_sum"]) / count, "mean_square": float(sums["square_sum"]) / count}


HALF_SQUARE = Objective(
    name="half_square",
    part=half_square_part,
    sums=SUMS,
    record=named,
    console_keys=("mean_square",),
    rows_per_example=lambda cfg: 1,
)


def test_an_objective_defined_in_a_test_trains(make_config, monkeypatch, tmp_path):
    monkeypatch.setattr(objective_table, "OBJECTIVES", {**objective_table.OBJECTIVES, "half_square": HALF_SQUARE})
    cfg = make_config(
        "mnist_mlp.yaml",
        *TINY_LLAMA,
        "train.objective=half_square",
        "train.steps=2",
        "log.every_steps=1",
        "eval.every_steps=2",
        "optimizer.learning_rate=0.03",
        workdir=tmp_path / "run",
    )
    result = fit(cfg)
    records = [json.loads(line) for line in (Path(cfg.workdir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    evals = [r for r in records if r.get("split") == "eval"]
    assert [r["step"] for r in train] == [1, 2]
    for record in train + evals:  # the objective's own record: its names, and its loss (half the mean square)
        assert "accuracy" not in record and record["loss"] == pytest.approx(record["mean_square"] / 2, rel=1e-5)
    assert result.losses[2] < result.losses[1]  # its gradient moved the parameters


def test_a_name_outside_the_table_is_refused(make_config):
    with pytest.raises(UsageError, match="train.objective='half_square' is not one of lm, dpo"):
        make_config("mnist_mlp.yaml", *TINY_LLAMA, "train.objective=half_square")
