"""GRPO's rollout decode (engine/lm/rollouts.py) against Hugging Face transformers' `generate` on
the same tiny Llama, batch and lengths, on this CPU.

The model: a random Llama (`--layers` 4, `--d-model` 256, 8 query / 4 key-value heads, MLP 688,
vocabulary 4096, float32), its weights written in Hugging Face's layout (models/llama_hf.py) and
loaded by `LlamaForCausalLM.from_pretrained`, so both sides run the same weights. The work:
`--batch` prompts of `--prompt` tokens each, `--completion` new tokens per row drawn at
temperature 1 without top-k / top-p and without stopping (transformers: min_new_tokens =
max_new_tokens), the prefill included. Rows:

  rollouts         build_decode's program (compiled once, before the timing: its compile seconds
                   reported apart), one call per repetition, the loop on the device.
  sample_generate  models/sampling.py `generate` (`launch.py sample`'s path): a Python loop of
                   jitted steps, one host sync per token, compiled again in every call (as a
                   user sees it: the call's wall time, its compiles included).
  transformers     `model.generate(...)` under torch.inference_mode with a key/value cache.

Repetitions interleave (rollouts, sample_generate, transformers, rollouts, ...); each row reports
its median tokens/s (batch × completion / seconds). The transformers side needs torch and
transformers (the optional `hf` extra); without them it is left out, with a line saying so.
`--site DIR` (repeatable) appends a directory with them to sys.path (after the engine's own);
`--torch-threads N` sets torch's intra-op threads (on a busy 2-core machine torch's default of 2
spin-waits: 1 thread ran its matmuls ~10x faster here).

    python benchmarks/sampler.py [--batch 8 --prompt 32 --completion 64 --reps 5] [--site DIR] [--torch-threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def model(args):
    """(config, DataInfo, training module, decoding module, params) of the random tiny Llama."""
    import jax
    import jax.numpy as jnp

    from engine.data import DataInfo
    from engine.parallel.sharding import unbox
    from models import REGISTRY
    from models.configs import LlamaConfig

    cfg = LlamaConfig(
        num_layers=args.layers, d_model=args.d_model, num_heads=8, num_kv_heads=4, mlp_dim=688, rope_theta=10000.0
    )
    info = DataInfo("tokens", 8, 8, vocab_size=args.vocab, seq_len=args.prompt + args.completion)
    family = REGISTRY["llama"]
    module = family.build(cfg, info, jnp.float32, jnp.float32)
    decoder = family.build(cfg, info, jnp.float32, jnp.float32, decode=True)
    params = unbox(module.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32), train=False))["params"]
    return cfg, info, module, decoder, params


def write_hf(directory: Path, cfg, info, params) -> None:
    """params in Hugging Face's layout: config.json and model.safetensors."""
    import numpy as np
    from safetensors.numpy import save_file

    from models import llama_hf

    (directory / "config.json").write_text(json.dumps(llama_hf.config_to_hf(cfg, info)))
    tensors = {}
    for tensor in llama_hf.tensors(cfg):
        value = params
        for key in tensor.path:
            value = value[key]
        value = np.asarray(value)
        for i, name in enumerate(tensor.names):
            tensors[name] = np.ascontiguousarray(tensor.to_hf(value[i] if tensor.stacked else value))
    save_file(tensors, str(directory / "model.safetensors"))


def transformers_side(directory: Path, prompts, completion: int, threads: int):
    """A timed `generate` of the prompts, or None (and why) without torch/transformers."""
    try:
        import torch
        from transformers import LlamaForCausalLM
    except ImportError as e:
        return None, f"transformers side left out: {e}"
    if threads:
        torch.set_num_threads(threads)
    reference = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.as_tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    settings = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=completion)
    settings.update(min_new_tokens=completion, pad_token_id=0)

    def run() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = reference.generate(input_ids=ids, attention_mask=mask, **settings)
        assert out.shape == (len(prompts), ids.shape[1] + completion), out.shape
        return time.perf_counter() - start

    run()  # warm-up
    return run, f"torch {torch.__version__}, {torch.get_num_threads()} threads"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--completion", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--site", action="append", default=[], help="a directory with torch and transformers")
    parser.add_argument("--torch-threads", type=int, default=0, help="torch's intra-op threads (0: its default)")
    args = parser.parse_args()
    sys.path.extend(args.site)

    import jax
    import numpy as np

    from engine.lm import rollouts
    from models import sampling

    cfg, info, _, decoder, params = model(args)
    prompts = np.random.default_rng(0).integers(1, args.vocab, (args.batch, args.prompt)).astype(np.int32)
    spec = rollouts.DecodeSpec(args.prompt, args.completion, temperature=1.0)
    decode = rollouts.build_decode(decoder, spec, params, args.batch)
    tokens, mask = rollouts.left_pad(prompts.tolist(), args.prompt)
    keys = iter(range(1_000_000))

    def ours() -> float:
        start = time.perf_counter()
        jax.block_until_ready(decode(params, tokens, mask, jax.random.key(next(keys))))
        return time.perf_counter() - start

    def sample_generate() -> float:
        start = time.perf_counter()
        out = sampling.generate(decoder, params, prompts.tolist(), args.completion, 1.0, 1.0, seed=next(keys))
        assert all(len(row) == args.completion for row in out)
        return time.perf_counter() - start

    with tempfile.TemporaryDirectory() as directory:
        write_hf(Path(directory), cfg, info, params)
        theirs, note = transformers_side(Path(directory), prompts.tolist(), args.completion, args.torch_threads)
    ours()  # warm-up (the program is compiled already)
    sides = {"rollouts": ours, "sample_generate": sample_generate}
    if theirs is not None:
        sides["transformers"] = theirs
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.reps):
        for name, side in sides.items():
            seconds[name].append(side())
    tokens_made = args.batch * args.completion
    print(
        f"Llama {args.layers} layers, d_model {args.d_model}, vocab {args.vocab}; batch {args.batch}, prompt "
        f"{args.prompt}, completion {args.completion}; {args.reps} interleaved repetitions; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}; {note}; rollouts compiled once in {decode.compile_seconds:.1f} s"
    )
    print(f"{'side':<16} {'tokens/s (median)':>18} {'seconds (median)':>17} {'min':>7} {'max':>7}")
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"{name:<16} {tokens_made / median:>18.0f} {median:>17.3f} {min(times):>7.3f} {max(times):>7.3f}")
    record = {name: tokens_made / statistics.median(times) for name, times in seconds.items()}
    print(json.dumps({"tokens_per_sec": record, "compile_seconds": decode.compile_seconds}))


if __name__ == "__main__":
    main()
