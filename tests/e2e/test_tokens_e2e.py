"""Tokenized corpora: the tokenize command (formats, resume, bad input), the Grain-backed
`tokens` source (packing, mixtures), and training on it (exact resume after SIGKILL)."""

import json

import numpy as np
import pytest
from support import tokens as tokens_helpers
from support.cli import child_env, run_cli, start_cli, wait_until
from support.fuzz_cli import refused_in_one_line, run_in_one_process
from support.in_process import train_here
from support.tokens import LLAMA_TOKENS, _corpus_files, _text

from engine.data import tokens as tk
from engine.data.pretokenize import tokenize
from engine.errors import UsageError
from engine.runtime.rundir import read_records

two_corpora = tokens_helpers.two_corpora  # the fixture


def test_tokenize_reads_a_hugging_face_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(3)
    texts = [_text(rng, int(rng.integers(3, 40))) for _ in range(30)]
    rows = {"id": list(range(30)), "content": texts}
    # two shards (the order is state.json's), and a DatasetDict whose train split is read
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"), num_shards=2)
    whole = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict(rows)})
    whole["test"] = whole["test"].select([0])
    whole.save_to_disk(str(tmp_path / "dd"))
    (tmp_path / "same.jsonl").write_text("".join(json.dumps({"content": t}) + "\n" for t in texts))
    for name in ("ds", "dd", "same.jsonl"):
        tokenize([str(tmp_path / name)], str(tmp_path / f"out_{name}"), "bpe:300", text_field="content", progress=False)
    reference = tk.open_corpus(str(tmp_path / "out_same.jsonl"))
    for name in ("ds", "dd"):
        corpus = tk.open_corpus(str(tmp_path / f"out_{name}"))
        for split in ("train", "eval"):
            got, want = corpus.stream(split), reference.stream(split)
            assert np.array_equal(got.read(0, got.doc_ends[-1]), want.read(0, want.doc_ends[-1]))
            assert np.array_equal(got.doc_ends, want.doc_ends)
    (tmp_path / "dd" / "dataset_dict.json").write_text('{"splits": ["test"]}')
    bad = ["--out", str(tmp_path / "bad"), "--tokenizer", "bpe:300"]  # both in one process (support/fuzz_cli.py)
    no_text, no_train = run_in_one_process(
        tmp_path, [{"argv": ["tokenize", "--input", str(tmp_path / name), *bad]} for name in ("ds", "dd")]
    )
    refused_in_one_line(no_text, "no column 'text' (columns: ['id', 'content']); pass --text-field NAME")
    refused_in_one_line(no_train, f"e.g. --input {tmp_path / 'dd' / 'test'}")
    assert not (tmp_path / "bad").exists()


def test_bad_corpus_input_is_refused_by_name(tmp_path, make_config):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    with pytest.raises(UsageError, match=r"bad.jsonl:2: no 'text' field .* --text-field"):
        tokenize([str(tmp_path / "bad.jsonl")], str(tmp_path / "o1"), "bpe:300", progress=False)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    with pytest.raises(UsageError, match="no non-empty documents"):
        tokenize([str(tmp_path / "empty")], str(tmp_path / "o2"), "bpe:300", progress=False)
    assert not (tmp_path / "o2").exists()  # nothing left behind
    with pytest.raises(UsageError, match="does not exist"):
        tokenize([str(tmp_path / "missing")], str(tmp_path / "o3"), "bpe:300", progress=False)
    with pytest.raises(UsageError, match="bpe:N with N ≥ 257"):
        tokenize([str(tmp_path / "bad.jsonl")], str(tmp_path / "o4"), "bpe:100", progress=False)

    good = _corpus_files(tmp_path / "good", documents=10)
    tokenize([str(good)], str(tmp_path / "corpus"), "bpe:300", eval_fraction=0.2, progress=False)
    with pytest.raises(UsageError, match="other settings"):
        tokenize([str(good)], str(tmp_path / "corpus"), "bpe:400", progress=False)
    from engine.run.setup import build_run

    small_model = make_config(
        "llama_tiny", "data.name=tokens", f"data.path={tmp_path / 'corpus'}", "model.vocab_size=200", "data.seq_len=16"
    )
    with pytest.raises(UsageError, match=r"model.vocab_size=200 is smaller than the data's vocabulary \(300"):
        build_run(small_model, compile_train=False)
    on_device = make_config(
        "llama_tiny", "data.name=tokens", f"data.path={tmp_path / 'corpus'}", "data.seq_len=16", "data.placement=device"
    )
    with pytest.raises(UsageError, match="data.placement=device: data.name=tokens cannot live on the devices"):
        build_run(on_device, compile_train=False)
    shard = tmp_path / "corpus" / "train-00000.tokens"
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x01  # one flipped bit
    shard.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="train-00000.tokens: checksum does not match"):
        tk.open_corpus(str(tmp_path / "corpus"))
    with pytest.raises(UsageError, match="no manifest.json.*launch.py tokenize"):
        tk.open_corpus(str(good))
    result = run_cli(
        "--config",
        "llama_tiny",
        "--workdir",
        str(tmp_path / "run"),
        "data.name=tokens",
        f"data.path={tmp_path / 'corpus'}",
        "train.steps=2",
    )
    assert result.returncode == 2 and "checksum does not match" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "run").exists()


def _train_records(workdir):
    return [r for r in read_records(workdir / "metrics.jsonl") if r["split"] == "train"]


@pytest.mark.slow
def test_a_packed_mixture_trains_reports_shares_and_resumes_bit_identically_after_sigkill(
    tmp_path, two_corpora, capsys
):
    """The run never stopped is this test's own (support/in_process.py); the killed one and its
    re-run are launched."""
    a, b = two_corpora
    args = [
        *LLAMA_TOKENS,
        f"data.sources=[{{path: {a}, weight: 3}}, {{path: {b}, weight: 1}}]",
        "train.steps=12",
        "checkpoint.every_steps=3",
    ]

    def start(workdir):
        return start_cli("--config", "llama_tiny", "--workdir", str(workdir), *args)

    reference, killed = tmp_path / "reference", tmp_path / "killed"
    code, said = train_here(capsys, reference, "llama_tiny", *args, devices=1, common=False)
    assert code == 0, said[-3000:]
    records = _train_records(reference)
    shares = np.array([[r["share_a"], r["share_b"]] for r in records])
    np.testing.assert_allclose(shares.sum(axis=1), 1.0, rtol=1e-6)
    assert abs(shares[:, 0].mean() - 0.75) < 0.1  # 12 steps × 8 windows, weighted by real tokens
    proc = start(killed)
    wait_until(lambda: _train_records(killed) and _train_records(killed)[-1]["step"] >= 7, proc, 240, poll=0.05)
    proc.kill()
    proc.wait()
    assert _train_records(killed)[-1]["step"] < 12
    proc = start(killed)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    losses = lambda records: [(r["step"], r["loss"], r["share_a"]) for r in records]  # noqa: E731
    assert losses(_train_records(killed)) == losses(records)
    # the run keeps its tokenizer: sample decodes with it, and a Hugging Face export carries it
    # (both commands through the CLI's main in one process: tests/support/fuzz_cli.py)
    assert (reference / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()
    sampled, exported = run_in_one_process(
        tmp_path,
        [
            {"argv": ["sample", "--workdir", str(reference), "--prompt", "alpha beta", "--temperature", "0"]},
            {"argv": ["export", "--workdir", str(reference), "--out", str(tmp_path / "hf"), "--format", "hf"]},
        ],
        env=child_env({"HOME": str(tmp_path)}),
    )
    assert sampled["code"] == 0 and not sampled["escaped"], sampled["escaped"] or sampled["stderr"]
    text = sampled["stdout"].strip("\n")
    assert text.strip() and set(text) <= set("abcdefghijklmnopqrstuvwxyz ."), text  # the corpus's own characters
    assert exported["code"] == 0 and not exported["escaped"], exported["escaped"] or exported["stderr"]
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_read_their_own_rows_and_match_one_process(tmp_path, two_corpora, capsys):
    from support.multiprocess import local_job, train_losses

    a, _ = two_corpora
    args = [*LLAMA_TOKENS, f"data.path={a}", "train.steps=6", "mesh.data=2", "mesh.fsdp=2"]
    two = local_job(tmp_path / "two", "llama_tiny", *args)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    code, said = train_here(capsys, tmp_path / "one", "llama_tiny", *args)  # (support/in_process.py)
    assert code == 0, said[-3000:]
    x, y = train_losses(tmp_path / "two"), train_losses(tmp_path / "one")
    assert sorted(x) == list(range(1, 7))
    np.testing.assert_allclose([x[s] for s in sorted(x)], [y[s] for s in sorted(x)], rtol=1e-5)
