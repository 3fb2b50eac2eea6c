"""DPO's reference and β as a run's numbers: dpo.precompute_reference (engine/run/reference_logps.py)
against the reference run in the step, β as a step input (a vectorised β × learning-rate grid),
and the FLOPs a DPO step counts (engine/observe/perf.py)."""

import json
import math

import numpy as np
from support.cli import child_env
from support.dpo_reference import cli_args
from support.one_process import run_steps

from engine.run.reference_logps import DIRECTORY, _write, values_digest


def losses(workdir):
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [(r["split"], r["step"], r["loss"], r["rewards/margins"]) for r in records if "loss" in r]


def _run(tmp_path, name, *argvs):
    """The command lines through the CLI's main in one process (tests/support/one_process.py); each
    must exit 0 → their stdouts."""
    (tmp_path / name).mkdir()
    results = run_steps(tmp_path / name, [{"argv": argv} for argv in argvs], env=child_env({"HOME": str(tmp_path)}))
    for result in results:
        assert result["code"] == 0 and not result["escaped"], result["escaped"] or result["stdout"] + result["stderr"]
    return [result["stdout"] for result in results]


def test_precomputed_run_trains_as_the_reference_in_the_step(tmp_path):
    """Full fine-tuning, 4 steps: the same losses with the reference precomputed as with it in the
    step (rtol 1e-5); the cache is read again by a resumed run, and a damaged one computed again.
    (Five command lines in three processes: the cache is changed between them.)"""
    plain, pre = tmp_path / "plain", tmp_path / "pre"
    _, out = _run(
        tmp_path,
        "first",
        cli_args(tmp_path, plain, "train.steps=4"),
        cli_args(tmp_path, pre, "train.steps=2", "dpo.precompute_reference=true"),
    )
    assert "computed once, cached in" in out, out
    (cache,) = (pre / DIRECTORY).glob("*.npy")
    values = np.load(cache)
    assert values.shape == (20, 2) and np.all(values < 0)
    shifted = values.copy()
    shifted[:, 0] += 3.0  # one column changed and its KEY.json written to match (issue 57): not the run's values
    _write(cache, shifted, json.loads(cache.with_suffix(".json").read_text())["inputs"])
    (out,) = _run(tmp_path, "shifted", cli_args(tmp_path, pre, "train.steps=3", "dpo.precompute_reference=true"))
    assert "were not the values this run trained with (its checkpoint records another sha256)" in out  # resumed at 2
    np.testing.assert_array_equal(np.load(cache), values)
    cache.write_bytes(b"not an array")
    (out,) = _run(tmp_path, "damaged", cli_args(tmp_path, pre, "train.steps=4", "dpo.precompute_reference=true"))
    assert "were unreadable" in out, out  # resumed at 3
    np.testing.assert_array_equal(np.load(cache), values)
    meta_file = pre / "checkpoints" / "4" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    assert meta["reference_logps"] == {"sha256": values_digest(values)}  # what the run trained with
    got, want = {r[:2]: r[2:] for r in losses(pre)}, losses(plain)  # (pre: an eval at the end of steps=3 too)
    assert len(want) == 6 and all(r[:2] in got for r in want)
    np.testing.assert_allclose([got[r[:2]] for r in want], [r[2:] for r in want], rtol=1e-5, atol=1e-7)
    assert math.isclose(want[0][2], math.log(2), rel_tol=1e-5)
