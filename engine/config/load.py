"""Loading a run's configuration: YAML files (with `extends:`) + dotted overrides, merged over
the schema by OmegaConf (types checked there), then validated (validate.py).

A config file may name another with `extends: other.yaml` (a path relative to the file, or
a shipped config's bare name: `extends: base`); the base is loaded first and the file's keys
are merged over it. The `model` section's schema is the chosen model's own dataclass (see
models/), so each model has typed keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml
from omegaconf import DictConfig, ListConfig, Node, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from engine.config.data_sections import DATA_CONFIGS
from engine.config.data_sections import owners as data_owners
from engine.config.schema import Config
from engine.config.validate import TABLE_COLUMNS, choice_message, other_source_key, validate
from engine.errors import UsageError
from engine.runtime.rundir import write_atomic
from engine.runtime.yaml_files import read_yaml_mapping, yaml_problem
from models.configs import CONFIGS  # the model.* dataclasses, without jax or flax

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> dict:
    """Reads a config file, following `extends:` to its base first."""
    if "\x00" in str(path):
        raise UsageError(f"config file {str(path)!r}: a path cannot hold a NUL character")
    if not path.is_file():
        names = ", ".join(shipped_configs(with_base=True))
        raise UsageError(f"config file {path} does not exist; shipped configs (also by bare name): {names}")
    if path in seen:
        raise UsageError(f"config {path} extends itself through {' -> '.join(map(str, seen))}")
    data = read_yaml_mapping(path, "config file")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str) or not base:
        raise UsageError(
            f"config file {path}: extends: {base!r} must be the path of one config file, e.g. extends: base.yaml"
        )
    merged = _read_yaml(config_file(base, path.parent), seen + (path,))
    return _deep_merge(merged, data)


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def shipped_configs(with_base: bool = False) -> list[str]:
    """The configs in configs/ (base.yaml, which only others extend, with `with_base`)."""
    return sorted(p.name for p in CONFIG_DIR.glob("*.yaml") if with_base or p.name != "base.yaml")


def config_file(name: str | os.PathLike, directory: Path = Path(".")) -> Path:
    """A config's file: `name` (or `name`.yaml) relative to `directory`, else the shipped config
    of that bare name (with or without .yaml), as --config and `extends:` both take it."""
    path = directory / name
    bare = Path(name).name == str(name)
    candidates = [CONFIG_DIR / name, CONFIG_DIR / f"{name}.yaml"] if bare else []
    for candidate in [path, Path(f"{path}.yaml"), *candidates]:  # the user's own file first; .yaml may be left out
        if candidate.is_file():
            return candidate.resolve()
    return path.resolve()


def _all_keys(node: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for key in node.keys():
        full = prefix + str(key)
        keys.append(full)
        child = node._get_node(key)
        if isinstance(child, DictConfig) and child._is_missing() is False and child._get_flag("struct"):
            keys.extend(_all_keys(child, full + "."))
    return keys


def _schema(model_name: str, data_name: str) -> DictConfig:
    """The config schema with model.name's model section and data.name's data section; never
    changed (merges copy it)."""
    if model_name not in CONFIGS:
        raise UsageError(choice_message("model.name", model_name, sorted(CONFIGS)))
    if data_name not in DATA_CONFIGS:
        raise UsageError(choice_message("data.name", data_name, tuple(DATA_CONFIGS)))
    return _built_schema(model_name, data_name)


@functools.lru_cache(maxsize=None)
def _built_schema(model_name: str, data_name: str) -> DictConfig:
    schema = OmegaConf.structured(Config)
    OmegaConf.set_readonly(schema, False)  # (the frozen dataclasses' nodes; merges of it build the config)
    schema.model = OmegaConf.structured(CONFIGS[model_name])
    schema.data = OmegaConf.structured(DATA_CONFIGS[data_name])
    OmegaConf.set_readonly(schema, False)
    OmegaConf.set_struct(schema, True)
    OmegaConf.set_struct(schema.mesh.rules, False)  # users may add logical axis names
    return schema


def _explain(err: OmegaConfBaseException, schema: DictConfig, source: str) -> str:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError) or "not in struct" in str(err):
        close = difflib.get_close_matches(key, _all_keys(schema), n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'?" if close else "; see docs/configuration.md"
        return f"unknown config key '{key}' (from {source}){hint}"
    if isinstance(err, ValidationError):
        expected = _expected_type(schema, key)
        value = getattr(err, "value", None)
        if isinstance(value, Node):  # OmegaConf's wrapper of a value: say the value itself
            value = value._value()
        return (
            f"config key '{key}' got {value!r} ({type(value).__name__}) from {source}, "
            f"but it must be {expected}; e.g. {key}={_example(expected)}"
        )
    return f"bad config ({source}): {str(err).splitlines()[0]}"


def _expected_type(schema: DictConfig, key: str) -> str:
    node: Any = schema
    parts = key.split(".")
    for part in parts[:-1]:
        node = node._get_node(part) if isinstance(node, DictConfig) and part in node else None
        if node is None:
            return "a valid value"
    leaf = node._get_node(parts[-1]) if isinstance(node, DictConfig) and parts[-1] in node else None
    if leaf is None:
        return "a valid value"
    ref = leaf._metadata.ref_type
    name = getattr(ref, "__name__", None) or str(ref).replace("typing.", "")
    if name == "Optional":  # Optional[X]
        name = str(ref).replace("typing.", "")
    names = {
        "int": "an int",
        "float": "a float",
        "bool": "a bool (true/false)",
        "str": "a string",
        "List": "a list",
        "list": "a list",
        "Dict": "a mapping",
        "dict": "a mapping",
    }
    return names.get(name.split("[")[0], name)


def _example(expected: str) -> str:
    return {
        "an int": "8",
        "a float": "0.001",
        "a bool (true/false)": "true",
        "a string": "name",
        "a mapping": "{a: 1}",
    }.get(expected, "[1,2]")


def _check_shapes(tree: dict, schema: DictConfig, source: str, prefix: str = "") -> None:
    """Sections the schema holds as mappings (or lists) get mappings (or lists): OmegaConf would
    fail on them with a message naming no key (or with a TypeError)."""
    for key, value in tree.items():
        if not isinstance(key, str) or key not in schema or value is None:
            continue  # unknown keys get OmegaConf's own message (with the closest valid key)
        node = schema._get_node(key)
        full = f"{prefix}{key}"
        if isinstance(node, DictConfig) and not isinstance(value, dict):
            raise UsageError(
                f"config key '{full}' is a section of keys, but {source} gives it {value!r}; "
                f"set its keys instead, e.g. {full}.<key>=value"
            )
        if isinstance(node, ListConfig) and isinstance(value, dict):
            raise UsageError(
                f"config key '{full}' must be a list, but {source} gives it a mapping ({value!r}); e.g. {full}=[1,2]"
            )
        if isinstance(node, DictConfig) and not node._is_missing():
            _check_shapes(value, node, source, full + ".")


def load_config(
    config_path: str | os.PathLike,
    overrides: Sequence[str] = (),
    workdir: str | None = None,
    override_source: str = "the command line",
) -> Config:
    """Config file + `a.b=value` overrides → validated Config; UsageError says what is wrong."""
    path = config_file(config_path)
    raw = _read_yaml(path)
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise UsageError(f"override '{item}' is not of the form dotted.key=value, e.g. train.steps=100")
        key, value = item.split("=", 1)
        if not all(part.strip() and part.isprintable() for part in key.split(".")):
            raise UsageError(f"override '{item}': the key '{key}' is not a dotted key such as train.steps")
        try:
            yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise UsageError(
                f"override '{item}': the value is not valid YAML ({yaml_problem(e)}); close its "
                f"brackets and quotes, e.g. {key}=[256,128]"
            ) from None
    try:
        override_cfg = OmegaConf.from_dotlist(list(overrides))
    except (OmegaConfBaseException, yaml.YAMLError, ValueError, TypeError) as e:  # e.g. a=[1] then a.b=2
        raise UsageError(f"could not parse overrides {list(overrides)}: {str(e).splitlines()[0]}") from None
    overrides_tree: Any = OmegaConf.to_container(override_cfg)
    file_model, model_name = _model_names(raw, overrides_tree, str(path))
    if model_name != file_model:  # the file's model keys belong to another model: start from defaults
        raw["model"] = {"name": model_name}
    data_name = _data_keys(raw, overrides_tree, str(path), override_source, _set_before_last_name(overrides))
    schema = _schema(str(model_name), data_name)
    cfg: Any = _file_layer(schema, raw, str(model_name), str(path))
    _check_shapes(overrides_tree, schema, override_source)
    try:
        cfg = OmegaConf.merge(cfg, OmegaConf.create(overrides_tree))
    except OmegaConfBaseException as e:
        raise UsageError(_explain(e, schema, override_source)) from None
    if workdir is not None:
        cfg.workdir = workdir
    if not cfg.workdir:
        cfg.workdir = str(Path("runs") / path.stem)
    try:
        config: Any = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:  # e.g. an interpolation ${...} that names no key
        raise UsageError(
            f"bad config: {str(e).splitlines()[0]} (at {getattr(e, 'full_key', '?')}); "
            "write the value itself, or ${section.key} of a key that exists"
        ) from None
    return validate(config)


_FILE_LAYERS: dict[str, Any] = {}  # a sweep loads one file with many overrides


def _file_layer(schema: DictConfig, raw: dict, model_name: str, source: str) -> DictConfig:
    """The schema merged with a config file's contents (never changed: merges copy it). Kept by
    content, so the runs of a sweep pay OmegaConf's schema merge once, not once each."""
    key = repr((model_name, schema.data.name, raw))  # keys of any type (YAML's `on:` is True), 1 and "1" apart
    if key not in _FILE_LAYERS:
        _check_shapes(raw, schema, source)
        try:
            layer = OmegaConf.merge(schema, OmegaConf.create(raw))
        except OmegaConfBaseException as e:
            raise UsageError(_explain(e, schema, source)) from None
        _FILE_LAYERS.clear()  # one file at a time is what sweeps and runs load
        _FILE_LAYERS[key] = layer
    return _FILE_LAYERS[key]


def _set_before_last_name(overrides: Sequence[str]) -> set[str]:
    """The data keys the overrides set before their last data.name=...: they belonged to the
    source named earlier (a launcher's defaults, then the user's own data.name=...)."""
    keys = [item.split("=", 1)[0].strip() for item in overrides if "=" in item]
    last = max((i for i, key in enumerate(keys) if key == "data.name"), default=-1)
    return {key.split(".")[1] for key in keys[:last] if key.startswith("data.")}


def _data_keys(raw: dict, overrides: dict, source: str, override_source: str, superseded: set[str]) -> str:
    """data.name of the run, with the file's data keys fitted to it: an override that switches
    data.name drops the file's keys the new source lacks (as a switched model.name does), and
    keys of the file's own source's defaults that it lacks (config.yaml files once held every
    source's keys); another source's key in a file is ignored with a note (a mixture, a held-out
    path and a table's columns are refused); an override set before the overrides' last
    data.name (`superseded`) that the source lacks is dropped too; any other override of
    another source's key is refused by name."""
    for where, tree in ((source, raw), (override_source, overrides)):
        if "data" in tree and tree["data"] is not None and not isinstance(tree["data"], dict):
            raise UsageError(
                f"config key 'data' is a section of keys, but {where} gives it {tree['data']!r}; "
                "set data.name=<source> and its keys instead"
            )
    file_data, over = raw.get("data") or {}, overrides.get("data") or {}
    name = over.get("name", file_data.get("name", "digits"))
    if isinstance(name, (list, dict)) or name is None or str(name) not in DATA_CONFIGS:
        return name if isinstance(name, str) else "digits"  # refused by _schema, or by the type check
    name = str(name)
    keys = {f.name: f for f in dataclasses.fields(DATA_CONFIGS[name])}
    switched = "name" in over and str(over["name"]) != str(file_data.get("name", "digits"))
    for key, value in list(file_data.items()):
        owners = data_owners(str(key))
        if str(key) in keys or not owners:
            continue  # the source's own key, or an unknown one (OmegaConf names it, with the closest)
        default = _field_default(dataclasses.fields(DATA_CONFIGS[owners[0]]), str(key))
        if not (switched or value == default) and _refused_in_files(str(key)):
            raise UsageError(f"{other_source_key(str(key), name, owners)} (from {source})")
        if not (switched or value == default):  # (a workdir's config.yaml once held every source's keys)
            print(f"note: {source}: data.{key} is not read by data.name={name}; ignored", file=sys.stderr)
        del file_data[key]
    for key in list(over):
        owners = data_owners(str(key))
        if str(key) not in keys and owners and str(key) in superseded:
            del over[key]
        elif str(key) not in keys and owners:
            raise UsageError(f"{other_source_key(str(key), name, owners)} (from {override_source})")
    return name


def _refused_in_files(key: str) -> bool:
    """The data keys a file could never give another source: a mixture, a held-out path, a
    table's columns (the rest, which config.yaml files of every run once listed, are ignored)."""
    return key in ("sources", "eval_path") or f"data.{key} " in TABLE_COLUMNS


def _field_default(fields, key: str) -> Any:
    f = next(f for f in fields if f.name == key)
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def _model_names(raw: dict, overrides: dict, source: str) -> tuple[str, str]:
    """The model the file names and the one the run uses (an override may switch it)."""
    for where, tree in ((source, raw), ("the command line", overrides)):
        if "model" in tree and tree["model"] is not None and not isinstance(tree["model"], dict):
            raise UsageError(
                f"config key 'model' is a section of keys, but {where} gives it {tree['model']!r}; "
                "set model.name=<model> and its keys instead"
            )
    file_model = (raw.get("model") or {}).get("name") or "mlp"
    model_name = (overrides.get("model") or {}).get("name") or file_model
    if not isinstance(model_name, str):
        model_name = repr(model_name)  # refused by _schema with the list of models
    return file_model, model_name


def to_yaml(cfg: Config) -> str:
    """The config as YAML, keys in the schema's order (plain PyYAML: OmegaConf takes ~0.1 s)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, allow_unicode=True)


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Writes the resolved config; `launch.py --config <this file>` reproduces the run.

    How processes found each other belongs to one launch, not to the experiment: only the
    distributed timeouts are kept."""
    launch_free = dataclasses.replace(
        cfg.distributed, coordinator_address="", coordinator_bind_address="", num_processes=0, process_id=-1
    )
    write_atomic(path, to_yaml(dataclasses.replace(cfg, distributed=launch_free)))
