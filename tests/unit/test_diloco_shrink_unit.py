"""DiLoCo onto fewer replicas (engine/parallel/diloco_shrink.py): a mid-round checkpoint of 4 replicas
restored onto 3 keeps the global parameters, the outer momentum and the pending change, goes back
to the round's start with every replica at the global parameters and the replicas' mean inner
optimizer state; the run goes on from there; the elastic plan refuses a job left with one replica."""

import pytest

from engine.config import load_config
from engine.elastic.shrink import shrink_plan


@pytest.mark.nocompile
def test_the_elastic_plan_keeps_two_replicas_or_refuses():
    def plan(*overrides):
        args = ["train.sync=diloco", "diloco.replica_axis=data", "train.global_batch_size=48", "fault.elastic=true"]
        return shrink_plan(load_config("configs/mnist_mlp.yaml", [*args, *overrides]), 4, 1)

    assert plan("fault.min_processes=2") == {2: [], 3: []}
    with pytest.raises(ValueError, match="a job of 1 processes would hold 1 replica"):
        plan()
