"""Helpers of the GRPO run tests (tests/integration/test_grpo_run.py, tests/e2e/test_grpo_resume.py):
a model directory with a chat template, a few prompts, reward functions in a file, and the
overrides of a tiny Llama GRPO run with LoRA adapters on them."""

from support.chat_data import write_jsonl, write_model_dir

PROMPTS = ["hello there", "the cat sat", "how are you", "be brief"]
REWARDS = """import os


def even_ids(prompts, completions, completion_ids, **fields):
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def broken(prompts, completions, **fields):
    raise ValueError("no answer field")


def broken_later(prompts, completions, completion_ids, **fields):
    if os.path.exists(os.path.join(os.path.dirname(__file__), "break")):
        raise ValueError("no answer field")
    return even_ids(prompts, completions, completion_ids)
"""


def write_files(directory):
    """(model directory, train prompts, held-out prompts, reward functions' file) in `directory`."""
    (directory / "model").mkdir()
    model = write_model_dir(directory / "model")
    train = write_jsonl(directory / "train.jsonl", [{"prompt": p} for p in PROMPTS])
    held = write_jsonl(directory / "held.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    rewards = directory / "rewards.py"
    rewards.write_text(REWARDS)
    return model, train, held, rewards


def overrides(files, steps: int, reward: str = "even_ids") -> list[str]:
    """A tiny Llama with LoRA adapters trained by GRPO on the files' prompts (4 prompts x 4 completions
    of 4 tokens a step), a record each step, no eval, no checkpoints unless asked."""
    model, train, held, rewards = files
    return [
        "mesh.num_devices=1",
        "model.name=llama",
        "model.num_layers=1",
        "model.d_model=32",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.mlp_dim=48",
        "data.name=prompts",
        f"data.path={train}",
        f"data.eval_path={held}",
        f"data.tokenizer={model}",
        "train.objective=grpo",
        f"train.steps={steps}",
        "train.global_batch_size=4",
        "grpo.num_generations=4",
        "grpo.max_prompt_tokens=16",
        "grpo.max_completion_tokens=4",
        f"grpo.rewards=[{rewards}:{reward}]",
        "finetune.lora.rank=4",
        "finetune.lora.targets=[all]",
        "optimizer.learning_rate=0.03",
        "optimizer.warmup_steps=0",
        "log.every_steps=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
    ]
