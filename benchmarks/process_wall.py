"""Whole-process wall time (start to exit, imports included) of the default job against
the same training written by hand (benchmarks/handwritten_digits.py), rounds interleaved.

    python benchmarks/process_wall.py [--rounds 3]

The engine side is the README's command, `python launch.py --config configs/mnist_mlp.yaml`
in a fresh workdir each round: it also writes checkpoints, metrics.jsonl, TensorBoard
events and the progress bar, which the hand-written script does not.
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

ROOT = Path(__file__).resolve().parent.parent


def seconds(argv: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    began = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"{argv} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times = {"engine (default job)": [], "hand-written script": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            sides = list(times) if r % 2 == 0 else list(reversed(times))
            for side in sides:
                argv = (
                    ["launch.py", "--config", "configs/mnist_mlp.yaml", "--workdir", f"{tmp}/run{r}"]
                    if side.startswith("engine")
                    else ["benchmarks/handwritten_digits.py"]
                )
                times[side].append(seconds(argv))
                print(f"round {r + 1} {side}: {times[side][-1]:.2f} s", flush=True)
    engine, hand = (statistics.median(v) for v in times.values())
    for side, values in times.items():
        print(f"{side:>22}: median {statistics.median(values):.2f} s ({', '.join(f'{v:.2f}' for v in values)})")
    print(f"engine / hand-written: {engine / hand:.2f}")


if __name__ == "__main__":
    main()
