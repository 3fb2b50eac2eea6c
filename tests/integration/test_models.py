from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from support.models import TOKENS

from engine.data import DataInfo
from engine.parallel.sharding import path_name, unbox
from engine.run.step import make_loss_fn
from models import REGISTRY
from models.transformer import TransformerConfig

IMAGE = DataInfo("image", 8, 8, input_shape=(16, 16, 3), num_classes=5)


def batch_for(info, n=4):
    rng = np.random.default_rng(0)
    if info.kind == "tokens":
        return {"tokens": jnp.asarray(rng.integers(0, info.vocab_size, (n, info.seq_len + 1)), jnp.int32)}
    return {
        "image": jnp.asarray(rng.random((n, *info.input_shape)), jnp.float32),
        "label": jnp.asarray(rng.integers(0, info.num_classes, n), jnp.int32),
    }


# (family, config, data, the parameter that first touches the input)
CASES = [
    ("mlp", {"hidden_sizes": [16]}, IMAGE, "hidden_0/kernel"),
    ("cnn", {"channels": [4, 8], "dense_size": 16}, IMAGE, "conv_0/kernel"),
    ("resnet", {"depth": 18, "width": 4}, IMAGE, "stem/kernel"),
    ("resnet", {"depth": 50, "width": 2}, IMAGE, "stem/kernel"),
    ("transformer", {"num_layers": 2, "d_model": 16, "num_heads": 2, "mlp_dim": 32}, TOKENS, "embed/embedding"),
    (
        "transformer",
        {"num_layers": 1, "d_model": 16, "num_heads": 2, "mlp_dim": 32, "remat": "full"},
        TOKENS,
        "embed/embedding",
    ),
]


def init(name, overrides, info, boxed=None):
    """(spec, module, unboxed variables, batch); boxed: a list that receives the variables as
    module.init gives them (with their logical axis names)."""
    spec = REGISTRY[name]
    cfg = spec.config_cls(**overrides)
    cfg.validate()
    module = spec.build(cfg, info, jnp.float32, jnp.float32)
    batch = batch_for(info)
    inputs = batch["tokens"][:, :-1] if info.kind == "tokens" else batch["image"]
    variables = module.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, inputs, train=False)
    if boxed is not None:
        boxed.append(variables)
    return spec, module, unbox(variables), batch


@pytest.mark.parametrize(
    "name, overrides, info, input_layer", CASES, ids=lambda c: str(c) if isinstance(c, str) and "/" not in c else None
)
@pytest.mark.slow
def test_forward_and_backward(name, overrides, info, input_layer):
    boxed = []  # (one init, eager: a ResNet-50's is seconds)
    spec, module, variables, batch = init(name, overrides, info, boxed)
    params = variables.pop("params")
    loss_fn = make_loss_fn(module, spec.task)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=4)
    (loss, (metrics, new_state)), grads = grad_fn(params, variables, batch, jax.random.key(2), True)
    assert np.isfinite(loss) and loss > 0
    assert float(metrics["count"]) == (4 * info.seq_len if info.kind == "tokens" else 4)
    norms = {path_name(path): float(jnp.linalg.norm(g)) for path, g in jax.tree_util.tree_leaves_with_path(grads)}
    assert all(np.isfinite(list(norms.values())))
    assert norms[input_layer] > 0, norms  # the gradient reaches the layer that reads the input
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    # every parameter of every model carries logical axis names (the sharding rules need them)
    boxes = jax.tree.leaves(boxed[0]["params"], is_leaf=lambda x: hasattr(x, "names"))
    assert all(hasattr(b, "names") and len(b.names) == b.value.ndim for b in boxes)


def test_resnet_batch_stats_update_in_training_and_are_used_in_eval():
    spec, module, variables, batch = init("resnet", {"depth": 18, "width": 4}, IMAGE)
    params = variables.pop("params")
    loss_fn = make_loss_fn(module, spec.task)
    _, (_, new_state) = loss_fn(params, variables, batch, jax.random.key(0), True)
    before = jax.tree.leaves(variables["batch_stats"])
    after = jax.tree.leaves(new_state["batch_stats"])
    assert any(not np.allclose(a, b) for a, b in zip(before, after))
    eval_before, _ = loss_fn(params, variables, batch, None, False)
    eval_after, (_, unchanged) = loss_fn(params, new_state, batch, None, False)
    assert float(eval_before) != pytest.approx(float(eval_after))  # eval reads the running statistics
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), unchanged, new_state))  # eval does not write


def test_dropout_is_on_in_training_only_and_depends_on_example_id():
    spec, module, variables, batch = init("mlp", {"hidden_sizes": [64], "dropout_rate": 0.5}, IMAGE)
    x = jnp.repeat(batch["image"][:1], 2, axis=0)  # two identical examples
    ids = jnp.array([0, 1])
    out = module.apply(variables, x, train=True, example_ids=ids, rngs={"dropout": jax.random.key(0)})
    assert not np.allclose(out[0], out[1])
    same = module.apply(variables, x, train=True, example_ids=jnp.array([7, 7]), rngs={"dropout": jax.random.key(0)})
    np.testing.assert_allclose(same[0], same[1])
    evals = module.apply(variables, x, train=False)
    np.testing.assert_allclose(evals[0], evals[1])


def test_bfloat16_compute_keeps_float32_params():
    spec = REGISTRY["mlp"]
    module = spec.build(spec.config_cls(hidden_sizes=[8]), IMAGE, jnp.bfloat16, jnp.float32)
    batch = batch_for(IMAGE)
    variables = unbox(module.init({"params": jax.random.key(0)}, batch["image"], train=False))
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(variables))
    assert module.apply(variables, batch["image"], train=False).dtype == jnp.bfloat16


def _lm_losses(module, variables, tokens, targets, fused: bool):
    """(mean loss, per-token hits) through the model's fused loss, or optax on full logits."""
    if fused:
        losses, hits = module.apply(variables, tokens, train=False, targets=targets)
        return losses.mean(), hits
    logits = module.apply(variables, tokens, train=False).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean(), jnp.argmax(logits, -1) == targets


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [0, 4])
def test_fused_cross_entropy_equals_optax_on_full_logits(chunk):
    info = DataInfo("tokens", 8, 8, vocab_size=50, seq_len=12)
    module = REGISTRY["transformer"].build(
        TransformerConfig(num_layers=1, d_model=16, num_heads=2, mlp_dim=32, loss_chunk=chunk),
        info,
        jnp.float32,
        jnp.float32,
    )
    tokens = batch_for(info, n=3)["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    variables = unbox(module.init(jax.random.key(0), inputs, train=False))
    grad = jax.jit(jax.value_and_grad(partial(_lm_losses, module), has_aux=True), static_argnums=3)
    (fused, fused_hits), fused_grads = grad(variables, inputs, targets, True)
    (ref, ref_hits), ref_grads = grad(variables, inputs, targets, False)
    np.testing.assert_allclose(fused, ref, rtol=1e-6)
    assert (fused_hits == ref_hits).all()
    # two summation orders in float32: gradients of unit scale agree to ~1e-7 absolute, and
    # code generated without LLVM's passes (the tests' -O0, no fused multiply-adds) rounds a
    # little differently again; a wrong gradient is off by orders more
    jax.tree.map_with_path(
        lambda path, g, expected: np.testing.assert_allclose(
            g, expected, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path)
        ),
        fused_grads,
        ref_grads,
    )


@pytest.mark.slow
def test_chunked_loss_keeps_less_in_memory():
    """With a large vocabulary the float32 logits dominate a step's temporaries; the fused
    loss keeps them once, the chunked one a piece at a time (from XLA's compiled estimate)."""
    info = DataInfo("tokens", 8, 8, vocab_size=2048, seq_len=32)
    tokens = batch_for(info, n=8)["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    temporaries = {}
    for name, chunk, fused in (("optax", 0, False), ("fused", 0, True), ("chunked", 8, True)):
        module = REGISTRY["transformer"].build(
            TransformerConfig(num_layers=1, d_model=32, num_heads=2, mlp_dim=64, loss_chunk=chunk),
            info,
            jnp.bfloat16,
            jnp.float32,
        )
        variables = unbox(module.init(jax.random.key(0), inputs, train=False))
        step = jax.jit(jax.grad(lambda v: _lm_losses(module, v, inputs, targets, fused)[0]))
        temporaries[name] = step.lower(variables).compile().memory_analysis().temp_size_in_bytes
    logits_f32 = 8 * 32 * 2048 * 4
    assert temporaries["fused"] <= temporaries["optax"] - logits_f32 / 2, temporaries  # one float32 copy, not two
    assert temporaries["chunked"] <= temporaries["fused"] - logits_f32 / 2, temporaries  # a quarter at a time
