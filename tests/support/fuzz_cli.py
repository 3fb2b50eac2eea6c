"""Runs command lines through the engine's `main` in this one process (jax imported once) and
records, for each, its exit code, its stderr and any exception that escaped `main` (what a
user would see as a traceback). Used by tests/e2e/test_fuzz_inputs.py and the other tests of bad
input that check many command lines at the cost of one process (run_in_one_process):

    python tests/support/fuzz_cli.py CASES.json RESULTS.json
"""

import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def run_in_one_process(tmp_path: Path, cases: list[dict], timeout: int = 600, env: dict | None = None) -> list[dict]:
    """Each case's (a dict with its "argv") exit code, stderr, stdout and any escaped exception, all run by
    this script in one fresh process (env: its environment; PATH and HOME=tmp_path unless given)."""
    import subprocess

    cases_file, results_file = tmp_path / "cases.json", tmp_path / "results.json"
    cases_file.write_text(json.dumps(cases))
    if env is None:
        env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), str(cases_file), str(results_file)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(results_file.read_text())


def refused_in_one_line(result: dict, *words: str) -> None:
    """The case ended with exit 2 and one line of stderr naming each of `words`, no traceback."""
    where = f"{result['argv'][:3]}: {result['escaped'] or result['stderr'][-2000:]}"
    assert result["code"] == 2 and not result["escaped"] and "Traceback" not in result["stderr"], where
    assert len(result["stderr"].strip().splitlines()) == 1, where
    for word in words:
        assert word in result["stderr"], (word, where)


def run_cases(cases: list[dict]) -> list[dict]:
    from engine.cli import main

    results = []
    for case in cases:
        err, out = io.StringIO(), io.StringIO()
        escaped = ""
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(case["argv"])
            except SystemExit as e:  # argparse's own usage errors
                code = e.code if isinstance(e.code, int) else 2
            except BaseException as e:  # noqa: BLE001 - recorded: the test fails on any
                code, escaped = -1, f"{type(e).__name__}: {e}"[:500]
        results.append(
            {
                **case,
                "code": code,
                "stderr": err.getvalue()[-2000:],
                "stdout": out.getvalue()[-2000:],
                "escaped": escaped,
            }
        )
    return results


if __name__ == "__main__":
    cases = json.loads(Path(sys.argv[1]).read_text())
    Path(sys.argv[2]).write_text(json.dumps(run_cases(cases)))
