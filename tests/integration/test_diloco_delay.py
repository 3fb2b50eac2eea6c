"""DiLoCo's overlapped outer step (diloco.delay=1): the engine's rounds equal a hand-written
loop of the one-round-stale update (replicas restart from the global parameters each round,
the outer optimizer applies the previous round's mean change); the pending change is in the
checkpoints (a run resumed mid-round continues exactly); delay=1 without DiLoCo exits 2."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.run.setup import build_run, trace_run
from engine.run.single import fit

ROUNDS, INNER, REPLICAS, BATCH = 4, 2, 2, 8


TINY = [
    "train.sync=diloco",
    "diloco.replica_axis=data",
    "diloco.delay=1",
    f"diloco.inner_steps={INNER}",
    f"mesh.data={REPLICAS}",
    f"mesh.num_devices={REPLICAS}",
    "model.hidden_sizes=[8]",
    "model.dropout_rate=0.0",
    "optimizer.schedule=constant",
    f"train.global_batch_size={BATCH}",
    "data.placement=host",
    "eval.every_steps=0",
    "log.every_steps=1",
]


def mlp_loss(params, image, label):
    """models/mlp.py's MLP (Dense relu → Dense) and softmax cross-entropy, written out."""
    x = image.reshape(image.shape[0], -1)
    h = jax.nn.relu(x @ params["hidden_0"]["kernel"] + params["hidden_0"]["bias"])
    logits = h @ params["logits"]["kernel"] + params["logits"]["bias"]
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits), label[:, None], axis=1)
    return -jnp.mean(picked)


def inner_sgd(lr):
    def step(p, g, state, t):
        return jax.tree.map(lambda p, g: p - lr * g, p, g), state

    return step


def inner_adamw(lr, b1, b2, eps, wd):
    def step(p, g, state, t):
        m, v = state
        m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, m, g)
        v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        update = jax.tree.map(lambda m, v: (m / (1 - b1**t)) / (jnp.sqrt(v / (1 - b2**t)) + eps), m, v)
        return jax.tree.map(lambda p, u: p - lr * (u + wd * p), p, update), (m, v)

    return step


def stale_reference(theta, batches, inner_step, outer: str, lr: float, mu: float):
    """The one-round-stale DiLoCo, as a plain loop: (global params, pending Δ̄, momentum, losses)."""
    zeros = jax.tree.map(jnp.zeros_like, theta)
    momentum, pending, losses, step = zeros, zeros, [], 0
    states = [(zeros, zeros)] * REPLICAS  # each replica's inner optimizer state lasts the whole run
    # (compiled once: dispatched eagerly, every op of the gradient is a program of its own)
    gradient = jax.jit(jax.value_and_grad(mlp_loss))
    for _ in range(ROUNDS):
        replicas = [theta] * REPLICAS  # every replica starts the round at the global parameters
        for _ in range(INNER):
            step, batch, round_losses = step + 1, batches[step], []
            for r in range(REPLICAS):
                rows = slice(r * BATCH // REPLICAS, (r + 1) * BATCH // REPLICAS)
                loss, grads = gradient(replicas[r], batch["image"][rows], batch["label"][rows])
                replicas[r], states[r] = inner_step(replicas[r], grads, states[r], step)
                round_losses.append(loss)
            losses.append(float(np.mean(round_losses)))
        fresh = jax.tree.map(lambda g, *rs: g - sum(rs) / REPLICAS, theta, *replicas)  # Δ̄_t
        if outer == "nesterov":
            momentum = jax.tree.map(lambda m, d: mu * m + d, momentum, pending)
            theta = jax.tree.map(lambda p, m, d: p - lr * (d + mu * m), theta, momentum, pending)
        else:  # sgd
            theta = jax.tree.map(lambda p, d: p - lr * d, theta, pending)
        pending = fresh  # applied at the end of the next round
    return theta, pending, momentum, losses


CASES = {
    "sgd-inner-nesterov-outer": (
        ["optimizer.name=sgd", "optimizer.learning_rate=0.1", "diloco.outer_optimizer=nesterov"],
        inner_sgd(0.1),
        "nesterov",
    ),
    "adamw-inner-sgd-outer": (
        [
            "optimizer.name=adamw",
            "optimizer.learning_rate=0.01",
            "optimizer.weight_decay=0.1",
            "optimizer.weight_decay_on=all",
            "diloco.outer_optimizer=sgd",
        ],
        inner_adamw(0.01, 0.9, 0.999, 1e-8, 0.1),
        "sgd",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_delay_1_is_the_one_round_stale_update_of_a_hand_written_loop(make_config, tmp_path, case):
    overrides, inner_step, outer = CASES[case]
    outer_lr, mu = 0.7, 0.9
    cfg = make_config(
        "mnist_mlp.yaml",
        *TINY,
        *overrides,
        f"train.steps={ROUNDS * INNER}",
        f"diloco.outer_learning_rate={outer_lr}",
        f"diloco.outer_momentum={mu}",
        workdir=tmp_path / "run",
    )
    run = build_run(cfg)
    start = jax.device_get(run.init_state().params)
    batches = [run.inputs.train(step) for step in range(ROUNDS * INNER)]
    result = fit(cfg, run)
    theta, pending, momentum, losses = stale_reference(start, batches, inner_step, outer, outer_lr, mu)
    state = jax.device_get(result.state)
    np.testing.assert_allclose([result.losses[s] for s in sorted(result.losses)], losses, rtol=1e-6)
    for ours, theirs in ((state.params, theta), (state.pending, pending), (state.momentum, momentum)):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), ours, theirs)
    for r in range(REPLICAS):  # every replica waits at the new global parameters
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[r], b), state.replicas["params"], state.params)


def test_a_delayed_run_resumed_mid_round_continues_exactly(make_config, tmp_path):
    """Saved at step 5 (mid-round 3, with round 2's change pending), resumed to step 8."""
    common = [*TINY, "optimizer.name=sgd", "optimizer.learning_rate=0.1", "checkpoint.every_steps=5"]
    whole = fit(make_config("mnist_mlp.yaml", *common, "train.steps=8", workdir=tmp_path / "whole"))
    fit(make_config("mnist_mlp.yaml", *common, "train.steps=5", workdir=tmp_path / "split"))
    resumed = fit(make_config("mnist_mlp.yaml", *common, "train.steps=8", workdir=tmp_path / "split"))
    assert sorted(resumed.losses) == [6, 7, 8]
    assert [resumed.losses[s] for s in (6, 7, 8)] == [whole.losses[s] for s in (6, 7, 8)]  # bit-identical
    a, b = jax.device_get(resumed.state), jax.device_get(whole.state)
    assert np.any(jax.tree.leaves(b.pending)[0] != 0)
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_the_pending_change_is_laid_out_as_the_parameters(make_config):
    """fsdp inside each replica: the pending Δ̄ is split as the global parameters are (no compile)."""
    plan = trace_run(make_config("mnist_mlp.yaml", *TINY, "mesh.fsdp=2", "mesh.num_devices=4"))
    specs = lambda tree: jax.tree.map(lambda s: s.spec, tree)  # noqa: E731
    assert specs(plan.state.shardings.pending) == specs(plan.state.shardings.params)
    assert "fsdp" in str(specs(plan.state.shardings.params))
    assert plan.state.abstract.pending["hidden_0"]["kernel"].dtype == jnp.float32
