"""`launch.py plan`: runs compiled for TPU pods by the TPU compiler (libtpu) on this CPU host.
The figures come from the compiled programs; the tests check them against what the sharded
state must hold, against the compiler's own refusal, and against the HLO's collectives."""

import pytest
from support.configs import ROOT
from support.plan import TINY

from engine.config import load_config
from engine.errors import UsageError
from engine.plan.tpu import Target, parse_target

pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) is not installed")


@pytest.fixture
def no_topology(monkeypatch):
    """Fails a test whose command has libtpu describe its target (the step before any mesh or compile)."""

    def described(target):
        raise AssertionError(f"{target.topology_name} was described")

    monkeypatch.setattr(Target, "devices", property(described))


def plan_in_process(capsys, *args) -> tuple[int, str]:
    """(exit code, stderr) of `launch.py plan --config llama_tiny ARGS` in this process."""
    from engine.cli import main

    code = main(["plan", "--config", "llama_tiny", *args])
    return code, capsys.readouterr().err


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "args, message",
    [
        (["--target", "v5p:512x512x512"], "134,217,728 chips in one slice, but the largest v5p slice is 8,960"),
        (["--target", "v5p:1024x1024x1024"], "1,073,741,824 chips in one slice"),
        (["--target", "v5e:1024x1024"], "the largest v5e slice is 256 chips (a whole pod); give at most that"),
        (["--target", "v4-16384"], "8,192 chips in one slice, but the largest v4 slice is 4,096"),
        (["--target", "v5p-" + "9" * 5000], "a number of 5000 digits is far more chips than any TPU slice"),
        (["--target", "v5e-256", "--slices", "300"], "76,800 chips, more than the 65,536 a plan takes"),
        (["--target", "v5e-256"], "global_batch_size=16 is not divisible by data*fsdp*expert=256*1*1=256"),
        (["--target", "v5e-8", "train.grad_accum_steps=4"], "(a micro-batch of 4 with train.grad_accum_steps=4)"),
        (
            ["--target", "v5e-8", "--slices", "2", "mesh.data=1"],
            "e.g. mesh.dcn_data=2 mesh.data=2",
        ),  # a hint that works
    ],
    ids=[
        "512-cubed",
        "1024-cubed",
        "v5e-1024-squared",
        "v4-past-its-pod",
        "digits",
        "slices",
        "batch",
        "micro",
        "hint",
    ],
)
def test_targets_past_the_largest_pod_or_the_batch_exit_2_before_the_topology(no_topology, capsys, args, message):
    """Refused from the numbers alone, at once: a topology of a billion chips took 21 GB and minutes."""
    code, err = plan_in_process(capsys, *args)
    assert code == 2, err
    assert message in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.nocompile
def test_a_json_path_that_cannot_be_written_exits_2_before_the_compile(no_topology, capsys, tmp_path):
    (tmp_path / "a-file").write_text("")
    cases = {
        str(tmp_path): "is a directory; give a file name",
        str(tmp_path / "missing" / "plan.json"): "missing is not an existing directory",
        str(tmp_path / "a-file" / "plan.json"): "a-file is not an existing directory",
    }
    for path, message in cases.items():
        code, err = plan_in_process(capsys, "--target", "v5e-8", "--json", path)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(AssertionError, match="v5e:2x4 was described"):  # what passes the checks goes on
        plan_in_process(capsys, "--target", "v5e-8", "--json", str(tmp_path / "plan.json"))


@pytest.mark.nocompile
def test_pod_names_count_cores_for_v4_and_v5p_and_chips_for_v5e_and_v6e():
    assert parse_target("v5p-128").topology_name == "v5p:4x4x4"
    assert parse_target("v4-32").topology_name == "v4:2x2x4"
    assert parse_target("v5e-256").topology_name == "v5e:16x16"
    assert parse_target("v6e-64").topology_name == "v6e:8x8"
    assert parse_target("v5p:4x4x8", 2).chips == 256
    with pytest.raises(UsageError, match="2 dimensions"):
        parse_target("v5e:2x2x2")


@pytest.mark.nocompile
def test_the_mfu_table_is_the_analytic_flops_at_the_chips_peak(make_config):
    cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", TINY, "/tmp/unused")
    from engine.plan.compiled import Planned

    planned = Planned(cfg, parse_target("v5p-8"), {}, {}, 0, flops_per_chip=459e12, tokens_per_step=4096)
    assert planned.step_seconds(0.5) == pytest.approx(2.0)  # 459 TFLOP at half of 459 TFLOP/s
