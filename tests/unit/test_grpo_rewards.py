"""GRPO's reward functions (engine/lm/rewards.py, issue 55): the shipped exact match and format
rewards, and a batch scored as TRL's GRPOTrainer calls reward functions (each prompt's fields
repeated for its completions, message lists in the conversational format, None left out as NaN),
with TRL's own documented reward functions unchanged; a function that raises or answers wrongly
is a UsageError naming it and the prompt. Compiles nothing."""

import re

import numpy as np
import pytest

from engine.errors import UsageError
from engine.lm.rewards import (
    RewardFunction,
    exact_match,
    extracted_answer,
    format_match,
    format_reward,
    grpo_rewards,
)


# TRL's documentation's reward functions (docs/source/grpo_trainer.md, "Using a custom reward
# function"), copied unchanged
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward_func(completions, **kwargs):
    """Reward function that checks if the completion has a specific format."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    completion_contents = [completion[0]["content"] for completion in completions]
    matches = [re.match(pattern, content) for content in completion_contents]
    return [1.0 if match else 0.0 for match in matches]


def reward_func(completions, ground_truth, **kwargs):
    # Regular expression to capture content inside \boxed{}
    matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
    contents = [match.group(1) if match else "" for match in matches]
    # Reward 1 if the content is the same as the ground truth, 0 otherwise
    return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]


def reward(function) -> RewardFunction:
    return RewardFunction(f"tests:{function.__name__}", function.__name__, function)


def test_exact_match_reads_the_answer_tag_or_the_text():
    assert extracted_answer("think first <answer> 1  2 3 </answer>") == "1 2 3"
    assert extracted_answer("<answer>1</answer> no, <answer>2</answer>") == "2"
    assert extracted_answer(" 1 2\n3 ") == "1 2 3"
    completions = ["<answer>1 2 3</answer>", "1 2 3", "1 2", [{"role": "assistant", "content": "7"}], "x"]
    assert exact_match([""] * 5, completions, answer=["1 2 3", "1  2 3", "2 1", 7, None]) == [1.0, 1.0, 0.0, 1.0, None]
    with pytest.raises(ValueError, match='records have none; add "answer"'):
        exact_match(["p"], ["c"])


def test_format_rewards_match_the_whole_completion():
    completions = ["<answer>1</answer>", "<think>hm</think>\n<answer>1</answer>", "1 <answer>1</answer>", "1"]
    assert format_match(completions=completions) == [1.0, 1.0, 0.0, 0.0]
    boxed = format_reward(r".*\\boxed\{.+\}", "boxed")
    assert boxed.__name__ == "boxed" and boxed(completions=["so \\boxed{4}", "4"]) == [1.0, 0.0]


def test_a_batch_is_scored_as_trl_calls_the_functions():
    seen = {}

    def spy(prompts, completions, completion_ids, **fields):
        seen.update(prompts=prompts, completions=completions, ids=completion_ids, fields=fields)
        return [None if f is None else 1.0 for f in fields["level"]]

    messages = [{"role": "user", "content": "sort: 2 1"}]
    prompts, fields = ["sort: 3 1 2", messages], [{"answer": "1 2 3", "level": 1}, {"answer": "1 2"}]
    texts = ["<answer>1 2 3</answer>", "3 2 1", "1 2", "<answer>1 2</answer>"]
    scores = grpo_rewards(
        [reward(spy), reward(exact_match), reward(format_match)], prompts, fields, texts, [[1], [2], [3], [4]], 2
    )
    assert seen["prompts"] == ["sort: 3 1 2", "sort: 3 1 2", messages, messages]
    assert seen["completions"][:2] == texts[:2]  # a string prompt's completions are strings
    assert seen["completions"][2] == [{"role": "assistant", "content": "1 2"}]  # a conversation's, messages
    assert seen["fields"] == {"answer": ["1 2 3", "1 2 3", "1 2", "1 2"], "level": [1, 1, None, None]}
    assert seen["ids"] == [[1], [2], [3], [4]]
    expected = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [np.nan, 1.0, 0.0], [np.nan, 1.0, 1.0]]
    np.testing.assert_array_equal(scores, np.array(expected))


def test_trls_documented_reward_functions_work_unchanged():
    texts = ["<think>a</think><answer>b</answer>", "\\boxed{4} in twenty chars", "no", "\\boxed{5}"]
    scores = grpo_rewards(
        [reward(reward_len), reward(reward_func)], ["p", "q"], [{"ground_truth": "4"}] * 2, texts, [[0]] * 4, 2
    )
    np.testing.assert_array_equal(scores[:, 0], [-abs(20 - len(t)) for t in texts])
    np.testing.assert_array_equal(scores[:, 1], [0.0, 1.0, 0.0, 0.0])
    conversation = [[{"role": "user", "content": "hi"}]]
    scores = grpo_rewards([reward(format_reward_func)], conversation, [{}], texts[:2], [[0]] * 2, 2)
    np.testing.assert_array_equal(scores[:, 0], [1.0, 0.0])


def test_a_function_that_fails_is_named_with_the_prompt():
    def picky(completions, **fields):
        if any(c == "boom" for c in completions):
            raise KeyError("answer")
        return [1.0] * len(completions)

    def short(completions, **fields):
        return [1.0]

    def nan(completions, **fields):
        return [0.0, float("nan")] * (len(completions) // 2)

    args = (["first prompt", "second prompt"], [{}, {}], ["a", "b", "boom", "c"], [[0]] * 4, 2)
    with pytest.raises(UsageError) as caught:
        grpo_rewards([reward(picky)], *args)
    message = str(caught.value)
    assert message.startswith("grpo.rewards: reward function tests:picky raised KeyError: 'answer'")
    assert "(completion 2, prompt 'second prompt')" in message
    with pytest.raises(UsageError, match="tests:short returned 1 values for 4 completions"):
        grpo_rewards([reward(short)], *args)
    with pytest.raises(UsageError, match=r"tests:nan returned nan for completion 1 \(prompt 'first prompt'\)"):
        grpo_rewards([reward(nan)], *args)
