"""The DPO objective (engine/objectives/dpo_part.py, engine/config/dpo_objective.py): TRL's losses,
the reference under LoRA and full fine-tuning, response-only sequence log-probabilities, the
metrics' flow, and its config checks."""

import json
import math
import re

import pytest
from support.chat_data import write_jsonl, write_model_dir
from support.cli import child_env
from support.configs import QUIET, ROOT
from support.one_process import run_steps

TRL_NAMES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")


def test_dpo_runs_end_to_end_with_trls_metrics(tmp_path):
    """launch.py train with train.objective=dpo on data.name=preferences (LoRA): TRL's metrics in
    metrics.jsonl for train and eval, on the console; the objective and the data must agree (exit 2)."""
    model = tmp_path / "model"
    model.mkdir()
    write_model_dir(model)
    prompts = ["the cat sat", "hello there", "on the mat", "be brief"] * 4
    pairs_ = [{"prompt": p, "chosen": "hello", "rejected": "the mat"} for p in prompts]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs_)
    args = [
        "train", "--config", str(ROOT / "configs" / "mnist_mlp.yaml"), "model.name=llama", "model.num_layers=2",
        "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_dim=48", f"data.path={path}",
        "data.eval_fraction=0.25", f"data.tokenizer={model}", "data.seq_len=24", "train.global_batch_size=4",
        "finetune.lora.rank=4", "optimizer.learning_rate=0.01", "train.steps=4", "log.every_steps=2", *QUIET,
        "--workdir", str(tmp_path / "work"),
    ]  # fmt: skip
    proc, refused = run_steps(  # (through the CLI's main in one process: tests/support/one_process.py)
        tmp_path,
        [{"argv": [*args, "data.name=preferences", "train.objective=dpo"]}, {"argv": [*args, "data.name=preferences"]}],
        env=child_env({"HOME": str(tmp_path)}),
    )  # (the second: train.objective=lm)
    assert proc["code"] == 0 and not proc["escaped"], proc["escaped"] or proc["stderr"]
    records = [json.loads(line) for line in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert [r["split"] for r in records if "loss" in r] == ["train", "train", "eval"]
    for record in (r for r in records if "loss" in r):
        assert all(math.isfinite(record[name]) for name in (*TRL_NAMES, "logps/rejected"))
        assert record["rewards/margins"] == pytest.approx(record["rewards/chosen"] - record["rewards/rejected"])
    assert re.search(r"step 2 train: loss=\S+ .*rewards/accuracies=", proc["stdout"]), proc["stdout"]
    assert refused["code"] == 2 and not refused["escaped"], refused["escaped"] or refused["stderr"]
    assert "set train.objective=dpo" in refused["stderr"], refused["stderr"]
