"""train.objective=grpo driven by the run (engine/objectives/grpo_driver.py, run/single.py Sampled):
a tiny Llama with LoRA adapters samples completions of a few chat prompts, a reward it can learn
(the share of even token ids in a completion) rises over a few dozen steps, the records carry
TRL's metrics and the host's (rewards/<fn>/mean, seconds sampling and updating); a reward
function that raises stops the run in one line naming it and the prompt; other layouts refused."""

import json

import pytest
from support.chat_data import write_jsonl, write_model_dir

from engine.errors import UsageError
from engine.run.single import fit

PROMPTS = ["hello there", "the cat sat", "how are you", "be brief"]
STEPS = 40


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("grpo")
    (directory / "model").mkdir()
    model = write_model_dir(directory / "model")
    train = write_jsonl(directory / "train.jsonl", [{"prompt": p} for p in PROMPTS])
    held = write_jsonl(directory / "held.jsonl", [{"prompt": p} for p in PROMPTS[:2]])
    rewards = directory / "rewards.py"
    rewards.write_text(
        "def even_ids(prompts, completions, completion_ids, **fields):\n"
        "    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]\n\n"
        "def broken(prompts, completions, **fields):\n"
        "    raise ValueError('no answer field')\n"
    )
    return model, train, held, rewards


def grpo_config(make_config, files, *overrides, reward="even_ids", tmp_path=None):
    model, train, held, rewards = files
    return make_config(
        "mnist_mlp.yaml",
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
        f"train.steps={STEPS}",
        "train.global_batch_size=4",
        "grpo.num_generations=4",
        "grpo.max_prompt_tokens=16",
        "grpo.max_completion_tokens=4",
        f"grpo.rewards=[{rewards}:{reward}]",
        "finetune.lora.rank=4",
        "optimizer.learning_rate=0.03",
        "finetune.lora.targets=[all]",
        "optimizer.warmup_steps=0",
        "log.every_steps=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
        *overrides,
    )


def records(workdir, split="train"):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == split]


def test_lora_grpo_raises_a_learnable_reward(make_config, files, tmp_path):
    cfg = grpo_config(make_config, files, f"eval.every_steps={STEPS}")
    fit(cfg)
    train = records(tmp_path / "run")
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    rewards = [r["reward"] for r in train]
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.1, (first, last)  # (optimizer.learning_rate=1e-9: +0.02)
    assert "rewards/even_ids/mean" in train[0], sorted(train[0])
    for key in ("reward_std", "frac_reward_zero_std", "completions/mean_length", "kl", "clip_ratio/region_mean"):
        assert key in train[0], key
    assert train[0]["seconds/sampling"] > 0 and train[0]["seconds/updating"] > 0
    (evaluated,) = records(tmp_path / "run", "eval")
    assert 0.0 <= evaluated["reward"] <= 1.0


def test_a_raising_reward_function_stops_the_run_naming_it(make_config, files):
    cfg = grpo_config(make_config, files, "train.steps=2", reward="broken")
    with pytest.raises(UsageError) as caught:
        fit(cfg)
    message = str(caught.value)
    assert "broken" in message and "no answer field" in message


def test_a_context_layout_is_refused(make_config, files):
    cfg = grpo_config(make_config, files, "train.steps=1", "mesh.num_devices=2", "mesh.data=1", "mesh.context=2")
    with pytest.raises(UsageError) as caught:
        fit(cfg)
    assert "mesh.context=2" in str(caught.value) and "mesh.data, mesh.fsdp or mesh.tensor" in str(caught.value)


@pytest.mark.parametrize("axis", ["fsdp"])
def test_a_two_device_layout_trains(make_config, files, tmp_path, axis):
    cfg = grpo_config(
        make_config, files, "train.steps=2", "mesh.num_devices=2", "mesh.data=1", f"mesh.{axis}=2", "eval.every_steps=2"
    )
    fit(cfg)
    train = records(tmp_path / "run")
    assert [r["step"] for r in train] == [1, 2] and all(0.0 <= r["reward"] <= 1.0 for r in train)
    assert records(tmp_path / "run", "eval")[0]["reward"] >= 0.0
