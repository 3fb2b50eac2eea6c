"""A real single-node SLURM cluster on localhost, from Debian's slurm-wlm and munge packages.

    with SlurmCluster(tmp_dir) as cluster:
        subprocess.run(["srun", "-n", "2", ...], env=cluster.env)

Needs root (munge and slurmd run as root/munge here). `available()` says whether the
binaries are installed; .ci/run installs them with apt-get.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


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
        self.pid_files = [self.dir / "slurmctld.pid", self.dir / "slurmd.pid"]
        self._pids: list[int] = []  # slurmctld, slurmd, and munged if we started it

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
        run_dir = Path("/run/munge")
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.chown(run_dir, "munge", "munge")
        socket_path = run_dir / "munge.socket.2"
        running = subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode == 0
        if running and socket_path.exists():
            return  # already running (e.g. started by the system)
        subprocess.run(["su", "-s", "/bin/sh", "munge", "-c", f"{_binary('munged')} --force"], check=True)
        deadline = time.monotonic() + 10
        while not socket_path.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._pids += [int(pid) for pid in subprocess.run(["pgrep", "-x", "munged"], capture_output=True,
                                                          text=True, check=True).stdout.split()]

    def __enter__(self) -> "SlurmCluster":
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
        self.__exit__(None, None, None)
        raise RuntimeError(f"the SLURM node did not become idle within 60 s; logs in {self.dir}/log")

    def __exit__(self, *exc) -> None:
        """Stops the daemons (and any step daemon they left) by pid: SIGTERM, then SIGKILL."""
        pids = self._pids + [int(p) for p in subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True,
                                                              text=True).stdout.split()]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):  # it has already exited
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
                time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running (not exited, not a zombie waiting to be reaped)."""
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except FileNotFoundError:
        return False
