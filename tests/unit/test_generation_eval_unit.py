"""eval.generate (engine/run/generation_eval.py): a chat run's evals complete the held-out prompts
with the sampler `sample` uses and score them by exact match against a record's field and by
reward functions of TRL's signature (engine/lm/rewards.py); a reward function that raises, answers
with the wrong length or NaN stops the run with exit 2 naming it."""

import pytest
from support.generation_eval import REWARDS

from engine.errors import UsageError
from engine.lm.rewards import call_reward, load_reward, load_rewards


@pytest.mark.nocompile
def test_bad_reward_functions_are_usage_errors_naming_them(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    key = "eval.generate.rewards"
    prompts, completions = ["a", "b"], ["x", "y"]
    for name, said in (("nan", "returned nan for completion 0"), ("short", "returned 1 values for 2 completions")):
        reward = load_reward(f"{tmp_path / 'rewards.py'}:{name}", key)
        with pytest.raises(UsageError, match=f"reward function .*rewards.py:{name} {said}"):
            call_reward(reward, prompts, completions, [[1], [2]], {}, key)
    with pytest.raises(UsageError, match="rewards.py:broken raised KeyError: 'answer'"):
        call_reward(load_reward(f"{tmp_path / 'rewards.py'}:broken", key), prompts, completions, [[1], [2]], {}, key)
    for spec, said in (
        (f"{tmp_path / 'rewards.py'}:missing", "missing in .* does not exist"),
        (f"{tmp_path / 'none.py'}:length", "none.py does not exist"),
        ("no_such_module_here:f", "importing no_such_module_here .* failed"),
        ("length", "is not module:function"),
    ):
        with pytest.raises(UsageError, match=said):
            load_reward(spec, key)
    with pytest.raises(UsageError, match="two reward functions are named length"):
        load_rewards([f"{tmp_path / 'rewards.py'}:length", f"{tmp_path / 'rewards.py'}:length"], key)
