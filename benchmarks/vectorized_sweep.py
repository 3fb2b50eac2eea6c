"""Wall time of a whole sweep (`launch.py sweep`, start to exit) run three ways: each run its
own process one after another (sequential), two processes at a time (`--parallel 2`), and
vectorised (`vectorize: auto`: the runs as one program). Rounds interleave the three.

    python benchmarks/vectorized_sweep.py                 # 8 digits-MLP configs (the default job)
    python benchmarks/vectorized_sweep.py --model gpt_small --steps 200   # 4 gpt_small configs

The digits sweep is the default job (configs/mnist_mlp.yaml, 1,500 steps) with AdamW and
four learning rates x two weight decays; gpt_small varies learning rate and weight decay
over four configs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
SWEEPS = {
    "mnist_mlp": {
        "grid": {"optimizer.learning_rate": [3e-4, 1e-3, 3e-3, 1e-2], "optimizer.weight_decay": [0.0, 0.1]},
        "overrides": {"optimizer.name": "adamw"},
    },
    "gpt_small": {
        "grid": {"optimizer.learning_rate": [3e-4, 1e-3], "optimizer.weight_decay": [0.0, 0.1]},
        "overrides": {},
    },
}
MODES = {"sequential": ([], False), "parallel 2": (["--parallel", "2"], False), "vectorised": ([], True)}


def sweep_seconds(model: str, steps: int | None, mode: str, directory: Path) -> float:
    flags, vectorize = MODES[mode]
    spec = {
        "base": str(ROOT / "configs" / f"{model}.yaml"),
        "directory": str(directory),
        "overrides": {
            **SWEEPS[model]["overrides"],
            "log.tensorboard": False,
            **({"train.steps": steps} if steps else {}),
        },
        "grid": SWEEPS[model]["grid"],
        "metric": "eval/accuracy",
        "mode": "max",
    }
    if vectorize:
        spec["vectorize"] = "auto"
    path = directory.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(spec))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    began = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "sweep", str(path), *flags],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise SystemExit(f"{mode} sweep failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(SWEEPS), default="mnist_mlp")
    parser.add_argument("--steps", type=int, help="train.steps of every run (default: the config's)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: " + ", ".join(MODES))
    args = parser.parse_args()
    modes = args.modes.split(",")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = modes[r % len(modes) :] + modes[: r % len(modes)]  # each mode goes first once in a while
            for mode in order:
                seconds = sweep_seconds(args.model, args.steps, mode, Path(tmp) / f"{mode.replace(' ', '_')}_{r}")
                times[mode].append(seconds)
                print(f"round {r + 1} {mode:>11}: {seconds:7.1f} s", flush=True)
    runs = len(SWEEPS[args.model]["grid"]["optimizer.learning_rate"]) * len(
        SWEEPS[args.model]["grid"]["optimizer.weight_decay"]
    )
    print(f"\n{args.model}, {runs} configs, train.steps={args.steps or 'config'}; median of {args.rounds} rounds")
    base = statistics.median(times["sequential"]) if "sequential" in times else None
    for mode, values in times.items():
        median = statistics.median(values)
        ratio = f"  {base / median:.2f}x sequential" if base else ""
        print(f"  {mode:>11}: {median:7.1f} s (" + ", ".join(f"{v:.1f}" for v in values) + f"){ratio}")


if __name__ == "__main__":
    main()
