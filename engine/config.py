"""Typed run configuration: YAML files + dotted overrides, merged and validated by OmegaConf.

A config file may name another with `extends: other.yaml` (a path relative to the file);
the base is loaded first and the file's keys are merged over it. The `model` section's
schema is the chosen model's own dataclass (see models/), so each model has typed keys.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, ListConfig, Node, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from engine.data.sources import FILE_SOURCES, MIXTURE_SOURCES, SOURCES, source_name
from engine.errors import UsageError
from engine.rundir import write_atomic
from models.configs import CONFIGS  # the model.* dataclasses, without jax or flax

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


@dataclass
class DataConfig:
    name: str = "digits"  # a source of engine/data/sources.py: digits, synthetic, npz, idx, cifar10, text, ...
    path: Optional[str] = None  # file or directory for npz, idx, cifar10 and text
    eval_fraction: float = 0.2  # held-out share when the source has no test split
    shuffle: bool = True  # reshuffle every epoch (order is a function of seed and epoch)
    prefetch: int = 2  # blocks of batches put on device ahead of the step (0 = none)
    steps_per_transfer: int = 1  # training batches moved to the device together (fewer, larger copies)
    # auto | host | device: device keeps the whole train split on every device and gathers
    # each step's rows inside the compiled step (auto: when it fits in device_memory_fraction)
    placement: str = "auto"
    device_memory_fraction: float = 0.25  # placement=auto: the share of one device's memory the train split may use
    # synthetic sources
    num_examples: int = 4096  # training examples generated (eval gets a quarter)
    image_shape: list[int] = field(default_factory=lambda: [8, 8, 1])  # [height, width, channels]
    num_classes: int = 10  # synthetic: classes made; npz: labels must lie in [0, num_classes)
    # token sources (text, synthetic_text)
    seq_len: int = 128  # tokens per example (the model sees seq_len, predicts the next)
    vocab_size: int = 256  # synthetic_text only; byte-level text is always 256
    max_bytes: int = 4_000_000  # python_source: bytes of text read
    # tokenized corpora (data.name=tokens; made by `python launch.py tokenize`)
    packing: bool = True  # documents packed into windows with segment ids and positions (else cut from the stream)
    sources: list[Any] = field(default_factory=list)  # a mixture: [{path: DIR, weight: 0.7, name: web}, ...]
    verify: bool = True  # check every shard's checksum against the manifest at start
    # python_source: bytes (ids are UTF-8 bytes) or bpe:N (a byte-level BPE of N tokens trained
    # on the text, tokenized once into cache_dir and reused)
    tokenizer: str = "bytes"
    cache_dir: str = "~/.cache/jax-engine/tokens"  # where python_source keeps its tokenized corpus


@dataclass
class TrainConfig:
    steps: int = 1000  # optimizer steps in the whole run
    global_batch_size: int = 128  # examples per step, over all devices and processes
    grad_accum_steps: int = 1  # microbatches per step; each is global_batch_size / this
    steps_per_call: int = 1  # optimizer steps per dispatch of the compiled step (a device-side loop)
    param_dtype: str = "float32"  # dtype the parameters are stored and updated in
    compute_dtype: str = "float32"  # dtype of activations and matmuls (bfloat16 for speed)
    nan_policy: str = "stop"  # stop | warn: what a non-finite loss does
    eager: bool = False  # run the step without jit (slow; for debugging, like TF eager)
    compilation_cache_dir: str = "~/.cache/jax-engine/xla"  # JAX's persistent compilation cache ("" = off)


@dataclass
class OptimizerConfig:
    name: str = "adam"  # sgd | momentum | adam | adamw
    learning_rate: float = 1e-3  # peak learning rate
    schedule: str = "constant"  # constant | warmup_cosine | warmup_linear
    warmup_steps: int = 0  # linear warm-up from 0 to learning_rate
    end_learning_rate_factor: float = 0.0  # final lr = factor * learning_rate (decaying schedules)
    momentum: float = 0.9  # momentum (sgd momentum) or Adam's b1
    b2: float = 0.999  # Adam's second-moment decay
    eps: float = 1e-8  # Adam's epsilon
    weight_decay: float = 0.0  # decoupled weight decay (adamw)
    grad_clip_norm: float = 0.0  # clip gradients to this global norm (0 = off)


@dataclass
class MeshConfig:
    data: int = -1  # data-parallel replicas (-1 = all remaining devices)
    fsdp: int = 1  # devices params and optimizer state are sharded over (ZeRO-3)
    tensor: int = 1  # tensor-parallel (Megatron) devices
    # context parallelism: each sequence's activations split over this many devices (the
    # sequence length must divide); attention all-gathers keys and values (models that support it)
    context: int = 1
    # expert parallelism: a mixture-of-experts model's experts split over this many devices
    # (tokens travel to their experts by all-to-all); the batch is split over it too
    expert: int = 1
    num_devices: int = -1  # how many of the visible devices to use (-1 = all)
    # multi-slice / multi-host: how many of each axis's factors cross the slow data-center
    # network (these become the outer part of the axis); 1 = all on the fast interconnect
    dcn_data: int = 1
    dcn_fsdp: int = 1
    dcn_tensor: int = 1
    dcn_context: int = 1
    dcn_expert: int = 1
    backend: str = "jit"  # jit (NamedSharding, any layout) | pmap (replicated data parallel)
    # logical axis name -> mesh axes to try in order; the first that is free, larger than 1
    # and divides the dimension is used (fsdp falls back to replication, tensor must divide)
    rules: dict[str, list[str]] = field(
        default_factory=lambda: {
            "embed": ["fsdp"],
            "mlp": ["tensor", "fsdp"],
            "heads": ["tensor", "fsdp"],
            "kv_heads": ["tensor"],  # grouped-query K/V heads: replicated where tensor does not divide them
            "kv": [],
            "layers": [],  # the stacked-layer axis of scanned models
            "expert": ["expert"],  # a mixture-of-experts layer's experts
            "vocab": ["tensor", "fsdp"],
            "conv_in": ["fsdp"],
            "conv_out": ["tensor"],
            "classes": [],
        }
    )


@dataclass
class CheckpointConfig:
    every_steps: int = 0  # save every N steps (0 = only at the end)
    keep: int = 3  # most recent checkpoints kept
    restore_from: str = ""  # start a new run from another run's checkpoints directory
    restore_mode: str = "params"  # params (fresh optimizer, step 0) | all (continue that run's state)
    staging: str = "host"  # host | device: where a save copies the state before training goes on
    verify: bool = True  # SHA256SUMS per step, written after each save and checked before a restore


@dataclass
class EvalConfig:
    every_steps: int = 0  # evaluate every N steps (0 = only at the end)
    batch_size: int = 0  # examples per eval batch (0 = train.global_batch_size)
    max_batches: int = 0  # cap on eval batches (0 = the whole eval split)


@dataclass
class LogConfig:
    every_steps: int = 50  # metrics to console, metrics.jsonl and TensorBoard every N steps
    progress: bool = True  # show a progress bar on the console
    tensorboard: bool = True  # write TensorBoard event files into the workdir
    # [a, b]: a jax.profiler trace of steps a..b after this process's first step (a resumed run
    # counts from where it resumed) into <workdir>/profile; [] = none. --profile = [5, 15]
    profile_steps: list[int] = field(default_factory=list)


@dataclass
class DistributedConfig:
    # How the processes of a multi-host job find each other. Left unset, a cluster environment
    # (SLURM, Open MPI, TPU pod) or TF_CONFIG is used, else the run is one process. These are
    # per-launch settings: config.yaml records only the timeouts.
    coordinator_address: str = ""  # host:port of process 0's coordinator
    coordinator_bind_address: str = ""  # where the coordinator listens (default: all interfaces)
    num_processes: int = 0  # processes in the job (0 = not set)
    process_id: int = -1  # this process's index, 0..num_processes-1 (-1 = not set)
    initialization_timeout: int = 300  # seconds to wait for every process to join
    heartbeat_timeout: int = 100  # seconds without a heartbeat before a process counts as dead
    barrier_timeout: int = 600  # seconds to wait at restore, checkpoint commit and the end


@dataclass
class WatchdogConfig:
    # Seconds without progress before a training process dumps every thread's stack to stderr
    # and WORKDIR/hang-<time>.txt and exits 1 (0 = no limit); see engine/watchdog.py.
    compile: int = 7200  # loading data and compiling
    restore: int = 3600  # reading the newest checkpoint
    step: int = 1800  # between two iterations of the training loop (a hung collective)
    eval: int = 3600  # one evaluation
    save: int = 3600  # one checkpoint save (and the wait for it at the end)


@dataclass
class Config:
    seed: int = 0  # every random draw (init, dropout, data order) derives from this
    workdir: str = ""  # where outputs go ("" = runs/<config file name>)
    model: Any = None  # the chosen model's dataclass, see models/
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)


CHOICES = {
    "data.name": tuple(SOURCES),
    "data.placement": ("auto", "host", "device"),
    "train.param_dtype": ("float32", "bfloat16", "float16"),
    "train.compute_dtype": ("float32", "bfloat16", "float16"),
    "train.nan_policy": ("stop", "warn"),
    "optimizer.name": ("sgd", "momentum", "adam", "adamw"),  # engine.optim.BUILDERS builds each
    "optimizer.schedule": ("constant", "warmup_cosine", "warmup_linear"),
    "mesh.backend": ("jit", "pmap"),
    "checkpoint.restore_mode": ("params", "all"),
    "checkpoint.staging": ("host", "device"),
}
MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")  # outer to inner (tensor: the closest devices)


MAX_YAML_VALUES = 100_000  # a config or sweep file expanding to more is refused (YAML alias bombs)


def _too_many_values(data, limit: int = MAX_YAML_VALUES) -> bool:
    """Whether `data`, with YAML aliases expanded, holds more than `limit` values (stops counting there)."""
    count, todo = 0, [data]
    while todo:
        item = todo.pop()
        count += 1
        if count > limit:
            return True
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
    return False


# PyYAML's safe loader in C (libyaml) where PyYAML was built with it: ~10x faster, the same
# documents, tags refused alike; a sweep's processes each read every config and its bases
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml_mapping(path: Path, what: str) -> dict:
    """A YAML file (safe loading: nothing is constructed from tags) that must hold a mapping
    of at most MAX_YAML_VALUES values once its aliases are expanded."""
    try:
        data = yaml.load(path.read_text(), Loader=SAFE_LOADER)
    except yaml.YAMLError as e:
        raise UsageError(f"{what} {path}{_yaml_place(e)} is not valid YAML: {_yaml_problem(e)}") from None
    if _too_many_values(data):
        raise UsageError(f"{what} {path} expands to more than {MAX_YAML_VALUES:,} values (through YAML aliases "
                         "&name / *name?); write the values out")
    if data is None:
        raise UsageError(f"{what} {path} is empty; it must hold a mapping of keys (see configs/ and README.md)")
    if not isinstance(data, dict):
        raise UsageError(f"{what} {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def _yaml_place(error: yaml.YAMLError) -> str:
    """':line:column' of a YAML error, where PyYAML knows it."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    return f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""


def _yaml_problem(error: yaml.YAMLError) -> str:
    return getattr(error, "problem", None) or str(error).splitlines()[0]


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """Reads a config file, following `extends:` to its base first."""
    if "\x00" in str(path):
        raise UsageError(f"config file {str(path)!r}: a path cannot hold a NUL character")
    if not path.is_file():
        raise UsageError(f"config file {path} does not exist; shipped configs: {', '.join(shipped_configs())}")
    if path in seen:
        raise UsageError(f"config {path} extends itself through {' -> '.join(map(str, seen))}")
    data = read_yaml_mapping(path, "config file")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise UsageError(f"config file {path}: extends: {base!r} must be the path of one config file, e.g. "
                         "extends: base.yaml")
    merged = _read_yaml((path.parent / base).resolve(), seen + (path,))
    return _deep_merge(merged, data)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def shipped_configs() -> list[str]:
    return sorted(p.name for p in CONFIG_DIR.glob("*.yaml") if p.name != "base.yaml")


def _all_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in node.keys():
        full = f"{prefix}{key}"
        keys.append(full)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and child._is_missing() is False and child._get_flag("struct"):
            keys.extend(_all_keys(child, full + "."))
    return keys


def _schema(model_name: str) -> DictConfig:
    """The config schema with model.name's model section; read-only (merges copy it)."""
    if model_name not in CONFIGS:
        raise UsageError(_choice_message("model.name", model_name, sorted(CONFIGS)))
    return _built_schema(model_name)


@functools.lru_cache(maxsize=None)
def _built_schema(model_name: str) -> DictConfig:
    schema = OmegaConf.structured(Config)
    schema.model = OmegaConf.structured(CONFIGS[model_name])
    OmegaConf.set_struct(schema, True)
    OmegaConf.set_struct(schema.mesh.rules, False)  # users may add logical axis names
    return schema


def _choice_message(key: str, value: Any, choices) -> str:
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"did you mean {key}={close[0]}? " if close else ""
    return f"{key}={value!r} is not one of {', '.join(map(str, choices))}; {hint}".rstrip("; ")


def _explain(err: OmegaConfBaseException, schema: DictConfig, source: str) -> str:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError) or "not in struct" in str(err):
        close = difflib.get_close_matches(key, _all_keys(schema), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else "; see the config reference in README.md"
        return f"unknown config key '{key}' (from {source}){hint}"
    if isinstance(err, ValidationError):
        expected = _expected_type(schema, key)
        value = getattr(err, "value", None)
        if isinstance(value, Node):  # OmegaConf's wrapper of a value: say the value itself
            value = value._value()
        return (f"config key '{key}' got {value!r} ({type(value).__name__}) from {source}, "
                f"but it must be {expected}; e.g. {key}={_example(expected)}")
    return f"bad config ({source}): {str(err).splitlines()[0]}"


def _expected_type(schema: DictConfig, key: str) -> str:
    node = schema
    parts = key.split(".")
    for part in parts[:-1]:
        node = node._get_node(part) if isinstance(node, DictConfig) and part in node else None
        if node is None:
            return "a valid value"
    leaf = node._get_node(parts[-1]) if isinstance(node, DictConfig) and parts[-1] in node else None
    if leaf is None:
        return "a valid value"
    ref = leaf._metadata.ref_type
    name = getattr(ref, "__name__", None) or str(ref).replace("typing.", "")
    if name == "Optional":  # Optional[X]
        name = str(ref).replace("typing.", "")
    names = {"int": "an int", "float": "a float", "bool": "a bool (true/false)", "str": "a string",
             "List": "a list", "list": "a list", "Dict": "a mapping", "dict": "a mapping"}
    return names.get(name.split("[")[0], name)


def _example(expected: str) -> str:
    return {"an int": "8", "a float": "0.001", "a bool (true/false)": "true", "a string": "name",
            "a mapping": "{a: 1}"}.get(expected, "[1,2]")


def _check_shapes(tree: dict, schema: DictConfig, source: str, prefix: str = "") -> None:
    """Sections the schema holds as mappings (or lists) get mappings (or lists): OmegaConf would
    fail on them with a message naming no key (or with a TypeError)."""
    for key, value in tree.items():
        if not isinstance(key, str) or key not in schema or value is None:
            continue  # unknown keys get OmegaConf's own message (with the closest valid key)
        node = schema._get_node(key)
        full = f"{prefix}{key}"
        if isinstance(node, DictConfig) and not isinstance(value, dict):
            raise UsageError(f"config key '{full}' is a section of keys, but {source} gives it {value!r}; "
                             f"set its keys instead, e.g. {full}.<key>=value")
        if isinstance(node, ListConfig) and isinstance(value, dict):
            raise UsageError(f"config key '{full}' must be a list, but {source} gives it a mapping ({value!r}); "
                             f"e.g. {full}=[1,2]")
        if isinstance(node, DictConfig) and not node._is_missing():
            _check_shapes(value, node, source, full + ".")


def load_config(config_path: str | os.PathLike, overrides: list[str] = (), workdir: str | None = None,
                override_source: str = "the command line") -> Config:
    """Config file + `a.b=value` overrides → validated Config; UsageError says what is wrong."""
    path = Path(config_path)
    for shipped in (CONFIG_DIR / path, CONFIG_DIR / f"{path}.yaml"):  # a name of configs/, with or without .yaml
        if not path.is_file() and shipped.is_file():
            path = shipped
    raw = _read_yaml(path.resolve())
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise UsageError(f"override '{item}' is not of the form dotted.key=value, e.g. train.steps=100")
        key, value = item.split("=", 1)
        if not all(part.strip() and part.isprintable() for part in key.split(".")):
            raise UsageError(f"override '{item}': the key '{key}' is not a dotted key such as train.steps")
        try:
            yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise UsageError(f"override '{item}': the value is not valid YAML ({_yaml_problem(e)}); close its "
                             f"brackets and quotes, e.g. {key}=[256,128]") from None
    try:
        override_cfg = OmegaConf.from_dotlist(list(overrides))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError) as e:  # e.g. a=[1] then a.b=2
        raise UsageError(f"could not parse overrides {list(overrides)}: {str(e).splitlines()[0]}") from None
    overrides_tree = OmegaConf.to_container(override_cfg)
    file_model, model_name = _model_names(raw, overrides_tree, str(path))
    if model_name != file_model:  # the file's model keys belong to another model: start from defaults
        raw["model"] = {"name": model_name}
    schema = _schema(str(model_name))
    cfg = _file_layer(schema, raw, str(model_name), str(path))
    _check_shapes(overrides_tree, schema, override_source)
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(overrides_tree))
    except OmegaConfBaseException as e:
        raise UsageError(_explain(e, schema, override_source)) from None
    if workdir is not None:
        cfg.workdir = workdir
    if not cfg.workdir:
        cfg.workdir = str(Path("runs") / path.stem)
    try:
        config: Config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # e.g. an interpolation ${...} that names no key
        raise UsageError(f"bad config: {str(e).splitlines()[0]} (at {getattr(e, 'full_key', '?')}); "
                         "write the value itself, or ${section.key} of a key that exists") from None
    validate(config)
    return config


_FILE_LAYERS: dict[str, DictConfig] = {}  # a sweep loads one file with many overrides


def _file_layer(schema: DictConfig, raw: dict, model_name: str, source: str) -> DictConfig:
    """The schema merged with a config file's contents (never changed: merges copy it). Kept by
    content, so the runs of a sweep pay OmegaConf's schema merge once, not once each."""
    key = repr((model_name, raw))  # keys of any type (YAML's `on:` is True), 1 and "1" apart
    if key not in _FILE_LAYERS:
        _check_shapes(raw, schema, source)
        try:
            layer = OmegaConf.merge(schema, OmegaConf.create(raw))
        except OmegaConfBaseException as e:
            raise UsageError(_explain(e, schema, source)) from None
        _FILE_LAYERS.clear()  # one file at a time is what sweeps and runs load
        _FILE_LAYERS[key] = layer
    return _FILE_LAYERS[key]


def _model_names(raw: dict, overrides: dict, source: str) -> tuple[str, str]:
    """The model the file names and the one the run uses (an override may switch it)."""
    for where, tree in ((source, raw), ("the command line", overrides)):
        if "model" in tree and tree["model"] is not None and not isinstance(tree["model"], dict):
            raise UsageError(f"config key 'model' is a section of keys, but {where} gives it {tree['model']!r}; "
                             "set model.name=<model> and its keys instead")
    file_model = (raw.get("model") or {}).get("name") or "mlp"
    model_name = (overrides.get("model") or {}).get("name") or file_model
    if not isinstance(model_name, str):
        model_name = repr(model_name)  # refused by _schema with the list of models
    return file_model, model_name


def validate(cfg: Config) -> None:
    """Value checks that types alone do not catch; each message names the key and a fix."""
    for key, choices in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in choices:
            raise UsageError(_choice_message(key, value, choices))
    positive = {
        "train.steps": cfg.train.steps,
        "train.global_batch_size": cfg.train.global_batch_size,
        "train.grad_accum_steps": cfg.train.grad_accum_steps,
        "train.steps_per_call": cfg.train.steps_per_call,
        "log.every_steps": cfg.log.every_steps,
        "checkpoint.keep": cfg.checkpoint.keep,
        "data.seq_len": cfg.data.seq_len,
        "data.num_examples": cfg.data.num_examples,
        "data.steps_per_transfer": cfg.data.steps_per_transfer,
    }
    for key, value in positive.items():
        if value <= 0:
            raise UsageError(f"{key}={value} must be positive")
    non_negative = {
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "eval.every_steps": cfg.eval.every_steps,
        "eval.batch_size": cfg.eval.batch_size,
        "eval.max_batches": cfg.eval.max_batches,
        "data.prefetch": cfg.data.prefetch,
        "optimizer.warmup_steps": cfg.optimizer.warmup_steps,
        "optimizer.grad_clip_norm": cfg.optimizer.grad_clip_norm,
        "optimizer.weight_decay": cfg.optimizer.weight_decay,
        **{f"watchdog.{f.name}": getattr(cfg.watchdog, f.name) for f in dataclasses.fields(cfg.watchdog)},
    }
    for key, value in non_negative.items():
        if value < 0:
            raise UsageError(f"{key}={value} must be 0 or more")
    _check_ranges(cfg)
    if cfg.optimizer.learning_rate <= 0:
        raise UsageError(f"optimizer.learning_rate={cfg.optimizer.learning_rate} must be positive, e.g. 1e-3")
    if not 0.0 < cfg.data.eval_fraction < 1.0:
        raise UsageError(f"data.eval_fraction={cfg.data.eval_fraction} must be between 0 and 1, e.g. 0.2")
    _fit_steps_per_call(cfg)
    if cfg.train.global_batch_size % cfg.train.grad_accum_steps:
        raise UsageError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps}; use a multiple of {cfg.train.grad_accum_steps}")
    if cfg.optimizer.warmup_steps > cfg.train.steps:  # a shortened run (a smoke test) still runs
        print(f"warning: optimizer.warmup_steps={cfg.optimizer.warmup_steps} exceeds train.steps={cfg.train.steps}; "
              f"warming up over all {cfg.train.steps} steps", file=sys.stderr)
        cfg.optimizer.warmup_steps = cfg.train.steps
    for axis in MESH_AXES:
        size = getattr(cfg.mesh, axis)
        if size == 0 or size < -1:
            raise UsageError(f"mesh.{axis}={size} must be a positive device count or -1 (the remaining devices)")
    for axis in MESH_AXES:
        if getattr(cfg.mesh, f"dcn_{axis}") < 1:
            raise UsageError(f"mesh.dcn_{axis}={getattr(cfg.mesh, f'dcn_{axis}')} must be 1 or more")
    if [getattr(cfg.mesh, a) for a in MESH_AXES].count(-1) > 1:
        raise UsageError(f"only one of {', '.join('mesh.' + a for a in MESH_AXES)} may be -1")
    for logical, axes in cfg.mesh.rules.items():
        for axis in axes:
            if axis not in MESH_AXES:
                raise UsageError(_choice_message(f"mesh.rules.{logical}", axis, MESH_AXES))
    if cfg.data.name in FILE_SOURCES and not cfg.data.path and not cfg.data.sources:
        raise UsageError(f"data.name={cfg.data.name} reads files: set data.path=/path/to/data")
    _check_sources(cfg.data)
    if hasattr(cfg.model, "validate"):
        try:
            cfg.model.validate()
        except ValueError as e:  # the model family's message names the key and the fix
            raise UsageError(str(e)) from None


INT32_MAX = 2**31 - 1


def _numbers(node, prefix: str = ""):
    """(dotted key, value) of every number in a config (dataclasses, dicts and lists)."""
    if dataclasses.is_dataclass(node):
        node = {f.name: getattr(node, f.name) for f in dataclasses.fields(node)}
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            yield f"{prefix}{key}", value
        else:
            yield from _numbers(value, f"{prefix}{key}.")


def _check_ranges(cfg: Config) -> None:
    for key, value in _numbers(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{key}={value} must be a finite number")
        if isinstance(value, int) and abs(value) > 2**62:
            raise UsageError(f"{key}={value} is out of range; give a value below 2**62")
    for key, value in (("seed", cfg.seed), ("train.steps", cfg.train.steps)):
        if value > INT32_MAX:
            raise UsageError(f"{key}={value} is more than {INT32_MAX} (it is held as a 32-bit integer)")
    window = list(cfg.log.profile_steps)
    if window and (len(window) != 2 or not 0 <= window[0] < window[1]):
        raise UsageError(f"log.profile_steps={window} must be [first, last) steps after the start, 0 <= first < last, "
                         "e.g. log.profile_steps=[5,15]")
    if not 0.0 < cfg.data.device_memory_fraction <= 1.0:
        raise UsageError(f"data.device_memory_fraction={cfg.data.device_memory_fraction} must be in (0, 1], e.g. 0.25")
    if cfg.seed < 0:
        raise UsageError(f"seed={cfg.seed} must be 0 or more (every random draw derives from it), e.g. seed=0")


def _fit_steps_per_call(cfg: Config) -> None:
    """train.steps_per_call is the most per call: calls end at every log, eval and checkpoint,
    so it is lowered to the largest divisor of their intervals (and train.steps), with a note."""
    per_call = cfg.train.steps_per_call
    intervals = {"train.steps": cfg.train.steps, "log.every_steps": cfg.log.every_steps,
                 "eval.every_steps": cfg.eval.every_steps, "checkpoint.every_steps": cfg.checkpoint.every_steps}
    common = math.gcd(*intervals.values())  # 0-valued (off) intervals do not count
    if common % per_call:  # calls end at every log, eval and checkpoint: the most that fits
        fits = max(d for d in range(1, per_call + 1) if common % d == 0)
        blocking = ", ".join(f"{k}={v}" for k, v in intervals.items() if v % per_call)
        print(f"note: train.steps_per_call={per_call} runs {fits} step(s) per call here, so that calls end at "
              f"{blocking} (logs, evals and checkpoints happen between calls)", file=sys.stderr)
        cfg.train.steps_per_call = fits


def _check_sources(data: DataConfig) -> None:
    """data.sources: a list of {path, weight[, name]} mappings, only with data.name=tokens."""
    if not data.sources:
        if data.tokenizer != "bytes" and not (data.tokenizer.startswith("bpe:") and data.tokenizer[4:].isdigit()):
            raise UsageError(f"data.tokenizer={data.tokenizer!r}: use bytes or bpe:N (N ≥ 257), e.g. bpe:2048")
        return
    if data.name not in MIXTURE_SOURCES:
        raise UsageError(f"data.sources is a mixture of tokenized corpora: it needs data.name="
                         f"{'|'.join(MIXTURE_SOURCES)}, not {data.name}")
    if data.path:
        raise UsageError("set data.path (one corpus) or data.sources (a mixture), not both")
    example = "data.sources=[{path: /data/web, weight: 0.7}, {path: /data/code, weight: 0.3}]"
    for i, source in enumerate(data.sources):
        if not isinstance(source, dict) or not source.get("path") or set(source) - {"path", "weight", "name"}:
            raise UsageError(f"data.sources[{i}]={source!r}: each source is a mapping with path, weight and "
                             f"optionally name, e.g. {example}")
        weight = source.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise UsageError(f"data.sources[{i}].weight={weight!r} must be a positive number, e.g. {example}")
    names = [source_name(s, i) for i, s in enumerate(data.sources)]
    if len(set(names)) != len(names):
        raise UsageError(f"data.sources have repeated names {names}; give each a distinct name: key")


def to_yaml(cfg: Config) -> str:
    """The config as YAML, keys in the schema's order (plain PyYAML: OmegaConf takes ~0.1 s)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, allow_unicode=True)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Writes the resolved config; `launch.py --config <this file>` reproduces the run.

    How processes found each other belongs to one launch, not to the experiment: only the
    distributed timeouts are kept."""
    launch_free = dataclasses.replace(cfg.distributed, coordinator_address="", coordinator_bind_address="",
                                      num_processes=0, process_id=-1)
    write_atomic(path, to_yaml(dataclasses.replace(cfg, distributed=launch_free)))


# Vectorised runs (engine/vectorize.py): which configs can share one compiled program.
# config keys whose values are numbers in the train state (plus the model family's hparams)
VECTOR_KEYS = ("seed", "optimizer.learning_rate", "optimizer.warmup_steps", "optimizer.end_learning_rate_factor",
               "optimizer.weight_decay", "optimizer.momentum", "optimizer.b2", "optimizer.eps",
               "optimizer.grad_clip_norm")


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def program_settings(cfg: Config) -> dict[str, Any]:
    """The settings that make a run's compiled program: the whole config but its VECTOR_KEYS,
    the family's hyperparameters and the workdir (clipping on or off stays: it is a program)."""
    flat = _flat(dataclasses.asdict(cfg))
    vector = set(VECTOR_KEYS) | {f"model.{name}" for name in CONFIGS[cfg.model.name].hparams} | {"workdir"}
    settings = {key: value for key, value in flat.items() if key not in vector}
    settings["optimizer.grad_clip"] = bool(cfg.optimizer.grad_clip_norm)
    return settings


def shape_differences(a: Config, b: Config) -> list[str]:
    """The program settings in which two configs differ (empty: they can share one program)."""
    sa, sb = program_settings(a), program_settings(b)
    return sorted(key for key in sa.keys() | sb.keys() if sa.get(key) != sb.get(key))


def check_vectorizable(cfg: Config, where: str) -> None:
    if cfg.mesh.backend != "jit" or cfg.train.eager:
        raise UsageError(f"{where}: vectorize trains runs as one jit-compiled program; set mesh.backend=jit and "
                         f"train.eager=false, or remove vectorize")
    if cfg.checkpoint.restore_from:
        raise UsageError(f"{where}: vectorized runs start from scratch or their own checkpoints, not "
                         f"checkpoint.restore_from; remove vectorize to start each run from "
                         f"{cfg.checkpoint.restore_from}")
