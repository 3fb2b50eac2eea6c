"""The jax-built members of the train.sync strategies (the table and its jax-free members:
engine/parallel/strategies.py): `every_step` (the train step's own gradient all-reduce, nothing
beside it) and `diloco` (engine/parallel/diloco.py's rounds). A strategy's StrategyParts wrap the
step and the state plan, build the compiled programs' sync part (SyncPart) and say its startup
and dry-run lines; a run's `Syncing` steps, fetches its metrics and fills its log records by that
part, so a job never asks which strategy is in use."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Optional

import jax
import numpy as np

from engine.parallel import diloco, diloco_shrink
from engine.parallel.sharding import per_device_bytes, replicated
from engine.parallel.strategies import strategy_of
from engine.state.columns import combine_copies, fetch_rows


def _no_fields(done: int) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class SyncPart:
    """What a strategy compiles beside the train step (every_step: nothing)."""

    every: int = 0  # steps between runs of `program` (0: it has none)
    program: Any = None  # the compiled sync program: state → (state, {figure: scalar}), after every `every` steps
    combine: Optional[Callable] = None  # compiled: [steps, copies, columns] → [steps, columns]
    fields: Callable[[int], dict] = _no_fields  # a log record's figures at a step (the sync program's added by Syncing)
    # (checkpointer, abstract state) → its Restored: the strategy's own way back from a checkpoint (DiLoCo's: onto
    # another replica count, diloco_shrink.py); None: the checkpointer's restore
    restore: Optional[Callable] = None


def _every_step(cfg, compiled, plan):
    """train.sync=every_step: each step all-reduces its gradients itself (the compiled step as is)."""
    return compiled


def _diloco(cfg, compiled, plan):
    """train.sync=diloco: the plan's outer step (setup.Traced.sync_step) compiled beside the inner
    step, run at the end of each round; the replicas' metrics combined on the device; a log
    record gets the outer steps so far and the bytes exchanged per step (then the replicas' drift
    and the outer gradient's norm at the last exchange)."""
    shardings, inner = plan.state.shardings, cfg.diloco.inner_steps
    started = time.perf_counter()
    outer = jax.jit(
        plan.sync_step, in_shardings=(shardings,), out_shardings=(shardings, replicated(plan.mesh)), donate_argnums=0
    )
    program = outer.lower(plan.state.abstract).compile()
    layout = diloco.Layout(plan.mesh.shape[diloco.REPLICA], inner, diloco.param_count(plan.state.abstract.params))
    per_step = layout.bytes_per_round / inner

    def fields(done: int) -> dict:
        return {"outer_step": done // inner, "exchanged_bytes_per_step": per_step}

    combine = jax.jit(combine_copies, out_shardings=replicated(plan.mesh))
    part = SyncPart(inner, program, combine, fields, functools.partial(diloco_shrink.restore, inner_steps=inner))
    return dataclasses.replace(
        compiled, sync=part, compile_seconds=compiled.compile_seconds + time.perf_counter() - started
    )


def _as_is(cfg, mesh, one_step, state):
    return one_step, None, None


def _no_lines(cfg, run, params: int, *more) -> list[str]:
    return []


@dataclasses.dataclass(frozen=True)
class StrategyParts:
    """A strategy's members built with jax (its record: engine/parallel/strategies.py)."""

    # (cfg, Compiled, setup's plan) → the Compiled with its SyncPart
    compile: Callable
    replica_axes: tuple[str, ...] = ()  # the mesh axes the step is mapped over (one copy of the model each)
    # (cfg, mesh, one train step, the run's state plan) → (the step each copy takes, the sync step
    # (not compiled; None: none), the state plan's (init, init with params, shardings); None: as is)
    step_and_state: Callable = _as_is
    startup_lines: Callable = _no_lines  # (cfg, run, trained params) → what a run says at its start
    # (cfg, run, total params, collectives(program) → text) → what `train --dry-run` adds
    dry_run_lines: Callable = _no_lines


def _diloco_step_and_state(cfg, mesh, one_step, state):
    """Each replica's step alone, the outer step, and the replicas' stacked state."""
    functions = diloco.state_functions(state, mesh, cfg.diloco.delay)
    return diloco.make_inner_step(one_step, mesh), diloco.make_sync_step(cfg.diloco), functions


def _diloco_startup_lines(cfg, run, params: int) -> list[str]:
    return [diloco.Layout(run.mesh.shape[diloco.REPLICA], cfg.diloco.inner_steps, params).text()]


def _diloco_dry_run_lines(cfg, run, params: int, collectives: Callable) -> list[str]:
    """The replicas, and what a round's outer step sends."""
    from engine.runtime.units import human_bytes

    layout = diloco.Layout(run.mesh.shape[diloco.REPLICA], cfg.diloco.inner_steps, params)
    replicas = per_device_bytes(run.abstract_state.replicas)
    return [
        f"{layout.text()}; replicas' state per device {human_bytes(replicas)}",
        f"collectives of the outer step (once per round): {collectives(run.compiled.sync.program)}",
    ]


EVERY_STEP = StrategyParts(_every_step)
DILOCO = StrategyParts(_diloco, (diloco.REPLICA,), _diloco_step_and_state, _diloco_startup_lines, _diloco_dry_run_lines)


def parts_of(cfg) -> StrategyParts:
    """train.sync's jax-built members."""
    return strategy_of(cfg).parts()


def compile_sync(cfg, compiled, plan):
    """The compiled programs with train.sync's sync part."""
    return parts_of(cfg).compile(cfg, compiled, plan)


class Syncing:
    """A run's sync part at work: the sync program after a call when one is due, the metrics
    fetched to the host (combined over copies first), and the figures each log record adds."""

    def __init__(self, part: SyncPart, wait: bool):
        self.part, self.wait = part, wait  # wait: CPU collectives (one program must end before the next)
        self.last = None  # the sync program's last figures (still on the device)

    def after(self, state, done: int):
        """The state after the call that ends at step `done`."""
        if self.part.program is None or done % self.part.every:
            return state
        if self.wait:
            jax.block_until_ready(state)
        state, self.last = self.part.program(state)
        return state

    def fetch(self, arrays: list) -> np.ndarray:
        """Packed metrics of several calls → the host's [steps, columns]."""
        combine = self.part.combine
        return fetch_rows([combine(a) for a in arrays] if combine is not None else arrays)

    def fields(self, done: int) -> dict:
        record = self.part.fields(done)
        if self.last is not None:
            record.update({k: float(v) for k, v in jax.device_get(self.last).items()})
        return record
