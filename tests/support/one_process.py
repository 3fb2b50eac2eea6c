"""Several launch.py command lines through the engine's `main`, one after another, in one fresh
process (jax and the engine imported once; a program compiled by one command loads from the
persistent cache in the next): for tests whose property is what each command does, not that it
runs in a process of its own, and for the tests of bad input that check many command lines at
once (tests/support/fuzz_cli.py). A step may create or remove a file before its command runs;
each result keeps its whole stdout and stderr:

    python tests/support/one_process.py STEPS.json RESULTS.json
"""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run_steps(tmp_path: Path, steps: list[dict], env: dict, timeout: int = 600) -> list[dict]:
    """Each step (a dict: "argv", and optionally "create" or "remove", a file's path to create
    empty or remove before the command) → the step with its "code" (main's exit code), "stdout",
    "stderr" and "escaped" (an exception that escaped main, as a user would see a traceback).
    env: the process's whole environment (tests/support/cli.child_env gives launch.py's)."""
    steps_file, results_file = tmp_path / "steps.json", tmp_path / "results.json"
    steps_file.write_text(json.dumps(steps))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(steps_file), str(results_file)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(results_file.read_text())


def _run(steps: list[dict]) -> list[dict]:
    from engine.cli import main

    results = []
    for step in steps:
        if "create" in step:
            Path(step["create"]).write_text("")
        if "remove" in step:
            Path(step["remove"]).unlink()
        err, out = io.StringIO(), io.StringIO()
        escaped = ""
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(step["argv"])
            except SystemExit as e:  # argparse's own usage errors
                code = e.code if isinstance(e.code, int) else 2
            except BaseException as e:  # noqa: BLE001 - recorded: the test fails on any
                code, escaped = -1, f"{type(e).__name__}: {e}"
        results.append({**step, "code": code, "stderr": err.getvalue(), "stdout": out.getvalue(), "escaped": escaped})
    return results


if __name__ == "__main__":
    Path(sys.argv[2]).write_text(json.dumps(_run(json.loads(Path(sys.argv[1]).read_text()))))
