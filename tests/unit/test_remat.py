"""model.remat's policies by name (models/remat.py): each gives remat=none's loss and gradients,
keeps what it names for the backward pass (and remat=offload keeps each layer's input in host
memory), in the Llama's scanned, unscanned and pipelined layers and in the GPT's blocks; a plan
for a TPU target reports the host memory an offloaded program uses."""

import contextlib
import dataclasses
import io
import re

import numpy as np
import pytest
from jax.ad_checkpoint import print_saved_residuals
from support.remat import BATCH, LAYERS, SEQ, WIDTH, loss_of

from contract.activations import ONE_STAGE, StagePlan
from contract.fields import choices_of
from engine.errors import UsageError
from models.configs import LlamaConfig, TransformerConfig
from models.remat import RECOMPUTE, REMAT_NAMES, policy


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
