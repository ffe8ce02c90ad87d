"""The offers list's two queries (COUNT and page), compiled by Django once per query *shape*, not per request.

Issue 14 item 5: on the cheap combinations Django's compiling of the COUNT and the page query (~2 ms) was as much
as the SQL itself. A shape is what decides the SQL text: which filters are present (how many distinct GPU models),
the values of those that change the text (ordering, nvlink, mig_profile) and the page's slice (LIMIT/OFFSET are
inlined). Requests of one shape differ only in parameters, so the SQL is cached per shape and each request's
parameters are put into the slots where that filter's parameters go.

Which slot holds which filter's parameter is learnt by compiling the shape once more with *probe* values (distinct
numbers and strings no constant of the query equals) and finding them. The template is then checked on the very
request that filled it: its parameters, rebuilt through the slots, must equal Django's own compile exactly (values
and types), and the probe's SQL must equal the request's; otherwise the shape is marked uncached and every request
of it is compiled by Django, as is any shape this module cannot describe. tests/marketplace/test_offer_query.py
holds the cached SQL, parameters and JSON equal to Django's over many combinations.
"""
from __future__ import annotations

import re
import threading
from collections.abc import Callable
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import orjson
from django.conf import settings
from django.core.exceptions import EmptyResultSet
from django.db import connections
from django.db.models import Count, JSONField, QuerySet
from django.db.models.expressions import Col
from django_filters.constants import EMPTY_VALUES
from psycopg.types.numeric import Int2, Int4, Int8

from core.money import usd_bound_to_micros
from marketplace.models import GpuModel
from marketplace.models.host import cuda_version_code

MAX_ENTRIES = 1024  # shapes x pages; bounded so that paging deep or odd filters cannot grow a worker without end

# Filters whose cleaned value becomes query parameters: the parameters, in the order Django writes them.
# gpu_model: django-filter ORs one predicate per model in `set(value)` order.
PARAMETERS: dict[str, Callable[[Any], list[Any]]] = {
    "gpu_model": lambda value: [model.slug for model in set(value)],
    "max_price_per_gpu_hour": lambda value: [usd_bound_to_micros(value)],
    "min_cuda_version": lambda value: [cuda_version_code(value)],
    **{name: (lambda value: [value]) for name in (
        "min_gpus", "min_gpu_memory_gb", "country", "city", "min_reliability", "min_score", "min_cpu_cores",
        "min_ram_gb", "min_disk_free_gb", "min_disk_bandwidth_mbs", "min_pcie_gen", "min_pcie_width",
        "min_platform_to_node_mbps")},
}
# A parameter rebuilt from a request's value takes the Python type Django gave the probe's parameter in that slot.
REBUILD: dict[type, Callable[[Any], Any]] = {int: int, float: float, str: str, Int2: Int2, Int4: Int4, Int8: Int8}

UNCACHED = object()
_cache: dict[tuple, Any] = {}
_cache_lock = threading.Lock()


class _Compiled(Exception):
    """Stops Django's COUNT at the point it would execute: the compiler is all that is wanted."""


def _probe(name: str, value: Any, serial: int) -> Any:
    """A value for filter `name` whose parameters no constant of the query and no other probe equals."""
    if name == "gpu_model":
        # Unsaved models need a pk to be hashed into django-filter's set(); only `slug` is read.
        return [GpuModel(pk=-(serial * 100 + i + 1), slug=f"probe-{serial}-{i}") for i in range(len(set(value)))]
    if name == "max_price_per_gpu_hour":
        return Decimal(f"{9_000 + serial}.123457")
    if name == "min_cuda_version":
        return f"97.{serial}"  # a valid version (two digits of major), code 97000 + 10 x serial
    if isinstance(value, str):
        return f"probe-{serial}"
    if isinstance(value, Decimal):
        return Decimal(f"{8_000 + serial}.654321")
    if isinstance(value, int):
        return 30_001 + serial  # fits a smallint column (pcie_gen)
    raise TypeError(name)


def _empty(value: Any) -> bool:
    # What each filter skips: django-filter's EMPTY_VALUES, and an absent gpu_model (an empty queryset).
    return (isinstance(value, QuerySet) and value.query.is_empty()) or value in EMPTY_VALUES


def _shape(cleaned: dict[str, Any]) -> tuple | None:
    """The request's shape, or None for values this module does not describe."""
    shape: list[tuple[str, Any]] = []
    for name, value in cleaned.items():
        if _empty(value):
            continue
        if name in PARAMETERS:
            shape.append((name, len(set(value)) if name == "gpu_model" else 1))
        elif isinstance(value, str):
            shape.append((name, value))
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            shape.append((name, tuple(value)))
        else:
            return None
    return tuple(shape)


class _Template:
    """One query of one shape: its SQL, its parameters with the request's slots, and Django's converters."""

    __slots__ = ("sql", "params", "slots", "converters")

    def __init__(self, sql: str, params: list[Any], slots: list[tuple[int, str, int, Callable]], converters):
        self.sql, self.params, self.slots, self.converters = sql, params, slots, converters

    def bind(self, values: dict[str, list[Any]]) -> tuple[Any, ...]:
        params = list(self.params)
        for position, name, index, rebuild in self.slots:
            params[position] = rebuild(values[name][index])
        return tuple(params)


def _same(a: tuple, b: tuple) -> bool:
    # Same types and values; a JSON parameter (psycopg's Jsonb, no __eq__) by the value it wraps.
    return len(a) == len(b) and all(type(x) is type(y) and getattr(x, "obj", x) == getattr(y, "obj", y)
                                    for x, y in zip(a, b, strict=True))


def _count_compiler(query, using: str):
    """The compiler of `query.get_count()`'s query, as Django builds it (get_count: a clone, get_aggregation),
    stopped before it runs; None where Django wraps it in an outer query."""
    obj = query.clone()
    compilers = []
    own_get_compiler = obj.get_compiler

    def get_compiler(*args, **kwargs):
        compiler = own_get_compiler(*args, **kwargs)

        def execute_sql(*_args, **_kwargs):
            compilers.append(compiler)
            raise _Compiled

        compiler.execute_sql = execute_sql
        return compiler

    obj.get_compiler = get_compiler
    try:
        obj.get_aggregation(using, {"__count": Count("*")})
    except _Compiled:
        return compilers[0]
    return None  # pragma: no cover - an outer query ran for real; not a shape of this endpoint


def _compile(queryset: QuerySet, kind: str, limits: tuple[int, int] | None):
    """(sql, params, converters) of the COUNT or of the page `limits`, compiled by Django."""
    if kind == "count":
        compiler = _count_compiler(queryset.query, queryset.db)
        if compiler is None:
            return None
        sql, params = compiler.as_sql()
        return sql, tuple(params), compiler.get_converters(compiler.query.annotation_select.values())
    assert limits is not None  # a page
    compiler = queryset[limits[0]:limits[1]].query.get_compiler(queryset.db)
    sql, params = compiler.as_sql()
    return sql, tuple(params), compiler.get_converters([s[0] for s in compiler.select[0:compiler.col_count]])


class OfferQuery:
    """What the paginator reads, `count()` and one slice, run from the SQL cached for the request's shape.

    `filterset` is a validated OfferFilter; `base` the queryset it filters (offers_search's values_list)."""

    ordered = True  # ordered in SQL (the Paginator warns about unordered lists)

    def __init__(self, filterset, base: QuerySet):
        self.filterset, self.base = filterset, base
        self.cleaned = filterset.form.cleaned_data
        self.shape = _shape(self.cleaned)
        self.values = {name: PARAMETERS[name](value) for name, value in self.cleaned.items()
                       if name in PARAMETERS and not _empty(value)}

    def count(self) -> int:
        return self._run("count", None)

    def __getitem__(self, key: slice) -> list[tuple]:
        start, stop = key.start or 0, key.stop
        if stop is None or key.step is not None:
            return list(self.filterset.qs[key])
        if stop <= start:
            return []  # Django's empty slice: no query
        return self._run("page", (start, stop))

    def _key(self, kind: str, limits: tuple[int, int] | None) -> tuple:
        # The base queryset leaves sim nodes out where the platform takes none (selectors.offers_search): its SQL
        # differs with the setting, which no parameter of the request says (a template learned with it off kept
        # every sim node out after it was turned on; a CI run caught it).
        return (kind, limits, self.shape, settings.SIM_NODES_ALLOWED)

    def _run(self, kind: str, limits: tuple[int, int] | None):
        key = self._key(kind, limits)
        template = _cache.get(key) if self.shape is not None else UNCACHED
        if template is None:
            template = self._fill(key)
        if not isinstance(template, _Template):  # UNCACHED: Django as it would run without this module
            if kind == "count":
                return self.filterset.qs.count()
            assert limits is not None
            return list(self.filterset.qs[limits[0]:limits[1]])
        return self._execute(kind, template, template.bind(self.values))

    def _execute(self, kind: str, template: _Template, params: tuple):
        connection = connections[self.base.db]
        with connection.cursor() as cursor:
            cursor.execute(template.sql, params)
            rows = cursor.fetchone() if kind == "count" else cursor.fetchall()
        # Django's converters (JSON decoding, ...), as compiler.apply_converters runs them.
        converters = list(template.converters.items())
        if kind == "count":
            rows = [rows]
        out = []
        for row in rows:
            if converters:
                row = list(row)
                for position, (functions, expression) in converters:
                    value = row[position]
                    for function in functions:
                        value = function(value, expression, connection)
                    row[position] = value
            out.append(tuple(row))
        return out[0][0] if kind == "count" else out

    def template(self, kind: str, limits: tuple[int, int] | None) -> _Template | object:
        """The cached template for this request (filled if needed): tests compare it with Django's compile."""
        key = self._key(kind, limits)
        return _cache.get(key) or self._fill(key)

    def _fill(self, key: tuple) -> _Template | object:
        kind, limits = key[:2]
        template = self._learn(kind, limits)
        with _cache_lock:  # threads of one process (gthread workers) may fill at once
            while len(_cache) >= MAX_ENTRIES:
                _cache.pop(next(iter(_cache)))  # the oldest entry
            _cache[key] = template
        return template

    def _learn(self, kind: str, limits: tuple[int, int] | None) -> _Template | object:
        try:
            real = _compile(self.filterset.qs, kind, limits)
        except EmptyResultSet:  # Django answers without a query: let it
            return UNCACHED
        try:
            probes: dict[str, Any] = {}
            cleaned = {}
            for serial, (name, value) in enumerate(self.cleaned.items()):
                if name in self.values:
                    cleaned[name] = probes[name] = _probe(name, value, serial)
                else:
                    cleaned[name] = value
            probe = self._filterset_with(cleaned)
            probed = _compile(probe.filter_queryset(self.base.all()), kind, limits)
        except Exception:  # noqa: BLE001 - a filter that refuses a probe value: this shape is compiled by Django
            return UNCACHED
        if real is None or probed is None or real[0] != probed[0]:
            return UNCACHED
        expected = {name: PARAMETERS[name](value) for name, value in probes.items()}
        slots = []
        for position, param in enumerate(probed[1]):
            for name, values in expected.items():
                for index, value in enumerate(values):
                    if param == value or (isinstance(value, Decimal) and isinstance(param, float)
                                          and param == float(value)):
                        rebuild = REBUILD.get(type(param))
                        if rebuild is None:
                            return UNCACHED
                        slots.append((position, name, index, rebuild))
        # Each probe value found exactly once, else the slots are not known.
        if sorted((name, index) for _, name, index, _ in slots) != sorted(
                (name, index) for name, values in expected.items() for index in range(len(values))):
            return UNCACHED
        # gpu_model's slugs: the request's set() order, as Django writes them, in the order of the slots.
        slots = _in_value_order(slots)
        template = _Template(real[0], list(probed[1]), slots, _fast_json(real[2]))
        if not _same(template.bind(self.values), real[1]):
            return UNCACHED
        return template

    def _filterset_with(self, cleaned: dict[str, Any]):
        probe = type(self.filterset)(self.filterset.data, queryset=self.base, request=self.filterset.request)
        probe._form = SimpleNamespace(cleaned_data=cleaned)  # filter_queryset reads only cleaned_data
        return probe


def _fast_json(converters: dict[int, tuple[list[Callable], Any]]) -> dict[int, tuple[list[Callable], Any]]:
    """Django's converters, with the JSON columns' decoding done by orjson: a page's 100 summaries and price maps
    were a tenth of the request's CPU in json.loads. Only for a plain column of a JSONField without a decoder of
    its own, where JSONField.from_db_value is json.loads of the text."""
    out = {}
    for position, (functions, expression) in converters.items():
        field = getattr(expression, "output_field", None)
        plain = (isinstance(expression, Col) and isinstance(field, JSONField) and field.decoder is None)
        out[position] = ([_json_loads if plain and getattr(f, "__func__", None) is JSONField.from_db_value else f
                          for f in functions], expression)
    return out


def _json_loads(value: Any, expression: Any, connection: Any) -> Any:
    """JSONField.from_db_value's result for a column's text, through orjson."""
    if value is None:
        return None
    if _LONG_NUMBER.search(value) is None:  # orjson reads an integer beyond 64 bits as a float, json.loads exactly
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:  # what orjson refuses: as Django does
            pass
    return JSONField().from_db_value(value, expression, connection)


_LONG_NUMBER = re.compile(r"\d{19}")


def _in_value_order(slots: list[tuple[int, str, int, Callable]]) -> list[tuple[int, str, int, Callable]]:
    """Renumber each filter's slots by position: the k-th slot of a filter takes its k-th parameter."""
    seen: dict[str, int] = {}
    out = []
    for position, name, _index, rebuild in sorted(slots):
        out.append((position, name, seen.get(name, 0), rebuild))
        seen[name] = seen.get(name, 0) + 1
    return out


def clear() -> None:
    """Forget every template (tests)."""
    _cache.clear()
