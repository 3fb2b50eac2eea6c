"""model.attention=splash: the Pallas flash kernel (interpreted on CPU) gives XLA's causal
attention, values and gradients, with grouped-query heads and packed documents; a sequence the
tiles do not divide is refused; a Llama run trains to XLA's losses and weights, on one device and
sharded, with packed documents."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.parallel import train_losses
from support.tokens import LLAMA_TOKENS, tokenized_corpus

from engine.errors import UsageError
from engine.parallel.mesh import build_mesh
from engine.parallel.sharding import ActivationLayout, unbox
from engine.run.setup import build_run
from models.splash import splash_attention

BATCH, SEQ, HEADS, WIDTH, BLOCK = 2, 256, 8, 32, 128


def inputs(kv_heads, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (BATCH, SEQ, HEADS, WIDTH), jnp.float32)
    k, v = (jax.random.normal(key, (BATCH, SEQ, kv_heads, WIDTH), jnp.float32) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], (BATCH, SEQ, HEADS, WIDTH), jnp.float32)


def xla_attention(q, k, v, segment_ids=None):
    """The model's XLA path (models/llama.py): causal, and within the query's document if packed."""
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & causal  # [batch, query, key]
    return jax.nn.dot_product_attention(q, k, v, mask=mask[:, None], implementation="xla")


def splash(q, k, v, segment_ids=None, layout=None):
    return splash_attention(q, k, v, segment_ids, interpret=True, block=BLOCK, layout=layout)


def values_and_grads(attention, q, k, v, cotangent, segment_ids=None):
    """attention's output and the gradients of <output, cotangent> by q, k and v."""

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, segment_ids) * cotangent)

    return jax.jit(lambda q, k, v: (attention(q, k, v, segment_ids), jax.grad(loss, (0, 1, 2))(q, k, v)))(q, k, v)


@pytest.mark.parametrize("kv_heads", [8, 2, 1], ids=["mha", "gqa4", "gqa8"])
def test_causal_values_and_grads_equal_xla(kv_heads):
    q, k, v, cotangent = inputs(kv_heads)
    (want, want_grads), (got, got_grads) = (
        values_and_grads(attention, q, k, v, cotangent) for attention in (xla_attention, splash)
    )
    np.testing.assert_allclose(got, want, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"d{name}")


def packed_segment_ids():
    """Documents of uneven lengths, cut across tile boundaries: [0]*100 + [1]*60 + [2]*96; then 3 of 256."""
    boundaries = jnp.array([[100, 160, SEQ], [3, SEQ, SEQ]])
    return jnp.sum(jnp.arange(SEQ)[None, :, None] >= boundaries[:, None, :], axis=-1).astype(jnp.int32)


def test_packed_documents_equal_xla_with_the_segment_mask():
    q, k, v, cotangent = inputs(2, seed=1)
    segment_ids = packed_segment_ids()
    (want, want_grads), (got, got_grads) = (
        values_and_grads(attention, q, k, v, cotangent, segment_ids) for attention in (xla_attention, splash)
    )
    assert not np.allclose(want, xla_attention(q, k, v), atol=1e-3)  # the segments do change the result
    np.testing.assert_allclose(got, want, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"d{name}")


def test_sharded_over_batch_and_heads_equals_xla():
    """Per device (shard_map) under a data=2 x tensor=4 mesh: 2 KV heads are replicated, 8 query heads split."""
    q, k, v, cotangent = inputs(2, seed=2)
    segment_ids = packed_segment_ids()
    mesh = build_mesh({"data": 2, "tensor": 4}, {}, jax.devices()[:8])

    def sharded(q, k, v, segment_ids):
        return splash(q, k, v, segment_ids, layout=ActivationLayout(mesh))

    (want, want_grads), (got, got_grads) = (
        values_and_grads(attention, q, k, v, cotangent, segment_ids) for attention in (xla_attention, sharded)
    )
    np.testing.assert_allclose(got, want, atol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        np.testing.assert_allclose(g, w, atol=1e-5, err_msg=f"d{name}")


def test_a_sequence_the_tiles_do_not_divide_is_refused(make_config):
    q, k, v, _ = inputs(2)
    with pytest.raises(ValueError, match=r"model\.attention=splash.*sequence length 200.*multiple of 128"):
        splash_attention(q[:, :200], k[:, :200], v[:, :200], interpret=True)
    with pytest.raises(UsageError, match=r"sequence length 96.*data\.seq_len"):  # at setup, before compiling
        build_run(make_config("llama_tiny.yaml", *TINY_RUN, "data.seq_len=96", "model.attention=splash"))


TINY_RUN = [
    "data.name=synthetic_text",
    "data.num_examples=64",
    "data.vocab_size=64",
    "data.seq_len=128",
    "model.num_layers=2",
    "model.d_model=64",
    "model.num_heads=4",
    "model.num_kv_heads=2",
    "model.mlp_dim=64",
    "train.global_batch_size=8",
]


SGD = [  # plain SGD: the parameters after a few steps carry the gradients' differences undistorted
    "optimizer.name=sgd",
    "optimizer.learning_rate=1.0",
    "optimizer.schedule=constant",
    "optimizer.grad_clip_norm=0",
]


def assert_splash_trains_like_xla(make_config, args):
    """3 steps with model.attention=splash give model.attention=xla's losses and weights."""
    runs = (build_run(make_config("llama_tiny.yaml", *args, f"model.attention={a}")) for a in ("xla", "splash"))
    (want, want_state), (got, got_state) = (train_losses(run, 3) for run in runs)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    want_params = dict(jax.tree_util.tree_leaves_with_path(unbox(want_state.params)))
    for path, param in jax.tree_util.tree_leaves_with_path(unbox(got_state.params)):
        np.testing.assert_allclose(param, want_params[path], atol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [["mesh.num_devices=1"], ["mesh.data=2", "mesh.tensor=4"]],
    ids=["1 device", "data2-tensor4-kv-replicated"],
)
def test_a_llama_run_trains_to_xla_losses(make_config, layout):
    """(data=2 x fsdp=2 x tensor=2 is the packed-documents run's layout, below.)"""
    assert_splash_trains_like_xla(make_config, [*TINY_RUN, *SGD, *layout])


@pytest.mark.slow
def test_packed_documents_train_to_xla_losses_sharded(make_config, tmp_path):
    """Packed documents (segment ids) through the per-device kernel under data=2 x fsdp=2 x tensor=2
    (the sharded run without replicated KV heads: one run proves both)."""
    corpus = tokenized_corpus(tmp_path / "corpus", seed=3)
    args = [
        *LLAMA_TOKENS,
        f"data.path={corpus}",
        "data.seq_len=128",
        *SGD,
        "mesh.data=2",
        "mesh.fsdp=2",
        "mesh.tensor=2",
    ]
    assert_splash_trains_like_xla(make_config, args)
