"""Bad command lines, many at the cost of one process: run_in_one_process runs them through the
engine's `main` one after another in one fresh process (tests/support/one_process.py), and
refused_in_one_line checks a refusal as a user sees it."""

from pathlib import Path

from support.one_process import run_steps


def run_in_one_process(tmp_path: Path, cases: list[dict], timeout: int = 600, env: dict | None = None) -> list[dict]:
    """Each case's (a dict with its "argv") exit code, stderr, stdout and any escaped exception, all
    run in one fresh process (env: its environment; PATH and HOME=tmp_path, so no sbatch, unless given)."""
    import sys

    if env is None:
        env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    return run_steps(tmp_path, cases, env, timeout)


def refused_in_one_line(result: dict, *words: str) -> None:
    """The case ended with exit 2 and one line of stderr naming each of `words`, no traceback."""
    where = f"{result['argv'][:3]}: {result['escaped'] or result['stderr'][-2000:]}"
    assert result["code"] == 2 and not result["escaped"] and "Traceback" not in result["stderr"], where
    assert len(result["stderr"].strip().splitlines()) == 1, where
    for word in words:
        assert word in result["stderr"], (word, where)
