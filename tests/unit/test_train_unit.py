"""End to end through launch.py: the default job, its outputs, and failure exits."""

import pytest


@pytest.mark.nocompile
def test_a_terminal_gets_a_progress_bar_and_a_pipe_plain_lines(tmp_path, monkeypatch, capsys):
    import io
    import sys

    from engine.observe.metrics import MetricWriter

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stderr, bar in ((Terminal(), True), (io.StringIO(), False)):
        monkeypatch.setattr(sys, "stderr", stderr)
        writer = MetricWriter(tmp_path, enabled=True, total_steps=10, start_step=0, progress=True, tensorboard=False)
        writer.write(5, "train", {"loss": 1.25, "examples_per_sec": 3.0})
        writer.close()
        assert (writer.bar is not None) == bar
        printed = capsys.readouterr().out
        assert ("step 5 train: loss=1.25" in printed) != bar and "examples_per_sec" not in printed
