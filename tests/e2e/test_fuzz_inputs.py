"""Every command's file inputs, damaged: truncated, bit-flipped, replaced by random bytes or
emptied. Whatever the damage, a command ends with an exit code of the contract (0 done, 1 a
failed run said plainly, 2 bad input in one line) and never with a traceback. Bounded: a
fixed seed and a fixed number of variants per file, all run in one process."""

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from support.cli import run_cli
from support.configs import ROOT
from support.fuzz_cli import run_in_one_process
from support.llama import TINY, write_hf_checkpoint
from support.tokens import _corpus_files, tokenized_corpus

from models.llama import LlamaConfig

VARIANTS = 5  # damaged copies of each input file


CONTRACT = {0, 1, 2, 130, 143}


def damaged(data: bytes, rng) -> list[bytes]:
    """VARIANTS damaged copies of `data`: cut short, one or a few bits flipped, random, empty."""
    out = [data[: int(rng.integers(0, max(len(data), 1)))]]
    for flips in (1, 8):
        copy = bytearray(data)
        for position in rng.integers(0, len(copy), flips):
            copy[position] ^= 1 << int(rng.integers(0, 8))
        out.append(bytes(copy))
    out.append(rng.integers(0, 256, max(len(data) // 4, 16), dtype=np.uint8).tobytes())
    out.append(b"")
    return out[:VARIANTS]


def test_damaged_inputs_keep_the_exit_code_contract(tmp_path):
    rng = np.random.default_rng(1234)
    cases = []

    def variants(original, name):
        """Copies of `original` (a file, or a directory holding it at `name`) with that file damaged."""
        made = []
        data = (original / name if original.is_dir() else original).read_bytes()
        for i, bad in enumerate(damaged(data, rng)):
            target = tmp_path / "cases" / f"{name}-{len(cases)}-{i}"
            if original.is_dir():
                shutil.copytree(original, target)
                (target / name).write_bytes(bad)
            else:
                target.mkdir(parents=True)
                target = target / original.name
                target.write_bytes(bad)
            made.append(target)
        return made

    # tokenize: a text file, JSON Lines, Parquet, a tokenizer.json
    text = _corpus_files(tmp_path / "text", documents=4)
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": f"document {i} alpha beta"}) + "\n" for i in range(6)))
    parquet = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"text": [f"row {i} gamma delta" for i in range(6)]}), parquet)
    corpus = tokenized_corpus(tmp_path / "corpus", seed=0, documents=12)
    for source in (text / "doc000.txt", jsonl, parquet):
        for i, bad in enumerate(variants(source, source.name)):
            out = str(tmp_path / "out" / f"{source.name}-{i}")
            cases.append(
                {"argv": ["tokenize", "--input", str(bad), "--out", out, "--tokenizer", "bpe:300", "--no-progress"]}
            )
    for i, bad in enumerate(variants(corpus / "tokenizer.json", "tokenizer.json")):
        out = str(tmp_path / "out" / f"tok-{i}")
        cases.append(
            {"argv": ["tokenize", "--input", str(text), "--out", out, "--tokenizer", str(bad), "--no-progress"]}
        )

    # import-hf: config.json, the weights, the index of sharded weights, the tokenizer
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(corpus / "tokenizer.json")).get_vocab_size()
    hf = tmp_path / "hf"
    write_hf_checkpoint(hf, LlamaConfig(**TINY), vocab=vocab)
    shutil.copyfile(corpus / "tokenizer.json", hf / "tokenizer.json")
    sharded = tmp_path / "hf-sharded"
    write_hf_checkpoint(sharded, LlamaConfig(**TINY), vocab=256, shards=2)
    quick = [
        "data.name=synthetic_text",
        f"data.vocab_size={vocab}",
        "data.seq_len=12",
        "data.num_examples=64",
        "train.global_batch_size=8",
    ]
    for directory, name in (
        (hf, "config.json"),
        (hf, "model.safetensors"),
        (hf, "tokenizer.json"),
        (sharded, "model.safetensors.index.json"),
    ):
        for i, bad in enumerate(variants(directory, name)):
            work = str(tmp_path / "imported" / f"{name}-{i}")
            cases.append({"argv": ["import-hf", str(bad), "--workdir", work, *quick]})

    # train: a corpus's manifest and shard (refused before compiling), a config file (--dry-run)
    train_quick = ["data.name=tokens", "data.seq_len=16", "train.steps=1", "log.progress=false", "--dry-run"]
    for name in ("manifest.json", "train-00000.tokens"):
        for i, bad in enumerate(variants(corpus, name)):
            work = str(tmp_path / "runs" / f"{name}-{i}")
            cases.append({"argv": ["--config", "llama_tiny", "--workdir", work, f"data.path={bad}", *train_quick]})
    config = tmp_path / "config.yaml"
    config.write_text((ROOT / "configs" / "mnist_mlp.yaml").read_text())
    for i, bad in enumerate(variants(config, "config.yaml")):
        work = str(tmp_path / "runs" / f"config-{i}")
        cases.append({"argv": ["--config", str(bad), "--workdir", work, "--dry-run"]})

    # sweep: the sweep file (loaded and checked; without sbatch on PATH nothing trains)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {
                "base": "mnist_mlp",
                "directory": str(tmp_path / "sweep-out"),
                "overrides": {"train.steps": 2},
                "grid": {"optimizer.learning_rate": [0.001, 0.01]},
            }
        )
    )
    for bad in variants(sweep, "sweep.yaml"):
        cases.append({"argv": ["sweep", str(bad), "--backend", "slurm"]})

    # sample and export: a run's config.yaml and tokenizer.json
    run = tmp_path / "run"
    made = run_cli(
        "import-hf", str(hf), "--workdir", str(run), "data.max_bytes=30000", "data.seq_len=16",
        "train.global_batch_size=4", env={"HOME": str(tmp_path)},
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    for name in ("config.yaml", "tokenizer.json"):
        for i, bad in enumerate(variants(run, name)):
            cases.append({"argv": ["sample", "--workdir", str(bad), "--prompt", "alpha", "--max-tokens", "4"]})
            out = str(tmp_path / "exports" / f"{name}-{i}")
            cases.append({"argv": ["export", "--workdir", str(bad), "--out", out]})

    results = run_in_one_process(tmp_path, cases, timeout=900)  # (no sbatch on its PATH)
    assert len(results) == len(cases) >= 80
    broken = [
        (r["argv"][:3], r["code"], r["escaped"] or r["stderr"][-400:])
        for r in results
        if r["escaped"] or r["code"] not in CONTRACT or "Traceback" in r["stderr"]
    ]
    assert not broken, broken
    refused = [r for r in results if r["code"] == 2]
    assert len(refused) > len(results) // 2  # most damage is bad input, said in one line
    assert all(len(r["stderr"].strip().splitlines()) >= 1 for r in refused)


def damaged_copies(directory: Path, name: str, tmp_path: Path, rng) -> list[Path]:
    """Copies of `directory` under tmp_path/cases, each with its file `name` damaged (damaged())."""
    made = []
    for i, bad in enumerate(damaged((directory / name).read_bytes(), rng)):
        target = tmp_path / "cases" / f"{directory.name}-{name}-{i}"
        shutil.copytree(directory, target)
        (target / name).write_bytes(bad)
        made.append(target)
    return made


def broken_contract(results: list[dict]) -> list:
    return [
        (r["argv"][:3], r["code"], r["escaped"] or r["stderr"][-400:])
        for r in results
        if r["escaped"] or r["code"] not in CONTRACT or "Traceback" in r["stderr"]
    ]


def test_damaged_tables_feature_caches_and_run_records_keep_the_exit_code_contract(tmp_path):
    """A table's CSV and Parquet files, its feature cache and a finished run's
    preprocessing.json, damaged: every command ends 0, 1 or 2, never with a traceback."""
    rng = np.random.default_rng(4321)
    header, *rows = ["age,city,income,label"] + [
        f"{20 + i},{'paris london tokyo'.split()[i % 3]},{i}.5,{i % 2}" for i in range(24)
    ]
    data = tmp_path / "table"
    data.mkdir()
    (data / "people.csv").write_text("\n".join([header, *rows]) + "\n")
    columns = list(zip(*(row.split(",") for row in rows)))
    numbers = {name: [float(v) for v in columns[i]] for i, name in ((0, "age"), (2, "income"))}
    table = pa.table({**numbers, "city": list(columns[1]), "label": [int(v) for v in columns[3]]})
    pq.write_table(table, data / "people.parquet")
    spec = (
        "data.features=[{name: age, kind: numeric, normalize: zscore}, {name: income, kind: bucketized, quantiles: 3},"
        " {name: city, kind: categorical}, {name: city_x, kind: crossed, features: [city, income], hash_buckets: 8},"
        " {name: e, kind: embedding, source: city, dimension: 2}]"
    )
    table_args = ["--config", "penguins_wide_deep", "data.label=label", spec, "train.steps=2", "log.progress=false"]
    table_args += ["train.global_batch_size=8", "train.steps_per_call=1"]
    made = run_cli(*table_args, f"data.path={data / 'people.csv'}", "--workdir", str(tmp_path / "trained"))
    assert made.returncode == 0, made.stderr
    (cache,) = data.glob(".people.csv.features-*.json")
    cases = []

    for name in ("people.csv", "people.parquet", cache.name):
        for i, copy in enumerate(damaged_copies(data, name, tmp_path, rng)):
            table = copy / ("people.csv" if name == cache.name else name)
            work = str(tmp_path / "runs" / f"{name}-{i}")
            cases.append({"argv": [*table_args, f"data.path={table}", "--workdir", work, "--dry-run"]})
    for i, copy in enumerate(damaged_copies(tmp_path / "trained", "preprocessing.json", tmp_path, rng)):
        cases.append({"argv": ["export", "--workdir", str(copy), "--out", str(tmp_path / "exports" / str(i))]})

    results = run_in_one_process(tmp_path, cases)
    assert len(results) == len(cases) == 20
    assert not broken_contract(results), broken_contract(results)
    exports = results[-VARIANTS:]
    assert all(r["code"] == 2 and "preprocessing.json" in r["stderr"] for r in exports), exports


def test_damaged_templates_trackers_json_datasets_and_plan_targets_keep_the_exit_code_contract(tmp_path):
    """A workdir's tokenizer_config.json and chat_template.jinja (sample --chat), a run's
    trackers.json, a Hugging Face datasets directory (tokenize), and hostile plan targets and
    --json paths: every command ends 0, 1 or 2, never with a traceback."""
    import datasets

    rng = np.random.default_rng(9876)
    template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    chat = tmp_path / "chat"
    chat.mkdir()
    (chat / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    (chat / "chat_template.jinja").write_text(template)
    trained = tmp_path / "trained"
    trained.mkdir()
    (trained / "trackers.json").write_text(json.dumps({"mlflow": "0123456789abcdef0123456789abcdef"}))
    corpus = tmp_path / "dataset"
    datasets.Dataset.from_dict({"text": [f"document {i} alpha beta gamma" for i in range(40)]}).save_to_disk(corpus)
    (arrow,) = [p.name for p in corpus.glob("*.arrow")]
    cases = []

    for name in ("tokenizer_config.json", "chat_template.jinja"):
        for work in damaged_copies(chat, name, tmp_path, rng):
            cases.append({"argv": ["sample", "--workdir", str(work), "--prompt", "hi", "--chat", "--max-tokens", "2"]})
    for work in damaged_copies(trained, "trackers.json", tmp_path, rng):
        cases.append({"argv": ["--config", "mnist_mlp", "--workdir", str(work), "log.trackers=[mlflow]", "--dry-run"]})
    for name in (arrow, "state.json", "dataset_info.json"):
        for i, copy in enumerate(damaged_copies(corpus, name, tmp_path, rng)):
            out = str(tmp_path / "tokenized" / f"{name}-{i}")
            cases.append({"argv": ["tokenize", "--input", str(copy), "--out", out, "--tokenizer", "bpe:300"]})
    targets = ["v5e-0", "v5p:0x0x0", "tpu9-8", "v5e-8x", "", "v5e--8", "v5p:1x1x99999999999", "v4-7", "v6e:2x2x2x2"]
    for target in targets:
        cases.append({"argv": ["plan", "--config", "llama_tiny", "--target", target]})
    for path in (tmp_path, tmp_path / "nowhere" / "p.json", tmp_path / "chat" / "chat_template.jinja" / "p.json"):
        cases.append({"argv": ["plan", "--config", "llama_tiny", "--target", "v5e-8", "--json", str(path)]})

    results = run_in_one_process(tmp_path, cases)
    assert len(results) == len(cases) == 42
    assert not broken_contract(results), broken_contract(results)
    plans = results[-len(targets) - 3 :]
    assert all(r["code"] == 2 and len(r["stderr"].strip().splitlines()) == 1 for r in plans), plans
