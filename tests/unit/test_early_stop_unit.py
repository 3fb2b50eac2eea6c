"""The best checkpoint (checkpoint.keep_best, export/sample --step best) and early stopping
(train.early_stop): what is kept, where a run ends, and that a resumed run decides as an
unbroken one."""

import pytest

from engine.errors import UsageError
from engine.run.best import Watched


@pytest.mark.nocompile
def test_watched_counts_evaluations_without_an_improvement_beyond_min_delta():
    """Keras's rule: an improvement beats the best so far (not the last value) by more than min_delta."""
    watched = Watched("train.early_stop.metric", "eval/loss", "min", min_delta=0.1)
    course = [(1.0, True), (0.95, False), (0.85, True), (0.8, False), (float("nan"), False), (0.76, False)]
    for step, (loss, improved) in enumerate(course, 1):
        assert watched.update({"loss": loss, "accuracy": 0.5}, step) == improved, step
    assert (watched.best, watched.step, watched.since) == (0.85, 3, 3)
    highest = Watched("checkpoint.keep_best", "eval/accuracy", "max")
    assert [highest.update({"accuracy": a}, s) for s, a in enumerate([0.5, 0.5, 0.6])] == [True, False, True]
    with pytest.raises(UsageError, match="eval/los is not an eval metric of this run; it records eval/loss"):
        Watched("checkpoint.keep_best", "eval/los", "min").update({"loss": 1.0}, 1)

    for patience in (0, 1, 2):  # a first evaluation (a new best) never ends the run; patience 0 acts as 1
        watched = Watched("train.early_stop.metric", "eval/loss", "min")
        ends = [watched.update({"loss": loss}, step) is None or watched.exhausted(patience) for step, loss in
                enumerate([1.0, 0.5, 0.7, 0.8], 1)]  # fmt: skip
        assert ends == [False, False, patience <= 1, True], patience
