"""One run compiled for a TPU target, and what the compiled programs say: memory per chip by
part against the chip's HBM, the collectives over ICI and DCN, and the step time the analytic
FLOPs give at a few MFUs. The run is built exactly as training builds it (engine/run/setup.py's
trace_run and compile_traced), on the target's chips instead of this host's devices."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import jax

from engine.config import Config, with_keys
from engine.config.objective import objective_of, objective_rows
from engine.errors import UsageError
from engine.parallel.axes import BATCH_AXES, CONFIG_AXES
from engine.parallel.mesh import mesh_shape
from engine.parallel.sharding import batch_sharding, batch_shards, per_device_bytes
from engine.plan import hlo
from engine.plan.hlo import Collective
from engine.plan.tpu import Target
from engine.run.cost import analytic_per_example
from engine.run.setup import compile_traced, trace_run, train_loss_chunk
from engine.runtime.units import human_bytes
from models.layers import LossChunk

MFUS = (0.4, 0.5, 0.6)  # the model FLOP utilisations the step time is shown at
BOUND_AT = 0.5  # the MFU at which a step's collectives are weighed against its compute


@dataclass
class Program:
    """One compiled program's memory per chip (bytes)."""

    name: str  # train or eval; GRPO's: update (its train step) and decode (its rollouts)
    params: int
    optimizer: int
    other_state: int  # model state, step, RNG, schedule numbers
    batch: int  # the program's input batch (a train block of steps_per_block batches)
    temporaries: int
    total: int  # arguments + outputs - donated + temporaries + code
    compile_seconds: float
    host: int = 0  # host memory (pinned_host): what remat=offload keeps off the chip (not in total)


@dataclass
class Planned:
    """A run planned on a target."""

    cfg: Config
    target: Target
    mesh: dict[str, int]  # axis → chips
    dcn: dict[str, int]  # axis → how much of it crosses slices
    hbm: int  # bytes per device
    programs: list[Program] = field(default_factory=list)
    collectives: list[Collective] = field(default_factory=list)  # the train program's
    steps_per_call: int = 1
    flops_per_chip: float = 0.0  # analytic model FLOPs of one step, per chip
    tokens_per_step: int = 0
    refused: str = ""  # the compiler's own refusal (out of memory), if any
    refused_program: str = "train"  # the program it refused
    batch_note: str = ""  # how the batch is made where it is not the data's (GRPO's rollouts)
    flops_formula: str = ""  # how the family counts a step's FLOPs (models/family.py FlopsAccounting)
    attention: str = ""  # the attention implementation the programs run ("": the model has none)
    remat: str = ""  # the activation rematerialisation policy ("": the model has none)
    loss: Optional[LossChunk] = None  # the train program's loss chunk (None: the model has none)

    @property
    def peak(self) -> int:
        return max((p.total for p in self.programs), default=0)

    @property
    def fits(self) -> bool:
        return not self.refused and self.peak <= self.hbm

    def per_step(self, dcn: bool) -> float:
        """Bytes per step and chip over DCN (or ICI), as each device sends them (ring algorithms)."""
        return sum(c.ring_bytes * c.count for c in self.collectives if c.dcn == dcn) / self.steps_per_call

    def step_seconds(self, mfu: float) -> float:
        return self.flops_per_chip / (self.target.chip.peak_bf16 * mfu) if self.flops_per_chip else 0.0

    def collective_seconds(self) -> float:
        """A step's collectives at the target's ICI and DCN bandwidths, one after another (no overlap)."""
        chip = self.target.chip
        return self.per_step(False) / chip.ici_bytes_per_second + self.per_step(True) / chip.dcn_bytes_per_second

    def communication_bound(self, mfu: float = BOUND_AT) -> bool:
        """The collectives would take longer than the compute at `mfu`: the chips would wait on the network."""
        return bool(self.flops_per_chip) and self.collective_seconds() > self.step_seconds(mfu)

    def flops_per_token(self) -> float:
        chips = math.prod(self.mesh.values()) or 1
        return self.flops_per_chip * chips / self.tokens_per_step if self.tokens_per_step else 0.0

    def estimate_seconds(self) -> float:
        """FLOPs at the chip's peak plus each collective's bytes at its network's bandwidth (no overlap)."""
        chip = self.target.chip
        return (
            self.step_seconds(1.0)
            + self.per_step(False) / chip.ici_bytes_per_second
            + self.per_step(True) / chip.dcn_bytes_per_second
        )


def plan(
    cfg: Config, target: Target, compile_eval: bool = True, group: Sequence[Config] = (), progress: bool = False
) -> Planned:
    """Builds and compiles `cfg` for `target` (no chip used, no state allocated); with `group`,
    the vectorised program of those runs (a sweep's, engine/run/vectorize.py) instead; `progress`:
    each phase said on stderr as it starts."""
    if cfg.mesh.backend != "jit":
        raise UsageError("plan compiles the jit backend; set mesh.backend=jit (pmap runs one device per replica)")
    _check_slices(cfg, target)
    if len(group) <= 1:  # (a vectorised group's mesh takes a trial axis: build_group checks it)
        _check_mesh(cfg, target)
    cfg, group = _for_plan(cfg), [_for_plan(each) for each in group]
    copies, started = max(len(group), 1), time.perf_counter()
    phases, decode, compiled, train_seconds = Phases(started, progress), None, None, 0.0
    try:
        with _no_persistent_cache():  # a TPU program cannot be loaded back on this host: not worth storing
            program, compiled, state, block = _compile(cfg, target, group, phases)
            train_seconds = time.perf_counter() - started
            if program.rollouts is not None:  # (GRPO: the rollouts' decode program beside the update)
                decode = _decode(program, phases)
    except _Refused as refused:
        return _refused_plan(refused, target, compiled, train_seconds)
    cfg = program.cfg  # (the steps per call the run takes: setup.Traced.cfg)
    planned = _planned(cfg, target, program.mesh)
    planned.attention, planned.remat = model_choices(program)
    planned.loss, planned.batch_note = train_loss_chunk(program), _rollout_note(program)
    parts = _parts(state)
    planned.programs.append(_program(_train_name(program), compiled.program, (*parts, block), train_seconds))
    if decode is not None:  # (GRPO evaluates by sampling with it: its eval step never runs)
        planned.programs.append(
            _program("decode", decode.compiled, (*parts, _prompt_bytes(program)), decode.compile_seconds)
        )
    elif compile_eval:
        planned.programs.append(_program("eval", compiled.eval_step, (*parts, _batch_bytes(program, 0)), 0.0))
    slice_of = [getattr(d, "slice_index", 0) for d in program.mesh.devices.flat]
    planned.collectives = hlo.program_collectives(compiled.program.as_text(), program.mesh.size, slice_of)
    info, family = program.dataset.info, program.family
    # (the objective's count: a DPO pair's two policy rows and the reference's; LoRA's frozen base)
    per_example, formula = (
        analytic_per_example(cfg, family.flops, info, program.state.abstract, objective_of(cfg))
        if family.flops
        else (0.0, "")
    )
    planned.flops_per_chip = per_example * cfg.train.global_batch_size * copies / program.mesh.size
    rows = objective_rows(cfg)  # (rows per example: a DPO pair is two)
    planned.tokens_per_step = cfg.train.global_batch_size * rows * family.task.tokens_per_example(info) * copies
    planned.flops_formula = formula
    return planned


def _refused_plan(refused: _Refused, target: Target, update, train_seconds: float) -> Planned:
    """The plan of a program that does not fit: its parts' figures and why, with the update's own
    figures beside a refused decode (`update`: the compiled update, GRPO's)."""
    planned = _planned(refused.program.cfg, target, refused.program.mesh)
    planned.refused, planned.loss = refused.text, train_loss_chunk(refused.program)
    planned.refused_program = refused.name
    planned.attention, planned.remat = model_choices(refused.program)
    params, optimizer, other, block = refused.parts
    name = _train_name(refused.program)
    if refused.name == "decode":  # (the update compiled: its figures beside the decode's refusal)
        planned.programs.append(_program(name, update.program, refused.parts, train_seconds))
        prompts = _prompt_bytes(refused.program)
        planned.programs.append(Program("decode", params, optimizer, other, prompts, -1, -1, 0.0))
    else:
        planned.programs.append(Program(name, params, optimizer, other, block, -1, -1, 0.0))
    planned.batch_note = _rollout_note(refused.program)
    return planned


def loss_line(planned: Planned) -> str:
    """The train program's loss chunk in words ("" for a model without one)."""
    loss, per = planned.loss, "chip" if planned.target.chip.devices_per_chip == 1 else "device"
    if loss is None:
        return ""
    logits = f"{human_bytes(loss.logits_bytes)} of float32 logits per {per}"
    if not loss.auto:
        return f"loss chunk {loss.chunk or 'none, the whole sequence'} (model.loss_chunk; at once: {logits})"
    if not loss.budget_bytes:
        return f"loss chunk none, the whole sequence at once ({logits}; model.logits_budget_mib=0: no budget)"
    budget = human_bytes(loss.budget_bytes)
    if loss.chunk:
        return f"loss chunk {loss.chunk} (auto: {logits} over the {budget} budget)"
    return f"loss chunk none, the whole sequence at once (auto: {logits} within the {budget} budget)"


def model_choices(program) -> tuple[str, str]:
    """(attention implementation, remat policy) of the module the train step traces (built for
    the target's devices: auto attention resolved as on the TPU), as it resolved them ("": none)."""
    family, model = program.family, program.cfg.model
    module = program.trained if program.trained is not None else program.module
    settings = family.flops.settings_used(model, module) if family.flops else {}
    return str(settings.get("attention", "")), family.remat(model) or ""


def _for_plan(cfg: Config) -> Config:
    """The config as a plan builds it: a corpus's shapes read from its manifest, its shards not
    checked; no persistent compilation cache."""
    data = with_keys(cfg.data, verify=False) if hasattr(cfg.data, "verify") else cfg.data
    return dataclasses.replace(cfg, data=data, train=dataclasses.replace(cfg.train, compilation_cache_dir=""))


class _Refused(Exception):
    """The TPU compiler refused the program (out of memory): an answer, not a failure."""

    def __init__(self, text: str, program, parts: tuple[int, int, int, int], name: str = "train"):
        super().__init__(text)
        self.text, self.program, self.parts, self.name = text, program, parts, name


def _train_name(program) -> str:
    """The train program's name: `update` where the run samples its batches (GRPO), else `train`."""
    return "train" if program.rollouts is None else "update"


def _rollout_note(program) -> str:
    """How a GRPO step's batch is made ("" for data read from the source): prompts x completions."""
    if program.rollouts is None:
        return ""
    cfg = program.cfg
    prompts, grpo = cfg.train.global_batch_size, cfg.grpo
    return (
        f"batch: {prompts:,} prompts a step x {grpo.num_generations} completions (grpo.num_generations) = "
        f"{program.rollouts.rows(cfg):,} rows of {grpo.max_prompt_tokens:,} prompt + "
        f"{grpo.max_completion_tokens:,} completion tokens (grpo.max_prompt_tokens, grpo.max_completion_tokens)"
    )


def _prompt_bytes(program) -> int:
    """Bytes per chip of the decode program's input: the rows' left-padded prompts and their masks."""
    rows, width = program.rollouts.rows(program.cfg), program.cfg.grpo.max_prompt_tokens
    return rows * width * (4 + 1) // batch_shards(program.mesh)  # (int32 tokens, bool mask)


def _decode(program, phase: Phases):
    """The run's rollout sampler built for the target as the run builds it beside the update
    (its objective's RolloutPart.build: the decode program compiled for the rows' static shapes,
    reading the train state's parameters where they lie, the rows split over the batch axes):
    its Decode (engine/lm/rollouts.py); _Refused where the TPU compiler runs out of memory."""
    cfg = program.cfg
    phase(
        f"compiling the rollouts' decode ({program.rollouts.rows(cfg):,} rows of {cfg.grpo.max_prompt_tokens:,} "
        f"+ {cfg.grpo.max_completion_tokens:,} tokens)"
    )
    try:
        sampler = program.rollouts.build(
            cfg, program.family, program.dataset, program.state.abstract, batch_sharding(program.mesh)
        )
    except Exception as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        parts = (*_parts(program.state.abstract), _batch_bytes(program, program.shapes.steps_per_block))
        raise _Refused(str(e).splitlines()[0][:300], program, parts, "decode") from None
    return sampler.decode


class Phases:
    """One line on stderr as each phase of a plan starts, with the time since it began (an 8B
    model's compile takes minutes: the user sees where it is)."""

    def __init__(self, started: float, enabled: bool = True):
        self.started, self.enabled = started, enabled

    def __call__(self, text: str) -> None:
        if self.enabled:
            print(f"plan [{time.perf_counter() - self.started:6.1f}s]: {text}", file=sys.stderr, flush=True)


def _compile(cfg: Config, target: Target, group: Sequence[Config], phase: Phases):
    """(the plan, its compiled steps, the abstract state they take (a group's stacked states), and
    the bytes of a train block per device (each of a group's data orders))."""
    phase(f"the TPU compiler describes {target.name}")
    devices = target.devices
    if len(group) > 1:
        from engine.run.vectorize import build_group, stacked_states

        phase(f"building and compiling the vectorised group of {len(group)} runs")
        built = build_group(list(group), devices=devices)
        block = _batch_bytes(built.traced, built.traced.shapes.steps_per_block) * len(built.batches)
        return built.traced, built.compiled, stacked_states(built), block
    phase("the run's mesh, data, model and train-state shapes")
    program = trace_run(cfg, devices=devices)
    block = _batch_bytes(program, program.shapes.steps_per_block)
    phase("compiling the train and eval steps (docs/multihost.md gives the times to expect)")
    try:
        return program, compile_traced(cfg, program, compile_train=True), program.state.abstract, block
    except Exception as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        parts = (*_parts(program.state.abstract), block)
        raise _Refused(str(e).splitlines()[0][:300], program, parts) from None


def _planned(cfg: Config, target: Target, mesh) -> Planned:
    return Planned(
        cfg,
        target,
        {a: mesh.shape[a] for a in CONFIG_AXES},
        {a: getattr(cfg.mesh, f"dcn_{a}") for a in CONFIG_AXES},
        target.program_hbm_bytes,  # the compiler's own limit, below the chip's nominal HBM
        steps_per_call=cfg.train.steps_per_call,
    )


def _parts(state) -> tuple[int, int, int]:
    """(parameters, optimizer state, the rest of the train state): bytes per device."""
    params, optimizer = per_device_bytes(state.params), per_device_bytes(state.opt_state)
    return params, optimizer, per_device_bytes(state) - params - optimizer


@contextlib.contextmanager
def _no_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache off (it decides once per process whether to use it:
    reset, so that it asks again)."""
    from jax._src import compilation_cache

    enabled = jax.config.values["jax_enable_compilation_cache"]
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", enabled)
        compilation_cache.reset_cache()


def _check_slices(cfg: Config, target: Target) -> None:
    across = math.prod(getattr(cfg.mesh, f"dcn_{a}") for a in CONFIG_AXES)
    if across != target.slices:
        keys = " * ".join(f"mesh.dcn_{a}" for a in CONFIG_AXES)
        # the slices as data-parallel replicas: mesh.data (all of it, over every slice) must hold them
        fits = cfg.mesh.data == -1 or cfg.mesh.data % target.slices == 0
        data = cfg.mesh.data if fits else target.slices * math.ceil(cfg.mesh.data / target.slices)
        example = f"mesh.dcn_data={target.slices}" + (f" mesh.data={data}" if data != cfg.mesh.data else "")
        raise UsageError(
            f"--slices {target.slices} but the mesh puts {across} slice(s) side by side ({keys} = "
            f"{across}); set the dcn_ keys to make {target.slices}, e.g. {example}"
        )


def _check_mesh(cfg: Config, target: Target) -> None:
    """The config's mesh and batch against the target's device count, from the numbers alone:
    libtpu's description of a large topology, and a mesh over it, take seconds and GBs."""
    devices = target.chips * target.chip.devices_per_chip
    sizes = mesh_shape(cfg.mesh, devices)
    axes = [a for a in BATCH_AXES if a in sizes]
    shards = math.prod(sizes[a] for a in axes)
    layout = f"{'*'.join(axes)}={'*'.join(str(sizes[a]) for a in axes)}={shards}"
    batch, accum = cfg.train.global_batch_size, cfg.train.grad_accum_steps
    if batch % shards == 0 and (batch // accum) % shards == 0:
        return
    micro = f" (a micro-batch of {batch // accum} with train.grad_accum_steps={accum})" if accum > 1 else ""
    raise UsageError(
        f"train.global_batch_size={batch}{micro} is not divisible by {layout} on {target.name}, "
        f"{devices} devices; use a global batch that is a multiple of {shards * accum}, or a smaller target"
    )


def _batch_bytes(program, steps: int) -> int:
    """Bytes of one program input per chip: a train block of `steps` batches, or (0) an eval batch."""
    shards = batch_shards(program.mesh)
    rows = program.shapes.global_batch * steps if steps else program.shapes.eval_batch
    return sum(rows * math.prod(a.shape[1:]) * a.dtype.itemsize for a in program.shapes.train_arrays.values()) // shards


def _program(name: str, compiled, parts: tuple, seconds: float) -> Program:
    """The program's memory per device: the whole train state (it stays on the devices for the
    whole run, also where a program reads part of it: the compiler drops unused arguments),
    the batch, the temporaries, outputs that reuse no donated buffer, and the code."""
    m = compiled.memory_analysis()
    params, optimizer, other, batch = parts
    extra = max(m.output_size_in_bytes - m.alias_size_in_bytes, 0) + m.generated_code_size_in_bytes
    total = params + optimizer + other + batch + m.temp_size_in_bytes + extra
    host = m.host_argument_size_in_bytes + m.host_temp_size_in_bytes
    host += max(m.host_output_size_in_bytes - m.host_alias_size_in_bytes, 0)  # (offloaded activations: temporaries)
    return Program(name, params, optimizer, other, batch, m.temp_size_in_bytes, total, seconds, host)


def as_record(planned: Planned) -> dict[str, Any]:
    """The plan as JSON-ready numbers (--json, BENCHMARKS)."""
    return {
        "target": planned.target.name,
        "chips": planned.target.chips,
        "mesh": planned.mesh,
        "fits": planned.fits,
        "hbm_bytes": planned.hbm,
        "attention": planned.attention,
        "remat": planned.remat,
        "refused": planned.refused,
        "programs": [vars(p) for p in planned.programs],
        "ici_bytes_per_step": planned.per_step(False),
        "dcn_bytes_per_step": planned.per_step(True),
        "flops_per_chip_step": planned.flops_per_chip,
        "step_seconds": {f"{m:.0%}": planned.step_seconds(m) for m in MFUS},
        "tokens_per_step": planned.tokens_per_step,
        "flops_per_token": planned.flops_per_token(),
        "collective_seconds_per_step": planned.collective_seconds(),
        "communication_bound": planned.communication_bound(),
        "loss_chunk": dataclasses.asdict(planned.loss) if planned.loss else None,
    }
