"""A plan as text: its mesh, memory per program against the chip's HBM, collectives, step time
at a few MFUs with the collectives weighed against the compute, and the one-line verdict (fits,
or does not and what would, or waits on the network and what would not)."""

from __future__ import annotations

from typing import Optional

import numpy as np

from engine.parallel.axes import BATCH_AXES
from engine.parallel.stages import describe as describe_pipeline
from engine.parallel.stages import stage_plan
from engine.plan.compiled import BOUND_AT, MFUS, Planned, Program, loss_line
from engine.plan.hlo import Collective
from engine.runtime.units import human_bytes
from models import REGISTRY
from models.family import stacked_layers

LOW_HEADROOM = 0.05  # a plan that fits with less is warned about
# remat=full recomputes each layer's forward in the backward pass: 8 FLOPs per parameter and token
# on the chips where the model's count (6: 2 forward, 4 backward) has 6
RECOMPUTED = {"full": 8 / 6}


def render(planned: Planned) -> str:
    """The plan as text: mesh, memory per program, collectives, time, and the verdict."""
    target, lines = planned.target, []
    axes = [f"{a}={n} ({_links(planned, a, n)})" for a, n in planned.mesh.items() if n > 1]
    lines.append(
        f"target: {target.name}, {target.chips} chips of {human_bytes(planned.hbm)} HBM"
        + (f" per device ({target.chip.devices_per_chip} per chip)" if target.chip.devices_per_chip > 1 else "")
    )
    lines.append(f"mesh: {' x '.join(axes) or 'one chip'}")
    lines.append(planned.batch_note or _batch_line(planned))
    stages = stage_plan(planned.cfg, planned.mesh.get("pipeline", 1))
    if stages.stages > 1:
        lines.append(describe_pipeline(stages, stacked_layers(REGISTRY[planned.cfg.model.name], planned.cfg.model)))
    lines += _model_lines(planned)
    lines += [line for line in [loss_line(planned)] if line]
    lines += _memory_table(planned)
    lines += _host_lines(planned)
    if planned.refused:
        lines.append(f"the TPU compiler refused the {planned.refused_program} program: {planned.refused}")
        return "\n".join(lines)
    lines += _collective_lines(planned)
    lines += _time_lines(planned)
    lines.append(
        "compile: " + ", ".join(f"{p.name} {p.compile_seconds:.1f}s" for p in planned.programs if p.compile_seconds)
    )
    return "\n".join(lines)


def _links(planned: Planned, axis: str, size: int) -> str:
    """How an axis's devices talk: over ICI inside a slice, or its outer factor over DCN."""
    across = planned.dcn[axis]
    return f"DCN x{across}, ICI x{size // across}" if across > 1 else "ICI"


def _batch_line(planned: Planned) -> str:
    """The batch the programs were planned for: global batch, sequence length, micro-batches."""
    cfg = planned.cfg
    batch, accum = cfg.train.global_batch_size, cfg.train.grad_accum_steps
    seq = getattr(cfg.data, "seq_len", 0)
    text = f"batch: {batch:,} examples a step" + (f" of {seq:,} tokens ({batch * seq:,} tokens)" if seq else "")
    return text + (f", in {accum} micro-batches of {batch // accum:,} (train.grad_accum_steps)" if accum > 1 else "")


def _model_lines(planned: Planned) -> list[str]:
    """The attention implementation and remat policy the programs were built with."""
    named = [f"{key} {value}" for key, value in (("attention", planned.attention), ("remat", planned.remat)) if value]
    return [f"model: {', '.join(named)}"] if named else []


def _host_lines(planned: Planned) -> list[str]:
    """Host memory per chip, where a program keeps activations there (remat=offload): not in HBM."""
    offloaded = [f"{p.name} {human_bytes(p.host)}" for p in planned.programs if p.host > 0]
    if not offloaded:
        return []
    return [f"host memory per chip (pinned_host, offloaded: not in the HBM above): {', '.join(offloaded)}"]


def _memory_table(planned: Planned) -> list[str]:
    header = ("per chip", "params", "optimizer", "other state", "batch", "temporaries", "total", "HBM", "headroom")
    rows = []
    for p in planned.programs:
        sizes = (p.params, p.optimizer, p.other_state, p.batch, p.temporaries, p.total, planned.hbm)
        cells = [human_bytes(v) if v >= 0 else "refused" for v in sizes]  # (-1: the compiler gave no figure)
        rows.append((p.name, *cells, f"{(planned.hbm - p.total) / planned.hbm:+.0%}" if p.total >= 0 else "-"))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
        for row in [header, *rows]
    ]


def _collective_lines(planned: Planned) -> list[str]:
    kinds: dict[tuple[str, bool], list[Collective]] = {}
    for c in planned.collectives:
        kinds.setdefault((c.op, c.dcn), []).append(c)
    lines = [
        f"collectives per step (train; a device's share, ring algorithms): ICI "
        f"{human_bytes(planned.per_step(False))}, DCN {human_bytes(planned.per_step(True))}"
    ]
    for (op, dcn), found in sorted(kinds.items()):
        runs = sum(c.count for c in found) / planned.steps_per_call
        size = sum(c.bytes * c.count for c in found) / planned.steps_per_call
        lines.append(f"  {op:<19} {'DCN' if dcn else 'ICI'}  x{runs:g} per step, {human_bytes(size)} of buffers")
    return lines


def _time_lines(planned: Planned) -> list[str]:
    if not planned.flops_per_chip:
        return ["step time: the model family gives no FLOP formula"]
    chip = planned.target.chip
    cells = []
    for mfu in MFUS:
        seconds = planned.step_seconds(mfu)
        tokens = f", {planned.tokens_per_step / seconds:,.0f} tokens/s" if planned.tokens_per_step else ""
        cells.append(f"{mfu:.0%} MFU {seconds * 1e3:,.1f} ms{tokens}")
    lines = [
        f"analytic model FLOPs per chip per step: {planned.flops_per_chip:.4g} (peak {chip.peak_bf16 / 1e12:g} "
        f"TFLOP/s bf16); step time at " + "; ".join(cells) + " (estimates: analytic FLOPs at an assumed MFU)"
    ]
    if planned.tokens_per_step:
        lines.append(
            f"FLOPs per token: {planned.flops_per_token():.4g} ({planned.flops_formula}; 6 per parameter and "
            "token: 2 forward, 4 backward; remat's recomputation not counted)"
        )
    recomputed = RECOMPUTED.get(planned.remat, 1.0)
    if recomputed > 1:
        lines.append(
            f"with remat={planned.remat} the chips also recompute each layer's forward: {recomputed:.2f}x those "
            f"FLOPs, a step at {BOUND_AT:.0%} MFU takes {milliseconds(planned.step_seconds(BOUND_AT) * recomputed)}"
        )
    compute, comm = planned.step_seconds(BOUND_AT), planned.collective_seconds()
    bound = "communication-bound" if planned.communication_bound() else "compute-bound"
    lines.append(
        f"collectives per step: {milliseconds(comm)} at {chip.ici_bytes_per_second / 1e9:g} GB/s ICI and "
        f"{chip.dcn_bytes_per_second / 1e9:g} GB/s DCN per chip (none overlapped), against {milliseconds(compute)} "
        f"of compute at {BOUND_AT:.0%} MFU: {bound}"
    )
    return lines


def verdict(planned: Planned) -> str:
    """One line: fits (with headroom), or does not, naming the largest parts and changes that would fit."""
    if planned.fits:
        headroom = (planned.hbm - planned.peak) / planned.hbm
        warning = (
            f"; warning: under {LOW_HEADROOM:.0%} headroom, a larger batch or another compiler version may not fit"
            if headroom < LOW_HEADROOM
            else ""
        )
        return (
            f"fits: {human_bytes(planned.peak)} per device of the {human_bytes(planned.hbm)} the TPU compiler "
            f"gives a program ({headroom:.0%} headroom){warning}{_bound(planned)}"
        )
    if planned.refused:
        fixes = _decode_fixes(planned) if planned.refused_program == "decode" else _fixes(planned, None)
        return (
            f"does not fit: the TPU compiler refused the {planned.refused_program} program ({planned.refused}); {fixes}"
        )
    worst = max(planned.programs, key=lambda p: p.total)
    parts = {
        "parameters": worst.params,
        "optimizer state": worst.optimizer,
        "temporaries": worst.temporaries,
        "batch": worst.batch,
    }
    largest = ", ".join(
        f"{name} {human_bytes(size)}" for name, size in sorted(parts.items(), key=lambda kv: -kv[1])[:3]
    )
    fixes = _decode_fixes(planned) if worst.name == "decode" else _fixes(planned, worst)
    return (
        f"does not fit: the {worst.name} program needs {human_bytes(worst.total)} per device of "
        f"{human_bytes(planned.hbm)} ({largest}); {fixes}"
    )


def _decode_fixes(planned: Planned) -> str:
    """What shrinks GRPO's decode program: its key/value cache grows with the rows and their tokens."""
    cfg = planned.cfg
    grpo, prompts = cfg.grpo, cfg.train.global_batch_size
    return (
        f"try fewer rows (train.global_batch_size={max(prompts // 2, 1)} prompts, or grpo.num_generations="
        f"{max(grpo.num_generations // 2, 2)}), shorter rollouts (grpo.max_completion_tokens="
        f"{max(grpo.max_completion_tokens // 2, 1)}), or mesh.fsdp over more chips (the parameters it reads)"
    )


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e3:.3g} ms"


def _bound(planned: Planned) -> str:
    """ "" for a step whose compute hides its collectives; else what waits on the network, and the fixes."""
    if not planned.communication_bound():
        return ""
    fixes = [
        f"a larger batch per chip (train.global_batch_size={planned.cfg.train.global_batch_size * 2}: the "
        "collectives of the weights and gradients do not grow with it)"
    ]
    if planned.mesh.get("tensor", 1) == 1:
        fixes.append("mesh.tensor=2 or 4 inside a host's chips (each all-gather moves a smaller part)")
    if planned.mesh.get("fsdp", 1) > 1:
        fixes.append(
            "fewer chips in mesh.fsdp and more in mesh.data where the state still fits (one reduction of the "
            "gradients per step instead of all-gathers per layer)"
        )
    return (
        f"; warning: communication-bound at {BOUND_AT:.0%} MFU ({milliseconds(planned.collective_seconds())} of "
        f"collectives against {milliseconds(planned.step_seconds(BOUND_AT))} of compute per step): try "
        + ", or ".join(fixes)
    )


def _fixes(planned: Planned, worst: Optional[Program]) -> str:
    cfg, chips, fixes = planned.cfg, planned.target.chips, []
    fsdp = planned.mesh["fsdp"]
    state = worst.params + worst.optimizer if worst else 1
    if fsdp < chips and (worst is None or state >= worst.temporaries):
        wider = min(chips, fsdp * 4)
        fixes.append(
            f"mesh.fsdp={wider} with mesh.data={max(planned.mesh['data'] * fsdp // wider, 1)} (parameters "
            f"and optimizer state over {wider} chips)"
        )
    family = REGISTRY[cfg.model.name]
    remat = family.remat(cfg.model)
    if remat not in (None, "full", "offload"):
        slower = ""
        if planned.flops_per_chip:  # (the recomputation counted: the step is slower, say by how much)
            full = planned.step_seconds(BOUND_AT) * RECOMPUTED["full"] / RECOMPUTED.get(remat, 1.0)
            slower = f": {milliseconds(full)} a step at {BOUND_AT:.0%} MFU with the recomputation"
        fixes.append(f"model.remat=full (recompute activations{slower})")
    elif remat == "full":
        fixes.append("model.remat=offload (each layer's saved input in host memory)")
    accum = _accumulation(planned, worst)
    if accum:
        fixes.append(accum)
    return "try " + ", or ".join(fixes) if fixes else "use a larger target or a smaller model"


def _accumulation(planned: Planned, worst: Optional[Program]) -> str:
    """The fewest gradient-accumulation steps (doubling) whose micro-batch still splits over the
    batch axes and whose program would fit by the estimate that its temporaries (the activations)
    shrink with the micro-batch; "" where none would. Without a program's figures: twice as many."""
    cfg = planned.cfg
    accum, shards = cfg.train.grad_accum_steps, batch_shards_of(planned)
    micro = cfg.train.global_batch_size // accum
    room = planned.hbm * (1 - LOW_HEADROOM)
    for factor in (2, 4, 8, 16, 32, 64):
        if micro % factor or (micro // factor) % shards:
            break
        if worst is None:
            return f"train.grad_accum_steps={accum * factor} (a micro-batch of {micro // factor})"
        estimate = worst.total - worst.temporaries + worst.temporaries / factor
        if estimate <= room:
            return (
                f"train.grad_accum_steps={accum * factor} (a micro-batch of {micro // factor}: an estimated "
                f"{human_bytes(int(estimate))} per device, the temporaries 1/{factor})"
            )
    return ""


def batch_shards_of(planned: Planned) -> int:
    return int(np.prod([planned.mesh.get(a, 1) for a in BATCH_AXES]))
