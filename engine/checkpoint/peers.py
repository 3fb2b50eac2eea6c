"""Who keeps copies of a process's local checkpoint shards (the next processes on other hosts),
and the run id that ties local steps to the run that saved them.

The local tier (local_tier.py) copies each process's shards to checkpoint.local_replicas peer
processes. Losing a host loses the local storage of every process on it, so a process's peers
are taken from the other hosts first: the next host (in the order hosts first appear among the
processes) and on it the process of the same rank within its host, then the host after, and
only when there are fewer other hosts than replicas, processes of its own host. Every process
computes the same choice from the gathered host names. A host's name is socket.gethostname(),
or the environment variable HOST_VARIABLE where it is set (`{process}` in it is replaced by
the process index: `ENGINE_HOST_NAME=host{process}` makes every process a host of its own, for
tests of several processes on one machine).

The run id is a random number made when a run begins (its workdir afresh) and kept in
RUN_ID_FILE in the workdir, so that a resumed run keeps it; a local step saved under another id
(an earlier run's, on a host that was away when the new run began) is not restored.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
from functools import partial
from pathlib import Path
from typing import Optional, Sequence

from engine.runtime.rundir import write_atomic

HOST_VARIABLE = "ENGINE_HOST_NAME"
RUN_ID_FILE = "local_tier.json"


def host_name(process: int) -> str:
    """This process's host, as the peer choice sees it."""
    override = os.environ.get(HOST_VARIABLE)
    return override.replace("{process}", str(process)) if override else socket.gethostname()


def host_key(name: str) -> int:
    """A host name as one int64 (for gathering; equal names, equal keys)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little", signed=True)


def choose_peers(hosts: Sequence, replicas: int) -> list[list[int]]:
    """For each process (the index into `hosts`, each process's host), the processes that keep
    copies of its shards, `replicas` of them (at most the other processes), best first: other
    hosts first, the next host first, on it the process of the same rank within its host."""
    order = list(dict.fromkeys(hosts))  # hosts in the order of their first process
    members = {host: [p for p, h in enumerate(hosts) if h == host] for host in order}
    rank = [members[host].index(p) for p, host in enumerate(hosts)]
    place = [order.index(host) for host in hosts]

    def preference(owner: int, peer: int) -> tuple:
        return (
            hosts[peer] == hosts[owner],
            (place[peer] - place[owner]) % len(order),
            (rank[peer] - rank[owner]) % len(members[hosts[peer]]),
            peer,
        )

    others = [[p for p in range(len(hosts)) if p != owner] for owner in range(len(hosts))]
    return [sorted(peers, key=partial(preference, owner))[:replicas] for owner, peers in enumerate(others)]


def one_host(hosts: Sequence) -> bool:
    """Whether several processes all run on one host (their peer copies then guard against a lost
    process's storage, not a lost host)."""
    return len(hosts) > 1 and len(set(hosts)) == 1


def new_run_id() -> int:
    return secrets.randbits(62) + 1  # (never 0: 0 stands for none)


def stored_run_id(workdir: Path) -> int:
    """The run id kept in `workdir` (0 when there is none or it does not read)."""
    try:
        value = json.loads((workdir / RUN_ID_FILE).read_text())["run"]
    except (OSError, ValueError, KeyError, TypeError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


def keep_run_id(workdir: Path, run: int) -> Optional[str]:
    """Writes `run` into `workdir`; why it could not (None when it did)."""
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        write_atomic(workdir / RUN_ID_FILE, json.dumps({"run": run}) + "\n")
    except OSError as e:
        return str(e)
    return None
