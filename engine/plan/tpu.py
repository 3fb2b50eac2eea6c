"""TPU chips and pod targets as users name them (`v5p-128`, `v5e-256`, `v6e-64`, `v4-32`, or a
shape such as `v5p:4x4x8`), over the chips' published figures (engine/runtime/tpu_chips.py).

The TPU compiler (libtpu) describes any such topology on a host without TPUs
(jax.experimental.topologies), so `launch.py plan` compiles for it here."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from functools import cached_property

from engine.errors import UsageError
from engine.runtime.tpu_chips import ALIASES, CHIPS, Chip

# Chips of a whole target, its slices together. The largest published multislice job trained on
# 50,944 v5e chips (199 slices of 256; Google Cloud, November 2023); 2**16 leaves room above it.
# libtpu describes a topology of any size, but one of millions of chips takes minutes and tens of
# GB on this host before anything is checked: a larger target is refused from its numbers alone.
MAX_TARGET_CHIPS = 2**16
INSTALL = 'pip install -e ".[tpu]" (or: pip install "jax[tpu]"; the TPU compiler, libtpu)'


@dataclass(frozen=True)
class Target:
    """A pod slice (or several): the chip kind, its shape, and how many slices."""

    chip: Chip
    shape: tuple[int, ...]  # chips along each torus dimension
    slices: int = 1

    @property
    def chips(self) -> int:
        return math.prod(self.shape) * self.slices

    @property
    def topology_name(self) -> str:
        return f"{self.chip.topology}:{'x'.join(map(str, self.shape))}"

    @property
    def name(self) -> str:
        cores = math.prod(self.shape) * self.chip.cores_per_chip
        slices = f" x {self.slices} slices" if self.slices > 1 else ""
        return f"{self.chip.name}-{cores} ({self.topology_name}, {math.prod(self.shape)} chips){slices}"

    @cached_property
    def devices(self) -> list:
        """The target's devices, as the TPU compiler describes them (no chip is used)."""
        from jax.experimental import topologies

        # only compiles here: several processes may load libtpu at once (a plan beside a sweep's)
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        try:
            with _quiet_stderr():  # libtpu prints start-up complaints about the missing TPU host
                topology = topologies.get_topology_desc(
                    platform="tpu",
                    topology_name=self.topology_name,
                    num_slices=self.slices,
                    chip_config_name=self.chip.chip_config,
                )
        except Exception as e:  # libtpu missing, or a shape it refuses
            text = str(e).splitlines()[0]
            if any(word in text.lower() for word in ("libtpu", "plugin", "not found", "not installed")):
                raise UsageError(f"the TPU compiler could not be loaded ({text}); install it: {INSTALL}") from None
            raise UsageError(f"--target {self.topology_name}: the TPU compiler refuses it ({text})") from None
        return list(topology.devices)

    @cached_property
    def program_hbm_bytes(self) -> int:
        """HBM per device that the TPU compiler lets a program use (it keeps some of the chip's
        for itself: 15.75 of v5e's 16 GiB), read from its refusal of a program twice that size;
        the chip's HBM if the refusal says nothing readable."""
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        nominal = self.chip.hbm_bytes // self.chip.devices_per_chip
        sharding = NamedSharding(Mesh(self.devices[:1], ("probe",)), PartitionSpec())
        too_big = jax.ShapeDtypeStruct((nominal // 2,), jnp.float32, sharding=sharding)  # 2x the HBM
        try:
            jax.jit(lambda x: (x * 2 + 1).sum()).lower(too_big).compile()
        except jax.errors.JaxRuntimeError as e:
            found = re.search(r"exceeds available HBM \(([\d.]+)([KMGT])\)", str(e))
            if found:
                return int(float(found[1]) * 1024 ** ("KMGT".index(found[2]) + 1))
        return nominal


def parse_target(text: str, slices: int = 1) -> Target:
    """`v5p-128` (the pod name: TensorCores for v4/v5p, chips for v5e/v6e) or `v5p:4x4x8` (chips per
    torus dimension); UsageError naming the accepted forms otherwise."""
    if slices < 1:
        raise UsageError(f"--slices {slices} must be 1 or more")
    match = re.fullmatch(r"([a-z0-9]+)(?:-(\d+)|:(\d+(?:x\d+)*))", text.strip().lower())
    chip = CHIPS.get(ALIASES.get(match.group(1), match.group(1))) if match else None
    if match is None or chip is None:
        names = ", ".join(CHIPS)
        raise UsageError(
            f"--target {text!r} is not a TPU target; write the pod name (e.g. v5p-128, v5e-256, v6e-64, "
            f"v4-32) or a shape (e.g. v5p:4x4x8); chips: {names}"
        )
    numbers = (match.group(3) or match.group(2)).split("x")
    digits = max(map(len, numbers))
    if digits > 9:  # (and Python reads at most 4,300 digits)
        shown = text if len(text) <= 40 else text[:40] + "..."
        raise UsageError(
            f"--target {shown}: a number of {digits} digits is far more chips than any TPU slice (the largest "
            f"{chip.name} slice is {chip.largest_slice:,} chips); give a real slice, e.g. "
            f"{chip.name}-{_largest_pod_name(chip)}"
        )
    if match.group(3):
        shape = tuple(int(n) for n in numbers)
        if len(shape) != chip.dims or min(shape) < 1:
            raise UsageError(
                f"--target {text}: a {chip.name} slice has {chip.dims} dimensions, e.g. "
                f"{chip.name}:{'x'.join(['2'] * chip.dims)}"
            )
        _check_size(chip, math.prod(shape), slices, text)
        return Target(chip, shape, slices)
    count = int(match.group(2))
    if count % chip.cores_per_chip:
        raise UsageError(
            f"--target {text}: {chip.name} pod names count TensorCores, {chip.cores_per_chip} per chip; "
            f"use a multiple of {chip.cores_per_chip}"
        )
    _check_size(chip, count // chip.cores_per_chip, slices, text)
    return Target(chip, slice_shape(chip, count // chip.cores_per_chip, text), slices)


def _check_size(chip: Chip, chips: int, slices: int, text: str) -> None:
    """UsageError for a slice larger than the chip's largest, or more than MAX_TARGET_CHIPS in all:
    checked from the numbers, before libtpu describes the topology."""
    if chips > chip.largest_slice:
        raise UsageError(
            f"--target {text}: {chips:,} chips in one slice, but the largest {chip.name} slice is "
            f"{chip.largest_slice:,} chips (a whole pod); give at most that, e.g. "
            f"{chip.name}-{_largest_pod_name(chip)}, and --slices N for more chips"
        )
    if chips * slices > MAX_TARGET_CHIPS:
        raise UsageError(
            f"--target {text} --slices {slices}: {chips * slices:,} chips, more than the {MAX_TARGET_CHIPS:,} "
            f"a plan takes (the largest multislice jobs run about 50,000 chips); use --slices "
            f"{max(MAX_TARGET_CHIPS // chips, 1)} or fewer"
        )


def _largest_pod_name(chip: Chip) -> int:
    """The number in the name of the largest power-of-two slice (v5p-16384: 8,192 chips)."""
    return 2 ** (chip.largest_slice.bit_length() - 1) * chip.cores_per_chip


def slice_shape(chip: Chip, chips: int, text: str) -> tuple[int, ...]:
    """The usual shape of a slice of `chips` chips: powers of two, as square (or cubic) as they go,
    smaller dimensions first and a 1 last (v5p-8 → 2x2x1, v5p-256 → 4x4x8, v5e-32 → 4x8)."""
    if chips < 1 or chips & (chips - 1):
        raise UsageError(
            f"--target {text}: {chips} chips is not a power of two; give the shape instead, e.g. "
            f"{chip.name}:{'x'.join(['2'] * chip.dims)}"
        )
    shape = [1] * chip.dims
    while math.prod(shape) < chips:
        shape[shape.index(min(shape))] *= 2
    return (*sorted(d for d in shape if d > 1), *(d for d in shape if d == 1))


class _quiet_stderr:
    """Sends file descriptor 2 to /dev/null for the duration (libtpu writes there from C++)."""

    def __enter__(self):
        self.saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
