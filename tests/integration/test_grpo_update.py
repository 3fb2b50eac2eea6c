"""GRPO's update (engine/objectives/grpo.py) on a tiny Llama: at the first update the ratio is 1
and the KL to the reference 0; with one update per batch the gradient is REINFORCE's with the
group-mean baseline, by hand; a group whose rewards are equal adds no policy gradient."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine.config.grpo_section import GrpoConfig
from engine.data import DataInfo
from engine.lm import grpo_math, rollouts
from engine.objectives.grpo import make_grpo_loss_fn
from engine.parallel.sharding import unbox
from engine.state.train_state import REFERENCE
from models import REGISTRY
from models.configs import LlamaConfig

INFO = DataInfo("tokens", 8, 8, vocab_size=64, seq_len=16)
P, C, G = 6, 4, 2
PROMPTS = [[5, 9], [1, 2, 3, 4, 5], [40, 41, 42], [3]]  # two prompts x G = 2 completions, each padded
REWARDS = np.array([1.0, 0.0, 0.5, 0.5], np.float32)  # the second group's rewards are equal


@pytest.fixture(scope="module")
def tiny():
    module = REGISTRY["llama"].build(
        LlamaConfig(num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, mlp_dim=48), INFO, jnp.float32, jnp.float32
    )
    params = unbox(module.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), train=False))["params"]
    tokens, mask = rollouts.left_pad(PROMPTS, P)
    completions = np.random.default_rng(1).integers(1, 64, (len(PROMPTS), C)).astype(np.int32)
    completion_mask = np.ones((len(PROMPTS), C), bool)
    completion_mask[1, 2:] = False  # a completion that stopped early
    old = rollouts.completion_logprobs(module, params, tokens, mask, completions, completion_mask, 0.7)
    advantages, zero_std = grpo_math.group_advantages(jnp.asarray(REWARDS), G, "group")
    batch = {
        "prompt_tokens": jnp.asarray(tokens),
        "prompt_mask": jnp.asarray(mask),
        "completion_tokens": jnp.asarray(completions),
        "completion_mask": jnp.asarray(completion_mask),
        "old_logps": old,
        "advantages": advantages,
        "rewards": jnp.asarray(REWARDS),
        "zero_std": zero_std.astype(jnp.float32),
    }
    return module, params, batch


def grpo(**keys):
    return types.SimpleNamespace(**{**vars(GrpoConfig()), "max_completion_tokens": C, "temperature": 0.7, **keys})


def test_first_update_has_ratio_one_and_no_kl(tiny):
    module, params, batch = tiny
    loss_fn = make_grpo_loss_fn(module, grpo(beta=0.04))
    _, (sums, _) = loss_fn(params, {REFERENCE: params}, batch, None, False, None)
    tokens = float(np.sum(batch["completion_mask"]))
    assert float(sums["completion_tokens"]) == tokens
    assert float(sums["ratio_sum"]) == pytest.approx(tokens, rel=1e-6)
    assert abs(float(sums["kl_sum"])) < 1e-6 and float(sums["clip_region_sum"]) == 0.0
    assert float(sums["zero_std_sum"]) == 2.0  # the second group's two completions


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_one_iteration_gradient_is_reinforce_with_the_group_mean_baseline(tiny, loss_type):
    module, params, batch = tiny
    loss_fn = make_grpo_loss_fn(module, grpo(loss_type=loss_type))
    got = jax.grad(lambda p: loss_fn(p, {}, batch, None, True, None)[0])(params)
    groups = REWARDS.reshape(-1, G)
    centred = groups - groups.mean(axis=1, keepdims=True)
    advantages = (centred / (groups.std(axis=1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)  # TRL's
    mask = np.asarray(batch["completion_mask"], np.float32)

    def reinforce(p):
        logps = rollouts.completion_logprobs(
            module, p, batch["prompt_tokens"], batch["prompt_mask"], batch["completion_tokens"], mask > 0, 0.7
        )
        per_row = jnp.sum(logps * mask, axis=1)
        if loss_type == "dapo":
            return -jnp.sum(advantages * per_row) / mask.sum()
        return -jnp.mean(advantages * per_row / mask.sum(axis=1))

    want = jax.grad(reinforce)(params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=1e-7)
    assert max(float(jnp.max(jnp.abs(w))) for w in jax.tree.leaves(want)) > 1e-4


def test_a_group_of_equal_rewards_gives_no_policy_gradient(tiny):
    module, params, batch = tiny
    loss_fn = make_grpo_loss_fn(module, grpo())
    only_second = dict(batch, mask=jnp.asarray([0.0, 0.0, 1.0, 1.0]))
    grads = jax.grad(lambda p: loss_fn(p, {}, only_second, None, True, None)[0])(params)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads))
    first = jax.grad(
        lambda p: loss_fn(p, {}, dict(batch, mask=jnp.asarray([1.0, 1.0, 0.0, 0.0])), None, True, None)[0]
    )(params)
    assert max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(first)) > 0
