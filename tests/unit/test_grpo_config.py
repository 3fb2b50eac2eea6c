"""The `grpo` section (engine/config/grpo_section.py): its keys' types, ranges and choices, and its
checks against train.objective and data.name, each refused with one message naming the key and
the fix (UsageError, exit 2). Compiles nothing."""

import dataclasses
from types import SimpleNamespace

import pytest
import yaml

from engine.config import load_config
from engine.config.grpo_section import check_grpo
from engine.errors import UsageError

CHAT = ["data.name=chat", "data.path=x.jsonl", "data.tokenizer=x"]


def refused(*overrides: str) -> str:
    with pytest.raises(UsageError) as caught:
        load_config("configs/chat_sft.yaml", list(overrides))
    return str(caught.value)


def test_defaults_are_trls():
    cfg = load_config("configs/chat_sft.yaml", [])
    grpo = cfg.grpo
    assert (grpo.num_generations, grpo.temperature, grpo.top_p, grpo.top_k) == (8, 1.0, 1.0, 0)
    assert (grpo.scale_rewards, grpo.loss_type, grpo.epsilon, grpo.epsilon_high) == ("group", "dapo", 0.2, None)
    assert (grpo.beta, grpo.num_iterations, grpo.reward_weights, grpo.rewards) == (0.0, 1, None, [])


@pytest.mark.parametrize(
    "override, named",
    [
        ("grpo.num_generations=1", "grpo.num_generations=1 must be 2 or more"),
        ("grpo.temperature=0", "grpo.temperature=0.0 must be more than 0.0"),
        ("grpo.top_k=-1", "grpo.top_k=-1 must be 0 or more"),
        ("grpo.loss_type=ppo", "grpo.loss_type='ppo' is not one of grpo, bnpo, dr_grpo, dapo"),
        ("grpo.scale_rewards=True", "grpo.scale_rewards='True' is not one of group, batch, none"),
        ("grpo.num_iterations=zero", "grpo.num_iterations"),
        ("grpo.reward_weights=[a]", "grpo.reward_weights"),
    ],
)
def test_a_bad_key_is_named(override, named):
    assert named in refused(override)


def test_the_section_is_refused_without_the_grpo_objective():
    message = refused("grpo.beta=0.1")
    assert "grpo.beta=0.1 set with train.objective=lm" in message and "train.objective=grpo" in message


def test_grpo_wants_prompts_and_prompts_want_grpo():
    message = refused("train.objective=grpo", "grpo.rewards=[engine.lm.rewards:exact_match]", *CHAT)
    assert "train.objective=grpo" in message and "data.name=chat" in message and "set data.name=prompts" in message


def grpo_refused(*overrides: str) -> str:
    """check_grpo's message for a grpo run on data.name=prompts: the grpo.* overrides make its section,
    the others are loaded with an lm run (these checks read no key of the prompts' data section)."""
    ours = dict(o.split("=", 1) for o in overrides if o.startswith("grpo."))
    lm = load_config("configs/chat_sft.yaml", [o for o in overrides if not o.startswith("grpo.")])
    grpo = dataclasses.replace(lm.grpo, **{key[5:]: yaml.safe_load(value) for key, value in ours.items()})
    train = dataclasses.replace(lm.train, objective="grpo")
    run = dataclasses.replace(lm, train=train, grpo=grpo, data=SimpleNamespace(name="prompts"))
    with pytest.raises(UsageError) as caught:
        check_grpo(run)
    return str(caught.value)


@pytest.mark.parametrize(
    "overrides, named",
    [
        ([], "train.objective=grpo needs a reward: set grpo.rewards"),
        (["grpo.rewards=[exact_match]"], "grpo.rewards: 'exact_match' is not module:function"),
        (
            ["grpo.rewards=[a:f,b:g]", "grpo.reward_weights=[1.0]"],
            "grpo.reward_weights=[1.0] has 1 weight(s) for 2 reward function(s)",
        ),
        (["grpo.rewards=[a:f]", "grpo.top_p=1.5"], "grpo.top_p=1.5 must be in (0, 1]"),
        (["grpo.rewards=[a:f]", "grpo.epsilon_high=0"], "grpo.epsilon_high=0 must be more than 0"),
        (["grpo.rewards=[a:f]", "finetune.lora.dropout=0.1"], "finetune.lora.dropout=0.1 has no effect"),
        (["grpo.rewards=[a:f]", "mesh.pipeline=2"], "does not run with mesh.pipeline=2 yet"),
        (
            ["grpo.rewards=[a:f]", "grpo.num_iterations=2", "checkpoint.every_steps=5"],
            "checkpoint.every_steps=5 is not a multiple of grpo.num_iterations=2",
        ),
    ],
)
def test_the_sections_checks(overrides, named):
    assert named in grpo_refused(*overrides)
