"""Tokenized corpora: the tokenize command (formats, resume, bad input), the Grain-backed
`tokens` source (packing, mixtures), and training on it (exact resume after SIGKILL)."""

import json
import shutil
import time

import numpy as np
import pytest
from support import tokens as tokens_helpers
from support.configs import ROOT
from support.tokens import _corpus_files, _text, tokenized_corpus

from engine.config import DataConfig
from engine.data import load_dataset
from engine.data import tokens as tk
from engine.data.pretokenize import Interrupted, held_out, tokenize
from engine.errors import UsageError

two_corpora = tokens_helpers.two_corpora  # the fixture


@pytest.mark.nocompile
def test_tokenize_reads_text_json_lines_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    texts = [
        "the first document, a plain text file",
        "a record's text",
        "another record",
        "a parquet row",
        "the second parquet row ünïcödé",
    ]
    (tmp_path / "a.txt").write_text(texts[0])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(texts[1:3])))
    pq.write_table(pa.table({"text": texts[3:], "n": [1, 2]}), tmp_path / "c.parquet")
    manifest = tokenize(
        [str(tmp_path / n) for n in ("a.txt", "b.jsonl", "c.parquet")],
        str(tmp_path / "out"),
        "bpe:300",
        eval_fraction=0.0,
        progress=False,
    )
    assert manifest["splits"]["train"]["documents"] == 5 and manifest["dtype"] == "uint16"
    corpus = tk.open_corpus(str(tmp_path / "out"))
    stream = corpus.stream("train")
    tokenizer = Tokenizer.from_file(str(corpus.tokenizer_file))
    starts = np.concatenate([[0], stream.doc_ends[:-1]])
    for text, start, end in zip(texts, starts, stream.doc_ends):
        ids = stream.read(int(start), int(end)).tolist()
        assert ids[-1] == manifest["eod_id"]  # every document ends with the end-of-document token
        assert ids[:-1] == tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids[:-1]) == text


@pytest.mark.nocompile
def test_held_out_documents_are_a_fixed_fraction_by_index():
    chosen = held_out(np.arange(200_000), 0.05)
    assert abs(chosen.mean() - 0.05) < 0.003
    np.testing.assert_array_equal(held_out(np.arange(1000, 2000), 0.05), chosen[1000:2000])  # batching-independent


def _files_of(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.name != "manifest.json"}


@pytest.mark.nocompile
def test_interrupted_tokenize_resumes_to_the_same_shards(tmp_path):
    inputs = [str(_corpus_files(tmp_path / "text", documents=60))]
    settings = dict(eval_fraction=0.2, shard_tokens=400, progress=False, batch_bytes=1500)
    reference = tokenize(inputs, str(tmp_path / "reference"), "bpe:320", **settings)
    out = tmp_path / "interrupted"
    with pytest.raises(Interrupted):
        tokenize(inputs, str(out), "bpe:320", stop_after_batches=3, **settings)
    assert not (out / "manifest.json").exists()
    with pytest.raises(UsageError, match="interrupted: re-run the tokenize command"):
        tk.open_corpus(str(out))  # an unfinished corpus is never read
    state = json.loads((out / "progress.json").read_text())
    open_shard = out / f"train-{len(state['splits']['train']['done']):05d}.tokens"
    with open(open_shard, "ab") as f:  # as if killed after writing, before progress.json said so
        f.write(b"\x07" * 123)
    resumed = tokenize(inputs, str(out), "bpe:320", **settings)
    assert resumed == {k: v for k, v in reference.items()}
    assert _files_of(out) == _files_of(tmp_path / "reference")
    assert len(reference["splits"]["train"]["shards"]) > 3 and reference["splits"]["eval"]["documents"] > 0


@pytest.mark.nocompile
def test_packing_lays_documents_into_windows_in_order():
    ends = np.array([3, 5, 12, 30, 31, 33])
    np.testing.assert_array_equal(tk.pack(ends, 5), [0, 5, 10, 15, 20, 25, 30, 33])
    tokens = np.arange(1, 34, dtype=np.uint16)
    windows = tk.Windows(tk.TokenStream([tokens[:20], tokens[20:]], [ends[:3], ends[3:] - 20]), seq_len=4, packing=True)
    rows = [windows[i] for i in range(len(windows))]
    np.testing.assert_array_equal(np.concatenate([r["tokens"][r["segments"] > 0] for r in rows]), tokens)
    np.testing.assert_array_equal(rows[0]["segments"], [1, 1, 1, 2, 2])  # documents [0, 3) and [3, 5)
    np.testing.assert_array_equal(rows[0]["positions"], [0, 1, 2, 0, 1])  # positions restart per document
    np.testing.assert_array_equal(rows[6]["tokens"], [31, 32, 33, 0, 0])  # [30, 33): a short doc, then padding
    np.testing.assert_array_equal(rows[6]["segments"], [1, 2, 2, 0, 0])
    np.testing.assert_array_equal(rows[6]["positions"], [0, 0, 1, 0, 0])
    unpacked = tk.Windows(tk.TokenStream([tokens[:20], tokens[20:]], [ends[:3], ends[3:] - 20]), 4, packing=False)
    np.testing.assert_array_equal(unpacked[4]["tokens"], tokens[16:21])  # across the shard boundary
    assert len(unpacked) == 8 and set(unpacked[0]) == {"tokens"}


@pytest.mark.nocompile
def test_a_mixture_follows_its_weights_and_the_seed(two_corpora):
    a, b = two_corpora
    cfg = DataConfig(name="tokens", seq_len=16, sources=[{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}])
    dataset = load_dataset(cfg)
    assert dataset.info.sources == ("a", "b") and dataset.info.text_codec == "tokenizer"
    examples = dataset.train.examples(seed=0, shuffle=True)
    drawn = examples.take(range(4000))
    share = (drawn["source"] == 0).mean()
    assert abs(share - 0.75) < 3 * np.sqrt(0.75 * 0.25 / 4000)
    picked = [5, 3999, 17, 17, 0, *range(1, 4000, 13)]  # Grain's batched read (training's) gives each index's own
    # example: windows of one and of several documents, padded ones, from both sources
    batched, alone = examples.take(picked), [examples.dataset[i] for i in picked]
    for name in ("tokens", "segments", "positions", "source"):
        np.testing.assert_array_equal(batched[name], np.stack([row[name] for row in alone]))
    again = dataset.train.examples(seed=0, shuffle=True).take(range(100, 140))
    np.testing.assert_array_equal(again["tokens"], drawn["tokens"][100:140])  # a function of (seed, index)
    other = dataset.train.examples(seed=1, shuffle=True).take(range(100, 140))
    assert not np.array_equal(other["tokens"], drawn["tokens"][100:140])
    first = load_dataset(DataConfig(name="tokens", path=str(a), seq_len=16)).train
    one_epoch = first.examples(seed=0, shuffle=True).take(range(len(first)))["tokens"]
    assert sorted(map(tuple, one_epoch)) == sorted(tuple(first.sources[0][i]["tokens"]) for i in range(len(first)))


@pytest.mark.nocompile
def test_each_process_reads_only_its_rows_of_the_global_batch(two_corpora):
    from engine.data import TrainBatches

    train = load_dataset(DataConfig(name="tokens", path=str(two_corpora[0]), seq_len=16)).train
    whole = TrainBatches(train, 8, seed=3)(5)
    halves = [TrainBatches(train, 8, seed=3, rows=np.arange(4) + 4 * p)(5) for p in (0, 1)]
    for name in whole:
        np.testing.assert_array_equal(np.concatenate([h[name] for h in halves]), whole[name])


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.name=tokens", "data.sources=[5]"], r"data.sources\[0\]=5: each source is a mapping with path"),
        (
            ["data.name=tokens", "data.sources=[{path: /a, weight: -1}]"],
            r"data.sources\[0\].weight=-1 must be a positive number",
        ),
        (["data.name=tokens", "data.sources=[{path: /x/a}, {path: /y/a}]"], "repeated names"),
        (["data.sources=[{path: /a}]"], "needs data.name=tokens, not python_source"),
        (["data.name=tokens", "data.path=/a", "data.sources=[{path: /b}]"], "not both"),
        (["data.name=tokens"], "set data.path"),
        (["data.tokenizer=bpe"], "use bytes, bpe:N"),
    ],
)
def test_malformed_token_data_settings_are_refused_by_key(tmp_path, overrides, message):
    from engine.config import load_config

    with pytest.raises(UsageError, match=message):
        load_config(ROOT / "configs" / "llama_tiny.yaml", overrides, str(tmp_path))


@pytest.mark.nocompile
def test_python_source_with_a_bpe_is_tokenized_once_into_the_cache(tmp_path, capsys):
    cfg = DataConfig(
        name="python_source",
        tokenizer="bpe:400",
        cache_dir=str(tmp_path / "cache"),
        max_bytes=300_000,
        seq_len=32,
        eval_fraction=0.1,
    )
    first = load_dataset(cfg)
    assert "tokenizing" in capsys.readouterr().err  # (a progress line: stderr, never in a command's output)
    (corpus,) = (tmp_path / "cache").glob("python-stdlib-bpe400-*")
    made = (corpus / "manifest.json").stat().st_mtime_ns
    again = load_dataset(cfg)
    assert "tokenizing" not in capsys.readouterr().err and (corpus / "manifest.json").stat().st_mtime_ns == made
    assert first.info.vocab_size == again.info.vocab_size == 400 and first.info.text_codec == "tokenizer"
    assert "segments" in first.train.spec and len(first.train) == len(again.train) > 0
    np.testing.assert_array_equal(first.train.sources[0][3]["tokens"], again.train.sources[0][3]["tokens"])


@pytest.mark.nocompile
def test_a_small_corpus_holds_out_one_document_and_symlinked_files_count_once(tmp_path, capsys):
    text = _corpus_files(tmp_path / "text", documents=34)
    (text / "again").mkdir()
    for name in ("doc000.txt", "doc001.txt", "doc002.txt"):  # the same files again through symlinks
        (text / "again" / name).symlink_to(text / name)
    manifest = tokenize([str(text), str(text / "doc005.txt")], str(tmp_path / "tokens"), "bpe:300", progress=False)
    splits = manifest["splits"]
    assert splits["train"]["documents"] + splits["eval"]["documents"] == 34
    assert splits["eval"]["documents"] == 1  # the default 1% of 34 documents, at least one
    assert "the last document is held out" in capsys.readouterr().err  # (notes on stderr, as progress)


@pytest.mark.nocompile
def test_a_corpus_of_one_text_file_holds_out_the_end_of_its_text(tmp_path, capsys):
    from tokenizers import Tokenizer

    one = tmp_path / "book.txt"
    one.write_text(_text(np.random.default_rng(3), 3000))
    out = tmp_path / "tokens"
    manifest = tokenize([str(one)], str(out), "bpe:300", eval_fraction=0.1, progress=False)
    said = capsys.readouterr().err
    splits = manifest["splits"]
    ids = Tokenizer.from_file(str(out / "tokenizer.json")).encode(one.read_text(), add_special_tokens=False).ids
    held = -(-len(ids) // 10)  # a tenth of its tokens, rounded up
    assert (splits["train"]["tokens"], splits["eval"]["tokens"]) == (len(ids) - held + 1, held + 1)  # (+ eod each)
    assert splits["train"]["bytes"] + splits["eval"]["bytes"] == one.stat().st_size
    assert f"holds out its last {held:,} of {len(ids):,} tokens" in said, said
    read = {split: np.fromfile(out / f"{split}-00000.tokens", manifest["dtype"]) for split in ("train", "eval")}
    eod = manifest["eod_id"]
    assert [*read["train"][:-1], *read["eval"][:-1]] == ids and read["train"][-1] == read["eval"][-1] == eod
    cfg = DataConfig(name="tokens", path=str(out), seq_len=16)
    assert len(load_dataset(cfg).eval) > 0  # a run has held-out windows to evaluate


@pytest.mark.nocompile
def test_a_changed_manifest_or_shard_is_refused_by_name(tmp_path):
    corpus = tokenized_corpus(tmp_path, seed=2, documents=12)
    manifest = corpus / "manifest.json"
    original = manifest.read_bytes()
    rng = np.random.default_rng(0)
    for position in rng.choice(len(original) - 1, 25, replace=False):  # one flipped bit each
        damaged = bytearray(original)
        damaged[position] ^= 1 << int(rng.integers(0, 7))
        manifest.write_bytes(bytes(damaged))
        with pytest.raises(UsageError, match="manifest.json"):
            tk.open_corpus(str(corpus))
    for length in (0, 1, len(original) // 2, len(original) - 2):
        manifest.write_bytes(original[:length])
        with pytest.raises(UsageError, match="manifest.json"):
            tk.open_corpus(str(corpus))
    manifest.write_bytes(original)
    tk.open_corpus(str(corpus))
    docs = corpus / "train-00000.docs"
    docs.write_bytes(docs.read_bytes()[:-3])  # a truncated shard
    with pytest.raises(UsageError, match="train-00000.docs: the manifest says"):
        tk.open_corpus(str(corpus), verify=False)


@pytest.mark.nocompile
def test_one_writer_per_out_directory_and_no_silent_phase(tmp_path, monkeypatch, capsys):
    from engine.data import pretokenize as tokenize_module
    from engine.runtime.rundir import WorkdirLock

    text = _corpus_files(tmp_path / "text", documents=6)
    (tmp_path / "out").mkdir()
    with WorkdirLock(tmp_path / "out", job="tokenize"):  # another tokenize writing there now
        with pytest.raises(UsageError, match="in use by another tokenize .*another --out"):
            tokenize([str(text)], str(tmp_path / "out"), "bpe:300", progress=False)
    assert [p.name for p in (tmp_path / "out").iterdir()] == [".lock"]  # nothing of its own written

    slow_bpe = tokenize_module.train_bpe

    def slow(*args):
        time.sleep(0.6)
        return slow_bpe(*args)

    monkeypatch.setattr(tokenize_module, "train_bpe", slow)
    tokenize([str(text)], str(tmp_path / "out"), "bpe:300", progress=False, heartbeat_seconds=0.2)
    assert "tokenize: still training the BPE" in capsys.readouterr().err


@pytest.mark.nocompile
def test_the_shipped_language_model_configs_share_one_stdlib_corpus(make_config):
    from engine.data.text import _stdlib_files, stdlib_corpus_dir

    llama, gpt = (make_config(name).data for name in ("llama_tiny", "gpt_small"))
    files = _stdlib_files(llama.max_bytes)
    assert stdlib_corpus_dir(llama, files) == stdlib_corpus_dir(gpt, _stdlib_files(gpt.max_bytes))


def _tokenize_cli(capsys, *args):
    """(exit code, stderr) of `launch.py tokenize ARGS`, run in this process."""
    from engine.cli import main

    capsys.readouterr()
    code = main(["tokenize", *args, "--tokenizer", "bpe:300", "--no-progress"])
    return code, capsys.readouterr().err


def _refused(capsys, out, *args):
    """The stderr line of an input refused with exit 2, one line, no traceback, nothing in --out."""
    code, err = _tokenize_cli(capsys, "--input", *map(str, args), "--out", str(out))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())
    return err


@pytest.mark.nocompile
def test_files_that_are_not_text_are_refused_and_replaced_bytes_are_counted(tmp_path, capsys):
    out = tmp_path / "out"
    binary = tmp_path / "model.bin"
    binary.write_bytes(np.arange(20_000, dtype=np.int32).tobytes())  # NUL bytes from the start
    assert f"--input {binary} is a binary file (a NUL byte in its first 8 KiB)" in _refused(capsys, out, binary)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café crème brûlée à la française. ".encode("latin-1") * 300)
    err = _refused(capsys, out, latin1)
    assert f"--input {latin1} is not UTF-8 text: more than 1% of its {latin1.stat().st_size:,} bytes" in err
    assert "iconv" in err
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "ok.txt").write_text("fine text")
    (tmp_path / "dir" / "skipped.pyc").write_bytes(binary.read_bytes())  # a directory's binary files are left out
    (tmp_path / "dir" / "z.txt").write_bytes(latin1.read_bytes())  # but not its files of bad text
    assert "z.txt is not UTF-8 text" in _refused(capsys, out, tmp_path / "dir")

    text = "ordinary words, ünïcödé and \ufffd itself. ".encode() * 300  # a real U+FFFD is text
    cut = text.index(b" ", 9000)  # past the first 8 KiB, between two characters
    (tmp_path / "a.txt").write_bytes(text[:cut] + b"\xff\xfe" + text[cut:] + b"\x00\xe4")
    (tmp_path / "b.txt").write_bytes(text + b"\xc3")  # a sequence cut off by the end of the file
    (tmp_path / "c.txt").write_bytes(text)
    files = [str(tmp_path / name) for name in ("a.txt", "b.txt", "c.txt")]
    code, err = _tokenize_cli(capsys, "--input", *files, "--out", str(out), "--eval-fraction", "0")
    assert code == 0, err
    size = len(text)
    assert err.splitlines() == [
        f"warning: tokenize: {files[0]}: 4 of its {size + 4:,} bytes are not text (3 invalid UTF-8, 1 NUL), "
        "read as U+FFFD",
        f"warning: tokenize: {files[1]}: 1 of its {size + 1:,} bytes are not text (1 invalid UTF-8, 0 NUL), "
        "read as U+FFFD",
    ]
    corpus = tk.open_corpus(str(out))
    from tokenizers import Tokenizer

    stream, tokenizer = corpus.stream("train"), Tokenizer.from_file(str(corpus.tokenizer_file))
    first = tokenizer.decode(stream.read(0, int(stream.doc_ends[0]) - 1).tolist())
    assert "\x00" not in first and first.endswith("\ufffd\ufffd") and first.count("\ufffd") == 300 + 4


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    """A Hugging Face datasets directory (save_to_disk) of 300 rows in two Arrow files."""
    datasets = pytest.importorskip("datasets")
    path = tmp_path_factory.mktemp("hf") / "original"
    datasets.Dataset.from_dict({"text": [f"row {i} of the set" for i in range(300)]}).save_to_disk(
        str(path), num_shards=2
    )
    return path


def _flipped(data: bytes, position: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 0x10
    return bytes(changed)


ARROW = "data-00000-of-00002.arrow"


@pytest.mark.nocompile
@pytest.mark.parametrize(
    "name, damage, message",
    [
        (ARROW, lambda data: data[: len(data) // 2], "cut short: no end-of-stream marker"),
        (ARROW, lambda data: data[:-8], "cut short"),  # cut where a batch ends: pyarrow reads fewer rows
        (ARROW, lambda data: _flipped(data, 10), "(Invalid flatbuffers message"),
        (ARROW, lambda data: _flipped(data, 100), "(its huggingface metadata does not read"),
        ("state.json", lambda _: b'{"_data_files": "data.arrow"}', '(its _data_files are "data.arrow", not a list'),
        ("state.json", lambda _: b'{"_data_files": [{"filename": 3}]}', '(its _data_files are [{"filename": 3}]'),
        ("state.json", lambda _: b'{"_data_files": [{"filename": "../x.arrow"}]}', "not a list of"),
        ("state.json", lambda _: b'{"_data_files": [{"filename": "%s"}, 7]}' % ARROW.encode(), "[{"),
        ("state.json", lambda _: b"[]", "(it holds list, not the JSON object"),
        ("dataset_info.json", lambda _: b'{"features": ', "(not valid JSON"),
        ("dataset_dict.json", lambda _: b'{"splits": "train"}', "(its splits are"),
    ],
    ids=[
        "arrow-cut-in-half",
        "arrow-cut-at-a-batch-end",
        "arrow-header-bit",
        "arrow-metadata-bit",
        "data-files-a-string",
        "filename-a-number",
        "filename-a-path",
        "one-entry-not-an-object",
        "state-a-list",
        "info-not-json",
        "splits-a-string",
    ],
)
def test_a_damaged_datasets_directory_is_refused_by_name(tmp_path, capsys, hf_directory, name, damage, message):
    damaged = tmp_path / "damaged"
    shutil.copytree(hf_directory, damaged)
    path = damaged / name
    path.write_bytes(damage(path.read_bytes() if path.exists() else b""))
    err = _refused(capsys, tmp_path / "out", damaged)
    assert f"{path} is " in err and "damaged" in err and message in err


@pytest.mark.nocompile
def test_bad_input_found_while_reading_leaves_nothing_in_out(tmp_path, capsys):
    (tmp_path / "late.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')  # found by the BPE's reading
    assert "late.jsonl:2: no 'text' field" in _refused(capsys, tmp_path / "new_out", tmp_path / "late.jsonl")
    assert not (tmp_path / "new_out").exists()
    (tmp_path / "empty_out").mkdir()  # an empty --out given: left empty
    _refused(capsys, tmp_path / "empty_out", tmp_path / "late.jsonl")


@pytest.mark.nocompile
def test_a_document_longer_than_the_limit_is_tokenized_in_pieces_at_line_ends(tmp_path, monkeypatch):
    """A 1 GB file or line would make the tokenizer hold ~50 GB: documents longer than
    MAX_DOCUMENT_CHARS come in pieces (cut at line ends where there are some), the text whole;
    a JSON Lines record that long is refused by line."""
    from engine.data import documents as docs

    monkeypatch.setattr(docs, "MAX_DOCUMENT_CHARS", 10)
    (tmp_path / "a.txt").write_text("abc\ndefgh\nijklmnopqrstuvwxyz\n")
    pieces = list(docs.documents([tmp_path / "a.txt"]))
    assert pieces == ["abc\ndefgh\n", "ijklmnopqr", "stuvwxyz\n"] and all(len(p) <= 10 for p in pieces)
    assert list(docs.documents([tmp_path / "a.txt"], text_unit="line")) == ["abc", "defgh", "ijklmnopqr", "stuvwxyz"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["\n" + " " * 12 + "abc"]}), tmp_path / "c.parquet")  # a blank first piece
    assert list(docs.documents([tmp_path / "c.parquet"])) == ["  abc"]  # the blank pieces before it left out
    out = tmp_path / "partial"  # an unfinished tokenization by a version that read documents otherwise
    out.mkdir()
    (out / "progress.json").write_text(json.dumps({"settings": {}, "documents": 3, "splits": {}}))
    with pytest.raises(UsageError, match="unfinished tokenization by an older version of this engine"):
        tokenize([str(tmp_path / "a.txt")], str(out), "bpe:300", progress=False)
    monkeypatch.setattr(docs, "MAX_DOCUMENT_CHARS", 20)
    (tmp_path / "b.jsonl").write_text('{"text": "short"}\n{"text": "far too long here"}\n')
    with pytest.raises(UsageError, match=r"b.jsonl:2: a record longer than 20 characters"):
        list(docs.documents([tmp_path / "b.jsonl"]))
