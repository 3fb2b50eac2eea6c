"""DiLoCo's wrong settings (train.sync=diloco, diloco.delay) exit 2 by key, from the command line in
this process (engine/cli: as launch.py runs it; tests/e2e/test_diloco_e2e.py and
test_diloco_delay_e2e.py keep one each through launch.py in a subprocess)."""

import pytest

from engine.cli import main


@pytest.mark.parametrize(
    "args, expected",
    [
        (["train.sync=diloco", "diloco.replica_axis=data", "mesh.data=1"], "needs mesh.data > 1"),
        (["train.sync=diloco", "mesh.dcn_data=2", "mesh.backend=pmap"], "does not run with mesh.backend=pmap"),
        (["train.sync=diloco", "mesh.dcn_data=2", "diloco.outer_momentum=1.0"], "must be in [0, 1)"),
        (["train.sync=diloco", "diloco.replica_axis=slices"], "diloco.replica_axis"),
        (["train.sync=diloco", "mesh.dcn_data=2", "diloco.delay=2"], "diloco.delay=2 is not one of 0, 1"),
    ],
    ids=["data-1", "pmap", "momentum", "axis", "delay-2"],
)
def test_diloco_mistakes_exit_2_by_key(tmp_path, capsys, args, expected):
    code = main(["--config", "configs/mnist_mlp.yaml", "--workdir", str(tmp_path / "w"), "--dry-run", *args])
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err, err
    assert not (tmp_path / "w").exists()
