"""Compile time of the train step against depth: the Llama family with scanned layers
(`model.scan_layers=true`, the default) and with a Python loop over layers, and the GPT-style
transformer (always a loop), at 4, 16 and 32 layers (d_model 128, as configs/gpt_small.yaml).

Each figure is `build_run`'s compile of the train step in a fresh process with the
persistent compilation cache off (what `--dry-run` reports as compile time). Rounds are
interleaved: every (model, depth) once per round, so drift on this noisy machine hits all.

    python benchmarks/compile_depth.py                 # 4, 16, 32 layers, 2 rounds
    python benchmarks/compile_depth.py --layers 4 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = [
    "data.name=python_source",
    "data.seq_len=128",
    "train.global_batch_size=16",
    "mesh.num_devices=1",
    "model.d_model=128",
    "model.num_heads=4",
    "model.mlp_dim=512",
    "train.compilation_cache_dir=''",
    "log.progress=false",
]
MODELS = {
    "llama, scanned": ["model.name=llama", "model.num_kv_heads=2", "model.scan_layers=true"],
    "llama, loop": ["model.name=llama", "model.num_kv_heads=2", "model.scan_layers=false"],
    "transformer (loop)": ["model.name=transformer"],
}

CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from engine.config import load_config
from engine.run.setup import build_run
cfg = load_config({root!r} + "/configs/base.yaml", {overrides!r}, "/tmp/compile_depth")
print(json.dumps({{"compile_seconds": build_run(cfg).compiled.compile_seconds}}))
"""


def compile_seconds(overrides: list[str]) -> float:
    code = CHILD.format(root=str(ROOT), overrides=overrides)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["compile_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for depth in args.layers:
            for name, extra in MODELS.items():
                seconds = compile_seconds([*COMMON, *extra, f"model.num_layers={depth}"])
                times.setdefault((name, depth), []).append(seconds)
                print(f"  {name:<20} {depth:>3} layers: {seconds:6.2f} s", flush=True)
    print(f"\ncompile time of the train step (median of {args.rounds}), seconds")
    print(f"{'model':<20}" + "".join(f"{d:>10} L" for d in args.layers) + f"{'ratio':>10}")
    for name in MODELS:
        medians = [statistics.median(times[(name, d)]) for d in args.layers]
        print(f"{name:<20}" + "".join(f"{m:>12.2f}" for m in medians) + f"{medians[-1] / medians[0]:>10.2f}")


if __name__ == "__main__":
    main()
