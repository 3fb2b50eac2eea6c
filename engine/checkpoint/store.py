"""Checkpoints on orbax's CheckpointManager: asynchronous saves, restore of the latest
complete checkpoint straight into the target shardings, and clear errors.

A checkpoint holds two items: `state` (the whole TrainState: step, params, optimizer state,
model state, RNG) and `meta` (JSON: the data iterator's position and the resolved config).
Orbax writes each step into a temporary directory and renames it when complete, so a save
cut off by a crash is never listed. Once a step is complete, process 0 hashes its files into
`<step>/SHA256SUMS` (`sha256sum` format) on a background thread; before a restore process 0
checks them and every process gets its verdict.
A finished checkpoint that fails to read or to match its checksums (a truncated file, a
flipped bit) is skipped with a warning and moved into `damaged/`, and the previous one is used.
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from engine.errors import UsageError
from engine.lm.finetune import BaseWeights, adapters_only, base_weights, with_frozen, without_frozen
from engine.parallel.sharding import path_name
from engine.run.best import chosen_step, retention
from engine.run.step import FROZEN
from engine.runtime.distributed import barrier
from engine.runtime.rundir import SUMS, check_sums, write_sums
from engine.runtime.settings import distributed_client_barriers_on

# A copy of every array, made on the devices where it lives (the jit keeps each sharding).
_device_copy = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


def _pinned_host_copy(state):
    """A copy of every array in its devices' pinned host memory, each sharded as before: the
    transfers are dispatched and this returns at once (a later use of the arrays, such as
    the next step donating them, runs after the copies have read them)."""
    return jax.device_put(state, jax.tree.map(lambda array: array.sharding.with_memory_kind("pinned_host"), state))


def _has_pinned_host() -> bool:
    return any(memory.kind == "pinned_host" for memory in jax.local_devices()[0].addressable_memories())


class InBackground:
    """Work on one background thread, one piece at a time and in order: `start` first waits
    for the previous piece; what a piece raised is raised again by `join`, on the caller's
    thread."""

    def __init__(self, name: str):
        self.name = name
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def start(self, work, *args) -> None:
        self.join()
        self._thread = threading.Thread(target=self._run, args=(work, *args), name=self.name, daemon=True)
        self._thread.start()

    def _run(self, work, *args) -> None:
        try:
            work(*args)
        except BaseException as error:  # noqa: BLE001 -- raised again on the caller's thread (join)
            self._error = error

    def join(self) -> None:
        """Waits for the piece in progress; raises what it raised."""
        self.finish()
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def finish(self) -> None:
        """Waits for the piece in progress, raising nothing: for clean-up while another error
        is on its way (a piece cut short by that error still ends)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class Restored(NamedTuple):
    """A restored checkpoint."""

    state: Any  # the TrainState, in the target shardings
    meta: dict  # {"step", "data": the iterator's position, "config": the resolved config as YAML}
    step: int


class _Damaged(Exception):
    """A checkpoint step's files do not match their SHA256SUMS."""


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
    ):
        self.directory = Path(directory).absolute()
        self.base = base  # a fine-tuning run's frozen base: not saved, read from its own checkpoint
        self._frozen = None  # read-only (eval, export, sample): the base read once, for every restore
        self.read_only, self.timeout_seconds, self.verify = read_only, timeout_seconds, verify
        # process 0 hashes each completed step's files (SHA256SUMS) while training goes on
        self._hashing = ThreadPoolExecutor(1, "checkpoint-sums") if verify and not read_only else None
        self._sums: list[Future] = []
        self._closed = threading.Event()
        # staging="host" saves from the background thread too where the devices have pinned host
        # memory and (several processes) orbax's barriers cannot interleave with the step's
        # collectives; else ("host_sync" always) orbax copies to the host before save() returns
        background_ok = jax.process_count() == 1 or distributed_client_barriers_on()
        self.staging = (
            "host"
            if staging == "host" and background_ok and _has_pinned_host()
            else ("host_sync" if staging in ("host", "host_sync") else staging)
        )
        if staging == "device" and not background_ok:
            raise RuntimeError(
                "checkpoint.staging=device with several processes needs orbax's distributed-client "
                "barriers: call engine.runtime.settings.use_distributed_client_barriers() at start-up "
                "(launch.py does)"
            )
        self._saving = InBackground("checkpoint-save")  # staging host or device: the save in progress
        if read_only and not self.directory.is_dir():
            raise UsageError(f"no checkpoints at {self.directory}; train first or check the path")
        options = ocp.CheckpointManagerOptions(
            **retention(None if read_only else keep, best),
            create=not read_only,
            read_only=read_only,
            save_interval_steps=0 if read_only else 1,
            enable_async_checkpointing=async_save,
            # how long processes wait for each other to commit a save
            async_options=ocp.AsyncOptions(timeout_secs=timeout_seconds),
        )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
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
        if self.base is not None:  # the adapters and the base's identity, not the base
            state, meta = without_frozen(state), {**meta, "base": self.base.identity}
        if self._sums:  # the previous step's checksums are written before this save's clean-up may delete it
            self.manager.wait_until_finished()  # (orbax's save would wait here too); raises a failed save's error
            self._join_sums()
        if self.staging == "host_sync":
            self._save(step, state, meta, metrics)
            return
        copy = _pinned_host_copy(state) if self.staging == "host" else _device_copy(state)
        self._saving.start(self._save, step, copy, meta, metrics)

    def _save(self, step: int, state, meta: dict, metrics: Optional[dict]) -> None:
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta))
        self.manager.save(step, args=args, force=True, metrics=metrics)  # metrics: checkpoint.keep_best's
        if self._hashing is not None and jax.process_index() == 0:
            self._sums.append(self._hashing.submit(self._write_sums, step))

    def _write_sums(self, step: int) -> None:
        """On the hashing thread: waits for orbax to finish `step` (its temporary directory is
        renamed to the step's name when complete), then writes its SHA256SUMS."""
        final, deadline = self.directory / str(step), time.monotonic() + self.timeout_seconds
        while not final.is_dir():
            # closed (orbax's saves all ended) or past the commit timeout: this save failed, and says so
            if self._closed.wait(0.05) or time.monotonic() > deadline:
                if not final.is_dir():
                    return
        try:
            write_sums(final)
        except FileNotFoundError:
            if final.is_dir():
                raise
            # else the step was deleted meanwhile (checkpoint.keep): there is nothing to vouch for

    def _join_sums(self) -> None:
        """Waits for the checksums of every save so far; raises what hashing raised."""
        while self._sums:
            self._sums.pop(0).result()

    def wait(self) -> None:
        self._saving.join()
        self.manager.wait_until_finished()
        self._join_sums()

    def close(self) -> None:
        self._saving.finish()  # a save cut short by an error elsewhere still finishes
        try:
            self.manager.close()  # waits for orbax's saves to end
        finally:
            self._closed.set()
        if self._hashing is not None:
            self._hashing.shutdown(wait=True)  # a complete step gets its checksums before the process ends

    def _verify(self, step: int) -> Optional[str]:
        """Process 0 checks the step's SHA256SUMS (one read of the checkpoint, not one per
        process) and every process gets its verdict: all must restore the same step."""
        if not self.verify:
            return None
        mismatch = check_sums(self.directory / str(step)) if jax.process_index() == 0 else None
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            if int(multihost_utils.broadcast_one_to_all(np.int32(mismatch is not None))) and mismatch is None:
                mismatch = f"its files do not match {SUMS} (checked by process 0)"
        return mismatch

    def _param_mismatches(self, step: int, abstract_params) -> list[str]:
        """'path: saved (shape), expected (shape)' for each parameter the model and checkpoint disagree on."""
        saved = self.manager.item_metadata(step)["state"]["params"]
        saved_shapes = {path_name(p): tuple(m.shape) for p, m in jax.tree_util.tree_leaves_with_path(saved)}
        want = {path_name(p): tuple(a.shape) for p, a in jax.tree_util.tree_leaves_with_path(abstract_params)}
        return [
            f"{name}: saved {saved_shapes.get(name, 'absent')}, expected {want.get(name, 'absent')}"
            for name in sorted(saved_shapes.keys() | want.keys())
            if saved_shapes.get(name) != want.get(name)
        ]

    def _check_compatible(self, step: int, abstract_state) -> None:
        problems = self._param_mismatches(step, abstract_state.params)
        if problems and adapters_only(abstract_state.params):
            saved = self.manager.item_metadata(step)["state"]["params"]
            if not adapters_only(saved, any_of=True):
                workdir = self.directory.parent
                raise UsageError(
                    f"{workdir} holds a model's full weights (checkpoint {step}), and finetune.lora trains "
                    f"adapters on a frozen base: fine-tune in a new workdir with finetune.base={workdir}"
                )
        if problems:
            raise UsageError(
                f"checkpoint {self.directory}/{step} does not fit this model's config: "
                + "; ".join(problems)
                + ". Use the model settings it was saved with, or a new workdir"
            )

    def restore(self, abstract_state, step: Optional[int] = None) -> Optional[Restored]:
        """The checkpoint at `step`, or the newest readable one; None if there is none.

        Arrays are read directly into the shardings that `abstract_state` carries.
        """
        steps = [step] if step is not None else list(reversed(self.steps()))
        if not steps:
            return None
        if self.base is not None:
            restored = self._restore(without_frozen(abstract_state), steps, step)
            self.base.check(restored.meta.get("base"), f"{self.directory}/{restored.step}")
            frozen = (
                self._frozen if self._frozen is not None else load_base(self.base, abstract_state.model_state[FROZEN])
            )
            if self.read_only:  # (a training state is donated to its step: nothing may keep its arrays)
                self._frozen = frozen
            return restored._replace(state=with_frozen(restored.state, frozen))
        return self._restore(abstract_state, steps, step)

    def _restore(self, abstract_state, steps: list[int], step: Optional[int]) -> Restored:
        failures, damaged = [], {}
        for candidate in steps:
            try:
                mismatch = self._verify(candidate)
                if mismatch:
                    raise _Damaged(mismatch)
                self._check_compatible(candidate, abstract_state)
                restored = self._read(candidate, abstract_state)
            except UsageError:
                raise
            except Exception as e:  # any read failure makes this step unusable: try the one before
                if "tree structures do not match" in str(e):  # a readable checkpoint of another train state
                    raise UsageError(
                        f"checkpoint {self.directory}/{candidate} holds a train state of another structure than this "
                        f"config makes: the optimizer (or a setting that changes its state) differs from the one it "
                        f"was saved with. Resume with the settings it was saved with ({self.directory.parent}/"
                        f"config.yaml), or start a new workdir from its parameters with checkpoint.restore_from="
                        f"{self.directory} checkpoint.restore_mode=params"
                    ) from None
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
                self._set_aside(damaged)  # else the run would meet them again when it saves those steps
            return Restored(restored["state"], restored["meta"], candidate)
        if step is not None:
            raise UsageError(f"checkpoint {self.directory}/{step} is unreadable: {failures[0]}")
        raise UsageError(
            f"every checkpoint in {self.directory} is unreadable ({'; '.join(failures)}); nothing was "
            f"deleted. Move that directory aside to start afresh, or set checkpoint.restore_from to a "
            f"good checkpoint"
        )

    def _read(self, step: int, abstract_state) -> dict:
        """The step's state (into `abstract_state`) and meta. A checkpoint saved before the
        gradient-clipping norm became a state number (engine/run/optimizer.py) lacks it: it is read
        without it, and the norm is put back as 0 for the caller to set from its config (the
        trainer does: setup.with_config_hparams)."""

        def args(target):
            return ocp.args.Composite(state=_restore_args(target), meta=ocp.args.JsonRestore())

        hyperparams = getattr(getattr(abstract_state, "opt_state", None), "hyperparams", None)
        try:
            return self.manager.restore(step, args=args(abstract_state))
        except Exception as e:
            if "tree structures do not match" not in str(e) or "grad_clip_norm" not in (hyperparams or {}):
                raise
        assert hyperparams is not None  # (the error above is re-raised otherwise)
        older = {k: v for k, v in hyperparams.items() if k != "grad_clip_norm"}
        restored = self.manager.restore(
            step, args=args(abstract_state.replace(opt_state=abstract_state.opt_state._replace(hyperparams=older)))
        )
        norm = hyperparams["grad_clip_norm"]
        state = restored["state"]
        filled = {
            **state.opt_state.hyperparams,
            "grad_clip_norm": jax.device_put(np.zeros(norm.shape, norm.dtype), norm.sharding),
        }
        return {**restored, "state": state.replace(opt_state=state.opt_state._replace(hyperparams=filled))}

    def _set_aside(self, damaged: dict[int, str]) -> None:
        """Moves unreadable steps into checkpoints/damaged/ with the reason beside them (nothing
        is deleted), so that training saves those steps again normally."""
        if jax.process_index() == 0:
            aside = self.directory / "damaged"
            aside.mkdir(exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for step, reason in damaged.items():
                target = aside / f"{step}-{stamp}"
                (self.directory / str(step)).rename(target)
                (aside / f"{step}-{stamp}.reason.txt").write_text(reason + "\n")
                print(
                    f"warning: moved the unreadable checkpoint {self.directory}/{step} to {target}; "
                    f"training will save step {step} again",
                    file=sys.stderr,
                )
        barrier(f"set_aside_{'_'.join(map(str, damaged))}", self.timeout_seconds)  # moved before anyone reloads
        self.manager.reload()

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
        problems = self._param_mismatches(step, abstract_params)
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
    Read-only unless `write`."""
    return Checkpointer(
        directory,
        cfg.checkpoint.keep,
        read_only=not write,
        timeout_seconds=cfg.distributed.barrier_timeout,
        staging=staging or cfg.checkpoint.staging,
        verify=cfg.checkpoint.verify,
        base=base_weights(cfg) if frozen_base else None,
        best=(cfg.checkpoint.keep_best, cfg.checkpoint.best_mode) if write and cfg.checkpoint.keep_best else None,
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
    """A fine-tuning run's frozen base: the parameters of finetune.base's newest checkpoint,
    quantised as finetune.base_dtype says, in the shardings of `abstract_frozen`."""
    assert base.identity["sha256"]  # (a base without checkpoints: this raises the error naming finetune.base)
    source = open_checkpoints(base.checkpoints, base.cfg, frozen_base=False)
    try:
        params, _ = source.restore_params(base.plain(abstract_frozen))
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


def check_shardings(state, abstract_state) -> None:
    """RuntimeError unless every restored array carries its target sharding (a restore that
    kept the saved layout would silently change the memory plan)."""
    for (path, array), target in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(abstract_state)):
        if not array.sharding.is_equivalent_to(target.sharding, array.ndim):
            raise RuntimeError(
                f"restored {path_name(path)} has sharding {array.sharding}, not the target {target.sharding}"
            )
