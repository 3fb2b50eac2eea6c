"""model.loss_chunk=0 (auto): the loss splits its float32 logits along the sequence when one
device's share would exceed model.logits_budget_mib. The chooser's arithmetic, the split it
takes from the layout, what plan says, and, from XLA's compiled memory, that neither the
forward nor the backward pass of a chunked loss holds the whole [batch, seq, vocab] logits."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from engine.config import load_config
from engine.data import DataInfo
from engine.parallel.axes import MESH_AXES
from engine.parallel.mesh import build_mesh
from engine.parallel.sharding import ActivationLayout, unbox
from engine.plan.compiled import Planned, as_record, loss_line, train_loss_chunk
from engine.plan.tpu import parse_target
from models import REGISTRY
from models.configs import LlamaConfig, TransformerConfig
from models.layers import MIB, LossChunk, choose_loss_chunk, traced_loss_chunk

VOCAB = 32768


@pytest.mark.nocompile
def test_within_the_budget_the_whole_sequence_at_once():
    chosen = choose_loss_chunk(0, 2048, 4, 1024, VOCAB)  # 512 MiB of logits
    assert (chosen.chunk, chosen.auto, chosen.logits_bytes) == (0, True, 4 * 1024 * VOCAB * 4)
    assert choose_loss_chunk(0, 512, 4, 1024, VOCAB).chunk == 0  # exactly the budget still fits


@pytest.mark.nocompile
def test_over_the_budget_the_largest_fitting_divisor_a_multiple_of_128_where_one_fits():
    # Llama 3 8B's shape: 4 x 8192 x 128256 float32 logits are 15.7 GiB; 2 GiB hold 1046 positions
    assert choose_loss_chunk(0, 2048, 4, 8192, 128256).chunk == 1024
    # seq 1536 = 2^9 * 3: 200 positions fit; 192 divides it but 128 is the tile that does
    assert choose_loss_chunk(0, 1, 1, 1536, 1310).chunk == 128  # 1310 * 4 bytes a position: 200 fit in 1 MiB
    # no multiple of 128 fits (seq 96): the largest divisor that does
    assert choose_loss_chunk(0, 1, 4, 96, 4096).chunk == 16  # 1 MiB / 64 KiB a position = 16
    # not even one position fits: one at a time
    assert choose_loss_chunk(0, 1, 64, 100, VOCAB).chunk == 1


@pytest.mark.nocompile
def test_a_budget_of_0_never_chunks_and_a_set_chunk_is_kept():
    whole = 64 * 8192 * 128256 * 4  # 250 GiB of logits, and no budget to hold them to
    assert choose_loss_chunk(0, 0, 64, 8192, 128256) == LossChunk(0, True, whole, 0)
    assert choose_loss_chunk(256, 0, 64, 8192, 128256) == LossChunk(256, False, whole, 0)
    kept = choose_loss_chunk(256, 2048, 1, 1024, 10)
    assert (kept.chunk, kept.auto) == (256, False)
    assert choose_loss_chunk(1024, 2048, 1, 1024, 10).chunk == 0  # a chunk of the whole sequence is none


@pytest.mark.nocompile
def test_the_batch_and_sequence_splits_divide_the_bytes_of_one_device():
    alone = choose_loss_chunk(0, 2048, 32, 8192, 128256)
    over_8 = choose_loss_chunk(0, 2048, 32, 8192, 128256, batch_splits=8)
    assert over_8.logits_bytes * 8 == alone.logits_bytes
    assert (alone.chunk, over_8.chunk) == (128, 1024)  # 4 sequences a device: as the 8B example above
    assert choose_loss_chunk(0, 2048, 32, 8192, 128256, 32, 8).chunk == 0  # 1 sequence, 1024 positions: 0.5 GiB
    assert choose_loss_chunk(0, 2048, 30, 8192, 128256, 8).logits_bytes == alone.logits_bytes * 30 // 32  # 8 ∤ 30


@pytest.mark.nocompile
def test_the_traced_choice_takes_the_layouts_batch_split():
    """The batch axes the step is not vmapped over (DiLoCo's replicas are) split the batch."""
    sizes = {"replica": 2, "fsdp": 4}
    mesh = build_mesh(sizes, {}, jax.devices()[:8])
    assert ActivationLayout(mesh).splits["batch"] == 8
    assert ActivationLayout(mesh, ("replica",)).splits["batch"] == 4
    targets = jax.ShapeDtypeStruct((32, 8192), jnp.int32)
    assert traced_loss_chunk(0, 2048, targets, 128256, None) == 128  # no layout: one device holds the batch
    assert traced_loss_chunk(0, 2048, targets, 128256, ActivationLayout(mesh)) == 1024
    assert traced_loss_chunk(512, 2048, targets, 128256, ActivationLayout(mesh)) == 512


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


def _program(micro_batch: int, accum: int, mesh: dict, objective: str = "lm", **model):
    model = {"loss_chunk": 0, "logits_budget_mib": 2048, "vocab_size": 0, **model}
    train = SimpleNamespace(global_batch_size=micro_batch * accum, grad_accum_steps=accum, objective=objective)
    shape = {axis: mesh.get(axis, 1) for axis in MESH_AXES}
    return SimpleNamespace(
        cfg=SimpleNamespace(model=SimpleNamespace(**model), train=train),
        family=REGISTRY["llama"],
        dataset=SimpleNamespace(info=SimpleNamespace(vocab_size=128000, seq_len=8192)),
        mesh=SimpleNamespace(shape=shape),
    )


@pytest.mark.nocompile
def test_plan_names_the_loss_chunk_of_the_train_program():
    """From one micro-batch split over the mesh's batch axes (the model's vocabulary over the data's)."""
    program = _program(128, 2, {"data": 4, "fsdp": 8}, vocab_size=128256)  # 4 sequences a chip
    loss = train_loss_chunk(program)
    assert loss is not None and (loss.chunk, loss.auto) == (1024, True)
    cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", [], "/tmp/unused")
    planned = Planned(cfg, parse_target("v6e-64"), {}, {}, 0, loss=loss)
    assert loss_line(planned) == "loss chunk 1024 (auto: 15.7 GiB of float32 logits per chip over the 2.0 GiB budget)"
    assert as_record(planned)["loss_chunk"] == {
        "chunk": 1024,
        "auto": True,
        "logits_bytes": 4 * 8192 * 128256 * 4,
        "budget_bytes": 2048 * MIB,
    }
    planned.loss = train_loss_chunk(_program(32, 1, {"fsdp": 32}))  # 1 sequence a chip, 3.9 GiB
    assert planned.loss is not None and planned.loss.chunk == 4096  # 2 GiB hold 4194 positions
    planned.loss = train_loss_chunk(_program(32, 1, {"fsdp": 32}, logits_budget_mib=0))
    assert loss_line(planned).startswith("loss chunk none, the whole sequence at once (3.9 GiB")
    planned.loss = train_loss_chunk(_program(32, 1, {"fsdp": 32}, logits_budget_mib=4096))
    assert "(auto: 3.9 GiB of float32 logits per chip within the 4.0 GiB budget)" in loss_line(planned)
    planned.loss = train_loss_chunk(_program(32, 1, {"fsdp": 32}, loss_chunk=512))
    assert loss_line(planned) == "loss chunk 512 (model.loss_chunk; at once: 3.9 GiB of float32 logits per chip)"
    over_context = train_loss_chunk(_program(32, 1, {"fsdp": 8, "context": 4}))  # 4 sequences, a quarter each
    assert over_context is not None and over_context.logits_bytes == 4 * 2048 * 128000 * 4
    pairs = train_loss_chunk(_program(16, 1, {"fsdp": 16}, objective="dpo"))  # DPO: 16 pairs are 32 rows
    assert pairs is not None and (pairs.chunk, pairs.logits_bytes) == (2048, 2 * 8192 * 128000 * 4)
    program.family = REGISTRY["mlp"]  # a model without a loss chunk
    assert train_loss_chunk(program) is None


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
