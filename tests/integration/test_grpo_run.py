"""train.objective=grpo driven by the run (engine/objectives/grpo_driver.py, run/single.py Sampled):
a tiny Llama with LoRA adapters samples completions of a few chat prompts, a reward it can learn
(the share of even token ids in a completion) rises over a few dozen steps, the records carry
TRL's metrics and the host's (rewards/<fn>/mean, seconds sampling and updating); a reward
function that raises stops the run in one line naming it and the prompt; other layouts refused."""

import json

import pytest
from support.grpo import overrides, write_files

from engine.cli import main
from engine.errors import UsageError
from engine.run.outputs import SIDECAR
from engine.run.single import fit

STEPS = 40


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return write_files(tmp_path_factory.mktemp("grpo"))


def grpo_config(make_config, files, *more, reward="even_ids"):
    return make_config("mnist_mlp.yaml", *overrides(files, STEPS, reward), *more)


def records(workdir, split="train"):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == split]


def test_lora_grpo_raises_a_learnable_reward(make_config, files, tmp_path):
    # (learning rate 0.02: +0.21 with XLA:CPU's fusion emitters and with its loop emitters alike; at 0.03
    # the rise depended on the emitters' rounding: it passed with one, +0.08 with the other)
    cfg = grpo_config(make_config, files, f"eval.every_steps={STEPS}", "optimizer.learning_rate=0.02")
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


@pytest.mark.parametrize("axis", ["fsdp"])  # (tensor=2 and data=2 pass too: kept out for the suite's time)
def test_a_two_device_layout_trains_and_launch_eval_scores_it_alike(make_config, files, tmp_path, axis):
    """Also `launch.py eval` of the run's checkpoint: the sidecar evaluator samples the eval prompts
    with the run's own keys, so its eval/reward is the run's own eval's of that step."""
    mesh = ["mesh.num_devices=2", "mesh.data=1", f"mesh.{axis}=2"]
    cfg = grpo_config(make_config, files, "train.steps=2", *mesh, "eval.every_steps=2", "checkpoint.every_steps=2")
    fit(cfg)
    train = records(tmp_path / "run")
    assert [r["step"] for r in train] == [1, 2] and all(0.0 <= r["reward"] <= 1.0 for r in train)
    (own,) = records(tmp_path / "run", "eval")
    assert own["step"] == 2 and 0.0 < own["reward"] < 1.0
    assert main(["eval", "--workdir", str(tmp_path / "run")]) == 0
    (sidecar,) = [r for r in records(tmp_path / "run", "eval") if r.get("source") == SIDECAR]
    assert sidecar["step"] == 2 and sidecar["reward"] == pytest.approx(own["reward"], rel=1e-6)


def test_num_iterations_reuse_a_batch_and_beta_measures_the_kl(make_config, files, tmp_path):
    """grpo.num_iterations=2: steps 1 and 2 update on one batch of rollouts (the same rewards), step 3
    samples anew; grpo.beta > 0 under LoRA: the KL to the base with the adapters off, 0 at the first
    update and not after it."""
    fit(grpo_config(make_config, files, "train.steps=4", "grpo.num_iterations=2", "grpo.beta=0.1"))
    train = records(tmp_path / "run")
    batch = [(r["reward"], r["reward_std"]) for r in train]
    assert batch[0] == batch[1] and batch[1] != batch[2] and batch[2] == batch[3]
    assert train[0]["kl"] == 0.0 and train[1]["kl"] > 0.0
    assert train[0]["seconds/sampling"] > 0 and "seconds/sampling" not in train[1]
