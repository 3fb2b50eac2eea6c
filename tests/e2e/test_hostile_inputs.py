"""Hostile or damaged Hugging Face directories given to import-hf: weight files outside the
directory, safetensors headers that lie about sizes, damaged JSON. Each is refused with exit 2
and one line naming the file, before anything is read or allocated."""

import json
import struct

import pytest
from support.cli import run_cli
from support.llama import TINY, write_hf_checkpoint

from models.llama import LlamaConfig


def _import(tmp_path):
    return run_cli("import-hf", str(tmp_path / "hf"), "--workdir", str(tmp_path / "run"), "data.name=synthetic_text")


def _refused(proc, *words):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def test_an_index_naming_a_file_outside_the_directory_is_refused(tmp_path):
    write_hf_checkpoint(tmp_path / "hf", LlamaConfig(**TINY), vocab=256, shards=2)
    (tmp_path / "secret.safetensors").write_bytes(b"not for the importer")
    index = tmp_path / "hf" / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    first = sorted(weight_map)[0]
    weight_map[first] = "../../../../../../../../etc/passwd"
    index.write_text(json.dumps({"weight_map": weight_map}))
    _refused(_import(tmp_path), "outside the Hugging Face directory", "/etc/passwd")
    weight_map[first] = "../secret.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    _refused(_import(tmp_path), "outside the Hugging Face directory")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_symlinked_weight_file_pointing_outside_is_refused(tmp_path):
    write_hf_checkpoint(tmp_path / "hf", LlamaConfig(**TINY), vocab=256)
    weights = tmp_path / "hf" / "model.safetensors"
    weights.rename(tmp_path / "elsewhere.safetensors")
    weights.symlink_to(tmp_path / "elsewhere.safetensors")
    _refused(_import(tmp_path), "outside the Hugging Face directory")


def _header(path, header: dict, data: bytes = b""):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize(
    "header, data, expected",
    [
        # a 4 TB tensor in a file of a few bytes: refused before any allocation
        ({"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 4 << 40]}}, b"\0" * 16, "lie outside"),
        ({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 16]}}, b"\0" * 16, "does not match"),
        ({"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "known dtype"),
        ({"w": {"dtype": "F32", "shape": "big", "data_offsets": [0, 4]}}, b"\0" * 4, "is not a list of sizes"),
    ],
    ids=["4TB", "shape-size", "dtype", "shape-type"],
)
def test_safetensors_headers_that_lie_are_refused_naming_the_file(tmp_path, header, data, expected):
    write_hf_checkpoint(tmp_path / "hf", LlamaConfig(**TINY), vocab=256)
    _header(tmp_path / "hf" / "model.safetensors", header, data)
    _refused(_import(tmp_path), "model.safetensors", expected)


def test_a_header_larger_than_the_file_or_not_json_is_refused(tmp_path):
    write_hf_checkpoint(tmp_path / "hf", LlamaConfig(**TINY), vocab=256)
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    _refused(_import(tmp_path), "model.safetensors", "the header claims")
    weights.write_bytes(struct.pack("<Q", 4) + b"{{{{")
    _refused(_import(tmp_path), "model.safetensors", "not valid JSON")
    (tmp_path / "hf" / "config.json").write_text("{not json")
    _refused(_import(tmp_path), "config.json", "not valid JSON")


@pytest.mark.parametrize("flag, value", [("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan")])
def test_sample_refuses_numbers_that_are_not_finite(tmp_path, flag, value):
    proc = run_cli("sample", "--workdir", str(tmp_path / "none"), "--prompt", "x", flag, value)
    _refused(proc, flag)


def test_tokenize_ends_in_seconds_on_a_4mb_document_of_one_line_and_reruns_identically(tmp_path):
    """Before: BPE training on one 4 MB 'word' ran for 48 minutes. Runs without white space are
    cut into pieces of engine.data.pretokenize.MAX_PIECE characters before training."""
    import time

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one_line.txt").write_text("ab" * 2_000_000)
    outputs = []
    for attempt in ("a", "b"):
        began = time.time()
        proc = run_cli(
            "tokenize",
            "--input",
            str(tmp_path / "in"),
            "--out",
            str(tmp_path / attempt),
            "--tokenizer",
            "bpe:300",
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert time.time() - began < 60
        files = {p.name: p.read_bytes() for p in sorted((tmp_path / attempt).rglob("*")) if p.is_file()}
        outputs.append(files)
    assert outputs[0] == outputs[1] and len(outputs[0]) >= 2
