"""DiLoCo (train.sync=diloco): one inner step with an outer SGD of rate 1 is data parallelism;
the inner step moves nothing between replicas and the outer step only the parameters; a run
killed mid-round resumes bit-identically; the default job converges with 4 replicas; two
processes holding one replica each equal one process holding both; wrong settings exit 2."""

import json
import time

import numpy as np
import pytest
from support.cli import run_cli, start_cli
from support.diloco import DILOCO, QUIET

from engine.runtime.rundir import read_records


def losses(workdir):
    return [(r["step"], r["loss"]) for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]


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
    ],
    ids=["no-replicas"],  # (the others, in this process: tests/unit/test_diloco_cli_unit.py)
)
def test_diloco_mistakes_exit_2_by_key(tmp_path, args, expected):
    proc = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "w"), "--dry-run", *args)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "w").exists()
