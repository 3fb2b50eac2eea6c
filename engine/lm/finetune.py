"""Fine-tuning published weights: LoRA adapters on a frozen base (`finetune.*`), the base
stored quantised (QLoRA), quantised matmuls (`train.matmul_dtype`).

The model's projections (models/projection.py) hold the adapters beside their kernels. The
train state's `params` are the adapters alone, so gradients, the optimizer state and the
checkpoint cover only them; the rest of the model's parameters (the base) live in the model
state's FROZEN collection, quantised by qwix when `finetune.base_dtype` says so, and join
the adapters in the model's `params` each step (engine/run/step.py model_variables). A checkpoint
holds the adapters and the base's identity (its directory, step and the SHA-256 of its
checksum file), not the base: a resume reads the base again from `finetune.base` and refuses
a base that changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from pathlib import Path
from typing import Any, Mapping, Optional

import jax
import jax.numpy as jnp
import qwix
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import NamedSharding, PartitionSpec

from contract.adapters import NO_ADAPTATION, Adaptation, targeted
from engine.errors import UsageError
from engine.runtime.rundir import SUMS
from engine.runtime.yaml_files import read_yaml_mapping
from engine.state.train_state import FROZEN
from models.projection import PackedNF4, dequantized, quantize_kernel

ADAPTER_LEAVES = ("lora_a", "lora_b")
QUANTISED = (qwix.QArray, PackedNF4)


def adaptation(cfg, projections: Mapping[str, tuple[int, int]]) -> Adaptation:
    """What the config asks of the model's projections; UsageError naming the key it cannot do."""
    lora, matmul = cfg.finetune.lora, cfg.train.matmul_dtype
    if not lora.rank and matmul == "none":
        return NO_ADAPTATION
    key = "finetune.lora.rank" if lora.rank else "train.matmul_dtype"
    if not projections:
        raise UsageError(
            f"{key}: model.name={cfg.model.name} has no named projections to adapt or quantise; LoRA and "
            f"quantised matmuls need a Llama-family model (model.name=llama)"
        )
    try:
        targets = targeted(list(lora.targets), projections) if lora.rank else ()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return Adaptation(lora.rank, lora.alpha, lora.dropout, targets, lora.init, matmul)


def lora_on(cfg) -> bool:
    return cfg.finetune.lora.rank > 0


def split(params) -> tuple[dict, dict]:
    """(adapters, base) of a model's parameter tree (nested dicts)."""
    flat = flatten_dict(params)
    adapters = {k: v for k, v in flat.items() if k[-1] in ADAPTER_LEAVES}
    return unflatten_dict(adapters), unflatten_dict({k: v for k, v in flat.items() if k not in adapters})


def merged(params, projections: Mapping[str, tuple[int, int]], scale: float) -> dict:
    """A plain parameter tree: each adapted kernel W + scale·A·B (a quantised base dequantised
    first), the adapters dropped; in each kernel's dtype."""
    flat = flatten_dict(params)
    out = {}
    for path, value in flat.items():
        if path[-1] in ADAPTER_LEAVES:
            continue
        value = dequantized(value)
        a, b = flat.get((*path[:-1], "lora_a")), flat.get((*path[:-1], "lora_b"))
        if path[-1] == "kernel" and a is not None:
            inputs, outputs = projections[path[-2]]
            lead = value.shape[: value.ndim - inputs - outputs]
            rank = a.shape[-1]
            low = jnp.reshape(a, (*lead, -1, rank)).astype(jnp.float32)
            high = jnp.reshape(b, (*lead, rank, -1)).astype(jnp.float32)
            delta = jnp.reshape(scale * (low @ high), value.shape)
            value = (value.astype(jnp.float32) + delta).astype(value.dtype)
        out[path] = value
    return unflatten_dict(out)


def quantize_base(base, projections: Mapping[str, tuple[int, int]], base_dtype: str):
    """The base with each projection's kernel quantised (models/projection.py quantize_kernel);
    the other parameters (embeddings, norms, the output head) as they are."""
    if base_dtype == "none":
        return base
    flat = flatten_dict(base)
    for path, w in flat.items():
        if path[-1] == "kernel" and len(path) >= 2 and path[-2] in projections:
            flat[path] = quantize_kernel(w, *projections[path[-2]], base_dtype)
    return unflatten_dict(flat)


def frozen_shardings(abstract_frozen, base_shardings):
    """Shardings of the (possibly quantised) base: each array takes its parameter's sharding,
    without the mesh axes that do not divide it (a scale's axis of size 1, or of blocks)."""
    by_path = flatten_dict(base_shardings)

    def shard(path, leaf) -> NamedSharding:
        names = tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        target = by_path[names]
        spec = [*target.spec] + [None] * (leaf.ndim - len(target.spec))
        kept = [
            axes if axes is None or leaf.shape[d] % _size(target.mesh, axes) == 0 else None
            for d, axes in enumerate(spec)
        ]
        return NamedSharding(target.mesh, PartitionSpec(*kept))

    return jax.tree_util.tree_map_with_path(shard, abstract_frozen)


def split_plan(abstract_params, param_shardings, projections, base_dtype: str) -> tuple[Any, Any, Any]:
    """(the adapters' shapes, their shardings, the frozen base's shardings) of a model's."""
    (abstract_adapters, abstract_base), (adapter_shardings, base_shardings) = map(
        split, (abstract_params, param_shardings)
    )
    frozen = jax.eval_shape(lambda b: quantize_base(b, projections, base_dtype), abstract_base)
    return abstract_adapters, adapter_shardings, frozen_shardings(frozen, base_shardings)


def _size(mesh, axes) -> int:
    return math.prod(mesh.shape[name] for name in ((axes,) if isinstance(axes, str) else axes))


def without_frozen(state):
    """The state without its frozen base (what a checkpoint of a fine-tuning run holds)."""
    return state.replace(model_state={k: v for k, v in state.model_state.items() if k != FROZEN})


def with_frozen(state, frozen):
    return state.replace(model_state={**state.model_state, FROZEN: frozen})


class BaseWeights:
    """`finetune.base`: the run whose newest checkpoint's parameters are the frozen base."""

    def __init__(self, cfg, projections: Mapping[str, tuple[int, int]]):
        self.directory = Path(cfg.finetune.base).expanduser().resolve()
        self.checkpoints = self.directory / "checkpoints"
        self.cfg, self.projections = cfg, projections
        self._identity: Optional[dict] = None
        self._chain: Any = None  # (False: read, and not a LoRA run)

    @property
    def identity(self) -> dict:
        """{path, step, sha256}: the base checkpoint and the SHA-256 of its checksum file (of
        its files, when it has none). Of a LoRA run (`chain`), sha256 covers its adapters'
        checksum file and its own base's identity (recorded under "base"), so a change anywhere
        in the chain changes it."""
        if self._identity is None:
            steps = sorted(int(p.name) for p in self.checkpoints.glob("[0-9]*") if p.is_dir() and p.name.isdigit())
            if not steps:
                raise UsageError(
                    f"finetune.base={self.cfg.finetune.base}: {self.checkpoints} holds no checkpoint; give the "
                    f"workdir of `launch.py import-hf` (or of a finished run)"
                )
            step_dir = self.checkpoints / str(steps[-1])
            identity = {"path": str(self.directory), "step": steps[-1], "sha256": _digest(step_dir)}
            if self.chain is not None:
                inner = self.chain.identity
                chained = hashlib.sha256(f"{identity['sha256']} on {inner['sha256']}".encode()).hexdigest()
                identity = {**identity, "sha256": chained, "adapters_sha256": identity["sha256"], "base": inner}
            self._identity = identity
        return self._identity

    @property
    def chain(self) -> Optional["BaseWeights"]:
        """When finetune.base is a LoRA run's workdir: the base that run trained its adapters on (its
        own finetune.base); this base is that one with the run's adapters merged in. Else None."""
        if self._chain is None:
            self._chain = _chained(self) or False
        return self._chain or None

    @property
    def scale(self) -> float:
        """A LoRA base run's adapter scale (its alpha / rank)."""
        lora = self.chain.cfg.finetune.lora if self.chain is not None else self.cfg.finetune.lora
        return lora.alpha / lora.rank

    def frozen_like(self, plain):
        """This base's parameters as its run holds them (quantised as its finetune.base_dtype says):
        their shapes, dtypes and shardings, from those of the plain parameters `plain`."""
        frozen = jax.eval_shape(lambda b: quantize_base(b, self.projections, self.cfg.finetune.base_dtype), plain)
        shardings = frozen_shardings(frozen, jax.tree.map(lambda x: x.sharding, plain))
        return jax.tree.map(lambda f, s: jax.ShapeDtypeStruct(f.shape, f.dtype, sharding=s), frozen, shardings)

    def adapter_shapes(self, saved, plain):
        """The shapes of a LoRA base run's adapters as its checkpoint's metadata (`saved`) gives
        them, replicated over the mesh of `plain`'s shardings."""
        mesh = jax.tree.leaves(plain)[0].sharding.mesh
        replicated = NamedSharding(mesh, PartitionSpec())
        return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=replicated), saved)

    def merge(self, frozen, adapters, plain):
        """A LoRA base run's base (`frozen`, as its run held it) with its adapters folded in, in
        the plain parameters' dtypes and shardings (`plain`)."""
        flat = {**flatten_dict(frozen), **flatten_dict(adapters)}
        shardings = jax.tree.map(lambda x: x.sharding, plain)
        fold = lambda tree: merged(tree, self.projections, self.scale)  # noqa: E731
        return jax.jit(fold, out_shardings=shardings)(unflatten_dict(flat))

    def plain(self, abstract_frozen):
        """The base's parameters as its checkpoint holds them (train.param_dtype, unquantised),
        in shardings like those of `abstract_frozen` (the train state's)."""
        dtype = jnp.dtype(self.cfg.train.param_dtype)

        def plain(leaf):
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=_first_sharding(leaf))

        return jax.tree.map(plain, abstract_frozen, is_leaf=lambda x: isinstance(x, QUANTISED))

    def quantised(self, params, abstract_frozen):
        """The base's parameters quantised as finetune.base_dtype says, in the state's shardings."""
        shardings = jax.tree.map(lambda x: x.sharding, abstract_frozen)
        base_dtype = self.cfg.finetune.base_dtype
        return jax.jit(lambda p: quantize_base(p, self.projections, base_dtype), out_shardings=shardings)(params)

    def check(self, recorded: Optional[dict], where: str) -> None:
        """UsageError when the checkpoint at `where` was trained on another base than this one."""
        if recorded is None or recorded.get("sha256") == self.identity["sha256"]:
            return
        then = (
            f"{recorded.get('path')}/checkpoints/{recorded.get('step')} with checksum {recorded.get('sha256', '')[:16]}"
        )
        now = f"step {self.identity['step']} with {self.identity['sha256'][:16]}"
        raise UsageError(
            f"finetune.base={self.cfg.finetune.base}: the base changed since {where} was saved (it was {then}; "
            f"it is {now} now); fine-tune the base it started from, or give a new workdir"
        )


def _chained(base: BaseWeights) -> Optional[BaseWeights]:
    """The base of the LoRA run whose workdir `base` names (BaseWeights of the run's own
    finetune.base), or None where that workdir's run trained no adapters (an import, a full run)."""
    written = base.directory / "config.yaml"
    if not written.is_file():
        return None
    saved = read_yaml_mapping(written, "finetune.base's config")
    given = base.cfg.finetune.base
    finetune, theirs = saved.get("finetune") or {}, saved.get("model") or {}
    lora = (finetune.get("lora") or {}) if isinstance(finetune, dict) else None
    if not all(isinstance(section, dict) for section in (finetune, lora, theirs)):  # (a hand-edited file)
        raise UsageError(
            f"finetune.base={given}: {written} does not read as a run's config (its finetune, finetune.lora and "
            "model sections are not mappings); give the workdir of `launch.py import-hf` or of a run"
        )
    assert isinstance(lora, dict) and isinstance(theirs, dict)  # (for mypy: checked above)
    if not lora.get("rank"):
        return None
    if not finetune.get("base"):
        raise UsageError(
            f"finetune.base={given} is a LoRA run whose base is its model's seeded initialisation (its own "
            f"finetune.base is empty); export it merged (launch.py export --format hf --merge), import that "
            f"(launch.py import-hf) and give the import's workdir"
        )
    model = dataclasses.asdict(base.cfg.model)
    differ = sorted(k for k in set(model) | set(theirs) if model.get(k) != theirs.get(k))
    if differ:
        raise UsageError(
            f"finetune.base={given} is a LoRA run of another model (model.{', model.'.join(differ[:5])} differ); "
            f"give this run the same model section"
        )
    inner = dataclasses.replace(
        base.cfg.finetune, base=str(finetune["base"]), base_dtype=finetune.get("base_dtype", "none")
    )
    inner = dataclasses.replace(
        inner, lora=dataclasses.replace(inner.lora, rank=lora["rank"], alpha=lora.get("alpha", 16.0))
    )
    return BaseWeights(dataclasses.replace(base.cfg, finetune=inner), base.projections)


def _first_sharding(leaf) -> Any:
    """The sharding of a stored kernel's values (PackedNF4's codes: the last axis may be whole)."""
    if isinstance(leaf, qwix.QArray):
        return leaf.qvalue.sharding
    return leaf.codes.sharding if isinstance(leaf, PackedNF4) else leaf.sharding


def _digest(step_dir: Path) -> str:
    sums = step_dir / SUMS
    digest = hashlib.sha256()
    if sums.is_file():
        digest.update(sums.read_bytes())
        return digest.hexdigest()
    for path in sorted(p for p in step_dir.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(step_dir)).encode())
        with path.open("rb") as f:
            while chunk := f.read(1 << 24):
                digest.update(chunk)
    return digest.hexdigest()


def base_weights(cfg) -> Optional[BaseWeights]:
    """The config's base checkpoint (None: no LoRA, or the base is the model's own seeded
    initialisation, which the run's checkpoints then hold)."""
    if not (lora_on(cfg) and cfg.finetune.base):
        return None
    from models import REGISTRY
    from models.family import projections

    return BaseWeights(cfg, projections(REGISTRY[cfg.model.name]))


def base_workdir(cfg) -> Optional[Path]:
    """The workdir whose weights a run starts from, and so whose model it is (its tokenizer, chat
    template, context and eos ids: vocab.MODEL_FILES): a LoRA run's finetune.base, or the workdir
    of checkpoint.restore_from (WORKDIR/checkpoints) while the run has no checkpoint of its own."""
    if lora_on(cfg) and cfg.finetune.base:
        return Path(cfg.finetune.base).expanduser()
    source = Path(cfg.checkpoint.restore_from).expanduser() if cfg.checkpoint.restore_from else None
    own = Path(cfg.workdir) / "checkpoints"
    if source is None or source.name != "checkpoints" or any(p.name.isdigit() for p in own.glob("[0-9]*")):
        return None
    return source.parent


def adapters_only(params, any_of: bool = False) -> bool:
    """Whether every (any_of: any) parameter of `params` is a LoRA adapter's (lora_a, lora_b)."""
    names = ["/".join(map(str, path)).endswith(("lora_a", "lora_b")) for path in flatten_dict(params)]
    return bool(names) and (any(names) if any_of else all(names))
