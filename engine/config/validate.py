"""Value checks that types alone do not catch. The schema's declarations (choices, bounds) are
checked for every field of every section, the model's too; then the checks that relate keys.
Each message names the key, its value and a fix."""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
from pathlib import Path
from typing import Any, Iterator

from contract.fields import choices_of
from engine.config.objective import check_objective
from engine.data.chat_data import MODEL_TEXT_SOURCES
from engine.data.features import entries
from engine.data.sources import EVAL_PATH_SOURCES, FILE_SOURCES, MIXTURE_SOURCES
from engine.data.text import source_name
from engine.errors import UsageError
from engine.parallel.axes import CONFIG_AXES, MESH_AXES
from engine.parallel.strategies import strategy_of

INT32_MAX = 2**31 - 1
TABLE_COLUMNS = "data.features and data.label "  # a table's columns: what makes a source a table


def choice_message(key: str, value: Any, choices) -> str:
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
    hint = f"did you mean {key}={close[0]}? " if close else ""
    return f"{key}={value!r} is not one of {', '.join(map(str, choices))}; {hint}".rstrip("; ")


def validate(cfg):
    """The resolved config: `cfg` when the schema and the keys' relations accept it, with
    train.steps_per_call and optimizer.warmup_steps fitted to the run (a new config, with a note
    on stderr); UsageError for the first value they refuse."""
    _check_ranges(cfg)
    for key, f, value in _declared(cfg):
        _check_declared(key, f, value)
    per_call = _fit_steps_per_call(cfg)
    if cfg.train.global_batch_size % cfg.train.grad_accum_steps:
        raise UsageError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not divisible by "
            f"train.grad_accum_steps={cfg.train.grad_accum_steps}; use a multiple of {cfg.train.grad_accum_steps}"
        )
    warmup = cfg.optimizer.warmup_steps
    if warmup > cfg.train.steps:  # a shortened run (a smoke test) still runs
        print(
            f"warning: optimizer.warmup_steps={warmup} exceeds train.steps={cfg.train.steps}; "
            f"warming up over all {cfg.train.steps} steps",
            file=sys.stderr,
        )
        warmup = cfg.train.steps
    _check_mesh(cfg.mesh)
    strategy_of(cfg).check(cfg)  # train.sync's own checks (engine/parallel/strategies.py)
    _check_local_tier(cfg.checkpoint)
    _check_finetune(cfg.finetune)
    _check_lora_on_full_weights(cfg)
    check_objective(cfg)
    _check_watched(cfg)
    _check_data(cfg.data)
    try:
        cfg.model.validate()
    except ValueError as e:  # the model family's message names the key and the fix
        raise UsageError(str(e)) from None
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, steps_per_call=per_call),
        optimizer=dataclasses.replace(cfg.optimizer, warmup_steps=warmup),
    )


def _check_data(data) -> None:
    """The data section's keys that relate: files to read, a mixture, a table, a held-out split."""
    if data.name in FILE_SOURCES and not data.path and not getattr(data, "sources", None):
        raise UsageError(f"data.name={data.name} reads files: set data.path=/path/to/data")
    _check_sources(data)
    _check_table(data)


def _declared(node, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, value) of every field of the config's dataclasses, the model's too."""
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _declared(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, value


def _check_declared(key: str, f: dataclasses.Field, value: Any) -> None:
    choices = choices_of(f)
    for each in value if isinstance(value, list) and choices is not None else [value]:
        if choices is not None and each not in choices:
            raise UsageError(choice_message(key, each, choices))
    at_least, above = f.metadata.get("at_least"), f.metadata.get("above")
    if at_least is not None and value < at_least:
        raise UsageError(f"{key}={value} must be {'positive' if at_least == 1 else f'{at_least} or more'}")
    if above is not None and not value > above:
        example = f.default if f.default is not dataclasses.MISSING else 1
        raise UsageError(f"{key}={value} must be more than {above}, e.g. {key}={example}")


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


def _check_ranges(cfg) -> None:
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
        raise UsageError(
            f"log.profile_steps={window} must be [first, last) steps after the start, 0 <= first < last, "
            "e.g. log.profile_steps=[5,15]"
        )
    if not cfg.data.device_memory_fraction <= 1.0:
        raise UsageError(f"data.device_memory_fraction={cfg.data.device_memory_fraction} must be in (0, 1], e.g. 0.25")
    if not getattr(cfg.data, "eval_fraction", 0.0) < 1.0:
        raise UsageError(f"data.eval_fraction={cfg.data.eval_fraction} must be between 0 and 1, e.g. 0.2")


def _check_mesh(mesh) -> None:
    for axis in CONFIG_AXES:
        size = getattr(mesh, axis)
        if size == 0 or size < -1:
            raise UsageError(f"mesh.{axis}={size} must be a positive device count or -1 (the remaining devices)")
    if [getattr(mesh, a) for a in CONFIG_AXES].count(-1) > 1:
        raise UsageError(f"only one of {', '.join('mesh.' + a for a in CONFIG_AXES)} may be -1")
    for logical, axes in mesh.rules.items():
        for axis in axes:
            if axis not in MESH_AXES:
                raise UsageError(choice_message(f"mesh.rules.{logical}", axis, CONFIG_AXES))


def _check_finetune(finetune) -> None:
    """A frozen base (finetune.base, a quantised base_dtype) needs adapters to train."""
    lora = finetune.lora
    if lora.rank == 0:
        for key, value, unset in (
            ("finetune.base", finetune.base, ""),
            ("finetune.base_dtype", finetune.base_dtype, "none"),
        ):
            if value != unset:
                raise UsageError(
                    f"{key}={value} freezes the base, but finetune.lora.rank=0 leaves nothing to train; set "
                    f"finetune.lora.rank > 0 (e.g. 8), or leave {key} unset to train every parameter"
                )
    if finetune.base and not (Path(finetune.base).expanduser() / "checkpoints").is_dir():
        raise UsageError(
            f"finetune.base={finetune.base} holds no checkpoints/ directory; give the workdir of `launch.py "
            f"import-hf` (or of a finished run) whose weights are the base"
        )
    if not lora.dropout < 1.0:
        raise UsageError(f"finetune.lora.dropout={lora.dropout} must be in [0, 1), e.g. 0.05")
    if not lora.targets:
        raise UsageError("finetune.lora.targets is empty; name the projections to adapt, e.g. [attention]")


def _check_lora_on_full_weights(cfg) -> None:
    """LoRA in a workdir whose checkpoints hold a model's full weights (an import's, a full
    fine-tuning run's, as its config.yaml says): refused here, before any data is read, with the
    words of the restore's own refusal (engine/checkpoint/diagnosis.py)."""
    import yaml

    workdir = Path(cfg.workdir)
    if not cfg.finetune.lora.rank or cfg.finetune.base or not (workdir / "config.yaml").is_file():
        return
    if not any(step.name.isdigit() for step in (workdir / "checkpoints").glob("*")):
        return
    try:
        saved = yaml.safe_load((workdir / "config.yaml").read_text(encoding="utf-8"))
        rank = ((saved.get("finetune") or {}).get("lora") or {}).get("rank", 0)
    except (OSError, UnicodeDecodeError, yaml.YAMLError, AttributeError):
        return  # (an unreadable config.yaml: the restore's own check names what the checkpoint holds)
    if not rank:
        raise UsageError(
            f"{workdir} holds a model's full weights (its config.yaml trains no adapters), and finetune.lora "
            f"trains adapters on a frozen base: fine-tune in a new workdir with finetune.base={workdir}"
        )


def _check_local_tier(checkpoint) -> None:
    """checkpoint.local_dir and checkpoint.local_every_steps come together."""
    if checkpoint.local_every_steps and not checkpoint.local_dir:
        raise UsageError(
            f"checkpoint.local_every_steps={checkpoint.local_every_steps} saves to the local tier, but "
            "checkpoint.local_dir is not set; set checkpoint.local_dir to node-local storage, e.g. "
            "checkpoint.local_dir=/dev/shm/checkpoints, or checkpoint.local_every_steps=0"
        )
    if checkpoint.local_dir and not checkpoint.local_every_steps:
        raise UsageError(
            f"checkpoint.local_dir={checkpoint.local_dir} sets up the local tier, but checkpoint.local_every_steps"
            "=0 never saves to it; set checkpoint.local_every_steps, e.g. checkpoint.local_every_steps=10, or "
            'checkpoint.local_dir=""'
        )
    if checkpoint.local_dir and not Path(checkpoint.local_dir).expanduser().is_absolute():
        raise UsageError(
            f"checkpoint.local_dir={checkpoint.local_dir} must be an absolute path on each host's own storage, "
            "e.g. checkpoint.local_dir=/dev/shm/checkpoints"
        )


def _check_watched(cfg) -> None:
    """checkpoint.keep_best and train.early_stop.metric name eval metrics (eval/NAME; which names a
    run records is known at its first evaluation); early stopping needs evaluations during the run."""
    stop = cfg.train.early_stop
    for key, metric, mode_key, mode in (
        ("checkpoint.keep_best", cfg.checkpoint.keep_best, "checkpoint.best_mode", cfg.checkpoint.best_mode),
        ("train.early_stop.metric", stop.metric, "train.early_stop.mode", stop.mode),
    ):
        if metric and (not metric.startswith("eval/") or metric == "eval/"):
            example = "eval/" + (metric.split("/")[-1] or "loss")
            raise UsageError(
                f"{key}={metric!r} must name an eval metric as eval/NAME, e.g. {key}={example} (eval/loss, or "
                f"eval/accuracy with {mode_key}=max)"
            )
        if metric.endswith("accuracy") and mode == "min":
            print(f"warning: {key}={metric} with {mode_key}=min counts a lower accuracy as better", file=sys.stderr)
    if stop.metric and not cfg.eval.every_steps:
        raise UsageError(
            f"train.early_stop.metric={stop.metric} watches the evaluations during the run, but eval.every_steps=0 "
            f"evaluates only at its end; set eval.every_steps, e.g. eval.every_steps={max(cfg.train.steps // 10, 1)}"
        )


def _fit_steps_per_call(cfg) -> int:
    """train.steps_per_call is the most per call: calls end at every log, eval and checkpoint,
    so the steps per call are the largest divisor of their intervals (and train.steps) up to it,
    said in a note when that is fewer."""
    per_call, sync = cfg.train.steps_per_call, strategy_of(cfg)
    intervals = {
        "train.steps": cfg.train.steps,
        "log.every_steps": cfg.log.every_steps,
        "eval.every_steps": cfg.eval.every_steps,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "checkpoint.local_every_steps": cfg.checkpoint.local_every_steps if cfg.checkpoint.local_dir else 0,
        **({sync.round_setting: sync.round_steps(cfg)} if sync.round_setting else {}),
    }
    common = math.gcd(*intervals.values())  # 0-valued (off) intervals do not count
    if common % per_call:  # calls end at every log, eval and checkpoint: the most that fits
        fits = max(d for d in range(1, per_call + 1) if common % d == 0)
        blocking = ", ".join(f"{k}={v}" for k, v in intervals.items() if v % per_call)
        print(
            f"note: train.steps_per_call={per_call} runs {fits} step(s) per call here, so that calls end at "
            f"{blocking} (logs, evals and checkpoints happen between calls)",
            file=sys.stderr,
        )
        return fits
    return per_call


def other_source_key(key: str, name: str, owners: list[str]) -> str:
    """The message for data.`key`, a key of the `owners` sources, set with data.name=`name`."""
    if key == "eval_path":
        return (
            f"data.eval_path: data.name={name} takes its held-out split otherwise (data.eval_fraction, "
            f"a test split, or tokenize --eval-fraction); data.eval_path is for {', '.join(EVAL_PATH_SOURCES)}"
        )
    if key == "sources":
        return (
            f"data.sources is a mixture of tokenized corpora: it needs data.name="
            f"{'|'.join(MIXTURE_SOURCES)}, not {name}"
        )
    if f"data.{key} " in TABLE_COLUMNS:  # the keys it names
        return f"{TABLE_COLUMNS}describe a table: they need data.name={owners[0]}, not {name}"
    return (
        f"data.{key} is a key of data.name={'|'.join(owners)}, not of data.name={name}; remove it, "
        f"or set data.name={owners[0]}"
    )


def _check_table(data) -> None:
    """A table's label and feature columns, checked before any data is read."""
    if not hasattr(data, "features"):
        return
    if not data.label:
        raise UsageError(f"data.name={data.name} needs data.label=COLUMN (the column the model predicts)")
    if not data.features:
        raise UsageError(f"data.name={data.name} needs data.features: [{{name: COLUMN, kind: numeric}}, ...]")
    entries(data.features)


def _check_sources(data) -> None:
    """data.tokenizer names a tokenizer; data.sources is a list of {path, weight[, name]} mappings."""
    tokenizer = getattr(data, "tokenizer", "bytes") if data.name not in MODEL_TEXT_SOURCES else "bytes"  # a model's
    bpe = tokenizer.startswith("bpe:") and tokenizer[4:].isdigit()
    if tokenizer != "bytes" and not bpe and not Path(tokenizer).expanduser().is_file():
        raise UsageError(
            f"data.tokenizer={tokenizer!r}: use bytes, bpe:N (N ≥ 257, e.g. bpe:2048) or the path of a tokenizer.json"
        )
    mixture = getattr(data, "sources", [])
    if not mixture:
        return
    if data.path:
        raise UsageError("set data.path (one corpus) or data.sources (a mixture), not both")
    example = "data.sources=[{path: /data/web, weight: 0.7}, {path: /data/code, weight: 0.3}]"
    for i, source in enumerate(mixture):
        if not isinstance(source, dict) or not source.get("path") or set(source) - {"path", "weight", "name"}:
            raise UsageError(
                f"data.sources[{i}]={source!r}: each source is a mapping with path, weight and "
                f"optionally name, e.g. {example}"
            )
        weight = source.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise UsageError(f"data.sources[{i}].weight={weight!r} must be a positive number, e.g. {example}")
    names = [source_name(s, i) for i, s in enumerate(mixture)]
    if len(set(names)) != len(names):
        raise UsageError(f"data.sources have repeated names {names}; give each a distinct name: key")
