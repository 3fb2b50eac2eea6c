"""Hugging Face checkpoints in and out, offline, for model families that declare the layout
(`ModelFamily.hf`): a directory of `config.json` + `*.safetensors` (one file, or shards
with `model.safetensors.index.json`).

`launch.py import-hf HF_DIR --workdir DIR` writes DIR/config.yaml (the model section from
config.json) and a checkpoint at step 0 in DIR/checkpoints: re-running on DIR fine-tunes,
and other runs can start from it with checkpoint.restore_from=DIR/checkpoints. Tensors are
read lazily, one at a time (one layer's at a time for stacked layers), and each is placed
straight into its parameter's sharding, so a model larger than one device's memory imports
under FSDP. `launch.py export --workdir DIR --format hf --out PATH` writes the layout that
`transformers.AutoModelForCausalLM.from_pretrained(PATH)` loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from engine.checkpoint.store import open_checkpoints, restore_newest
from engine.config import data_config, load_config, save_config, with_keys
from engine.data import example_spec
from engine.data.recorded import DATA_SHAPE, recorded_shape, shape_record
from engine.errors import UsageError
from engine.hub.hf_adapters import adapter_tensors, merged, peft_base, write_peft
from engine.hub.inference import new_output_dir, run_config, staged
from engine.lm.chat import JINJA_FILE, check_imported_template
from engine.lm.finetune import lora_on
from engine.lm.tokenizer import (
    HF_CONFIG,
    TOKENIZER,
    TOKENIZER_COMPANIONS,
    canonical,
    check_config_data,
    check_model_files,
    copy_tokenizer,
)
from engine.parallel import sharding
from engine.run.setup import build_run
from engine.runtime.rundir import LOCK, write_atomic
from engine.state.train_state import model_variables
from models import REGISTRY
from models.family import ModelFamily, projections

INDEX = "model.safetensors.index.json"
SHARD_BYTES = 2 * 1024**3  # largest safetensors file written by export


def hf_layout(family: ModelFamily):
    """The family's Hugging Face layout (None: it has none)."""
    return family.language_model.hf_layout if family.language_model else None


def _family_for(architecture: str):
    for name, family in REGISTRY.items():
        layout = hf_layout(family)
        if layout is not None and architecture in layout.ARCHITECTURES:
            return name, family
    supported = sorted(a for f in REGISTRY.values() for a in getattr(hf_layout(f), "ARCHITECTURES", ()))
    raise UsageError(f"config.json architectures={architecture!r} is not supported; supported: {', '.join(supported)}")


MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on a file's JSON header
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2}
DTYPE_BYTES.update({"U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8})


def _inside(hf_dir: Path, file: Path) -> Path:
    """`file` with symlinks resolved; UsageError unless it lies inside `hf_dir`."""
    root, resolved = hf_dir.resolve(), file.resolve()
    if not resolved.is_relative_to(root):
        raise UsageError(
            f"{file} resolves to {resolved}, outside the Hugging Face directory {root}; the files import-hf "
            "reads must lie inside it"
        )
    return resolved


def check_safetensors(path: Path) -> list[str]:
    """The tensor names of a safetensors file whose header has been checked against the file's
    length (sizes, offsets, dtypes) before anything is read or allocated; UsageError naming the
    file and the fault otherwise."""
    size = path.stat().st_size if path.is_file() else -1
    if size < 8:
        raise UsageError(f"{path}: not a safetensors file ({'missing' if size < 0 else f'{size} bytes'})")
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > min(MAX_HEADER_BYTES, size - 8):
            raise UsageError(f"{path}: the header claims {length:,} bytes, more than the file's {size:,} (or 100 MiB)")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UsageError(f"{path}: the header is not valid JSON ({e})") from None
    data = size - 8 - length
    if not isinstance(header, dict):
        raise UsageError(f"{path}: the header is not a JSON object")
    names = [name for name in header if name != "__metadata__"]
    for name in names:
        _check_entry(path, name, header[name], data)
    return names


def _check_entry(path: Path, name: str, entry, data: int) -> None:
    fault = None
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPE_BYTES:
        fault = f"an entry without a known dtype ({str(entry)[:80]})"
    else:
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            fault = f"shape {shape!r} is not a list of sizes"
        elif not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            fault = f"data_offsets {offsets!r} are not [begin, end]"
        elif not 0 <= offsets[0] <= offsets[1] <= data:
            fault = f"data_offsets {offsets} lie outside the file's {data:,} bytes of data"
        elif math.prod(shape) * DTYPE_BYTES[entry["dtype"]] != offsets[1] - offsets[0]:
            fault = f"shape {shape} of {entry['dtype']} does not match its {offsets[1] - offsets[0]:,} bytes"
    if fault:
        raise UsageError(f"{path}: tensor {name!r}: {fault}; the file is damaged or not safetensors")


def _tensor_files(hf_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file that holds it (each inside hf_dir, its header checked)."""
    index = hf_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise UsageError(f"{index} is not a safetensors index ({e})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise UsageError(f"{index}: weight_map must map tensor names to file names")
        named = {file: _inside(hf_dir, hf_dir / file) for file in set(weight_map.values())}
        for path in named.values():
            check_safetensors(path)
        return {name: named[file] for name, file in weight_map.items()}
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise UsageError(f"{hf_dir} holds no *.safetensors files (and no {INDEX})")
    found = {}
    for file in files:
        resolved = _inside(hf_dir, file)
        found.update({name: resolved for name in check_safetensors(resolved)})
    return found


class _Reader:
    """Reads one tensor at a time, keeping the file open between reads of the same file."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.path: Optional[Path] = None
        self.handle: Any = None

    def __call__(self, name: str) -> np.ndarray:
        from safetensors import safe_open

        if name not in self.files:
            raise UsageError(f"the checkpoint has no tensor {name!r}; is it the architecture config.json names?")
        if self.files[name] != self.path:
            self.path = self.files[name]
            self.handle = safe_open(self.path, framework="numpy")
        return self.handle.get_tensor(name)


def import_hf(hf_dir: str, workdir: str, config: str | None = None, overrides: Sequence[str] = ()) -> Path:
    """Writes workdir/config.yaml, a step-0 checkpoint of the Hugging Face model in hf_dir, and
    the model's tokenizer (tokenizer.json and its companions, where the directory has them).
    One import per workdir at a time (its lock); a failed import leaves the workdir as it found it."""
    hf_path, work = Path(hf_dir), Path(workdir)
    if not (hf_path / "config.json").is_file():
        raise UsageError(f"{hf_path} has no config.json; give a Hugging Face model directory")
    if (work / "checkpoints").exists():
        raise UsageError(f"{work}/checkpoints exists; import into a new --workdir")
    from engine.run.outputs import claim

    # the lock file this import adds to an existing workdir goes again if it fails (claim itself
    # removes a workdir it created)
    lock_of_ours = work.is_dir() and not (work / LOCK).exists()
    with contextlib.ExitStack() as closing:
        claim(work, closing, wait_seconds=0.0, job="import-hf")
        try:
            if (work / "checkpoints").exists():  # another import finished while this one started
                raise UsageError(f"{work}/checkpoints exists; import into a new --workdir")
            return _import_hf(hf_path, work, config, overrides)
        except BaseException:
            if lock_of_ours:  # removed while still held, as claim removes a workdir it created
                (work / LOCK).unlink(missing_ok=True)
            raise


def _import_hf(hf_path: Path, work: Path, config: str | None, overrides: Sequence[str]) -> Path:
    try:
        hf_config = json.loads((hf_path / "config.json").read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{hf_path / 'config.json'} is not valid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise UsageError(f"{hf_path / 'config.json'} is not a JSON object")
    name, family = _family_for((hf_config.get("architectures") or ["?"])[0])
    layout = hf_layout(family)
    try:
        model = layout.config_from_hf(hf_config)
    except ValueError as e:
        raise UsageError(str(e)) from None
    from engine.config import CONFIG_DIR

    model_overrides = [f"model.{key}={json.dumps(value)}" for key, value in model.items()]
    tokenizer = _inside(hf_path, hf_path / TOKENIZER) if (hf_path / TOKENIZER).is_file() else None
    kept = _tokenizer_files(hf_path) if tokenizer is not None else {}
    if tokenizer is not None:
        canonical(tokenizer)  # a damaged tokenizer.json is refused here, not met later by sample
        check_imported_template(hf_path)  # so is a chat template that fails or reaches a bound (engine/lm/chat.py)
    # base.yaml's data is images; without a config of its own the run gets real offline text,
    # tokenized with the model's own tokenizer where the directory has one (by the first training run)
    data = [] if config else ["data.name=python_source", *([f"data.tokenizer={tokenizer}"] if tokenizer else [])]
    cfg = load_config(config or CONFIG_DIR / "base.yaml", [*data, *model_overrides, *overrides], str(work))
    if not config and not any(o.startswith("checkpoint.every_steps=") for o in overrides):
        cfg = _saving_periodically(cfg)
    if tokenizer is not None:  # data of another tokenizer (or bytes) would train the model on ids it reads otherwise
        check_config_data(tokenizer, cfg.data)
    run = build_run(_reading_no_data(cfg, model.get("vocab_size")), compile_train=False)
    read = _Reader(_tensor_files(hf_path))
    params = run.abstract_state.params
    for tensor in layout.tensors(cfg.model):
        target = _get(params, tensor.path)
        params = _set(params, tensor.path, _place(tensor, target, read))
    missing = [
        sharding.path_name(path)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        if isinstance(leaf, jax.ShapeDtypeStruct)
    ]
    if missing:
        raise RuntimeError(f"the Hugging Face mapping of model.name={name} leaves {missing} unset")
    state = run.init_state(params)  # a fresh optimizer state beside the imported weights
    if tokenizer is not None and not config and hasattr(cfg.data, "tokenizer"):  # (python_source, unless switched)
        # the written config reads the workdir's copy, which moves with the run
        cfg = dataclasses.replace(cfg, data=with_keys(cfg.data, tokenizer=str((work / TOKENIZER).absolute())))
    if not config:  # the data's shape, for sample and export before any training run tokenized it
        kept[DATA_SHAPE] = _import_shape(run.dataset, work if tokenizer is not None else None)
    _write_import(work, {**kept, HF_CONFIG: json.dumps(hf_config, indent=2) + "\n"}, cfg, state, hf_path)
    return work


def _import_shape(stand_in, work: Optional[Path]) -> str:
    """data.json of an import's python_source data: the fields of `stand_in` (the synthetic text
    the import built its model from), with the text read by the workdir's tokenizer.json (`work`)
    or as UTF-8 bytes (None)."""
    codec = {"text_codec": "tokenizer", "tokenizer": str((work / TOKENIZER).absolute())} if work else {}
    info = dataclasses.replace(stand_in.info, **(codec or {"text_codec": "bytes", "tokenizer": ""}))
    return shape_record(info, example_spec(stand_in.train), example_spec(stand_in.eval)) + "\n"


def _saving_periodically(cfg):
    """cfg saving a checkpoint every tenth of train.steps (at a multiple of log.every_steps where
    that fits): a kill of the first fine-tuning run loses at most a tenth of it."""
    tenth = max(cfg.train.steps // 10, 1)
    unit = cfg.log.every_steps if tenth >= cfg.log.every_steps else 1
    every = max(tenth // unit * unit, 1)
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, every_steps=every))


def _reading_no_data(cfg, vocab: Optional[int]):
    """cfg with data that reads nothing (synthetic_text of the model's `vocab`, at data.seq_len):
    the model and its state are built from it, while the config written keeps cfg's data for the
    first training run to read (or tokenize)."""
    batch = max(cfg.train.global_batch_size, cfg.eval.batch_size)
    kept = {key: getattr(cfg.data, key) for key in ("vocab_size", "seq_len") if hasattr(cfg.data, key)}
    if vocab:
        kept["vocab_size"] = vocab
    data = data_config(**kept, name="synthetic_text", num_examples=4 * batch)
    return dataclasses.replace(cfg, data=data)


def _tokenizer_files(hf_path: Path) -> dict[str, str]:
    """The tokenizer files import-hf keeps (tokenizer, special tokens, chat template): name → text,
    each read from inside hf_path and checked (JSON, or a UTF-8 template), every size checked first."""
    check_model_files(hf_path)  # (a 1.5 GB chat_template.jinja is refused by its size, not read)
    kept = {}
    for name in (TOKENIZER, *TOKENIZER_COMPANIONS):
        if (hf_path / name).is_file():
            path = _inside(hf_path, hf_path / name)
            try:
                kept[name] = path.read_bytes().decode("utf-8") if name == JINJA_FILE else _json_text(path)
            except UnicodeDecodeError as e:
                raise UsageError(f"{path} is not UTF-8 text ({e}); save the chat template as UTF-8") from None
    return kept


def _write_import(work: Path, files: dict[str, str], cfg, state, hf_path: Path) -> None:
    """`files` (name → text), config.yaml and the step-0 checkpoint, written into work/.import and
    moved into place once all are written, the checkpoint last: a failed import leaves none of them
    (re-running it starts over), a finished one is complete."""
    staging = work / ".import"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for name, text in files.items():  # the tokenizer, token ids, names: kept for sample and export
            write_atomic(staging / name, text)
        save_config(cfg, staging / "config.yaml")
        _save_step_zero(staging, cfg, state, hf_path)
        for name in [*files, "config.yaml", "checkpoints"]:
            os.replace(staging / name, work / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _save_step_zero(staging: Path, cfg, state, hf_path: Path) -> None:
    """The imported state as the run's checkpoint at step 0, in staging/checkpoints."""
    from engine.run.outputs import checkpoint_meta

    checkpointer = open_checkpoints(staging / "checkpoints", cfg, write=True, frozen_base=False)
    try:
        checkpointer.save(0, state, checkpoint_meta(cfg, 0, imported_from=str(hf_path.absolute())))
        checkpointer.wait()
    finally:
        checkpointer.close()


def _json_text(path: Path) -> str:
    """The text of a JSON file, refused (UsageError) unless it parses."""
    try:
        text = path.read_text(encoding="utf-8")
        json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path} is not valid JSON ({e}); the Hugging Face directory is damaged") from None
    return text


def _place(tensor, target: jax.ShapeDtypeStruct, read) -> jax.Array:
    """One parameter from its Hugging Face tensor(s), in `target`'s shape, dtype and sharding."""
    stacked = tensor.stacked
    layer_shape = target.shape[1:] if stacked else target.shape
    spec = target.sharding.spec
    layer_sharding = NamedSharding(target.sharding.mesh, PartitionSpec(*spec[1:]) if stacked else spec)
    layers = []
    for name in tensor.names:
        value = tensor.to_ours(read(name))
        if tuple(value.shape) != tuple(layer_shape):
            raise UsageError(
                f"tensor {name} has shape {tuple(value.shape)} in our layout, but the model built from "
                f"config.json expects {tuple(layer_shape)}"
            )
        layers.append(jax.device_put(value.astype(target.dtype), layer_sharding))  # one tensor on the host at a time
    if not stacked:
        return layers[0]
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=target.sharding)(*layers)


def _get(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def _set(tree, path, value):
    if not path:
        return value
    return {**tree, path[0]: _set(tree[path[0]], path[1:], value)}


def export_hf(workdir: str, out: str, merge: bool = False, base_model: Optional[str] = None) -> Path:
    """The newest checkpoint of the run in workdir, as a Hugging Face model directory; of a
    LoRA run, its adapters as a PEFT directory (for `base_model`: by default the Hugging Face
    directory its base was imported from), or (`merge`) folded into the base."""
    work, out_path = Path(workdir), new_output_dir(out)
    cfg = run_config(work)
    if base_model is not None and (merge or not lora_on(cfg)):
        raise UsageError(
            f"--base-model names the base of a LoRA run's adapter directory, but {work} "
            + ("is exported whole with --merge" if merge else "trained no adapters (finetune.lora.rank=0)")
            + "; leave out --base-model"
        )
    family = REGISTRY[cfg.model.name]
    layout = hf_layout(family)
    if layout is None:
        raise UsageError(f"model.name={cfg.model.name} has no Hugging Face layout; use the default export format")
    run = build_run(cfg, compile_train=False, dataset=recorded_shape(cfg))  # (no data read: data.json)
    try:  # first: a model without a Hugging Face layout (a mixture of experts) writes nothing
        hf_config = layout.config_to_hf(cfg.model, run.dataset.info, cfg.train.param_dtype)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if merge and not lora_on(cfg):
        raise UsageError(f"--merge folds LoRA adapters into the base, but {work} trained none (finetune.lora.rank=0)")
    restored = restore_newest(work, run.abstract_state, cfg, "export")
    params = model_variables(restored.state.params, restored.state.model_state)["params"]
    if lora_on(cfg) and not merge:
        peft_tensors, targets = adapter_tensors(params, layout.tensors(cfg.model))
        name = peft_base(cfg, base_model)  # (the base was read above: its checksums are checked)
        with staged(out_path) as staging:
            write_peft(staging, cfg, peft_tensors, targets, name)
            copy_tokenizer(work, run.dataset.info, staging)
        return out_path
    if lora_on(cfg):
        params = merged(params, projections(family), cfg.finetune.lora.alpha / cfg.finetune.lora.rank)
    tensors = {}
    for tensor in layout.tensors(cfg.model):  # a tensor reads a parameter, or a module's (GPT-2's fused qkv)
        value = jax.device_get(_get(params, tensor.path))
        layers = value if tensor.stacked else [value]
        tensors.update({name: np.asarray(tensor.to_hf(layer)) for name, layer in zip(tensor.names, layers)})
    with staged(out_path) as staging:
        _write_hf(staging, work, run, tensors, hf_config)
    return out_path


def _write_hf(out_path: Path, work: Path, run, tensors: dict, hf_config: dict) -> None:
    _write_safetensors(tensors, out_path)
    if (work / HF_CONFIG).is_file():  # an imported model keeps what we do not model (bos/eos ids, context length)
        original = json.loads((work / HF_CONFIG).read_text())
        kept = {k: v for k, v in original.items() if k not in hf_config or k == "max_position_embeddings"}
        hf_config = {**hf_config, **kept}
    write_atomic(out_path / "config.json", json.dumps(hf_config, indent=2) + "\n")
    copy_tokenizer(work, run.dataset.info, out_path)  # the tokenizer goes with the weights


def _write_safetensors(tensors: dict[str, np.ndarray], out: Path) -> None:
    """One model.safetensors, or shards of at most SHARD_BYTES with an index (transformers' layout)."""
    from safetensors.numpy import save_file

    shards: list[dict[str, np.ndarray]] = []
    current: dict[str, np.ndarray] = {}
    size = 0
    for name, value in tensors.items():
        if current and size + value.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = value
        size += value.nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in shard})
    total = sum(v.nbytes for v in tensors.values())
    write_atomic(out / INDEX, json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
