"""What only a GPU runs: cuDNN's fused attention against XLA's, and bfloat16 training through
the CLI with its MFU. Skipped without a GPU; on one: ENGINE_TEST_GPU=1 python -m pytest tests/integration/test_gpu.py"""

import json

import jax
import pytest
from support.cli import run_cli

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (ENGINE_TEST_GPU=1 on a machine with one)"),
]


def test_llama_trains_in_bfloat16_with_mfu(tmp_path):
    """The Llama config trains on the GPU in bf16 (cuDNN attention): the loss falls, MFU is counted."""
    workdir = tmp_path / "run"
    result = run_cli(
        "--config",
        "configs/llama_tiny.yaml",
        "--workdir",
        str(workdir),
        "train.steps=60",
        "log.every_steps=20",
        "log.progress=false",
        "train.compute_dtype=bfloat16",
        timeout=900,
    )  # not the tests' 8 CPU devices, -O0
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stdout[-2000:])
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert train[-1]["loss"] < train[0]["loss"]
    summary = next(r for r in records if r.get("split") == "summary")
    assert summary["mfu"] > 0 and "no peak known" not in summary["peak_source"], summary
