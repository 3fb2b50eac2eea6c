"""A sub-mesh sweep's console (engine/sweep/progress.py): one line per sub-mesh updated in place on
a terminal, plain lines elsewhere, the summary at the end. Compiles nothing."""

import io
from types import SimpleNamespace

from engine.sweep.progress import Progress

DEVICES = [SimpleNamespace(id=0), SimpleNamespace(id=1)]


def test_plain_lines_say_each_start_metric_and_end_then_the_summary():
    out = io.StringIO()
    progress = Progress(2, "eval/loss", out, terminal=False)
    progress.started(0, "width=8", DEVICES)
    progress.record(0, {"split": "train", "step": 10, "loss": 2.0})  # (a train record: no line)
    progress.record(0, {"split": "eval", "step": 20, "loss": 0.5})
    progress.ended(0, "width=8", {"status": "failed", "error": "error: training stopped: loss is nan"})
    progress.close()
    lines = out.getvalue().splitlines()
    assert lines[:3] == [
        "start width=8 on sub-mesh 0 (devices [0, 1])",
        "width=8 step 20: eval/loss=0.5",
        "     failed width=8: error: training stopped: loss is nan",
    ]
    assert lines[3].startswith("sweep: 1 failed in ")


def test_on_a_terminal_each_sub_mesh_has_one_line_updated_in_place():
    out = io.StringIO()
    progress = Progress(2, "eval/loss", out, terminal=True)
    progress.started(0, "width=8", DEVICES)
    progress.started(1, "width=16", DEVICES)
    progress.record(0, {"split": "train", "step": 10, "loss": 1.5})
    progress.record(1, {"split": "eval", "step": 20, "loss": 0.9})
    assert [progress.text(0), progress.text(1)] == [
        "[0] width=8: training step 10 loss=1.5",
        "[1] width=16: training step 20 eval/loss=0.9",
    ]
    progress.refresh()
    progress.ended(0, "width=8", {"status": "finished"})
    progress.idle(0)
    progress.close()
    text = out.getvalue()
    assert "[0] width=8: training step 10 loss=1.5" in text and "\x1b[A" in text  # (tqdm moves up to rewrite)
    assert "   finished width=8" in text and "[0] idle" in text
    assert text.splitlines()[-1].startswith("sweep: 1 finished in ")
