"""model.loss_chunk=0 (auto): the loss splits its float32 logits along the sequence when one
device's share would exceed model.logits_budget_mib. The chooser's arithmetic, the split it
takes from the layout, what plan says, and, from XLA's compiled memory, that neither the
forward nor the backward pass of a chunked loss holds the whole [batch, seq, vocab] logits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.loss_chunk import VOCAB

from engine.data import DataInfo
from engine.parallel.sharding import unbox
from models import REGISTRY
from models.configs import LlamaConfig, TransformerConfig
from models.layers import MIB, choose_loss_chunk


def _module(family: str, chunk: int, budget_mib: int, vocab: int, seq: int):
    info = DataInfo("tokens", 8, 8, vocab_size=vocab, seq_len=seq)
    shape = {"num_layers": 1, "d_model": 32, "num_heads": 2, "loss_chunk": chunk, "logits_budget_mib": budget_mib}
    if family == "llama":
        cfg = LlamaConfig(**shape, mlp_dim=64, scan_layers=False, attention="xla")
    else:
        cfg = TransformerConfig(**shape, mlp_dim=64, dropout_rate=0.0, attention="xla")
    return REGISTRY[family].build(cfg, info, jnp.float32, jnp.float32)


def _loss_and_grads(module):
    """value_and_grad of the mean loss, jitted: (params, inputs, targets) → (loss, gradients)."""

    def loss(params, inputs, targets):
        losses, _ = module.apply({"params": params}, inputs, train=False, targets=targets)
        return losses.mean()

    return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("family", ["llama", "transformer"])
def test_over_the_budget_neither_pass_holds_the_whole_logits(family):
    """XLA's compiled memory of value_and_grad of the loss, 4 x 256 x 32768 float32 logits
    (128 MiB): with an 8 MiB budget (16 positions a piece) the temporaries stay under one
    whole logits array, forward and backward; without a budget they hold at least one."""
    batch, seq = 4, 256
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    logits = batch * seq * VOCAB * 4
    assert choose_loss_chunk(0, 8, batch, seq, VOCAB).chunk == 16
    temporaries = {}
    for budget in (8, 0):
        module = _module(family, 0, budget, VOCAB, seq)
        params = unbox(jax.eval_shape(lambda: module.init(jax.random.key(0), tokens, train=False)))["params"]
        compiled = _loss_and_grads(module).lower(params, tokens, tokens).compile()
        temporaries[budget] = compiled.memory_analysis().temp_size_in_bytes
    assert temporaries[8] < logits / 4 and temporaries[0] >= logits, {k: v / MIB for k, v in temporaries.items()}


@pytest.mark.parametrize("family", ["llama", "transformer"])
def test_the_auto_chunk_gives_the_unchunked_loss_and_gradients(family):
    batch, seq, vocab = 2, 64, 4096  # 2 MiB of logits; a 1 MiB budget takes 32 positions a piece
    assert choose_loss_chunk(0, 1, batch, seq, vocab).chunk == 32
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)), jnp.int32)
    results = []
    for budget in (1, 0):
        module = _module(family, 0, budget, vocab, seq)
        params = unbox(jax.jit(lambda t: module.init(jax.random.key(0), t, train=False))(tokens[:, :-1]))["params"]
        results.append(_loss_and_grads(module)(params, tokens[:, :-1], tokens[:, 1:]))
    (chunked, chunked_grads), (whole, whole_grads) = results
    np.testing.assert_allclose(chunked, whole, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), chunked_grads, whole_grads)


@pytest.mark.slow
@pytest.mark.parametrize("accum", [1, 2])
def test_mfu_counts_the_whole_loss_when_the_budget_splits_it(make_config, accum):
    """A chunked loss is a loop XLA's cost analysis counts once: MFU is counted from a reference
    step that makes its logits whole, where the run's budget splits them (16 x 16 x 8192 float32
    logits are 8 MiB over one device), alone or beside gradient accumulation."""
    from engine.run.setup import build_run

    base = [
        "mesh.num_devices=1",
        "model.name=transformer",
        "data.name=synthetic_text",
        "data.seq_len=16",
        "data.num_examples=64",
        "data.vocab_size=8192",
        "model.num_layers=1",
        "model.d_model=16",
        "model.num_heads=2",
        "model.mlp_dim=32",
        "train.global_batch_size=16",
        f"train.grad_accum_steps={accum}",
    ]
    runs = {
        budget: build_run(make_config("mnist_mlp.yaml", *base, f"model.logits_budget_mib={budget}"))
        for budget in (1, 0)
    }
    chunk = choose_loss_chunk(0, 1, 16 // accum, 16, 8192).chunk  # a (micro-)batch's logits split to fit 1 MiB
    assert chunk == 2 * accum
    without = f"loss_chunk={chunk} (auto)" + (f", grad_accum_steps={accum}" if accum > 1 else "")
    assert runs[1].cost.source == f"XLA cost analysis of the same step without {without}"
    # (one program lowered against one compiled where nothing is accumulated: within 1%; the
    # chunked loop counted once would be a fifth of it)
    assert runs[1].cost.flops_per_device_step == pytest.approx(runs[0].cost.flops_per_device_step, rel=0.01)


@pytest.mark.slow
def test_a_chunked_loss_under_fsdp_gathers_the_head_once_not_for_every_piece(make_config):
    """8 CPU devices, fsdp=8: the train step of a loss in 8 pieces moves about what the whole
    logits' step moves (the output projection gathered once around the pieces' loop, its gradient
    reduced once); gathered in the loop it moved the head 8 times forward and 8 times backward."""
    from engine.plan import hlo
    from engine.run.setup import build_run

    tiny = ["data.name=synthetic_text", "data.num_examples=64", "data.vocab_size=4096", "data.seq_len=128"]
    tiny += ["model.num_layers=1", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2"]
    tiny += ["model.mlp_dim=64", "model.attention=xla", "train.global_batch_size=8", "mesh.fsdp=8", "mesh.data=1"]
    tiny += ["model.tie_embeddings=false"]  # (a tied table is gathered whole for the input anyway)
    moved = {}
    for chunk, gather in ((0, True), (16, True), (16, False)):
        settings = [f"model.loss_chunk={chunk}", "model.logits_budget_mib=0", f"model.gather_head={gather}".lower()]
        run = build_run(make_config("llama_tiny.yaml", *tiny, *settings))
        collectives = hlo.program_collectives(run.compiled.program.as_text(), run.mesh.size)
        moved[chunk, gather] = sum(c.ring_bytes * c.count for c in collectives)
    head = 64 * 4096 * 4  # the output projection in float32: 1 MiB
    assert moved[16, True] < moved[0, True] + head, {k: v / MIB for k, v in moved.items()}
    # model.gather_head=false: in every piece (less memory, more collectives)
    assert moved[16, False] > moved[0, True] + 4 * head, {k: v / MIB for k, v in moved.items()}
