"""The DPO objective (engine/objectives/dpo_part.py, engine/config/dpo_objective.py): TRL's losses,
the reference under LoRA and full fine-tuning, response-only sequence log-probabilities, the
metrics' flow, and its config checks."""

import dataclasses
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_chat_data import write_jsonl, write_model_dir

from conftest import QUIET, ROOT, TINY_LLAMA, run_cli
from engine.config.dpo_objective import DPO, DPO_SUMS
from engine.config.objective import check_objective
from engine.data import load_dataset
from engine.errors import UsageError
from engine.objectives.dpo_part import dpo_losses, make_dpo_loss_fn
from engine.parallel.mesh import make_mesh
from engine.run.columns import MetricColumns, pack_metrics
from engine.run.optimizer import make_optimizer
from engine.run.setup import build_model, run_hparams
from engine.run.state import state_plan
from engine.run.step import make_train_step
from engine.state.train_state import FROZEN, REFERENCE
from models.family import NextToken

SEQ = 16


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


def pairs(prompts, chosen, rejected):
    """A batch in interfaces.md's format from token lists: [pairs, 2, SEQ + 1] right-padded."""
    n = len(prompts)
    batch = {k: np.zeros((n, 2, SEQ + 1), np.int32) for k in ("tokens", "segments", "positions", "loss_mask")}
    for i, prompt in enumerate(prompts):
        for j, response in enumerate((chosen[i], rejected[i])):
            row = list(prompt) + list(response)
            batch["tokens"][i, j, : len(row)] = row
            batch["segments"][i, j, : len(row)] = 1
            batch["positions"][i, j, : len(row)] = np.arange(len(row))
            batch["loss_mask"][i, j, len(prompt) : len(row)] = 1
    return {k: jnp.asarray(v) for k, v in batch.items()}


def hand_batch():
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 64, n) for n in (5, 3, 7)]
    chosen = [rng.integers(1, 64, n) for n in (4, 9, 2)]
    rejected = [rng.integers(1, 64, n) for n in (6, 2, 9)]
    return pairs(prompts, chosen, rejected), prompts, chosen, rejected


def setup(make_config, *overrides, dpo=()):
    """(cfg, family, module, state, tx, state plan) of a tiny Llama whose train.objective is dpo (the config is
    loaded as an lm run on synthetic text: the preference loader is another module's)."""
    cfg = make_config("mnist_mlp.yaml", *TINY_LLAMA, f"data.seq_len={SEQ}", *overrides)
    cfg = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, objective="dpo"), dpo=dataclasses.replace(cfg.dpo, **dict(dpo))
    )
    info = load_dataset(cfg.data).info
    family, module = build_model(cfg, info)
    tx = make_optimizer(cfg.optimizer)
    plan = state_plan(cfg, make_mesh(cfg.mesh, jax.devices()[:1]), family, module, info, tx, run_hparams(cfg))
    return cfg, family, module, plan.create(), tx, plan


def eval_sums(loss_fn):
    """The jitted metric sums of an eval call of `loss_fn` (params, model_state, batch)."""
    return jax.jit(lambda p, s, b: loss_fn(p, s, b, None, False)[1][0])


def per_pair(fn, params, model_state, batch):
    """Each pair's metrics (a batch mask selecting it alone; `fn`: eval_sums's), as {name: [pairs]}."""
    n = batch["tokens"].shape[0]
    rows = [jax.device_get(fn(params, model_state, dict(batch, mask=jnp.eye(n)[i]))) for i in range(n)]
    return {name: np.array([float(r[name]) for r in rows]) for name in rows[0]}


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


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


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


@pytest.mark.nocompile
def test_config_checks(make_config):
    cfg = make_config("mnist_mlp.yaml", *TINY_LLAMA)
    dpo_run = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, objective="dpo"))
    with pytest.raises(UsageError, match="data.name=preferences"):
        check_objective(dpo_run)
    preferences = dataclasses.replace(dpo_run, data=dataclasses.replace(cfg.data, name="preferences"))
    check_objective(preferences)
    with pytest.raises(UsageError, match="train.objective=dpo"):
        check_objective(dataclasses.replace(preferences, train=cfg.train))
    with pytest.raises(UsageError, match=r"dpo.beta=0.5 set with train.objective=lm.*set train.objective=dpo"):
        make_config("mnist_mlp.yaml", *TINY_LLAMA, "dpo.beta=0.5")
    for dpo, message in (
        ({"loss": "ipo", "label_smoothing": 0.1}, "dpo.loss=ipo takes no label smoothing"),
        ({"loss": "hinge", "label_smoothing": 0.1}, "dpo.loss=hinge takes no label smoothing"),
        ({"label_smoothing": 0.5}, r"must be in \[0, 0.5\)"),
    ):
        with pytest.raises(UsageError, match=message):
            check_objective(dataclasses.replace(preferences, dpo=dataclasses.replace(cfg.dpo, **dpo)))
    lora = dataclasses.replace(cfg.finetune.lora, dropout=0.1)  # DPO scores without dropout (TRL's disable_dropout)
    with pytest.raises(UsageError, match=r"finetune.lora.dropout=0.1 has no effect.*set finetune.lora.dropout=0"):
        check_objective(dataclasses.replace(preferences, finetune=dataclasses.replace(cfg.finetune, lora=lora)))
    check_objective(dataclasses.replace(preferences, dpo=dataclasses.replace(cfg.dpo, precompute_reference=True)))
    check_objective(dataclasses.replace(preferences, dpo=dataclasses.replace(cfg.dpo, label_smoothing=0.2)))


TRL_NAMES = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen")


def test_dpo_runs_end_to_end_with_trls_metrics(tmp_path):
    """launch.py train with train.objective=dpo on data.name=preferences (LoRA): TRL's metrics in
    metrics.jsonl for train and eval, on the console; the objective and the data must agree (exit 2)."""
    model = tmp_path / "model"
    model.mkdir()
    write_model_dir(model)
    prompts = ["the cat sat", "hello there", "on the mat", "be brief"] * 4
    pairs_ = [{"prompt": p, "chosen": "hello", "rejected": "the mat"} for p in prompts]
    path = write_jsonl(tmp_path / "pairs.jsonl", pairs_)
    args = [
        "train", "--config", str(ROOT / "configs" / "mnist_mlp.yaml"), "model.name=llama", "model.num_layers=2",
        "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2", "model.mlp_dim=48", f"data.path={path}",
        "data.eval_fraction=0.25", f"data.tokenizer={model}", "data.seq_len=24", "train.global_batch_size=4",
        "finetune.lora.rank=4", "optimizer.learning_rate=0.01", "train.steps=4", "log.every_steps=2", *QUIET,
        "--workdir", str(tmp_path / "work"),
    ]  # fmt: skip
    proc = run_cli(*args, "data.name=preferences", "train.objective=dpo")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "work" / "metrics.jsonl").read_text().splitlines()]
    assert [r["split"] for r in records if "loss" in r] == ["train", "train", "eval"]
    for record in (r for r in records if "loss" in r):
        assert all(math.isfinite(record[name]) for name in (*TRL_NAMES, "logps/rejected"))
        assert record["rewards/margins"] == pytest.approx(record["rewards/chosen"] - record["rewards/rejected"])
    assert re.search(r"step 2 train: loss=\S+ .*rewards/accuracies=", proc.stdout), proc.stdout
    proc = run_cli(*args, "data.name=preferences")  # (train.objective=lm)
    assert proc.returncode == 2 and "set train.objective=dpo" in proc.stderr, proc.stderr
