"""Dataset sources chosen by `data.name`. Each returns a Dataset of in-memory (or
memory-mapped) numpy arrays, indexed by example. Files are read in their real formats:
MNIST IDX, CIFAR-10 binary batches, .npz/.npy (never unpickled) and raw text bytes."""

from __future__ import annotations

import gzip
import importlib.util
import math
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from engine.errors import UsageError

SPLIT_SEED = 20240521  # the held-out split is fixed, whatever the run's seed


@dataclass(frozen=True)
class DataInfo:
    kind: str  # "image" (image, label) or "tokens" (tokens)
    num_train: int
    num_eval: int
    input_shape: tuple[int, ...] = ()  # image: [height, width, channels]
    num_classes: int = 0
    vocab_size: int = 0
    seq_len: int = 0  # tokens the model sees per example
    text_codec: str = ""  # how token ids map to text: "bytes" (ids are UTF-8 bytes), "tokenizer"; "" = not text
    tokenizer: str = ""  # text_codec "tokenizer": the tokenizer.json file
    sources: tuple[str, ...] = ()  # a mixture's source names; batches carry `source` (their index)
    preprocessing: str = ""  # what was done to the stored inputs before the model saw them (export.json says it)


@dataclass(frozen=True)
class Dataset:
    # name → array [examples, ...] in memory (or memory-mapped), or Examples read by index
    # (engine/data/tokens.py: tokenized corpora through Grain)
    train: Any
    eval: Any
    info: DataInfo


def _images(train_x, train_y, eval_x, eval_y, num_classes: Optional[int] = None, scaled: str = "") -> Dataset:
    """scaled: how the source already scaled its pixels (said in DataInfo.preprocessing)."""
    steps = [scaled] if scaled else []
    if train_x.dtype == np.uint8:
        steps.append("uint8 pixels / 255")
    steps.append("float32")
    if train_x.ndim == 3:
        steps.append("a channel axis added: [n, h, w] → [n, h, w, 1]")
    train_x, eval_x = _as_float_images(train_x), _as_float_images(eval_x)
    train_y, eval_y = train_y.astype(np.int32).reshape(-1), eval_y.astype(np.int32).reshape(-1)
    classes = num_classes or int(max(train_y.max(initial=0), eval_y.max(initial=0))) + 1
    info = DataInfo(
        "image",
        len(train_x),
        len(eval_x),
        tuple(train_x.shape[1:]),
        num_classes=classes,
        preprocessing="; ".join(steps),
    )
    return Dataset({"image": train_x, "label": train_y}, {"image": eval_x, "label": eval_y}, info)


def _check_labels(
    labels: np.ndarray,
    num_classes: int,
    where: str,
    name: str = "labels",
    fix: str = "fix the labels, or set data.num_classes to the number of classes",
) -> None:
    """UsageError naming the file, the count and the first bad index unless every label is
    an integer in [0, num_classes) (so nothing wraps when it becomes int32)."""
    if not np.issubdtype(labels.dtype, np.integer):
        raise UsageError(f"{where}: {name} must be integers, got {labels.dtype}")
    flat = labels.reshape(-1)
    bad = np.flatnonzero((flat < 0) | (flat >= num_classes))
    if bad.size:
        raise UsageError(
            f"{where}: {bad.size} of {name} outside [0, {num_classes}), the first at {name}[{bad[0]}] "
            f"(value {flat[bad[0]]}); {fix}"
        )


def _check_finite(inputs: np.ndarray, where: str, name: str = "inputs") -> None:
    if np.issubdtype(inputs.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(inputs.reshape(len(inputs), -1)).all(axis=1))
        if bad.size:
            raise UsageError(
                f"{where}: {bad.size} example(s) of {name} hold NaN or infinite values, the first at "
                f"{name}[{bad[0]}]; clean the data"
            )


def _as_float_images(x: np.ndarray) -> np.ndarray:
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    x = x.astype(np.float32) / scale
    if x.ndim == 3:  # [n, h, w] → [n, h, w, 1]
        x = x[..., None]
    return x


def _split(x: np.ndarray, y: np.ndarray, eval_fraction: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    order = np.random.default_rng(SPLIT_SEED).permutation(len(x))
    n_eval = max(1, int(round(len(x) * eval_fraction)))
    return x[order[n_eval:]], y[order[n_eval:]], x[order[:n_eval]], y[order[:n_eval]]


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images [1797, 8, 8] float64 0..16, labels int): sklearn.datasets.load_digits()'s images
    and target, read from the CSV file scikit-learn ships as load_digits does, without importing
    scikit-learn (its import takes ~2 s, most of the default job's start-up)."""
    spec = importlib.util.find_spec("sklearn")
    locations = (spec.submodule_search_locations if spec else None) or [""]
    path = Path(next(iter(locations), "")) / "datasets" / "data" / "digits.csv.gz"
    if not path.is_file():  # another layout of the package: its own loader
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def digits(cfg) -> Dataset:
    """scikit-learn's handwritten digits (1,797 real 8x8 scans, shipped inside the package)."""
    images, labels = digits_arrays()
    images = (images / 16.0).astype(np.float32)  # pixel values are 0..16
    return _images(
        *_split(images, labels, cfg.eval_fraction),
        num_classes=10,
        scaled="sklearn.datasets.load_digits().images / 16.0 (pixel values 0..16 → 0..1)",
    )


def synthetic(cfg) -> Dataset:
    """Gaussian images labelled by a fixed random linear map: learnable, any shape."""
    rng = np.random.default_rng(SPLIT_SEED)
    shape = tuple(cfg.image_shape)
    n_eval = max(cfg.num_examples // 4, 1)
    x = rng.standard_normal((cfg.num_examples + n_eval, *shape), dtype=np.float32)
    w = rng.standard_normal((int(np.prod(shape)), cfg.num_classes), dtype=np.float32)
    y = np.argmax(x.reshape(len(x), -1) @ w, axis=1)
    return _images(
        x[: cfg.num_examples], y[: cfg.num_examples], x[cfg.num_examples :], y[cfg.num_examples :], cfg.num_classes
    )


def npz(cfg) -> Dataset:
    """A .npz file, or a directory of .npy files, holding x_train, y_train[, x_test, y_test] or x, y."""
    path = Path(cfg.path)
    expected = "arrays x_train, y_train (and optionally x_test, y_test), or x, y"
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as archive:
                arrays = {k: archive[k] for k in archive.files}
        except (ValueError, OSError) as e:
            raise UsageError(f"data.path={path} is not a readable .npz file of {expected}: {e}") from None
    elif path.is_dir():
        arrays = {}
        for file in sorted(path.glob("*.npy")):
            try:
                arrays[file.stem] = np.load(file, allow_pickle=False)
            except (ValueError, OSError) as e:
                raise UsageError(f"{file} is not a readable .npy array: {e}") from None
    else:
        raise UsageError(f"data.path={path} does not exist; expected a .npz file or a directory of .npy files")
    for x_key, y_key in (("x_train", "y_train"), ("x_test", "y_test"), ("x", "y")):
        if x_key in arrays and y_key in arrays and len(arrays[x_key]) != len(arrays[y_key]):
            raise UsageError(
                f"data.path={path}: {x_key} has {len(arrays[x_key])} examples but {y_key} has "
                f"{len(arrays[y_key])}; they must match"
            )
    for x_key, y_key in (("x_train", "y_train"), ("x_test", "y_test"), ("x", "y")):
        if y_key in arrays:  # checked in the file's own indexing, before any split
            _check_labels(arrays[y_key], cfg.num_classes, f"data.path={path}", y_key)
        if x_key in arrays:
            _check_finite(arrays[x_key], f"data.path={path}", x_key)
    if {"x_train", "y_train"} <= arrays.keys():
        if {"x_test", "y_test"} <= arrays.keys():
            parts = arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"]
        else:
            parts = _split(arrays["x_train"], arrays["y_train"], cfg.eval_fraction)
    elif {"x", "y"} <= arrays.keys():
        parts = _split(arrays["x"], arrays["y"], cfg.eval_fraction)
    else:
        raise UsageError(f"data.path={path} holds {sorted(arrays)}; expected {expected}")
    for x, y in (parts[:2], parts[2:]):
        if len(x) != len(y) or x.ndim < 2 or y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
            raise UsageError(
                f"data.path={path}: x must be [n, ...] and y [n] integer labels; "
                f"got x {x.shape} {x.dtype}, y {y.shape} {y.dtype}"
            )
    return _images(*parts, num_classes=cfg.num_classes)


def _read_idx(path: Path, expect_dims: int) -> np.ndarray:
    """One IDX file (the MNIST format: magic 0x0000 08 ndim, big-endian sizes, uint8 data)."""
    raw = path.read_bytes()
    try:
        raw = gzip.decompress(raw) if path.suffix == ".gz" else raw
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise UsageError(
            f"{path} is not a complete gzip file ({e or type(e).__name__}); download it again, or "
            "give the file uncompressed without .gz"
        ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08 or raw[3] != expect_dims:
        raise UsageError(
            f"{path} is not an IDX file of uint8 with {expect_dims} dimension(s) "
            f"(expected magic 0x000008{expect_dims:02x})"
        )
    if len(raw) < 4 + 4 * expect_dims:
        raise UsageError(f"{path} is truncated: {len(raw)} bytes end inside its IDX header")
    dims = [int(d) for d in np.frombuffer(raw, dtype=">u4", count=expect_dims, offset=4)]
    body = raw[4 + 4 * expect_dims :]
    if len(body) != math.prod(dims):  # Python integers: a header of 2**31-sized dimensions cannot overflow
        raise UsageError(
            f"{path} is truncated or padded: header says {tuple(dims)} = {math.prod(dims):,} bytes, "
            f"file has {len(body):,}"
        )
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def _find(directory: Path, stems: tuple[str, ...]) -> Path:
    for stem in stems:
        for name in (stem, stem + ".gz"):
            if (directory / name).is_file():
                return directory / name
    raise UsageError(
        f"{directory} has no {stems[0]}[.gz]; an MNIST/Fashion-MNIST directory holds "
        "train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte"
    )


def idx(cfg) -> Dataset:
    """MNIST or Fashion-MNIST in their original IDX files (optionally gzipped)."""
    directory = _existing_dir(cfg.path, "MNIST-style IDX files")
    parts = []
    for split in ("train", "t10k"):
        images = _read_idx(_find(directory, (f"{split}-images-idx3-ubyte", f"{split}-images.idx3-ubyte")), 3)
        label_file = _find(directory, (f"{split}-labels-idx1-ubyte", f"{split}-labels.idx1-ubyte"))
        labels = _read_idx(label_file, 1)
        _check_labels(labels, 10, str(label_file), fix="MNIST-style IDX labels are digits 0..9; fix the file")
        if len(images) != len(labels):
            raise UsageError(f"{directory}: {split} has {len(images)} images but {len(labels)} labels")
        parts += [images, labels]
    train_x, train_y, eval_x, eval_y = parts
    return _images(train_x, train_y, eval_x, eval_y, num_classes=10)


CIFAR_RECORD = 1 + 3 * 32 * 32  # label byte + 3x32x32 pixels (channel-major)


def _read_cifar(files: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    records = []
    for file in files:
        raw = np.fromfile(file, dtype=np.uint8)
        if raw.size == 0 or raw.size % CIFAR_RECORD:
            raise UsageError(
                f"{file} is not a CIFAR-10 binary batch: {raw.size} bytes is not a multiple of "
                f"{CIFAR_RECORD} (1 label byte + 3072 pixel bytes per image)"
            )
        records.append(raw.reshape(-1, CIFAR_RECORD))
    data = np.concatenate(records)
    if data[:, 0].max() > 9:
        raise UsageError(f"{files[0].parent}: CIFAR-10 labels must be 0..9, found {int(data[:, 0].max())}")
    images = data[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # → [n, h, w, c]
    return images, data[:, 0]


def cifar10(cfg) -> Dataset:
    """CIFAR-10 binary version: data_batch_1..5.bin and test_batch.bin."""
    directory = _existing_dir(cfg.path, "CIFAR-10 binary batches")
    if (directory / "cifar-10-batches-bin").is_dir():
        directory = directory / "cifar-10-batches-bin"
    train_files = sorted(directory.glob("data_batch_*.bin"))
    test_file = directory / "test_batch.bin"
    if not train_files or not test_file.is_file():
        raise UsageError(
            f"{directory} must hold data_batch_1.bin … data_batch_5.bin and test_batch.bin "
            "(the CIFAR-10 binary version)"
        )
    return _images(*_read_cifar(train_files), *_read_cifar([test_file]), num_classes=10)


def _existing_dir(path: str, what: str) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise UsageError(f"data.path={path} is not a directory; expected a directory of {what}")
    return directory


def _windows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """Non-overlapping examples of seq_len + 1 tokens (inputs and shifted targets), as a view."""
    count = max((len(tokens) - 1) // seq_len, 0)
    return np.lib.stride_tricks.as_strided(
        tokens, (count, seq_len + 1), (seq_len * tokens.strides[0], tokens.strides[0]), writeable=False
    )


def _token_dataset(tokens: np.ndarray, cfg, vocab_size: int, where: str, text_codec: str = "") -> Dataset:
    n_eval = int(len(tokens) * cfg.eval_fraction)
    train_tokens, eval_tokens = tokens[: len(tokens) - n_eval], tokens[len(tokens) - n_eval :]
    train, evals = _windows(train_tokens, cfg.seq_len), _windows(eval_tokens, cfg.seq_len)
    if len(train) == 0 or len(evals) == 0:
        raise UsageError(
            f"{where} has {len(tokens)} tokens: too few for data.seq_len={cfg.seq_len} with "
            f"data.eval_fraction={cfg.eval_fraction}; use more text or a shorter seq_len"
        )
    info = DataInfo("tokens", len(train), len(evals), vocab_size=vocab_size, seq_len=cfg.seq_len, text_codec=text_codec)
    return Dataset({"tokens": train}, {"tokens": evals}, info)


def text(cfg) -> Dataset:
    """Byte-level text: a file, or every file under a directory (sorted), as tokens 0..255."""
    path = Path(cfg.path)
    if path.is_file():
        tokens = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    elif path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise UsageError(f"data.path={path} holds no files; expected text files")
        tokens = np.concatenate([np.fromfile(p, dtype=np.uint8) for p in files])
    else:
        raise UsageError(f"data.path={path} does not exist; expected a text file or a directory of them")
    return _token_dataset(tokens, cfg, 256, f"data.path={path}", text_codec="bytes")


def _stdlib_files(max_bytes: int) -> list[Path]:
    files, size = [], 0
    for file in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        files.append(file)
        size += file.stat().st_size
        if size >= max_bytes:
            break
    return files


def python_source(cfg) -> Dataset:
    """The Python standard library's own modules: real text (code and English docstrings)
    present wherever Python is, so it needs no download. data.tokenizer=bytes: byte-level
    tokens of the first max_bytes; bpe:N: a byte-level BPE trained on those files, tokenized
    once (one document per module) into data.cache_dir and read as data.name=tokens."""
    files = _stdlib_files(cfg.max_bytes)
    stdlib = files[0].parent
    if cfg.tokenizer != "bytes":
        return _tokens_dataset(cfg, [(str(_stdlib_corpus(cfg, files)), 1.0, "python_source")])
    tokens = np.concatenate([np.fromfile(file, dtype=np.uint8) for file in files])
    return _token_dataset(tokens[: cfg.max_bytes], cfg, 256, f"the Python library at {stdlib}", text_codec="bytes")


def _stdlib_corpus(cfg, files: list[Path]) -> Path:
    """The tokenized corpus of `files` in the cache (made on first use; a lock keeps two
    processes from making it at once)."""
    import fcntl
    import hashlib

    from engine.data.tokenize import tokenize

    key = hashlib.sha256(
        repr([cfg.tokenizer, cfg.eval_fraction, [(str(f), f.stat().st_size) for f in files]]).encode()
    ).hexdigest()[:16]
    out = Path(cfg.cache_dir).expanduser() / f"python-stdlib-{cfg.tokenizer.replace(':', '')}-{key}"
    if not (out / "manifest.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (out / "manifest.json").is_file():
                print(
                    f"data: tokenizing {len(files)} Python modules with a {cfg.tokenizer} tokenizer into {out} "
                    "(once; later runs reuse it)",
                    flush=True,
                )
                tokenize(
                    [str(f) for f in files], str(out), cfg.tokenizer, eval_fraction=cfg.eval_fraction, progress=False
                )
    return out


def source_name(source: dict, index: int) -> str:
    """A mixture source's name in metrics: its `name`, else its directory's name."""
    return str(source.get("name") or Path(str(source["path"])).name or f"source{index}")


def tokens(cfg) -> Dataset:
    """Tokenized corpora (`python launch.py tokenize`): data.path, or a mixture in data.sources."""
    if cfg.sources:
        return _tokens_dataset(
            cfg, [(str(s["path"]), float(s.get("weight", 1.0)), source_name(s, i)) for i, s in enumerate(cfg.sources)]
        )
    return _tokens_dataset(cfg, [(cfg.path, 1.0, Path(cfg.path).name)])


def _tokens_dataset(cfg, sources: list[tuple[str, float, str]]) -> Dataset:
    from engine.data import tokens as tk

    where = "data.path" if len(sources) == 1 else "data.sources"
    corpora = [tk.open_corpus(path, cfg.verify, where) for path, _, _ in sources]
    first = corpora[0]
    for corpus, (path, _, _) in zip(corpora[1:], sources[1:]):
        if corpus.tokenizer_file.read_bytes() != first.tokenizer_file.read_bytes():
            raise UsageError(
                f"data.sources: {path} was tokenized with another tokenizer than {sources[0][0]}; "
                "a mixture's corpora must share one tokenizer"
            )
    mixed = len(sources) > 1
    train, evals = [], []
    for k, (corpus, (path, _, _)) in enumerate(zip(corpora, sources)):
        source = k if mixed else None
        train.append(tk.Windows(corpus.stream("train"), cfg.seq_len, cfg.packing, source))
        evals.append(tk.Windows(corpus.stream("eval"), cfg.seq_len, cfg.packing, source))
        if len(train[-1]) == 0:
            raise UsageError(
                f"{where}: {path} has {corpus.stream('train').size} train tokens: too few for "
                f"data.seq_len={cfg.seq_len}; use more text or a shorter seq_len"
            )
    evals = [w for w in evals if len(w)]
    if not evals:
        raise UsageError(
            f"{where}: no held-out windows of data.seq_len={cfg.seq_len} tokens; tokenize with a "
            "larger --eval-fraction or use a shorter seq_len"
        )
    info = DataInfo(
        "tokens",
        sum(len(w) for w in train),
        sum(len(w) for w in evals),
        vocab_size=first.vocab_size,
        seq_len=cfg.seq_len,
        text_codec="tokenizer",
        tokenizer=str(first.tokenizer_file),
        sources=tuple(name for _, _, name in sources) if mixed else (),
    )
    return Dataset(tk.Mixture(train, [w for _, w, _ in sources]), tk.eval_examples(evals), info)


def synthetic_text(cfg) -> Dataset:
    """A stream of 64 fixed random 6-token "words" in random order: within a word the next
    token is predictable from the context, so the loss can fall well below log(vocab)."""
    rng = np.random.default_rng(SPLIT_SEED)
    length = int(cfg.num_examples * 1.25) * cfg.seq_len + 1
    words = rng.integers(0, cfg.vocab_size, (64, 6), dtype=np.int32)
    tokens = words[rng.integers(0, len(words), length // 6 + 1)].reshape(-1)[:length]
    return _token_dataset(tokens, cfg, cfg.vocab_size, "data.name=synthetic_text")


SOURCES = {
    "digits": digits,
    "synthetic": synthetic,
    "npz": npz,
    "idx": idx,
    "cifar10": cifar10,
    "text": text,
    "synthetic_text": synthetic_text,
    "python_source": python_source,
    "tokens": tokens,
}

FILE_SOURCES = ("npz", "idx", "cifar10", "text", "tokens")  # the sources that read data.path
MIXTURE_SOURCES = ("tokens",)  # the sources that read a weighted mixture from data.sources


def load_dataset(cfg) -> Dataset:
    """The dataset named by cfg.name (a DataConfig)."""
    return SOURCES[cfg.name](cfg)
