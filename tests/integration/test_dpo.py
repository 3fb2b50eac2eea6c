"""The DPO objective (engine/objectives/dpo_part.py, engine/config/dpo_objective.py): TRL's losses,
the reference under LoRA and full fine-tuning, response-only sequence log-probabilities, the
metrics' flow, and its config checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.dpo import SEQ, eval_sums, hand_batch, nbytes, pairs, per_pair, setup

from engine.config.dpo_objective import DPO, DPO_SUMS
from engine.objectives.dpo_part import dpo_losses, make_dpo_loss_fn
from engine.run.step import make_train_step
from engine.state.columns import MetricColumns, pack_metrics
from engine.state.train_state import FROZEN, REFERENCE
from models.family import NextToken


def np_logsigmoid(x):
    return -np.logaddexp(0.0, -x)


def trl_loss(pc, pr, rc, rr, beta, loss, ls):
    """TRL's DPOTrainer.dpo_loss, in numpy."""
    h = (pc - rc) - (pr - rr)
    if loss == "sigmoid":
        return -np_logsigmoid(beta * h) * (1 - ls) - np_logsigmoid(-beta * h) * ls
    if loss == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    return np.maximum(0.0, 1 - beta * h)


@pytest.mark.parametrize(
    "loss, ls, beta", [("sigmoid", 0.0, 0.1), ("sigmoid", 0.2, 0.5), ("ipo", 0.0, 0.1), ("hinge", 0.0, 0.3)]
)
def test_losses_are_trls(loss, ls, beta):
    rng = np.random.default_rng(0)
    pc, pr, rc, rr = (rng.normal(-20, 5, 8).astype(np.float32) for _ in range(4))
    got = dpo_losses(*map(jnp.asarray, (pc, pr, rc, rr)), beta, loss, ls)
    np.testing.assert_allclose(np.asarray(got), trl_loss(pc, pr, rc, rr, beta, loss, ls), rtol=1e-5, atol=1e-6)


def perturbed(tree, leaf_names, seed=3):
    """`tree` with the leaves named `leaf_names` (all, if empty) moved by noise."""
    key = jax.random.key(seed)

    def move(path, x):
        if leaf_names and getattr(path[-1], "key", None) not in leaf_names:
            return x
        return x + 0.5 * jax.random.normal(jax.random.fold_in(key, hash(str(path)) % 2**31), x.shape, x.dtype)

    return jax.tree_util.tree_map_with_path(move, tree)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_step_zero_is_log2_and_reference_is_the_start(make_config, lora):
    cfg, family, module, state, *_ = setup(make_config, *(["finetune.lora.rank=4"] if lora else []))
    assert (FROZEN in state.model_state) == lora and (REFERENCE in state.model_state) == (not lora)
    loss_fn = eval_sums(make_dpo_loss_fn(module, family.task, cfg.dpo))
    batch = hand_batch()[0]
    start = per_pair(loss_fn, state.params, state.model_state, batch)
    np.testing.assert_allclose(start["loss_sum"], math.log(2), rtol=1e-6)
    np.testing.assert_allclose(start["rewards_chosen"], 0.0, atol=1e-6)
    np.testing.assert_allclose(start["rewards_rejected"], 0.0, atol=1e-6)
    # the policy moved (LoRA: its adapters; full: every parameter): the reference stays the start
    moved = per_pair(loss_fn, perturbed(state.params, ("lora_b",) if lora else ()), state.model_state, batch)
    assert np.all(np.abs(moved["logps_chosen"] - start["logps_chosen"]) > 1e-3)
    beta = cfg.dpo.beta
    for side in ("chosen", "rejected"):
        reference = moved[f"logps_{side}"] - moved[f"rewards_{side}"] / beta
        np.testing.assert_allclose(reference, start[f"logps_{side}"], rtol=1e-4, atol=1e-4)


def test_sequence_logps_are_the_responses_alone(make_config):
    cfg, family, module, state, *_ = setup(make_config)
    batch, prompts, chosen, rejected = hand_batch()
    got = per_pair(eval_sums(make_dpo_loss_fn(module, family.task, cfg.dpo)), state.params, state.model_state, batch)
    tokens = np.asarray(batch["tokens"])
    logits = jax.jit(module.apply, static_argnames="train")(
        {"params": state.params}, tokens[:, :, :-1].reshape(-1, SEQ), train=False
    )
    logps = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32))).reshape(*tokens.shape[:2], SEQ, -1)
    for i, prompt in enumerate(prompts):
        for j, (side, response) in enumerate((("chosen", chosen[i]), ("rejected", rejected[i]))):
            row, logp = tokens[i, j], logps[i, j]  # (padding after a row: causal attention never sees it)
            start, end = len(prompt), len(prompt) + len(response)  # targets t - 1 → token t
            hand = sum(logp[t - 1, row[t]] for t in range(start, end))
            np.testing.assert_allclose(got[f"logps_{side}"][i], hand, rtol=1e-5)

    class PromptTargetsChanged(NextToken):  # the prompt's targets changed, the inputs not
        def model_inputs(self, batch):
            inputs, targets, extra = super().model_inputs(batch)
            prompt = batch["loss_mask"][:, 1:] == 0
            changed = jnp.where(prompt, (targets + 7) % 64, targets)
            return inputs, changed, {**extra, "targets": changed}

    changed = eval_sums(make_dpo_loss_fn(module, PromptTargetsChanged(), cfg.dpo))
    other = per_pair(changed, state.params, state.model_state, batch)
    np.testing.assert_allclose(other["logps_chosen"], got["logps_chosen"], rtol=1e-6)
    np.testing.assert_allclose(other["logps_rejected"], got["logps_rejected"], rtol=1e-6)


def test_lora_state_holds_one_base(make_config):
    _, _, _, state, *_ = setup(make_config, "finetune.lora.rank=4")
    frozen = nbytes(state.model_state[FROZEN])
    assert REFERENCE not in state.model_state and nbytes(state.model_state) == frozen
    # the rest of the state: the adapters, their two Adam moments and a few scalars, no second base
    assert nbytes(state) - frozen < 3 * nbytes(state.params) + 1024 < frozen
    cfg, family, module, full, tx, plan = setup(
        make_config
    )  # full fine-tuning: the reference is a copy of the parameters
    assert nbytes(full.model_state[REFERENCE]) == nbytes(full.params)
    given = perturbed(full.params, ())  # checkpoint.restore_mode=params: the given parameters are the reference
    started = plan.create(given)
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, started.model_state[REFERENCE], given)))
    step = jax.jit(make_train_step(make_dpo_loss_fn(module, family.task, cfg.dpo), tx, cfg.optimizer.schedule))
    after, _ = step(started, hand_batch()[0])  # the parameters train, the reference does not
    assert not np.array_equal(after.params["embed"]["embedding"], given["embed"]["embedding"])
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, after.model_state[REFERENCE], given)))


DPO_COLUMNS = MetricColumns(sums=DPO.sums, named=DPO.record)  # a DPO run's (engine/run/outputs.py)


def test_dpo_steps_learn_a_separable_preference(make_config):
    cfg, family, module, state, tx, _ = setup(
        make_config, "finetune.lora.rank=4", "optimizer.learning_rate=0.02", dpo={"beta": 0.5}
    )
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 64, 4) for _ in range(8)]
    batch = pairs(prompts, [[5, 6, 5, 6]] * 8, [[9, 9, 9, 9]] * 8)
    loss_fn = make_dpo_loss_fn(module, family.task, cfg.dpo)
    step = jax.jit(make_train_step(loss_fn, tx, cfg.optimizer.schedule))
    records = []
    for _ in range(8):
        state, metrics = step(state, batch)
        records.append(DPO_COLUMNS.record(np.asarray(pack_metrics(metrics, DPO_SUMS))[None]))
    first, last = records[0], records[-1]
    assert first["loss"] == pytest.approx(math.log(2), rel=1e-5) and first["rewards/accuracies"] == 0.0
    assert last["rewards/accuracies"] == 1.0
    assert last["rewards/margins"] > 0.5 > first["rewards/margins"]
    assert last["loss"] < 0.5 * math.log(2)


def test_metrics_are_sums_over_pairs_under_trls_names():
    step = {
        "loss_sum": 3.0, "correct": 2.0, "count": 4.0, "grad_norm": 1.0, "learning_rate": 0.1,
        "aux_loss": 0.0, "routed": 0.0, "dropped": 0.0,
        "rewards_chosen": 2.0, "rewards_rejected": -1.0, "logps_chosen": -40.0, "logps_rejected": -60.0,
    }  # fmt: skip
    other = dict(step, loss_sum=1.0, correct=4.0, rewards_chosen=6.0)
    host = np.stack([np.asarray(pack_metrics(step, DPO_SUMS)), np.asarray(pack_metrics(other, DPO_SUMS))])
    assert host.shape[-1] == DPO_COLUMNS.width == 8 + len(DPO_SUMS)
    record = DPO_COLUMNS.record(host)
    assert record["loss"] == pytest.approx(0.5) and record["rewards/accuracies"] == pytest.approx(0.75)
    assert record["rewards/chosen"] == pytest.approx(1.0) and record["rewards/rejected"] == pytest.approx(-0.25)
    assert record["rewards/margins"] == pytest.approx(1.25) and record["logps/chosen"] == pytest.approx(-10.0)
    assert record["logps/rejected"] == pytest.approx(-15.0) and "accuracy" not in record
