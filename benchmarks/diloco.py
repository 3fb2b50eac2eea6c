"""DiLoCo against data parallelism on llama_tiny (2 CPU devices, equal tokens): the final eval
loss for each number of inner steps H, and the bytes each replica sends over the replica axis
per 100 steps (read from the compiled programs' HLO: data parallelism's gradient all-reduce
every step, DiLoCo's outer all-reduce once per round). BENCHMARKS.md "DiLoCo" quotes it.

    python benchmarks/diloco.py [--steps 300] [--inner 1 4 8 16 64] [--no-dp] [--json out.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.runtime import settings as process  # noqa: E402

process.install()


from engine.config import load_config  # noqa: E402
from engine.plan import hlo  # noqa: E402
from engine.run.single import fit  # noqa: E402


def crossing_bytes(program, mesh, axis_name: str) -> int:
    """Bytes of the collectives whose groups span more than one index of `axis_name`, per run of
    the program."""
    found = hlo.program_collectives(program.as_text(), mesh.size)
    return sum(c.bytes * c.count for c in hlo.crossing(found, mesh, axis_name))


def train(overrides: list[str], workdir: str):
    cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", overrides, workdir)
    started = time.perf_counter()
    result = fit(cfg)
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--inner", type=int, nargs="*", default=[1, 4, 8, 16, 64])
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--no-dp", action="store_true", help="skip the data-parallel run")
    parser.add_argument("overrides", nargs="*", help="added to the DiLoCo runs, e.g. diloco.outer_learning_rate=0.3")
    args = parser.parse_args()
    common = [
        f"train.steps={args.steps}",
        "mesh.data=2",
        "log.progress=false",
        "log.tensorboard=false",
        f"eval.every_steps={args.steps}",
        "train.steps_per_call=1",
    ]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        from engine.run.setup import build_run

        dp_cfg = load_config(ROOT / "configs" / "llama_tiny.yaml", common, f"{tmp}/probe")
        dp_run = build_run(dp_cfg)
        dp_bytes = crossing_bytes(dp_run.compiled.program, dp_run.mesh, "data")
        dp_loss = float("nan")
        if not args.no_dp:
            result, seconds = train(common, f"{tmp}/dp")
            dp_loss = result.eval_metrics["loss"]
            print(f"data parallel: eval loss {dp_loss:.4f}; {seconds:.0f}s", flush=True)
        records.append({"sync": "every_step", "eval_loss": dp_loss, "bytes_per_100_steps": 100 * dp_bytes})
        print(f"data parallel: {hlo.human_bytes(100 * dp_bytes)} per 100 steps", flush=True)
        for inner in args.inner:
            overrides = [
                *common,
                "train.sync=diloco",
                "diloco.replica_axis=data",
                f"diloco.inner_steps={inner}",
                *args.overrides,
            ]
            run = build_run(load_config(ROOT / "configs" / "llama_tiny.yaml", overrides, f"{tmp}/probe{inner}"))
            inner_bytes = crossing_bytes(run.compiled.program, run.mesh, "replica")
            outer_bytes = crossing_bytes(run.compiled.sync.program, run.mesh, "replica")
            per_100 = 100 * inner_bytes + 100 / inner * outer_bytes
            result, seconds = train(overrides, f"{tmp}/diloco{inner}")
            loss = result.eval_metrics["loss"]
            records.append(
                {
                    "sync": "diloco",
                    "inner_steps": inner,
                    "overrides": args.overrides,
                    "eval_loss": loss,
                    "bytes_per_100_steps": per_100,
                }
            )
            print(
                f"DiLoCo H={inner}: eval loss {loss:.4f} ({loss / records[0]['eval_loss'] - 1:+.1%} against data "
                f"parallel); {hlo.human_bytes(per_100)} per 100 steps (inner step {inner_bytes} B); {seconds:.0f}s",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
