"""GRPO with LoRA on the shipped post-training example: the engine against Hugging Face TRL's GRPOTrainer.

Workload: configs/chat_grpo.yaml as shipped (after configs/chat_sft.yaml for 100 steps): the
4-layer Llama of chat_sft.yaml (d_model 128), LoRA rank 8, alpha 16 on every projection, 16
prompts x 8 completions a step sampled at temperature 1 (at most 12 tokens, stopping at
<|im_end|>), the reward engine.lm.rewards:exact_match against each record's answer, group-scaled
advantages, loss_type dapo, epsilon 0.2, beta 0, one update per batch of rollouts, AdamW 1e-3
warmed up over 10 steps then cosine-decayed to 0.1 of it, weight decay 0.01, gradient norm clipped
at 1, 120 steps. TRL trains from the same SFT weights (exported with `launch.py export --format
hf`) on the same prompts (as one user message each, rendered with the same chat template) with a
PEFT LoRA of the same rank, alpha and targets, the same reward function and the same settings
(lr_scheduler_type cosine_with_min_lr at min_lr_rate 0.1), on torch (CPU, float32, no gradient
checkpointing). Rounds interleave (engine, TRL, engine, TRL, ...), each its own process.

Reported: seconds per step (the engine's `seconds/sampling` + `seconds/updating` records; TRL's
steps timed by a callback, its sampling being `_generate_and_score_completions`: generate, rewards,
advantages), and the held-out reward: the mean exact_match of 8 completions sampled at temperature
1 for each of the 200 held-out prompts (the engine's eval/reward; TRL's sampled with
transformers' generate after training, and once before it).

    python -m engine.data.chat_example DIR/chat_example
    python launch.py --config configs/chat_sft.yaml train.steps=100 --workdir DIR/chat_sft_short \\
        data.path=DIR/chat_example/chat_train.jsonl data.eval_path=DIR/chat_example/chat_eval.jsonl \\
        data.tokenizer=DIR/chat_example
    python benchmarks/grpo_trl.py --trl-python VENV/bin/python --dir DIR [--rounds 1] [--steps 120]

`--trl-python`: a Python with torch, transformers, peft, trl, datasets and this repository
installed (`pip install -e '.[hf]'`: the reward function is the engine's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, GENERATIONS, COMPLETION, RANK, ALPHA, LR, WARMUP, TEMPERATURE = 16, 8, 12, 8, 16, 1e-3, 10, 1.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the engine's "all"


def engine_round(work: Path, example: Path, sft: Path, steps: int) -> dict:
    """One engine run of configs/chat_grpo.yaml in its own process."""
    workdir = work / f"engine_{time.time_ns()}"
    cmd = [
        sys.executable, "launch.py", "--config", "configs/chat_grpo.yaml", f"workdir={workdir}", "log.progress=false",
        f"finetune.base={sft}", f"data.path={example / 'prompts_train.jsonl'}",
        f"data.eval_path={example / 'prompts_eval.jsonl'}", f"data.tokenizer={example}", f"train.steps={steps}",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"engine run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    evals = [r for r in rows if r["split"] == "eval"]
    summary = next(r for r in rows if r["split"] == "summary")
    sampling = statistics.mean(r["seconds/sampling"] for r in train)
    updating = statistics.mean(r["seconds/updating"] for r in train)
    return {
        "step_seconds": summary["mean_step_seconds"],
        "sampling_seconds": sampling,
        "updating_seconds": updating,
        "wall_seconds": wall,
        "train_seconds": summary["wall_seconds"],
        "reward_before": None,
        "reward_after": evals[-1]["reward"],
        "train_reward_last": train[-1]["reward"],
    }


def trl_round(work: Path, python: str, hf_dir: Path, example: Path, steps: int, threads: int) -> dict:
    """One TRL run in its own process (this file with --side trl under `python`)."""
    out = work / f"trl_{time.time_ns()}.json"
    cmd = [python, __file__, "--side", "trl", "--hf-dir", str(hf_dir), "--dir", str(example.parent), "--out", str(out)]
    cmd += ["--steps", str(steps), "--torch-threads", str(threads)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text()) | {"wall_seconds": wall}


def records(path: Path) -> list[dict]:
    """The example's prompts as TRL's conversational records (the engine renders a string prompt as
    one user message), with their answers for the reward."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in rows]


def held_out_reward(model, tokenizer, rows: list[dict], seed: int) -> float:
    """The mean exact_match of GENERATIONS completions at TEMPERATURE for each held-out prompt
    (batches of PROMPTS prompts, as the engine's eval/reward), sampled with transformers' generate."""
    import torch

    from engine.lm.rewards import exact_match

    torch.manual_seed(seed)
    model.eval()
    total, seen = 0.0, 0
    tokenizer.padding_side = "left"
    for begin in range(0, len(rows), PROMPTS):
        part = [r for r in rows[begin : begin + PROMPTS] for _ in range(GENERATIONS)]
        texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in part]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            ids = model.generate(
                **enc, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=COMPLETION,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        completions = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        rewards = exact_match(
            [r["prompt"] for r in part], [[{"role": "assistant", "content": c}] for c in completions],
            answer=[r["answer"] for r in part],
        )  # fmt: skip
        total += sum(rewards)
        seen += len(rewards)
    model.train()
    return total / seen


def trl_side(hf_dir: Path, example: Path, out: Path, steps: int, threads: int) -> None:
    """TRL's GRPOTrainer with a PEFT LoRA on the exported SFT weights; writes seconds per step (and
    the sampling part) and the held-out reward before and after to `out`."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    from engine.lm.rewards import exact_match

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.chat_template = (hf_dir / "chat_template.jinja").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    args = trl.GRPOConfig(
        output_dir=str(out.parent / (out.stem + "_out")),
        max_steps=steps,
        per_device_train_batch_size=PROMPTS * GENERATIONS,  # completions a step
        num_generations=GENERATIONS,
        max_completion_length=COMPLETION,
        temperature=TEMPERATURE,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        epsilon=0.2,
        num_iterations=1,
        learning_rate=LR,
        warmup_steps=WARMUP,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},  # the engine's warmup_cosine ends at 0.1 of the peak
        weight_decay=0.01,
        max_grad_norm=1.0,
        bf16=False,
        gradient_checkpointing=False,  # (TRL's default recomputes activations; the engine's example does not)
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=10,
        dataloader_num_workers=0,
        seed=0,
    )
    train_rows, eval_rows = records(example / "prompts_train.jsonl"), records(example / "prompts_eval.jsonl")
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=[exact_match],
        args=args,
        train_dataset=datasets.Dataset.from_list(train_rows),
        processing_class=tokenizer,
        peft_config=lora,
    )
    sampling: list[float] = []
    generate = trainer._generate_and_score_completions

    def timed(*a, **k):
        began = time.perf_counter()
        result = generate(*a, **k)
        sampling.append(time.perf_counter() - began)
        return result

    trainer._generate_and_score_completions = timed
    step_ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            step_ends.append(-time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step_ends[-1] += time.perf_counter()

    trainer.add_callback(StepClock())
    before = held_out_reward(trainer.model, tokenizer, eval_rows, seed=1)
    result = trainer.train()
    after = held_out_reward(trainer.model, tokenizer, eval_rows, seed=2)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    out.write_text(
        json.dumps(
            {
                "step_seconds": statistics.mean(step_ends),
                "sampling_seconds": statistics.mean(sampling),
                "updating_seconds": statistics.mean(step_ends) - statistics.mean(sampling),
                "train_seconds": result.metrics["train_runtime"],
                "reward_before": before,
                "reward_after": after,
                "train_reward_last": rewards[-1] if rewards else None,
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


def table(rows: list[tuple[str, dict]]) -> str:
    lines = [
        "| run | s/step | sampling | updating | train s | process wall (s) | held-out reward before -> after |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in rows:
        before = "" if r["reward_before"] is None else f"{r['reward_before']:.3f} -> "
        lines.append(
            f"| {name} | {r['step_seconds']:.2f} | {r['sampling_seconds']:.2f} | {r['updating_seconds']:.2f} | "
            f"{r['train_seconds']:.0f} | {r['wall_seconds']:.0f} | {before}{r['reward_after']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=("bench", "trl"), default="bench")
    p.add_argument("--trl-python", default=sys.executable, help="a Python with torch, transformers, peft, trl")
    p.add_argument("--dir", type=Path, default=ROOT / "runs", help="holds chat_example and chat_sft_short")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--torch-threads", type=int, default=1, help="torch's threads (0: its default)")
    p.add_argument("--hf-dir", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    example, sft = args.dir / "chat_example", args.dir / "chat_sft_short"
    if args.side == "trl":
        trl_side(args.hf_dir, example, args.out, args.steps, args.torch_threads)
        return
    for needed in (example / "prompts_train.jsonl", sft / "config.yaml"):
        if not needed.exists():
            raise SystemExit(f"{needed} is missing: run the commands in this file's docstring first")
    work = args.dir / f"grpo_trl_{time.strftime('%H%M%S')}"
    hf_dir = work / "sft_short_hf"
    subprocess.run(
        [sys.executable, "launch.py", "export", "--workdir", str(sft), "--out", str(hf_dir), "--format", "hf"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    rows = []
    for i in range(args.rounds):
        rows.append((f"engine, round {i + 1}", engine_round(work, example, sft, args.steps)))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        trl = trl_round(work, args.trl_python, hf_dir, example, args.steps, args.torch_threads)
        rows.append((f"TRL GRPOTrainer + PEFT, round {i + 1}", trl))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()}")
    print(table(rows))


if __name__ == "__main__":
    main()
