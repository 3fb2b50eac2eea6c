"""eval.generate (engine/run/generation_eval.py): a chat run's evals complete the held-out prompts
with the sampler `sample` uses and score them by exact match against a record's field and by
reward functions of TRL's signature (engine/lm/rewards.py); a reward function that raises, answers
with the wrong length or NaN stops the run with exit 2 naming it."""

import json

import numpy as np
import pytest
from support.cli import run_cli
from support.configs import QUIET, ROOT
from support.generation_eval import REWARDS

from engine.checkpoint.store import restore_newest
from engine.config import load_config
from engine.data import chat_example
from engine.hub.generate import sample
from engine.lm.chat import chat_prompts
from engine.run.generation_eval import GenerationEval
from engine.run.setup import build_run
from engine.runtime.rundir import read_records

TINY = ["model.num_layers=1", "model.d_model=32", "model.mlp_dim=64", "train.steps=2", "train.steps_per_call=1"]


MAX_TOKENS = 6


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the example's directory, the reward functions' file, a 2-step chat_sft run evaluated with eval.generate)."""
    root = tmp_path_factory.mktemp("generate")
    assert chat_example.main([str(root / "example"), "--train", "60", "--eval", "12"]) == 0
    (root / "rewards.py").write_text(REWARDS)
    proc = run_cli(*sft_args(root / "example", root / "sft", f"eval.generate.rewards=[{root / 'rewards.py'}:length]"))
    assert proc.returncode == 0, proc.stderr
    return root / "example", root / "rewards.py", root / "sft"


def sft_args(example, work, *more):
    data = [f"data.path={example / 'chat_train.jsonl'}", f"data.eval_path={example / 'chat_eval.jsonl'}"]
    generate = ["eval.generate.num_prompts=12", f"eval.generate.max_tokens={MAX_TOKENS}", "eval.every_steps=2"]
    generate += ["eval.generate.answer_field=completion"]
    config = ["--config", str(ROOT / "configs" / "chat_sft.yaml"), "--workdir", str(work)]
    return [*config, *data, f"data.tokenizer={example}", *TINY, *generate, *QUIET, *more]


def test_the_eval_scores_the_completions_sample_gives(trained, tmp_path):
    example, rewards, work = trained
    records = [json.loads(line) for line in (example / "chat_eval.jsonl").read_text().splitlines()]
    questions = [r["messages"][0]["content"] for r in records]
    texts = sample(str(work), chat_prompts(work, questions), max_tokens=MAX_TOKENS, temperature=0)
    (evaluated,) = [r for r in read_records(work / "metrics.jsonl") if r["split"] == "eval"]
    answers = [r["messages"][1]["content"] for r in records]
    assert evaluated["generate/exact_match"] == np.mean([t.strip() == a for t, a in zip(texts, answers)])
    assert evaluated["generate/rewards/length"] == pytest.approx(np.mean([len(t) for t in texts]))
    assert evaluated["generate/reward"] == evaluated["generate/rewards/length"]

    # a field of the records that half of the completions match exactly: exact_match 6 of 12
    expected = [t if i % 2 else t + " x" for i, t in enumerate(texts)]
    with open(tmp_path / "eval.jsonl", "w") as f:
        f.writelines(json.dumps({**r, "expected": e}) + "\n" for r, e in zip(records, expected))
    overrides = [f"data.eval_path={tmp_path / 'eval.jsonl'}", "eval.generate.answer_field=expected"]
    overrides += [f"eval.generate.rewards=[{rewards}:length,{rewards}:tokens]"]
    cfg = load_config(work / "config.yaml", overrides, str(work))
    run = build_run(cfg, compile_train=False)
    metrics = GenerationEval(run)(restore_newest(work, run.abstract_state, cfg, "read").state)
    assert metrics["generate/exact_match"] == 0.5
    assert metrics["generate/rewards/length"] == pytest.approx(np.mean([len(t) for t in texts]))
    counted = metrics["generate/mean_length"] * 12  # (with each end-of-text token)
    assert metrics["generate/rewards/tokens"] <= MAX_TOKENS and counted >= 12  # (None: left out of the mean)


def test_a_reward_function_returning_nan_stops_the_run_with_exit_2_naming_it(trained, tmp_path):
    example, rewards, _ = trained
    proc = run_cli(*sft_args(example, tmp_path / "sft", f"eval.generate.rewards=[{rewards}:nan]"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"eval.generate.rewards: reward function {rewards}:nan returned nan for completion 0" in proc.stderr
