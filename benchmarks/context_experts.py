"""Context and expert parallelism on 8 simulated CPU devices, from the compiled step alone.

1. Per-device memory against sequence length at mesh.context = 1, 2, 4, 8: XLA's memory
   estimate of the compiled train step (arguments + temporaries, per device) of a Llama of
   4 layers, d_model 256, 8 query / 2 key-value heads, batch 1 sequence, for each length.
   `mesh.num_devices` = the context size (one sequence; no data parallelism).
2. Collective bytes per step of `mesh.context=8` and `mesh.expert=8` (a top-2-of-8 MoE)
   against the theoretical minimum of each layout (see `minimum_*` below), counted as in
   benchmarks/collectives.py (engine/plan/hlo.py): an op inside the scanned layer counts once,
   so both sides count one layer's traffic plus what runs outside the layer loop.

    python benchmarks/context_experts.py [--lengths 1024 2048 4096 8192] [--contexts 1 2 4 8]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import argparse  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.config import load_config  # noqa: E402
from engine.errors import UsageError  # noqa: E402
from engine.plan.hlo import hlo_collectives  # noqa: E402
from engine.run.setup import build_run  # noqa: E402
from engine.runtime.units import human_bytes  # noqa: E402

MODEL = [
    "model.name=llama",
    "data.name=synthetic_text",
    "data.vocab_size=512",
    "model.num_layers=4",
    "model.d_model=256",
    "model.num_heads=8",
    "model.num_kv_heads=2",
    "model.mlp_dim=512",
    "log.progress=false",
    "log.tensorboard=false",
    "train.steps_per_call=1",
    "data.eval_fraction=0.25",
]


def build(overrides: list[str]):
    with tempfile.TemporaryDirectory() as workdir:
        return build_run(load_config(ROOT / "configs" / "mnist_mlp.yaml", MODEL + overrides, workdir))


def memory_table(lengths: list[int], contexts: list[int]) -> None:
    print("per-device memory of the compiled step (arguments + temporaries), batch 1 sequence")
    print(f"{'seq_len':>8}" + "".join(f"{f'context={c}':>16}" for c in contexts) + f"{'1 / max':>10}")
    for length in lengths:
        cells = []
        for context in contexts:
            try:
                run = build(
                    [
                        f"data.seq_len={length}",
                        "data.num_examples=4",
                        "train.global_batch_size=1",
                        f"mesh.num_devices={context}",
                        "mesh.data=1",
                        f"mesh.context={context}",
                    ]
                )
            except UsageError as error:
                cells.append(None)
                print(f"  ({error})")
                continue
            memory = run.compiled.memory
            cells.append(memory.argument_size_in_bytes + memory.temp_size_in_bytes)
        ratio = cells[0] / cells[-1] if cells[0] and cells[-1] else float("nan")
        print(f"{length:>8}" + "".join(f"{human_bytes(c) if c else '-':>16}" for c in cells) + f"{ratio:>9.2f}x")


def gradient_bytes(run, keep=lambda layout: True) -> float:
    """Bytes of the gradients all-reduced over the batch split, as the program text counts
    them: a scanned layer's once (its share of the stacked parameters), the rest whole."""
    return sum(
        p.nbytes / (p.shape[0] if p.logical[:1] == ("layers",) else 1) for p in run.model.param_layouts if keep(p)
    )


def minimum_context(run) -> float:
    """The keys and values of the whole sequence gathered on every device (once per layer,
    forward; the backward may recompute or reduce them), plus every gradient summed over
    the devices that split the sequence (1 x P)."""
    cfg, info = run.cfg, run.dataset.info
    kv = 2 * cfg.train.global_batch_size * info.seq_len * cfg.model.kv_heads * cfg.model.head_width * 4
    return kv + gradient_bytes(run)


def minimum_expert(run) -> float:
    """Tokens to their experts and back, forward and backward: 4 all-to-alls of this
    device's share of the dispatched buffer [batch, experts, capacity, d_model] per MoE
    layer; plus the all-reduce of the gradients of everything but the experts (1 x P)."""
    from models.moe import expert_capacity

    cfg, info = run.cfg, run.dataset.info
    capacity = expert_capacity(cfg.model, info.seq_len)
    dispatched = cfg.train.global_batch_size * cfg.model.num_experts * capacity * cfg.model.d_model * 4
    return 4 * dispatched / run.mesh.size + gradient_bytes(run, lambda p: "expert" not in p.logical)


def collectives_table() -> None:
    print("\ncollective bytes per step (one scanned layer + the rest), against the layout's minimum")
    layouts = {
        "context=8 (seq 2048, batch 1)": (
            ["data.seq_len=2048", "data.num_examples=4", "train.global_batch_size=1", "mesh.data=1", "mesh.context=8"],
            minimum_context,
        ),
        "expert=8 (top-2 of 8, seq 256, batch 8)": (
            [
                "data.seq_len=256",
                "data.num_examples=32",
                "train.global_batch_size=8",
                "mesh.data=1",
                "mesh.expert=8",
                "model.num_experts=8",
                "model.experts_per_token=2",
            ],
            minimum_expert,
        ),
    }
    for name, (overrides, minimum) in layouts.items():
        run = build(overrides)
        found = hlo_collectives(run.compiled.program.as_text(), run.mesh.size)
        kinds: dict[str, int] = {}
        for c in found:
            kinds[c.op] = kinds.get(c.op, 0) + c.bytes
        total, least = sum(kinds.values()), minimum(run)
        detail = ", ".join(f"{op} {human_bytes(b)}" for op, b in sorted(kinds.items()))
        print(f"{name}: {human_bytes(total)} ({detail}); minimum {human_bytes(least)}; ratio {total / least:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    memory_table(args.lengths, args.contexts)
    collectives_table()


if __name__ == "__main__":
    main()
