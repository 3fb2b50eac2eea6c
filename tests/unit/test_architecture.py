"""The shape of the code that later work stands on: the engine knows no model, models know
no engine, imports run one way, and the loop and setup stay small enough to read."""

import ast
import dataclasses
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.configs import ROOT

from engine.config import load_config
from engine.errors import UsageError
from engine.run.setup import Run

ENGINE = sorted((ROOT / "engine").rglob("*.py"))


MODELS = sorted((ROOT / "models").rglob("*.py"))


@functools.cache
def parsed(path: Path) -> ast.Module:
    """A source file's syntax tree, parsed once for all the checks (the cycle check asks each
    module's imports of every module importing it)."""
    return ast.parse(path.read_text())


def _runtime_nodes(tree):
    """Every node, less `if TYPE_CHECKING:` blocks (annotations only, never imported at run time)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            continue
        todo.extend(ast.iter_child_nodes(node))
        yield node


def imports(path: Path) -> set[str]:
    """Top-level package.module names a file imports (anywhere in it, lazily or not)."""
    found = set()
    for node in _runtime_nodes(parsed(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_engine_names_no_model_family_field_or_task_data_key():
    # ("mlp" is also a logical axis name, and the config's default model: not searched for)
    words = re.compile(r'"transformer"|"resnet"|"cnn"|"tokens"|"image"|"label"|dropout_rate|num_layers')
    for path in ENGINE:
        if path.parent.name == "data" and path.name in (
            "base.py",
            "shards.py",
            "sources.py",
            "text.py",
            "tokens.py",
            "pretokenize.py",
            "table.py",
            "preprocess.py",
            "chat_data.py",
            "preferences.py",
            "prompts.py",
        ):
            continue  # the data sources produce the keys
        hits = [
            f"{path.name}:{n}: {line.strip()}"
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if words.search(line)
        ]
        assert not hits, hits


def test_models_import_nothing_from_the_engine():
    for path in MODELS:
        assert not {name for name in imports(path) if name.split(".")[0] == "engine"}, path


def test_engine_imports_have_no_cycles():
    ours = {module_name(p): p for p in ENGINE + MODELS}
    graph = {}
    for name, path in ours.items():
        graph[name] = set()
        for imported in imports(path):
            # `from engine import process` imports the submodule (its package is already loading);
            # `from engine.x import y` imports module engine.x for its member y
            names = _from_names(path, imported)
            submodules = [f"{imported}.{alias}" for alias in names if f"{imported}.{alias}" in ours]
            candidates = submodules + ([imported] if len(submodules) < len(names) or not names else [])
            graph[name].update(c for c in candidates if c in ours and c != name)
    for start in graph:  # depth-first: a path back to `start` is a cycle
        stack, seen = [(start, (start,))], set()
        while stack:
            node, trail = stack.pop()
            for nxt in graph[node]:
                assert nxt != start or _is_package_of(start, node), f"import cycle: {' -> '.join(trail + (nxt,))}"
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, trail + (nxt,)))


def _from_names(path: Path, module: str) -> list[str]:
    return _names_imported_from(path).get(module, [])


@functools.cache
def _names_imported_from(path: Path) -> dict[str, list[str]]:
    """module → the names a file imports from it (`from module import a, b`), in one walk of its tree."""
    names: dict[str, list[str]] = {}
    for node in _runtime_nodes(parsed(path)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.setdefault(node.module, []).extend(alias.name for alias in node.names)
    return names


def _is_package_of(package: str, module: str) -> bool:
    """A package's __init__ re-exporting its own submodules is not a cycle."""
    return module.startswith(package + ".")


SOURCES = ENGINE + MODELS + sorted((ROOT / "contract").rglob("*.py")) + [ROOT / "launch.py"]


def function_lengths(path: Path) -> dict[str, int]:
    tree = parsed(path)
    return {
        f"{path.name}:{node.name}": node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def test_every_function_fits_on_a_screen_and_every_file_stays_small():
    lengths = {name: n for path in SOURCES for name, n in function_lengths(path).items()}
    assert lengths["loop.py:train"] <= 60
    assert not {name: n for name, n in lengths.items() if n > 60}
    assert not {path.name: n for path in SOURCES if (n := len(path.read_text().splitlines())) > 450}


def test_a_run_is_a_handful_of_named_parts():
    assert len(dataclasses.fields(Run)) <= 12


def test_no_engine_module_imports_another_modules_private_names():
    found = []
    for path in ENGINE + MODELS:
        for node in _runtime_nodes(parsed(path)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("engine", "models"):
                found += [
                    f"{path.name}: from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")
                ]
    assert not found, found


def test_the_engine_asks_the_model_family_not_the_model_config():
    """A model's settings are the family's to read: `getattr(cfg.model, ...)` in the engine is a
    capability the family should declare (models/family.py)."""
    pattern = re.compile(r"getattr\(\s*[\w.]*model\b")
    hits = [
        f"{path.name}:{n}"
        for path in ENGINE
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not hits, hits


def test_every_family_satisfies_the_typed_protocol():
    from models import REGISTRY
    from models.family import ModelFamily, splits_sequence

    assert all(isinstance(family, ModelFamily) for family in REGISTRY.values())
    assert splits_sequence(REGISTRY["llama"]) and not splits_sequence(REGISTRY["mlp"])


def test_a_model_family_has_a_small_required_core():
    # required: every member of the protocol that Family does not default to None (the capability
    # records, where absent means unsupported)
    from models.family import Family, ModelFamily

    members = {name for name in (*vars(ModelFamily), *vars(ModelFamily).get("__annotations__", {})) if name[0] != "_"}
    capabilities = {name for name in members if getattr(Family, name, "required") is None}
    required = members - capabilities
    assert {"config_cls", "task", "build"} <= required and len(required) <= 8, sorted(required)
    assert {"flops", "language_model", "layer_stack", "experts"} <= capabilities, sorted(capabilities)


def test_the_engine_passes_the_models_what_they_need_as_arguments():
    # no context variable carries anything between engine and models: build takes BuildOptions
    # (the pipeline, LoRA adapters, the activation layout of the step traced)
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in MODELS + sorted((ROOT / "contract").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "ContextVar" in line or "contextvars" in line
    ]
    assert not hits, hits


def test_the_mesh_keys_and_rules_come_from_the_axis_declarations():
    from engine.config import MeshConfig
    from engine.parallel.axes import AXES, CONFIG_AXES, default_rules

    names = [f.name for f in dataclasses.fields(MeshConfig)]
    assert names[: 2 * len(CONFIG_AXES)] == [*CONFIG_AXES, *(f"dcn_{a}" for a in CONFIG_AXES)]
    rules = default_rules()
    for axis in AXES:
        assert all(axis.name in rules[logical] for logical in axis.params)
    assert rules["mlp"] == ["tensor", "fsdp"]  # tensor parallel first, then fsdp


def test_the_configuration_reference_is_generated_from_the_schema():
    from engine.config.reference import DOC, render

    assert DOC.read_text() == render(), "docs/configuration.md is stale: python -m engine.config.reference"
    assert "`optimizer.name` | `adam` |" in DOC.read_text()


def test_model_validation_errors_are_usage_errors():
    with pytest.raises(UsageError, match=r"model.dropout_rate=1.5 must be in \[0, 1\)"):
        load_config(ROOT / "configs" / "mnist_mlp.yaml", ["model.name=cnn", "model.dropout_rate=1.5"], "/tmp/unused")


def test_the_light_declarations_agree_with_what_they_stand_for():
    """The names config checking reads without jax are the ones the heavy modules build."""
    import optax

    from engine.config import load_config
    from engine.config.optimizers import OPTIMIZERS
    from engine.optim.optimizer import make_optimizer
    from models import CONFIGS, REGISTRY
    from models.configs import REMAT_NAMES
    from models.remat import policy

    for name in OPTIMIZERS:  # every optimizer of the table builds
        cfg = load_config(ROOT / "configs" / "mnist_mlp.yaml", [f"optimizer.name={name}"], "/tmp/unused")
        assert isinstance(make_optimizer(cfg.optimizer), optax.GradientTransformation)
    assert all((policy(name) is None) == (name == "none") for name in REMAT_NAMES)  # each name builds its policy
    assert {name: family.config_cls for name, family in REGISTRY.items()} == CONFIGS
    assert all("hparams" in vars(config) for config in CONFIGS.values())  # program_settings reads it
    assert REGISTRY["mlp"].hparams == ("dropout_rate",) and REGISTRY["llama"].hparams == ()


def test_the_engine_is_folders_that_show_the_design():
    """A maintainer finds a thing by its folder: the engine's top level holds subpackages and at
    most three modules, and no two modules anywhere in it share a file name."""
    top = [p.name for p in (ROOT / "engine").glob("*.py")]
    assert len(top) <= 3, top
    names = [p.name for p in ENGINE if p.name not in ("__init__.py", "__main__.py")]
    assert not {n for n in names if names.count(n) > 1}


def _calls_of(name: str, node, where: str = "<module>"):
    """The enclosing function's name (or "<module>") for each call of `name` (or of x.`name`) under `node`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Call) and name in (getattr(child.func, "id", None), getattr(child.func, "attr", None)):
            yield where
        yield from _calls_of(
            name, child, child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
        )


def test_the_engine_constructs_its_checkpointer_in_one_place():
    """The engine opens checkpoints only through engine.checkpoint.store.open_checkpoints, so
    every reader and writer takes keep, verification, staging and the frozen base from its
    config the same way: that function holds the engine's one Checkpointer(...)."""
    found = [f"{module_name(path)}:{where}" for path in ENGINE for where in _calls_of("Checkpointer", parsed(path))]
    assert found == ["engine.checkpoint.store:open_checkpoints"], found


# the strategy table and the strategies' own modules: the only ones that may say which one runs
STRATEGY_MODULES = {"strategies.py", "sync.py", "diloco.py", "diloco_shrink.py"}
# (the elastic supervisor's checks are being moved onto the record's check_resize/round_steps)
LEFT_TO_ELASTIC: set[str] = set()  # (elastic/shrink.py and grow.py ask the record too)
ASKS_WHICH_SYNC = re.compile(r"\.sync\s*[!=]=|DilocoState\)|isinstance\([^)]*Diloco")


def test_only_the_strategy_table_asks_which_sync_strategy_runs():
    """train.sync is compared in engine/parallel/strategies.py alone: the loop, setup, the dry run,
    the blueprint and the config checks ask the strategy's record (round_steps, step_and_state,
    dry_run_lines, replicas_from, check), never `train.sync == ...` or `isinstance(..., DilocoState)`.
    (By behaviour: tests/integration/test_sync_strategy_plugin.py trains a strategy defined there.)"""
    asking = {
        str(path.relative_to(ROOT))
        for path in ENGINE
        if not (path.parent.name == "parallel" and path.name in STRATEGY_MODULES)
        and ASKS_WHICH_SYNC.search(path.read_text())
    }
    assert asking <= LEFT_TO_ELASTIC, sorted(asking - LEFT_TO_ELASTIC)


def test_the_engines_subpackages_import_one_way():
    """The layer order of pyproject.toml's import-linter contracts holds (docs/architecture.md,
    "Layers"): no subpackage imports one above it, not even inside a function."""
    check = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_logo=True))"
    found = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 0, found.stdout[-3000:]


# the packed metrics' layout by name or position: the column names' tuple, a column looked up by
# name, a row's or a column's literal index (`row[0]`, `host[:, 2]`, `packed[:, :, 3]`)
PACKED_LAYOUT = re.compile(
    r"TRAIN_METRICS|\.index\(\"(loss_sum|correct|count|grad_norm|learning_rate)\"\)|\brows?\[\s*-?\d|\[\s*:\s*,\s*(:\s*,\s*)?-?\d"
)


def test_only_the_metric_columns_know_the_packed_metrics_layout():
    """engine/state/columns.py (MetricColumns) owns the packed train metrics' layout; no other engine
    module names its columns or indexes metric rows by position (the data sources index their own
    arrays, not metrics)."""
    owner = ROOT / "engine" / "state" / "columns.py"
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in ENGINE
        if path != owner and path.parent.name != "data"
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PACKED_LAYOUT.search(line)
    ]
    assert not hits, hits
