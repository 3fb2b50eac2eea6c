"""Elastic soak: seeded random SIGKILLs of the default job's workers on 4 local processes, and
what each cost (seconds from the kill to the next step, steps lost, checkpoint tier used), the
final eval accuracy against an unbroken run of the same job, and goodput.

Design. A kill shrinks a job by one process (fault.elastic restarts it on the survivors), so ten
kills cannot all land in one 4-process job. Growing back at the next persistent checkpoint is not
built, so the soak emulates it: the run is cut into segments at persistent checkpoints
(checkpoint.every_steps); each segment is a fresh `--local-processes 4` job that resumes from the
newest checkpoint and trains to its segment's end (train.steps raised segment by segment: the
default job's learning rate is constant, so this is the unbroken run's arithmetic), with
fault.elastic=true, fault.min_processes=1, fault.max_restarts=3. The kills are seeded steps spread
over the run, at most 3 in one persistent interval (4 -> 1 processes), at least --gap steps apart;
the victim of each is a seeded random process among those alive (process 0 included). A kill is
the engine's test hook ENGINE_TEST_KILL_AT=process:step:start (the process SIGKILLs itself once it
has dispatched that step: no clean-up, as a lost host). The figures per failure come from the
`split: "recovery"` records of metrics.jsonl; the summary lines give goodput per segment, and the
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


def has_precompile() -> bool:
    """Whether this engine's schema has fault.precompile."""
    sys.path.insert(0, str(ROOT))
    from engine.config.schema import FaultConfig

    return "precompile" in FaultConfig.__dataclass_fields__


def plan_kills(rng: random.Random, steps: int, kills: int, every: int, gap: int) -> list[int]:
    """`kills` distinct seeded steps in (gap, steps - gap), `gap` apart, at most PROCESSES - 1 in
    one persistent interval of `every` steps, each at least `gap` after its interval's start."""
    for _ in range(10_000):
        chosen = sorted(rng.sample(range(gap, steps - gap), kills))
        spaced = all(b - a >= gap for a, b in zip(chosen, chosen[1:]))
        late = all(s % every >= gap for s in chosen)
        crowded = max(sum(1 for s in chosen if s // every == i) for i in range(steps // every + 1))
        if spaced and late and crowded < PROCESSES:
            return chosen
    raise SystemExit(f"cannot place {kills} kills in {steps} steps {gap} apart; lower --kills or --gap")


def segments(kill_steps: list[int], steps: int, every: int) -> list[tuple[int, list[int]]]:
    """(end step, the kills in it) per job: a job ends at the persistent checkpoint after its kills."""
    jobs: list[tuple[int, list[int]]] = []
    for step in kill_steps:
        end = min((step // every + 1) * every, steps)
        if jobs and jobs[-1][0] == end:
            jobs[-1][1].append(step)
        else:
            jobs.append((end, [step]))
    if not jobs or jobs[-1][0] < steps:
        jobs.append((steps, []))
    return jobs


def run(workdir: Path, overrides: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """One launcher job to its end: (its result, its wall seconds)."""
    full = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "ENGINE_TEST_KILL_AT")}
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


def soak(args, base: Path, common: list[str], kill_steps: list[int]) -> tuple[list[dict], list[dict], float]:
    """The broken run, segment by segment: (its recovery records, its segments' summaries, wall seconds)."""
    rng = random.Random(args.seed + 1)
    workdir, summaries, wall, recoveries = base / "soak", [], 0.0, []
    for end, kills in segments(kill_steps, args.steps, args.persistent_every):
        hooks = []
        for attempt, step in enumerate(kills):  # the k-th kill of a job hits its k-th start (4 - k alive)
            hooks.append(f"{rng.randrange(PROCESSES - attempt)}:{step}:{attempt}")
        env = {"ENGINE_TEST_KILL_AT": ",".join(hooks)} if hooks else {}
        before = len(records(workdir, "recovery")) if (workdir / "metrics.jsonl").exists() else 0
        done, seconds = run(workdir, [*common, f"train.steps={end}"], env)
        (base / f"segment-{end}.log").write_text(done.stdout + done.stderr)
        wall += seconds
        for record in records(workdir, "recovery")[before:]:  # this job's failures: planned (a kill) or not
            planned = record["attempt"] < len(kills)
            record["planned"] = kills[record["attempt"]] if planned else None
            recoveries.append(record)
        summaries.append({"end": end, "kills": hooks, "wall": seconds, **records(workdir, "summary")[-1]})
        print(f"  segment to step {end}: kills {hooks or 'none'}, {seconds:.1f}s", flush=True)
    return recoveries, summaries, wall


def report(recoveries: list[dict], summaries: list[dict]) -> None:
    """One line per failure (a kill of the soak's, or one it did not plan: `-` in kill@step)."""
    print("\nfailure  kill@step  reached  restored  lost steps  tier        s kill->next step  processes")
    for i, r in enumerate(recoveries, 1):
        planned = r["planned"] if r["planned"] is not None else "-"
        stop = f" (survivors stopped in {r['seconds_to_stop']:.1f}s)" if r.get("seconds_to_stop") is not None else ""
        lost = r["step_reached"] - r["step_restored"] if r.get("step_restored") is not None else None
        seconds = f"{r['seconds_lost']:.1f}" if r.get("seconds_lost") is not None else "-"
        print(
            f"{i:>7}  {planned:>9}  {r['step_reached']:>7}  {r['step_restored']!s:>8}  {lost!s:>10}  "
            f"{r['tier']!s:<10}  {seconds:>17}{stop}  {r['processes_before']}->{r['processes_now']} "
            f"(process {r['lost_process']} {r['how'].removeprefix('was ')})"
        )
    lost_s = [r["seconds_lost"] for r in recoveries if r.get("seconds_lost") is not None]
    steps = [r["step_reached"] - r["step_restored"] for r in recoveries if r.get("step_restored") is not None]
    if lost_s:
        print(
            f"seconds kill->next step: median {statistics.median(lost_s):.1f}, max {max(lost_s):.1f}; "
            f"steps lost: median {statistics.median(steps):g}, max {max(steps)}; tiers: "
            + ", ".join(
                f"{t} {sum(r['tier'] == t for r in recoveries)}" for t in sorted({str(r["tier"]) for r in recoveries})
            )
        )
    for s in summaries:
        print(
            f"  segment to {s['end']:>5}: wall {s['wall']:.1f}s, summary goodput {s['goodput']:.1%}, "
            f"badput recovery {s['badput_recovery']:.1%}, compile {s['badput_compile']:.1%}, "
            f"other {s['badput_other']:.1%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precompile", action="store_true", help="fault.precompile=true (when the engine has it)")
    parser.add_argument("--quick", action="store_true", help="300 steps, 3 kills: a short try (a few minutes)")
    parser.add_argument("--local-every", type=int, default=20, help="checkpoint.local_every_steps")
    parser.add_argument("--persistent-every", type=int, default=0, help="checkpoint.every_steps (default steps/kills)")
    parser.add_argument("--gap", type=int, default=40, help="the fewest steps between two kills")
    parser.add_argument("--keep", action="store_true", help="keep the workdirs (printed)")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.kills = 300, 3
    args.persistent_every = args.persistent_every or max(args.steps // max(args.kills, 1) // 10 * 10, 10)
    if args.precompile and not has_precompile():
        raise SystemExit("--precompile: this engine has no fault.precompile yet (engine/config/schema.py)")
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
        recoveries, summaries, wall = soak(args, base, common, kill_steps)
        local_unbroken = Path(tempfile.mkdtemp(prefix="soak-local-", dir=shm))
        made.append(local_unbroken)
        plain = [f"checkpoint.local_dir={local_unbroken}", *common[1:], f"train.steps={args.steps}"]
        _, unbroken_wall = run(base / "unbroken", [c for c in plain if not c.startswith("fault.")], {})
        report(recoveries, summaries)
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
        f"wall: soak {wall:.1f}s (all segments and restarts), unbroken {unbroken_wall:.1f}s; unbroken run's summary "
        f"goodput {summary['goodput']:.1%}; soak goodput (the unbroken run's productive {productive:.1f}s over the "
        f"soak's wall) {productive / wall:.1%}"
    )


if __name__ == "__main__":
    main()
