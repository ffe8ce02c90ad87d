"""The agent's `inventory` and `benchmark` answers checked at the boundary, before anything reads or stores them.

The node runs the platform's own agent, but what comes back over SSH is whatever the server sends: a tampered
agent, a shimmed nvidia-smi or a broken driver can answer a string where a number belongs, NaN, a number past what
a column holds, a GPU twice or not at all. Each such answer is a list of problems in words a provider can act on
("gpus[2].memory_total_mib is not an integer"); the service turns them into one REJECT finding (`inventory_malformed`,
`benchmark_malformed`), never an internal error. What passes has the types, finite numbers and ranges the policy,
the host facts and the database columns expect, and a benchmark covers each GPU it was asked about exactly once.

`storable` is the last guard before a JSON column: NaN and infinities (which PostgreSQL's jsonb refuses) become
null and NUL characters (which no text column takes) are dropped, for what the platform's own checks derive from
the node's answers (the challenge's and memory proof's figures). Pure: no Django.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import Any

from provisioning.verification.model import REJECT, Finding
from provisioning.verification.tolerances import CNN_FIGURES, FIGURES

MAX_GPUS = 64  # the agent's own bound on a GPU index (gpu_indices)
INT32_MAX = 2**31 - 1  # PostgreSQL integer columns (Gpu.memory_mib, MigSlice.memory_mib)
SMALLINT_MAX = 2**15 - 1  # MigSlice.device
FIGURE_MAX = 1e9  # no card measures a billion TFLOP/s or GB/s; past this a product of figures could overflow
MEASURE_MAX = 1e6  # watts, MHz, GB/s of a link, link counts
HOST_MAX = 10**15  # MiB of RAM, GB of disk, MB/s (host_facts' own bound)
SHOWN_PROBLEMS = 5  # the finding names the first few; the rest are counted

# A node answering like this has something between the platform's agent and its hardware (a shim, a modified
# agent, a broken nvidia-smi): what the provider can check before verifying again.
_ADVICE = ("The platform's agent does not answer like this on its own: check that `nvidia-smi` runs cleanly, "
           "remove any NVML or CUDA shim and anything that changes the agent's files, then verify again.")


class MalformedAnswer(Exception):
    """An agent answer failed its check; `finding` says what is wrong with it (REJECT)."""

    def __init__(self, command: str, problems: Sequence[str]):
        self.command, self.problems = command, list(problems)
        shown = "; ".join(self.problems[:SHOWN_PROBLEMS])
        more = len(self.problems) - SHOWN_PROBLEMS
        if more > 0:
            shown += f"; and {more} more problem{'s' if more > 1 else ''}"
        self.finding = Finding(REJECT, f"{command}_malformed",
                               f"The node's {command} answer is malformed: {shown}. {_ADVICE}")
        super().__init__(self.finding.message)


# ------------------------------------------------------------------------------------------ the pieces

class _Check:
    """Problems found so far, each naming where in the answer it is (`gpus[2].memory_total_mib`)."""

    def __init__(self) -> None:
        self.found: dict[str, str] = {}  # path -> its first problem

    def add(self, path: str, what: str) -> None:
        self.found.setdefault(path, what)

    @property
    def problems(self) -> list[str]:
        return [f"{path} {what}" for path, what in self.found.items()]

    def obj(self, value: Any, path: str, *, required: bool = False) -> dict | None:
        if value is None:
            if required:
                self.add(path, "is missing")
            return None
        if not isinstance(value, dict):
            self.add(path, "is not an object")
            return None
        return value

    def items(self, value: Any, path: str, *, required: bool = False, most: int | None = None) -> list | None:
        if value is None:
            if required:
                self.add(path, "is missing")
            return None
        if not isinstance(value, list):
            self.add(path, "is not a list")
            return None
        if most is not None and len(value) > most:
            self.add(path, f"has {len(value)} entries, more than {most}")
            return None
        return value

    def integer(self, obj: dict, key: str, path: str, high: int, *, required: bool = False,
                low: int = 0) -> int | None:
        value = obj.get(key)
        if value is None:
            if required:
                self.add(_at(path, key), "is missing")
            return None
        if type(value) is not int:  # bool is not a count, 3.0 is not an index
            self.add(_at(path, key), "is not an integer")
        elif not low <= value <= high:
            said = f"is {value}, " if abs(value) < 10**18 else ""  # a number of a thousand digits is not quoted
            self.add(_at(path, key), f"{said}outside {low}..{high}")
        else:
            return value
        return None

    def number(self, obj: dict, key: str, path: str, high: float, *, low: float = 0.0) -> None:
        value = obj.get(key)
        if value is None:
            return
        if type(value) not in (int, float):
            self.add(_at(path, key), "is not a number")
        elif type(value) is float and not math.isfinite(value):  # an int is finite: math.isfinite(10**400) raises
            self.add(_at(path, key), "is not a finite number")
        elif not low <= value <= high:  # exact for an int of any size, never converted to a float
            # `:g` of an int converts it to a float: past the double's range (10**400) that raises OverflowError
            said = f"is {value:g}, " if type(value) is float or abs(value) < 10**18 else ""
            self.add(_at(path, key), f"{said}outside {low:g}..{high:g}")

    def text(self, obj: dict, key: str, path: str, longest: int, *, required: bool = False) -> None:
        value = obj.get(key)
        if value is None:
            if required:
                self.add(_at(path, key), "is missing")
            return
        if not isinstance(value, str):
            self.add(_at(path, key), "is not a string")
        elif len(value) > longest:
            self.add(_at(path, key), f"is longer than {longest} characters")

    def flag(self, obj: dict, key: str, path: str) -> None:
        if obj.get(key) is not None and type(obj[key]) is not bool:
            self.add(_at(path, key), "is not true or false")

    def json_values(self, value: Any, path: str) -> None:
        """Anywhere in `value`, where no field's own check said something already: no NaN or infinity, no NUL
        character (iterative: the answer's depth is the node's)."""
        stack: list[tuple[Any, str]] = [(value, path)]
        while stack:
            item, where = stack.pop()
            if where in self.found:
                continue
            if isinstance(item, float) and not math.isfinite(item):
                self.add(where, "is not a finite number")
            elif isinstance(item, str) and "\x00" in item:
                self.add(where, "contains a NUL character")
            elif isinstance(item, dict):
                for key, sub in item.items():
                    if "\x00" in key:
                        self.add(where, "has a key with a NUL character")
                    stack.append((sub, f"{where}.{key}" if where else key))
            elif isinstance(item, list):
                stack.extend((sub, f"{where}[{n}]") for n, sub in enumerate(item))


def _at(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _unique(check: _Check, values: list[tuple[str, Any]], what: str) -> None:
    """Each (path, value) once: a repeated one is a problem at its path."""
    first: dict[Any, str] = {}
    for path, value in values:
        if value in first:
            check.add(path, f"repeats {what} {value} (also at {first[value]})")
        else:
            first[value] = path


# --------------------------------------------------------------------------------------------- inventory

def inventory_problems(inventory: Any) -> list[str]:
    """What is wrong with an `inventory` answer ([] when nothing): the GPUs (unique indices 0..63, their memory,
    links, power limits and names as nvidia-smi gives them), the topology, the MIG devices and the host's facts."""
    check = _Check()
    answer = check.obj(inventory, "the answer", required=True)
    if answer is None:
        return check.problems
    gpus = check.items(answer.get("gpus"), "gpus", required=True, most=MAX_GPUS) or []
    indices: list[tuple[str, Any]] = []
    for n, gpu in enumerate(gpus):
        path = f"gpus[{n}]"
        if check.obj(gpu, path, required=True) is None:
            continue
        index = check.integer(gpu, "index", path, MAX_GPUS - 1, required=True)
        if index is not None:
            indices.append((f"{path}.index", index))
        check.text(gpu, "uuid", path, 64)  # Gpu.uuid; one UUID on two GPUs is the policy's gpu_uuid_repeated
        check.text(gpu, "name", path, 200)
        check.text(gpu, "pci_bus_id", path, 32)  # Gpu.pci_bus_id
        for key in ("pci_device_id", "mig_mode", "ecc_mode"):
            check.text(gpu, key, path, 32)
        check.text(gpu, "driver_version", path, 64)
        check.integer(gpu, "memory_total_mib", path, INT32_MAX)
        for key in ("pcie_link_gen_max", "pcie_link_gen_current", "pcie_link_width_max", "pcie_link_width_current"):
            check.integer(gpu, key, path, 1024)
        for key in ("power_limit_w", "power_default_limit_w"):
            check.number(gpu, key, path, MEASURE_MAX)
    _unique(check, indices, "GPU index")
    _topology(check, answer.get("topology"))
    _mig_devices(check, answer.get("mig"))
    _host(check, answer)
    check.json_values(answer, "")
    return check.problems


def _mig_devices(check: _Check, value: Any) -> None:
    """`nvidia-smi -L`'s MIG devices, each well formed. A UUID listed twice, or a device number twice on one card,
    is no malformed answer but a fault of that card's listing, which the MIG check names on the card
    (verification/mig.py: repeated_mig_findings): here it made the whole inventory malformed, a rejection about no
    card, and every renter of the node was cut to $0/h, whichever card the driver fault was on (found by review)."""
    for n, device in enumerate(check.items(value, "mig", most=MAX_GPUS * 8) or []):
        path = f"mig[{n}]"
        if check.obj(device, path, required=True) is None:
            continue
        check.integer(device, "gpu", path, MAX_GPUS - 1, required=True)
        check.integer(device, "device", path, SMALLINT_MAX, required=True)  # MigSlice.device
        check.text(device, "profile", path, 20, required=True)  # MigSlice.profile
        check.text(device, "uuid", path, 64, required=True)  # MigSlice.uuid


def _topology(check: _Check, value: Any) -> None:
    topology = check.obj(value, "topology")
    if topology is None:
        return
    for n, pair in enumerate(check.items(topology.get("pairs"), "topology.pairs", most=MAX_GPUS ** 2) or []):
        path = f"topology.pairs[{n}]"
        if check.obj(pair, path, required=True) is not None:
            check.integer(pair, "a", path, MAX_GPUS - 1, required=True)
            check.integer(pair, "b", path, MAX_GPUS - 1, required=True)
            check.text(pair, "link", path, 16, required=True)
    for n, gpu in enumerate(check.items(topology.get("gpus"), "topology.gpus", most=MAX_GPUS) or []):
        path = f"topology.gpus[{n}]"
        if check.obj(gpu, path, required=True) is not None:
            check.integer(gpu, "index", path, MAX_GPUS - 1, required=True)
            check.integer(gpu, "links_total", path, 1024)
            check.integer(gpu, "links_active", path, 1024)
            check.number(gpu, "link_gbs", path, MEASURE_MAX)
    islands = check.items(topology.get("nvlink_islands"), "topology.nvlink_islands", most=MAX_GPUS) or []
    members: list[tuple[str, Any]] = []
    for n, island in enumerate(islands):
        path = f"topology.nvlink_islands[{n}]"
        for m, gpu in enumerate(check.items(island, path, required=True, most=MAX_GPUS) or []):
            if type(gpu) is not int or not 0 <= gpu < MAX_GPUS:
                check.add(f"{path}[{m}]", f"is not a GPU index (0..{MAX_GPUS - 1})")
            else:
                members.append((f"{path}[{m}]", gpu))
    # A GPU is in one island at most: islands that overlap ([[1, 2, 3], [0, 1]]) would be offered as two NVLink groups
    # that an NVLink booking cannot both be given (found by review; only an agent that lies sends them).
    _unique(check, members, "GPU")


def _host(check: _Check, answer: dict) -> None:
    for key in ("runtime", "cuda_version"):
        check.text(answer, key, "", 32)
    check.text(answer, "driver_version", "", 64)
    check.text(answer, "hostname", "", 255)
    check.integer(answer, "gpu_count", "", MAX_GPUS)
    check.integer(answer, "ram_mib", "", HOST_MAX)
    check.integer(answer, "disk_free_gb", "", HOST_MAX)
    cpu = check.obj(answer.get("cpu"), "cpu")
    if cpu is not None:
        check.text(cpu, "model", "cpu", 1000)
        check.integer(cpu, "cores", "cpu", INT32_MAX)
    disk = check.obj(answer.get("disk"), "disk")
    if disk is not None:
        for key in ("free_gb", "read_mbs", "write_mbs", "test_mib"):
            check.number(disk, key, "disk", HOST_MAX)
        check.text(disk, "error", "disk", 1000)
    system = check.obj(answer.get("os"), "os")
    if system is not None:
        for key in ("name", "kernel", "arch"):
            check.text(system, key, "os", 1000)


# --------------------------------------------------------------------------------------------- benchmark

# A GPU's (or a MIG slice's) measured figures: numbers from 0 to FIGURE_MAX, or null when not measured.
_FIGURES = (*FIGURES, "h2d_gbs", "d2h_gbs", *CNN_FIGURES)
_TELEMETRY = ("sm_clock_mhz", "sm_clock_max_mhz", "power_draw_w", "pcie_link_gen", "pcie_link_width")


def benchmark_problems(bench: Any, gpu_indices: Collection[int], mig_uuids: Collection[str] = (),
                       device: str = "cuda") -> list[str]:
    """What is wrong with a `benchmark` answer to a request for `gpu_indices` (and `mig_uuids`) on `device` ([] when
    nothing): each GPU asked about measured exactly once and no other, each slice at most once and none not asked
    about, every figure a finite number in range, the telemetry, the correctness check and the p2p copies well formed,
    and measured on the device asked for. The policy judges a "cpu" answer as figures only (no CUDA name, SM count,
    CUDA memory, power or fleet comparison: gpu-selfcheck --device cpu), so an answer saying so to a request for
    cuda was a shim's one-word way past those checks."""
    check = _Check()
    answer = check.obj(bench, "the answer", required=True)
    if answer is None:
        return check.problems
    if "device" in answer and answer["device"] != device:  # absent: the agent's default, cuda (as the policy reads it)
        said = answer["device"]
        shown = ("null" if said is None else repr(said) if isinstance(said, str) and len(said) <= 64
                 else "not a device name")
        check.add("device", f"is {shown}; the benchmark was asked to run on {device}")
    asked = set(gpu_indices)
    seen: list[tuple[str, Any]] = []
    for n, gpu in enumerate(check.items(answer.get("gpus"), "gpus", required=True, most=MAX_GPUS) or []):
        path = f"gpus[{n}]"
        if check.obj(gpu, path, required=True) is None:
            continue
        index = check.integer(gpu, "index", path, MAX_GPUS - 1, required=True)
        if index is not None and index not in asked:
            check.add(f"{path}.index", f"is GPU {index}, which the benchmark was not asked to measure")
        elif index is not None:
            seen.append((f"{path}.index", index))
        check.text(gpu, "uuid", path, 64)
        check.text(gpu, "name", path, 200)
        check.integer(gpu, "sm_count", path, 100_000)
        check.number(gpu, "memory_mib", path, INT32_MAX)
        _measured(check, gpu, path)
        telemetry = check.obj(gpu.get("telemetry"), f"{path}.telemetry")
        if telemetry is not None:
            where = f"{path}.telemetry"
            for key in _TELEMETRY:
                check.number(telemetry, key, where, MEASURE_MAX)
            check.number(telemetry, "temperature_c", where, 1000, low=-300)
            check.integer(telemetry, "samples", where, INT32_MAX)
            for m, reason in enumerate(check.items(telemetry.get("clocks_event_reasons"),
                                                   f"{where}.clocks_event_reasons", most=64) or []):
                if not isinstance(reason, str):
                    check.add(f"{where}.clocks_event_reasons[{m}]", "is not a string")
            check.obj(telemetry.get("clocks_event_reason_samples"), f"{where}.clocks_event_reason_samples")
            check.text(telemetry, "error", where, 1000)
        shapes = check.obj(gpu.get("matmul_shapes_tflops"), f"{path}.matmul_shapes_tflops") or {}
        for dtype, figures in shapes.items():
            where = f"{path}.matmul_shapes_tflops.{dtype}"
            for m, value in enumerate(check.items(figures, where, most=64) or []):
                if value is not None and (type(value) not in (int, float) or not 0 <= value <= FIGURE_MAX):
                    check.add(f"{where}[{m}]", f"is not a number from 0 to {FIGURE_MAX:g}")
    _unique(check, seen, "GPU")
    missing = sorted(asked - {index for _, index in seen})
    if missing:
        check.add("gpus", f"has no figures for GPU{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}, "
                          "which the benchmark was asked to measure")
    for n, pair in enumerate(check.items(answer.get("p2p"), "p2p", most=MAX_GPUS ** 2) or []):
        path = f"p2p[{n}]"
        if check.obj(pair, path, required=True) is not None:
            check.integer(pair, "a", path, MAX_GPUS - 1, required=True)
            check.integer(pair, "b", path, MAX_GPUS - 1, required=True)
            check.number(pair, "gbs", path, MEASURE_MAX)
    _slices(check, answer.get("mig_slices"), set(mig_uuids))
    for key in ("mode", "device", "agent_version", "torch_version", "cuda_runtime"):
        check.text(answer, key, "", 64)
    check.flag(answer, "quick", "")
    for key in ("duration_s", "time_limit_s"):
        check.number(answer, key, "", HOST_MAX)
    check.json_values(answer, "")
    return check.problems


def _measured(check: _Check, row: dict, path: str) -> None:
    for key in _FIGURES:
        check.number(row, key, path, FIGURE_MAX)
    errors = check.obj(row.get("matmul_rel_error"), f"{path}.matmul_rel_error") or {}
    for dtype in errors:
        check.number(errors, dtype, f"{path}.matmul_rel_error", FIGURE_MAX)


def _slices(check: _Check, value: Any, asked: set[str]) -> None:
    seen: list[tuple[str, Any]] = []
    for n, row in enumerate(check.items(value, "mig_slices", most=MAX_GPUS * 8) or []):
        path = f"mig_slices[{n}]"
        if check.obj(row, path, required=True) is None:
            continue
        uuid = row.get("uuid")
        if not isinstance(uuid, str):
            check.add(f"{path}.uuid", "is not a string" if uuid is not None else "is missing")
        elif uuid not in asked:
            check.add(f"{path}.uuid", "is a MIG slice the benchmark was not asked to measure")
        else:
            seen.append((f"{path}.uuid", uuid))
        check.integer(row, "gpu", path, MAX_GPUS - 1)
        check.integer(row, "device", path, SMALLINT_MAX)
        check.text(row, "profile", path, 20)
        check.number(row, "memory_mib", path, INT32_MAX)
        _measured(check, row, path)
    _unique(check, seen, "MIG slice")


# ------------------------------------------------------------------------------------------ storing

def storable(value: Any) -> Any:
    """`value` as a JSON column takes it: NaN and infinities become null, NUL characters are dropped (in keys
    too). Iterative, so an answer's depth cannot exhaust the stack."""
    def clean(item: Any) -> Any:
        if isinstance(item, float):
            return item if math.isfinite(item) else None
        if isinstance(item, str):
            return item.replace("\x00", "")
        return item

    if not isinstance(value, dict | list):
        return clean(value)
    root: Any = {} if isinstance(value, dict) else []
    stack: list[tuple[Any, Any]] = [(value, root)]
    while stack:
        source, target = stack.pop()
        pairs = source.items() if isinstance(source, dict) else enumerate(source)
        for key, item in pairs:
            if isinstance(item, dict | list):
                copy: Any = {} if isinstance(item, dict) else []
                stack.append((item, copy))
            else:
                copy = clean(item)
            if isinstance(target, dict):
                target[clean(str(key))] = copy
            else:
                target.append(copy)
    return root
