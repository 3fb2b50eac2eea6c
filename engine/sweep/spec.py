"""Config sweeps: a grid, zipped lists and/or a seeded random search over any dotted keys,
each run a `launch.py` training process in its own workdir under the sweep's directory.

    base: configs/mnist_mlp.yaml         # relative to the sweep file
    overrides: {train.steps: 300}        # fixed for every run
    grid: {optimizer.learning_rate: [1e-3, 3e-3], train.global_batch_size: [32, 64]}
    zip: {optimizer.warmup_steps: [0, 50], optimizer.schedule: [constant, warmup_cosine]}
    random: {samples: 8, seed: 0, params: {optimizer.learning_rate: {log_uniform: [1e-4, 1e-2]}}}
    metric: eval/accuracy                # split/name from metrics.jsonl, to rank by
    mode: max                            # or min
    directory: runs/my_sweep             # default runs/<sweep file name>
    slurm: {partition: gpu, time: "01:00:00", cpus_per_task: 4, gres: "gpu:1"}
    vectorize: 8                         # or auto: runs that share a compiled program train
                                         # K at a time as one program (engine/run/vectorize.py)

Runs are the product of the grid's axes, the zip group (one axis) and the random samples;
or, with `search:` (and `pruner:`), the trials of an Optuna study (search.py).
Each run's status lives in its workdir (`status.json`); `sweep.jsonl` is the index made from them.

This module reads and checks sweep files; local.py runs them as local processes, slurm.py
as a SLURM job array.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from engine.config import load_config, read_yaml_mapping
from engine.errors import UsageError
from engine.observe.trackers import check_installed, mlflow_uri, prepare_store

SWEEP_KEYS = {
    "base",
    "overrides",
    "grid",
    "zip",
    "random",
    "metric",
    "mode",
    "directory",
    "slurm",
    "search",
    "pruner",
    "vectorize",
}
DISTRIBUTIONS = ("log_uniform", "uniform", "int_uniform", "choice")
SAMPLERS = ("tpe", "random", "grid")  # a search's (Optuna's) samplers and pruners with their settings
PRUNERS = {
    "median": ("startup_trials", "warmup_steps"),
    "successive_halving": ("min_resource", "reduction_factor"),
    "hyperband": ("min_resource", "max_resource", "reduction_factor"),
}
MAX_RUNS = 10_000  # runs one sweep file may make (grid × zip × random samples)
MAX_VECTOR = 64  # vectorize: auto puts at most this many runs in one program


@dataclass(frozen=True)
class RunSpec:
    name: str  # stable, from the overrides that vary, e.g. learning_rate=0.001,global_batch_size=32
    overrides: dict  # dotted key → value for this run (the varying ones)


@dataclass
class Sweep:
    path: Path
    base: Path
    overrides: dict
    runs: list[RunSpec]
    metric: str
    mode: str
    directory: Path
    slurm: dict = field(default_factory=dict)
    search: dict | None = None  # an Optuna study (search.py): runs are its trials, made as it goes
    pruner: dict | None = None
    vectorize: int = 0  # runs per vectorised program (0: each run its own process)
    vectorize_auto: bool = False  # vectorize: auto (a run that cannot be vectorised trains alone)
    _configs: dict = field(default_factory=dict, repr=False)  # run name → its loaded Config

    def workdir(self, run: RunSpec) -> Path:
        return self.directory / run.name

    def argv(self, run: RunSpec) -> list[str]:
        """launch.py arguments that train this run."""
        values = {**self.overrides, **run.overrides}
        return [
            "--config",
            str(self.base),
            "--workdir",
            str(self.workdir(run)),
            "log.progress=false",
            f"log.group={format_value(self.directory.name)}",  # trackers group the trials by sweep
            f"log.tracking_dir={format_value(str(self.directory))}",  # and keep one store for them all
            *(f"{key}={format_value(value)}" for key, value in values.items()),
        ]

    def config(self, run: RunSpec):
        """The run's validated Config (a copy of the one loaded first); UsageError naming the
        run if a value is bad."""
        if run.name not in self._configs:
            args = self.argv(run)
            try:
                self._configs[run.name] = load_config(
                    self.base, args[4:], args[3], override_source=f"the sweep file {self.path.name}"
                )
            except UsageError as e:
                raise UsageError(f"run '{run.name}': {e}") from None
        return copy.deepcopy(self._configs[run.name])


def format_value(value) -> str:
    """A value as the YAML an override parses back to the same value."""
    if isinstance(value, float):
        return repr(value)
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip().removesuffix("...").strip()


NAME_BYTES = 200  # run directory names stay well under the 255 bytes file systems allow


def _short(value) -> str:
    """A value as a shell-safe piece of a directory name: lists joined by '-', and nothing but
    letters, digits and . _ + - = kept (a run's workdir can be typed or pasted without quotes)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return "-".join(_short(v) for v in value)
    return re.sub(r"[^A-Za-z0-9._+=-]", "_", format_value(value))


def _bounded(name: str) -> str:
    """`name`, cut to NAME_BYTES with a hash of the whole so that cut names stay distinct."""
    if len(name.encode()) <= NAME_BYTES:
        return name
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return name.encode()[: NAME_BYTES - 11].decode(errors="ignore") + "_" + digest


def _run_names(combos: list[dict]) -> list[str]:
    keys = list(combos[0]) if combos else []
    tails = [key.rsplit(".", 1)[-1] for key in keys]
    labels = [tail if tails.count(tail) == 1 else key for key, tail in zip(keys, tails)]
    names = [
        _bounded(",".join(f"{label}={_short(combo[key])}" for key, label in zip(keys, labels)) or "run")
        for combo in combos
    ]
    if len(set(names)) != len(names):  # e.g. random draws that print alike: number them
        names = [f"{i:03d}_{name}" for i, name in enumerate(names)]
    return names


def _sample(spec: dict, rng: np.random.Generator):
    """One draw from a validated distribution spec such as {log_uniform: [1e-4, 1e-2]}."""
    ((kind, args),) = spec.items()
    if kind == "choice":
        return args[int(rng.integers(len(args)))]
    lo, hi = args
    if kind == "log_uniform":
        return float(math.exp(rng.uniform(math.log(lo), math.log(hi))))
    if kind == "uniform":
        return float(rng.uniform(lo, hi))
    return int(rng.integers(lo, hi + 1))  # int_uniform, both ends included


def _check_random(random: dict, where: str) -> None:
    if not isinstance(random, dict) or not isinstance(random.get("params"), dict):
        raise UsageError(
            f"{where}: random needs 'samples' (a count), 'params' (key: distribution) and optionally 'seed'"
        )
    if not isinstance(random.get("samples"), int) or isinstance(random["samples"], bool) or random["samples"] < 1:
        raise UsageError(f"{where}: random.samples must be a positive integer")
    if random["samples"] > MAX_RUNS:
        raise UsageError(
            f"{where}: random.samples={random['samples']:,} is more than {MAX_RUNS:,} runs; sample fewer "
            "(or split the sweep into several files)"
        )
    for key, spec in random["params"].items():
        _check_distribution(spec, f"{where}: random.params.{key}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _number(value):
    """`value`, or the float a text such as "1e-4" spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _check_distribution(spec, where: str) -> None:
    """One of {log_uniform: [lo, hi]}, {uniform: [lo, hi]}, {int_uniform: [lo, hi]} (lo < hi;
    log_uniform above 0; int_uniform whole numbers) or {choice: [a, b, ...]} (not empty)."""
    kind = next(iter(spec)) if isinstance(spec, dict) and len(spec) == 1 else None
    args = spec[kind] if kind in DISTRIBUTIONS else None
    if not isinstance(args, list) or not args:
        raise UsageError(
            f"{where} must be one of {{log_uniform: [lo, hi]}}, {{uniform: [lo, hi]}}, "
            "{int_uniform: [lo, hi]} or {choice: [a, b, ...]} (a non-empty list)"
        )
    if kind == "choice":
        return
    args[:] = [_number(a) for a in args]  # YAML reads 1e-4 (no dot) as text; configs accept it, so do sweeps
    if len(args) != 2 or not all(map(_is_number, args)) or not args[0] < args[1]:
        raise UsageError(f"{where}.{kind}={args!r} must be [low, high]: two numbers with low < high")
    if kind == "int_uniform" and not all(isinstance(a, int) for a in args):
        raise UsageError(f"{where}.int_uniform={args!r} must be two whole numbers")
    if kind == "log_uniform" and args[0] <= 0:
        raise UsageError(f"{where}.log_uniform={args!r}: the bounds must be positive")


def _overrides(overrides, where: str) -> dict:
    """The sweep's fixed overrides: a mapping of dotted keys, or a list of "a.b=value" strings."""
    if isinstance(overrides, list) and all(isinstance(item, str) and "=" in item[1:] for item in overrides):
        try:
            return {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in overrides)}
        except yaml.YAMLError as e:
            raise UsageError(f"{where}: overrides: a value is not valid YAML ({e.__class__.__name__})") from None
    if not isinstance(overrides, dict) or not all(isinstance(key, str) for key in overrides):
        raise UsageError(
            f"{where}: overrides must map dotted keys to values ({{train.steps: 300}}) or list "
            f'"key=value" strings, not {overrides!r}'
        )
    return overrides


def check_slurm_values(slurm: dict, where: str) -> None:
    """Every `slurm:` key and value is one line of printable text (a newline would add a line to
    the script, a control character could hide one): UsageError naming the key otherwise."""
    if not isinstance(slurm, dict):
        raise UsageError(f"{where}: slurm must map sbatch options to values, e.g. {{partition: gpu}}")
    for key, value in slurm.items():
        for text in (str(key), str(value)):
            if any(ord(c) < 32 or ord(c) == 127 for c in text):
                raise UsageError(
                    f"{where}: slurm.{key}={value!r} holds a control character (a newline, say); "
                    f"give each sbatch option on one line"
                )


def check_search(search: dict, pruner: dict | None, where: str) -> None:
    """The search and pruner sections, refused by name before anything runs."""
    if not isinstance(search, dict) or set(search) - {"sampler", "trials", "seed", "params"}:
        raise UsageError(f"{where}: search takes sampler, trials, seed and params")
    if search.get("sampler", "tpe") not in SAMPLERS:
        raise UsageError(f"{where}: search.sampler={search.get('sampler')!r} is not one of {', '.join(SAMPLERS)}")
    trials = search.get("trials")
    if not isinstance(trials, int) or isinstance(trials, bool) or not 0 < trials <= 10_000:
        raise UsageError(f"{where}: search.trials={trials!r} must be a whole number from 1 to 10000")
    params = search.get("params")
    if not isinstance(params, dict) or not params:
        raise UsageError(
            f"{where}: search.params must map dotted keys to distributions, e.g. "
            "{optimizer.learning_rate: {log_uniform: [1e-4, 1e-2]}}"
        )
    for key, dist in params.items():
        _check_distribution(dist, f"{where}: search.params.{key}")
        kind = next(iter(dist))
        if search.get("sampler") == "grid" and kind != "choice":
            raise UsageError(f"{where}: search.sampler=grid needs choice lists; search.params.{key} is {kind}")
    if pruner is not None:
        if not isinstance(pruner, dict) or pruner.get("kind") not in PRUNERS:
            raise UsageError(f"{where}: pruner.kind must be one of {', '.join(PRUNERS)}")
        unknown = set(pruner) - {"kind", *PRUNERS[pruner["kind"]]}
        if unknown:
            raise UsageError(
                f"{where}: pruner {pruner['kind']} takes {', '.join(PRUNERS[pruner['kind']])}; "
                f"not {', '.join(sorted(unknown))}"
            )


def _vectorize(value, where: str) -> int:
    """`vectorize:` → runs per program: a whole number (1 = off), or auto (MAX_VECTOR)."""
    if value is None or value is False:
        return 0
    if value == "auto":
        return MAX_VECTOR
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1024:
        raise UsageError(f"{where}: vectorize={value!r} must be a whole number of runs per program (1 to 1024) or auto")
    return value if value > 1 else 0


def _combinations(grid: dict, zipped: dict, random, where: str) -> list[dict]:
    """The runs' overrides: the product of the grid's axes, the zip group and the random draws."""
    for section, listed in (("grid", grid), ("zip", zipped)):
        if not isinstance(listed, dict) or not all(isinstance(v, list) and v for v in listed.values()):
            raise UsageError(f"{where}: {section} must map dotted keys to non-empty lists of values")
    if len({len(v) for v in zipped.values()}) > 1:
        raise UsageError(
            f"{where}: the zip lists must have equal lengths, got "
            + ", ".join(f"{k}: {len(v)}" for k, v in zipped.items())
        )
    axes = [[{key: value} for value in values] for key, values in grid.items()]
    if zipped:
        axes.append([dict(zip(zipped, row)) for row in zip(*zipped.values())])
    if random is not None:
        _check_random(random, where)
        rng = np.random.default_rng(random.get("seed", 0))
        axes.append(
            [{key: _sample(dist, rng) for key, dist in random["params"].items()} for _ in range(random["samples"])]
        )
    count = math.prod(len(axis) for axis in axes)
    if count > MAX_RUNS:
        raise UsageError(
            f"{where} makes {count:,} runs (the product of its axes), more than {MAX_RUNS:,}; narrow "
            "the grid or sample fewer"
        )
    return [{k: v for part in parts for k, v in part.items()} for parts in itertools.product(*axes)]


def load_sweep(path: str | os.PathLike) -> Sweep:
    path = Path(path).absolute()
    if not path.is_file():
        raise UsageError(f"sweep file {path} does not exist")
    spec = read_yaml_mapping(path, "sweep file")
    unknown = set(spec) - SWEEP_KEYS
    if unknown:
        raise UsageError(f"sweep file {path}: unknown key(s) {sorted(unknown)}; valid keys: {sorted(SWEEP_KEYS)}")
    if not isinstance(spec.get("base"), str) or not spec["base"] or "\x00" in spec["base"]:
        raise UsageError(f"sweep file {path} needs 'base: <config file>' (one path), not {spec.get('base')!r}")
    base = (path.parent / spec["base"]).resolve()
    overrides = _overrides(spec.get("overrides") or {}, f"sweep file {path}")
    grid, zipped, random = spec.get("grid") or {}, spec.get("zip") or {}, spec.get("random")
    combos = _combinations(grid, zipped, random, f"sweep file {path}")
    mode = spec.get("mode", "min")
    if mode not in ("min", "max"):
        raise UsageError(f"sweep file {path}: mode={mode!r} must be min or max")
    metric = spec.get("metric", "eval/loss")
    if not isinstance(metric, str) or not all(metric.partition("/")[::2]):  # (a name may hold "/": eval/rewards/...)
        raise UsageError(f"sweep file {path}: metric={metric!r} must be split/name, e.g. eval/accuracy")
    if not isinstance(spec.get("directory") or "", str) or "\x00" in (spec.get("directory") or ""):
        raise UsageError(f"sweep file {path}: directory={spec['directory']!r} must be a path")
    directory = Path(spec.get("directory") or Path("runs") / path.stem)
    if not directory.is_absolute():
        directory = Path.cwd() / directory
    runs = [RunSpec(name, combo) for name, combo in zip(_run_names(combos), combos)]
    slurm = spec.get("slurm") or {}
    check_slurm_values(slurm, f"sweep file {path}")
    search, pruner = spec.get("search"), spec.get("pruner")
    if search is not None or pruner is not None:
        if search is None or grid or zipped or random is not None:
            raise UsageError(
                f"sweep file {path}: a pruner needs a search, and a search replaces grid, zip and "
                f"random; use one or the other"
            )
        check_search(search, pruner, f"sweep file {path}")
        runs = []
    vectorize = _vectorize(spec.get("vectorize"), f"sweep file {path}")
    if vectorize and search is not None:
        raise UsageError(
            f"sweep file {path}: a search makes its trials one at a time and cannot vectorise them; "
            "remove vectorize, or use grid/zip/random"
        )
    auto = spec.get("vectorize") == "auto"
    return Sweep(path, base, overrides, runs, metric, mode, directory, slurm, search, pruner, vectorize, auto)


def search_probes(search: dict) -> list[RunSpec]:
    """Runs at the ends of a search's ranges and each of its choices: what validate_runs loads."""
    probes = []
    for end in (0, -1):
        probes.append({key: values[end] for key, d in search["params"].items() for values in d.values()})
    for key, d in search["params"].items():
        probes += [{key: value} for value in d.get("choice", [])]
    return [RunSpec(f"search probe {i}", combo) for i, combo in enumerate(probes)]


def validate_runs(sweep: Sweep) -> None:
    """Loads every run's config before any run starts; the first bad one stops the sweep.
    A search loads its ranges' ends and each choice."""
    stores = {}
    for run in search_probes(sweep.search) if sweep.search else sweep.runs:
        cfg = sweep.config(run)
        check_installed(cfg)
        if "mlflow" in cfg.log.trackers:
            stores[(mlflow_uri(cfg), cfg.log.project)] = cfg
    for cfg in stores.values():  # made once here, not by trials starting together
        prepare_store(cfg)
