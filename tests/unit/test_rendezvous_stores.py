"""The rendezvous's backends (engine/elastic/stores.py): compare-and-set with a fencing token, on
a shared directory and on a real etcd server; and how --rendezvous names one."""

import sys
import threading
import time

import pytest
from support.etcd_server import etcd_server  # noqa: F401 (a fixture)

from engine.elastic.rendezvous import Store
from engine.elastic.stores import EtcdBackend, FileBackend, backend_for
from engine.errors import UsageError

pytestmark = pytest.mark.nocompile


@pytest.fixture(params=["directory", "etcd"])
def backend(request, tmp_path):
    if request.param == "directory":
        return FileBackend(tmp_path / "rendezvous")
    address = request.getfixturevalue("etcd_server")
    return backend_for(f"etcd://{address}/jobs/test")


def test_a_write_takes_only_with_the_token_of_the_state_it_replaces(backend):
    assert backend.get_state() == (None, None)
    state, first, written = backend.set_state(b"one", None)  # None: only when nothing is there yet
    assert (state, written) == (b"one", True) and backend.get_state() == (b"one", first)
    assert backend.set_state(b"other", None) == (b"one", first, False)  # someone wrote first: told what is there
    state, second, written = backend.set_state(b"two", first)
    assert (state, written) == (b"two", True) and second != first
    assert backend.set_state(b"stale", first) == (b"two", second, False)  # a stale token writes nothing
    assert backend.get_state() == (b"two", second)


def test_writers_at_once_lose_no_update(backend):
    """Four threads raising one counter 25 times each through the compare-and-set retry loop."""
    store = Store(backend)

    def add_one(state):
        count = state["members"].get("count", {"n": 0})
        state["members"]["count"] = {"n": count["n"] + 1}

    def raise_counter():
        for _ in range(25):
            store.update(add_one)

    threads = [threading.Thread(target=raise_counter) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert store.read()[0]["members"]["count"] == {"n": 100}


def test_rendezvous_names_a_directory_or_an_etcd_prefix(tmp_path, monkeypatch):
    assert isinstance(backend_for(str(tmp_path / "dir")), FileBackend)
    assert isinstance(backend_for("etcd://127.0.0.1:1/jobs/a"), EtcdBackend)  # (connects at its first request)
    for bad in ("etcd://host:2379", "etcd://:2379/jobs", "etcd://host:port/jobs"):
        with pytest.raises(UsageError, match=r"an etcd rendezvous is etcd://HOST:PORT/PREFIX"):
            backend_for(bad)
    monkeypatch.setitem(sys.modules, "etcd3gw.client", None)  # the client not installed
    with pytest.raises(UsageError, match=r"pip install 'jax-train-engine\[elastic\]'"):
        backend_for("etcd://127.0.0.1:2379/jobs/a")
    (tmp_path / "file").write_text("x\n")
    with pytest.raises(UsageError, match=r"not a directory this pod can use"):
        backend_for(str(tmp_path / "file"))


def test_an_etcd_that_cannot_be_reached_is_tried_again_then_named(monkeypatch):
    pytest.importorskip("etcd3gw")
    from engine.elastic import stores

    monkeypatch.setattr(stores, "RETRY_SECONDS", 1.0)
    began = time.monotonic()
    with pytest.raises(ConnectionError, match=r"etcd at etcd://127.0.0.1:1/jobs/a cannot be reached: reading"):
        backend_for("etcd://127.0.0.1:1/jobs/a").get_state()
    assert time.monotonic() - began >= 1.0  # (tried again for RETRY_SECONDS first)
