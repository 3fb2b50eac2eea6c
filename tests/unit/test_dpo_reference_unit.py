"""DPO's reference and β as a run's numbers: dpo.precompute_reference (engine/run/reference_logps.py)
against the reference run in the step, β as a step input (a vectorised β × learning-rate grid),
and the FLOPs a DPO step counts (engine/observe/perf.py)."""

import json

import numpy as np
import pytest

from engine.errors import UsageError
from engine.run.reference_logps import _read, _write, check_trained, values_digest


@pytest.mark.nocompile
def test_the_reference_cache_is_read_only_with_the_checksum_it_was_written_with(tmp_path):
    """KEY.json beside KEY.npy: a column shifted by 3.0, one flipped bit, or no KEY.json is not
    read (computed again, with a note); a resumed run's values must be the ones it trained with."""
    rng = np.random.default_rng(0)
    values = -rng.uniform(1, 30, (12, 2)).astype(np.float32)
    path = tmp_path / "0123.npy"
    _write(path, values, {"pairs": "abc"})
    read, problem = _read(path, 12)
    np.testing.assert_array_equal(read, values)
    assert problem == "" and json.loads(path.with_suffix(".json").read_text())["inputs"] == {"pairs": "abc"}
    shifted = values.copy()
    shifted[:, 1] += 3.0
    flipped = values.copy()
    flipped.view(np.uint32)[5, 0] ^= 1 << 23  # an exponent bit: a finite value of another size
    for damaged in (shifted, flipped):
        np.save(path, damaged)
        assert _read(path, 12) == (
            None,
            f"not the values written (their sha256 is not the one {path.with_suffix('.json')} records)",
        )
    _write(path, values, {})
    path.with_suffix(".json").unlink()
    read, problem = _read(path, 12)
    assert read is None and problem.startswith("without a readable checksum")
    check_trained(values, values_digest(values), path)  # (the values trained with: nothing to say)
    check_trained(values, "", path)  # (a run from before the record)
    with pytest.raises(UsageError, match=f"{path} does not hold the reference log-probabilities this run trained"):
        check_trained(shifted, values_digest(values), path)
