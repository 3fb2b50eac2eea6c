"""Mesh config → jax.sharding.Mesh with the named axes of engine/parallel/axes.py (every mesh has them
all; an axis the run does not use has size 1)."""

from __future__ import annotations

import math
from typing import Optional, Sequence

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from engine.errors import UsageError
from engine.parallel.axes import CONFIG_AXES, MESH_AXES


def mesh_shape(cfg, num_devices: int) -> dict[str, int]:
    """The configured axes' sizes with the one -1 filled in; UsageError if they cannot cover num_devices."""
    sizes = {axis: getattr(cfg, axis) for axis in CONFIG_AXES}
    fixed = math.prod(size for size in sizes.values() if size != -1)
    layout = " x ".join(f"{axis}={size}" for axis, size in sizes.items())
    for axis, size in sizes.items():
        if size == -1:
            if num_devices % fixed:
                raise UsageError(
                    f"mesh {layout}: the other axes use {fixed} devices, which does not divide the "
                    f"{num_devices} devices; choose sizes whose product divides {num_devices}"
                )
            sizes[axis] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        hint = (
            "; on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N before starting gives N devices"
            if jax.default_backend() == "cpu" and math.prod(sizes.values()) > num_devices
            else ""
        )
        raise UsageError(
            f"mesh {layout} uses {math.prod(sizes.values())} devices but {num_devices} are in use; "
            f"make {' * '.join('mesh.' + a for a in CONFIG_AXES)} = {num_devices} (or set one of them "
            f"to -1){hint}"
        )
    return sizes


def num_devices(cfg) -> int:
    available = jax.device_count()
    if cfg.num_devices == -1:
        return available
    if not 0 < cfg.num_devices <= available:
        raise UsageError(
            f"mesh.num_devices={cfg.num_devices} but {available} devices are visible; use 1..{available} or -1 for all"
        )
    if cfg.num_devices != available and jax.process_count() > 1:
        raise UsageError("mesh.num_devices must be -1 (all devices) when running with several processes")
    return cfg.num_devices


def full_shape(sizes: dict[str, int]) -> tuple[int, ...]:
    """Sizes of every mesh axis (1 where `sizes` does not name it), in MESH_AXES order."""
    return tuple(sizes.get(axis, 1) for axis in MESH_AXES)


def build_mesh(sizes: dict[str, int], dcn: dict[str, int], devices: Sequence) -> Mesh:
    """A mesh of `devices` with these axis sizes; the dcn_* factors of each axis are its outer part
    (they cross slices, or hosts where devices know no slice)."""
    shape = full_shape(sizes)
    outer = tuple(dcn.get(axis, 1) for axis in MESH_AXES)
    types = (AxisType.Auto,) * len(MESH_AXES)
    # a physical torus axis is split between mesh axes only where no whole-axis assignment
    # exists (a 2-way tensor axis on an 8x8 v6e slice)
    if math.prod(outer) == 1:
        grid = mesh_utils.create_device_mesh(shape, list(devices), allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=types)
    for axis, size, part in zip(MESH_AXES, shape, outer):
        if size % part:
            raise UsageError(f"mesh.dcn_{axis}={part} does not divide mesh.{axis}={size}")
    inner = tuple(size // part for size, part in zip(shape, outer))
    # without slices (CPU and GPU hosts say slice 0 or nothing), each process is a granule
    granule = len({getattr(d, "slice_index", None) for d in devices}) == 1
    grid = mesh_utils.create_hybrid_device_mesh(
        inner, outer, list(devices), process_is_granule=granule, allow_split_physical_axes=True
    )
    return Mesh(grid, MESH_AXES, axis_types=types)


def make_mesh(cfg, devices: Optional[Sequence] = None, replicas_from: str = "") -> Mesh:
    """The config's mesh over the devices in use (or over `devices`: a TPU topology's chips).
    replicas_from (train.sync=diloco): "data" makes every data-parallel index a replica,
    "dcn_data" the slices of mesh.dcn_data; the replica axis takes them from the data axis."""
    devices = list(devices) if devices is not None else jax.devices()[: num_devices(cfg)]
    sizes = mesh_shape(cfg, len(devices))
    dcn = {axis: getattr(cfg, f"dcn_{axis}") for axis in CONFIG_AXES}
    if replicas_from:
        replicas = sizes["data"] if replicas_from == "data" else dcn["data"]
        if replicas == 1:
            raise UsageError(
                f"train.sync=diloco: diloco.replica_axis={replicas_from} gives 1 replica on "
                f"{len(devices)} devices; make mesh.{replicas_from} the number of replicas (at least 2)"
            )
        sizes = {"replica": replicas, **sizes, "data": sizes["data"] // replicas}
        dcn = {"replica": dcn["data"], **dcn, "data": 1}
    return build_mesh(sizes, dcn, devices)
