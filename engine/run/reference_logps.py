"""dpo.precompute_reference: the reference's log-probabilities of every pair, computed once before training.

A run with train.objective=dpo and dpo.precompute_reference=true carries, in each split of its
dataset, one more array REF_LOGPS: float32 [pairs, 2], the reference's log-probability of each
pair's chosen and rejected response (engine/objectives/dpo_part.py). The pipeline indexes the first axis of
every array, so a pair's values travel with it into every batch (shuffled, sharded, held on the
devices); the step then runs no reference model, and under full fine-tuning the train state
holds no copy of the starting parameters (engine/run/state.py).

`with_slots` adds the arrays as zeros when the run is planned (their shapes are the compiled
program's); `fill` writes their values once the starting state is known, before the first step:
from the reference (LoRA: the base with the adapters off; full fine-tuning: the starting
parameters), in batches of the eval batch size, on the run's mesh. The values are cached in the
workdir (reference_logps/KEY.npy, the train split's rows then the eval split's), KEY a hash of
the pair files' bytes, the tokenizer file's, the reference parameters', the rendered pairs',
data.seq_len, data.overflow and the model's settings: a run that starts again (a resume, a
SIGKILL's restart) reads the same values; a cache that does not match is not used, and a damaged
one is computed again (said on the console). Beside each cache, KEY.json holds the sha256 of its
values and what KEY was made of; a cache whose values no longer have that checksum (a changed
value, a flipped bit, no KEY.json) is damaged. The reference parameters' checksum is recorded
(reference_logps/reference.json) for a resumed full fine-tuning run, whose state no longer holds
them. Each checkpoint's meta records the sha256 of the values the run trains with (`record`): a
resumed run whose cache does not give them computes them again, and refuses (UsageError naming the
cache) to go on with values other than the ones it trained with.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

import jax
import numpy as np
from jax.experimental import multihost_utils

from engine.config.dpo_objective import REF_LOGPS
from engine.config.objective import objective_of
from engine.data import Dataset, eval_batches
from engine.errors import UsageError
from engine.objectives import objective_part
from engine.parallel import sharding
from engine.runtime.processes import current
from engine.state.train_state import FROZEN

DIRECTORY = "reference_logps"  # in the workdir
RECORD = "reference.json"  # {"params": the reference parameters' checksum}
META = "reference_logps"  # the checkpoint meta's {"sha256": of the values trained with, "file": the cache}


def precomputed(cfg) -> bool:
    """Whether the run's batches carry the reference's log-probabilities."""
    return objective_of(cfg).prepass(cfg)


def with_slots(cfg, dataset: Dataset) -> Dataset:
    """The dataset with REF_LOGPS zeros [pairs, 2] in each split (precomputed runs; `fill` writes them)."""
    if not precomputed(cfg):
        return dataset

    def slot(split: dict) -> dict:
        return {**split, REF_LOGPS: np.zeros((_pairs(split), 2), np.float32)}

    return dataclasses.replace(dataset, train=slot(dataset.train), eval=slot(dataset.eval))


def _pairs(split: dict) -> int:
    """A split's examples (the first axis of every array)."""
    return len(next(iter(split.values())))


def digest_tree(tree) -> str:
    """sha256 of a tree's leaves (their paths, shapes, dtypes and bytes), in path order."""
    h = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        value = np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
        h.update(f"{jax.tree_util.keystr(path)}:{value.shape}:{value.dtype}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    return h.hexdigest()


def reference_digest(params, model_state) -> str:
    """The checksum of the reference's parameters: LoRA's base (FROZEN), or the parameters."""
    return digest_tree(model_state[FROZEN] if FROZEN in model_state else params)


def _file_digest(path: str) -> str:
    if not path:
        return ""
    h = hashlib.sha256()
    with open(Path(path).expanduser(), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def cache_key(cfg, dataset: Dataset, params_digest: str) -> str:
    """The cache's name: a hash of what the reference's log-probabilities depend on."""
    return _key(_key_parts(cfg, dataset, params_digest))


def _key(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def _key_parts(cfg, dataset: Dataset, params_digest: str) -> dict:
    """What the cache's name is a hash of (KEY.json keeps it)."""
    data = cfg.data
    arrays = hashlib.sha256()
    for split in (dataset.train, dataset.eval):
        for name in sorted(split):
            if name != REF_LOGPS:
                arrays.update(name.encode() + np.ascontiguousarray(split[name]).tobytes())
    parts = {
        "pairs": _file_digest(data.path),
        "eval_pairs": _file_digest(getattr(data, "eval_path", "")),
        "tokenizer": _file_digest(dataset.info.tokenizer),
        "reference": params_digest,
        "seq_len": data.seq_len,
        "overflow": getattr(data, "overflow", ""),
        "rendered": arrays.hexdigest(),
        "model": repr(cfg.model),
        "compute_dtype": cfg.train.compute_dtype,
        "average": False,  # sums over each response's targets (IPO's per-target means were cached before)
    }
    return parts


def values_digest(values: np.ndarray) -> str:
    """sha256 of the values (float32 [pairs, 2], C order): KEY.json's and the checkpoint meta's."""
    return hashlib.sha256(np.ascontiguousarray(values, np.float32).tobytes()).hexdigest()


def compute(run, params, model_state) -> np.ndarray:
    """The reference's log-probabilities of the train split's pairs then the eval split's
    [train + eval, 2], in eval-sized batches on the run's mesh."""
    make_reference = objective_part(run.cfg).reference_fn
    assert make_reference is not None  # (a pre-pass's objective has one: DPO's)
    reference = jax.jit(
        make_reference(run.model.module, run.model.family.task),
        out_shardings=sharding.replicated(run.mesh),
    )
    size, rows = run.inputs.eval_batch_size, run.inputs.eval_rows
    parts = []
    for split in (run.dataset.train, run.dataset.eval):
        arrays = {name: array for name, array in split.items() if name != REF_LOGPS}
        count = _pairs(arrays)
        for b, host in enumerate(eval_batches(arrays, size, rows=rows)):
            values = np.asarray(jax.device_get(reference(params, model_state, run.compiled.put_batch(host, size))))
            parts.append(values[: count - b * size].astype(np.float32))
    return np.concatenate(parts)


def _read(path: Path, rows: int) -> tuple[Optional[np.ndarray], str]:
    """(the cached values, "") or (None, why they are not used: "" where there is no cache)."""
    if not path.is_file():
        return None, ""
    try:
        values = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        return None, f"unreadable ({type(e).__name__}: {e})"
    if values.shape != (rows, 2) or values.dtype != np.float32 or not np.isfinite(values).all():
        return None, f"damaged (shape {values.shape}, {values.dtype}; expected ({rows}, 2) float32, finite)"
    sidecar = path.with_suffix(".json")
    try:
        written = json.loads(sidecar.read_text(encoding="utf-8"))
        checksum, key = str(written["sha256"]), str(written["key"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return None, f"without a readable checksum ({sidecar}: {type(e).__name__})"
    if key != path.stem or checksum != values_digest(values):
        return None, f"not the values written (their sha256 is not the one {sidecar} records)"
    return values, ""


def _write(path: Path, values: np.ndarray, parts: dict) -> None:
    """KEY.npy, then KEY.json: the values' sha256 and what KEY was made of (a cache without it is not read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    written = {"sha256": values_digest(values), "key": path.stem, "shape": list(values.shape), "inputs": parts}
    for target, write in (
        (path, lambda f: np.save(f, values, allow_pickle=False)),
        (path.with_suffix(".json"), lambda f: f.write(json.dumps(written, indent=1, sort_keys=True).encode() + b"\n")),
    ):
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def _recorded_digest(directory: Path) -> str:
    try:
        return str(json.loads((directory / RECORD).read_text())["params"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def fill(
    run, reference: Optional[tuple[Any, Any]], starting: Optional[Callable] = None, trained: str = ""
) -> list[str]:
    """Writes the reference's log-probabilities into the run's dataset (REF_LOGPS, in place):
    from the cache, or computed from `reference` ((params, model_state) of the reference: a
    fresh state's, or a LoRA state's) and cached. `reference` None (a resumed full fine-tuning
    run): the checksum recorded at the run's start names the cache; where that cache is gone,
    `starting()` (params, model_state) makes the starting parameters again. `trained`: the sha256
    of the values a resumed run trained with (its checkpoint's meta), which the values must have.
    The lines to say."""
    cfg, dataset = run.cfg, run.dataset
    directory = Path(cfg.workdir).expanduser() / DIRECTORY
    digest = reference_digest(*reference) if reference is not None else _recorded_digest(directory)
    if not digest:
        if starting is None:
            raise UsageError(
                f"dpo.precompute_reference: {directory / RECORD} is missing, and this state holds no reference "
                "parameters; train the run from its start (or set dpo.precompute_reference=false)"
            )
        reference = starting()
        digest = reference_digest(*reference)
    rows = len(dataset.train[REF_LOGPS]) + len(dataset.eval[REF_LOGPS])
    parts = _key_parts(cfg, dataset, digest)
    path = directory / f"{_key(parts)}.npy"
    values, problem = _read(path, rows)
    if values is not None and trained and values_digest(values) != trained:
        values, problem = None, "not the values this run trained with (its checkpoint records another sha256)"
    lines = [f"dpo: the reference's log-probabilities read from {path}"] if values is not None else []
    if values is None:
        if reference is None:
            if starting is None:
                raise UsageError(f"dpo.precompute_reference: {path} is gone; train the run from its start")
            reference = starting()
            if reference_digest(*reference) != digest:
                raise UsageError(
                    f"dpo.precompute_reference: {path} is gone and the starting parameters made again differ "
                    f"from the run's ({directory / RECORD}); train the run from its start"
                )
        values = compute(run, *reference)
        if problem:
            lines.append(f"note: the cached reference log-probabilities {path} were {problem}; computed again")
        check_trained(values, trained, path)
        lines.append(f"dpo: the reference's log-probabilities of {rows:,} pairs computed once, cached in {path}")
        if current().chief:  # (the run's: a sweep trial's may be on some of the job's processes)
            _write(path, values, parts)
    if current().chief:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / RECORD).write_text(json.dumps({"params": digest}) + "\n")
    train = len(dataset.train[REF_LOGPS])
    dataset.train[REF_LOGPS][...] = values[:train]
    dataset.eval[REF_LOGPS][...] = values[train:]
    return lines


def check_trained(values: np.ndarray, trained: str, path: Path) -> None:
    """UsageError when a resumed run's values (computed again) are not the ones it trained with."""
    if trained and values_digest(values) != trained:
        raise UsageError(
            f"dpo.precompute_reference: {path} does not hold the reference log-probabilities this run trained with "
            "(their sha256, recorded in its checkpoint, differs), and computing them again gives other values; "
            f"restore {path.parent} from a copy of the workdir, or train the run from its start in a new workdir"
        )


def record(run) -> dict:
    """What a checkpoint's meta keeps of the values the run trains with ({} without precomputed ones)."""
    if not precomputed(run.cfg):
        return {}
    values = np.concatenate([run.dataset.train[REF_LOGPS], run.dataset.eval[REF_LOGPS]])
    return {META: {"sha256": values_digest(values)}}


def trained_digest(meta: dict) -> str:
    """The sha256 of the values a resumed run's checkpoint recorded ("" for none: a run from before it)."""
    recorded = meta.get(META)
    return str(recorded.get("sha256", "")) if isinstance(recorded, dict) else ""


def fill_run(run, state, resumed: bool, trained: str = "") -> list[str]:
    """`fill` for a run starting from `state` (`resumed`: its own checkpoint's, whose parameters
    have trained: the reference is then the LoRA state's base, or the recorded checksum's cache;
    `trained`: trained_digest of its meta)."""
    if not precomputed(run.cfg):
        return []
    own = FROZEN in state.model_state or not resumed
    reference = (state.params, state.model_state) if own else None

    def starting() -> tuple[Any, Any]:  # (a run from scratch: its seed's parameters)
        fresh = run.init_state()
        return fresh.params, fresh.model_state

    return fill(run, reference, None if run.cfg.checkpoint.restore_from else starting, trained)
