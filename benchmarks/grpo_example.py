"""The post-training example's GRPO task (configs/chat_grpo.yaml) with the engine's GRPO pieces driven
by this script: the rollout batch (engine/objectives/grpo_rollout.py: the compiled decode, the reward
functions, the group advantages) and the update's loss (engine/objectives/grpo.py), LoRA on the short
SFT run's frozen base, until the training run drives them (docs/design/grpo.md section 7). Prints
the held-out reward (exact answers of 4 samples at temperature 1 of each of the 200 held-out prompts)
before and after, and the seconds spent sampling and updating.

    python -m engine.data.chat_example runs/chat_example
    python launch.py --config configs/chat_sft.yaml train.steps=100 --workdir runs/chat_sft_short
    python benchmarks/grpo_example.py --steps 120 --lr 1e-3 --prompts 16 --generations 8
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.checkpoint.store import load_base  # noqa: E402
from engine.config import load_config  # noqa: E402
from engine.data.prompts import fit_prompts  # noqa: E402
from engine.data.sources import load_dataset  # noqa: E402
from engine.hub.generate import _decoder  # noqa: E402
from engine.lm import finetune, rollouts  # noqa: E402
from engine.lm.rewards import extracted_answer, load_rewards  # noqa: E402
from engine.objectives.grpo import make_grpo_loss_fn  # noqa: E402
from engine.objectives.grpo_rollout import rollout_batch  # noqa: E402
from engine.run.setup import build_run  # noqa: E402
from engine.state.train_state import FROZEN, model_variables  # noqa: E402

PROMPT, COMPLETION, HELD_SAMPLES = 16, 12, 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--example", default="runs/chat_example")
    parser.add_argument("--base", default="runs/chat_sft_short")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--rank", type=int, default=8)
    args = parser.parse_args()
    d, generations = args.example, args.generations
    keys = [f"data.path={d}/chat_train.jsonl", f"data.eval_path={d}/chat_eval.jsonl", f"data.tokenizer={d}"]
    keys += [f"finetune.base={args.base}", f"finetune.lora.rank={args.rank}", "finetune.lora.targets=[all]"]
    keys += ["eval.generate.num_prompts=0", "train.steps_per_call=1"]
    cfg = load_config("configs/chat_sft.yaml", keys, workdir="/tmp/grpo_example_workdir")
    run = build_run(cfg, compile_train=False)
    state = finetune.with_frozen(
        run.init_state(), load_base(finetune.base_weights(cfg), run.abstract_state.model_state[FROZEN])
    )
    prompts_keys = [f"data.path={d}/prompts_train.jsonl", f"data.eval_path={d}/prompts_eval.jsonl"]
    prompts_keys += ["data.name=prompts", f"data.tokenizer={d}", "train.objective=grpo"]
    pcfg = load_config("configs/chat_sft.yaml", [*prompts_keys, "grpo.rewards=[engine.lm.rewards:exact_match]"])
    data = fit_prompts(load_dataset(pcfg.data), PROMPT, COMPLETION)
    grpo = types.SimpleNamespace(
        **{**vars(pcfg.grpo), "num_generations": generations, "max_completion_tokens": COMPLETION, "beta": args.beta}
    )
    tokenizer = Tokenizer.from_file(f"{d}/tokenizer.json")
    spec = rollouts.DecodeSpec(PROMPT, COMPLETION, temperature=1.0, stop_ids=(tokenizer.token_to_id("<|im_end|>"),))
    decoder = _decoder(cfg, run, jnp.float32, adapted=True)
    first = model_variables(state.params, state.model_state)["params"]
    decode = rollouts.build_decode(decoder, spec, first, args.prompts * generations)
    held = data.eval
    held_decode = rollouts.build_decode(decoder, spec, first, len(held["record_index"]) * HELD_SAMPLES)
    answers = [data.records[1][i].fields["answer"] for i in np.repeat(held["record_index"], HELD_SAMPLES)]

    def held_out_reward(params) -> float:
        rows = {k: np.repeat(held[k], HELD_SAMPLES, axis=0) for k in ("prompt_tokens", "prompt_mask")}
        out = jax.device_get(held_decode(params, rows["prompt_tokens"], rows["prompt_mask"], jax.random.key(99)))
        tokens, mask = np.asarray(out.completion_tokens), np.asarray(out.completion_mask)
        texts = [tokenizer.decode(row[keep].tolist()) for row, keep in zip(tokens, mask)]
        return float(np.mean([extracted_answer(text) == answer for text, answer in zip(texts, answers)]))

    loss_fn = make_grpo_loss_fn(run.model.module, grpo)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.0))
    hparams = {"grpo_beta": jnp.float32(args.beta)}

    @jax.jit
    def update(params, opt_state, batch):
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (_, (metrics, _)), grads = grad_fn(params, state.model_state, batch, None, True, hparams)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    params, opt_state = state.params, tx.init(state.params)
    rewards = load_rewards(list(pcfg.grpo.rewards), "grpo.rewards")
    start = time.time()
    print(f"held-out reward before: {held_out_reward(first):.4f}", flush=True)
    order = np.random.default_rng(0).permutation(len(data.train["record_index"]))
    sampling = updating = 0.0
    for step in range(args.steps):
        rows = order[step * args.prompts : (step + 1) * args.prompts]
        prompts = {k: v[rows] for k, v in data.train.items()}
        began = time.time()
        variables = model_variables(params, state.model_state)["params"]
        batch, metrics = rollout_batch(
            decode, variables, prompts, jax.random.key(1000 + step), data.records[0], rewards, tokenizer.decode, grpo
        )
        sampled = time.time()
        params, opt_state, _ = update(params, opt_state, {k: jnp.asarray(v) for k, v in batch.items()})
        jax.block_until_ready(params)
        sampling, updating = sampling + sampled - began, updating + time.time() - sampled
        if step % 10 == 0 or step == args.steps - 1:
            zero = metrics["frac_reward_zero_std"]
            print(f"step {step}: reward {metrics['reward']:.3f}, frac_reward_zero_std {zero:.3f}", flush=True)
    after = held_out_reward(model_variables(params, state.model_state)["params"])
    seconds = f"{time.time() - start:.0f} s ({sampling:.0f} s sampling, {updating:.0f} s updating)"
    print(f"held-out reward after: {after:.4f}; {seconds}")


if __name__ == "__main__":
    main()
