"""The table of train.sync strategies: every question the engine asks about the way a run keeps
its copies of the model in step is a member of its Strategy record, so no other module compares
train.sync. The record answers the jax-free questions itself (the config's checks and choices,
the mesh axis that becomes replicas, a round's length, whether an elastic job may shrink to a
size), so the launcher and the sweep's process read it without jax; `parts()` gives the
jax-built members (engine/parallel/sync.py's StrategyParts: the state plan and step, the
compiled sync program, startup and dry-run lines).

A new strategy is one module with its parts plus one entry in STRATEGIES."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from engine.errors import UsageError


def _no_replicas(cfg) -> str:
    return ""


def _one_step(cfg) -> int:
    return 1


def _always(cfg, count: int, processes: int, data: int) -> None:
    return None


def _named(module: str, name: str) -> Callable[[], Any]:
    """A strategy's parts named, not imported: the table is read by the config and the launcher,
    which import no jax; the parts (jax, and the layers they build on) load where a run is built."""
    return lambda: getattr(importlib.import_module(module), name)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One train.sync value and its answers."""

    parts: Callable[[], Any]  # () → its StrategyParts (engine/parallel/sync.py): the jax-built members
    check: Callable[[Any], None]  # cfg → UsageError naming the fix when the config cannot run with it
    replicas_from: Callable[[Any], str] = _no_replicas  # cfg → the mesh axis whose indices are replicas ("": none)
    round_steps: Callable[[Any], int] = _one_step  # cfg → steps per round: a job resizes only at a round's end
    round_setting: str = ""  # the setting that sets round_steps (the config's interval checks name it)
    # (cfg, process count, processes now, mesh.data at that count) → UsageError when an elastic job
    # cannot go on at that size under this strategy
    check_resize: Callable[[Any, int, int, int], None] = _always
    vectorised: bool = False  # whether a sweep may vectorise runs under it (engine/run/vectorize.py)


def _check_every_step(cfg) -> None:
    if cfg.diloco.delay:
        raise UsageError(
            f"diloco.delay={cfg.diloco.delay} delays DiLoCo's outer step, but train.sync={cfg.train.sync}; "
            "set train.sync=diloco, or diloco.delay=0"
        )


def _check_diloco(cfg) -> None:
    """The replicas' axis is set, and the rest of the run composes with DiLoCo."""
    mesh, axis = cfg.mesh, cfg.diloco.replica_axis
    replicas = mesh.dcn_data if axis == "dcn_data" else mesh.data
    if replicas == 1:
        other = "data" if axis == "dcn_data" else "dcn_data"
        raise UsageError(
            f"train.sync=diloco with diloco.replica_axis={axis} needs mesh.{axis} > 1 (the replicas), "
            f"but it is {replicas}; set mesh.{axis} to the number of replicas, or diloco.replica_axis={other}"
        )
    for key, value, fix in (
        ("mesh.backend", mesh.backend, "jit"),
        ("mesh.pipeline", mesh.pipeline, 1),
        ("train.eager", cfg.train.eager, False),
    ):
        if value != fix:
            raise UsageError(
                f"train.sync=diloco does not run with {key}={value}; set {key}={str(fix).lower()} "
                f"(or train.sync=every_step)"
            )
    if not cfg.diloco.outer_momentum < 1.0:
        raise UsageError(f"diloco.outer_momentum={cfg.diloco.outer_momentum} must be in [0, 1), e.g. 0.9")


def _diloco_resize(cfg, count: int, processes: int, data: int) -> None:
    """A job of `count` processes (mesh.data = `data`) keeps 2 or more replicas (the replica
    axis shrinks with the data axis: diloco_shrink.py), and no frozen base."""
    if cfg.finetune.base:
        raise UsageError(
            "fault.elastic=true with train.sync=diloco and finetune.base: continuing on fewer DiLoCo replicas is "
            "not built for a frozen base yet; set fault.elastic=false (a lost process then ends the job)"
        )
    axis = cfg.diloco.replica_axis
    replicas = cfg.mesh.dcn_data * count // processes if axis == "dcn_data" else data
    if replicas < 2:
        raise UsageError(
            f"fault.elastic=true with train.sync=diloco: a job of {count} processes would hold {replicas} "
            f"replica(s) (diloco.replica_axis={axis}), and DiLoCo needs 2 or more; raise fault.min_processes "
            f"above {count}"
        )


STRATEGIES: dict[str, Strategy] = {
    # the train step's own gradient all-reduce, nothing beside it
    "every_step": Strategy(
        parts=_named("engine.parallel.sync", "EVERY_STEP"), check=_check_every_step, vectorised=True
    ),
    # replicas train alone for diloco.inner_steps, then an outer step (engine/parallel/diloco.py)
    "diloco": Strategy(
        parts=_named("engine.parallel.sync", "DILOCO"),
        check=_check_diloco,
        replicas_from=lambda cfg: cfg.diloco.replica_axis,
        round_steps=lambda cfg: cfg.diloco.inner_steps,
        round_setting="diloco.inner_steps",
        check_resize=_diloco_resize,
    ),
}


def strategy_of(cfg) -> Strategy:
    """train.sync's record (the config checked its name against STRATEGIES)."""
    return STRATEGIES[cfg.train.sync]
