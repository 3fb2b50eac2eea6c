"""Checkpoint cost: how long an asynchronous save blocks training, against a synchronous save
and a plain numpy.save of the same bytes.

Builds the transformer of configs/gpt_small.yaml (or --config's model), made moderately
large (by default d_model=256, 6 layers, mlp_dim=1024: about 5M parameters, ~60 MB of train
state with Adam's two moments), initialises its state (`run.init_state()`), trains --train-steps steps so
that Adam's moments are no longer all zeros, and saves it with
engine.checkpoint.store.Checkpointer, the class the trainer uses, with the trainer's metadata
(config and data position):

  (a) blocked      async save (the default, `checkpoint.staging=host`): time until `save()`
                   returns, i.e. what the training loop waits for. The state's copy into
                   pinned host memory is dispatched and orbax saves it from a background
                   thread.
  (a') blocked     async save with `checkpoint.staging=device`: the state is copied on the
                   devices and orbax saves the copy from a background thread.
  (a'') blocked    the Checkpointer's `host_sync` staging (host staging before pinned copies:
                   still used without pinned host memory, for several processes on an orbax
                   without distributed-client barriers, and by a vectorised group): orbax
                   copies the arrays off the devices before save() returns.
  (g) host copy    the pinned host copy of (a) itself, dispatched and waited for: the
                   devices' time before the next step may donate the state.
  (c) async total  the staging=host save, until `wait()` returns: everything on disk.
  (b) synchronous  `Checkpointer(..., async_save=False)`: save + wait.
  (d) bytes on disk of that synchronous checkpoint (all files under its step directory)
                   and its write throughput: bytes on disk / (b), and state bytes / (b).
                   Orbax compresses arrays (zstd), so the disk holds fewer bytes than the
                   state; a freshly initialised state's zero Adam moments compress to almost
                   nothing (--train-steps 0 shows it), hence the training steps first.
  (e) numpy.save   `jax.device_get` of every state leaf, `np.save` of each into one file,
                   then fsync (orbax's tensorstore writes also sync to disk by default):
                   the throughput of a plain write of the same bytes to the same disk.

Each measurement is repeated --reps times (after one untimed warm-up of each kind), every
save with its own step number; async saves go through one Checkpointer per staging mode,
as in a training run (the warm-up is the run's first save), the others each into a fresh
directory; the table gives medians.
`blocked / synchronous` is the share of a synchronous save's time that training still
loses with async saving; the target is at most 10%. `(b) / (e)` compares orbax with the
plain write. MB = 10^6 bytes. Directories go under /tmp (or --dir) and are removed at the
end unless --keep; note that /tmp may be a RAM-backed tmpfs on some systems, which makes
every write look fast.

    python benchmarks/checkpoint_io.py
    python benchmarks/checkpoint_io.py --d-model 512 --num-layers 8 --mlp-dim 2048 --dir /data/scratch
    python benchmarks/checkpoint_io.py --config llama_tiny.yaml model.num_heads=8 model.num_kv_heads=4
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.checkpoint.staging import pinned_host_copy  # noqa: E402
from engine.checkpoint.store import Checkpointer  # noqa: E402
from engine.config import load_config, to_yaml  # noqa: E402
from engine.run.setup import build_run  # noqa: E402
from engine.runtime.rundir import write_sums  # noqa: E402

QUIET = ["log.progress=false", "log.tensorboard=false"]


def disk_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def async_save(checkpointer: Checkpointer, step: int, state, meta: dict) -> tuple[float, float]:
    """(seconds until save() returned, seconds until wait() returned)."""
    start = time.perf_counter()
    checkpointer.save(step, state, meta)
    returned = time.perf_counter()
    checkpointer.wait()
    finished = time.perf_counter()
    return returned - start, finished - start


def sync_save(directory: Path, step: int, state, meta: dict) -> tuple[float, int]:
    """(seconds for save + wait, bytes on disk of the step's checkpoint)."""
    checkpointer = Checkpointer(directory, keep=3, async_save=False, verify=False)
    start = time.perf_counter()
    checkpointer.save(step, state, meta)
    checkpointer.wait()
    seconds = time.perf_counter() - start
    checkpointer.close()
    return seconds, disk_bytes(directory / str(step))


def numpy_save(path: Path, state, fsync: bool) -> tuple[float, int]:
    """(seconds to fetch the leaves and write them into one .npy stream, bytes written)."""
    start = time.perf_counter()
    leaves = jax.device_get(jax.tree.leaves(state))
    with open(path, "wb") as f:
        for leaf in leaves:
            np.save(f, np.asarray(leaf))
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    return time.perf_counter() - start, path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config",
        default="gpt_small.yaml",
        help="a config under configs/ (llama_tiny.yaml: scanned layers, a few arrays per weight kind)",
    )
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--mlp-dim", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=200_000, help="data.max_bytes (only the data loads)")
    parser.add_argument("--train-steps", type=int, default=2, help="steps trained before saving (0 = fresh state)")
    parser.add_argument("--reps", type=int, default=3, help="timed repetitions of each measurement")
    parser.add_argument("--dir", default=None, help="where to write (a fresh subdirectory; default under /tmp)")
    parser.add_argument("--no-fsync", dest="fsync", action="store_false", help="numpy.save without fsync")
    parser.add_argument("--keep", action="store_true", help="keep the written checkpoints")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="extra engine config overrides")
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="checkpoint_io_", dir=args.dir))
    overrides = QUIET + [
        f"model.d_model={args.d_model}",
        f"model.num_layers={args.num_layers}",
        f"model.mlp_dim={args.mlp_dim}",
        f"data.max_bytes={args.max_bytes}",
        *args.overrides,
    ]
    cfg = load_config(ROOT / "configs" / args.config, overrides, str(base / "run"))
    run = build_run(cfg)
    state = run.compiled.to_step_layout(run.init_state())
    for step in range(args.train_steps):
        state, _ = run.compiled.train_step(state, run.train_block(step))
    state = run.compiled.from_step_layout(jax.block_until_ready(state))
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
    params = sum(leaf.size for leaf in jax.tree.leaves(state.params))

    def meta(step):  # what the trainer saves alongside the state
        return {"step": step, "data": {"next_step": step, "seed": cfg.seed}, "config": to_yaml(cfg)}

    host = Checkpointer(base / "async_host", keep=args.reps + 1, staging="host")
    device = Checkpointer(base / "async_device", keep=args.reps + 1, staging="device")
    host_sync = Checkpointer(base / "async_host_sync", keep=args.reps + 1, staging="host_sync")
    async_save(host, 1, state, meta(1))
    async_save(device, 1, state, meta(1))
    async_save(host_sync, 1, state, meta(1))
    sync_save(base / "warmup_sync", 2, state, meta(2))
    numpy_save(base / "warmup.npy", state, args.fsync)

    blocked, blocked_device, blocked_sync, host_copy, async_total, synchronous, on_disk, plain = ([] for _ in range(8))
    for rep in range(args.reps):
        step = 100 * (rep + 1)
        returned, finished = async_save(host, step, state, meta(step))
        blocked.append(returned)
        async_total.append(finished)
        blocked_device.append(async_save(device, step, state, meta(step))[0])
        blocked_sync.append(async_save(host_sync, step, state, meta(step))[0])
        began = time.perf_counter()
        jax.block_until_ready(pinned_host_copy(state))
        host_copy.append(time.perf_counter() - began)
        seconds, size = sync_save(base / f"sync_{rep}", step + 1, state, meta(step + 1))
        synchronous.append(seconds)
        on_disk.append(size)
        plain.append(numpy_save(base / f"numpy_{rep}.npy", state, args.fsync))

    median = statistics.median
    sync_seconds, disk = median(synchronous), median(on_disk)
    numpy_seconds = median([seconds for seconds, _ in plain])
    numpy_bytes = plain[0][1]

    def row(label: str, values: list[float], extra: str = "") -> None:
        runs = " ".join(f"{v * 1e3:.1f}" for v in values)
        print(f"{label:<50}{median(values) * 1e3:>10.1f} ms   [{runs}]{extra}")

    print(
        f"{cfg.model.name} d_model={args.d_model} num_layers={args.num_layers} mlp_dim={args.mlp_dim}: "
        f"{params / 1e6:.2f}M parameters; train state {state_bytes / 1e6:.1f} MB in "
        f"{len(jax.tree.leaves(state))} arrays after {args.train_steps} training steps; "
        f"{jax.device_count()} {jax.devices()[0].platform} device(s)"
    )
    print(f"writing under {base}; medians of {args.reps} (runs in brackets)")
    row("(a) async save, loop blocked (save returns)", blocked)
    row("(a') the same, checkpoint.staging=device", blocked_device)
    row("(a'') the same, orbax copying first (host_sync)", blocked_sync)
    row("(g) the pinned host copy of (a), to completion", host_copy)
    row("(c) async save, total (until wait returns)", async_total)
    row("(b) synchronous save (save + wait)", synchronous)
    print(
        f"{'(d) synchronous: bytes on disk, throughput':<50}{disk / 1e6:>10.1f} MB   "
        f"{disk / 1e6 / sync_seconds:.0f} MB/s on disk, {state_bytes / 1e6 / sync_seconds:.0f} MB/s of state"
    )
    fsync = "+ fsync" if args.fsync else "no fsync"
    row(
        f"(e) numpy.save of the same bytes ({fsync})",
        [s for s, _ in plain],
        f"   {numpy_bytes / 1e6:.1f} MB, {numpy_bytes / 1e6 / numpy_seconds:.0f} MB/s",
    )
    began = time.perf_counter()
    write_sums(base / "sync_0" / str(101))
    print(
        f"{'(f) SHA256SUMS of one step (a background thread)':<50}{(time.perf_counter() - began) * 1e3:>10.1f} ms"
        "   (checkpoint.verify: in (a) only when a save comes before the last one is hashed, and in (c))"
    )
    host.close()
    device.close()
    host_sync.close()
    print(
        f"blocked / synchronous = {median(blocked) / sync_seconds:.1%} with staging=host, "
        f"{median(blocked_device) / sync_seconds:.1%} with staging=device, "
        f"{median(blocked_sync) / sync_seconds:.1%} with orbax copying first (target <= 10%); "
        f"synchronous / numpy.save = {sync_seconds / numpy_seconds:.2f}x"
    )
    if not args.keep:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
