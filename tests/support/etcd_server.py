"""A real etcd server for the tests (Debian's etcd-server; .ci/run installs it): started in a
temporary folder on free 127.0.0.1 ports, stopped after. `etcd_server` skips the test cleanly when
the etcd binary or the etcd3gw client is missing."""

import shutil
import socket
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_etcd(folder: Path):
    """Yields "127.0.0.1:PORT" of an etcd server whose data lives in `folder`."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("the etcd binary is not installed (apt-get install etcd-server; .ci/run installs it)")
    pytest.importorskip("etcd3gw", reason="the etcd client: pip install 'jax-train-engine[elastic]'")
    from etcd3gw.client import Etcd3Client
    from etcd3gw.exceptions import Etcd3Exception

    client, peer = _free_port(), _free_port()
    url, peer_url = f"http://127.0.0.1:{client}", f"http://127.0.0.1:{peer}"
    log = open(folder / "etcd.log", "w")
    server = subprocess.Popen(
        [
            binary,
            "--name=test",
            f"--data-dir={folder / 'data'}",
            f"--listen-client-urls={url}",
            f"--advertise-client-urls={url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster=test={peer_url}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.time() + 30
        while True:
            try:
                Etcd3Client(host="127.0.0.1", port=client, timeout=2).status()
                break
            except Etcd3Exception:  # (not listening yet)
                assert server.poll() is None and time.time() < deadline, (folder / "etcd.log").read_text()[-2000:]
                time.sleep(0.1)
        yield f"127.0.0.1:{client}"
    finally:
        server.kill()
        server.wait()
        log.close()


@pytest.fixture
def etcd_server(tmp_path):
    """A fresh etcd server's "127.0.0.1:PORT" for one test."""
    folder = tmp_path / "etcd"
    folder.mkdir()
    with running_etcd(folder) as address:
        yield address
