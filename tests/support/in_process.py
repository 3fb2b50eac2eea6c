"""launch.py's train command through the engine's `main` in this test process: jax imported
once, programs compiled here (the worker's persistent cache warm), no process started. For the
single-process side of a comparison whose property is not about that process (two processes
give one process's losses; a checkpoint moves between process counts)."""

from support.configs import ROOT
from support.multiprocess import COMMON


def train_here(capsys, workdir, config, *overrides, devices=4, common=True) -> tuple[int, str]:
    """(main's exit code, its stdout and stderr) of training `config` with `overrides` (and, if
    `common`, the multi-process tests' COMMON) on `devices` of this process's CPU devices."""
    from engine.cli import main

    path = ROOT / config
    args = ["--config", str(path) if path.exists() else config, "--workdir", str(workdir)]
    capsys.readouterr()  # what came before is not this run's
    code = main([*args, *overrides, *(COMMON if common else ()), f"mesh.num_devices={devices}"])
    out, err = capsys.readouterr()
    return code, out + err
