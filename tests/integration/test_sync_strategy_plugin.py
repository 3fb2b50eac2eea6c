"""The sync strategies' table (engine/parallel/strategies.py): a strategy defined here, in the
test, plugs in as one entry of a copy of the table and trains, with no edit of the engine; the
engine asks it for its config check, its step and state plan, its compiled sync program, its log
fields and its startup lines."""

import dataclasses

import jax
import optax
import pytest

from engine.errors import UsageError
from engine.parallel import strategies
from engine.parallel.sharding import replicated
from engine.parallel.sync import StrategyParts, SyncPart
from engine.run.setup import build_run
from engine.run.single import fit
from engine.run.startup import startup_lines
from engine.runtime.rundir import read_records

ROUND = 2
asked: list[str] = []


def check(cfg) -> None:
    asked.append("check")
    if cfg.train.steps % ROUND:
        raise UsageError(f"train.sync=norm_rounds runs whole rounds of {ROUND} steps; make train.steps even")


def step_and_state(cfg, mesh, one_step, state):
    asked.append("step_and_state")
    return one_step, None, None  # the plain step and state: the round's program only reads them


def compile_rounds(cfg, compiled, plan):
    """At each round's end, a program that measures the parameters' norm (and changes nothing)."""
    shardings = plan.state.shardings
    program = jax.jit(
        lambda state: (state, {"param_norm": optax.global_norm(state.params)}),
        in_shardings=(shardings,),
        out_shardings=(shardings, replicated(plan.mesh)),
        donate_argnums=0,
    )
    part = SyncPart(ROUND, program.lower(plan.state.abstract).compile(), None, lambda done: {"round": done // ROUND})
    return dataclasses.replace(compiled, sync=part)


PARTS = StrategyParts(
    compile_rounds, step_and_state=step_and_state, startup_lines=lambda cfg, run, params: [f"rounds of {ROUND}"]
)
NORM_ROUNDS = strategies.Strategy(parts=lambda: PARTS, check=check, round_steps=lambda cfg: ROUND)


@pytest.fixture
def with_norm_rounds(monkeypatch):
    monkeypatch.setattr(strategies, "STRATEGIES", {**strategies.STRATEGIES, "norm_rounds": NORM_ROUNDS})
    asked.clear()


SETTINGS = ("train.sync=norm_rounds", "train.steps=4", "log.every_steps=2", "eval.every_steps=0")


def test_a_strategy_defined_in_a_test_trains(make_config, tmp_path, with_norm_rounds):
    cfg = make_config("mnist_mlp.yaml", *SETTINGS, workdir=tmp_path / "run")
    assert "check" in asked
    run = build_run(cfg)
    assert "step_and_state" in asked and f"rounds of {ROUND}" in startup_lines(run)
    result = fit(cfg, run=run)
    assert sorted(result.losses) == [1, 2, 3, 4]
    train = [r for r in read_records(tmp_path / "run" / "metrics.jsonl") if r["split"] == "train"]
    assert [(r["step"], r["round"]) for r in train] == [(2, 1), (4, 2)]
    norms = [r["param_norm"] for r in train]
    assert norms[0] > 0 and norms[0] != norms[1]  # measured after each round, as the parameters moved


def test_its_check_refuses_a_config(make_config, tmp_path, with_norm_rounds):
    with pytest.raises(UsageError, match="make train.steps even"):
        make_config("mnist_mlp.yaml", *SETTINGS, "train.steps=3", workdir=tmp_path / "odd")
