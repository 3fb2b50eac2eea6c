"""Elastic soak: seeded random SIGKILLs of the default job's workers on 4 local processes, and
what each cost (seconds from the kill to the next step, steps lost, checkpoint tier used), the
final eval accuracy against an unbroken run of the same job, and goodput.

Design. One `--local-processes 4` job with fault.elastic=true, fault.min_processes=1,
fault.max_restarts=3 and fault.grow_back (the default): a kill shrinks the job by one process
(fault.elastic restarts it on the survivors from the newest checkpoint of either tier), and the
job of 3 grows back to 4 at its next persistent checkpoint (checkpoint.every_steps), as the lost
process's place is free again on this machine. The kills are seeded steps, one in each of
`--kills` seeded persistent intervals (never the last, so every kill is followed by its growth
before the next), at least --gap steps into their interval; the victim of each is a seeded random
process of the 4 (process 0 included). So the k-th kill (from 0) hits the job's start 2k. A kill
comes from outside the trainer (tests/support/faults.py FaultAt: a SIGKILL to that process of
that start once metrics.jsonl logged the step: no clean-up, as a lost host). The figures per failure come from the
`split: "recovery"` records of metrics.jsonl, each growth's from the `split: "grow"` records; the
whole soak's wall time is set against the unbroken run's (one 4-process job, no kills, the same
checkpoint settings). The global batch is 48 (the default job's 64 has no split over 6 devices).

    python benchmarks/soak.py [--steps 2000] [--kills 10] [--seed 0] [--precompile] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from support.faults import FaultAt  # noqa: E402 (the kills come from outside the trainer)

PROCESSES, DEVICES = 4, 2
JOB = [
    "--config",
    "configs/mnist_mlp.yaml",
    "train.global_batch_size=48",  # 8 batch shards on 4 processes x 2 devices, 6 on 3, 4 on 2, 2 on 1
    "log.every_steps=10",
    "log.progress=false",
    "log.tensorboard=false",
    "fault.elastic=true",
    "fault.min_processes=1",
    "fault.max_restarts=3",
]


def plan_kills(rng: random.Random, steps: int, kills: int, every: int, gap: int) -> list[int]:
    """`kills` seeded steps, one in each of `kills` distinct seeded persistent intervals of `every`
    steps (not the last: the growth at its end comes before the next kill), `gap` steps or more into
    its interval and not on a persistent step."""
    intervals = steps // every - 1
    if kills > intervals or gap >= every:
        raise SystemExit(f"cannot place {kills} kills in {intervals} persistent intervals; lower --kills or --gap")
    return sorted(i * every + rng.randrange(gap, every) for i in rng.sample(range(intervals), kills))


def run(workdir: Path, overrides: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """One launcher job to its end: (its result, its wall seconds)."""
    full = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full.update(env, JAX_PLATFORMS="cpu")
    flags = ["--local-processes", str(PROCESSES), "--devices-per-process", str(DEVICES)]
    argv = [sys.executable, str(ROOT / "launch.py"), *JOB[:2], "--workdir", str(workdir), *flags, *JOB[2:]]
    began = time.perf_counter()
    done = subprocess.run([*argv, *overrides], capture_output=True, text=True, cwd=ROOT, env=full, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"the job in {workdir} ended with exit {done.returncode}:\n{done.stderr[-3000:]}")
    return done, time.perf_counter() - began


def records(workdir: Path, split: str) -> list[dict]:
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line.strip()) if r.get("split") == split]


def soak(args, base: Path, common: list[str], kill_steps: list[int]) -> tuple[list[dict], list[dict], dict, float]:
    """The broken run, one job: (its recovery records, its growth records, its summary, wall seconds)."""
    rng = random.Random(args.seed + 1)
    workdir = base / "soak"
    victims = [rng.randrange(PROCESSES) for _ in kill_steps]
    hooks = [f"{victim}:{step}:{2 * k}" for k, (victim, step) in enumerate(zip(victims, kill_steps))]
    kills = [
        FaultAt(workdir, victim, step, attempt=2 * k, timeout=7200)
        for k, (victim, step) in enumerate(zip(victims, kill_steps))
    ]
    done, seconds = run(workdir, [*common, f"train.steps={args.steps}"], {})
    for kill in kills:
        kill.stop()
    (base / "soak.log").write_text(done.stdout + done.stderr)
    recoveries = records(workdir, "recovery")
    for record in recoveries:  # (a failure of a start that no planned kill names was not planned)
        planned = record["attempt"] % 2 == 0 and record["attempt"] // 2 < len(kill_steps)
        record["planned"] = kill_steps[record["attempt"] // 2] if planned else None
    print(f"  kills (process:step:start) {','.join(hooks)}; {seconds:.1f}s", flush=True)
    return recoveries, records(workdir, "grow"), records(workdir, "summary")[-1], seconds


def report(recoveries: list[dict], grown: list[dict], summary: dict) -> None:
    """One line per failure (a kill of the soak's, or one it did not plan: `-` in kill@step)."""
    print("\nfailure  kill@step   logged  restored  lost steps  tier        s kill->next step  processes")
    for i, r in enumerate(recoveries, 1):
        planned = r["planned"] if r["planned"] is not None else "-"
        stop = f" (survivors stopped in {r['seconds_to_stop']:.1f}s)" if r.get("seconds_to_stop") is not None else ""
        reached = r["planned"] if r["planned"] is not None else r["step_reached"]  # (the kill's step, not the log's)
        lost = reached - r["step_restored"] if r.get("step_restored") is not None else None
        seconds = f"{r['seconds_lost']:.1f}" if r.get("seconds_lost") is not None else "-"
        print(
            f"{i:>7}  {planned:>9}  {r['step_reached']:>7}  {r['step_restored']!s:>8}  {lost!s:>10}  "
            f"{r['tier']!s:<10}  {seconds:>17}{stop}  {r['processes_before']}->{r['processes_now']} "
            f"(process {r['lost_process']} {r['how'].removeprefix('was ')})"
        )
    lost_s = [r["seconds_lost"] for r in recoveries if r.get("seconds_lost") is not None]
    steps = [
        (r["planned"] if r["planned"] is not None else r["step_reached"]) - r["step_restored"]
        for r in recoveries
        if r.get("step_restored") is not None
    ]
    if lost_s:
        print(
            f"seconds kill->next step: median {statistics.median(lost_s):.1f}, max {max(lost_s):.1f}; "
            f"steps lost: median {statistics.median(steps):g}, max {max(steps)}; tiers: "
            + ", ".join(
                f"{t} {sum(r['tier'] == t for r in recoveries)}" for t in sorted({str(r["tier"]) for r in recoveries})
            )
        )
    for g in grown:
        print(
            f"  grew back {g['processes_before']}->{g['processes_now']} at step {g['step_restored']} "
            f"({g['tier']}): {g['seconds_lost']:.1f}s from the stop to the next step"
        )
    print(
        f"  the soak's summary: goodput {summary['goodput']:.1%}, badput recovery {summary['badput_recovery']:.1%}, "
        f"compile {summary['badput_compile']:.1%}, other {summary['badput_other']:.1%} (the last start's own clock)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precompile", action="store_true", help="fault.precompile=true")
    parser.add_argument("--quick", action="store_true", help="400 steps, 3 kills: a short try (a few minutes)")
    parser.add_argument("--local-every", type=int, default=20, help="checkpoint.local_every_steps")
    parser.add_argument("--persistent-every", type=int, default=0, help="checkpoint.every_steps (default steps/kills)")
    parser.add_argument("--gap", type=int, default=10, help="the fewest steps from a persistent checkpoint to a kill")
    parser.add_argument("--keep", action="store_true", help="keep the workdirs (printed)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.kills = 400, 3
    args.persistent_every = args.persistent_every or max(args.steps // (2 * max(args.kills, 1)) // 10 * 10, 10)
    base = Path(tempfile.mkdtemp(prefix="soak-"))
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else base
    local = Path(tempfile.mkdtemp(prefix="soak-local-", dir=shm))
    made = [local]  # (this soak's local tiers: removed at the end unless --keep)
    common = [
        f"checkpoint.local_dir={local}",
        f"checkpoint.local_every_steps={args.local_every}",
        f"checkpoint.every_steps={args.persistent_every}",
        f"eval.every_steps={args.persistent_every}",
        *(["fault.precompile=true"] if args.precompile else []),
    ]
    kill_steps = plan_kills(random.Random(args.seed), args.steps, args.kills, args.persistent_every, args.gap)
    print(
        f"{args.steps} steps of configs/mnist_mlp.yaml (batch 48) on {PROCESSES} processes x {DEVICES} devices; "
        f"{args.kills} SIGKILLs at steps {kill_steps} (seed {args.seed}); local tier every {args.local_every} steps "
        f"in {shm}, persistent every {args.persistent_every}; precompile {'on' if args.precompile else 'off'}",
        flush=True,
    )
    try:
        recoveries, grown, summary, wall = soak(args, base, common, kill_steps)
        local_unbroken = Path(tempfile.mkdtemp(prefix="soak-local-", dir=shm))
        made.append(local_unbroken)
        plain = [f"checkpoint.local_dir={local_unbroken}", *common[1:], f"train.steps={args.steps}"]
        _, unbroken_wall = run(base / "unbroken", [c for c in plain if not c.startswith("fault.")], {})
        report(recoveries, grown, summary)
        compare(base, wall, unbroken_wall)
    finally:
        if args.keep:
            print(f"workdirs kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
        for path in made if not args.keep else []:
            shutil.rmtree(path, ignore_errors=True)


def compare(base: Path, wall: float, unbroken_wall: float) -> None:
    """Final eval accuracy, losses and end-to-end goodput against the unbroken run."""
    soaked, unbroken = base / "soak", base / "unbroken"
    accuracy = records(soaked, "eval")[-1], records(unbroken, "eval")[-1]
    losses = {r["step"]: r["loss"] for r in records(soaked, "train")}
    expected = {r["step"]: r["loss"] for r in records(unbroken, "train")}
    shared = sorted(set(losses) & set(expected))
    worst = max(abs(losses[s] - expected[s]) / max(abs(expected[s]), 1e-12) for s in shared)
    (summary,) = records(unbroken, "summary")[-1:]
    productive = summary["goodput"] * summary["wall_seconds"]
    print(
        f"final eval accuracy: soak {accuracy[0]['accuracy']:.4f} at step {accuracy[0]['step']}, unbroken "
        f"{accuracy[1]['accuracy']:.4f} at step {accuracy[1]['step']}; train losses at {len(shared)} logged steps: "
        f"largest relative difference {worst:.1e}"
    )
    print(
        f"wall: soak {wall:.1f}s (all restarts and growths), unbroken {unbroken_wall:.1f}s; unbroken run's summary "
        f"goodput {summary['goodput']:.1%}; soak goodput (the unbroken run's productive {productive:.1f}s over the "
        f"soak's wall) {productive / wall:.1%}"
    )


if __name__ == "__main__":
    main()
