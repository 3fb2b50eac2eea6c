"""Eight digits-MLP trials of different widths on 8 simulated CPU devices, four ways, rounds
interleaved: in one process on sub-meshes of 1 and of 2 devices (`--devices-per-trial`), one
after another each on all 8 (data parallel: plain `launch.py sweep`), and as separate
processes 4 at a time on 2 devices each (`--parallel 4`). And packing (`--modes packing`):
sixteen trials, two widths x eight learning rates, on sub-meshes of 4, each trial alone or the
trials of one program packed into one vectorised group per sub-mesh (`vectorize: auto`). Wall time of the whole
`launch.py sweep` process, and each device's busy fraction: the time the runs on it spent in
training steps (steps x mean step seconds from each run's summary record) over the wall
time. (XLA:CPU's simulated devices share the host's cores: a device's busy time is the time
a run holding it stepped, not a core's utilisation.)

    python benchmarks/submesh_sweep.py --rounds 2
    python benchmarks/submesh_sweep.py --rounds 2 --modes packing
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DEVICES = 8
WIDTHS = [[16], [32], [48], [64], [96], [128], [192], [256]]
MODES = {  # flags, devices per run
    "sub-meshes of 1": (["--devices-per-trial", "1"], 1),
    "sub-meshes of 2": (["--devices-per-trial", "2"], 2),
    "one after another on 8": ([], 8),
    "--parallel 4": (["--parallel", "4"], 2),
    "sub-meshes of 4, each trial alone": (["--devices-per-trial", "4"], 4),
    "sub-meshes of 4, packed": (["--devices-per-trial", "4"], 4),
}
PACKING = ["sub-meshes of 4, each trial alone", "sub-meshes of 4, packed"]
RATES = [0.0005, 0.001, 0.002, 0.003, 0.005, 0.007, 0.01, 0.02]


def sweep(mode: str, steps: int, directory: Path) -> dict:
    flags, per_run = MODES[mode]
    grid: dict = {"model.hidden_sizes": WIDTHS}
    if mode in PACKING:  # two programs of eight trials
        grid = {"model.hidden_sizes": [[64], [128]], "optimizer.learning_rate": RATES}
    spec = {
        "base": str(ROOT / "configs" / "mnist_mlp.yaml"),
        "directory": str(directory),
        "overrides": {
            "train.steps": steps,
            "eval.every_steps": steps // 2,
            "checkpoint.every_steps": steps // 2,
            "log.every_steps": steps // 10,
            "log.tensorboard": False,
        },
        "grid": grid,
        "metric": "eval/accuracy",
        "mode": "max",
        **({"vectorize": "auto"} if mode.endswith("packed") else {}),
    }
    path = directory.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(spec))
    # each sweep compiles cold (its own compilation cache): the modes' programs differ anyway
    cache = directory.with_name(directory.name + "-cache")
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_ENGINE_CACHE=str(cache))
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "sweep", str(path), *flags],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    wall = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{mode} sweep failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return {"wall": wall, "busy": busy(directory, per_run, wall)}


def busy(directory: Path, per_run: int, wall: float) -> list[float]:
    """Each device's busy fraction: its runs' training-step seconds over the wall time (where a
    run's devices are unknown, a separate process's, its share is spread over all of them)."""
    from engine.runtime.rundir import read_records
    from engine.sweep.submesh import events

    starts = {e["run"]: e for e in events(directory) if e["event"] == "start"}
    placed = {run: e["devices"] for run, e in starts.items()}
    seconds, groups = [0.0] * DEVICES, set()
    for workdir in directory.iterdir():
        if not (workdir / "metrics.jsonl").is_file():
            continue
        group = starts.get(workdir.name, {}).get("group")
        if group in groups:  # (a vectorised group's trials step together: its time once)
            continue
        if group:
            groups.add(group)
        summary = [r for r in read_records(workdir / "metrics.jsonl") if r["split"] == "summary"][-1]
        stepping = summary["mean_step_seconds"] * summary["step"]
        if workdir.name in placed:
            for device in placed[workdir.name]:
                seconds[device] += stepping
        else:
            for device in range(DEVICES):
                seconds[device] += stepping * per_run / DEVICES
    return [s / wall for s in seconds]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--modes",
        default=",".join(m for m in MODES if m not in PACKING),
        help="comma-separated subset of: " + ", ".join(MODES) + "; or packing",
    )
    args = parser.parse_args()
    modes = PACKING if args.modes == "packing" else args.modes.split(",")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for mode in modes:
                result = sweep(mode, args.steps, Path(tmp) / f"r{round_}-{mode.replace(' ', '_').strip('-')}")
                results[mode].append(result)
                shown = " ".join(f"{b:.2f}" for b in result["busy"])
                print(f"round {round_} {mode:>24}: {result['wall']:6.1f} s, busy {shown}", flush=True)
    print("\n| mode | wall (median; rounds) | devices' busy fraction (median round) |\n|---|---|---|")
    for mode, rounds in results.items():
        walls = [r["wall"] for r in rounds]
        middle = sorted(rounds, key=lambda r: r["wall"])[len(rounds) // 2]
        print(
            f"| {mode} | {statistics.median(walls):.1f} s ({', '.join(f'{w:.1f}' for w in walls)}) | "
            f"{' '.join(f'{b:.2f}' for b in middle['busy'])} (mean {statistics.mean(middle['busy']):.2f}) |"
        )
    print(json.dumps({mode: [r["wall"] for r in rounds] for mode, rounds in results.items()}))


if __name__ == "__main__":
    main()
