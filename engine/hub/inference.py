"""`launch.py export`: a trained run's inference variables (orbax) and its forward function
serialised with jax.export (StableHLO, batch size left symbolic), for serving without this code."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import jax
import orbax.checkpoint as ocp

from engine.checkpoint.store import restore_newest
from engine.config import Config, load_config
from engine.data.recorded import PREPROCESSING, recorded_preprocessing, recorded_shape
from engine.errors import UsageError
from engine.lm.tokenizer import copy_tokenizer
from engine.parallel.axes import CONFIG_AXES
from engine.run.setup import build_run
from engine.runtime.rundir import write_sums
from engine.state.train_state import model_variables
from models.projection import dequantized, is_quantised

SINGLE_DEVICE = [
    *(f"mesh.{axis}=1" for axis in CONFIG_AXES),
    *(f"mesh.dcn_{axis}=1" for axis in CONFIG_AXES),
    "mesh.num_devices=1",
    "mesh.backend=jit",
    "log.progress=false",
]


def run_config(workdir: Path) -> Config:
    """A finished or running run's own config.yaml, on one device (the readers of a run:
    export, Hugging Face export, sample); UsageError if workdir is not a run's directory."""
    if not (workdir / "config.yaml").is_file():
        raise UsageError(f"{workdir} has no config.yaml; --workdir must be a training run's directory")
    return load_config(workdir / "config.yaml", SINGLE_DEVICE, str(workdir))


def new_output_dir(out: str) -> Path:
    """--out as an absolute path, refused if it exists with anything in it (nothing is overwritten)."""
    out_path = Path(out).absolute()
    if out_path.exists() and any(out_path.iterdir()):
        raise UsageError(f"--out {out_path} exists and is not empty; choose a new directory")
    return out_path


@contextlib.contextmanager
def staged(out_path: Path) -> Iterator[Path]:
    """A hidden directory beside `out_path` to write an export into, renamed to `out_path` whole
    when the block ends without error: an export cut short (a kill, a full disk) never leaves a
    half-written --out, and re-running it starts over (earlier partial attempts are removed)."""
    parent = out_path.parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".{out_path.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = parent / f".{out_path.name}.partial-{os.getpid()}"
    staging.mkdir()
    try:
        yield staging
        if out_path.exists():
            out_path.rmdir()  # empty (new_output_dir); OSError if another export filled it meanwhile
        os.replace(staging, out_path)
    except OSError as e:
        raise UsageError(f"--out {out_path} could not be written ({e}); choose a new directory") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def export_run(workdir: str, out: str, step: Optional[str] = None) -> Path:
    """The run's newest checkpoint (or the one `step` names: best or N) exported into `out`."""
    workdir_path, out_path = Path(workdir), new_output_dir(out)
    # Gathered onto one device: the exported program is independent of the training mesh.
    cfg = run_config(workdir_path)
    recorded = recorded_shape(cfg)  # (no data read: data.json)
    if recorded is not None and recorded.info.preprocessing_data:  # a table's data is read: an export
        recorded = None  # refuses data whose preprocessing changed since (docs/data.md)
    run = build_run(cfg, compile_train=False, dataset=recorded)
    preprocessing = recorded_preprocessing(workdir_path, run.dataset.info)
    restored = restore_newest(workdir_path, run.abstract_state, cfg, "export", step)
    variables = model_variables(restored.state.params, restored.state.model_state)
    variables["params"] = jax.tree.map(dequantized, variables["params"], is_leaf=is_quantised)  # (a QLoRA base)
    module, task = run.model.module, run.model.family.task

    def forward(variables, inputs):
        return module.apply(variables, inputs, train=False)

    signature = task.export_input(run.dataset.info)  # one example, as the model family says
    exported = jax.export.export(jax.jit(forward))(
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), variables), symbolic_inputs(signature)
    )
    serialized = exported.serialize()  # before anything is written: a failure leaves no partial export
    with staged(out_path) as staging:
        _write_export(staging, cfg, run, restored, variables, serialized, signature)
        copy_tokenizer(workdir_path, run.dataset.info, staging)  # a language model's text goes in and out by it
        _copy_preprocessing(preprocessing, run.dataset.info, staging)
        write_sums(staging)  # last: `sha256sum -c SHA256SUMS` in PATH checks every file before serving
    return out_path


def symbolic_inputs(signature):
    """The family's export_input → ShapeDtypeStructs with a symbolic batch (a dict of inputs
    shares one `batch`)."""
    named = signature if isinstance(signature, dict) else {"": signature}
    scope = jax.export.SymbolicScope([c for _, _, constraints in named.values() for c in constraints])
    out = {
        name: jax.ShapeDtypeStruct(
            jax.export.symbolic_shape(", ".join(["batch", *map(str, shape)]), scope=scope), dtype
        )
        for name, (shape, dtype, _) in named.items()
    }
    return out if isinstance(signature, dict) else out[""]


def _signature_json(signature) -> dict:
    if isinstance(signature, dict):
        inputs = {name: {"shape": ["batch", *shape], "dtype": dtype} for name, (shape, dtype, _) in signature.items()}
        return {"inputs": inputs, "input_constraints": [c for _, _, cs in signature.values() for c in cs]}
    shape, dtype, constraints = signature
    return {"input_shape": ["batch", *shape], "input_constraints": list(constraints), "input_dtype": dtype}


def _copy_preprocessing(preprocessing: bytes, info, out_path: Path) -> None:
    """A table's preprocessing as data (the run's preprocessing.json, byte for byte) and the
    code that applies it."""
    if preprocessing:
        (out_path / PREPROCESSING).write_bytes(preprocessing)
    for file in info.serving_files:
        shutil.copyfile(file, out_path / Path(file).name)


def _write_export(out_path: Path, cfg, run, restored, variables, serialized: bytes | bytearray, signature) -> None:
    with ocp.StandardCheckpointer() as saver:
        saver.save(out_path / "variables", variables)
    (out_path / "forward.stablehlo").write_bytes(serialized)
    (out_path / "export.json").write_text(
        json.dumps(
            {
                "model": cfg.model.name,
                "step": restored.step,
                **_signature_json(signature),
                "preprocessing": run.dataset.info.preprocessing or "none: the data source's values as stored",
                "variables": "variables/",
                "forward": "forward.stablehlo",
                "usage": "jax.export.deserialize(bytes).call(variables, inputs) → logits",
            },
            indent=2,
        )
    )
