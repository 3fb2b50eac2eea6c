"""The Checkpointer, one run's checkpoints on orbax's CheckpointManager, and open_checkpoints, the engine's way to it.

A checkpoint holds two items: `state` (the whole TrainState: step, params, optimizer state,
model state, RNG) and `meta` (JSON: the data iterator's position and the resolved config).
Orbax writes each step into a temporary directory and renames it when complete, so a save
cut off by a crash is never listed. Saves are asynchronous (staging.py); restores read the
newest readable checkpoint straight into the target shardings, after its checksums
(integrity.py) and its fit to the train state (diagnosis.py) are checked. A finished checkpoint
that fails to read or to match its checksums is skipped with a warning and moved into
`damaged/`, and the previous one is used. A fine-tuning run's frozen base is stripped from its
saves and rejoined on restore (frozen_base.py). With checkpoint.local_dir, a run's checkpointer
also keeps the local tier (local_tier.py): frequent saves of each process's shards to node-local
storage and a peer's; a restore takes its newest complete step when it is as new as the
persistent tier's newest, and says which tier it used.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import zlib
from pathlib import Path
from typing import Any, NamedTuple, Optional

import jax
import orbax.checkpoint as ocp

from engine.checkpoint.among import among
from engine.checkpoint.choice import chosen_step, retention
from engine.checkpoint.diagnosis import (
    TREE_MISMATCH,
    check_compatible,
    check_shardings,
    other_structure,
    param_mismatches,
    with_zero_clip_norm,
    without_clip_norm,
)
from engine.checkpoint.frozen_base import FrozenBase
from engine.checkpoint.integrity import Checksums, Damaged, set_aside, verdict
from engine.checkpoint.local_tier import LocalTier
from engine.checkpoint.packing import refitted
from engine.checkpoint.staging import InBackground, effective_staging, staged_copy
from engine.errors import UsageError
from engine.lm.finetune import BaseWeights, base_weights
from engine.runtime.processes import current


class Restored(NamedTuple):
    """A restored checkpoint."""

    state: Any  # the TrainState, in the target shardings
    # {"step", "data": the iterator's position, "config": the resolved config as YAML; "tier": local or
    # persistent, "restored_from": for the console, "checkpoint DIR/STEP" or the local tier's copies}
    meta: dict
    step: int


# Orbax numbers a process's saves with one process-wide operation id, which its background
# commit reads back: two runs saving at once on threads of one process (a sub-mesh sweep's
# trials, engine/sweep/submesh.py) would take each other's. serial_saves() makes each save
# whole (written and committed) under one lock: such runs save one at a time.
_SERIAL: Optional[threading.Lock] = None


def serial_saves() -> None:
    """From now on this process's saves are made one at a time, each complete before the next."""
    global _SERIAL
    _SERIAL = _SERIAL or threading.Lock()


class Checkpointer:
    """One run's checkpoints directory: save (async), list, restore (into target shardings)."""

    def __init__(
        self,
        directory: str | Path,
        keep: int,
        *,
        read_only: bool = False,
        async_save: bool = True,
        timeout_seconds: int = 600,
        staging: str = "host",
        verify: bool = True,
        base: Optional[BaseWeights] = None,
        best: Optional[tuple[str, str]] = None,  # checkpoint.keep_best and best_mode: that step is kept too
        local: Optional[dict] = None,  # the local tier's settings (LocalTier's): checkpoint.local_dir and its keys
    ):
        self.directory = Path(directory).absolute()
        self.base = base  # a fine-tuning run's frozen base: not saved, read from its own checkpoint
        self._frozen_base = FrozenBase(base, read_only) if base is not None else None
        self.read_only, self.timeout_seconds, self.verify = read_only, timeout_seconds, verify
        # process 0 hashes each completed step's files (SHA256SUMS) while training goes on
        self._sums = Checksums(self.directory, timeout_seconds, enabled=verify and not read_only)
        self.staging = effective_staging(staging)
        self._saving = InBackground("checkpoint-save")  # staging host or device: the save in progress
        if read_only and not self.directory.is_dir():
            raise UsageError(f"no checkpoints at {self.directory}; train first or check the path")
        fresh = not self.directory.exists()  # (before orbax creates it) a new run: no earlier local steps count
        self.local = LocalTier(persistent=self.directory, fresh=fresh, **local) if local else None
        self.manager = self._open_manager(keep, async_save, best)

    def _open_manager(self, keep: int, async_save: bool, best: Optional[tuple[str, str]]) -> ocp.CheckpointManager:
        # a run on some of the job's processes (a sub-mesh sweep's trial): its chief is the primary
        # host, and its commits wait for its own processes alone (engine/runtime/processes.py)
        processes, handled, state = current(), {}, {}
        if not processes.whole_job:
            name = f"run_{zlib.crc32(str(self.directory).encode()):08x}"  # (its barriers' keys: unique in the job)
            handled["multiprocessing_options"], state = among(processes.ids, name)
            if not self.read_only:  # (orbax creates it only for a run on every process)
                self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            **retention(None if self.read_only else keep, best),
            **handled,
            create=not self.read_only and not handled,
            read_only=self.read_only,
            save_interval_steps=0 if self.read_only else 1,
            cleanup_tmp_directories=not self.read_only,  # a killed save's N.orbax-checkpoint-tmp-* (issue 57)
            enable_async_checkpointing=async_save,
            # how long processes wait for each other to commit a save
            async_options=ocp.AsyncOptions(timeout_secs=self.timeout_seconds),
        )
        return ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.PyTreeCheckpointHandler(**handled, **state),
                "meta": ocp.JsonCheckpointHandler(**handled),
            },
        )

    def steps(self) -> list[int]:
        """Complete checkpoints, oldest first (re-read from disk: another process may be writing)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def save(self, step: int, state, meta: dict, metrics: Optional[dict] = None) -> None:
        """Starts an asynchronous save; training may change (or donate) `state` once it returns.

        staging="host": this returns once a copy of the state into pinned host memory is
        dispatched; orbax saves that copy from a background thread, so its bookkeeping
        overlaps training. staging="device": the same with the copy on the devices (faster to
        make; one more state's worth of device memory until it is written).
        staging="host_sync": orbax copies the arrays off the devices before this returns."""
        self._saving.join()  # one save at a time, in step order; raises a background save's error
        if self._frozen_base is not None:  # the adapters and the base's identity, not the base
            state, meta = self._frozen_base.strip(state, meta)
        if self._sums.pending:  # the previous step's checksums are written before this save's clean-up may delete it
            self.manager.wait_until_finished()  # (orbax's save would wait here too); raises a failed save's error
            self._sums.join()
        if self.staging == "host_sync":
            self._save(step, state, meta, metrics)
            return
        self._saving.start(self._save, step, staged_copy(state, self.staging), meta, metrics)

    def save_local(self, step: int, state, meta: dict) -> None:
        """A save to the local tier (checkpoint.local_dir): every process's shards to its own
        storage and its peers'; returns once they are packed on the host (the exchange with the
        peers and the writes run in the background: `wait` waits for them)."""
        assert self.local is not None, "save_local needs checkpoint.local_dir"
        if self._frozen_base is not None:
            state, meta = self._frozen_base.strip(state, meta)
        self.local.save(step, state, meta)

    def _save(self, step: int, state, meta: dict, metrics: Optional[dict]) -> None:
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta))
        with _SERIAL or contextlib.nullcontext():
            self.manager.save(step, args=args, force=True, metrics=metrics)  # metrics: checkpoint.keep_best's
            if _SERIAL is not None:
                self.manager.wait_until_finished()
        self._sums.after_save(step)

    def wait(self) -> None:
        self._saving.join()
        if self.local is not None:
            self.local.wait()
        self.manager.wait_until_finished()
        self._sums.join()

    def close(self) -> None:
        self._saving.finish()  # a save cut short by an error elsewhere still finishes
        if self.local is not None:
            self.local.close()
        try:
            self.manager.close()  # waits for orbax's saves to end
        finally:
            self._sums.saves_ended()
        self._sums.close()  # a complete step gets its checksums before the process ends

    def _verify(self, step: int) -> Optional[str]:
        """Why the step's files fail their checksums (integrity.verdict); None when they match or
        checkpoint.verify is off."""
        return verdict(self.directory / str(step)) if self.verify else None

    def _saved_params(self, step: int):
        """The metadata (shapes, dtypes) of the parameters saved at `step`."""
        return self.saved_state(step)["params"]

    def saved_state(self, step: int):
        """The metadata (shapes, dtypes) of the train state saved at `step`, by field."""
        return self.manager.item_metadata(step)["state"]

    def restore(self, abstract_state, step: Optional[int] = None) -> Optional[Restored]:
        """The checkpoint at `step`, or the newest readable one; None if there is none.

        Arrays are read directly into the shardings that `abstract_state` carries; a refit (a
        function of a checkpoint's saved shapes by path, packing.refitted) gives the abstract state
        for each checkpoint it tries (DiLoCo onto another replica count: diloco_shrink.py).
        """
        steps = [step] if step is not None else list(reversed(self.steps()))
        target = abstract_state if self._frozen_base is None else FrozenBase.saved_part(abstract_state)
        restored = self._restore_local(target, steps[0] if steps else None) if step is None else None
        if restored is None and steps:
            restored = self._restore(target, steps, step)
            why = (self.local.declined if step is None else f"step {step} was named") if self.local else ""
            tier = f"; the persistent tier: {why}" if why else ""
            source = f"checkpoint {self.directory}/{restored.step}{tier}"
            restored = restored._replace(meta={**restored.meta, "tier": "persistent", "restored_from": source})
        if self.local is not None and step is None:  # the run goes on from here: later local steps are its past
            self.local.discard_after(restored.step if restored else 0)
        if restored is None or self._frozen_base is None:
            return restored
        local = restored.meta["tier"] == "local"
        where = restored.meta["restored_from"] if local else f"{self.directory}/{restored.step}"
        state = self._frozen_base.rejoin(restored.state, restored.meta, where, abstract_state, load_base)
        return restored._replace(state=state)

    def _restore_local(self, target, persistent_newest: Optional[int]) -> Optional[Restored]:
        """The local tier's newest complete step when it is as new as `persistent_newest` (None: none)."""
        if self.local is None or self.read_only:
            return None
        got = self.local.restore(target, persistent_newest)
        if got is None:
            return None
        if not callable(target):
            check_shardings(got.state, target)
        return Restored(got.state, {**got.meta, "tier": "local", "restored_from": got.source}, got.step)

    def _restore(self, target, steps: list[int], step: Optional[int]) -> Restored:
        failures, damaged = [], {}
        for candidate in steps:
            try:
                mismatch = self._verify(candidate)
                if mismatch:
                    raise Damaged(mismatch)
                abstract_state = self._refitted(target, candidate)
                check_compatible(self._saved_params(candidate), abstract_state.params, self.directory, candidate)
                restored = self._read(candidate, abstract_state)
            except UsageError:
                raise
            except Exception as e:  # any read failure makes this step unusable: try the one before
                if TREE_MISMATCH in str(e):  # a readable checkpoint of another train state
                    raise other_structure(self.directory, candidate) from None
                reason = (str(e).splitlines() or [type(e).__name__])[0][:300]
                failures.append(f"step {candidate}: {reason}")
                damaged[candidate] = reason
                if step is None:
                    print(
                        f"warning: checkpoint {self.directory}/{candidate} is unreadable ({reason}); "
                        f"trying an earlier one",
                        file=sys.stderr,
                    )
                continue
            check_shardings(restored["state"], abstract_state)
            if step is None and damaged and not self.read_only:
                set_aside(self.directory, damaged, self.timeout_seconds)  # else the run would meet them again
                self.manager.reload()
            return Restored(restored["state"], restored["meta"], candidate)
        if step is not None:
            raise UsageError(f"checkpoint {self.directory}/{step} is unreadable: {failures[0]}")
        raise UsageError(
            f"every checkpoint in {self.directory} is unreadable ({'; '.join(failures)}); nothing was "
            f"deleted. Move that directory aside to start afresh, or set checkpoint.restore_from to a "
            f"good checkpoint"
        )

    def _refitted(self, target, step: int):
        """`target`, or a refit's abstract state for the arrays saved at `step`."""
        if not callable(target):
            return target
        flat = jax.tree_util.tree_flatten_with_path(self.manager.item_metadata(step)["state"])[0]
        return refitted(target, [jax.tree_util.keystr(path) for path, _ in flat], [leaf.shape for _, leaf in flat])

    def discard_after(self, step: int) -> None:
        """The run goes on from `step`, before the step it restored (DiLoCo's round start): the
        checkpoints after it, of both tiers, belong to a past it trains again and are deleted."""
        for later in (s for s in self.steps() if s > step):
            self.manager.delete(later)
        if self.local is not None:
            self.local.discard_after(step)

    def _read(self, step: int, abstract_state) -> dict:
        """The step's state (into `abstract_state`) and meta; a checkpoint saved before the
        gradient-clipping norm became a state number is read without it, the norm put back as 0
        (diagnosis.without_clip_norm)."""
        try:
            return self.manager.restore(step, args=_read_args(abstract_state))
        except Exception as e:
            older = without_clip_norm(abstract_state) if TREE_MISMATCH in str(e) else None
            if older is None:
                raise
        restored = self.manager.restore(step, args=_read_args(older))
        return {**restored, "state": with_zero_clip_norm(restored["state"], abstract_state)}

    def restore_params(self, abstract_params):
        """Only the parameters of the newest checkpoint, into the shardings of `abstract_params`."""
        steps = self.steps()
        if not steps:
            raise UsageError(f"checkpoint.restore_from={self.directory} holds no complete checkpoint")
        step = steps[-1]
        mismatch = self._verify(step)  # a base or starting point is checked as a resume is
        if mismatch:
            raise UsageError(
                f"checkpoint {self.directory}/{step} is damaged: {mismatch}; restore it from a copy, "
                "or name another checkpoint"
            )
        problems = param_mismatches(self._saved_params(step), abstract_params)
        if problems:
            raise UsageError(
                f"checkpoint.restore_from={self.directory} (step {step}) does not fit this model: "
                + "; ".join(problems)
            )
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=_restore_args({"params": abstract_params}, partial=True))
            )
        except (OSError, ValueError, KeyError, TypeError) as e:  # orbax's and tensorstore's read failures
            reason = (str(e).splitlines() or [type(e).__name__])[0][:300]
            raise UsageError(f"checkpoint {self.directory}/{step} is unreadable ({reason}); name another") from None
        params = restored["state"]["params"]
        check_shardings(params, abstract_params)
        return params, step


def open_checkpoints(
    directory: str | Path, cfg, *, write: bool = False, staging: Optional[str] = None, frozen_base: bool = True
) -> Checkpointer:
    """The one way the engine opens a checkpoint directory. `cfg` is the config of the run that
    wrote (or writes) it: its keep, verification, barrier timeout, staging and keep_best; with
    `frozen_base`, its fine-tuning base is stripped from saves and rejoined on restore.
    Read-only unless `write`; written, with checkpoint.local_dir, with its local tier too."""
    section = cfg.checkpoint
    local = dict(
        local_dir=section.local_dir,
        keep=section.local_keep,
        replicas=section.local_replicas,
        verify=section.verify,
        timeout=cfg.distributed.barrier_timeout,
    )
    return Checkpointer(
        directory,
        cfg.checkpoint.keep,
        read_only=not write,
        timeout_seconds=cfg.distributed.barrier_timeout,
        staging=staging or cfg.checkpoint.staging,
        verify=cfg.checkpoint.verify,
        base=base_weights(cfg) if frozen_base else None,
        best=(cfg.checkpoint.keep_best, cfg.checkpoint.best_mode) if write and cfg.checkpoint.keep_best else None,
        local=local if write and section.local_dir else None,
    )


def restore_newest(workdir: str | Path, abstract_state, cfg, purpose: str, step: Optional[str] = None) -> Restored:
    """The newest readable checkpoint of the run in `workdir` (its config `cfg`), or the one `step`
    names (--step best or N), opened read-only (export, sample, evaluator); UsageError if none."""
    checkpointer = open_checkpoints(Path(workdir) / "checkpoints", cfg)
    try:
        restored = checkpointer.restore(abstract_state, chosen_step(checkpointer, cfg, step))
    finally:
        checkpointer.close()
    if restored is None:
        raise UsageError(f"{workdir}/checkpoints holds no complete checkpoint to {purpose}")
    return restored


def load_base(base: BaseWeights, abstract_frozen):
    """A fine-tuning run's frozen base: the parameters of finetune.base's newest checkpoint (of a
    LoRA run: its own base with its adapters merged), quantised as finetune.base_dtype says, in the
    shardings of `abstract_frozen`."""
    assert base.identity["sha256"]  # (a base without checkpoints: this raises the error naming finetune.base)
    source = open_checkpoints(base.checkpoints, base.cfg, frozen_base=False)
    plain = base.plain(abstract_frozen)
    try:
        if base.chain is None:
            params, _ = source.restore_params(plain)
        else:  # a LoRA run: its own base, checked as its checkpoint records it, with its adapters merged in
            step = base.identity["step"]
            meta = source.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
            base.chain.check(meta.get("base"), f"{base.checkpoints}/{step}")
            adapters, _ = source.restore_params(base.adapter_shapes(source.saved_state(step)["params"], plain))
            params = base.merge(load_base(base.chain, base.chain.frozen_like(plain)), adapters, plain)
    except UsageError as e:
        raise UsageError(f"finetune.base={base.cfg.finetune.base}: {e}") from None
    finally:
        source.close()
    return base.quantised(params, abstract_frozen)


def _restore_args(target, partial: bool = False) -> ocp.args.PyTreeRestore:
    """Restore into the shapes, dtypes and shardings of `target` (ShapeDtypeStructs)."""
    return ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=partial
    )


def _read_args(target) -> ocp.args.Composite:
    """A whole checkpoint: its state into `target`'s shapes, dtypes and shardings, and its meta."""
    return ocp.args.Composite(state=_restore_args(target), meta=ocp.args.JsonRestore())
