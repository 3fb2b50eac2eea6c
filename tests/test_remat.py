"""model.remat's policies by name (models/remat.py): each gives remat=none's loss and gradients,
keeps what it names for the backward pass (and remat=offload keeps each layer's input in host
memory), in the Llama's scanned, unscanned and pipelined layers and in the GPT's blocks; a plan
for a TPU target reports the host memory an offloaded program uses."""

import contextlib
import dataclasses
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals

from contract.activations import ONE_STAGE, StagePlan
from contract.fields import choices_of
from engine.data import DataInfo
from engine.errors import UsageError
from engine.parallel.sharding import unbox
from models import REGISTRY
from models.configs import LlamaConfig, TransformerConfig
from models.family import BuildOptions
from models.remat import RECOMPUTE, REMAT_NAMES, policy

INFO = DataInfo("tokens", 8, 8, vocab_size=32, seq_len=8)
BATCH, SEQ, WIDTH, LAYERS = 2, 8, 16, 2
LLAMA = {"num_layers": LAYERS, "d_model": WIDTH, "num_heads": 4, "num_kv_heads": 2, "mlp_dim": 24}
MODELS = {
    "llama-scanned": ("llama", LLAMA),
    "llama-unscanned": ("llama", {**LLAMA, "scan_layers": False}),
    "gpt": (
        "transformer",
        {"num_layers": LAYERS, "d_model": WIDTH, "num_heads": 2, "mlp_dim": 32, "dropout_rate": 0.0},
    ),
}
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, INFO.vocab_size, (BATCH, SEQ + 1)), jnp.int32)


def loss_of(model: str, remat: str, stages: StagePlan = ONE_STAGE):
    """(the mean next-token loss as a function of the parameters, abstract parameters)."""
    name, overrides = MODELS[model]
    family = REGISTRY[name]
    module = family.build(family.config_cls(**overrides, remat=remat), INFO, jnp.float32, jnp.float32)
    params = jax.eval_shape(lambda: unbox(module.init({"params": jax.random.key(0)}, TOKENS[:, :-1], train=False)))
    if stages.stages > 1:  # the same parameters, run as a pipeline
        options = BuildOptions(stages=stages)
        module = family.build(family.config_cls(**overrides, remat=remat), INFO, jnp.float32, jnp.float32, options)

    def loss(p):
        losses, _ = module.apply({"params": p}, TOKENS[:, :-1], train=True, targets=TOKENS[:, 1:])
        return losses.mean()

    return loss, params["params"]


def residuals(model: str, remat: str, stages: StagePlan = ONE_STAGE) -> list[tuple[str, tuple[int, ...], str]]:
    """What the backward pass keeps: (memory: device or host, shape, how it was made), the
    parameters left out (every policy keeps them)."""
    loss, params = loss_of(model, remat, stages)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(loss, params)
    found = []
    for line in out.getvalue().splitlines():
        kind, host, shape, made = re.match(r"(\w+)(<host>)?\[([\d,]*)\] (.*)", line).groups()
        if not made.startswith("from the argument"):
            found.append(("host" if host else "device", tuple(int(n) for n in shape.split(",") if n), made))
    return found


def named(found) -> set[str]:
    return {re.search(r"named '(\w+)'", made).group(1) for _, _, made in found if "named '" in made}


def device_bytes(found) -> int:
    return sum(4 * int(np.prod(shape)) for memory, shape, _ in found if memory == "device")


@pytest.mark.nocompile
def test_the_names_are_one_table_the_configs_and_plan_search_share():
    assert set(RECOMPUTE) == set(REMAT_NAMES)  # plan --search ranks every policy, and only those
    for config in (LlamaConfig, TransformerConfig):
        field = next(f for f in dataclasses.fields(config) if f.name == "remat")
        assert choices_of(field) == REMAT_NAMES
        assert all(name in field.metadata["doc"] for name in REMAT_NAMES)  # the reference describes each
    assert policy("none") is None and all(callable(policy(name)) for name in REMAT_NAMES if name != "none")
    with pytest.raises(ValueError, match=r"model\.remat='most' is not one of none, full, dots, minimal"):
        policy("most")


@pytest.mark.nocompile
def test_an_unknown_policy_is_refused_naming_the_key_and_the_choices(make_config):
    with pytest.raises(UsageError, match=r"model\.remat.*offload"):
        make_config("llama_tiny.yaml", "model.remat=offlaod")


@pytest.mark.nocompile
@pytest.mark.parametrize("model", ["llama-unscanned", "gpt"])
def test_each_policy_keeps_what_it_names_and_full_only_the_layer_inputs(model):
    """The named saves keep their projections; full keeps no value from inside a layer, only
    the layers' inputs, which offload keeps in host memory instead: the device keeps
    layers x [batch, seq, embed] fewer floats, and the host holds exactly those."""
    kept = {remat: residuals(model, remat) for remat in REMAT_NAMES}
    assert named(kept["minimal"]) == {"query_proj", "key_proj", "value_proj", "out_proj"}
    assert named(kept["save_qkv_proj"]) == {"query_proj", "key_proj", "value_proj"}
    assert named(kept["save_out_proj"]) == {"out_proj"}
    assert not named(kept["full"]) and not named(kept["offload"])  # (none keeps everything, names and all)
    layer_inputs = LAYERS * BATCH * SEQ * WIDTH * 4
    host = [(memory, shape) for memory, shape, _ in kept["offload"] if memory == "host"]
    assert host == [("host", (BATCH, SEQ, WIDTH))] * LAYERS
    assert device_bytes(kept["full"]) - device_bytes(kept["offload"]) == layer_inputs
    assert not any(memory == "host" for remat in REMAT_NAMES if remat != "offload" for memory, _, _ in kept[remat])
    # each saving policy keeps more than full and less than none (dots: every matmul's output)
    order = ["full", "save_out_proj", "save_qkv_proj", "minimal", "none"]
    assert [device_bytes(kept[r]) for r in order] == sorted(device_bytes(kept[r]) for r in order), kept
    assert device_bytes(kept["full"]) < device_bytes(kept["dots"]) < device_bytes(kept["none"])


@pytest.mark.nocompile
@pytest.mark.parametrize("stages", [ONE_STAGE, StagePlan(stages=2, microbatches=2)], ids=["scanned", "pipelined"])
def test_scanned_and_pipelined_layers_offload_their_stacked_inputs_to_host_memory(stages):
    """Under nn.scan (and the pipeline's scans) the layers' inputs are stacked residuals: with
    offload they live in host memory, with full on the device; minimal keeps the projections."""

    def kept(remat: str, ends: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        """The stacked residuals (layers or pipeline iterations first) whose shape ends so."""
        found = residuals("llama-scanned", remat, stages)
        return [(memory, shape) for memory, shape, _ in found if len(shape) > 3 and shape[-len(ends) :] == ends]

    inputs = (SEQ, WIDTH)  # [..., batch, seq, embed]
    assert {memory for memory, _ in kept("offload", inputs)} == {"host"}
    assert {memory for memory, _ in kept("full", inputs)} == {"device"}
    projections = [(SEQ, 4, 4), (SEQ, 2, 4)]  # the query's and the key's or value's [..., seq, heads, width]
    assert sum(len(kept("minimal", ends)) for ends in projections) == 3
    assert not any(kept(remat, ends) for remat in ("full", "offload", "save_out_proj") for ends in projections)


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
