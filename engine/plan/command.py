"""`launch.py plan`: a run compiled for a TPU pod (compiled.py) and its verdict printed, or the
ranked layouts of `--search` (layouts.py); chips and targets are engine/plan/tpu.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from engine.config import Config
from engine.errors import UsageError
from engine.plan.compiled import as_record, plan
from engine.plan.layouts import render as render_search
from engine.plan.layouts import search
from engine.plan.tpu import parse_target
from engine.plan.verdict import render, verdict


def plan_command(
    cfg: Config, target_name: str, slices: int, search_layouts: bool, compiles: int, json_path: Optional[str]
) -> int:
    """Prints the plan (or the ranked search); 0 when it fits, 1 when it does not."""
    _check_writable(json_path)  # before minutes of compiling, not after
    target = parse_target(target_name, slices)
    if search_layouts:
        ranked = search(cfg, target, compiles)
        print(render_search(ranked, cfg))
        best = ranked[0] if ranked and ranked[0].planned and ranked[0].planned.fits else None
        if best is None:
            print(f"no layout tried fits {target.name}; try more chips, remat, or a smaller micro-batch")
            return 1
        print(f"best: {' '.join(best.overrides())}")
        records = [as_record(c.planned) | {"overrides": c.overrides()} for c in ranked if c.planned]
        _write(json_path, records)
        return 0
    planned = plan(cfg, target, progress=True)
    print(render(planned))
    print(verdict(planned))
    _write(json_path, as_record(planned))
    return 0 if planned.fits else 1


def _check_writable(path: Optional[str]) -> None:
    """UsageError unless --json PATH can be written: its folder exists, and it is no folder itself."""
    if not path:
        return
    out = Path(path)
    folder = out.parent
    if out.is_dir():
        raise UsageError(f"--json {path} is a directory; give a file name, e.g. --json {out / 'plan.json'}")
    if not folder.is_dir():
        raise UsageError(f"--json {path}: {folder} is not an existing directory; create it, or write elsewhere")
    if not os.access(folder, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise UsageError(f"--json {path} cannot be written here (permissions); give a writable path")


def _write(path: Optional[str], record) -> None:
    if not path:
        return
    try:
        Path(path).write_text(json.dumps(record, indent=2) + "\n")
    except OSError as e:  # (checked before compiling; what changed since is said in one line)
        raise UsageError(f"--json {path} could not be written ({e.strerror or e}); the plan is printed above") from None
