"""Runs command lines through the engine's `main` in this one process (jax imported once) and
records, for each, its exit code, its stderr and any exception that escaped `main` (what a
user would see as a traceback). Used by tests/e2e/test_fuzz_inputs.py:

    python tests/fuzz_cli.py CASES.json RESULTS.json
"""

import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run_cases(cases: list[dict]) -> list[dict]:
    from engine.cli import main

    results = []
    for case in cases:
        err = io.StringIO()
        escaped = ""
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                code = main(case["argv"])
            except SystemExit as e:  # argparse's own usage errors
                code = e.code if isinstance(e.code, int) else 2
            except BaseException as e:  # noqa: BLE001 - recorded: the test fails on any
                code, escaped = -1, f"{type(e).__name__}: {e}"[:500]
        results.append({**case, "code": code, "stderr": err.getvalue()[-2000:], "escaped": escaped})
    return results


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run_cases(cases)))
