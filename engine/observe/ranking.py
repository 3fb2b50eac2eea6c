"""`launch.py report SWEEP_DIR_OR_WORKDIRS...`: runs ranked by a metric, as a console table,
CSV and Markdown, and one PNG of every run's train and eval loss curves."""

from __future__ import annotations

import csv
import importlib
import os
import threading
from pathlib import Path

from engine.errors import UsageError
from engine.runtime.rundir import METRICS, STATUS, final_metrics, read_json, read_records, read_status


def preload() -> threading.Thread:
    """Imports matplotlib's figure and PNG writer on a background thread (0.7 s on a 2-core
    machine), so that a sweep's report, drawn once its runs end, finds them loaded: the sweep
    process only waits for its runs meanwhile."""

    def load() -> None:
        for module in ("matplotlib.figure", "matplotlib.backends.backend_agg"):  # backend_agg: the PNG writer
            importlib.import_module(module)

    # not a daemon: a sweep ending early waits for the import rather than cutting it off
    # (matplotlib may be writing its font cache)
    thread = threading.Thread(target=load, name="report-preload")
    thread.start()
    return thread


def _runs(paths: list[Path]) -> list[tuple[str, Path, str]]:
    """(name, workdir, status) for each run: a sweep directory's runs, or workdirs themselves."""
    runs = []
    for path in paths:
        if (path / "sweep.json").exists():
            names = (read_json(path / "sweep.json") or {}).get("runs")
            if not isinstance(names, list):  # damaged: the runs are the sweep directory's workdirs
                names = sorted(p.name for p in path.iterdir() if (p / METRICS).exists() or (p / STATUS).exists())
            for name in names:
                runs.append((name, path / name, read_status(path / name).get("status", "pending")))
        elif (path / METRICS).exists():
            runs.append((path.name, path, read_status(path).get("status", "finished")))
        else:
            raise UsageError(f"{path} is neither a sweep directory (sweep.json) nor a run's workdir (metrics.jsonl)")
    return runs


def _curves(workdir: Path, metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """Per panel ("train", "eval", and the ranking metric): (steps, values) of the run."""
    curves: dict[str, tuple[list[int], list[float]]] = {}
    split, name = metric.split("/", 1)
    for record in read_records(workdir / METRICS):
        panels = [(record["split"], record.get("loss"))] if record.get("source") != "evaluator" else []
        if record["split"] == split and (metric not in ("train/loss", "eval/loss")):
            panels.append((metric, record.get(name)))
        for panel, value in panels:
            if isinstance(value, (int, float)):
                steps, values = curves.setdefault(panel, ([], []))
                steps.append(record["step"])
                values.append(value)
    return curves


def report(
    paths: list[Path | str], metric: str | None = None, mode: str | None = None, out: Path | str | None = None
) -> list[dict]:
    """Writes report.csv, report.md and report.png into `out` (default: the sweep directory, or the
    directory holding the workdirs); prints and returns the ranked rows."""
    folders = [Path(p) for p in paths]
    sweep_meta = next((read_json(p / "sweep.json") or {} for p in folders if (p / "sweep.json").exists()), {})
    metric = metric or sweep_meta.get("metric", "eval/loss")
    mode = mode or sweep_meta.get("mode", "min")
    place = (
        Path(out)
        if out
        else (
            folders[0]
            if len(folders) == 1 and (folders[0] / "sweep.json").exists()
            else Path(os.path.commonpath([p.absolute().parent for p in folders]))
        )
    )
    place.mkdir(parents=True, exist_ok=True)
    rows = []
    runs = _runs(folders)
    available = sorted({key for _, workdir, _ in runs for key in final_metrics(workdir)})
    if runs and not available:  # (every run failed, or stopped, before it logged anything)
        raise UsageError(
            f"--metric {metric}: no run has logged a metric yet (metrics.jsonl); see each run's status and error"
            " in sweep.jsonl or its run.log"
        )
    if runs and metric not in available:
        raise UsageError(f"--metric {metric} is in no run's metrics.jsonl; available: {', '.join(available)}")
    for name, workdir, status in runs:
        final = final_metrics(workdir)
        rows.append(
            {
                "run": name,
                "status": status,
                metric: final.get(metric),
                **{k: v for k, v in sorted(final.items()) if k != metric and k in _shown(final)},
            }
        )
    ranked = sorted(rows, key=lambda r: (r[metric] is None, (r[metric] or 0) * (-1 if mode == "max" else 1)))
    for rank, row in enumerate(ranked, 1):
        row["rank"] = rank if row[metric] is not None else None
    columns = ["rank", "run", "status", metric] + sorted(
        {k for r in ranked for k in r} - {"rank", "run", "status", metric}
    )
    with open(place / "report.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(ranked)
    cells = [[_cell(row.get(c)) for c in columns] for row in ranked]
    (place / "report.md").write_text(_markdown(columns, cells, f"Runs ranked by {metric} ({mode})"))
    print(_console(columns, cells, f"runs ranked by {metric} ({mode}); best first"))
    best = str(ranked[0]["run"]) if ranked and ranked[0]["rank"] else None
    _plot([(name, _curves(workdir, metric)) for name, workdir, _ in runs], place / "report.png", metric, best)
    print(f"wrote {place / 'report.csv'}, {place / 'report.md'}, {place / 'report.png'}")
    return ranked


def _shown(final: dict) -> set[str]:
    """Columns worth a glance: eval metrics, train loss/accuracy, time to first step, compile time."""
    keep = {
        "train/loss",
        "train/accuracy",
        "summary/time_to_first_step",
        "summary/compile_seconds",
        "summary/compile_cache_hits",
    }
    return {k for k in final if k.startswith("eval/") or k in keep}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _markdown(columns, cells, title) -> str:
    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines) + "\n"


def _console(columns, cells, title) -> str:
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = [title, "  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def _plot(curves: list[tuple[str, dict]], path: Path, metric: str, best: str | None) -> None:
    """Train loss, eval loss and (when it is neither) the ranking metric per run; the best run
    drawn thick and named in the title."""
    from matplotlib.figure import Figure  # no pyplot: a file, no display, no global figure state

    panels = ["train", "eval"] + ([metric] if metric not in ("train/loss", "eval/loss") else [])
    shown = sum(1 for _, by_panel in curves if any(panel in by_panel for panel in panels))
    legend_inches = 0.17 * ((shown + 2) // 3) + (0.2 if shown else 0)  # three names a row, under the panels
    height = 4.5 + legend_inches
    fig = Figure(figsize=(6.5 * len(panels), height))
    axes = fig.subplots(1, len(panels))
    for ax, panel in zip(axes, panels):
        for name, by_panel in curves:
            if panel in by_panel:
                steps, values = by_panel[panel]
                ax.plot(
                    steps,
                    values,
                    marker="o" if len(steps) < 15 else None,
                    markersize=3,
                    label=name,
                    linewidth=3 if name == best else 1,
                    zorder=3 if name == best else 2,
                )
        ax.set_title(f"{panel} loss" if panel in ("train", "eval") else panel)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.suptitle(f"best by {metric}: {best}" if best else f"no run has {metric} yet")
    handles, labels = [], []
    for ax in axes:  # every run that appears in any panel, once
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
    # fixed margins (inches over the figure's height): matplotlib's tight_layout measured every
    # label, 0.5 s of a sweep's report
    fig.subplots_adjust(
        left=0.07 / len(panels) * 2,
        right=0.98,
        top=1 - 0.75 / height,
        wspace=0.25,
        bottom=(0.55 + legend_inches) / height,
    )
    fig.savefig(path, dpi=110)
