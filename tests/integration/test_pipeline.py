"""The `pipeline` mesh axis on 8 simulated devices: a Llama's scanned layers split into stages
(GPipe and circular schedules, alone and beside data, fsdp and tensor parallelism) give the
one-device losses and weights; checkpoints move between pipeline layouts; a killed run resumes
exactly; a stage holds its share of the layers; wrong settings exit 2 by name."""

import jax
import numpy as np
import pytest
from support.context_experts import assert_same_training
from support.pipeline import DEEP, losses_of
from support.same_training import same_training_runs
from support.tokens import LLAMA_TOKENS, tokenized_corpus

from engine.errors import UsageError
from engine.parallel.sharding import per_device_bytes
from engine.run.setup import build_run
from engine.run.single import fit


@pytest.mark.slow
def test_pipelines_alone_and_beside_other_axes_give_the_one_device_training(make_config):
    """Stages 2 and 4, GPipe and circular, with data, fsdp and tensor: the one-device losses and
    weights of the same run (rtol 1e-5) over 4 steps. (2 stages beside data alone, and 4 circular
    stages of 2 repeats beside fsdp: the checkpoint test below, against one device too.) Under
    data=2 x pipeline=4 a stage holds its share of the layers."""
    runs = same_training_runs(
        make_config,
        DEEP,
        [
            ["mesh.data=2", "mesh.pipeline=4", "train.microbatches=8"],
            ["mesh.data=2", "mesh.pipeline=2", "mesh.tensor=2", "pipeline.schedule=circular", "train.microbatches=4"],
            ["mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2", "mesh.pipeline=2", "model.remat=full"],
        ],
    )
    assert_a_stage_holds_its_share_of_the_layers(runs[0][0])


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return tokenized_corpus(tmp_path_factory.mktemp("pipeline_corpus"), seed=5)


@pytest.mark.slow
def test_a_pipeline_over_packed_documents_gives_the_one_device_training(make_config, packed):
    """Segment ids and positions travel with their micro-batch through the stages."""
    args = [*LLAMA_TOKENS, f"data.path={packed}", "model.num_layers=4"]
    assert_same_training(make_config, args, [["mesh.data=2", "mesh.pipeline=4", "pipeline.schedule=gpipe"]])


def assert_a_stage_holds_its_share_of_the_layers(run):
    """Under mesh.pipeline=4 each device holds a quarter of the stacked layers' parameters (and
    of their Adam moments); the embedding and the head are whole on every stage."""
    stacked = {p.path for p in run.model.param_layouts if p.logical[:1] == ("layers",)}
    leaves = jax.tree_util.tree_leaves_with_path(run.abstract_state.params)
    layer_leaves = [leaf for path, leaf in leaves if jax.tree_util.keystr(path).startswith("['layers']")]
    whole = sum(p.nbytes for p in run.model.param_layouts if p.path in stacked)
    assert stacked and per_device_bytes(layer_leaves) * 4 == whole
    other = [leaf for path, leaf in leaves if not jax.tree_util.keystr(path).startswith("['layers']")]
    assert per_device_bytes(other) == sum(p.nbytes for p in run.model.param_layouts if p.path not in stacked)
    memory = run.compiled.memory
    assert memory.argument_size_in_bytes < per_device_bytes(run.abstract_state) + whole  # not the whole stack


@pytest.mark.slow
def test_checkpoints_move_between_pipeline_layouts_and_the_run_continues(make_config, tmp_path):
    """Saved under a circular 4-stage pipeline of 2 repeats beside fsdp (layers stored
    stage-major on the devices, in their own order in the checkpoint), resumed with no pipeline,
    then with 2 stages beside data: the losses of a run that never changed layout."""
    common = [
        *DEEP,
        "model.num_layers=8",
        "train.steps=6",
        "checkpoint.every_steps=2",
        "log.every_steps=1",
        "optimizer.schedule=constant",
    ]  # (train.steps ends each segment; a decaying schedule would follow it)
    reference = fit(make_config("llama_tiny.yaml", *common, "mesh.num_devices=1", workdir=tmp_path / "reference"))
    layouts = [
        ["mesh.data=1", "mesh.fsdp=2", "mesh.pipeline=4", "pipeline.schedule=circular", "train.steps=2"],
        ["mesh.num_devices=1", "train.steps=4"],
        ["mesh.data=4", "mesh.pipeline=2"],
    ]
    for layout in layouts:
        fit(make_config("llama_tiny.yaml", *common, *layout, workdir=tmp_path / "moved"))
    moved = losses_of(tmp_path / "moved")
    assert sorted(moved) == list(range(1, 7))
    np.testing.assert_allclose([moved[s] for s in range(1, 7)], [reference.losses[s] for s in range(1, 7)], rtol=1e-5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh.pipeline=3", "mesh.data=1", "mesh.num_devices=3"], "the model's 4 layers do not divide into"),
        (["mesh.pipeline=4", "mesh.data=2", "train.microbatches=2"], "train.microbatches=2 is fewer than"),
        (["mesh.pipeline=2", "mesh.data=4", "train.microbatches=3"], "does not split into train.microbatches=3"),
        (["mesh.pipeline=2", "mesh.data=2", "mesh.context=2"], "with mesh.context=2 is not supported"),
        (["mesh.pipeline=2", "mesh.data=4", "model.scan_layers=false"], "needs a layer stack"),
        (
            ["mesh.pipeline=2", "mesh.data=4", "model.num_experts=4", "model.experts_per_token=1"],
            "model.num_experts=4 is not supported",
        ),
    ],
    ids=["layers", "too-few-microbatches", "batch", "context", "no-stack", "experts"],
)
def test_pipeline_mistakes_are_refused_by_key(make_config, overrides, message):
    with pytest.raises(UsageError, match=message):
        build_run(make_config("llama_tiny.yaml", *DEEP, *overrides))
