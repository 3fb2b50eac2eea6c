"""The run configuration's schema: one dataclass per section, every key declared with its
default, meaning, choices and bounds (contract.fields.option). The `model` section's schema
is the chosen family's dataclass (models/configs.py), the `data` section's the chosen source's
(data_sections.py); the mesh axes' keys come from engine/parallel/axes.py. Every section is
frozen: a loaded config is never changed in place (dataclasses.replace builds another).
docs/configuration.md is generated from this (python -m engine.config.reference).

Imports no jax: a sweep's process reads every run's config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from contract.fields import option
from engine.config.data_sections import DataConfig
from engine.config.eval_section import EvalConfig
from engine.config.grpo_section import GrpoConfig
from engine.config.objective import objective_names
from engine.config.optimizers import OPTIMIZERS, SCHEDULES, WEIGHT_DECAY_ON
from engine.observe.trackers import TRACKERS
from engine.parallel import strategies
from engine.parallel.axes import AXES, CONFIG_AXES, default_rules

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EarlyStopConfig:
    """train.early_stop: the run ends when an eval metric stops improving (Keras's EarlyStopping)."""

    metric: str = option("", 'the eval metric watched at each evaluation: eval/loss, eval/accuracy, ... ("" = off)')
    mode: str = option("min", "min: lower is better (a loss); max: higher is (an accuracy)", choices=("min", "max"))
    patience: int = option(
        3, "evaluations in a row without an improvement after which the run ends (as Keras counts epochs)", at_least=0
    )
    min_delta: float = option(0.0, "the least change of the metric that counts as an improvement", at_least=0.0)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = option(1000, "optimizer steps in the whole run", at_least=1)
    global_batch_size: int = option(128, "examples per step, over all devices and processes", at_least=1)
    grad_accum_steps: int = option(
        1,
        "microbatches per step, accumulated inside the compiled step (equal to "
        "one big batch); each is global_batch_size / this",
        at_least=1,
    )
    steps_per_call: int = option(
        1,
        "the most optimizer steps per dispatch of the compiled step, in a "
        "device-side loop (Keras's steps_per_execution); calls end at every log, "
        "eval and checkpoint",
        at_least=1,
    )
    microbatches: int = option(
        0,
        "mesh.pipeline > 1: micro-batches each step's batch flows through the stages in (0 = one per stage); "
        "at least the stages",
        at_least=0,
    )
    sync: str = option(
        "every_step",
        "every_step: one gradient all-reduce over the data-parallel devices per step; diloco: replicas "
        "(diloco.replica_axis) each take diloco.inner_steps steps alone, then average their change "
        "(docs/parallelism.md)",
        choices=lambda: tuple(strategies.STRATEGIES),
    )
    param_dtype: str = option("float32", "dtype the parameters are stored and updated in", choices=DTYPES)
    compute_dtype: str = option("float32", "dtype of activations and matmuls (bfloat16 for speed)", choices=DTYPES)
    nan_policy: str = option(
        "stop", "what a NaN or infinite loss does: stop (exit 1, naming the step) or warn", choices=("stop", "warn")
    )
    matmul_dtype: str = option(
        "none",
        "the projections' matmuls on quantised operands (qwix, per-channel scales, straight-through "
        "gradients): fp8 (e4m3; gradients e5m2) or int8; none: compute_dtype. Llama-family models",
        choices=("none", "fp8", "int8"),
    )
    objective: str = option(
        "lm",
        "what the run trains for: lm (next-token cross-entropy, or the model's own loss) or dpo (direct "
        "preference optimisation on data.name=preferences pairs; the `dpo` section) or grpo (group-relative "
        "policy optimisation with reward functions on data.name=prompts; the `grpo` section)",
        choices=objective_names,
    )
    eager: bool = option(False, "run the step without jit, op by op (slow; for debugging, like TF eager)")
    compilation_cache_dir: str = option(
        "~/.cache/jax-engine/xla", 'JAX\'s persistent compilation cache ("" = off): a relaunch skips XLA compilation'
    )
    early_stop: EarlyStopConfig = dataclasses.field(default_factory=EarlyStopConfig)


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = option("adam", "the optimizer (engine/config/optimizers.py)", choices=lambda: tuple(OPTIMIZERS))
    learning_rate: float = option(1e-3, "peak learning rate", above=0.0)
    schedule: str = option(
        "constant",
        "the learning-rate schedule; the decaying ones decay to the end of the run",
        choices=lambda: tuple(SCHEDULES),
    )
    warmup_steps: int = option(0, "linear warm-up from 0 to learning_rate", at_least=0)
    end_learning_rate_factor: float = option(0.0, "final rate of the decaying schedules, as a fraction of the peak")
    decay_fraction: float = option(0.2, "wsd: the last share of the run over which the rate decays")
    momentum: float = option(0.9, "SGD momentum, or Adam's b1")
    b2: float = option(0.999, "Adam's second-moment decay")
    eps: float = option(1e-8, "Adam's epsilon")
    weight_decay: float = option(0.0, "decoupled weight decay (adamw, lion, adafactor, muon)", at_least=0)
    weight_decay_on: str = option(
        "all",
        "which parameters decay: all, or matrices (not norms' scales nor biases, as LLM recipes do)",
        choices=lambda: WEIGHT_DECAY_ON,
    )
    grad_clip_norm: float = option(0.0, "clip gradients to this global norm (0 = off)", at_least=0)


def _mesh_fields() -> list:
    """mesh.<axis> and mesh.dcn_<axis> for every configured axis of engine/parallel/axes.py."""
    fields = []
    for axis in AXES:
        if axis.configured:
            fields.append((axis.name, int, option(axis.default, axis.doc)))
    for name in CONFIG_AXES:
        fields.append(
            (
                f"dcn_{name}",
                int,
                option(
                    1,
                    f"how much of mesh.{name} crosses the slower data-center "
                    "network (its outer part; multi-slice and multi-host)",
                    at_least=1,
                ),
            )
        )
    return fields


_MESH_SETTINGS = [
    ("num_devices", int, option(-1, "how many of the visible devices to use (-1 = all)")),
    (
        "backend",
        str,
        option(
            "jit",
            "jit (NamedSharding, every layout) or pmap (classic replicated data parallel)",
            choices=("jit", "pmap"),
        ),
    ),
    (
        "rules",
        dict[str, list[str]],
        option(
            default_rules(),
            "logical axis name → mesh axes to try, in order: the "
            "first that is free, larger than 1 and divides the "
            "dimension shards it (see docs/parallelism.md)",
        ),
    ),
]

if TYPE_CHECKING:

    class MeshConfig:
        """What the type checker knows of the dataclass made below from engine/parallel/axes.py."""

        num_devices: int
        backend: str
        rules: dict[str, list[str]]

        def __getattr__(self, name: str) -> int: ...  # mesh.<axis>, mesh.dcn_<axis>

else:
    MeshConfig = dataclasses.make_dataclass("MeshConfig", [*_mesh_fields(), *_MESH_SETTINGS], frozen=True)
    MeshConfig.__module__ = __name__
    MeshConfig.__doc__ = "mesh.*: the device mesh's axis sizes (engine/parallel/axes.py) and the sharding rules."


@dataclass(frozen=True)
class PipelineConfig:
    """How a layer stack split over mesh.pipeline stages runs (docs/parallelism.md)."""

    schedule: str = option(
        "gpipe",
        "gpipe: each stage holds one group of consecutive layers; circular: each holds pipeline.repeats "
        "groups, a micro-batch goes round the stages that many times (a smaller bubble)",
        choices=("gpipe", "circular"),
    )
    repeats: int = option(2, "circular: groups of layers per stage (gpipe: 1)", at_least=1)


@dataclass(frozen=True)
class DilocoConfig:
    """train.sync=diloco: replicas train alone for diloco.inner_steps steps, then an outer optimizer
    applies their mean parameter change to the global parameters (DiLoCo; docs/parallelism.md)."""

    inner_steps: int = option(20, "steps each replica takes alone between two exchanges (H)", at_least=1)
    replica_axis: str = option(
        "dcn_data",
        "which devices hold the replicas: dcn_data (the slices of mesh.dcn_data; each replica spans "
        "mesh.data / mesh.dcn_data of them) or data (every data-parallel index a replica)",
        choices=("dcn_data", "data"),
    )
    outer_optimizer: str = option(
        "nesterov",
        "applies the replicas' mean change: nesterov, momentum or sgd",
        choices=("nesterov", "momentum", "sgd"),
    )
    outer_learning_rate: float = option(0.7, "the outer optimizer's learning rate", above=0.0)
    outer_momentum: float = option(0.9, "the outer optimizer's momentum (nesterov, momentum)", at_least=0.0)
    delay: int = option(
        0,
        "rounds between an outer gradient's exchange and its use: 0 (applied at the end of its own round) "
        "or 1 (the overlapped outer step: applied at the end of the next round, so its all-reduce can "
        "overlap that round's inner steps; replicas restart each round from the global parameters)",
        choices=(0, 1),
    )


@dataclass(frozen=True)
class DpoConfig:
    """train.objective=dpo: direct preference optimisation against the frozen starting point (the
    reference), with Hugging Face TRL's DPOTrainer's losses and metric names (docs/language-models.md)."""

    beta: float = option(0.1, "how far the policy may move from the reference (TRL's beta)", above=0.0)
    loss: str = option(
        "sigmoid",
        "TRL's loss_type: sigmoid (DPO), ipo (IPO's squared loss) or hinge (SLiC's)",
        choices=("sigmoid", "ipo", "hinge"),
    )
    label_smoothing: float = option(
        0.0,
        "sigmoid: the share of pairs taken as mislabelled (conservative DPO), in [0, 0.5); as TRL's sigmoid "
        "loss before 0.29: TRL 1.x ignores label_smoothing for sigmoid (its robust loss takes it)",
        at_least=0.0,
    )
    precompute_reference: bool = option(
        False,
        "compute the reference's log-probabilities of every pair once before training (cached in the "
        "workdir's reference_logps/) instead of in every step: no reference model runs in the step, and "
        "full fine-tuning keeps no copy of the starting parameters",
    )


@dataclass(frozen=True)
class LoraConfig:
    rank: int = option(0, "adapter rank r (0 = no LoRA: every parameter trains)", at_least=0)
    alpha: float = option(16.0, "the adapters' scale is alpha / rank", above=0.0)
    dropout: float = option(0.0, "dropout on the adapters' input (training only)", at_least=0.0)
    targets: list[str] = option(
        ["attention"],
        "projections that get adapters: attention, mlp, all, names (query, key, value, out, gate, up, "
        "down), Hugging Face's (q_proj, …) or globs over them",
    )
    init: str = option(
        "gaussian",
        "A's initialiser: gaussian (std 1/rank) or kaiming (uniform, PEFT's default); B starts at zero",
        choices=("gaussian", "kaiming"),
    )


@dataclass(frozen=True)
class FinetuneConfig:
    """LoRA adapters on a frozen base (QLoRA with a quantised one): only the adapters train and are
    checkpointed (docs/language-models.md, Fine-tuning)."""

    base: str = option(
        "",
        "the workdir (e.g. import-hf's) whose newest checkpoint's parameters are the frozen base; "
        '"" = the model\'s own seeded initialisation (then the checkpoints hold it)',
    )
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    base_dtype: str = option(
        "none",
        "the frozen base's projections stored quantised, dequantised per matmul (QLoRA): int8, nf4 "
        "(blocks of 64) or fp8 (e4m3); none: train.param_dtype",
        choices=("none", "int8", "nf4", "fp8"),
    )


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = option(
        0, "save every N steps (0 = only at the end; a save always happens at the end and on SIGTERM)", at_least=0
    )
    keep: int = option(3, "most recent checkpoints kept", at_least=1)
    keep_best: str = option(
        "",
        "an eval metric (eval/loss, eval/accuracy, ...): the checkpoint at its best value so far is kept beside "
        'the newest checkpoint.keep, saved at each evaluation that improves it (export/sample --step best) ("" = off)',
    )
    best_mode: str = option(
        "min", "checkpoint.keep_best's best: min (a loss) or max (an accuracy)", choices=("min", "max")
    )
    restore_from: str = option(
        "", "start a new run from another run's checkpoints/ directory (when this workdir has none)"
    )
    restore_mode: str = option(
        "params",
        "params: those parameters, a fresh optimizer, step 0 (fine-tuning); all: continue that run's whole state",
        choices=("params", "all"),
    )
    staging: str = option(
        "host",
        "where a save copies the state before training goes on: host (the devices' "
        "pinned host memory) or device (one more copy on the devices; a faster copy)",
        choices=("host", "device"),
    )
    verify: bool = option(True, "SHA256SUMS per step, written after each save and checked before a restore")
    local_dir: str = option(
        "",
        "the local tier: node-local fast storage (/dev/shm/..., a local SSD) where each process saves its own "
        'shards every checkpoint.local_every_steps, and a copy of them at a peer process ("" = no local tier)',
    )
    local_every_steps: int = option(
        0, "save to the local tier every N steps (frequent; needs checkpoint.local_dir; 0 = off)", at_least=0
    )
    local_keep: int = option(2, "most recent steps the local tier keeps", at_least=1)
    local_replicas: int = option(
        1,
        "peer processes (on other hosts first: docs/checkpoints.md) that hold a copy of each process's local shards",
        at_least=0,
    )


@dataclass(frozen=True)
class LogConfig:
    every_steps: int = option(50, "metrics to the console, metrics.jsonl and TensorBoard every N steps", at_least=1)
    progress: bool = option(True, "a progress bar on the console")
    tensorboard: bool = option(True, "TensorBoard event files in the workdir")
    trackers: list[str] = option(
        [],
        "experiment trackers beside TensorBoard, e.g. [wandb, mlflow] (pip install 'jax-train-engine[trackers]'); "
        "W&B offline unless WANDB_MODE is set, MLflow in TRACKING_DIR/mlflow.db unless MLFLOW_TRACKING_URI is",
        choices=TRACKERS,
    )
    project: str = option("jax-engine", "the W&B project and MLflow experiment of log.trackers")
    group: str = option("", "the W&B group and MLflow tag 'group' of the run (a sweep sets its own name)")
    tracking_dir: str = option(
        "", 'TRACKING_DIR, where trackers keep local files ("" = the workdir; a sweep sets its directory)'
    )
    profile_steps: list[int] = option(
        [],
        "[a, b]: a jax.profiler trace of steps a..b after this process's first "
        "step (a resumed run counts from where it resumed) into "
        "WORKDIR/profile; [] = none; --profile = [5, 15]",
    )


@dataclass(frozen=True)
class DistributedConfig:
    """How the processes of a multi-host job find each other. Left unset, a cluster environment
    (SLURM, Open MPI, TPU pod) or TF_CONFIG is used, else the run is one process. These are
    per-launch settings: config.yaml records only the timeouts."""

    coordinator_address: str = option("", "host:port of process 0's coordinator (or --coordinator-address)")
    coordinator_bind_address: str = option("", "where the coordinator listens (default: all interfaces)")
    num_processes: int = option(0, "processes in the job (0 = not set; or --num-processes)")
    process_id: int = option(-1, "this process's index, 0..num_processes-1 (-1 = not set; or --process-id)")
    initialization_timeout: int = option(300, "seconds to wait for every process to join")
    heartbeat_timeout: int = option(100, "seconds without a heartbeat before a process counts as dead")
    barrier_timeout: int = option(600, "seconds to wait at restore, checkpoint commit and the end")


@dataclass(frozen=True)
class WatchdogConfig:
    """Seconds without progress before a training process writes every thread's stack to stderr
    and WORKDIR/hang-<time>.txt and exits 1 naming the phase (0 = no limit)."""

    compile: int = option(7200, "loading data and compiling", at_least=0)
    restore: int = option(3600, "reading the newest checkpoint", at_least=0)
    step: int = option(1800, "between two iterations of the training loop (a hung collective)", at_least=0)
    eval: int = option(3600, "one evaluation", at_least=0)
    save: int = option(3600, "one checkpoint save (and the wait for it at the end)", at_least=0)


@dataclass(frozen=True)
class FaultConfig:
    """What a multi-process job does when a process dies or hangs (docs/multihost.md, Elastic
    continuation): with fault.elastic the local launcher (--local-processes), or the SLURM driver
    (launch.py train --elastic), restarts the job on the processes left, from the newest checkpoint,
    with the same global batch, data order and random numbers."""

    elastic: bool = option(
        False,
        "restart the job on the processes left when one dies or hangs (--local-processes, or SLURM with "
        "`launch.py train --elastic` in the allocation, or Kubernetes with `launch.py train --rendezvous DIR` in "
        "each pod); the outermost data axis "
        "(mesh.dcn_data, then mesh.data) shrinks",
    )
    min_processes: int = option(1, "fault.elastic: the fewest processes the job goes on with", at_least=1)
    max_restarts: int = option(
        3,
        "fault.elastic: the most restarts after failures since the job last ran at its full size; one more "
        "failure ends it with exit 1",
        at_least=0,
    )
    grow_back: bool = option(
        True,
        "fault.elastic: a job that shrank grows back to its full size at its next persistent checkpoint once "
        "the lost processes can run again (local launcher: at once; SLURM: when no node of the allocation is down; "
        "Kubernetes: when a pod returns)",
    )
    precompile: bool = option(
        False,
        "fault.elastic: while the job trains, compile the smaller jobs' programs (N-1 processes, then fewer) "
        "in the background into the persistent compilation cache (train.compilation_cache_dir); a restart "
        "then skips compiling",
    )


@dataclass(frozen=True)
class Config:
    seed: int = option(0, "every random draw (init, dropout, data order) derives from this", at_least=0)
    workdir: str = option("", 'where outputs go ("" = runs/<config file name>; --workdir overrides it)')
    model: Any = option(None, "the chosen model's section: model.name and its keys (models/configs.py)")
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    diloco: DilocoConfig = dataclasses.field(default_factory=DilocoConfig)
    finetune: FinetuneConfig = dataclasses.field(default_factory=FinetuneConfig)
    dpo: DpoConfig = dataclasses.field(default_factory=DpoConfig)
    grpo: GrpoConfig = dataclasses.field(default_factory=GrpoConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    log: LogConfig = dataclasses.field(default_factory=LogConfig)
    distributed: DistributedConfig = dataclasses.field(default_factory=DistributedConfig)
    watchdog: WatchdogConfig = dataclasses.field(default_factory=WatchdogConfig)
    fault: FaultConfig = dataclasses.field(default_factory=FaultConfig)


def sections() -> list[tuple[str, Any]]:
    """(name, dataclass) of every section but model, in the schema's order."""
    return [
        (f.name, f.default_factory) for f in dataclasses.fields(Config) if f.default_factory is not dataclasses.MISSING
    ]
