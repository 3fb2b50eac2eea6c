"""What a compiled program's devices send each other, read from its HLO text.

bytes: the size of the buffer a collective produces (its HLO result shape; a tuple counts
every element); for reduce-scatter the full input (result x group), so that a gradient
reduce-scatter and a gradient all-reduce both count the gradient once. ring_bytes: what each
device sends with ring algorithms over a group of n: all-reduce 2(n-1)/n x bytes;
all-gather, reduce-scatter, all-to-all (n-1)/n x bytes; collective-permute 1 x bytes.

`count` is how many times the program runs the op: a collective inside a loop (the scanned
layers, gradient accumulation, steps per call) runs once per iteration, so its count is the
product of the trip counts of the loops around it (read from each loop's condition: i < N).
Copies of one collective that the compiler places in several fused computations (async
start and done) share a channel id and count once.

On a TPU pod of several slices the compiler lowers what crosses the data-center network to
host transfers (`send` with `_xla_megascale_transfer_type`): those are the program's DCN
collectives; the rest run over the slices' ICI. `replica_groups` name devices by their
position in the program's device assignment (the mesh's devices, flattened)."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from engine.runtime.units import human_bytes

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
SEND = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\((?P<shape>\w+\[[\d,]*\])[^=]*?\bsend\(")
MEGASCALE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
ARRAY_SHAPE = re.compile(r"\b(pred|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s+\(.*\)\s+->\s+.*\{\s*$")
CALLS = re.compile(r"\b(?P<kind>body|condition|calls|to_apply)=%?(?P<name>[\w.\-]+)")
CALL_LISTS = re.compile(r"\b(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")


@dataclass
class Collective:
    op: str
    bytes: int  # see the module docstring
    group: int  # devices taking part in each group
    count: int = 1  # times the program runs it
    dcn: bool = False  # crosses the data-center network (between slices)
    groups: Optional[list[list[int]]] = None  # device positions of each group (None: not read)

    @property
    def ring_bytes(self) -> float:
        n = self.group
        if self.op == "collective-permute" or n < 2:
            return float(self.bytes) if self.op == "collective-permute" else 0.0
        factor = 2 * (n - 1) / n if self.op == "all-reduce" else (n - 1) / n
        return factor * self.bytes


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as `f32[64,128]{1,0}` or a tuple `(f32[10]{0}, bf16[4,8]{1,0})`."""
    return sum(
        DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in ARRAY_SHAPE.findall(shape)
        if dtype in DTYPE_BYTES
    )


_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}"
)


def _iota(dims: str, perm: Optional[str]) -> np.ndarray:
    """XLA's iota device list [dims]T(perm), flattened."""
    ids = np.arange(math.prod(int(d) for d in dims.split(","))).reshape([int(d) for d in dims.split(",")])
    return (ids.transpose([int(p) for p in perm.split(",")]) if perm else ids).reshape(-1)


def _mesh_groups(found: re.Match) -> list[list[int]]:
    """mesh['axis_0'=4,'axis_1'=2], device_ids=([4,2]T(1,0)) {'axis_0'}: a group along the named
    axes of that mesh of device positions."""
    axes = re.findall(r"'(\w+)'=(\d+)", found.group(1))
    names, sizes = [name for name, _ in axes], [int(size) for _, size in axes]
    ids = _iota(found.group(2), found.group(3)) if found.group(2) else np.arange(math.prod(sizes))
    grouped = [names.index(name) for name in re.findall(r"'(\w+)'", found.group(4))]
    rest = [i for i in range(len(names)) if i not in grouped]
    size = math.prod(sizes[i] for i in grouped)
    return ids.reshape(sizes).transpose(rest + grouped).reshape(-1, size).tolist()


def replica_groups(line: str, num_devices: int) -> Optional[list[list[int]]]:
    """The device positions of each group, from the forms XLA prints ({{0,2},{1,3}}; iota
    [groups,size]<=[dims]T(perm); mesh[...] {axes}; {} for every device); None for a form not
    read here."""
    mesh_form = _MESH_GROUPS.search(line)
    if mesh_form:
        return _mesh_groups(mesh_form)
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if listed:
        groups = [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([\d,]*)\}", listed.group(1))]
        return groups or [list(range(num_devices))]
    iota = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if iota:
        count, size = int(iota.group(1)), int(iota.group(2))
        return _iota(iota.group(3), iota.group(4)).reshape(count, size).tolist()
    return None if "replica_groups=" in line else [list(range(num_devices))]


def group_size(line: str, num_devices: int) -> int:
    """Devices per replica group, from any of the forms XLA prints."""
    groups = replica_groups(line, num_devices)
    return len(groups[0]) if groups else num_devices


def _computations(hlo: str) -> dict[str, list[str]]:
    """Computation name → its instruction lines (ENTRY's under its own name and "ENTRY")."""
    found: dict[str, list[str]] = {}
    current: Optional[list[str]] = None
    for line in hlo.splitlines():
        header = HEADER.match(line)
        if header:
            current = found.setdefault(header.group("name"), [])
            if line.startswith("ENTRY"):
                found["ENTRY"] = current
        elif line.rstrip() == "}":  # (a line such as `}}, metadata=…` continues an instruction: a
            current = None  # custom call's backend config may hold newlines, as splash attention's does)
        elif current is not None:
            current.append(line)
    return found


def _trip_count(condition: list[str]) -> int:
    """A loop's trip count from its condition `i < constant(N)` (1 where it is not that simple)."""
    constants = [int(m.group(1)) for line in condition for m in [re.search(r"constant\((\d+)\)", line)] if m]
    compares = any("direction=LT" in line for line in condition)
    return constants[0] if compares and len(constants) == 1 else 1


def _executions(computations: dict[str, list[str]]) -> dict[str, int]:
    """How many times one run of the program (its ENTRY) runs each computation."""
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for name, lines in computations.items():
        if name == "ENTRY":
            continue
        for line in lines:
            calls = {m.group("kind"): m.group("name") for m in CALLS.finditer(line)}
            known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)  # XLA's own analysis, where given
            trips = int(known.group(1)) if known else _trip_count(computations.get(calls.get("condition", ""), []))
            for kind, callee in calls.items():
                callers[callee].append((name, trips if kind == "body" else 1))
            for listed in CALL_LISTS.finditer(line):
                for callee in re.findall(r"%?([\w.\-]+)", listed.group("names")):
                    callers[callee].append((name, 1))
    entry = next(name for name, lines in computations.items() if lines is computations.get("ENTRY") and name != "ENTRY")
    memo: dict[str, int] = {entry: 1}

    def runs(name: str, seen: frozenset = frozenset()) -> int:
        if name not in memo:
            memo[name] = sum(
                runs(caller, seen | {name}) * factor for caller, factor in callers[name] if caller not in seen
            )
        return memo[name]

    return {name: runs(name) for name in computations if name != "ENTRY"}


def program_collectives(hlo: str, num_devices: int, slice_of: Optional[Sequence[int]] = None) -> list[Collective]:
    """Every collective of a compiled program with how often it runs, and whether it crosses the
    data-center network (`slice_of[i]`: the slice of device position i; None: one slice)."""
    computations = _computations(hlo)
    runs = _executions(computations)
    slices = len(set(slice_of)) if slice_of is not None else 1
    found: dict[str, Collective] = {}  # channel id (or a unique key) → the collective
    for name, lines in computations.items():
        if name == "ENTRY":
            continue
        for index, line in enumerate(lines):
            collective = _collective(line, num_devices, slice_of, slices)
            if collective is None:
                continue
            collective.count = runs.get(name, 1)
            channel = re.search(r"channel_id=(\d+)", line)
            key = f"{'dcn' if collective.dcn else 'ici'}{channel.group(1)}" if channel else f"{name}:{index}"
            if key not in found or found[key].count < collective.count:
                found[key] = collective
    return list(found.values())


def _collective(line: str, num_devices: int, slice_of: Optional[Sequence[int]], slices: int) -> Optional[Collective]:
    transfer = MEGASCALE.search(line)
    send = SEND.match(line) if transfer else None
    if send and transfer:  # a host transfer between slices: its first tuple element is the payload
        op = transfer.group(1).lower().replace("_", "-")
        return Collective(op, shape_bytes(send.group("shape")), slices, dcn=True)
    match = INSTRUCTION.match(line)
    if not match or match.group("suffix") == "-start":  # async pairs count once, at -done
        return None
    op, size, group = match.group("op"), shape_bytes(match.group("shape")), group_size(line, num_devices)
    groups = replica_groups(line, num_devices)
    crosses = bool(slice_of is not None and groups and any(len({slice_of[d] for d in g}) > 1 for g in groups))
    return Collective(op, size * group if op == "reduce-scatter" else size, group, dcn=crosses, groups=groups)


def crossing(collectives: list[Collective], mesh, axis: str) -> list[Collective]:
    """The collectives whose groups span more than one index of the mesh axis `axis` (an
    unread group counts as crossing)."""
    position = list(mesh.axis_names).index(axis)
    index_of = [int(np.unravel_index(p, mesh.devices.shape)[position]) for p in range(mesh.size)]
    return [c for c in collectives if c.groups is None or any(len({index_of[d] for d in g}) > 1 for g in c.groups)]


def hlo_collectives(hlo: str, num_devices: int) -> list[Collective]:
    """The program's collectives (see program_collectives), one slice."""
    return program_collectives(hlo, num_devices)


def summary(collectives: list[Collective]) -> str:
    """'all-gather x4 (1.2 MiB), all-to-all x2 (64.0 KiB)': per kind, runs and bytes per program run."""
    kinds: dict[str, list[int]] = {}
    for c in collectives:
        kinds.setdefault(c.op, []).extend([c.bytes] * c.count)
    return ", ".join(f"{op} x{len(sizes)} ({human_bytes(sum(sizes))})" for op, sizes in sorted(kinds.items())) or "none"
