"""The run configuration: the schema (schema.py), loading files and overrides (load.py), value
checks (validate.py), which configs share a compiled program (programs.py), and the generated
reference (reference.py). No jax is imported: a sweep's process reads configs."""

from engine.config.data_sections import DATA_CONFIGS, DataConfig, data_config, with_keys
from engine.config.load import CONFIG_DIR, load_config, read_yaml_mapping, save_config, shipped_configs, to_yaml
from engine.config.programs import VECTOR_KEYS, check_vectorizable, program_settings, shape_differences
from engine.config.schema import (
    CheckpointConfig,
    Config,
    DilocoConfig,
    DistributedConfig,
    EvalConfig,
    LogConfig,
    MeshConfig,
    OptimizerConfig,
    PipelineConfig,
    TrainConfig,
    WatchdogConfig,
)
from engine.config.validate import choice_message, validate

__all__ = [
    "CONFIG_DIR",
    "load_config",
    "read_yaml_mapping",
    "save_config",
    "shipped_configs",
    "to_yaml",
    "VECTOR_KEYS",
    "check_vectorizable",
    "program_settings",
    "shape_differences",
    "DATA_CONFIGS",
    "data_config",
    "with_keys",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "DistributedConfig",
    "EvalConfig",
    "LogConfig",
    "MeshConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "DilocoConfig",
    "TrainConfig",
    "WatchdogConfig",
    "choice_message",
    "validate",
]
