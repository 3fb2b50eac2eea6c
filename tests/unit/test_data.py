import dataclasses
import gzip

import numpy as np
import pytest
from support.data import make_mnist_dir

from engine.config import DataConfig
from engine.data import Prefetcher, TrainBatches, eval_batches, load_dataset, process_rows
from engine.data.sources import digits_arrays
from engine.errors import UsageError

pytestmark = pytest.mark.nocompile  # reading and batching data compiles nothing


def write_cifar(path, n, rng):
    labels = rng.integers(0, 10, (n, 1), dtype=np.uint8)
    pixels = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
    path.write_bytes(np.concatenate([labels, pixels], axis=1).tobytes())
    return labels[:, 0], pixels


def test_digits_is_the_real_embedded_dataset():
    ds = load_dataset(DataConfig(name="digits", eval_fraction=0.2))
    assert ds.info.num_train + ds.info.num_eval == 1797
    assert ds.info.input_shape == (8, 8, 1) and ds.info.num_classes == 10
    assert 0.0 <= ds.train["image"].min() and ds.train["image"].max() <= 1.0


def test_digits_are_read_as_scikit_learn_loads_them():
    """The engine reads scikit-learn's digits file itself (importing scikit-learn takes ~2 s)."""
    from sklearn.datasets import load_digits

    images, labels = digits_arrays()
    bunch = load_digits()
    np.testing.assert_array_equal(images, bunch.images)
    np.testing.assert_array_equal(labels, bunch.target)


def test_synthetic_has_requested_shapes():
    ds = load_dataset(DataConfig(name="synthetic", image_shape=[4, 4, 3], num_classes=5, num_examples=100))
    assert ds.train["image"].shape == (100, 4, 4, 3) and ds.info.num_classes == 5
    assert set(np.unique(ds.train["label"])) <= set(range(5))


@pytest.mark.parametrize("gz", [False, True])
def test_idx_reads_mnist_format(tmp_path, gz):
    make_mnist_dir(tmp_path, gz=gz)
    ds = load_dataset(DataConfig(name="idx", path=str(tmp_path)))
    assert ds.train["image"].shape == (30, 28, 28, 1) and ds.eval["image"].shape == (10, 28, 28, 1)
    raw = np.frombuffer(
        (gzip.decompress if gz else bytes)((tmp_path / f"train-images-idx3-ubyte{'.gz' if gz else ''}").read_bytes())[
            16:
        ],
        np.uint8,
    )
    np.testing.assert_allclose(ds.train["image"].reshape(-1), raw / 255.0, rtol=1e-6)


def test_idx_truncated_file_is_a_usage_error(tmp_path):
    make_mnist_dir(tmp_path)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(UsageError, match="train-images-idx3-ubyte is truncated"):
        load_dataset(DataConfig(name="idx", path=str(tmp_path)))


def test_idx_wrong_magic_and_missing_dir(tmp_path):
    make_mnist_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").write_bytes(b"\x01\x02\x03\x04garbage")
    with pytest.raises(UsageError, match="is not an IDX file"):
        load_dataset(DataConfig(name="idx", path=str(tmp_path)))
    with pytest.raises(UsageError, match="is not a directory"):
        load_dataset(DataConfig(name="idx", path=str(tmp_path / "missing")))


def test_cifar10_binary_batches(tmp_path):
    rng = np.random.default_rng(1)
    labels, pixels = write_cifar(tmp_path / "data_batch_1.bin", 6, rng)
    write_cifar(tmp_path / "data_batch_2.bin", 4, rng)
    write_cifar(tmp_path / "test_batch.bin", 5, rng)
    ds = load_dataset(DataConfig(name="cifar10", path=str(tmp_path)))
    assert ds.train["image"].shape == (10, 32, 32, 3) and ds.eval["image"].shape == (5, 32, 32, 3)
    np.testing.assert_array_equal(ds.train["label"][:6], labels)
    # channel-major on disk → channels-last in memory
    np.testing.assert_allclose(ds.train["image"][0, :, :, 1].reshape(-1), pixels[0, 1024:2048] / 255.0, rtol=1e-6)


def test_cifar10_malformed_batch(tmp_path):
    (tmp_path / "data_batch_1.bin").write_bytes(b"\x00" * 3000)
    (tmp_path / "test_batch.bin").write_bytes(b"\x00" * 3073)
    with pytest.raises(UsageError, match="data_batch_1.bin is not a CIFAR-10 binary batch"):
        load_dataset(DataConfig(name="cifar10", path=str(tmp_path)))


def test_npz_file_and_npy_directory(tmp_path):
    rng = np.random.default_rng(2)
    x, y = rng.random((20, 5, 5), dtype=np.float32), rng.integers(0, 3, 20)
    np.savez(tmp_path / "data.npz", x=x, y=y)
    ds = load_dataset(DataConfig(name="npz", path=str(tmp_path / "data.npz"), eval_fraction=0.25))
    assert ds.info.num_train == 15 and ds.info.num_eval == 5 and ds.info.input_shape == (5, 5, 1)
    npy_dir = tmp_path / "arrays"
    npy_dir.mkdir()
    for name, arr in (("x_train", x), ("y_train", y), ("x_test", x[:4]), ("y_test", y[:4])):
        np.save(npy_dir / f"{name}.npy", arr)
    ds = load_dataset(DataConfig(name="npz", path=str(npy_dir)))
    np.testing.assert_array_equal(ds.eval["label"], y[:4])


def test_npz_refuses_pickles_and_wrong_keys(tmp_path):
    np.save(tmp_path / "x.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "y.npy", np.arange(1))
    with pytest.raises(UsageError, match="x.npy is not a readable .npy array"):
        load_dataset(DataConfig(name="npz", path=str(tmp_path)))
    np.savez(tmp_path / "other.npz", features=np.zeros((3, 2)))
    with pytest.raises(UsageError, match=r"holds \['features'\]; expected arrays x_train"):
        load_dataset(DataConfig(name="npz", path=str(tmp_path / "other.npz")))


def test_text_bytes_become_shifted_windows(tmp_path):
    (tmp_path / "a.txt").write_bytes(bytes(range(100)))
    (tmp_path / "b.txt").write_bytes(bytes(range(100, 200)))
    ds = load_dataset(DataConfig(name="text", path=str(tmp_path), seq_len=8, eval_fraction=0.1))
    assert ds.info.vocab_size == 256 and ds.info.seq_len == 8
    first = ds.train["tokens"][0]
    assert first.shape == (9,) and list(first) == list(range(9))
    assert list(ds.train["tokens"][1]) == list(range(8, 17))  # windows overlap by the one target token
    with pytest.raises(UsageError, match="too few for data.seq_len=500"):
        load_dataset(DataConfig(name="text", path=str(tmp_path / "a.txt"), seq_len=500))


def test_synthetic_text_is_deterministic():
    a = load_dataset(DataConfig(name="synthetic_text", seq_len=16, num_examples=64, vocab_size=32))
    b = load_dataset(DataConfig(name="synthetic_text", seq_len=16, num_examples=64, vocab_size=32))
    np.testing.assert_array_equal(a.train["tokens"], b.train["tokens"])
    assert a.train["tokens"].max() < 32


def test_batches_are_a_function_of_seed_and_step():
    arrays = {"x": np.arange(100)}
    batches = TrainBatches(arrays, 8, seed=3)
    again = TrainBatches(arrays, 8, seed=3)
    for step in (0, 5, 11, 12, 40):  # 12 steps per epoch: 11 and 12 straddle an epoch
        np.testing.assert_array_equal(batches(step)["x"], again(step)["x"])
    epoch0 = np.concatenate([batches(s)["x"] for s in range(12)])
    assert len(set(epoch0)) == 96  # each example at most once per epoch, remainder dropped
    assert not np.array_equal(batches(0)["x"], TrainBatches(arrays, 8, seed=4)(0)["x"])
    assert not np.array_equal(batches(0)["x"], batches(12)["x"])  # reshuffled each epoch


def test_process_rows_partition_the_global_batch():
    arrays = {"x": np.arange(64)}
    whole = TrainBatches(arrays, 16, seed=0)(3)["x"]
    parts = [TrainBatches(arrays, 16, seed=0, rows=np.arange(4 * i, 4 * i + 4))(3)["x"] for i in range(4)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    evals = list(eval_batches({"x": np.arange(10)}, 4, rows=np.array([2, 3])))
    assert [b["x"].tolist() for b in evals] == [[2, 3], [6, 7], [9, 9]]
    assert evals[-1]["mask"].tolist() == [0, 0]


class ProcessView:
    """A sharding as one process of a multi-host job sees it: only some devices' slices."""

    def __init__(self, slices):
        self.slices = slices

    def addressable_devices_indices_map(self, shape):
        return {device: (piece,) for device, piece in enumerate(self.slices)}


def test_process_rows_follow_the_sharding(mesh2x4):
    from jax.sharding import NamedSharding, PartitionSpec

    rows = process_rows(NamedSharding(mesh2x4, PartitionSpec(("data", "fsdp"))), 16)
    np.testing.assert_array_equal(rows, np.arange(16))  # one process holds every row
    # a process whose two devices hold rows 4..7 and 12..15 (devices interleaved over hosts)
    np.testing.assert_array_equal(
        process_rows(ProcessView([slice(4, 8), slice(12, 16)]), 16), [4, 5, 6, 7, 12, 13, 14, 15]
    )
    # pmap's [devices, rows per device] layout: device slots 1 and 3 of 4, 8 rows each
    np.testing.assert_array_equal(
        process_rows(ProcessView([slice(1, 2), slice(3, 4)]), 32, per_row=8), list(range(8, 16)) + list(range(24, 32))
    )
    # replicas on two devices of the process ask for the same rows once
    np.testing.assert_array_equal(process_rows(ProcessView([slice(0, 4), slice(0, 4)]), 8), [0, 1, 2, 3])


def test_batch_larger_than_dataset_is_a_usage_error():
    with pytest.raises(UsageError, match="larger than the training split"):
        TrainBatches({"x": np.arange(10)}, 16, seed=0)


def test_eval_batches_pad_and_mask():
    batches = list(eval_batches({"x": np.arange(10)}, 4))
    assert len(batches) == 3
    assert batches[-1]["mask"].tolist() == [1, 1, 0, 0]
    assert sum(b["mask"].sum() for b in batches) == 10


def test_prefetcher_yields_in_order_from_any_start_and_reraises():
    prefetch = Prefetcher(lambda step: step * 10, start_step=5, depth=3)
    assert [next(prefetch) for _ in range(4)] == [50, 60, 70, 80]
    prefetch.close()

    def failing(step):
        if step == 2:
            raise ValueError("bad batch")
        return step

    prefetch = Prefetcher(failing, 0, depth=2)
    assert next(prefetch) == 0 and next(prefetch) == 1
    with pytest.raises(ValueError, match="bad batch"):
        next(prefetch)
    prefetch.close()


def test_data_eval_path_holds_out_its_own_files_and_trains_on_all_of_data_path(tmp_path):
    """data.eval_path: a table's held-out rows and byte-level text's held-out windows come from
    their own file; every row (byte) of data.path trains; other sources refuse the key."""
    header, rows = "x,label", [f"{i}.5,{'ab'[i % 2]}" for i in range(20)]
    (tmp_path / "train.csv").write_text("\n".join([header, *rows[:15]]) + "\n")
    (tmp_path / "eval.csv").write_text("\n".join([header, *rows[15:]]) + "\n")
    table = DataConfig(
        name="table", path=str(tmp_path / "train.csv"), eval_path=str(tmp_path / "eval.csv"), label="x",
        target="regression", features=[{"name": "x", "kind": "numeric"}],
    )  # fmt: skip
    ds = load_dataset(table)
    assert (ds.info.num_train, ds.info.num_eval) == (15, 5)
    np.testing.assert_array_equal(ds.eval["label"], [15.5, 16.5, 17.5, 18.5, 19.5])  # the file's rows, in order
    np.testing.assert_array_equal(np.sort(ds.train["label"]), [i + 0.5 for i in range(15)])

    (tmp_path / "a.txt").write_bytes(bytes(range(65, 65 + 25)) * 4)  # 100 bytes
    (tmp_path / "b.txt").write_bytes(b"z" * 33)
    ds = load_dataset(
        DataConfig(name="text", path=str(tmp_path / "a.txt"), eval_path=str(tmp_path / "b.txt"), seq_len=8)
    )
    assert (ds.info.num_train, ds.info.num_eval) == (99 // 8, 32 // 8)
    assert (ds.eval["tokens"] == ord("z")).all()
    with pytest.raises(UsageError, match="overlaps data.path"):
        load_dataset(DataConfig(name="text", path=str(tmp_path), eval_path=str(tmp_path / "b.txt"), seq_len=8))
    with pytest.raises(UsageError, match="data.eval_path and data.path both name"):
        load_dataset(dataclasses.replace(table, eval_path=str(tmp_path / "train.csv")))
    with pytest.raises(UsageError, match="data.eval_path: data.name=digits takes its held-out split otherwise"):
        from engine.config import load_config

        load_config("mnist_mlp", [f"data.eval_path={tmp_path / 'b.txt'}"], str(tmp_path / "run"))
