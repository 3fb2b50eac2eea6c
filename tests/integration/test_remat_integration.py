"""model.remat's policies by name (models/remat.py): each gives remat=none's loss and gradients,
keeps what it names for the backward pass (and remat=offload keeps each layer's input in host
memory), in the Llama's scanned, unscanned and pipelined layers and in the GPT's blocks; a plan
for a TPU target reports the host memory an offloaded program uses."""

import jax
import numpy as np
import pytest
from support.remat import MODELS, loss_of

from contract.activations import ONE_STAGE, StagePlan
from models.remat import REMAT_NAMES


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, stages",
    [(model, ONE_STAGE) for model in MODELS] + [("llama-scanned", StagePlan(stages=2, microbatches=2))],
    ids=[*MODELS, "llama-pipelined"],
)
def test_every_policy_gives_the_loss_and_gradients_of_none(model, stages):
    """Remat changes what is kept, never the result (float32)."""
    loss, abstract = loss_of(model, "none", stages)
    params = jax.tree.map(lambda a, k: jax.random.normal(k, a.shape) * 0.2, abstract, _keys(abstract))
    want, want_grads = jax.jit(jax.value_and_grad(loss))(params)
    for remat in REMAT_NAMES[1:]:
        value, grads = jax.jit(jax.value_and_grad(loss_of(model, remat, stages)[0]))(params)
        np.testing.assert_allclose(value, want, rtol=1e-6, err_msg=remat)
        for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7, err_msg=remat)


def _keys(tree):
    leaves, structure = jax.tree.flatten(tree)
    return jax.tree.unflatten(structure, list(jax.random.split(jax.random.key(1), len(leaves))))


@pytest.mark.slow
def test_a_plan_for_tpu_reports_the_host_memory_offload_uses_and_its_fewer_device_temporaries(make_config):
    """remat=offload compiled for a v5e-8 by the TPU compiler: each layer's input lives in host
    memory (pinned_host), which the plan reports per chip (text and --json), and the device's
    temporaries are smaller than remat=full's, which keeps those inputs on the chip. (Many thin
    layers, so that the saved inputs outweigh one layer's recomputation; seq 128: splash attention.)"""
    pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")
    from engine.plan.compiled import as_record, plan
    from engine.plan.tpu import parse_target
    from engine.plan.verdict import render

    shape = ["model.num_layers=128", "model.d_model=128", "model.num_heads=4", "model.mlp_dim=256"]
    args = ["train.steps_per_call=1", "data.steps_per_transfer=1", *shape, "train.global_batch_size=64"]
    target = parse_target("v5e-8")
    planned = {
        remat: plan(make_config("llama_tiny.yaml", *args, f"model.remat={remat}"), target, compile_eval=False)
        for remat in ("full", "offload")
    }
    full, offload = (as_record(planned[remat]) for remat in ("full", "offload"))
    inputs = 128 * (64 // 8) * 128 * 128 * 4  # layers x [batch per chip, seq, embed] in float32
    assert offload["remat"] == "offload" and offload["attention"] == "splash" and full["remat"] == "full"
    assert offload["programs"][0]["host"] >= inputs and full["programs"][0]["host"] == 0
    assert offload["programs"][0]["temporaries"] < full["programs"][0]["temporaries"] - inputs // 2
    text = render(planned["offload"])
    assert "model: attention splash, remat offload" in text
    assert "host memory per chip (pinned_host, offloaded: not in the HBM above): train 64.0 MiB" in text, text
    assert "host memory" not in render(planned["full"])


def test_a_plan_names_attention_and_remat_and_suggests_offload_where_full_does_not_fit(make_config):
    """The plan's text names the programs' attention and remat policy and, for a program that
    does not fit with remat=full, suggests offload (not full again; and nothing for offload)."""
    pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")
    from engine.plan.compiled import Planned, Program
    from engine.plan.tpu import parse_target
    from engine.plan.verdict import render, verdict

    target = parse_target("v5e-8")
    mesh = {"data": 8, "fsdp": 1, "tensor": 1, "expert": 1, "context": 1, "pipeline": 1}

    def planned(remat: str) -> Planned:
        cfg = make_config("llama_tiny.yaml", f"model.remat={remat}")
        program = Program("train", 0, 0, 0, 0, 20 * 2**30, 20 * 2**30, 0.0, host=2**30 if remat == "offload" else 0)
        return Planned(
            cfg,
            target,
            mesh,
            dict.fromkeys(mesh, 1),
            target.program_hbm_bytes,
            [program],
            attention="splash",
            remat=remat,
        )

    text = render(planned("offload"))
    assert "model: attention splash, remat offload" in text
    assert "host memory per chip (pinned_host, offloaded: not in the HBM above): train 1.0 GiB" in text
    assert "host memory" not in render(planned("full"))
    assert "model.remat=offload" in verdict(planned("full")) and "model.remat=full" not in verdict(planned("full"))
    assert "model.remat=full" in verdict(planned("dots")) and "model.remat=offload" not in verdict(planned("dots"))
    assert "model.remat=" not in verdict(planned("offload"))
