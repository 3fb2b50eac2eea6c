"""`launch.py sample`'s two generation paths on a run's checkpoint, timed interleaved: the compiled
decode (engine/hub/generate.py compiled_samples over engine/lm/rollouts.py: one program, the token
loop on the device), which serves every request without stop strings, and the family's stepwise
generator (models/sampling.py generate: a jitted prefill and step, a host sync per token), which
serves `--stop`. Each call compiles its programs, as each `sample` command does: the seconds are the
wall a user waits for the tokens (not the run's setup or checkpoint restore, the same for both).
Greedy; every row runs to --max-tokens (no end-of-text stop), so both make the same tokens: the
script checks they are equal.

    python benchmarks/sample_paths.py --workdir runs/chat_sft_short --rows 8 --max-tokens 48 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="runs/chat_sft_short")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()

    import jax

    from engine.checkpoint.store import restore_newest
    from engine.data.recorded import recorded_shape
    from engine.hub.generate import _decoder, compiled_samples
    from engine.hub.inference import run_config
    from engine.lm import rollouts
    from engine.run.setup import build_run
    from engine.state.train_state import model_variables
    from models import sampling

    cfg = run_config(Path(args.workdir))
    run = build_run(cfg, compile_train=False, dataset=recorded_shape(cfg))
    restored = restore_newest(Path(args.workdir), run.abstract_state, cfg, "sample from", None)
    params = model_variables(restored.state.params, restored.state.model_state)["params"]
    decoder = _decoder(cfg, run, jax.tree.leaves(params)[0].dtype, adapted=True)
    vocab = run.dataset.info.vocab_size
    # prompts of different lengths (the longest --prompt-tokens), ids the model has
    prompts = [[(7 * r + 3 * i) % (vocab - 1) + 1 for i in range(args.prompt_tokens - r % 4)] for r in range(args.rows)]
    settings = (args.max_tokens, 0.0, 1.0, 0)
    # the compiled decode's program compiled once and called again: the token loop alone
    spec = rollouts.DecodeSpec(args.prompt_tokens, args.max_tokens, 1.0, 1.0, 1)
    program = rollouts.build_decode(decoder, spec, params, len(prompts))
    padded = rollouts.left_pad(prompts, args.prompt_tokens)

    def reused() -> list[list[int]]:
        out = jax.device_get(program(params, *padded, jax.random.key(0)))
        return [row[keep].tolist() for row, keep in zip(out.completion_tokens, out.completion_mask)]

    paths = {
        "compiled decode (sample's path: compiled in the call)": lambda: compiled_samples(
            decoder, params, prompts, *settings, (), 1
        ),
        "stepwise generate (sample --stop's path: compiled in the call)": lambda: sampling.generate(
            decoder, params, prompts, *settings
        ),
        "compiled decode, its program reused (the token loop alone)": reused,
    }
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    outputs = {}
    for _ in range(args.reps):
        for name, call in paths.items():
            started = time.perf_counter()
            outputs[name] = call()
            seconds[name].append(time.perf_counter() - started)
    first = list(outputs.values())
    same = all(out == first[0] for out in first)
    tokens = sum(map(len, first[0]))
    print(f"{args.rows} rows, prompts of up to {args.prompt_tokens} tokens, {args.max_tokens} new tokens each")
    print(f"greedy tokens equal: {same}; compiling the decode program once took {program.compile_seconds:.2f} s")
    print("| path | tokens/s (median) | seconds (median, min-max) |")
    print("|---|---|---|")
    for name, times in seconds.items():
        median = statistics.median(times)
        print(f"| {name} | {tokens / median:,.0f} | {median:.2f} ({min(times):.2f}-{max(times):.2f}) |")
    if not same:
        sys.exit("the paths' greedy tokens differ")


if __name__ == "__main__":
    main()
