"""Parallelism on 8 simulated devices: every layout gives the single-device losses, FSDP
really shards memory, the compiled HLO has the collectives each layout implies, and
misconfigured meshes are refused before compiling."""

import re

import jax
import numpy as np
import pytest
from support.configs import TINY_GPT
from support.parallel import addressable_bytes, train_losses

from engine.errors import UsageError
from engine.run.setup import build_run
from engine.state.columns import unpack_metrics

MLP = ["model.name=mlp", "model.hidden_sizes=[128]", "model.dropout_rate=0.2", "train.global_batch_size=64"]


GPT = TINY_GPT


LAYOUTS = {
    "1 device": ["mesh.num_devices=1"],
    "data=8": ["mesh.data=8"],
    "fsdp=8": ["mesh.data=1", "mesh.fsdp=8"],
    "data=4,tensor=2": ["mesh.data=4", "mesh.tensor=2"],
    "fsdp=4,tensor=2": ["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"],
    "pmap 8": ["mesh.data=8", "mesh.backend=pmap"],
}


@pytest.mark.slow
@pytest.mark.parametrize("model", [MLP, GPT], ids=["mlp", "transformer"])
def test_every_layout_matches_one_device(make_config, model):
    args = [*model, "optimizer.name=adam", "optimizer.learning_rate=3e-3"]
    reference, _ = train_losses(build_run(make_config("mnist_mlp.yaml", *args, *LAYOUTS["1 device"])), 6)
    assert reference[-1] < reference[0]
    for name, layout in LAYOUTS.items():
        if name == "1 device" or (name == "data=8" and model is GPT):  # (the GPT's data axis: data=4,tensor=2)
            continue
        losses, _ = train_losses(build_run(make_config("mnist_mlp.yaml", *args, *layout)), 6)
        np.testing.assert_allclose(losses, reference, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("model", [MLP, GPT], ids=["mlp", "transformer"])
def test_fsdp_shards_params_and_optimizer_state(make_config, model):
    run = build_run(make_config("mnist_mlp.yaml", *model, *LAYOUTS["fsdp=8"]))
    initial = run.init_state()
    state = (initial.params, initial.opt_state)
    total = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    for device in run.mesh.devices.flat:
        assert addressable_bytes(state, device) <= 1.1 * total / 8, device


def collectives(hlo: str) -> dict[str, list[str]]:
    found = {}
    for line in hlo.splitlines():
        match = re.search(r"= (.*?) (all-reduce|all-gather|reduce-scatter)(-start)?\(", line)
        if match:
            found.setdefault(match.group(2), []).append(match.group(1))
    return found


def cut_to_shard(hlo: str, full_shapes: tuple[str, ...], shard_shape: str) -> bool:
    """Does an all-reduce result of one of `full_shapes` feed an instruction that also takes
    the device's partition id and yields `shard_shape` (this device's slice of it)?"""
    reduced = set()
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?%(\S+) = (\S+?)(?:\{[^}]*\})? (all-reduce|get-tuple-element)\((%[^,)]+)", line)
        if (
            match
            and match.group(2) in full_shapes
            and (match.group(3) == "all-reduce" or match.group(4).startswith("%all-reduce"))
        ):
            reduced.add(match.group(1))
    for line in hlo.splitlines():
        match = re.match(r"\s*(?:ROOT )?%\S+ = (\S+?)(?:\{[^}]*\})? [\w-]+\(([^)]*)\)", line)
        if match and match.group(1) == shard_shape:
            operands = {o.strip().lstrip("%") for o in match.group(2).split(",")}
            if operands & reduced and any(o.startswith("partition-id") for o in operands):
                return True
    return False


def test_hlo_data_parallel_all_reduces_gradients_and_never_gathers(make_config):
    run = build_run(make_config("mnist_mlp.yaml", *MLP, *LAYOUTS["data=8"]))
    ops = collectives(run.compiled.train_step.as_text())
    assert "all-gather" not in ops
    assert any("f32[64,128]" in shapes or "f32[128,64]" in shapes for shapes in ops["all-reduce"])


def test_hlo_fsdp_gathers_parameters_and_reduces_gradients_to_shards(make_config):
    run = build_run(make_config("mnist_mlp.yaml", *MLP, *LAYOUTS["fsdp=8"]))
    hlo = run.compiled.train_step.as_text()
    ops = collectives(hlo)
    gathered = " ".join(ops["all-gather"])
    assert "f32[64,128]" in gathered and "f32[128,10]" in gathered  # full kernels rebuilt from their shards
    kernel = run.abstract_state.params["hidden_0"]["kernel"]
    assert kernel.sharding.shard_shape(kernel.shape) == (8, 128)  # each device keeps 1/8 of the kernel
    if jax.default_backend() == "cpu":
        # XLA:CPU has no reduce-scatter creator pass: the gradient reduce-scatter appears as an
        # all-reduce whose result is cut to this device's shard by its partition id (GPU/TPU
        # fuse the pair): the full [64, 128] kernel gradient becomes the [8, 128] shard.
        assert cut_to_shard(hlo, ("f32[128,64]", "f32[64,128]"), "f32[8,128]")
    else:
        assert "reduce-scatter" in ops


def test_mesh_axis_product_must_match_devices(make_config):
    with pytest.raises(UsageError, match=r"uses 6 devices but 8 are in use"):
        build_run(make_config("mnist_mlp.yaml", "mesh.data=3", "mesh.tensor=2"))
    with pytest.raises(UsageError, match=r"does not divide the 8 devices"):
        build_run(make_config("mnist_mlp.yaml", "mesh.data=-1", "mesh.tensor=3"))


def test_batch_must_divide_over_batch_axes(make_config):
    with pytest.raises(
        UsageError,
        match=r"train.global_batch_size=60 is not divisible by data\*fsdp\*expert=2\*4\*1=8; "
        r"use a multiple of 8",
    ):
        build_run(make_config("mnist_mlp.yaml", "mesh.data=2", "mesh.fsdp=4", "train.global_batch_size=60"))


def test_tensor_size_must_divide_sharded_dimension(make_config):
    with pytest.raises(
        UsageError,
        match=r"parameter hidden_0/bias \(100,\): its 'mlp' dimension of 100 is not "
        r"divisible by mesh.tensor=8; choose a mesh.tensor that divides 100",
    ):
        build_run(make_config("mnist_mlp.yaml", "mesh.data=1", "mesh.tensor=8", "model.hidden_sizes=[100]"))


def test_pmap_refuses_sharded_layouts(make_config):
    with pytest.raises(UsageError, match="mesh.backend=pmap is replicated data parallel only"):
        build_run(make_config("mnist_mlp.yaml", "mesh.data=4", "mesh.fsdp=2", "mesh.backend=pmap"))


@pytest.mark.parametrize("layout", [["mesh.data=8"], ["mesh.data=8", "mesh.backend=pmap"]], ids=["jit", "pmap"])
def test_steps_per_call_on_eight_devices_matches_one_step_per_call(make_config, layout):
    args = ["train.global_batch_size=32", "model.dropout_rate=0.2", "data.steps_per_transfer=4", *layout]
    reference, _ = train_losses(
        build_run(make_config("mnist_mlp.yaml", "mesh.num_devices=1", *args[: -len(layout)])), 8
    )
    run = build_run(make_config("mnist_mlp.yaml", *args, "train.steps_per_call=4"))
    state, losses = run.compiled.to_step_layout(run.init_state()), []
    for step in range(0, 8, 4):
        state, metrics = jax.block_until_ready(
            run.compiled.train_step(state, run.train_block(step // run.inputs.steps_per_block))
        )
        steps = unpack_metrics(jax.device_get(metrics))  # one call, four steps
        losses += [m["loss_sum"] / m["count"] for m in steps]
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
