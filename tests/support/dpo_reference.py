"""Helpers of tests/**/test_dpo_reference*.py that other test files (or its other tiers) share."""

from support.chat_data import write_jsonl, write_model_dir
from support.configs import QUIET, ROOT


def cli_args(tmp_path, workdir, *extra):
    model = tmp_path / "model"
    if not model.exists():
        model.mkdir()
        write_model_dir(model)
    prompts = ["the cat sat", "hello there", "on the mat", "be brief"]
    records = [{"prompt": f"{prompts[i % 4]} {i}", "chosen": "hello", "rejected": "the mat"} for i in range(20)]
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    return [
        "train", "--config", str(ROOT / "configs" / "mnist_mlp.yaml"), "model.name=llama", "model.num_layers=2",
        "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_dim=48", f"data.path={path}",
        "data.eval_fraction=0.2", f"data.tokenizer={model}", "data.seq_len=24", "train.global_batch_size=4",
        "optimizer.learning_rate=0.01", "log.every_steps=1", "eval.every_steps=2", "checkpoint.every_steps=2",
        "data.name=preferences", "train.objective=dpo", *QUIET, "--workdir", str(workdir), *extra,
    ]  # fmt: skip
