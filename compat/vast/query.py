"""The query of `vastai search offers` (POST /api/v0/bundles/): `{field: {op: value}, "order": [[field, dir]],
"type": ..., "limit": ...}`, checked and turned into conditions on the offers' rows.

Values arrive as the CLI parsed them from text ("2", "RTX A6000", 40000.0, true), so each field says its type and a
value that is not one is a 400; so is a field this platform cannot answer honestly (a Vast field it does not
measure: filtering on it would silently drop or keep everything) and any field it does not know.
"""
from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from core.errors import ValidationFailed
from core.validators import whole_number
from marketplace.models import Runtime


class Version:
    """The kind of `driver_version`: shown as the driver prints it ("535.104.05"), compared as the CLI's
    numeric_version makes of it (535104005), which is what parse_query sends for a dotted value."""

# The fields of an offer row (compat.vast.offers) a query may filter and order on, by type.
FIELDS: dict[str, type] = {
    "id": int, "ask_contract_id": int, "machine_id": int, "num_gpus": int,
    "gpu_name": str, "gpu_ram": float, "gpu_total_ram": float,
    "dph_total": float, "dph_base": float,
    "reliability": float, "reliability2": float, "score": float, "pcie_bw": float,
    "geolocation": str, "verification": str,
    "verified": bool, "rentable": bool, "rented": bool, "external": bool,
    # The node's disk price (USD per GB per 30-day month, what a stopped instance's disk and a volume cost), its
    # runtime (`docker`, `libvirt`, `sim`: a booking on libvirt takes no env, ports or onstart) and Vast's flag for
    # the same fact (vms_enabled: the offer's instances are virtual machines, runtime libvirt).
    "storage_cost": float, "runtime": str, "vms_enabled": bool,
    # The benchmark's measured GPU memory and NVLink bandwidth (GB/s, compat.vast.offers.measured_fields): absent
    # on a row until measured.
    "gpu_mem_bw": float, "bw_nvlink": float,
    # The host's measured facts (compat.vast.offers.host_fields): absent on a row until measured.
    "cpu_name": str, "cpu_cores": int, "cpu_ram": float, "disk_space": float, "disk_bw": float, "inet_down": float,
    "driver_version": Version, "cuda_max_good": float, "pci_gen": float,
}
KIND_WORDS = {int: "a whole number", float: "a number", str: "text", bool: "true or false",
              Version: "a driver version (535.104.05, or 535104005 as the CLI sends it)"}
# Vast's own aliases (the CLI rewrites them; the SDK and raw API users send them as they are).
ALIASES = {"dph": "dph_total", "reliability_2": "reliability2", "cuda_vers": "cuda_max_good"}
# Vast fields this platform does not measure or offer: named in the 400, so that nobody wonders why.
NOT_OFFERED = {
    "compute_cap", "cpu_arch", "cpu_cores_effective", "cpu_ghz", "datacenter",
    "direct_port_count", "dlperf", "dlperf_per_dphtotal", "dlperf_usd", "duration", "flops_per_dphtotal",
    "flops_usd", "gpu_arch", "gpu_display_active", "display_active", "gpu_frac", "gpu_max_power", "gpu_max_temp",
    "has_avx", "host_id", "inet_down_cost", "inet_up", "inet_up_cost", "min_bid", "mobo_name",
    "static_ip", "total_flops", "ubuntu_version", "cluster_id",
}
assert not NOT_OFFERED & (set(FIELDS) | set(ALIASES))
OPERATORS = ("eq", "neq", "gt", "gte", "lt", "lte", "in", "notin")
ORDERED_OPERATORS = {"gt", "gte", "lt", "lte"}
# Keys of the body that are not filters.
SETTINGS = {"order", "type", "limit", "allocated_storage", "disable_bundling"}
DEFAULT_ORDER = [("score", True)]
DEFAULT_LIMIT = 64
MAX_LIMIT = 1000


@dataclass(frozen=True)
class Condition:
    field: str
    op: str
    value: Any  # the field's type, a list of it for in/notin, or None


@dataclass
class Query:
    conditions: list[Condition] = field(default_factory=list)
    order: list[tuple[str, bool]] = field(default_factory=lambda: list(DEFAULT_ORDER))  # (field, descending)
    limit: int = DEFAULT_LIMIT


def gpu_name_key(name: str) -> str:
    """"RTX_A6000", "rtx a6000", "NVIDIA RTX A6000" all name one card; "GeForce RTX 3090" is "RTX 3090"."""
    words = re.sub(r"[\s_\-]+", " ", name).strip().casefold().split(" ")
    while words and words[0] in ("nvidia", "geforce"):
        words = words[1:]
    return " ".join(words)


_VERSION_RE = re.compile(r"([0-9]{1,3})\.([0-9]{1,3})(?:\.([0-9]{1,3}))?")


def version_number(value: Any) -> int | None:
    """A driver version as the CLI's numeric_version: major * 10**6 + minor * 10**3 + patch ("535.104.05" is
    535104005, "550.54" is 550054000); an int is taken as that number already. None for anything else (a driver
    that printed its version otherwise is not comparable, as if not measured)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if 0 <= value < 10**9 else None
    if isinstance(value, float):
        return version_number(int(value)) if value.is_integer() else None
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        # The CLI's parse_query makes a number only of a dotted value: `driver_version>=535104005` comes as text.
        # Below 10**6 it names no major version ("535" meant 535.x, not 0.0.535): refused, as before.
        number = int(value.strip()[:12])
        return number if 10**6 <= number < 10**9 and len(value.strip()) <= 12 else None
    match = _VERSION_RE.fullmatch(value.strip()) if isinstance(value, str) else None
    if match is None:
        return None
    return int(match[1]) * 10**6 + int(match[2]) * 10**3 + int(match[3] or 0)


# The text of a whole number: digits, and a fraction of zeros only ("5.0", as a float is written).
_WHOLE_TEXT = re.compile(r"([0-9]+)(?:\.0+)?")


def whole(value: Any, name: str, *, low: int, high: int, words: str | None = None) -> int:
    """A count, limit or id of a JSON body or query (or of a URL's query string) as an int from `low` to `high`:
    a JSON integer, a number with a whole value (5.0: what a JSON encoder writes for a number kept as a float, as
    JavaScript's and Python's do) or the text of either ("5", "5.0"). Anything else is a 400 naming the field
    (`words` says what it is, "a whole number from LOW to HIGH" unless given): a fraction (5.5), true or false
    (by type: True is 1 in Python), NaN, an infinity, text that is no number, one out of range however long."""
    number: int | None = None
    if type(value) is int:
        number = value
    elif type(value) is float:
        number = int(value) if value.is_integer() else None  # False for NaN and the infinities
    elif isinstance(value, str) and len(value) <= len(str(high)) + 20:
        # Digits counted before int() (whole_number): Python refuses a string of more than 4300 digits.
        match = _WHOLE_TEXT.fullmatch(value)
        number = whole_number(match[1], low=low, high=high) if match else None
    if number is None or not low <= number <= high:
        raise ValidationFailed(f"`{name}` is {words or f'a whole number from {low} to {high}'}.", field=name)
    return number


def _field_name(name: str) -> str:
    name = ALIASES.get(name, name)
    if name in FIELDS:
        return name
    if name in NOT_OFFERED:
        raise ValidationFailed(f"`{name}` is a Vast.ai field this platform does not measure or offer; leave it out "
                               f"of the query (fields: {', '.join(sorted(FIELDS))}).", field=name)
    raise ValidationFailed(f"Unknown field `{name}` (fields: {', '.join(sorted(FIELDS))}).", field=name)


def _coerce(name: str, value: Any) -> Any:
    kind = FIELDS[name]
    shown = repr(value) if not isinstance(value, int) or abs(value) < 10**40 else "a number that large"
    wrong = ValidationFailed(f"`{name}` takes {KIND_WORDS[kind]}, not {shown[:100]}.", field=name)
    if value is None:
        return None
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise wrong
    if kind is str:
        if not isinstance(value, str) or len(value) > 200:
            raise wrong
        # A runtime is one of the node's (compared without case, as the rows compare text): a word that names none
        # (a typo, Vast's `kvm`) is a 400, not a search that silently answers nothing (or everything, for neq).
        if name == "runtime" and value.casefold() not in Runtime.values:
            raise ValidationFailed(f"`runtime` is one of {', '.join(Runtime.values)} (how the node runs instances), "
                                   f"not {value[:100]!r}.", field=name)
        return value
    if kind is Version:
        version = version_number(value)
        if version is None:
            raise wrong
        return version
    if isinstance(value, bool):
        raise wrong
    try:
        number = float(value) if isinstance(value, str | int | float) else math.nan
    except (ValueError, OverflowError):  # OverflowError: an integer beyond a float's range
        raise wrong from None
    if not math.isfinite(number):
        raise wrong
    if kind is int:
        if not number.is_integer():
            raise wrong
        return int(number)
    return number


def _conditions(name: str, spec: Any) -> list[Condition]:
    name = _field_name(name)
    if not isinstance(spec, Mapping) or not spec:
        raise ValidationFailed(f"`{name}` needs operators and values, e.g. {{\"gte\": 2}}; got {spec!r}.", field=name)
    out = []
    for op, value in spec.items():
        if op not in OPERATORS:
            raise ValidationFailed(f"Unknown operator `{op}` for `{name}` (operators: {', '.join(OPERATORS)}).",
                                   field=name)
        if op in ORDERED_OPERATORS and FIELDS[name] in (str, bool):
            raise ValidationFailed(f"`{name}` cannot be compared with `{op}`: use eq, neq, in or notin.", field=name)
        if op in ("in", "notin"):
            if not isinstance(value, list) or len(value) > 100:
                raise ValidationFailed(f"`{name}` `{op}` takes a list of values, not {value!r}.", field=name)
            out.append(Condition(name, op, [_coerce(name, item) for item in value]))
        elif value is None and op in ORDERED_OPERATORS:
            raise ValidationFailed(f"`{name}` `{op}` needs a value.", field=name)
        else:
            out.append(Condition(name, op, _coerce(name, value)))
    return out


def _order(value: Any) -> list[tuple[str, bool]]:
    if not isinstance(value, list) or len(value) > 10:
        raise ValidationFailed(f"`order` is a list of [field, \"asc\"|\"desc\"], not {value!r}.", field="order")
    order = []
    for item in value:
        if isinstance(item, str):
            item = [item, "asc"]
        if (not isinstance(item, list | tuple) or len(item) != 2 or not isinstance(item[0], str)
                or item[1] not in ("asc", "desc")):
            raise ValidationFailed(f"`order` takes [field, \"asc\"|\"desc\"] pairs, not {item!r}.", field="order")
        order.append((_field_name(item[0]), item[1] == "desc"))
    return order or list(DEFAULT_ORDER)


def parse(body: Any) -> Query:
    """The request body as a Query; a ValidationFailed (400) names what is wrong."""
    if not isinstance(body, Mapping):
        raise ValidationFailed("The query is a JSON object: {field: {operator: value}, \"order\": ..., ...}.")
    query = Query()
    kind = body.get("type", "on-demand")
    if kind != "on-demand":  # what the CLI sends by default (search offers -t/-d); -b, -i, -r send bid, reserved
        raise ValidationFailed(f"Only on-demand offers exist here (`type` {kind!r}): no interruptible (bid) or "
                               "reserved pricing.", field="type")
    if "order" in body:
        query.order = _order(body["order"])
    if body.get("limit") is not None:
        query.limit = whole(body["limit"], "limit", low=1, high=MAX_LIMIT)
    storage = body.get("allocated_storage")
    if storage is not None and (isinstance(storage, bool) or not isinstance(storage, int | float)):
        raise ValidationFailed("`allocated_storage` is a number (GiB).", field="allocated_storage")
    for name, spec in body.items():
        if name not in SETTINGS:
            query.conditions.extend(_conditions(name, spec))
    return query


def compare(op: str, have: Any, want: Any, norm: Callable[[Any], Any]) -> bool:
    # Normalised for the ordered operators too: a row's driver_version is text, compared as its number.
    have = norm(have)
    if op == "in":
        return have in [norm(w) for w in want]
    if op == "notin":
        return have not in [norm(w) for w in want]
    want = norm(want)
    if op == "eq":
        return have == want
    if op == "neq":
        return have != want
    if have is None:
        return False  # not measured: never "greater" or "less" than anything
    return {"gt": have > want, "gte": have >= want, "lt": have < want, "lte": have <= want}[op]


def norm_for(name: str) -> Callable[[Any], Any]:
    """How a field's values compare: GPU names by gpu_name_key, a driver version by its number, other text
    without case. `show instances` filters its columns the same way."""
    if name == "gpu_name":
        return lambda v: gpu_name_key(v) if isinstance(v, str) else v
    if FIELDS.get(name) is Version:
        return lambda v: version_number(v) if isinstance(v, str) else v
    return lambda v: v.casefold() if isinstance(v, str) else v


def matches(row: Mapping[str, Any], conditions: list[Condition]) -> bool:
    return all(compare(c.op, row.get(c.field), c.value, norm_for(c.field)) for c in conditions)


_ORDERED = {"gt": operator.gt, "gte": operator.ge, "lt": operator.lt, "lte": operator.le}


def _check(c: Condition) -> Callable[[Mapping[str, Any]], bool]:
    """compare() of one condition with its wanted value normalised once, not once per row: what `matcher` is made
    of. The same answer for every row (tests/compat/test_matching.py holds them equal)."""
    field, norm = c.field, norm_for(c.field)
    if c.op in ("in", "notin"):
        wanted = [norm(w) for w in c.value]
        if c.op == "in":
            return lambda row: norm(row.get(field)) in wanted
        return lambda row: norm(row.get(field)) not in wanted
    want = norm(c.value)
    if c.op == "eq":
        return lambda row: norm(row.get(field)) == want
    if c.op == "neq":
        return lambda row: norm(row.get(field)) != want
    ordered = _ORDERED[c.op]

    def check(row: Mapping[str, Any]) -> bool:
        have = norm(row.get(field))
        return have is not None and ordered(have, want)
    return check


def matcher(conditions: list[Condition]) -> Callable[[Mapping[str, Any]], bool]:
    """matches(row, conditions) as one function of the row, for many rows (a search checks hundreds)."""
    checks = [_check(c) for c in conditions]
    if not checks:
        return lambda row: True
    if len(checks) == 1:
        return checks[0]
    return lambda row: all(check(row) for check in checks)


def _key(name: str, norm: Callable[[Any], Any]) -> Callable[[dict[str, Any]], Any]:
    return lambda row: norm(row[name])


def sort(rows: list[dict[str, Any]], order: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    """Stable sorts from the last key to the first; rows without a value (null) last either way; `id` breaks ties."""
    rows = sorted(rows, key=lambda r: r["id"])
    for name, descending in reversed(order):
        norm = norm_for(name)
        # By the normalised value: a driver version that is not a number sorts with the unmeasured.
        present = [r for r in rows if norm(r.get(name)) is not None]
        absent = [r for r in rows if norm(r.get(name)) is None]
        rows = sorted(present, key=_key(name, norm), reverse=descending) + absent
    return rows
