"""Long contexts and mixtures of experts on 8 simulated devices: the sequence split over
`mesh.context` and the experts over `mesh.expert` give the one-device losses and weights of
the same run; a context split holds a fraction of the activations, an expert split a
fraction of the experts; MoE metrics reach metrics.jsonl; wrong settings exit 2 by name."""

import dataclasses

import pytest
from support.cli import run_cli
from support.context_experts import LLAMA, MOE

from engine.data import DataInfo
from engine.run.single import fit
from engine.runtime.rundir import read_records
from models.llama import LlamaConfig, flops_per_example


@pytest.mark.slow
def test_moe_metrics_are_logged_and_dropless_drops_nothing(make_config, tmp_path, capsys):
    common = [*LLAMA, *MOE, "train.steps=4", "log.every_steps=2", "eval.every_steps=0", "checkpoint.every_steps=0"]
    fit(
        make_config(
            "llama_tiny", *common, "mesh.num_devices=1", "model.expert_capacity_factor=0.5", workdir=tmp_path / "0.5"
        )
    )
    warned = [line for line in capsys.readouterr().out.splitlines() if "warning: the experts dropped" in line]
    assert len(warned) == 1 and "model.expert_capacity_factor" in warned[0], warned  # said once, not per log line
    # the dropless run split over context and experts: its readers (export) run on one device
    fit(
        make_config(
            "llama_tiny",
            *common,
            "mesh.data=2",
            "mesh.expert=2",
            "mesh.context=2",
            "model.expert_capacity_factor=0",
            workdir=tmp_path / "0",
        )
    )
    tight, dropless = (
        [r for r in read_records(tmp_path / f / "metrics.jsonl") if r["split"] == "train"] for f in ("0.5", "0")
    )
    for record in tight + dropless:
        assert 0.01 * 0.5 < record["moe_aux_loss"] < 0.01 * 8  # coef x E * sum(f * P): 1 when balanced, 8 at worst
    assert all(r["moe_dropped_fraction"] > 0.3 for r in tight)  # half the room of a balanced routing
    assert all(r["moe_dropped_tokens"] == 0 for r in dropless)
    assert "warning: the experts dropped" not in capsys.readouterr().out
    proc = run_cli("export", "--workdir", str(tmp_path / "0"), "--out", str(tmp_path / "exported"))
    assert proc.returncode == 0 and (tmp_path / "exported").exists(), proc.stderr
    # no Hugging Face layout for experts: refused before anything is written
    proc = run_cli("export", "--workdir", str(tmp_path / "0"), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert proc.returncode == 2 and "model.num_experts=8: a mixture-of-experts model" in proc.stderr, proc.stderr
    assert not (tmp_path / "hf").exists()
    summary = next(r for r in read_records(tmp_path / "0" / "metrics.jsonl") if r["split"] == "summary")
    assert "active experts only" in summary["flops_source"]
    assert summary["flops_per_device_step"] == summary["analytic_flops_per_device_step"]
    # the formula counts 2 of 8 experts (3 x 32 x 48 weights each) and the router (32 x 8)
    # per layer where a dense model counts its MLP (3 x 32 x 48)
    dense = LlamaConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=48)
    moe = dataclasses.replace(dense, num_experts=8, experts_per_token=2)
    info = DataInfo("tokens", 8, 8, vocab_size=64, seq_len=16)
    added = 2 * (8 * 3 * 32 * 48 + 32 * 8 - 3 * 32 * 48)  # parameters the two MoE layers add
    extra = flops_per_example(moe, info, 10_000 + added) - flops_per_example(dense, info, 10_000)
    assert extra == pytest.approx(6 * 16 * 2 * (2 * 3 * 32 * 48 + 32 * 8 - 3 * 32 * 48), rel=1e-12)


@pytest.mark.slow
def test_cli_refuses_a_context_split_that_does_not_divide_with_exit_2(tmp_path):
    proc = run_cli(
        "--config",
        "configs/llama_tiny.yaml",
        "--workdir",
        str(tmp_path / "w"),
        "mesh.context=3",
        "mesh.data=1",
        "mesh.num_devices=3",
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=3"},
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "data.seq_len=128 is not divisible by mesh.context=3" in proc.stderr
    assert not (tmp_path / "w" / "checkpoints").exists()
