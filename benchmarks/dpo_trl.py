"""DPO with LoRA on the shipped post-training example: the engine against Hugging Face TRL's DPOTrainer.

Workload: configs/dpo.yaml as shipped (after configs/chat_sft.yaml): the 4-layer Llama of
chat_sft.yaml (d_model 128), LoRA rank 8, alpha 16 on every projection, beta 2.0, sigmoid loss,
100 steps of 16 pairs, AdamW 2e-4 with 20 warmup steps then cosine-decayed to 0.1 of it (TRL:
cosine_with_min_lr at min_lr_rate 0.1), on chat_example's 4,000 training pairs; the held-out
reward accuracy on its 200 eval pairs at the end. TRL trains the same pairs (as conversations:
the prompt a user message, the answers the assistant's, rendered with the same chat template)
from the same SFT weights, exported from runs/chat_sft with `launch.py export --format hf`, with
a PEFT LoRA of the same rank, alpha and targets, on torch (CPU, float32). Rounds interleave
(engine, TRL, engine, TRL, ...); each reports pairs per second over the training steps and the
final held-out rewards/accuracies; the medians over rounds, and the engine's ratio to TRL.

    python -m engine.data.chat_example runs/chat_example
    python launch.py --config configs/chat_sft.yaml               # the SFT weights (runs/chat_sft)
    python benchmarks/dpo_trl.py --trl-python VENV/bin/python [--rounds 2] [--precompute]

`--trl-python`: a Python with torch, transformers, peft, trl and datasets (not the engine's
dependencies); `--precompute` adds an engine row with dpo.precompute_reference=true; `--example`
and `--sft` take the example's files and the SFT run from elsewhere than runs/ (the SFT weights
change the accuracies, not the pairs/s: any run of chat_sft.yaml's shape will do for speed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "runs" / "chat_example"
SFT = ROOT / "runs" / "chat_sft"
STEPS, BATCH, RANK, ALPHA, BETA, LR, WARMUP, SEQ = 100, 16, 8, 16, 2.0, 2e-4, 20, 32  # configs/dpo.yaml
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # the engine's "all"


def engine_round(work: Path, precompute: bool, example: Path, sft: Path) -> dict:
    """One engine run of configs/dpo.yaml in its own process: pairs/s (the run's summary: training
    steps only), the process's wall time and the final held-out rewards/accuracies."""
    workdir = work / f"engine_{time.time_ns()}"
    cmd = [sys.executable, "launch.py", "--config", "configs/dpo.yaml", f"workdir={workdir}", "log.progress=false"]
    cmd += [f"finetune.base={sft}", f"data.tokenizer={example}"]
    cmd += [f"data.path={example / 'preferences_train.jsonl'}", f"data.eval_path={example / 'preferences_eval.jsonl'}"]
    if precompute:
        cmd.append("dpo.precompute_reference=true")
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"engine run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in rows if r["split"] == "summary")
    evals = [r for r in rows if r["split"] == "eval"]
    return {
        "pairs_per_sec": summary["examples_per_sec"],
        "wall_seconds": wall,
        "train_seconds": summary["wall_seconds"],
        "eval_accuracy": evals[-1]["rewards/accuracies"],
    }


def trl_round(work: Path, python: str, hf_dir: Path, example: Path, threads: int) -> dict:
    """One TRL run in its own process (this file with --side trl under `python`)."""
    out = work / f"trl_{time.time_ns()}.json"
    cmd = [python, __file__, "--side", "trl", "--hf-dir", str(hf_dir), "--out", str(out)]
    cmd += ["--example", str(example), "--torch-threads", str(threads)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"TRL run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text()) | {"wall_seconds": wall}


def conversations(path: Path) -> list[dict]:
    """The example's pairs as TRL's conversational preference records (the engine renders a string
    prompt as one user message, and a string answer as the assistant's)."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        {
            "prompt": [{"role": "user", "content": r["prompt"]}],
            "chosen": [{"role": "assistant", "content": r["chosen"]}],
            "rejected": [{"role": "assistant", "content": r["rejected"]}],
        }
        for r in records
    ]


def trl_side(hf_dir: Path, out: Path, example: Path, threads: int) -> None:
    """TRL's DPOTrainer with a PEFT LoRA on the exported SFT weights; writes pairs/s and the final
    held-out rewards/accuracies to `out`."""
    import datasets
    import peft
    import torch
    import transformers
    import trl

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tokenizer.chat_template = (hf_dir / "chat_template.jinja").read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    lora = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    args = trl.DPOConfig(
        output_dir=str(out.parent / (out.stem + "_out")),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        learning_rate=LR,
        warmup_steps=WARMUP,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": 0.1},  # the engine's warmup_cosine ends at 0.1 of the peak
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=SEQ + 1,  # the engine's window: seq_len + 1 tokens
        bf16=False,
        gradient_checkpointing=False,  # (TRL's default recomputes activations; the engine's example does not)
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_steps=25,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = trl.DPOTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(conversations(example / "preferences_train.jsonl")),
        eval_dataset=datasets.Dataset.from_list(conversations(example / "preferences_eval.jsonl")),
        processing_class=tokenizer,
        peft_config=lora,
    )
    result = trainer.train()
    metrics = trainer.evaluate()
    out.write_text(
        json.dumps(
            {
                "pairs_per_sec": result.metrics["train_samples_per_second"],
                "train_seconds": result.metrics["train_runtime"],
                "eval_accuracy": metrics["eval_rewards/accuracies"],
                "torch_threads": torch.get_num_threads(),
            }
        )
    )


def table(rows: list[tuple[str, dict]]) -> str:
    lines = [
        "| run | pairs/s (training steps) | process wall (s) | held-out rewards/accuracies |",
        "|---|---|---|---|",
    ]
    for name, r in rows:
        lines.append(f"| {name} | {r['pairs_per_sec']:.1f} | {r['wall_seconds']:.1f} | {r['eval_accuracy']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--side", choices=("bench", "trl"), default="bench")
    p.add_argument("--trl-python", default=sys.executable, help="a Python with torch, transformers, peft, trl")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--precompute", action="store_true", help="add an engine row with dpo.precompute_reference")
    p.add_argument("--example", type=Path, default=EXAMPLE, help="the example's files (chat_example)")
    p.add_argument("--sft", type=Path, default=SFT, help="the SFT run (configs/chat_sft.yaml's workdir)")
    p.add_argument("--torch-threads", type=int, default=0, help="torch's threads (0: torch's default)")
    p.add_argument("--hf-dir", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.side == "trl":
        trl_side(args.hf_dir, args.out, args.example, args.torch_threads)
        return
    for needed in (args.example / "preferences_train.jsonl", args.sft / "config.yaml"):
        if not needed.exists():
            raise SystemExit(f"{needed} is missing: run the commands in this file's docstring first")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        hf_dir = work / "sft_hf"
        subprocess.run(
            [sys.executable, "launch.py", "export", "--workdir", str(args.sft), "--out", str(hf_dir), "--format", "hf"],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        rows = []
        for i in range(args.rounds):
            rows.append((f"engine, round {i + 1}", engine_round(work, False, args.example, args.sft)))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            if args.precompute:
                rows.append(
                    (f"engine, precompute_reference, round {i + 1}", engine_round(work, True, args.example, args.sft))
                )
                print(table(rows[-1:]).splitlines()[-1], flush=True)
            rows.append(
                (
                    f"TRL DPOTrainer + PEFT, round {i + 1}",
                    trl_round(work, args.trl_python, hf_dir, args.example, args.torch_threads),
                )
            )
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"{os.cpu_count()} CPUs; load average {os.getloadavg()}")
    print(table(rows))
    sides = {"engine": "engine, round", "engine (precompute)": "engine, precompute_reference", "TRL": "TRL"}
    by_side = {label: [r["pairs_per_sec"] for name, r in rows if name.startswith(key)] for label, key in sides.items()}
    for label, values in by_side.items():
        if values:
            print(f"{label}: median {statistics.median(values):.1f} pairs/s")
    for label in ("engine", "engine (precompute)"):
        if by_side[label]:
            ratios = [ours / theirs for ours, theirs in zip(by_side[label], by_side["TRL"])]
            ratio = statistics.median(by_side[label]) / statistics.median(by_side["TRL"])
            print(f"{label} / TRL: {ratio:.2f}x (medians); round by round {', '.join(f'{x:.2f}' for x in ratios)}")


if __name__ == "__main__":
    main()
