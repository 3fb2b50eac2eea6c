"""DiLoCo (train.sync=diloco): one inner step with an outer SGD of rate 1 is data parallelism;
the inner step moves nothing between replicas and the outer step only the parameters; a run
killed mid-round resumes bit-identically; the default job converges with 4 replicas; two
processes holding one replica each equal one process holding both; wrong settings exit 2."""

import numpy as np
from support.diloco import DILOCO, QUIET

from engine.parallel.sharding import per_device_bytes
from engine.plan import hlo
from engine.run.setup import build_run
from engine.run.single import fit
from engine.runtime.rundir import read_records


def test_one_inner_step_and_an_outer_sgd_of_rate_1_is_data_parallelism(make_config, tmp_path):
    """Inner SGD with momentum is linear in the gradients, so the replicas' mean after one step
    is data parallelism's step (dropout on: each example keeps its row of the global batch);
    fsdp inside each replica."""
    run = [
        "train.steps=12",
        "optimizer.name=momentum",
        "optimizer.learning_rate=0.05",
        "model.dropout_rate=0.2",
        "mesh.data=4",
        "mesh.fsdp=2",
        *QUIET,
    ]
    plain = fit(make_config("mnist_mlp.yaml", *run, workdir=tmp_path / "dp"))
    outer = ["diloco.inner_steps=1", "diloco.outer_optimizer=sgd", "diloco.outer_learning_rate=1.0"]
    local = fit(make_config("mnist_mlp.yaml", *run, *DILOCO, *outer, workdir=tmp_path / "diloco"))
    steps = sorted(plain.losses)
    assert steps == list(range(1, 13)) and sorted(local.losses) == steps
    np.testing.assert_allclose([local.losses[s] for s in steps], [plain.losses[s] for s in steps], rtol=1e-6)
    np.testing.assert_allclose(local.eval_metrics["loss"], plain.eval_metrics["loss"], rtol=1e-6)
    record = [r for r in read_records(tmp_path / "diloco" / "metrics.jsonl") if r["split"] == "train"][-1]
    assert record["outer_step"] == 12 and record["drift"] > 0
    assert record["exchanged_bytes_per_step"] == 4 * 9610  # the MLP's parameters in float32, every step (H = 1)


def test_the_inner_step_moves_nothing_between_replicas_and_the_outer_step_the_parameters(make_config):
    cfg = make_config("mnist_mlp.yaml", *DILOCO, "diloco.inner_steps=8", "mesh.data=4", "mesh.fsdp=2")
    run = build_run(cfg)
    assert run.mesh.shape["replica"] == 4
    inner = hlo.program_collectives(run.compiled.program.as_text(), run.mesh.size)
    assert inner and all(c.groups is not None for c in inner)  # fsdp inside each replica: some collectives
    assert hlo.crossing(inner, run.mesh, "replica") == []
    outer = hlo.program_collectives(run.compiled.sync.program.as_text(), run.mesh.size)
    crossing = hlo.crossing(outer, run.mesh, "replica")
    assert [c.op for c in crossing] == ["all-reduce"]
    shard = per_device_bytes(run.abstract_state.momentum)  # a device's share of the parameters, float32
    assert shard <= crossing[0].bytes <= shard + 64  # (+ the drift's and the norm's partial sums)


def test_the_default_job_with_four_replicas_reaches_95_percent(make_config, tmp_path):
    """configs/mnist_mlp.yaml as shipped (Adam inside, 1500 steps), 4 replicas exchanging every
    10 steps with the default outer Nesterov."""
    cfg = make_config(
        "mnist_mlp.yaml",
        *DILOCO,
        "diloco.inner_steps=10",
        "mesh.data=4",
        "mesh.num_devices=4",
        "train.steps_per_call=10",
    )
    result = fit(cfg)
    assert result.eval_metrics["accuracy"] >= 0.95, result.eval_metrics


def test_collectives_in_a_scanned_loop_count_once_per_layer_on_cpu(make_config):
    """XLA:CPU's loop conditions are not `i < constant`: the trip count comes from the loop's
    known_trip_count. Data parallelism's gradient all-reduce covers every parameter once per step."""
    cfg = make_config(
        "llama_tiny.yaml",
        "data.name=synthetic_text",
        "data.vocab_size=64",
        "data.seq_len=16",
        "mesh.data=2",
        "mesh.num_devices=2",
    )
    run = build_run(cfg)
    found = hlo.program_collectives(run.compiled.program.as_text(), run.mesh.size)
    reduced = sum(c.bytes * c.count for c in found if c.op == "all-reduce")
    params = per_device_bytes(run.abstract_state.params)  # float32, replicated: the whole model
    assert params <= reduced <= params + 64  # (+ the loss's and the norm's partial sums)
