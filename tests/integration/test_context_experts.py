"""Long contexts and mixtures of experts on 8 simulated devices: the sequence split over
`mesh.context` and the experts over `mesh.expert` give the one-device losses and weights of
the same run; a context split holds a fraction of the activations, an expert split a
fraction of the experts; MoE metrics reach metrics.jsonl; wrong settings exit 2 by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.context_experts import LLAMA, MOE, assert_same_training
from support.parallel import addressable_bytes
from support.same_training import same_training_runs
from support.tokens import LLAMA_TOKENS, tokenized_corpus

from engine.data import DataInfo
from engine.errors import UsageError
from engine.plan import hlo
from engine.run.setup import build_run
from engine.state.train_state import aux_totals as _aux_totals
from models.llama import LlamaConfig


@pytest.fixture(scope="module")
def packed_corpus(tmp_path_factory):
    return tokenized_corpus(tmp_path_factory.mktemp("context_corpus"), seed=3)


@pytest.mark.slow
def test_context_parallel_packed_documents_match_one_device(make_config, packed_corpus):
    """Packed documents (segment ids, positions restarting per document) over context 2, 4
    and 8, alone and with fsdp and tensor: the one-device losses and weights. (The Llama
    family has no dropout; the transformer's is per example, so a sequence split would not
    change it, but that family does not split its sequence.)"""
    args = [*LLAMA_TOKENS, f"data.path={packed_corpus}", "data.seq_len=32"]
    assert_same_training(
        make_config,
        args,
        [
            ["mesh.data=4", "mesh.context=2"],
            ["mesh.data=1", "mesh.fsdp=2", "mesh.context=4"],
            ["mesh.data=1", "mesh.context=8"],
            ["mesh.data=1", "mesh.fsdp=2", "mesh.context=2", "mesh.tensor=2"],
        ],
    )


@pytest.mark.slow
def test_moe_over_expert_axes_matches_one_device_each_holding_its_share_of_the_experts(make_config):
    """Top-2 of 8 experts with tokens over capacity dropped (factor 1.0), over expert 4 (with
    fsdp) and 8, and over expert 2 with a shared expert and sigmoid router beside context and
    tensor (on unpacked sequences: plain causal attention, cuDNN's on a GPU without a context
    split). Over expert 8 each device holds an eighth of the experts' weights and tokens reach
    them by all-to-all."""
    args = [*LLAMA, *MOE, "model.expert_capacity_factor=1.0"]
    runs = same_training_runs(
        make_config,
        args,
        [
            ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=4"],
            ["mesh.data=1", "mesh.expert=8"],
        ],
    )
    run, state = runs[1]
    experts = {name: leaf for name, leaf in state.params["layers"]["block"]["moe"].items() if name != "router"}
    total = sum(leaf.nbytes for leaf in experts.values())
    for device in run.mesh.devices.flat:
        assert addressable_bytes(experts, device) == total // 8
    assert "all-to-all" in {c.op for c in hlo.hlo_collectives(run.compiled.program.as_text(), 8)}
    assert_same_training(
        make_config,
        [*args, "model.shared_expert=true", "model.router=sigmoid", "model.scan_layers=false", "model.moe_interval=2"],
        [["mesh.data=1", "mesh.expert=2", "mesh.context=2", "mesh.tensor=2"]],
        steps=3,
    )


@pytest.mark.slow
def test_routing_is_causal_a_token_keeps_its_experts_whatever_follows():
    """With experts over capacity, which tokens are dropped depends on earlier tokens only:
    changing the tokens after position t leaves the logits up to t as they were."""
    from engine.parallel.sharding import unbox
    from models import REGISTRY

    cfg = LlamaConfig(
        num_layers=2,
        d_model=32,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=48,
        num_experts=4,
        experts_per_token=2,
        expert_capacity_factor=0.5,
    )
    info = DataInfo("tokens", 8, 8, vocab_size=64, seq_len=24)
    module = REGISTRY["llama"].build(cfg, info, jnp.float32, jnp.float32)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, (4, 24))
    params = jax.jit(lambda t: unbox(module.init(jax.random.key(0), t, train=False))["params"])(
        jnp.asarray(tokens, jnp.int32)
    )
    changed = tokens.copy()
    changed[:, 12:] = rng.integers(0, 64, (4, 12))

    @jax.jit  # (one program for both token sets, not every op dispatched eagerly)
    def forward(t):
        logits, sown = module.apply({"params": params}, t, train=False, mutable=["aux"])
        return logits, _aux_totals(sown["aux"])["dropped"]

    def apply(t):
        logits, dropped = forward(jnp.asarray(t, jnp.int32))
        return np.asarray(logits), float(dropped)

    (before, dropped), (after, _) = apply(tokens), apply(changed)
    assert dropped > 0  # experts were over capacity
    np.testing.assert_allclose(after[:, :12], before[:, :12], rtol=1e-6, atol=1e-6)
    assert not np.allclose(after[:, 12:], before[:, 12:])


@pytest.mark.slow
def test_a_context_split_holds_a_fraction_of_the_activations(make_config):
    """XLA's memory estimate of the compiled step: a 512-token sequence over context 4 needs
    under 40% of one device's temporaries (keys and values are gathered whole)."""
    args = [*LLAMA, "data.seq_len=512", "train.global_batch_size=4", "data.num_examples=16", "data.eval_fraction=0.2"]
    one = build_run(make_config("llama_tiny", *args, "mesh.num_devices=1")).compiled.memory.temp_size_in_bytes
    split = build_run(make_config("llama_tiny", *args, "mesh.num_devices=4", "mesh.data=1", "mesh.context=4"))
    assert split.compiled.memory.temp_size_in_bytes < 0.4 * one
    found = {c.op for c in hlo.hlo_collectives(split.compiled.program.as_text(), 4)}
    assert "all-gather" in found


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.data=1", "mesh.context=8", "data.seq_len=12"], "data.seq_len=12 is not divisible by mesh.context=8"),
        (
            ["mesh.data=1", "mesh.expert=8", "model.num_experts=4"],
            "model.num_experts=4 is not divisible by mesh.expert=8",
        ),
        (["model.num_experts=4", "model.experts_per_token=5"], "model.experts_per_token=5 must be between 1 and"),
        (["model.num_experts=4", "model.moe_interval=2"], "set model.scan_layers=false"),
        (
            ["mesh.data=4", "mesh.expert=2"],
            r"mesh.expert=2 needs a mixture of experts \(model.num_experts > 0\), which "
            r"model.name=llama .* does not have; set mesh.expert=1",
        ),
        (
            ["model.name=transformer", "mesh.data=4", "mesh.context=2"],
            "mesh.context=2 needs a model that splits its sequence",
        ),
    ],
)
def test_context_and_expert_mistakes_are_refused_by_key(make_config, overrides, message):
    model = [a for a in LLAMA if "kv_heads" not in a] if "model.name=transformer" in overrides else LLAMA
    with pytest.raises(UsageError, match=message):
        build_run(make_config("llama_tiny", *model, *overrides))
