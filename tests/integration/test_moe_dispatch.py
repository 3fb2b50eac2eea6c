"""The ragged dispatch of a mixture of experts (model.moe_dispatch=ragged): the losses and
gradients of the one-hot dispatch when that drops nothing, on one device and with the experts
split over mesh.expert; nothing dropped where one-hot drops a skewed routing's excess, and a
bounded all-to-all buffer's overflow counted; generation with the cache."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.context_experts import LLAMA, MOE, assert_same_training
from support.llama import greedy_reference

from engine.parallel.sharding import unbox
from engine.run.setup import build_run
from engine.state.columns import unpack_metrics
from models import REGISTRY, sampling
from models.configs import LlamaConfig
from models.moe import MoE

RAGGED = ["model.moe_dispatch=ragged"]


@pytest.mark.parametrize(
    "k, router, shared", [(1, "softmax", False), (2, "softmax", True), (1, "sigmoid", True), (2, "sigmoid", False)]
)
def test_ragged_layer_gives_the_losses_and_gradients_of_dropless_onehot(k, router, shared):
    cfg = LlamaConfig(
        d_model=16,
        mlp_dim=24,
        num_experts=4,
        experts_per_token=k,
        router=router,
        shared_expert=shared,
        expert_capacity_factor=0,
    )
    x = jax.random.normal(jax.random.key(1), (3, 10, 16))
    params = unbox(MoE(cfg, jnp.float32, jnp.float32).init(jax.random.key(0), x))["params"]

    def loss_and_grads(dispatch):
        module = MoE(dataclasses.replace(cfg, moe_dispatch=dispatch), jnp.float32, jnp.float32)

        def loss(params, x):
            y, sown = module.apply({"params": params}, x, mutable=["aux"])
            return jnp.sum(jnp.sin(y)) + sown["aux"]["aux_loss"][0], sown["aux"]["dropped"][0]

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    (onehot, _), onehot_grads = loss_and_grads("onehot")
    (ragged, dropped), ragged_grads = loss_and_grads("ragged")
    assert dropped == 0
    np.testing.assert_allclose(ragged, onehot, rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), ragged_grads, onehot_grads)
    assert np.abs(ragged_grads[0]["router"]).max() > 0 and np.abs(ragged_grads[1]).max() > 0


@pytest.mark.slow
def test_ragged_over_expert_axes_gives_the_losses_of_dropless_onehot_on_one_device(make_config):
    """The reference: one device, one-hot, dropless; ragged with room for every assignment in
    the all-to-all buffers, on one device and over expert 4 (with fsdp) and 8, and over expert 2
    beside context and tensor (the second run)."""
    args = [*LLAMA, *MOE, "model.expert_capacity_factor=0", "model.expert_buffer_factor=0"]
    assert_same_training(
        make_config,
        args,
        [
            ["mesh.num_devices=1", *RAGGED],
            ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4", *RAGGED],
            ["mesh.data=1", "mesh.expert=8", *RAGGED],
        ],
        steps=3,
    )
    assert_same_training(
        make_config,
        [*args, "model.shared_expert=true", "model.router=sigmoid", "model.scan_layers=false", "model.moe_interval=2"],
        [["mesh.data=1", "mesh.expert=2", "mesh.context=2", "mesh.tensor=2", *RAGGED]],
        steps=3,
    )


def skewed_first_step(make_config, *overrides) -> dict:
    """The first step's metrics (those metrics.jsonl's moe_dropped_tokens sums) with every
    router kernel 0: equal gates, and top-k takes the lowest experts on ties, so every token
    goes to experts 0 and 1."""
    run = build_run(make_config("llama_tiny", *LLAMA, *MOE, *overrides))
    state = run.init_state()
    skewed = jax.tree_util.tree_map_with_path(
        lambda path, a: a * 0 if "router" in jax.tree_util.keystr(path) else a, state.params
    )
    state = run.compiled.to_step_layout(state.replace(params=skewed))
    _, metrics = jax.block_until_ready(run.compiled.train_step(state, run.train_block(0)))
    (metrics,) = unpack_metrics(jax.device_get(metrics))
    return metrics


@pytest.mark.slow
def test_a_skewed_routing_drops_nothing_ragged_and_the_excess_onehot(make_config):
    """16 sequences of 16 tokens, 2 layers, every token to experts 0 and 1 of 8: 1024
    assignments. One-hot at capacity factor 1.25 keeps ceil(1.25 * 16 * 2 / 8) = 5 per
    expert per sequence, dropping 2 * (16 - 5) per sequence and layer. Ragged drops nothing on
    one device, nor over expert 2 or 4 with the default buffers (factor 0: room for every
    assignment); with factor 1 each device (2 sequences: 64 assignments) sends at most 64 / S
    to the shard holding experts 0 and 1, and the rest overflow."""
    onehot = skewed_first_step(make_config, "mesh.num_devices=1", "model.expert_capacity_factor=1.25")
    assert onehot["routed"] == 1024 and onehot["dropped"] == 2 * 16 * 2 * (16 - 5)
    for layout in (["mesh.num_devices=1"], ["mesh.data=4", "mesh.expert=2"], ["mesh.data=2", "mesh.expert=4"]):
        ragged = skewed_first_step(make_config, *layout, *RAGGED)
        assert ragged["routed"] == 1024 and ragged["dropped"] == 0, layout
    for shards, data in ((2, 4), (4, 2)):
        bounded = skewed_first_step(
            make_config, f"mesh.data={data}", f"mesh.expert={shards}", "model.expert_buffer_factor=1", *RAGGED
        )
        assert bounded["dropped"] == 2 * 8 * (64 - 64 // shards), shards


@pytest.mark.slow
def test_ragged_generation_with_the_cache_equals_argmax_without_it():
    from engine.data import DataInfo

    cfg = LlamaConfig(
        num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=48, num_experts=4, expert_capacity_factor=0
    )
    info = DataInfo("tokens", 8, 8, vocab_size=61, seq_len=12)
    onehot = REGISTRY["llama"].build(cfg, info, jnp.float32, jnp.float32)
    ragged_cfg = dataclasses.replace(cfg, moe_dispatch="ragged")
    ragged = REGISTRY["llama"].build(ragged_cfg, info, jnp.float32, jnp.float32)
    prompt = [3, 14, 15, 9, 2]
    params = jax.jit(lambda t: unbox(onehot.init(jax.random.key(0), t, train=False))["params"])(
        jnp.asarray([prompt], jnp.int32)
    )  # (one program, not every op dispatched eagerly)
    decoder = REGISTRY["llama"].build(ragged_cfg, info, jnp.float32, jnp.float32, decode=True)
    cached = sampling.generate(decoder, params, [prompt, prompt[:3]], 8, temperature=0.0)
    assert cached[0] == greedy_reference(ragged, params, prompt, 8, length=12)
    assert cached[0] == greedy_reference(onehot, params, prompt, 8, length=12)
    assert cached[1] == greedy_reference(onehot, params, prompt[:3], 8, length=12)
