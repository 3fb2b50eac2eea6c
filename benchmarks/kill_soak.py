"""SIGKILL soak of the commands that write: each command is run once uninterrupted, then
--kills times killed at a seeded random moment of its run and re-run to the end. Every
re-run must end with exit 0 and give the uninterrupted result: byte-identical files
(tokenize; the Hugging Face export of an imported model; a serving export's program) and
bit-identical parameters and losses (a vectorised group's per-trial metrics and exported
weights; a LoRA fine-tuning run's and a table run's recorded losses after resuming). Prints
one line per command with its counts.

    python benchmarks/kill_soak.py --kills 20 [--only tokenize,import-hf,export,group,search,lora,table]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads results
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))


def cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    full = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full.update(env or {})
    return subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full,
        cwd=ROOT,
    )


def finish(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = cli(*args, env=env)
    out, err = proc.communicate(timeout=600)
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def digest(directory: Path, skip: tuple[str, ...] = ()) -> str:
    """SHA-256 over the names and bytes of every file under `directory` (hidden files and `skip` left out)."""
    total = hashlib.sha256()
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        relative = path.relative_to(directory)
        if any(part.startswith(".") for part in relative.parts) or any(s in str(relative) for s in skip):
            continue
        total.update(str(relative).encode())
        total.update(path.read_bytes())
    return total.hexdigest()


class Soak:
    """One command: `run(attempt)` gives its argv into a fresh output; `result(attempt)` its digest."""

    name = ""

    def __init__(self, base: Path):
        self.base = base

    def argv(self, out: Path) -> list[str]:
        raise NotImplementedError

    def result(self, out: Path) -> str:
        raise NotImplementedError

    def done_codes(self) -> tuple[int, ...]:
        return (0,)


class Tokenize(Soak):
    name = "tokenize"

    def __init__(self, base: Path):
        super().__init__(base)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        self.inputs = base / "text"
        self.inputs.mkdir()
        size = 0
        for file in sorted(stdlib.glob("*.py")):
            shutil.copyfile(file, self.inputs / file.name)
            size += file.stat().st_size
            if size > 3_000_000:
                break

    def argv(self, out):
        return ["tokenize", "--input", str(self.inputs), "--out", str(out), "--tokenizer", "bpe:2048",
                "--shard-tokens", "50000", "--no-progress"]  # fmt: skip

    def result(self, out):
        return digest(out)


class ImportHF(Soak):
    name = "import-hf"

    def __init__(self, base: Path):
        super().__init__(base)
        from test_llama import TINY, write_hf_checkpoint

        from models.llama import LlamaConfig

        self.hf = base / "hf"
        write_hf_checkpoint(self.hf, LlamaConfig(**{**TINY, "d_model": 256, "mlp_dim": 512}), vocab=4096, shards=3)

    def argv(self, out):
        return ["import-hf", str(self.hf), "--workdir", str(out), "data.name=synthetic_text", "data.vocab_size=4096",
                "data.seq_len=16", "data.num_examples=64", "train.global_batch_size=8"]  # fmt: skip

    def done_codes(self):
        return (0, 2)  # 2: a kill after the checkpoint was in place: the import is finished ("checkpoints exists")

    def result(self, out):
        exported = out.parent / f"{out.name}-hf"
        proc = finish("export", "--workdir", str(out), "--format", "hf", "--out", str(exported))
        assert proc.returncode == 0, proc.stderr[-2000:]
        return digest(exported)


class Export(Soak):
    name = "export"

    def __init__(self, base: Path):
        super().__init__(base)
        self.run = base / "trained"
        proc = finish("--config", "mnist_mlp", "--workdir", str(self.run), "train.steps=20", "log.progress=false",
                      "log.tensorboard=false", "model.hidden_sizes=[512,512]")  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]

    def argv(self, out):
        return ["export", "--workdir", str(self.run), "--out", str(out)]

    def done_codes(self):
        return (0, 2)  # 2: killed after the export was in place ("--out exists"): nothing is overwritten

    def result(self, out):
        import numpy as np
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as reader:
            variables = reader.restore(out / "variables")
        import jax

        arrays = b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(variables))
        return hashlib.sha256(arrays + (out / "forward.stablehlo").read_bytes()).hexdigest()


class Sweep(Soak):
    """A sweep file into `out`: `spec` is what runs (a vectorised grid, or an Optuna search)."""

    name = ""
    spec: dict = {}

    def argv(self, out):
        import yaml

        sweep = out.parent / f"{out.name}.yaml"
        overrides = {"train.steps": 40, "checkpoint.every_steps": 10, "eval.every_steps": 20, "log.every_steps": 5,
                     "log.progress": False, "log.tensorboard": False}  # fmt: skip
        body = {"base": str(ROOT / "configs" / "mnist_mlp.yaml"), "directory": str(out), "overrides": overrides}
        sweep.write_text(yaml.safe_dump({**body, **self.spec, "metric": "eval/loss", "mode": "min"}))
        return ["sweep", str(sweep)]

    def result(self, out):
        import json

        from engine.runtime.rundir import read_records

        losses = []
        for run in sorted(p for p in out.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists()):
            losses += [(run.name, r["step"], r["loss"]) for r in read_records(run / "metrics.jsonl") if "loss" in r]
        assert losses, f"no run metrics under {out}"
        return hashlib.sha256(json.dumps(losses).encode()).hexdigest()


class Group(Sweep):
    name = "group"
    spec = {"grid": {"optimizer.learning_rate": [0.001, 0.003, 0.01]}, "vectorize": 3}


class Search(Sweep):
    name = "search"
    spec = {
        "search": {
            "sampler": "tpe",
            "trials": 3,
            "seed": 0,
            "params": {"optimizer.learning_rate": {"log_uniform": [1.0e-4, 1.0e-1]}},
        }
    }


class Training(Soak):
    """A training run killed and re-run on its workdir: it resumes, and its recorded losses
    (train and eval, each step once) equal the uninterrupted run's bit for bit."""

    common = ["train.steps=400", "checkpoint.every_steps=20", "log.every_steps=5", "eval.every_steps=100",
              "log.progress=false", "log.tensorboard=false"]  # fmt: skip

    def result(self, out):
        import json

        from engine.runtime.rundir import read_records

        records = read_records(out / "metrics.jsonl")
        losses = [(r["split"], r["step"], r["loss"]) for r in records if r["split"] in ("train", "eval")]
        assert len({(split, step) for split, step, _ in losses}) == len(losses), "a step recorded twice"
        return hashlib.sha256(json.dumps(losses).encode()).hexdigest()


class Lora(Training):
    name = "lora"

    def __init__(self, base: Path):
        super().__init__(base)
        from test_llama import TINY, write_hf_checkpoint

        from models.llama import LlamaConfig

        write_hf_checkpoint(base / "hf", LlamaConfig(**TINY), vocab=256)
        self.data = ["data.name=synthetic_text", "data.vocab_size=256", "data.seq_len=16", "data.num_examples=256",
                     "train.global_batch_size=8"]  # fmt: skip
        proc = finish("import-hf", str(base / "hf"), "--workdir", str(base / "imported"), *self.data)
        assert proc.returncode == 0, proc.stderr[-2000:]

    def argv(self, out):
        lora = ["finetune.lora.rank=4", "finetune.lora.targets=[all]", "finetune.lora.dropout=0.1",
                f"finetune.base={self.base / 'imported'}", "optimizer.learning_rate=0.01"]  # fmt: skip
        config = str(self.base / "imported" / "config.yaml")
        return ["--config", config, "--workdir", str(out), *self.data, *lora, *self.common]


class Table(Training):
    name = "table"

    def argv(self, out):
        return ["--config", "penguins_wide_deep", "--workdir", str(out), "train.steps_per_call=1", *self.common]


SOAKS = {cls.name: cls for cls in (Tokenize, ImportHF, Export, Group, Search, Lora, Table)}


def soak(kind: type[Soak], kills: int, seed: int) -> str:
    base = Path(tempfile.mkdtemp(prefix=f"soak-{kind.name}-"))
    try:
        command = kind(base)
        began = time.perf_counter()
        reference = finish(*command.argv(base / "reference"))
        duration = time.perf_counter() - began
        assert reference.returncode == 0, reference.stderr[-2000:]
        expected = command.result(base / "reference")
        rng = random.Random(seed)
        killed = finished_first = equal = resumed = 0
        failures = []
        for attempt in range(kills):
            out = base / f"attempt{attempt}"
            proc = cli(*command.argv(out))
            try:
                proc.wait(timeout=rng.uniform(0.3, duration))
                finished_first += 1
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed += 1
            rerun = finish(*command.argv(out))
            resumed += "resuming from step" in rerun.stdout
            if rerun.returncode not in command.done_codes():
                failures.append(f"attempt {attempt}: re-run exit {rerun.returncode}: {rerun.stderr.strip()[-300:]}")
                continue
            if command.result(out) == expected:
                equal += 1
            else:
                failures.append(f"attempt {attempt}: the re-run's result differs")
        line = (
            f"{kind.name}: {kills} attempts ({killed} killed mid-run at seeded random moments in 0.3-{duration:.1f} s, "
            f"{finished_first} finished first); re-runs equal to the uninterrupted result: {equal}/{kills}"
            + (f" ({resumed} resumed from a checkpoint)" if resumed else "")
        )
        return line + "".join(f"\n  {f}" for f in failures)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--only", default=",".join(SOAKS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for name in args.only.split(","):
        print(soak(SOAKS[name], args.kills, args.seed), flush=True)


if __name__ == "__main__":
    main()
