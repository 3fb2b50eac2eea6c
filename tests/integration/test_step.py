"""The compiled step: gradient accumulation, eager mode, optimizers and schedules."""

import jax
import numpy as np
import optax
import pytest

from engine.config import OptimizerConfig
from engine.errors import UsageError
from engine.optim.optimizer import learning_rate_at, schedule_hparams
from engine.run.backends import compile_now
from engine.run.setup import build_run
from engine.run.single import fit
from engine.runtime.rundir import read_records
from engine.runtime.settings import compile_cache_events
from engine.state.columns import unpack_metrics


def first_steps(run, steps):
    state, losses = run.compiled.to_step_layout(run.init_state()), []
    for step in range(steps):
        state, metrics = jax.block_until_ready(
            run.compiled.train_step(state, run.train_block(step // run.inputs.steps_per_block))
        )
        (metrics,) = unpack_metrics(jax.device_get(metrics))  # one step per call
        losses.append(metrics["loss_sum"] / metrics["count"])
    return state, losses


def assert_trees_close(a, b, rtol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize(
    "model",
    [
        ["model.name=mlp", "model.dropout_rate=0.2"],
        [
            "model.name=transformer",
            "data.name=synthetic_text",
            "data.seq_len=16",
            "data.num_examples=256",
            "model.num_layers=1",
            "model.d_model=32",
            "model.num_heads=2",
            "model.mlp_dim=64",
            "data.vocab_size=32",
        ],
    ],
)
@pytest.mark.slow
def test_grad_accumulation_equals_one_big_batch(make_config, model):
    base = [
        "mesh.num_devices=1",
        "train.global_batch_size=32",
        "optimizer.name=sgd",
        "optimizer.learning_rate=0.1",
        *model,
    ]
    big, _ = first_steps(build_run(make_config("mnist_mlp.yaml", *base)), 3)
    accum, _ = first_steps(build_run(make_config("mnist_mlp.yaml", *base, "train.grad_accum_steps=4")), 3)
    # dropout masks follow each example's row in the global batch, so they match too
    assert_trees_close(big.params, accum.params, rtol=1e-5)


@pytest.mark.slow
def test_eager_mode_matches_jit(make_config):
    args = ["mesh.num_devices=1", "train.global_batch_size=16"]
    _, jitted = first_steps(build_run(make_config("mnist_mlp.yaml", *args)), 3)
    _, eager = first_steps(build_run(make_config("mnist_mlp.yaml", *args, "train.eager=true")), 3)
    np.testing.assert_allclose(jitted, eager, rtol=1e-5)


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam", "adamw"])
def test_each_optimizer_lowers_the_loss(make_config, name):
    lr = {"sgd": 0.5, "momentum": 0.1}.get(name, 0.01)
    cfg = make_config(
        "mnist_mlp.yaml",
        "mesh.num_devices=1",
        "train.steps=60",
        f"optimizer.name={name}",
        f"optimizer.learning_rate={lr}",
        "optimizer.grad_clip_norm=1.0",
        "log.every_steps=10",
    )
    losses = fit(cfg).losses
    assert np.mean([losses[s] for s in range(51, 61)]) < 0.6 * np.mean([losses[s] for s in range(1, 11)])


@pytest.mark.parametrize(
    "name, reference",
    [
        ("lion", lambda lr, mask: optax.lion(lr, b1=0.9, b2=0.99, weight_decay=0.1, mask=mask)),
        ("adafactor", lambda lr, mask: optax.adafactor(lr, weight_decay_rate=0.1, weight_decay_mask=mask)),
        ("muon", lambda lr, mask: optax.contrib.muon(lr, beta=0.9, weight_decay=0.1, weight_decay_mask=mask)),
        ("adamw", lambda lr, mask: optax.adamw(lr, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1, mask=mask)),
    ],
)
@pytest.mark.parametrize("decay_on", ["all", "matrices"])
def test_one_step_of_each_optimizer_equals_optax(name, reference, decay_on):
    """Our optimizer (its numbers in the state) makes optax's own update, weight decay on all
    parameters or (decay_on=matrices) not on norms' scales and biases."""
    from engine.optim.optimizer import make_optimizer

    cfg = OptimizerConfig(name=name, momentum=0.9, b2=0.99, weight_decay=0.1, weight_decay_on=decay_on)
    rng = np.random.default_rng(0)
    params = {
        "dense": {"kernel": rng.normal(size=(8, 4)).astype(np.float32), "bias": np.ones(4, np.float32)},
        "norm": {"scale": np.full(4, 2.0, np.float32)},
    }
    grads = jax.tree.map(lambda p: rng.normal(size=p.shape).astype(np.float32), params)
    ours = make_optimizer(cfg)
    state = ours.init(params)
    state.hyperparams["learning_rate"] = np.float32(0.01)
    mask = {"dense": {"kernel": True, "bias": decay_on == "all"}, "norm": {"scale": decay_on == "all"}}
    theirs = reference(0.01, mask)
    their_state = theirs.init(params)
    for _ in range(2):  # a second step: the state carried as optax carries it
        got, state = ours.update(grads, state, params)
        expected, their_state = theirs.update(grads, their_state, params)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    if decay_on == "matrices":  # the mask takes effect: a scale with zero gradient does not move
        zero = jax.tree.map(np.zeros_like, grads)
        moved, _ = make_optimizer(cfg).update(zero, make_optimizer(cfg).init(params), params)
        assert not np.any(np.asarray(moved["norm"]["scale"]))


@pytest.mark.parametrize(
    "kind, warmup, end",
    [
        ("constant", 0, 0.0),
        ("constant", 10, 0.0),
        ("warmup_cosine", 10, 0.1),
        ("warmup_linear", 4, 0.0),
        ("wsd", 10, 0.1),
    ],
)
def test_schedules_match_optax(kind, warmup, end):
    cfg = OptimizerConfig(learning_rate=2.0, schedule=kind, warmup_steps=warmup, end_learning_rate_factor=end)
    total = 110
    if kind == "constant":
        reference = optax.linear_schedule(0.0, 2.0, warmup) if warmup else optax.constant_schedule(2.0)
    elif kind == "warmup_cosine":
        reference = optax.warmup_cosine_decay_schedule(0.0, 2.0, warmup, total, 2.0 * end)
    elif kind == "wsd":  # the default decay_fraction 0.2: stable to step 88, then down to the end
        reference = optax.join_schedules(
            [
                optax.linear_schedule(0.0, 2.0, warmup),
                optax.constant_schedule(2.0),
                optax.linear_schedule(2.0, 2.0 * end, 22),
            ],
            [warmup, 88],
        )
    else:
        reference = optax.join_schedules(
            [optax.linear_schedule(0.0, 2.0, warmup), optax.linear_schedule(2.0, 2.0 * end, total - warmup)], [warmup]
        )
    hp = schedule_hparams(cfg, total)
    for step in (0, 1, warmup // 2, warmup, warmup + 1, 50, 87, 88, 95, 109, 110):
        assert float(learning_rate_at(kind, step, hp)) == pytest.approx(float(reference(step)), rel=1e-5, abs=1e-6)


@pytest.mark.slow
def built(cfg):
    """A run built and its eval step compiled (otherwise compiled at its first use), with the persistent
    compilation cache's {"hits": n, "misses": m} over both: every program a run needs."""
    before = dict(compile_cache_events)
    run = build_run(cfg)
    compile_now(run.compiled.eval_step)
    return run, {k: v - before.get(k, 0) for k, v in compile_cache_events.items()}


def test_hyperparameters_are_inputs_not_constants(make_config, tmp_path):
    """Runs that differ only in learning rate, warm-up, weight decay, dropout rate or seed lower to the same
    programs, so the second run loads every one of them from the persistent compilation cache."""
    common = ["mesh.num_devices=1", "optimizer.name=adamw", "optimizer.schedule=warmup_cosine"]
    _, first = built(make_config("mnist_mlp.yaml", *common, "optimizer.learning_rate=0.001", "seed=0"))
    _, second = built(
        make_config(
            "mnist_mlp.yaml",
            *common,
            "optimizer.learning_rate=0.02",
            "seed=3",
            "optimizer.weight_decay=0.1",
            "optimizer.warmup_steps=7",
            "model.dropout_rate=0.4",
        )
    )
    assert first.get("hits", 0) + first.get("misses", 0) >= 2  # the cache is in use
    assert second.get("misses", 0) == 0 and second.get("hits", 0) >= 2
    _, changed = built(make_config("mnist_mlp.yaml", *common, "model.hidden_sizes=[47]"))
    assert changed.get("misses", 0) >= 1  # a new shape does compile


def test_steps_per_transfer_changes_nothing_but_speed(make_config):
    args = ["mesh.num_devices=1", "train.global_batch_size=32", "model.dropout_rate=0.2"]
    _, one = first_steps(build_run(make_config("mnist_mlp.yaml", *args, "data.steps_per_transfer=1")), 12)
    _, five = first_steps(build_run(make_config("mnist_mlp.yaml", *args, "data.steps_per_transfer=5")), 12)
    assert one == five  # bit-identical, including steps that start mid-block


def test_dropout_rate_input_takes_effect(make_config):
    """The dropout rate is an input of the compiled step: two rates, one program (the second
    build loads it from the persistent cache, compiling nothing), different losses."""
    args = ["mesh.num_devices=1", "train.global_batch_size=32"]
    none_run, _ = built(make_config("mnist_mlp.yaml", *args, "model.dropout_rate=0.0"))
    half_run, half_cache = built(make_config("mnist_mlp.yaml", *args, "model.dropout_rate=0.5"))
    # The persistent cache is keyed by the program: every one the second build needed was there.
    assert half_cache.get("misses", 0) == 0 and half_cache.get("hits", 0) >= 2
    assert float(none_run.init_state().hparams["dropout_rate"]) == 0.0
    assert float(half_run.init_state().hparams["dropout_rate"]) == 0.5
    _, none = first_steps(none_run, 3)
    _, half = first_steps(half_run, 3)
    assert none[0] != half[0]  # same compiled program, different rate in the state, different loss


@pytest.mark.slow
def test_model_flops_ignore_remat_chunking_and_accumulation(make_config):
    """MFU counts the model's FLOPs: recomputation (remat) and loops that XLA's cost analysis
    counts once (chunked loss, gradient accumulation) must not change the figure."""
    base = [
        "mesh.num_devices=1",
        "model.name=transformer",
        "data.name=synthetic_text",
        "data.seq_len=16",
        "data.num_examples=256",
        "model.num_layers=2",
        "model.d_model=32",
        "model.num_heads=2",
        "model.mlp_dim=64",
        "data.vocab_size=512",
        "train.global_batch_size=8",
    ]
    plain = build_run(make_config("mnist_mlp.yaml", *base))
    assert plain.cost.source == "XLA cost analysis of the compiled step"
    remat = build_run(make_config("mnist_mlp.yaml", *base, "model.remat=full"))
    compiled = remat.compiled.train_step.cost_analysis()
    compiled = compiled[0] if isinstance(compiled, (list, tuple)) else compiled
    assert compiled["flops"] > 1.15 * plain.cost.flops_per_device_step  # the forward pass again
    looped = build_run(make_config("mnist_mlp.yaml", *base, "model.loss_chunk=4", "train.grad_accum_steps=2"))
    for run, named in ((remat, "remat=full"), (looped, "loss_chunk=4, grad_accum_steps=2")):
        assert run.cost.source == f"XLA cost analysis of the same step without {named}"
        assert run.cost.flops_per_device_step == pytest.approx(plain.cost.flops_per_device_step, rel=0.02)


def test_steps_per_call_changes_nothing_but_speed(make_config, tmp_path):
    """Several steps per dispatch (a device-side loop): the same losses, metrics and final
    state as one step per call, bit for bit, logged at the same steps."""
    args = [
        "mesh.num_devices=1",
        "train.steps=40",
        "log.every_steps=8",
        "eval.every_steps=20",
        "checkpoint.every_steps=0",
        "model.dropout_rate=0.2",
        "data.steps_per_transfer=6",
    ]
    one = fit(make_config("mnist_mlp.yaml", *args, workdir=tmp_path / "one"))
    four = fit(make_config("mnist_mlp.yaml", *args, "train.steps_per_call=4", workdir=tmp_path / "four"))
    assert four.losses == one.losses and sorted(four.losses) == sorted(one.losses) and len(one.losses) == 40
    assert four.eval_metrics == one.eval_metrics
    for a, b in zip(jax.tree.leaves(one.state.params), jax.tree.leaves(four.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    logged = [
        [
            (r["step"], r["split"], r.get("loss"))
            for r in read_records(path / "metrics.jsonl")
            if r["split"] != "summary"
        ]
        for path in (tmp_path / "one", tmp_path / "four")
    ]
    assert logged[0] == logged[1]


def test_convolutional_models_run_one_step_per_call_on_cpu(make_config, capsys):
    """XLA:CPU runs convolutions ~7-20x slower inside a multi-step call (BENCHMARKS.md): a CNN
    on CPU runs a step per call, and says so; the MLP keeps its device loop."""
    args = ["mesh.num_devices=1", "train.steps=20", "log.every_steps=10", "train.steps_per_call=10"]
    cnn = build_run(make_config("mnist_mlp.yaml", *args, "model.name=cnn"))
    assert cnn.inputs.steps_per_call == 1 and cnn.cfg.train.steps_per_call == 1
    assert "runs 1 step per call: on CPU, XLA runs model.name=cnn's convolutions" in capsys.readouterr().err
    assert build_run(make_config("mnist_mlp.yaml", *args)).inputs.steps_per_call == 10


def test_resuming_between_calls_of_a_different_size_is_refused(make_config, tmp_path):
    args = ["mesh.num_devices=1", "log.every_steps=2", "checkpoint.every_steps=2"]
    fit(make_config("mnist_mlp.yaml", *args, "train.steps=6", workdir=tmp_path / "w"))
    with pytest.raises(UsageError, match="resumes at step 6, which is not a multiple of train.steps_per_call=4"):
        fit(
            make_config(
                "mnist_mlp.yaml",
                "mesh.num_devices=1",
                "log.every_steps=4",
                "train.steps=12",
                "train.steps_per_call=4",
                workdir=tmp_path / "w",
            )
        )


def test_without_a_reference_count_mfu_uses_the_analytic_formula(make_config, monkeypatch):
    """GPU and TPU plugins may not analyse a lowered program; then a remat run's MFU comes
    from the transformer's formula, not from a compiled count that includes recomputation."""
    import engine.run.cost

    monkeypatch.setattr(engine.run.cost, "lowered_flops", lambda lowered: None)
    run = build_run(
        make_config(
            "mnist_mlp.yaml",
            "mesh.num_devices=1",
            "model.name=transformer",
            "data.name=synthetic_text",
            "data.seq_len=16",
            "data.num_examples=256",
            "model.num_layers=2",
            "model.d_model=32",
            "model.num_heads=2",
            "model.mlp_dim=64",
            "train.global_batch_size=8",
            "model.remat=full",
        )
    )
    cost = run.cost
    assert cost.flops_per_device_step == cost.analytic_per_device_step > 0
    assert cost.source.startswith("analytic formula (6*N*tokens")
    assert cost.source.endswith("XLA cost analysis of the compiled step, with remat=full is not the model's")


def test_the_clipping_norm_is_a_state_number_that_keeps_each_dtype(make_config):
    """optimizer.grad_clip_norm is an input of the step (runs of different norms share one
    program); it clips as optax does, and bfloat16 parameters keep bfloat16 updates."""
    common = ["mesh.num_devices=1", "train.steps=3", "train.param_dtype=bfloat16", "optimizer.name=adamw"]
    result = fit(make_config("mnist_mlp.yaml", *common, "optimizer.grad_clip_norm=0.5"))
    assert result.state.opt_state.hyperparams["grad_clip_norm"] == np.float32(0.5)
    assert jax.tree.leaves(result.state.params)[0].dtype == jax.numpy.bfloat16
    assert all(np.isfinite(loss) for loss in result.losses.values())
