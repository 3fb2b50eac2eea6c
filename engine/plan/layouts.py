"""`launch.py plan --search`: layouts for a target, ranked. A candidate is a split of the chips
over the mesh axes, a remat policy and a micro-batch (gradient accumulation). Candidates whose
sharded train state alone does not fit a chip are ruled out from shapes (no compile); the
rest are ordered by an estimate and the first `compiles` are compiled with the TPU compiler;
the table ranks those by fit, then by step time (the analytic FLOPs at the chip's peak, with
remat's recomputation, plus the compiled program's collective bytes at the ICI and DCN
bandwidths of engine/plan/tpu.py)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Optional, cast

from engine.config import Config
from engine.errors import UsageError
from engine.parallel.axes import CONFIG_AXES
from engine.parallel.sharding import per_device_bytes
from engine.plan.compiled import Planned, plan
from engine.plan.hlo import human_bytes
from engine.plan.tpu import Target
from engine.run.setup import plan_run
from models import REGISTRY
from models.family import num_experts, splits_sequence

RECOMPUTE = {"none": 1.0, "dots": 7 / 6, "full": 4 / 3}  # training FLOPs with each remat policy, relative


@dataclass
class Candidate:
    mesh: dict[str, int]
    remat: Optional[str]  # None: the family has no remat setting
    accum: int
    state_bytes: int = 0  # the sharded train state per device, from shapes
    planned: Optional[Planned] = None

    def overrides(self) -> list[str]:
        sizes = [f"mesh.{axis}={size}" for axis, size in self.mesh.items()]
        remat = [f"model.remat={self.remat}"] if self.remat else []
        return [*sizes, *remat, f"train.grad_accum_steps={self.accum}"]

    def seconds(self) -> float:
        """The estimate the table ranks by (inf when not compiled)."""
        if self.planned is None:
            return math.inf
        return self.planned.estimate_seconds() + self.planned.step_seconds(1.0) * (
            RECOMPUTE.get(self.remat or "none", 1.0) - 1
        )


def candidates(cfg: Config, target: Target) -> list[Candidate]:
    """Every split of the chips over the configured axes (powers of two; each axis a multiple of
    its dcn_ factor), with each remat policy and micro-batch count the config allows."""
    chips, family = target.chips, REGISTRY[cfg.model.name]
    usable = [
        a
        for a in CONFIG_AXES
        if a in ("data", "fsdp", "tensor")
        or (a == "context" and splits_sequence(family))
        or (a == "expert" and num_experts(family, cfg.model) > 0)
    ]
    sizes = [2**i for i in range(int(math.log2(chips)) + 1)]
    remats = [None] if family.remat(cfg.model) is None else list(RECOMPUTE)
    found = []
    for split in itertools.product(sizes, repeat=len(usable)):
        if math.prod(split) != chips:
            continue
        mesh = {a: 1 for a in CONFIG_AXES} | dict(zip(usable, split))
        if any(mesh[a] % getattr(cfg.mesh, f"dcn_{a}") for a in CONFIG_AXES):
            continue
        shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
        for remat, accum in itertools.product(remats, (1, 2, 4, 8)):
            micro = cfg.train.global_batch_size // accum
            if cfg.train.global_batch_size % accum == 0 and micro % shards == 0:
                found.append(Candidate(mesh, remat, accum))
    return found


def configured(cfg: Config, candidate: Candidate) -> Config:
    """`cfg` with the candidate's mesh, remat policy and accumulation (a new config)."""
    model = cfg.model if candidate.remat is None else dataclasses.replace(cfg.model, remat=candidate.remat)
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cast(Any, cfg.mesh), **candidate.mesh),  # (MeshConfig: made from the axes)
        model=model,
        train=dataclasses.replace(cfg.train, grad_accum_steps=candidate.accum),
    )


def search(cfg: Config, target: Target, compiles: int, say=print) -> list[Candidate]:
    """Ranked candidates (the compiled ones first: fitting, then by step-time estimate)."""
    found = candidates(cfg, target)
    hbm = target.chip.hbm_bytes // target.chip.devices_per_chip
    screened = []
    for candidate in found:
        try:
            shapes = plan_run(configured(cfg, candidate), devices=target.devices)
        except UsageError:  # a layout the model refuses (tensor not dividing the heads, ...)
            continue
        candidate.state_bytes = per_device_bytes(shapes.state.abstract)
        if candidate.state_bytes <= hbm:
            screened.append(candidate)
    # before compiling: the least recomputation, the fewest micro-batches, the state most spread
    screened.sort(key=lambda c: (RECOMPUTE.get(c.remat or "none", 1.0), c.accum, c.mesh["tensor"], c.state_bytes))
    started = time.perf_counter()
    for candidate in screened[:compiles]:
        candidate.planned = plan(configured(cfg, candidate), target, compile_eval=False)
    say(
        f"search: {len(found)} candidates; {len(found) - len(screened)} ruled out from shapes (invalid, or the "
        f"sharded state alone exceeds {human_bytes(hbm)}); {min(compiles, len(screened))} compiled in "
        f"{time.perf_counter() - started:.0f}s"
    )
    compiled = [c for c in screened if c.planned is not None]
    compiled.sort(key=lambda c: (not c.planned.fits, c.seconds()))  # type: ignore[union-attr]
    return compiled


def render(ranked: list[Candidate]) -> str:
    header = ("rank", "fits", "peak HBM/chip", "ICI/step", "DCN/step", "est. step", "overrides")
    rows = []
    for rank, c in enumerate(ranked, 1):
        p = c.planned
        assert p is not None
        rows.append(
            (
                str(rank),
                "yes" if p.fits else "no",
                human_bytes(p.peak) if p.programs else "refused",
                human_bytes(p.per_step(False)),
                human_bytes(p.per_step(True)),
                f"{c.seconds() * 1e3:.2f} ms",
                " ".join(o for o in c.overrides() if not o.endswith("=1") or o.startswith("train")),
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows])
