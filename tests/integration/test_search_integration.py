"""Model-based search with pruning (engine/sweep/search.py) on the digits MLP: an Optuna study
in the sweep directory's SQLite database, pruned trials stopped early, a killed sweep
resuming its study, two sweep processes sharing one study without running a trial twice.
And `launch.py plan --search`'s candidates (engine/plan/layouts.py): the attention, remat and
loss-chunk variants a family supports, their overrides, and the order they are compiled in."""

import pytest
from support.configs import TINY_LLAMA
from support.search import plan_config

from engine.plan import layouts
from engine.plan.tpu import parse_target


def twins(screened, key: str) -> list[tuple[int, ...]]:
    """Pairs of positions in `screened` whose candidates differ only in `key` (attention or loss_chunk)."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(screened):
        rest = {"mesh": tuple(c.mesh.items()), "remat": c.remat, "accum": c.accum}
        rest |= {"attention": c.attention, "loss_chunk": c.loss_chunk}
        del rest[key]
        groups.setdefault(tuple(rest.values()), []).append(i)
    return [tuple(group) for group in groups.values() if len(group) == 2]


def test_the_screen_orders_splash_and_the_auto_loss_chunk_first_and_xla_without_remat_after_what_fits(tmp_path):
    """At seq 8192 on v5e chips (16 GiB), XLA attention's scores of 8 sequences per chip are
    ~17 GB: remat none with XLA attention and one micro-batch is estimated past the chip and
    ordered after every candidate estimated to fit; splash and the auto loss chunk go first.
    (Shapes only: no model is compiled; the data and state plans jit a few tiny CPU helpers.)"""
    pytest.importorskip("libtpu", reason="the TPU compiler (libtpu) describes the target's devices")
    cfg, _ = plan_config(
        tmp_path,
        "mnist_mlp.yaml",
        *TINY_LLAMA,
        "data.seq_len=8192",
        "data.num_examples=64",
        "train.global_batch_size=32",
    )
    found, screened = layouts.screen(cfg, parse_target("v5e-4"))
    assert screened and len(found) == len(screened)  # (every layout's state fits a chip)
    first = screened[0]
    assert (first.kernel, first.remat, first.loss_chunk, first.accum) == ("splash", "none", 0, 1)
    limit = layouts.ESTIMATE_MARGIN * 16 * 2**30
    fitting = [i for i, c in enumerate(screened) if c.state_bytes + c.activation_bytes <= limit]
    assert fitting == list(range(len(fitting))) and len(fitting) < len(screened)  # the estimated fits first
    kernels = [c.kernel for c in screened[: len(fitting)]]
    assert kernels.index("xla") > len(kernels) - 1 - kernels[::-1].index("splash")  # splash, then XLA
    for key in ("attention", "loss_chunk"):  # where both twins fit by the estimate: auto (splash), then the other
        pairs = [pair for pair in twins(screened, key) if max(pair) < len(fitting)]
        assert pairs and all(getattr(screened[a], key) in ("auto", 0) for a, _ in pairs), key
    slowest = [c for c in screened if (c.kernel, c.remat, c.accum) == ("xla", "none", 1) and c.mesh["context"] == 1]
    assert slowest and all(c.activation_bytes > 16 * 2**30 and screened.index(c) >= len(fitting) for c in slowest)
    assert max(c.activation_bytes for c in screened if c.kernel == "splash" and c.accum == 1) < 2**30
