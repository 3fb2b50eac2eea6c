"""The ragged dispatch of a mixture of experts (model.moe_dispatch=ragged): the losses and
gradients of the one-hot dispatch when that drops nothing, on one device and with the experts
split over mesh.expert; nothing dropped where one-hot drops a skewed routing's excess, and a
bounded all-to-all buffer's overflow counted; generation with the cache."""

from support.cli import run_cli


def test_an_unknown_dispatch_exits_2_naming_the_choices(tmp_path):
    proc = run_cli(
        "--config",
        "configs/llama_tiny.yaml",
        "--workdir",
        str(tmp_path / "w"),
        "model.num_experts=4",
        "model.moe_dispatch=sorted",
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "model.moe_dispatch='sorted' is not one of onehot, ragged" in proc.stderr
