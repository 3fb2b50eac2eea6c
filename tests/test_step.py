"""The compiled step: gradient accumulation, eager mode, optimizers and schedules."""
import jax
import numpy as np
import pytest

from engine.optim import learning_rate_schedule
from engine.config import OptimizerConfig
from engine.setup import build_run
from engine.trainer import fit


def first_steps(run, steps):
    state, losses = run.to_step_layout(run.init_state()), []
    for step in range(steps):
        state, metrics = run.train_step(state, run.put_batch(run.train_batches(step), run.cfg.train.global_batch_size))
        losses.append(float(metrics["loss_sum"]) / float(metrics["count"]))
    return state, losses


def assert_trees_close(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("model", [["model.name=mlp", "model.dropout_rate=0.2"],
                                   ["model.name=transformer", "data.name=synthetic_text", "data.seq_len=16",
                                    "data.num_examples=256", "model.num_layers=1", "model.d_model=32",
                                    "model.num_heads=2", "model.mlp_dim=64", "data.vocab_size=32"]])
def test_grad_accumulation_equals_one_big_batch(make_config, model):
    base = ["mesh.num_devices=1", "train.global_batch_size=32", "optimizer.name=sgd",
            "optimizer.learning_rate=0.1", *model]
    big, _ = first_steps(build_run(make_config("mnist_mlp.yaml", *base)), 3)
    accum, _ = first_steps(build_run(make_config("mnist_mlp.yaml", *base, "train.grad_accum_steps=4")), 3)
    # dropout masks follow each example's row in the global batch, so they match too
    assert_trees_close(big.params, accum.params, rtol=1e-5)


def test_eager_mode_matches_jit(make_config):
    args = ["mesh.num_devices=1", "train.global_batch_size=16"]
    _, jitted = first_steps(build_run(make_config("mnist_mlp.yaml", *args)), 3)
    _, eager = first_steps(build_run(make_config("mnist_mlp.yaml", *args, "train.eager=true")), 3)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_each_optimizer_lowers_the_loss(make_config, name):
    lr = {"sgd": 0.5, "momentum": 0.1}.get(name, 0.01)
    cfg = make_config("mnist_mlp.yaml", "mesh.num_devices=1", "train.steps=60", f"optimizer.name={name}",
                      f"optimizer.learning_rate={lr}", "optimizer.grad_clip_norm=1.0", "log.every_steps=10")
    losses = fit(cfg).losses
    assert np.mean([losses[s] for s in range(51, 61)]) < 0.6 * np.mean([losses[s] for s in range(1, 11)])


def test_schedules():
    warm_cos = learning_rate_schedule(OptimizerConfig(learning_rate=1.0, schedule="warmup_cosine", warmup_steps=10,
                                                      end_learning_rate_factor=0.1), 110)
    assert float(warm_cos(0)) == 0.0 and float(warm_cos(10)) == pytest.approx(1.0)
    assert float(warm_cos(110)) == pytest.approx(0.1)
    linear = learning_rate_schedule(OptimizerConfig(learning_rate=2.0, schedule="warmup_linear", warmup_steps=4), 24)
    assert float(linear(2)) == pytest.approx(1.0) and float(linear(14)) == pytest.approx(1.0)
    assert float(linear(24)) == pytest.approx(0.0)
    assert float(learning_rate_schedule(OptimizerConfig(learning_rate=0.3), 5)(3)) == pytest.approx(0.3)
