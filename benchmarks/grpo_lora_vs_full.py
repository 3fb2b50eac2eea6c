"""LoRA GRPO against full fine-tuning GRPO on the same task (issue 55): the shipped
configs/chat_grpo.yaml (LoRA rank 8 on the 100-step SFT base) and the same config training every
parameter (no adapters: `finetune.base=` `finetune.lora.rank=0`, the SFT run's parameters restored
with `checkpoint.restore_from=runs/chat_sft_short/checkpoints checkpoint.restore_mode=params`) at a
learning rate of its own. Each is its own `launch.py` process; the script prints the held-out reward
before (the same config run 1 step at lr 1e-9: the start, which both share) and after, the greedy
exact answers, and the seconds each took (process wall, and the mean step's sampling and updating).

    python -m engine.data.chat_example runs/chat_example
    python launch.py --config configs/chat_sft.yaml train.steps=100 --workdir runs/chat_sft_short
    python benchmarks/grpo_lora_vs_full.py --full-lr 1e-4 --full-lr 3e-5   # [--steps 120] [--nice 19]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/chat_grpo.yaml"


def full_overrides(base: str, lr: float) -> list[str]:
    """The shipped config with every parameter trained, from the SFT run's parameters."""
    return [
        "finetune.base=''",
        "finetune.lora.rank=0",
        f"checkpoint.restore_from={base}/checkpoints",
        "checkpoint.restore_mode=params",
        f"optimizer.learning_rate={lr}",
    ]


def _records(workdir: Path) -> list[dict]:
    path = workdir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def run(name: str, overrides: list[str], workdir: Path, niceness: int, stop_at: int = 0) -> dict:
    """One launch.py process: its eval records, its train records' mean seconds, its wall; `stop_at`:
    stopped (SIGTERM) once its eval at that step is written (the schedule stays the whole run's)."""
    shutil.rmtree(workdir, ignore_errors=True)
    command = ["nice", "-n", str(niceness), sys.executable, "launch.py", "--config", CONFIG, "--workdir", str(workdir)]
    started, wall = time.perf_counter(), 0.0
    process = subprocess.Popen([*command, *overrides], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while stop_at and process.poll() is None:
        if any(r.get("split") == "eval" and r["step"] >= stop_at for r in _records(workdir)):
            wall = time.perf_counter() - started  # (to the eval's record)
            process.terminate()
            break
        time.sleep(2)
    _, stderr = process.communicate()
    if not wall:
        wall = time.perf_counter() - started
        if process.returncode != 0:
            sys.exit(f"{name}: exit {process.returncode}\n{stderr.decode()[-3000:]}")
    records = _records(workdir)
    evals = [r for r in records if r.get("split") == "eval" and (not stop_at or r["step"] <= stop_at)]
    train = [r for r in records if r.get("split") == "train" and (not stop_at or r["step"] <= stop_at)]
    summary = next((r for r in records if r.get("split") == "summary"), {"mean_step_seconds": float("nan")})
    mean = lambda key: sum(r[key] for r in train) / max(len(train), 1)  # noqa: E731
    result = {
        "name": name,
        "wall": wall,
        "steps": train[-1]["step"] if train else 0,
        "eval": [(r["step"], r["reward"], r.get("generate/exact_match")) for r in evals],
        "sampling": mean("seconds/sampling"),
        "updating": mean("seconds/updating"),
        "step_seconds": summary["mean_step_seconds"],
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", default="runs/chat_sft_short")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--full-lr", type=float, action="append", default=None)
    parser.add_argument("--nice", type=int, default=19)
    parser.add_argument("--no-before", action="store_true")
    parser.add_argument("--no-lora", action="store_true")
    parser.add_argument("--no-full", action="store_true")
    parser.add_argument("--stop-at", type=int, default=0, help="stop each run after its eval at this step")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    scratch = Path(tempfile.mkdtemp(prefix="grpo_lora_vs_full_"))
    steps = [f"train.steps={args.steps}"]
    results = []
    if not args.no_before:
        results.append(run("before", ["train.steps=1", "optimizer.learning_rate=1e-9"], scratch / "before", args.nice))
    if not args.no_lora:
        results.append(run("lora (shipped, lr 1e-3)", steps, scratch / "lora", args.nice, args.stop_at))
    for lr in [] if args.no_full else args.full_lr or [1e-4]:
        results.append(
            run(
                f"full, lr {lr:g}",
                [*steps, *full_overrides(args.base, lr)],
                scratch / f"full_{lr:g}",
                args.nice,
                args.stop_at,
            )
        )
    print("\n| run | eval/reward by step | greedy exact by step | process wall | step (sampling / updating) |")
    print("|---|---|---|---|---|")
    for r in results:
        rewards = ", ".join(f"{s}: {v:.3f}" for s, v, _ in r["eval"])
        exact = ", ".join(f"{s}: {e:.3f}" for s, _, e in r["eval"] if e is not None)
        print(
            f"| {r['name']} | {rewards} | {exact} | {r['wall']:.0f} s | {r['step_seconds']:.2f} s "
            f"({r['sampling']:.2f} / {r['updating']:.2f}) |"
        )
    shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
