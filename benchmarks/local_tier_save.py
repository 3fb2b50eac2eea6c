"""Local-tier save time against the persistent tier's, per save, for configs/llama_tiny.yaml.

Starts --processes processes (--devices-per-process CPU devices each, one jax.distributed job on
this host, as `--local-processes` does); each builds the llama_tiny run, trains --train-steps
steps (so that Adam's moments are not zeros), opens the run's checkpoints the way the trainer
does (engine.checkpoint.store.open_checkpoints with checkpoint.local_dir set) and then, --reps
times, interleaved, saves the same state to each tier and waits for it:

  blocking    what the training loop waits for: `save()` (persistent: the pinned host copy
              dispatched, orbax's save left to a background thread) or `save_local()` (local:
              the state packed into one host buffer; with several processes the copy to the
              peer process, engine/checkpoint/transport.py, and the files follow on the
              tier's background thread). The engine's summary counts both tiers' blocking time together in
              checkpoint_blocking_seconds (badput_checkpoint_blocking).
  total       until `wait()` returns: everything written (persistent: orbax's files, commit and
              SHA256SUMS; local: the copies exchanged, this process's shards and the copies it
              holds written, with checksums).
  background  total - blocking: the time the save runs beside training.

Each kind has one untimed warm-up first (the local tier's first save also agrees on the peers
and the run id). The local tier goes to --local-dir (default /dev/shm, a RAM disk), the
persistent one to a fresh directory under --dir (default /tmp). Prints medians (ms) per process
and the ratio local/persistent; process 0's figures are the headline.

    python benchmarks/local_tier_save.py [--processes 2] [--devices-per-process 1] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
QUIET = ["log.progress=false", "log.tensorboard=false"]
ONE_STEP = ["train.steps_per_call=1", "data.steps_per_transfer=1"]  # one step per block (the warm-up steps)


def timed(save, wait) -> tuple[float, float]:
    """(seconds until `save()` returned, seconds until `wait()` returned)."""
    began = time.perf_counter()
    save()
    returned = time.perf_counter()
    wait()
    return returned - began, time.perf_counter() - began


def worker(args) -> None:
    """One process of the job: the timings, as JSON, to <out>/process_<i>.json."""
    sys.path.insert(0, str(ROOT))
    import jax

    from engine.checkpoint.store import open_checkpoints
    from engine.config import load_config, to_yaml
    from engine.run.setup import build_run
    from engine.runtime.distributed import initialize

    distributed = []
    if args.processes > 1:
        distributed = [
            f"distributed.coordinator_address=127.0.0.1:{args.port}",
            f"distributed.coordinator_bind_address=127.0.0.1:{args.port}",
            f"distributed.num_processes={args.processes}",
            f"distributed.process_id={args.process}",
        ]
    out = Path(args.out)
    overrides = [
        *QUIET,
        f"data.max_bytes={args.max_bytes}",
        f"checkpoint.local_dir={args.local}",
        "checkpoint.local_every_steps=10",
    ]
    overrides += distributed
    cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", [*overrides, *args.overrides], str(out / "run"))
    initialize(cfg.distributed)
    run = build_run(cfg)
    state = run.compiled.to_step_layout(run.init_state())
    train_step = run.compiled.train_step
    assert train_step is not None
    for step in range(args.train_steps):
        state, _ = train_step(state, run.train_block(step))
    state = run.compiled.from_step_layout(jax.block_until_ready(state))
    checkpoints = open_checkpoints(out / "run" / "checkpoints", cfg, write=True)

    def meta(step: int) -> dict:  # what the trainer saves beside the state
        return {"step": step, "data": {"next_step": step, "seed": cfg.seed}, "config": to_yaml(cfg)}

    def persistent(step: int) -> tuple[float, float]:
        return timed(lambda: checkpoints.save(step, state, meta(step)), checkpoints.wait)

    def local(step: int) -> tuple[float, float]:
        return timed(lambda: checkpoints.save_local(step, state, meta(step)), checkpoints.wait)

    persistent(1)
    local(2)
    times: dict[str, list] = {"persistent": [], "local": []}
    for rep in range(args.reps):
        step = 10 * (rep + 1)
        order = [("persistent", persistent), ("local", local)]
        for name, save in order if rep % 2 == 0 else order[::-1]:  # interleaved, alternating which goes first
            times[name].append(save(step + (name == "local")))
    checkpoints.close()
    leaves = jax.tree.leaves(state)
    local_bytes = sum(shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards)
    info = dict(
        process=jax.process_index(),
        processes=jax.process_count(),
        devices=jax.device_count(),
        state_bytes=sum(leaf.nbytes for leaf in leaves),
        local_bytes=local_bytes,
        params=sum(leaf.size for leaf in jax.tree.leaves(state.params)),
        times=times,
    )
    (out / f"process_{jax.process_index()}.json").write_text(json.dumps(info))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, out: Path, local: Path) -> None:
    """The job's processes, to their end (their output to out/process_<i>.log)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}")
    children = []
    for index in range(args.processes):
        command = [sys.executable, __file__, "--worker", "--process", str(index), "--port", str(port)]
        command += ["--out", str(out), "--local", str(local), *sys.argv[1:]]
        log = open(out / f"process_{index}.log", "w")
        children.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
    failed = []
    for index, (child, log) in enumerate(children):
        if child.wait(timeout=1800) != 0:
            failed.append(index)
        log.close()
    if failed:
        logs = {i: (out / f"process_{i}.log").read_text() for i in failed}
        index = next((i for i in failed if "Traceback" in logs[i]), failed[0])
        text = logs[index]
        shown = text[text.find("Traceback") :][:3000] if "Traceback" in text else text[-3000:]
        raise SystemExit(f"process(es) {failed} failed; process {index}'s output:\n{shown}")


def summarize(out: Path, args) -> None:
    median = statistics.median
    results = sorted((json.loads(p.read_text()) for p in out.glob("process_*.json")), key=lambda r: r["process"])
    first = results[0]
    print(
        f"configs/llama_tiny.yaml: {first['params'] / 1e6:.2f}M parameters, train state "
        f"{first['state_bytes'] / 1e6:.1f} MB ({first['local_bytes'] / 1e6:.1f} MB on process 0); "
        f"{first['processes']} process(es) x {args.devices_per_process} CPU device(s); local tier in "
        f"{args.local_dir}, persistent under {args.dir or '/tmp'}; "
        f"medians of {args.reps} interleaved saves per tier, ms"
    )
    print(f"{'process':>7}  {'tier':<10} {'blocking':>9} {'background':>10} {'total':>8}   blocking per save [runs]")
    for result in results:
        for tier in ("local", "persistent"):
            blocked = [b for b, _ in result["times"][tier]]
            total = [t for _, t in result["times"][tier]]
            background = [t - b for b, t in result["times"][tier]]
            runs = " ".join(f"{b * 1e3:.0f}" for b in blocked)
            print(
                f"{result['process']:>7}  {tier:<10} {median(blocked) * 1e3:>9.1f} {median(background) * 1e3:>10.1f} "
                f"{median(total) * 1e3:>8.1f}   [{runs}]"
            )
    times = first["times"]
    ratio = median(b for b, _ in times["local"]) / median(b for b, _ in times["persistent"])
    total = median(t for _, t in times["local"]) / median(t for _, t in times["persistent"])
    print(f"process 0: local / persistent = {ratio:.2f}x blocking, {total:.2f}x total")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=1)
    parser.add_argument("--reps", type=int, default=7, help="timed saves per tier")
    parser.add_argument("--train-steps", type=int, default=2, help="steps trained before saving")
    parser.add_argument("--max-bytes", type=int, default=200_000, help="data.max_bytes (only the data loads)")
    parser.add_argument("--local-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    parser.add_argument("--dir", default=None, help="where the persistent tier goes (a fresh subdirectory)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="extra engine config overrides")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--process", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    parser.add_argument("--local", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(tempfile.mkdtemp(prefix="local_tier_save_", dir=args.dir))
    local = Path(tempfile.mkdtemp(prefix="local_tier_save_", dir=args.local_dir))
    try:
        launch(args, out, local)
        summarize(out, args)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(local, ignore_errors=True)


if __name__ == "__main__":
    main()
