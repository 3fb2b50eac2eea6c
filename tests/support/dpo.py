"""Helpers of tests/**/test_dpo*.py that other test files (or its other tiers) share."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from engine.data import load_dataset
from engine.optim.optimizer import make_optimizer
from engine.parallel.mesh import make_mesh
from engine.run.setup import build_model, run_hparams
from engine.run.state import state_plan
from support.configs import TINY_LLAMA

SEQ = 16


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


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
