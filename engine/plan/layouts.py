"""`launch.py plan --search`: layouts for a target, ranked. A candidate is a split of the chips
over the mesh axes, a remat policy (models/remat.py's, where the family has remat), an attention
(auto, which is splash on the target, or XLA's, where the family has splash and the sequence
tiles), a loss chunk (auto or an explicit one, for language models) and a micro-batch (gradient
accumulation). Candidates whose sharded train state alone does not fit a chip are ruled out
from shapes (no compile); the rest are ordered before compiling: those whose state plus a rough
activation estimate (footprint.py) fits first (the rest by that estimate), then splash before
XLA, the least recomputation, the auto loss chunk, the fewest micro-batches, the state most
spread. The first `compiles` are compiled with the TPU compiler; the table ranks those by fit,
then by step time (the analytic FLOPs at the chip's peak, with remat's recomputation, plus the
compiled program's collective bytes at the ICI and DCN bandwidths of engine/runtime/tpu_chips.py)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass
from typing import Any, Optional, cast

from contract.fields import choices_of
from engine.config import Config
from engine.errors import UsageError
from engine.parallel.axes import CONFIG_AXES
from engine.parallel.sharding import per_device_bytes
from engine.plan.compiled import Planned, plan
from engine.plan.footprint import Widths, activation_bytes
from engine.plan.tpu import Target
from engine.run.blueprint import replicas_from
from engine.run.setup import trace_run
from engine.runtime.units import human_bytes
from models import REGISTRY
from models.family import ModelFamily, num_experts, splits_sequence
from models.remat import RECOMPUTE
from models.splash import chosen_attention

ACCUMS = (1, 2, 4, 8)  # micro-batches per step tried
LOSS_CHUNKS = (1024, 512)  # the explicit model.loss_chunk tried beside auto: the largest that divides the sequence
ESTIMATE_MARGIN = 0.9  # a candidate "fits by the estimate" under this share of a chip's HBM (the estimate is rough)


@dataclass
class Candidate:
    mesh: dict[str, int]
    remat: Optional[str]  # None: the family has no remat setting
    accum: int
    attention: Optional[str] = None  # the model.attention set (auto: splash on the target); None: the config's
    loss_chunk: Optional[int] = None  # the model.loss_chunk set (0: auto); None: the family has none
    kernel: str = "-"  # the attention the target runs (splash, xla; -: the family has no attention setting)
    state_bytes: int = 0  # the sharded train state per device, from shapes
    activation_bytes: int = 0  # a rough estimate from the shapes (footprint.py); 0: none made
    planned: Optional[Planned] = None

    def overrides(self, cfg: Optional[Config] = None) -> list[str]:
        """The key=value overrides that give the config this candidate; given `cfg`, only those
        whose value differs from cfg's own (what to type after cfg's to get the candidate)."""
        settings: dict[str, Any] = {f"mesh.{axis}": size for axis, size in self.mesh.items()}
        settings |= {"model.remat": self.remat, "model.attention": self.attention, "model.loss_chunk": self.loss_chunk}
        settings["train.grad_accum_steps"] = self.accum
        return [
            f"{key}={value}"
            for key, value in settings.items()
            if value is not None and (cfg is None or _config_value(cfg, key) != value)
        ]

    def seconds(self) -> float:
        """The estimate the table ranks by (inf when not compiled)."""
        if self.planned is None:
            return math.inf
        return self.planned.estimate_seconds() + self.planned.step_seconds(1.0) * (
            RECOMPUTE.get(self.remat or "none", 1.0) - 1
        )


def _config_value(cfg: Config, key: str) -> Any:
    """cfg's value of a dotted `section.name` key (None: the section has no such key)."""
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name, None)


def candidates(cfg: Config, target: Target) -> list[Candidate]:
    """Every split of the chips over the configured axes (powers of two; each axis a multiple of
    its dcn_ factor), with each remat policy, attention, loss chunk and micro-batch count the
    config allows."""
    chips, family = target.chips, REGISTRY[cfg.model.name]
    usable = [
        a
        for a in CONFIG_AXES
        if a in ("data", "fsdp", "tensor")
        or (a == "context" and splits_sequence(family))
        or (a == "expert" and num_experts(family, cfg.model) > 0)
    ]
    sizes = [2**i for i in range(int(math.log2(chips)) + 1)]
    remats, chunks = remat_choices(cfg, family), loss_chunk_choices(cfg, family)
    found = []
    for split in itertools.product(sizes, repeat=len(usable)):
        if math.prod(split) != chips:
            continue
        mesh = {a: 1 for a in CONFIG_AXES} | dict(zip(usable, split))
        if any(mesh[a] % getattr(cfg.mesh, f"dcn_{a}") for a in CONFIG_AXES):
            continue
        shards = mesh["data"] * mesh["fsdp"] * mesh["expert"]
        for remat, (attention, kernel), chunk, accum in itertools.product(
            remats, attention_choices(cfg, mesh), chunks, ACCUMS
        ):
            micro = cfg.train.global_batch_size // accum
            if cfg.train.global_batch_size % accum == 0 and micro % shards == 0:
                found.append(Candidate(mesh, remat, accum, attention, chunk, kernel))
    return found


def _choices(model_cfg, key: str) -> Optional[tuple]:
    """The allowed values of the model config's `key` (None: any, or no such key)."""
    fields = {f.name: f for f in dataclasses.fields(model_cfg)}
    return choices_of(fields[key]) if key in fields else None


def remat_choices(cfg: Config, family: ModelFamily) -> list[Optional[str]]:
    """models/remat.py's policies that model.remat accepts ([None]: the family has no remat)."""
    if family.remat(cfg.model) is None:
        return [None]
    accepted = _choices(cfg.model, "remat") or tuple(RECOMPUTE)
    return [name for name in RECOMPUTE if name in accepted]


def attention_choices(cfg: Config, mesh: dict[str, int]) -> list[tuple[Optional[str], str]]:
    """(model.attention to set, the attention the TPU target runs) pairs: auto (splash) and xla
    where the family has splash and auto picks it here (the sequence tiles, the step runs per
    device, no context split); else the config's own (None), which is XLA's on a TPU (cuDNN is
    for GPUs; a config's own splash that cannot run here is the model's to refuse)."""
    if "attention" not in {f.name for f in dataclasses.fields(cfg.model)}:
        return [(None, "-")]
    seq = getattr(cfg.data, "seq_len", 0)
    per_device = mesh.get("context", 1) == 1 and not replicas_from(cfg)
    splash = "splash" in (_choices(cfg.model, "attention") or ())
    if splash and chosen_attention("auto", "tpu", cfg.train.compute_dtype, seq, per_device) == "splash":
        return [("auto", "splash"), ("xla", "xla")]
    return [(None, "xla")]


def loss_chunk_choices(cfg: Config, family: ModelFamily) -> list[Optional[int]]:
    """model.loss_chunk of a language model whose loss chunks: 0 (auto) and the largest of
    LOSS_CHUNKS below the sequence that divides it; [None] for other families."""
    if family.language_model is None or family.language_model.loss_chunk is None:
        return [None]
    seq = getattr(cfg.data, "seq_len", 0)
    explicit = next((c for c in LOSS_CHUNKS if c < seq and seq % c == 0), 0)
    return [0, explicit] if explicit else [0]


def configured(cfg: Config, candidate: Candidate) -> Config:
    """`cfg` with the candidate's mesh, remat policy, attention, loss chunk and accumulation (a new config)."""
    settings = {"remat": candidate.remat, "attention": candidate.attention, "loss_chunk": candidate.loss_chunk}
    model = dataclasses.replace(cfg.model, **{key: value for key, value in settings.items() if value is not None})
    return dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cast(Any, cfg.mesh), **candidate.mesh),  # (MeshConfig: made from the axes)
        model=model,
        train=dataclasses.replace(cfg.train, grad_accum_steps=candidate.accum),
    )


def screen(cfg: Config, target: Target) -> tuple[list[Candidate], list[Candidate]]:
    """Every candidate, and those whose sharded state fits a chip in the order they would be
    compiled. One shapes-only plan per mesh: the micro-batch count, remat, attention and loss
    chunk do not change the train state (candidates() keeps the micro-batches the batch axes divide)."""
    found = candidates(cfg, target)
    hbm = target.chip.hbm_bytes // target.chip.devices_per_chip
    devices = target.devices  # (a target the TPU compiler refuses is said here, not taken for a refused layout)
    shapes: dict[tuple, Any] = {}  # mesh → (the shapes-only plan, the decoder's widths), or None: refused
    screened = []
    for candidate in found:
        key = tuple(candidate.mesh.items())
        if key not in shapes:
            try:
                program = trace_run(configured(cfg, candidate), devices=devices)
                shapes[key] = (program, Widths.of(program.state.param_layouts))
            except UsageError:  # a layout the model refuses (tensor not dividing the heads, ...)
                shapes[key] = None
        if shapes[key] is None:
            continue
        program, widths = shapes[key]
        candidate.state_bytes = per_device_bytes(program.state.abstract)
        candidate.activation_bytes = activation_bytes(
            configured(cfg, candidate), program.family, program.dataset.info, widths, candidate.mesh, candidate.kernel
        )
        if candidate.state_bytes <= hbm:
            screened.append(candidate)
    screened.sort(key=lambda c: _compile_order(c, hbm))
    return found, screened


def _estimated_over(c: Candidate, hbm: int) -> bool:
    return c.state_bytes + c.activation_bytes > ESTIMATE_MARGIN * hbm


def _compile_order(c: Candidate, hbm: int) -> tuple:
    """Fitting by the estimate first (the rest by it), then splash before XLA, the least
    recomputation (ties: models/remat.py's order), auto loss chunk, the fewest micro-batches,
    the least tensor parallelism and the state most spread."""
    over = _estimated_over(c, hbm)
    estimate = c.state_bytes + c.activation_bytes if over else 0
    recompute = RECOMPUTE.get(c.remat or "none", 1.0)
    policy = list(RECOMPUTE).index(c.remat) if c.remat in RECOMPUTE else 0
    spread = (c.mesh["tensor"], c.state_bytes)
    return (over, estimate, c.kernel == "xla", recompute, policy, bool(c.loss_chunk), c.accum, *spread)


def search(cfg: Config, target: Target, compiles: int, say=print) -> list[Candidate]:
    """Ranked candidates (the compiled ones first: fitting, then by step-time estimate)."""
    found, screened = screen(cfg, target)
    hbm = target.chip.hbm_bytes // target.chip.devices_per_chip
    over = sum(_estimated_over(c, hbm) for c in screened)
    started = time.perf_counter()
    for candidate in screened[:compiles]:
        candidate.planned = plan(configured(cfg, candidate), target, compile_eval=False)
    say(
        f"search: {len(found)} candidates; {len(found) - len(screened)} ruled out from shapes (invalid, or the "
        f"sharded state alone exceeds {human_bytes(hbm)}); {over} more past {ESTIMATE_MARGIN:.0%} of it with "
        f"their estimated activations (tried last); {min(compiles, len(screened))} compiled in "
        f"{time.perf_counter() - started:.0f}s"
    )
    compiled = [c for c in screened if c.planned is not None]
    compiled.sort(key=lambda c: (not c.planned.fits, c.seconds()))  # type: ignore[union-attr]
    return compiled


def render(ranked: list[Candidate], cfg: Config) -> str:
    """The ranked candidates as a table; each row's overrides are those that change `cfg` (the
    searched config) into the candidate, to type after its own."""
    header = (
        "rank",
        "fits",
        "peak HBM/chip",
        "ICI/step",
        "DCN/step",
        "est. step",
        "attention",
        "loss chunk",
        "overrides",
    )
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
                c.kernel,
                "-" if c.loss_chunk is None else str(c.loss_chunk or "auto"),
                " ".join(c.overrides(cfg)) or "(as configured)",
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in [header, *rows])
