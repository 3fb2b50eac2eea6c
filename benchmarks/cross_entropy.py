"""Cross-entropy memory and speed: optax on full logits against the engine's fused loss.

Builds the transformer of the engine (models/transformer.py) at the given size and
compiles, for one batch of random tokens, the gradient of the mean next-token loss three
ways:

  optax     logits from the model (compute dtype), cast to float32, then
            `optax.softmax_cross_entropy_with_integer_labels`: what a hand-written loop
            does, and what the engine did before the fused loss.
  fused     `model.loss_chunk=0`: the output matmul writes float32 logits once and the
            backward pass makes the logits' gradient from them in one fusion.
  chunked   `model.loss_chunk=N`: N positions at a time, logits recomputed in the
            backward pass.

It prints XLA's estimate of each compiled program's temporary memory
(`compiled.memory_analysis().temp_size_in_bytes`), the size of one float32 logits array
for reference, and the median time of a gradient evaluation on this machine.

    python benchmarks/cross_entropy.py                                    # vocab 8192, seq 256
    python benchmarks/cross_entropy.py --vocab 32768 --dtype bfloat16 --chunk 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.data import DataInfo  # noqa: E402
from engine.parallel.sharding import unbox  # noqa: E402
from models.transformer import TransformerConfig, build  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=32, help="model.loss_chunk of the chunked variant")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype")
    parser.add_argument("--reps", type=int, default=5, help="timed gradient evaluations per variant")
    args = parser.parse_args()

    info = DataInfo("tokens", args.batch, args.batch, vocab_size=args.vocab, seq_len=args.seq)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.seq + 1)), jnp.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits_bytes = args.batch * args.seq * args.vocab * 4
    print(
        f"transformer d_model={args.d_model} num_layers={args.num_layers}, vocab {args.vocab}, batch {args.batch} "
        f"x {args.seq} tokens, compute {args.dtype}, 1 {jax.devices()[0].platform} device; one float32 logits "
        f"array is {logits_bytes / 2**20:.1f} MiB"
    )
    print(f"{'loss':<28}{'temporaries (MiB)':>18}{'grad time (ms)':>16}")
    for name, chunk, fused in (
        ("optax on float32 logits", 0, False),
        ("fused (loss_chunk=0)", 0, True),
        (f"chunked (loss_chunk={args.chunk})", args.chunk, True),
    ):
        cfg = TransformerConfig(
            num_layers=args.num_layers,
            d_model=args.d_model,
            num_heads=4,
            mlp_dim=4 * args.d_model,
            dropout_rate=0.0,
            loss_chunk=chunk,
        )
        module = build(cfg, info, jnp.dtype(args.dtype), jnp.float32)
        variables = unbox(module.init(jax.random.key(0), inputs, train=False))

        def loss(variables, module=module, fused=fused):
            if fused:
                return module.apply(variables, inputs, train=False, targets=targets)[0].mean()
            logits = module.apply(variables, inputs, train=False).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        compiled = jax.jit(jax.grad(loss)).lower(variables).compile()
        jax.block_until_ready(compiled(variables))
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            jax.block_until_ready(compiled(variables))
            times.append(time.perf_counter() - start)
        temporaries = compiled.memory_analysis().temp_size_in_bytes
        print(f"{name:<28}{temporaries / 2**20:>18.1f}{statistics.median(times) * 1e3:>16.1f}")


if __name__ == "__main__":
    main()
