"""Helpers of tests/**/test_data*.py that other test files (or its other tiers) share."""

import gzip
import struct

import numpy as np


def write_idx(path, array, gz=False):
    header = struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def make_mnist_dir(directory, n_train=30, n_test=10, gz=False):
    rng = np.random.default_rng(0)
    suffix = ".gz" if gz else ""
    for split, n in (("train", n_train), ("t10k", n_test)):
        write_idx(directory / f"{split}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28)), gz)
        write_idx(directory / f"{split}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, (n,)), gz)
    return directory
