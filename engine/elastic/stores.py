"""The rendezvous's backends: one state, read and compare-and-set with a fencing token.

In torchelastic's shape (its dynamic rendezvous's `RendezvousBackend`): the generic state machine
(rendezvous.py) keeps the whole rendezvous (members, rounds, reports) in one value and changes it
only by `set_state(new, token)`, which writes `new` when the stored state is still the one read
with `token` (else nothing, and it answers the state that is there: the caller merges its change
into it and tries again). So two supervisors can never both form round n, and a stale one cannot
overwrite a newer state. Two backends, picked by `--rendezvous`:

- a directory every pod mounts (a ReadWriteMany volume): `state.json` in it, replaced by an atomic
  rename while `state.lock` is held (flock; NFSv4 clients map it onto the server's byte-range
  locks); the token is a version counter in the file;
- `etcd://HOST:PORT/PREFIX`: the key PREFIX/state of an etcd v3 cluster; the token is the key's
  mod_revision and the write one transaction comparing it (etcd3gw, the client of etcd's v3 JSON
  gateway: `pip install 'jax-train-engine[elastic]'`).

Imports no jax.
"""

from __future__ import annotations

import base64
import fcntl
import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional, Protocol
from urllib.parse import urlsplit

from engine.errors import UsageError

Token = Any  # a backend's fencing token: None when there is no state yet

ETCD = "etcd://"
STATE, LOCK = "state.json", "state.lock"
TIMEOUT_SECONDS = 10.0  # one etcd request
RETRY_SECONDS = 30.0  # how long requests that fail to reach etcd are tried again (an election, a blip) before giving up


class RendezvousBackend(Protocol):
    """Where the rendezvous state lives."""

    name: str  # what the messages call it (the --rendezvous value)

    def get_state(self) -> tuple[Optional[bytes], Token]:
        """(the state, its token); (None, None) when none was written yet."""
        ...

    def set_state(self, state: bytes, token: Token) -> tuple[bytes, Token, bool]:
        """Writes `state` if the stored state is still the one `token` was read with: (the state now,
        its token, whether this call wrote it)."""
        ...


class FileBackend:
    """The state in a directory's state.json (a shared volume)."""

    def __init__(self, directory: Path):
        self.dir, self.name = Path(directory), str(directory)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # (a regular file there, a path that cannot be created)
            raise UsageError(
                f"--rendezvous {directory}: not a directory this pod can use ({e.strerror or e}); pass a directory "
                "every pod mounts (a ReadWriteMany volume), or etcd://HOST:PORT/PREFIX"
            ) from None
        self.path = self.dir / STATE

    def _read(self) -> tuple[Optional[bytes], Token]:
        try:
            data = self.path.read_bytes()  # (written whole: a rename)
        except FileNotFoundError:
            return None, None
        except IsADirectoryError:
            raise UsageError(
                f"--rendezvous {self.name}: {self.path} is a directory, not the state this engine's supervisors "
                "write; give each job its own empty directory, or remove it"
            ) from None
        version, _, state = data.partition(b"\n")
        return state, int(version) if version.isdigit() else version.decode(errors="replace")

    def get_state(self) -> tuple[Optional[bytes], Token]:
        return self._read()

    def set_state(self, state: bytes, token: Token) -> tuple[bytes, Token, bool]:
        with open(self.dir / LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                current, now = self._read()
                if now != token:
                    return current or b"", now, False
                version = (token if isinstance(token, int) else 0) + 1
                temporary = self.dir / f".{STATE}.{uuid.uuid4().hex}.tmp"  # (pods' pids are alike: often 1)
                temporary.write_bytes(b"%d\n" % version + state)
                os.replace(temporary, self.path)
                return state, version, True
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


class EtcdBackend:
    """The state in one key of an etcd v3 cluster, through its JSON gateway."""

    def __init__(self, spec: str):
        self.name = spec
        where = urlsplit(spec)
        try:
            port = where.port or 2379
        except ValueError:
            port = -1
        prefix = where.path.strip("/")
        if not where.hostname or port < 1 or not prefix or where.query or where.fragment:
            raise UsageError(
                f"--rendezvous {spec}: an etcd rendezvous is etcd://HOST:PORT/PREFIX (PREFIX names the job's keys, "
                "one per job), e.g. etcd://etcd.default.svc:2379/jobs/llama-7b"
            )
        try:
            from etcd3gw.client import Etcd3Client
        except ImportError:
            raise UsageError(
                f"--rendezvous {spec}: the etcd client is not installed; pip install 'jax-train-engine[elastic]' "
                "(etcd3gw), or pass a directory every pod mounts"
            ) from None
        self.client = Etcd3Client(host=where.hostname, port=port, timeout=TIMEOUT_SECONDS)
        self.key = f"/{prefix}/state"

    def _call(self, what: str, function, *args):
        """`function(*args)`, tried again for RETRY_SECONDS while etcd cannot be reached; then
        ConnectionError naming what failed."""
        from etcd3gw.exceptions import ConnectionFailedError, ConnectionTimeoutError, Etcd3Exception

        deadline = time.monotonic() + RETRY_SECONDS
        while True:
            try:
                return function(*args)
            except (ConnectionFailedError, ConnectionTimeoutError) as e:
                if time.monotonic() > deadline:
                    raise ConnectionError(f"etcd at {self.name} cannot be reached: {what} failed ({e})") from None
            except Etcd3Exception as e:
                raise ConnectionError(f"etcd at {self.name}: {what} failed ({e})") from None
            time.sleep(0.5)

    def get_state(self) -> tuple[Optional[bytes], Token]:
        found = self._call("reading the state", self.client.get, self.key, True)
        if not found:
            return None, None
        value, meta = found[0]
        return value, int(meta["mod_revision"])

    def set_state(self, state: bytes, token: Token) -> tuple[bytes, Token, bool]:
        key = _b64(self.key.encode())
        if token is None:  # only if the key does not exist yet
            compare = {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": 0}
        else:
            compare = {"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": token}
        txn = {
            "compare": [compare],
            "success": [{"request_put": {"key": key, "value": _b64(state)}}],
            "failure": [{"request_range": {"key": key}}],
        }
        answer = self._call("writing the state", self.client.transaction, txn)
        if answer.get("succeeded"):
            return state, int(answer["header"]["revision"]), True
        kvs = answer["responses"][0]["response_range"].get("kvs", [])
        if not kvs:
            return b"", None, False
        return base64.b64decode(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]), False


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def backend_for(spec: str | os.PathLike) -> RendezvousBackend:
    """The backend `--rendezvous SPEC` names: etcd://HOST:PORT/PREFIX, else a directory."""
    text = os.fspath(spec)
    return EtcdBackend(text) if text.startswith(ETCD) else FileBackend(Path(text))
