"""DPO's reference and β as a run's numbers: dpo.precompute_reference (engine/run/reference_logps.py)
against the reference run in the step, β as a step input (a vectorised β × learning-rate grid),
and the FLOPs a DPO step counts (engine/observe/perf.py)."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from support.dpo import hand_batch, nbytes, setup

from engine.config import shape_differences
from engine.config.dpo_objective import DPO_BETA, REF_LOGPS
from engine.config.objective import objective_of
from engine.objectives.dpo_part import make_dpo_loss_fn
from engine.parallel.mesh import make_mesh
from engine.run.cost import analytic_per_example
from engine.run.reference_logps import compute
from engine.run.setup import run_hparams
from engine.run.step import make_eval_step, make_train_step, weights_of
from engine.state.train_state import REFERENCE
from models import REGISTRY


def test_precomputed_state_holds_no_reference_and_batches_stand_for_it(make_config):
    cfg, family, module, state, *_ = setup(make_config)
    _, _, _, lean, *_ = setup(make_config, dpo={"precompute_reference": True})
    assert REFERENCE in state.model_state and REFERENCE not in lean.model_state
    assert nbytes(state) - nbytes(lean) == nbytes(state.params)  # the state's size less one copy of the parameters
    loss_fn = make_dpo_loss_fn(module, family.task, cfg.dpo)
    batch = hand_batch()[0]
    moved = jax.tree.map(lambda x: x * 1.1, state.params)  # the policy away from the reference
    sums = jax.jit(lambda p, s, b: loss_fn(p, s, b, None, False)[1][0])
    on_the_fly = sums(moved, state.model_state, batch)
    at_start = jax.jit(lambda p, s, b: make_dpo_loss_fn(module, family.task, cfg.dpo)(p, s, b, None, False)[1][0])
    # the reference's log-probabilities of each pair: the policy's own at the start
    ref = jnp.stack(
        [jnp.stack([per_pair(at_start, state, batch, i, side) for side in ("chosen", "rejected")]) for i in range(3)]
    )
    # the precompute pass (in batches of 2: the last one padded) gives those values
    pass_run = SimpleNamespace(
        cfg=cfg, mesh=make_mesh(cfg.mesh, jax.devices()[:1]), model=SimpleNamespace(module=module, family=family),
        inputs=SimpleNamespace(eval_batch_size=2, eval_rows=np.arange(2)),
        compiled=SimpleNamespace(put_batch=lambda host, size: jax.tree.map(jnp.asarray, host)),
        dataset=SimpleNamespace(
            train={k: np.asarray(v) for k, v in batch.items()}, eval={k: np.asarray(v)[:1] for k, v in batch.items()}
        ),
    )  # fmt: skip
    np.testing.assert_allclose(
        compute(pass_run, state.params, state.model_state), np.concatenate([ref, ref[:1]]), rtol=1e-5
    )
    given = sums(moved, lean.model_state, dict(batch, **{REF_LOGPS: ref}))
    for name in ("loss_sum", "rewards_chosen", "rewards_rejected", "logps_chosen"):
        np.testing.assert_allclose(float(given[name]), float(on_the_fly[name]), rtol=1e-5)
    off = sums(moved, lean.model_state, dict(batch, **{REF_LOGPS: ref + 1.0}))  # they are what is used
    assert abs(float(off["rewards_chosen"]) - float(on_the_fly["rewards_chosen"])) > 0.1


def per_pair(fn, state, batch, i, side):
    mask = jnp.eye(batch["tokens"].shape[0])[i]
    return fn(state.params, state.model_state, dict(batch, mask=mask))[f"logps_{side}"]


def test_beta_is_a_step_input_vectorised_over_a_grid(make_config):
    """A 2 × 2 grid of dpo.beta × optimizer.learning_rate shares one program: the trials under
    vmap give each its metrics alone (train and eval)."""
    grid = [(beta, lr) for beta in (0.1, 0.5) for lr in (0.01, 0.03)]
    runs = [
        setup(make_config, "finetune.lora.rank=4", f"optimizer.learning_rate={lr}", dpo={"beta": b}) for b, lr in grid
    ]
    cfgs = [run[0] for run in runs]
    assert all(not shape_differences(cfgs[0], cfg) for cfg in cfgs)
    cfg, family, module, _, tx, plan = runs[0]
    step = make_train_step(make_dpo_loss_fn(module, family.task, cfg.dpo), tx, cfg.optimizer.schedule)
    evaluate = make_eval_step(make_dpo_loss_fn(module, family.task, cfg.dpo))
    batch = hand_batch()[0]
    stack = lambda trees: jax.tree.map(lambda *x: jnp.stack(x), *trees)  # noqa: E731
    hparams = stack([run_hparams(c) for c in cfgs])
    assert np.allclose(hparams["schedule"][DPO_BETA], [0.1, 0.1, 0.5, 0.5])
    states = jax.vmap(plan.init)(jnp.zeros(4, jnp.int32), hparams)

    def two_steps(state):
        for _ in range(2):
            state, metrics = step(state, batch)
        return metrics, evaluate(weights_of(state), dict(batch, mask=jnp.ones(3)))

    together = jax.jit(jax.vmap(two_steps))(states)
    one = jax.jit(two_steps)  # (one program for every trial alone too: β is an input)
    for k, c in enumerate(cfgs):
        alone = one(plan.init(np.int32(0), run_hparams(c)))
        for got, want in zip(together, alone):
            for name in ("loss_sum", "rewards_chosen", "logps_rejected"):
                np.testing.assert_allclose(float(got[name][k]), float(want[name]), rtol=1e-5, atol=1e-6)
    margins = [float(together[1]["rewards_chosen"][k] - together[1]["rewards_rejected"][k]) for k in range(4)]
    assert len({round(m, 6) for m in margins}) == 4  # every trial its own β and learning rate


@pytest.mark.parametrize("lora, precompute", [(True, False), (False, False), (False, True)])
def test_dpo_flops_are_the_hand_formula(make_config, lora, precompute):
    cfg, family, _, state, _, plan = setup(
        make_config, *(["finetune.lora.rank=4"] if lora else []), dpo={"precompute_reference": precompute}
    )
    m, tokens = cfg.model, 16
    counted = lambda tree: sum(x.size for x in jax.tree.leaves(tree))  # noqa: E731
    trained, base = counted(state.params), counted(state.model_state.get("frozen", {}))
    attention = 6 * m.num_layers * m.num_heads * m.head_width * tokens * tokens  # causal QK^T and AV, fwd + bwd
    info = plan_info(cfg)
    embedding = (m.vocab_size or info.vocab_size) * m.d_model  # a lookup, not a matmul (untied)
    full = 6 * (trained + base - embedding) * tokens + attention  # forward + backward of every parameter
    policy = full - 2 * base * tokens  # LoRA: no gradient for the base's weights
    reference = 0 if precompute else 2 * full / 3  # the reference's forward on chosen and rejected
    flops, formula = analytic_per_example(cfg, REGISTRY["llama"].flops, info, plan.abstract, objective_of(cfg))
    assert flops == pytest.approx(2 * policy + reference, rel=1e-9) and flops > 0
    assert ("reference's forward" in formula) == (not precompute) and ("LoRA" in formula) == lora


def plan_info(cfg):
    from engine.data import load_dataset

    return load_dataset(cfg.data).info
