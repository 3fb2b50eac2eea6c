"""Collectives in a compiled program's HLO text: what each device sends per step.

bytes: the size of the buffer a collective produces (its HLO result shape; a tuple counts
every element); for reduce-scatter the full input (result x group), so that a gradient
reduce-scatter and a gradient all-reduce both count the gradient once. ring_bytes: what each
device sends with ring algorithms over a group of n: all-reduce 2(n-1)/n x bytes;
all-gather, reduce-scatter, all-to-all (n-1)/n x bytes; collective-permute 1 x bytes. An op
inside a loop counts once; async pairs (-start/-done) count once, at -done.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>.*?)\s(?P<op>" + "|".join(OPS) + r")(?P<suffix>-start|-done)?\("
)
ARRAY_SHAPE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")


@dataclass
class Collective:
    op: str
    bytes: int  # see the module docstring
    group: int  # devices taking part in each group

    @property
    def ring_bytes(self) -> float:
        n = self.group
        if self.op == "collective-permute":
            return float(self.bytes)
        factor = 2 * (n - 1) / n if self.op == "all-reduce" else (n - 1) / n
        return factor * self.bytes


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as `f32[64,128]{1,0}` or a tuple `(f32[10]{0}, bf16[4,8]{1,0})`."""
    return sum(
        DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in ARRAY_SHAPE.findall(shape)
    )


def group_size(line: str, num_devices: int) -> int:
    """Devices per replica group, from any of the forms XLA prints."""
    mesh_form = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if mesh_form:  # mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_2'}
        sizes = {name: int(size) for name, size in re.findall(r"'(\w+)'=(\d+)", mesh_form.group(1))}
        return math.prod(sizes[name] for name in re.findall(r"'(\w+)'", mesh_form.group(2)))
    iota_form = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if iota_form:  # [num_groups,group_size]<=[devices]
        return int(iota_form.group(2))
    listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if listed:  # {{0,2,4,6},{1,3,5,7}}
        return len(listed.group(1).split(","))
    return num_devices  # replica_groups={} (every device) or none (collective-permute)


def hlo_collectives(hlo: str, num_devices: int) -> list[Collective]:
    found = []
    for line in hlo.splitlines():
        match = INSTRUCTION.match(line)
        if not match or match.group("suffix") == "-start":  # async pairs count once, at -done
            continue
        op, size = match.group("op"), shape_bytes(match.group("shape"))
        group = group_size(line, num_devices)
        found.append(Collective(op, size * group if op == "reduce-scatter" else size, group))
    return found


def summary(collectives: list[Collective]) -> str:
    """'all-gather x4 (1.2 MiB), all-to-all x2 (64.0 KiB)': per kind, the count and bytes."""
    kinds: dict[str, list[int]] = {}
    for c in collectives:
        kinds.setdefault(c.op, []).append(c.bytes)
    return ", ".join(f"{op} x{len(sizes)} ({human_bytes(sum(sizes))})" for op, sizes in sorted(kinds.items())) or "none"


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024:
            return f"{n:.1f} {unit}"
    return f"{n / 1024:.1f} TiB"
