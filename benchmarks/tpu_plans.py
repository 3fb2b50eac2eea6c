"""The shipped language-model configs planned for their intended TPU targets with the TPU
compiler on this host (`launch.py plan`), one slice and two: fit, memory per chip, compile
time, collectives and the analytic step time. BENCHMARKS.md "TPU plans" quotes it.

    python benchmarks/tpu_plans.py [--only llama_1b] [--target v6e-64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.runtime import settings as process  # noqa: E402

process.install()

from engine.config import load_config  # noqa: E402
from engine.plan.compiled import as_record, plan  # noqa: E402
from engine.plan.tpu import parse_target  # noqa: E402
from engine.runtime.units import human_bytes  # noqa: E402

# (config, target, slices, overrides): the layouts the configs ship, and across two slices data
# parallel between the slices with the config's layout inside each
CASES = [
    ("llama_1b", "v5p-8", 1, []),
    ("llama_1b", "v5p-8", 2, ["mesh.data=2", "mesh.dcn_data=2"]),
    ("llama_1b", "v5e-16", 1, []),
    ("llama_1b", "v5e-16", 2, ["mesh.data=2", "mesh.dcn_data=2"]),
    ("llama3_8b", "v5p-64", 1, []),
    ("llama3_8b", "v5p-64", 2, ["mesh.data=2", "mesh.dcn_data=2"]),
    ("llama3_8b", "v6e-64", 1, []),
    ("llama3_8b", "v6e-64", 2, ["mesh.data=2", "mesh.dcn_data=2", "train.global_batch_size=64"]),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="one config name")
    parser.add_argument("--target", help="one target name, e.g. v6e-64")
    parser.add_argument("--slices", type=int, help="only the cases with this many slices")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("overrides", nargs="*", help="added to every case, e.g. model.remat=full")
    args = parser.parse_args()
    records = []
    for config, target_name, slices, overrides in CASES:
        if (
            (args.only and config != args.only)
            or (args.target and target_name != args.target)
            or (args.slices and slices != args.slices)
        ):
            continue
        cfg = load_config(ROOT / "configs" / f"{config}.yaml", overrides + args.overrides, "/tmp/tpu-plans")
        started = time.perf_counter()
        planned = plan(cfg, parse_target(target_name, slices))
        seconds = time.perf_counter() - started
        peak = human_bytes(planned.peak) if not planned.refused else "refused"
        ops = sorted({f"{c.op} ({'DCN' if c.dcn else 'ICI'})" for c in planned.collectives})
        print(
            f"{config} on {planned.target.name}: fits={planned.fits} peak={peak}/device of "
            f"{human_bytes(planned.hbm)}; ICI {human_bytes(planned.per_step(False))}/step, DCN "
            f"{human_bytes(planned.per_step(True))}/step; step at 50% MFU {planned.step_seconds(0.5) * 1e3:,.0f} ms; "
            f"plan {seconds:.0f}s; {', '.join(ops)}",
            flush=True,
        )
        records.append(
            {"config": config, "overrides": overrides + args.overrides, "seconds": seconds, **as_record(planned)}
        )
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2) + "\n")


if __name__ == "__main__":
    main()
