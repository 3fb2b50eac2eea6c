"""model.loss_chunk=0 (auto): the loss splits its float32 logits along the sequence when one
device's share would exceed model.logits_budget_mib. The chooser's arithmetic, the split it
takes from the layout, what plan says, and, from XLA's compiled memory, that neither the
forward nor the backward pass of a chunked loss holds the whole [batch, seq, vocab] logits."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest
from support.configs import ROOT
from support.loss_chunk import VOCAB

from engine.config import load_config
from engine.parallel.axes import MESH_AXES
from engine.parallel.mesh import build_mesh
from engine.parallel.sharding import ActivationLayout
from engine.plan.compiled import Planned, as_record, loss_line, train_loss_chunk
from engine.plan.tpu import parse_target
from models import REGISTRY
from models.layers import MIB, LossChunk, choose_loss_chunk, traced_loss_chunk


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
