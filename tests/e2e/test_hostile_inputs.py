"""Hostile or damaged Hugging Face directories given to import-hf: weight files outside the
directory, safetensors headers that lie about sizes, damaged JSON. Each is refused with exit 2
and one line naming the file, before anything is read or allocated."""

import json
import struct

from support.cli import run_cli
from support.fuzz_cli import refused_in_one_line, run_in_one_process
from support.llama import TINY, write_hf_checkpoint

from models.llama import LlamaConfig


def _import(hf, workdir) -> list[str]:
    return ["import-hf", str(hf), "--workdir", str(workdir), "data.name=synthetic_text"]


def _refused(proc, *words):
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr


def _header(path, header: dict, data: bytes = b""):
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


HEADERS = {  # a safetensors header that lies: (header, data, what the line says)
    # a 4 TB tensor in a file of a few bytes: refused before any allocation
    "4TB": (
        {"w": {"dtype": "F32", "shape": [1 << 20, 1 << 20], "data_offsets": [0, 4 << 40]}},
        b"\0" * 16,
        "lie outside",
    ),
    "shape-size": ({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 16]}}, b"\0" * 16, "does not match"),
    "dtype": ({"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "known dtype"),
    "shape-type": (
        {"w": {"dtype": "F32", "shape": "big", "data_offsets": [0, 4]}},
        b"\0" * 4,
        "is not a list of sizes",
    ),
}


def test_hostile_hugging_face_directories_and_non_finite_sample_numbers_are_refused_in_one_line(tmp_path):
    """Weight files outside the directory (an index naming ../ paths, a symlink), safetensors
    headers that lie, damaged JSON, and sample's non-finite numbers: each is exit 2, one line
    naming the file or flag, no traceback, nothing written. Two of them through launch.py in a
    process of their own (the exit code and stderr a user sees), the rest through the CLI's
    main in one process (tests/support/fuzz_cli.py)."""
    cases = []  # (argv, the words its line must say)

    def hf(name, shards=1):
        write_hf_checkpoint(tmp_path / name, LlamaConfig(**TINY), vocab=256, shards=shards)
        return tmp_path / name

    (tmp_path / "secret.safetensors").write_bytes(b"not for the importer")
    for name, target, words in (
        ("passwd", "../../../../../../../../etc/passwd", ["outside the Hugging Face directory", "/etc/passwd"]),
        ("secret", "../secret.safetensors", ["outside the Hugging Face directory"]),
    ):
        index = hf(name, shards=2) / "model.safetensors.index.json"
        weight_map = json.loads(index.read_text())["weight_map"]
        weight_map[sorted(weight_map)[0]] = target
        index.write_text(json.dumps({"weight_map": weight_map}))
        cases.append((_import(index.parent, tmp_path / f"run-{name}"), words))

    weights = hf("symlink") / "model.safetensors"
    weights.rename(tmp_path / "elsewhere.safetensors")
    weights.symlink_to(tmp_path / "elsewhere.safetensors")
    cases.append((_import(weights.parent, tmp_path / "run-symlink"), ["outside the Hugging Face directory"]))

    for name, (header, data, expected) in HEADERS.items():
        _header(hf(name) / "model.safetensors", header, data)
        cases.append((_import(tmp_path / name, tmp_path / f"run-{name}"), ["model.safetensors", expected]))

    # a header larger than the file, a header that is not JSON, a config.json that is not JSON
    hf("large").joinpath("model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    cases.append((_import(tmp_path / "large", tmp_path / "run-large"), ["model.safetensors", "the header claims"]))
    hf("notjson").joinpath("model.safetensors").write_bytes(struct.pack("<Q", 4) + b"{{{{")
    cases.append((_import(tmp_path / "notjson", tmp_path / "run-notjson"), ["model.safetensors", "not valid JSON"]))
    hf("config").joinpath("config.json").write_text("{not json")
    cases.append((_import(tmp_path / "config", tmp_path / "run-config"), ["config.json", "not valid JSON"]))

    for flag, value in (("--temperature", "nan"), ("--temperature", "inf"), ("--top-p", "nan")):
        cases.append((["sample", "--workdir", str(tmp_path / "none"), "--prompt", "x", flag, value], [flag]))

    (first_argv, first_words), *rest = cases
    _refused(run_cli(*first_argv), *first_words)  # the /etc/passwd index, through launch.py
    *rest, (last_argv, last_words) = rest
    _refused(run_cli(*last_argv), *last_words)  # sample --top-p nan, through launch.py
    results = run_in_one_process(tmp_path, [{"argv": argv} for argv, _ in rest])
    assert len(results) == len(rest) == 11
    for result, (_, words) in zip(results, rest):
        refused_in_one_line(result, *words)
    assert not list(tmp_path.glob("run-*/checkpoints")) and not (tmp_path / "none").exists()


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
