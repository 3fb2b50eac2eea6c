"""Dataset sources chosen by `data.name`. Each returns a Dataset of in-memory (or
memory-mapped) numpy arrays, indexed by example. Files are read in their real formats:
MNIST IDX, CIFAR-10 binary batches, .npz/.npy (never unpickled); the text sources are
engine/data/text.py's. SOURCES is the registry `data.name` chooses from."""

from __future__ import annotations

import gzip
import importlib.util
import math
import zlib
from pathlib import Path
from typing import Optional

import numpy as np

from engine.data.base import SPLIT_SEED, DataInfo, Dataset, existing_dir
from engine.data.chat_data import chat
from engine.data.preferences import preferences
from engine.data.prompts import prompts
from engine.data.table import table
from engine.data.text import python_source, synthetic_text, text, tokens
from engine.errors import UsageError


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
    directory = existing_dir(cfg.path, "MNIST-style IDX files")
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
    directory = existing_dir(cfg.path, "CIFAR-10 binary batches")
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
    "table": table,
    "chat": chat,
    "preferences": preferences,
    "prompts": prompts,
}

# the sources that read data.path
FILE_SOURCES = ("npz", "idx", "cifar10", "text", "tokens", "table", "chat", "preferences", "prompts")
MIXTURE_SOURCES = ("tokens",)  # the sources that read a weighted mixture from data.sources
# the sources that read their held-out split from data.eval_path
EVAL_PATH_SOURCES = ("table", "text", "chat", "preferences", "prompts")


def load_dataset(cfg) -> Dataset:
    """The dataset named by cfg.name (a DataConfig)."""
    return SOURCES[cfg.name](cfg)
