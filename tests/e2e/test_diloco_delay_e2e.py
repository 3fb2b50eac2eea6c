"""DiLoCo's overlapped outer step (diloco.delay=1): the engine's rounds equal a hand-written
loop of the one-round-stale update (replicas restart from the global parameters each round,
the outer optimizer applies the previous round's mean change); the pending change is in the
checkpoints (a run resumed mid-round continues exactly); delay=1 without DiLoCo exits 2."""

import pytest
from support.cli import run_cli


@pytest.mark.parametrize(
    "args, expected",
    [
        (["diloco.delay=1"], "diloco.delay=1 delays DiLoCo's outer step, but train.sync=every_step; set train.sync"),
    ],
    ids=["no-diloco"],  # (diloco.delay=2, in this process: tests/unit/test_diloco_cli_unit.py)
)
def test_delay_mistakes_exit_2_by_key(tmp_path, args, expected):
    proc = run_cli("--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "w"), "--dry-run", *args)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
