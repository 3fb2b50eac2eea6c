"""DiLoCo (train.sync=diloco): one inner step with an outer SGD of rate 1 is data parallelism;
the inner step moves nothing between replicas and the outer step only the parameters; a run
killed mid-round resumes bit-identically; the default job converges with 4 replicas; two
processes holding one replica each equal one process holding both; wrong settings exit 2."""

import json
import time

import numpy as np
import pytest

from conftest import run_cli, start_cli
from engine.parallel.sharding import per_device_bytes
from engine.plan import hlo
from engine.run.setup import build_run
from engine.run.single import fit
from engine.runtime.rundir import read_records

DILOCO = ["train.sync=diloco", "diloco.replica_axis=data"]
QUIET = ["log.every_steps=1", "eval.every_steps=0", "log.progress=false"]


def losses(workdir):
    return [(r["step"], r["loss"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]


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


def _last_step(workdir) -> int:
    return losses(workdir)[-1][0] if (workdir / "metrics.jsonl").exists() and losses(workdir) else 0


def _start(workdir, *extra):
    args = ["--config", "configs/mnist_mlp.yaml", "--workdir", str(workdir), *RESUMED, *extra]
    return start_cli(*args, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"})


# checkpoints every 5 steps, rounds of 6: most saves fall mid-round
RESUMED = [
    *DILOCO,
    *QUIET,
    "mesh.data=4",
    "train.steps=60",
    "diloco.inner_steps=6",
    "checkpoint.every_steps=5",
    "checkpoint.keep=20",
    "train.compilation_cache_dir=''",
]


@pytest.mark.slow
def test_a_run_killed_mid_round_resumes_bit_identically(tmp_path):
    whole = _start(tmp_path / "whole")
    assert whole.wait(timeout=300) == 0, whole.communicate()[1][-3000:]
    killed = _start(tmp_path / "killed")
    deadline = time.time() + 240
    while _last_step(tmp_path / "killed") < 33:
        assert killed.poll() is None and time.time() < deadline, killed.communicate()[1][-3000:]
        time.sleep(0.05)
    killed.kill()
    killed.wait()
    assert losses(tmp_path / "killed")[-1][0] < 60  # it really was cut short
    again = _start(tmp_path / "killed")
    assert again.wait(timeout=300) == 0, again.communicate()[1][-3000:]
    assert losses(tmp_path / "killed") == losses(tmp_path / "whole")  # bit-identical
    last = [json.loads(line) for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert [r["outer_step"] for r in last if r["split"] == "train"][-1] == 10


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


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_holding_one_replica_each_equal_one_process_holding_both(tmp_path):
    common = [
        "--config",
        "configs/mnist_mlp.yaml",
        "train.steps=12",
        "train.sync=diloco",
        "diloco.inner_steps=4",
        "mesh.data=2",
        "mesh.fsdp=2",
        *QUIET,
    ]
    two = run_cli(
        *common,
        "--workdir",
        str(tmp_path / "two"),
        "--local-processes",
        "2",
        "--devices-per-process",
        "2",
        "mesh.dcn_data=2",
        "diloco.replica_axis=dcn_data",
        timeout=400,
    )
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    one = run_cli(
        *common,
        "--workdir",
        str(tmp_path / "one"),
        "diloco.replica_axis=data",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        timeout=400,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert "DiLoCo: 2 replicas, each 4 steps alone per round" in one.stdout  # said at the start
    assert "outer_step=" in one.stdout and "drift=" in one.stdout  # and on the console's train lines
    a, b = dict(losses(tmp_path / "two")), dict(losses(tmp_path / "one"))
    assert sorted(a) == list(range(1, 13)) == sorted(b)
    np.testing.assert_allclose([a[s] for s in sorted(a)], [b[s] for s in sorted(a)], rtol=1e-5)


@pytest.mark.parametrize(
    "args, expected",
    [
        (["train.sync=diloco"], "needs mesh.dcn_data > 1 (the replicas), but it is 1"),
        (["train.sync=diloco", "diloco.replica_axis=data", "mesh.data=1"], "needs mesh.data > 1"),
        (["train.sync=diloco", "mesh.dcn_data=2", "mesh.backend=pmap"], "does not run with mesh.backend=pmap"),
        (["train.sync=diloco", "mesh.dcn_data=2", "diloco.outer_momentum=1.0"], "must be in [0, 1)"),
        (["train.sync=diloco", "diloco.replica_axis=slices"], "diloco.replica_axis"),
    ],
    ids=["no-replicas", "data-1", "pmap", "momentum", "axis"],
)
def test_diloco_mistakes_exit_2_by_key(tmp_path, args, expected):
    proc = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "w"), "--dry-run", *args)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "w").exists()


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
