"""Mesh config → jax.sharding.Mesh with named axes (data, fsdp, expert, context, tensor)."""
from __future__ import annotations

import math

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from engine.config import MESH_AXES, MeshConfig
from engine.errors import UsageError


def mesh_shape(cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Axis sizes with the one -1 filled in; UsageError if they cannot cover num_devices."""
    sizes = {axis: getattr(cfg, axis) for axis in MESH_AXES}
    fixed = math.prod(size for size in sizes.values() if size != -1)
    layout = " x ".join(f"{axis}={size}" for axis, size in sizes.items())
    for axis, size in sizes.items():
        if size == -1:
            if num_devices % fixed:
                raise UsageError(f"mesh {layout}: the other axes use {fixed} devices, which does not divide the "
                                 f"{num_devices} devices; choose sizes whose product divides {num_devices}")
            sizes[axis] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise UsageError(f"mesh {layout} uses {math.prod(sizes.values())} devices but {num_devices} are in use; "
                         f"make {' * '.join('mesh.' + a for a in MESH_AXES)} = {num_devices} (or set one of them to -1)")
    return sizes


def num_devices(cfg: MeshConfig) -> int:
    available = jax.device_count()
    if cfg.num_devices == -1:
        return available
    if not 0 < cfg.num_devices <= available:
        raise UsageError(f"mesh.num_devices={cfg.num_devices} but {available} devices are visible; "
                         f"use 1..{available} or -1 for all")
    if cfg.num_devices != available and jax.process_count() > 1:
        raise UsageError("mesh.num_devices must be -1 (all devices) when running with several processes")
    return cfg.num_devices


def make_mesh(cfg: MeshConfig) -> Mesh:
    """A mesh over the devices in use; the data-center-network (dcn_*) factors are the outer ones."""
    count = num_devices(cfg)
    sizes = mesh_shape(cfg, count)
    shape = tuple(sizes[axis] for axis in MESH_AXES)
    dcn = tuple(getattr(cfg, f"dcn_{axis}") for axis in MESH_AXES)
    if math.prod(dcn) > 1:
        for axis, size, outer in zip(MESH_AXES, shape, dcn):
            if size % outer:
                raise UsageError(f"mesh.dcn_{axis}={outer} does not divide mesh.{axis}={size}")
        ici = tuple(size // outer for size, outer in zip(shape, dcn))
        devices = mesh_utils.create_hybrid_device_mesh(ici, dcn, jax.devices()[:count],
                                                       process_is_granule=not hasattr(jax.devices()[0], "slice_index"))
        return Mesh(devices, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    devices = jax.devices()[:count]
    return jax.make_mesh(shape, MESH_AXES, (AxisType.Auto,) * len(MESH_AXES), devices=devices)
