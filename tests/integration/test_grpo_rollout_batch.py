"""GRPO's rollout batch (engine/objectives/grpo_rollout.py) from a tiny Llama's decode program:
rows grouped by prompt, advantages summing to zero in each group, a constant reward counted in
frac_reward_zero_std with no advantage, and the same key the same batch (a resume samples alike)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config.grpo_section import GrpoConfig
from engine.data import DataInfo
from engine.lm import rollouts
from engine.lm.rewards import RewardFunction
from engine.objectives.grpo_rollout import rollout_batch
from engine.parallel.sharding import unbox
from models import REGISTRY
from models.configs import LlamaConfig

INFO = DataInfo("tokens", 8, 8, vocab_size=64, seq_len=16)
G, P, C = 4, 6, 5
PROMPTS = [[5, 9], [1, 2, 3, 4, 5]]
RECORDS = [types.SimpleNamespace(prompt=f"prompt {i}", fields={"answer": str(i)}) for i in range(2)]


def even(prompts, completions, **fields):
    return [float(sum(int(t) % 2 == 0 for t in text.split())) for text in completions]


def constant(prompts, completions, **fields):
    return [1.0] * len(completions)


@pytest.fixture(scope="module")
def decoding():
    cfg = LlamaConfig(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=48)
    module = REGISTRY["llama"].build(cfg, INFO, jnp.float32, jnp.float32)
    decoder = REGISTRY["llama"].build(cfg, INFO, jnp.float32, jnp.float32, decode=True)
    params = unbox(module.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), train=False))["params"]
    spec = rollouts.DecodeSpec(P, C, temperature=1.0, stop_ids=(7,), pad_id=0)
    decode = rollouts.build_decode(decoder, spec, params, len(PROMPTS) * G)
    tokens, mask = rollouts.left_pad(PROMPTS, P)
    prompts = {"prompt_tokens": tokens, "prompt_mask": mask, "record_index": np.arange(2, dtype=np.int32)}
    return decode, params, prompts


def batch_of(decoding, function, key=3):
    decode, params, prompts = decoding
    grpo = types.SimpleNamespace(**{**vars(GrpoConfig()), "num_generations": G})
    rewards = [RewardFunction(function.__name__, function.__name__, function)]
    return rollout_batch(decode, params, prompts, jax.random.key(key), RECORDS, rewards, detokenize, grpo)


def detokenize(ids):
    return " ".join(map(str, ids))


def test_groups_advantages_and_metrics(decoding):
    batch, metrics = batch_of(decoding, even)
    assert batch["completion_tokens"].shape == (len(PROMPTS) * G, C)
    np.testing.assert_array_equal(batch["prompt_tokens"][:G], np.repeat(batch["prompt_tokens"][:1], G, axis=0))
    sums = batch["advantages"].reshape(-1, G).sum(axis=1)
    np.testing.assert_allclose(sums, 0.0, atol=1e-5)
    assert np.any(batch["advantages"] != 0)
    assert metrics["reward"] == pytest.approx(float(np.mean(batch["rewards"])), rel=1e-6)
    assert metrics["rewards/even/mean"] == pytest.approx(metrics["reward"], rel=1e-6)
    lengths = batch["completion_mask"].sum(axis=1)
    assert metrics["completions/mean_length"] == pytest.approx(float(lengths.mean()))


def test_a_constant_reward_counts_every_group_as_zero_std(decoding):
    batch, metrics = batch_of(decoding, constant)
    assert metrics["frac_reward_zero_std"] == 1.0 and np.all(batch["zero_std"] == 1.0)
    assert np.all(batch["advantages"] == 0.0)


def test_the_same_key_samples_the_same_batch(decoding):
    first, second, other = batch_of(decoding, even), batch_of(decoding, even), batch_of(decoding, even, key=4)
    for name in first[0]:
        np.testing.assert_array_equal(first[0][name], second[0][name])
    assert not np.array_equal(first[0]["completion_tokens"], other[0]["completion_tokens"])
