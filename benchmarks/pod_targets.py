"""Issue 46's pod targets planned with the TPU compiler on this host: the shipped configs at the
shapes pods train (seq 8192, several sequences per chip), each run as the user would run it
(`launch.py plan … --json`, one process per case), with variants of attention and remat beside
the shipped settings. BENCHMARKS.md "Pod targets" quotes it.

    python benchmarks/pod_targets.py [--only 8b-v6e] [--variants] [--json out.json]

A case's line: fits, HBM per chip (total and temporaries) against what the compiler gives a
program, host memory (offloaded activations), the collectives' time against the compute at 50%
MFU, tokens/s per chip at 40/50/60% MFU, and the compile time. An 8B case takes 2-5 minutes
and several GiB here, a 70B case longer: run them one at a time on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.runtime.units import human_bytes  # noqa: E402

# (name, config, target, overrides): the shipped settings, as the targets state them
TARGETS = [
    ("8b-v6e", "llama3_8b", "v6e-64", ["train.global_batch_size=256"]),  # 4 sequences per chip
    ("8b-v5e", "llama3_8b", "v5e-256", ["train.global_batch_size=512"]),  # 2 per chip
    ("1b-v5e", "llama_1b", "v5e-16", ["model.remat=dots"]),  # the shipped batch, seq 2048
    ("70b-v6e", "llama3_70b", "v6e-256", []),  # 2 per chip, the config's batch
    ("70b-v5p", "llama3_70b", "v5p-128", ["train.global_batch_size=128"]),  # 2 per chip (64 chips)
]
# variants of the first target: what each setting is worth
VARIANTS = [
    ("8b-v6e xla", "llama3_8b", "v6e-64", ["train.global_batch_size=256", "model.attention=xla"]),
    ("8b-v6e remat=offload", "llama3_8b", "v6e-64", ["train.global_batch_size=256", "model.remat=offload"]),
    ("8b-v6e tensor=2", "llama3_8b", "v6e-64", ["train.global_batch_size=256", "mesh.tensor=2"]),
    (
        "8b-v6e tensor=2 offload",
        "llama3_8b",
        "v6e-64",
        ["train.global_batch_size=256", "mesh.tensor=2", "model.remat=offload"],
    ),
    ("8b-v6e 1 per chip", "llama3_8b", "v6e-64", ["train.global_batch_size=64"]),
    ("8b-v6e remat=minimal", "llama3_8b", "v6e-64", ["train.global_batch_size=256", "model.remat=minimal"]),
    ("8b-v6e logits whole", "llama3_8b", "v6e-64", ["train.global_batch_size=256", "model.logits_budget_mib=0"]),
    *[
        (f"8b-v6e remat={r}", "llama3_8b", "v6e-64", ["train.global_batch_size=256", f"model.remat={r}"])
        for r in ("dots", "none")
    ],
]


def run_case(config: str, target: str, overrides: list[str]) -> tuple[dict, float]:
    """One `launch.py plan --json` in its own process: (its record, seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        started = time.perf_counter()
        command = [sys.executable, "launch.py", "plan", "--config", f"configs/{config}.yaml", "--target", target]
        done = subprocess.run(
            [*command, *overrides, "--json", str(out)], cwd=ROOT, capture_output=True, text=True, check=False
        )
        seconds = time.perf_counter() - started
        if not out.exists():
            return {"error": (done.stdout + done.stderr)[-2000:]}, seconds
        return json.loads(out.read_text()), seconds


def line(name: str, record: dict, seconds: float) -> str:
    if "error" in record:
        return f"{name}: no plan ({seconds:.0f}s): {record['error'].strip().splitlines()[-1]}"
    train = record["programs"][0]
    if record["refused"]:  # the TPU compiler's own words: how much the program needs
        return f"{name}: refused ({seconds:.0f}s): {record['refused'].strip().splitlines()[0][:300]}"
    compute = record["step_seconds"]["50%"]
    tokens = {mfu: record["tokens_per_step"] / record["chips"] / s for mfu, s in record["step_seconds"].items()}
    host = train.get("host", 0)
    return (
        f"{name}: fits={record['fits']} {human_bytes(train['total'])} per chip "
        f"(temporaries {human_bytes(train['temporaries'])}) of {human_bytes(record['hbm_bytes'])}"
        f"{f', host {human_bytes(host)}' if host else ''}; collectives "
        f"{record['collective_seconds_per_step'] * 1e3:,.0f} ms vs compute {compute * 1e3:,.0f} ms at 50% MFU; "
        f"tokens/s per chip " + " / ".join(f"{tokens[m]:,.0f}" for m in sorted(tokens)) + " at 40/50/60% MFU; "
        f"compile {train['compile_seconds']:.0f}s, plan {seconds:.0f}s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="one case name, e.g. 8b-v6e")
    parser.add_argument("--variants", action="store_true", help="the 8B variants instead of the targets")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args()
    records = []
    for name, config, target, overrides in VARIANTS if args.variants else TARGETS:
        if args.only and name != args.only:
            continue
        record, seconds = run_case(config, target, overrides)
        print(line(name, record, seconds), flush=True)
        records.append({"name": name, "config": config, "overrides": overrides, "seconds": seconds, **record})
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
