"""A real single-node SLURM cluster on localhost, from Debian's slurm-wlm and munge packages.

    with SlurmCluster(tmp_dir) as cluster:
        subprocess.run(["srun", "-n", "2", ...], env=cluster.env)

Needs root (munge and slurmd run as root/munge here). `available()` says whether the
binaries are installed; .ci/run installs them with apt-get.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sinfo")
# One of these clusters at a time on a machine (the tests run in parallel workers): each is
# the machine's one node under its host name.
LOCK = Path(tempfile.gettempdir()) / "engine-test-slurm-cluster.lock"


def available() -> bool:
    return all(shutil.which(b) or Path(f"/usr/sbin/{b}").exists() for b in BINARIES) and os.geteuid() == 0


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SlurmCluster:
    def __init__(self, directory: str | os.PathLike, cpus: int | None = None):
        self.dir = Path(directory)
        self.host = socket.gethostname()
        self.cpus = cpus or os.cpu_count() or 2
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        # this cluster's own munged (socket, pid file, seed, log), in a directory the munge user can
        # reach (pytest's temporary directories are private to root)
        self.munge_dir = Path(tempfile.mkdtemp(prefix="engine-munge-"))
        self.pid_files = [self.munge_dir / "munged.pid", self.dir / "slurmctld.pid", self.dir / "slurmd.pid"]
        self._pids: list[int] = []  # the daemons this cluster started, from their pid files
        self._lock = None

    def _write_config(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf.write_text(f"""
ClusterName=engine-test
SlurmctldHost={self.host}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_dir}/munge.socket
StateSaveLocation={self.dir}/state
SlurmdSpoolDir={self.dir}/spool
SlurmctldPidFile={self.dir}/slurmctld.pid
SlurmdPidFile={self.dir}/slurmd.pid
SlurmctldLogFile={self.dir}/log/slurmctld.log
SlurmdLogFile={self.dir}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName={self.host} CPUs={self.cpus} RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")

    def _start_munge(self) -> None:
        """A munged of our own (its socket, pid file and seed under this cluster's directory), so
        that stopping it touches no munged the machine may already run."""
        shutil.chown(self.munge_dir, "munge", "munge")
        socket_path = self.munge_dir / "munge.socket"
        options = (
            f"--socket={socket_path} --pid-file={self.munge_dir}/munged.pid "
            f"--seed-file={self.munge_dir}/munged.seed --log-file={self.munge_dir}/munged.log"
        )
        subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", f"{_binary('munged')} --force {options}"], check=True)
        deadline = time.monotonic() + 10
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    def __enter__(self) -> "SlurmCluster":
        self._lock = open(LOCK, "w")
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # waits for another worker's cluster to stop
        try:
            return self._start()
        except BaseException:
            self.__exit__(None, None, None)  # stops what started and releases the lock, then raises
            raise

    def _start(self) -> "SlurmCluster":
        self._write_config()
        self._start_munge()
        subprocess.run([_binary("slurmctld"), "-f", str(self.conf)], check=True, env=self.env)
        subprocess.run([_binary("slurmd"), "-f", str(self.conf)], check=True, env=self.env)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=self.env)
            if state.returncode == 0 and state.stdout.strip() == "idle":  # both daemons wrote their pid files
                self._pids += [int(pid_file.read_text().strip()) for pid_file in self.pid_files]
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the SLURM node did not become idle within 60 s; logs in {self.dir}/log")

    def __exit__(self, *exc) -> None:
        """Stops the daemons this cluster started (and the step daemons and tasks under them) by
        pid: SIGTERM, then SIGKILL. Nothing else on the machine is touched."""
        started = self._pids or [int(f.read_text().strip()) for f in self.pid_files if f.is_file()]
        pids = started + [pid for parent in started for pid in _descendants(parent)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # it has already exited
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
                time.sleep(0.2)
        shutil.rmtree(self.munge_dir, ignore_errors=True)
        if self._lock is not None:
            self._lock.close()  # (releases the lock)
            self._lock = None


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc's parent links)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting to be reaped)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False
