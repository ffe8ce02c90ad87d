"""The offer search's one statement (compat.vast.offers), compiled by Django once per query *shape*, not per request.

Building the search's queryset (OfferFilter over offers_search, the node-column conditions, the scan's order) and
compiling it was 2-6 ms of every search, as much as its SQL on the selective queries (docs/BENCHMARKS.md,
"Vast.ai-compatible offer search"). A shape is everything that decides the statement's text:

- which OfferFilter parameters narrow the nodes (compat.vast.offers._narrowing), and for `gpu_model` how many
  models (one OR'ed predicate each);
- each node-column condition's column and lookup (compat.vast.offers._column_filters), how many distinct values an
  `in` has (Django drops duplicates; the runtimes a condition on `runtime` or `vms_enabled` keeps are one `in`),
  and `verified`'s true or false (= or NOT =);
- the scan's order (the first order key and its direction), or none (every node);
- settings.SIM_NODES_ALLOWED (offers_search leaves sim nodes out in SQL where the platform takes none).

Requests of one shape differ only in parameter values. Which parameter is which value is learnt once per shape by
building the same queryset with *probe* values (numbers and strings no constant of the statement equals) and
finding them among Django's parameters; a later request of the shape puts its own values in those slots, in the
Python type Django gave the probe's (int, float, str, psycopg's Int4...). The template is checked on the request
that filled it against the search as it was built before this module (OfferFilter's form, then the column
conditions): the same SQL text, and its parameters rebuilt through the slots equal to Django's in value and type
(the constants too, so that a parameter that changes between two compiles, a time, fails the check); otherwise
the shape is marked uncached and every request of it is built and compiled by Django. So is any request this module
cannot describe: an integer beyond its column's range (Django then drops the condition or answers nothing without
SQL, another text), or a value of an unexpected type. The rows go through Django's converters (JSON through orjson,
as the native offers list) and come out as `.values()` dicts.

tests/compat/test_statements.py holds the cached statements and the answers equal to Django's over many shapes and
values; test_offers_scan.py and test_matching.py hold the answers equal to the plain rules.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from functools import cache
from types import SimpleNamespace
from typing import Any

from django.conf import settings
from django.core.exceptions import EmptyResultSet, FullResultSet
from django.db import connections
from django.db.models import Field, Q, QuerySet
from psycopg.types.numeric import Int2, Int4, Int8

from core.money import usd_bound_to_micros
from marketplace.api.offer_query import _fast_json
from marketplace.api.offers import OfferFilter
from marketplace.models import Node, Verdict
from marketplace.selectors import offers_search

MAX_ENTRIES = 256  # shapes; bounded so that odd queries cannot grow a worker without end

# A node-column condition as SQL: (column, Django lookup, values), or ("verified", None, [True|False]).
Term = tuple[str, str | None, list[Any]]

# OfferFilter's narrowing parameters (compat.vast.offers._narrowing), in the order its form cleans them (the order
# filter_queryset applies them, hence the order of the SQL's conditions), with the form's cleaning of the text.
NARROWING: dict[str, Callable[[list[str]], Any]] = {
    "gpu_model": list,  # the slugs; django-filter ORs `gpu_model__slug = slug` over set(value)
    "min_gpus": lambda texts: int(texts[-1]),
    "max_price_per_gpu_hour": lambda texts: Decimal(texts[-1]),
    "min_reliability": lambda texts: Decimal(texts[-1]),
    "country": lambda texts: texts[-1],
}
FILTER_ORDER = [name for name in OfferFilter.base_filters if name in NARROWING]
# The parameters each narrowing value becomes, in the order Django writes them (gpu_model: any order, see _same).
PARAMETERS: dict[str, Callable[[Any], list[Any]]] = {
    "gpu_model": sorted,
    "min_gpus": lambda value: [value],
    "max_price_per_gpu_hour": lambda value: [usd_bound_to_micros(value)],  # OfferFilter.filter_max_price
    "min_reliability": lambda value: [value],  # a Decimal; Django's FloatField makes it the float below (REBUILD)
    "country": lambda value: [value],
}
UNORDERED = {"gpu_model"}  # OR'ed in set() order: the same rows in any order
# A parameter rebuilt from a request's value takes the Python type Django gave the probe's parameter in that slot.
REBUILD: dict[type, Callable[[Any], Any]] = {int: int, float: float, str: str, Int2: Int2, Int4: Int4, Int8: Int8}

UNCACHED = object()
_cache: dict[tuple, Any] = {}
_lock = threading.Lock()


class Search:
    """What decides one search's statement, and its own values: OfferFilter's narrowing (`params`, the query
    parameters compat.vast.offers._narrowing made), the node-column conditions (`terms`) and the scan's order
    (`order_key`: the first key and its direction; None: every node, in no order of the scan's)."""

    def __init__(self, params, terms: list[Term], order_key: tuple[str, bool] | None, fields: tuple[str, ...]):
        self.params, self.terms, self.order_key, self.fields = params, terms, order_key, fields
        self.cleaned = {name: NARROWING[name](params.getlist(name)) for name in FILTER_ORDER if name in params}
        self.shape = _shape(self.cleaned, terms, order_key, fields)

    def groups(self) -> list[list[Any]]:
        return _groups(self.cleaned, self.terms)

    def rows(self, order, build_before: Callable[[], QuerySet], chunk_size: int | None) -> Iterator[dict[str, Any]]:
        """The nodes' NODE_VALUES dicts as `.values()` gives them, read through a server-side cursor fetching
        `chunk_size` at a time (Django's `.iterator(chunk_size)`), or all at once (None). `order`: the scan's
        OrderBy (None: none); `build_before()`: the nodes' queryset built as before this module (uncached shapes,
        and the check of a new template)."""
        template = _template(self, order, build_before)
        if not isinstance(template, _Template):
            return _django_rows(_values(build_before(), order, self.fields), chunk_size)
        return template.rows(template.bind(self.groups()), chunk_size)


def _shape(cleaned: dict[str, Any], terms: list[Term], order_key, fields: tuple[str, ...]) -> tuple | None:
    """The request's shape (the cache key), or None where this module does not describe it."""
    shape: list[Any] = [("narrow", name, len(value) if name == "gpu_model" else 1) for name, value in cleaned.items()]
    for column, lookup, values in terms:
        if lookup is None:  # verified: = or NOT =
            shape.append(("term", column, values[0]))
            continue
        low, high = _column_range(column)
        for value in values:
            if type(value) is int:
                if (low is not None and value < low) or (high is not None and value > high):
                    return None  # Django drops the condition or answers nothing: another text
            elif type(value) not in (float, str):  # str: the runtimes of `runtime IN (...)` (offers._runtimes)
                return None
        shape.append(("term", column, lookup, len(values)))
    return (tuple(shape), order_key, fields, settings.SIM_NODES_ALLOWED)


def _groups(cleaned: dict[str, Any], terms: list[Term]) -> list[list[Any]]:
    """The statement's per-request parameter values, by group: each narrowing parameter's, then each term's."""
    return [PARAMETERS[name](value) for name, value in cleaned.items()] + [
        values for _, lookup, values in terms if lookup is not None]


@cache
def _column_range(column: str) -> tuple[int | None, int | None]:
    """The integer range Django checks a lookup's value against (IntegerFieldOverflow); (None, None) for a float
    column."""
    field: Field
    annotation = offers_search().query.annotations.get(column)
    if annotation is not None:
        field = annotation.output_field
    else:
        model: Any = Node
        *path, name = column.split("__")
        for step in path:
            model = model._meta.get_field(step).related_model
        field = model._meta.get_field(name)
    internal = field.get_internal_type()
    if "Integer" not in internal and "AutoField" not in internal:
        return None, None
    return connections["default"].ops.integer_field_range(internal)


def column_q(terms: list[Term]) -> Q:
    """The terms as one Q (compat.vast.offers._column_filters builds it the same way)."""
    q = Q()
    for column, lookup, values in terms:
        if lookup is None:
            q &= Q(verdict=Verdict.VERIFIED) if values[0] else ~Q(verdict=Verdict.VERIFIED)
        else:
            q &= Q(**{f"{column}__{lookup}": values if lookup == "in" else values[0]})
    return q


def _built(cleaned: dict[str, Any], terms: list[Term]) -> QuerySet:
    """The nodes' queryset from cleaned narrowing values (no form: a probe's slugs are no catalogue's)."""
    base = offers_search()
    narrowing = OfferFilter(queryset=base)
    narrowing._form = SimpleNamespace(cleaned_data=cleaned)  # type: ignore[attr-defined]  # all filter_queryset reads
    return narrowing.filter_queryset(base).filter(column_q(terms))


def _values(nodes: QuerySet, order, fields: tuple[str, ...]) -> QuerySet:
    """What compat.vast.offers reads of the nodes: in the scan's order (then id), or as they come."""
    return (nodes.order_by(order, "id") if order is not None else nodes).values(*fields)


def _django_rows(rows: QuerySet, chunk_size: int | None) -> Iterator[dict[str, Any]]:
    return rows.iterator(chunk_size=chunk_size) if chunk_size is not None else iter(list(rows))


class _Template:
    """One shape's statement: its SQL, the probe's parameters with the request's slots, Django's converters and the
    `.values()` names."""

    __slots__ = ("sql", "params", "slots", "converters", "names", "db")

    def __init__(self, sql: str, params: list[Any], slots: list[tuple[int, int, int, Callable]], converters,
                 names: list[str], db: str):
        self.sql, self.params, self.slots, self.converters, self.names, self.db = (
            sql, params, slots, list(converters.items()), names, db)

    def bind(self, groups: list[list[Any]]) -> tuple[Any, ...]:
        params = list(self.params)
        for position, group, index, rebuild in self.slots:
            params[position] = rebuild(groups[group][index])
        return tuple(params)

    def rows(self, params: tuple[Any, ...], chunk_size: int | None) -> Iterator[dict[str, Any]]:
        """As Django's compiler runs a `.values()` query: a server-side cursor for `.iterator()` (unless the
        database settings disable them), FETCHes of chunk_size; else one fetch of every row."""
        connection = connections[self.db]
        chunked = chunk_size is not None and not connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS")
        cursor = connection.chunked_cursor() if chunked else connection.cursor()
        names, converters = self.names, self.converters
        try:
            cursor.execute(self.sql, params)
            fetch = (lambda: cursor.fetchmany(chunk_size)) if chunk_size is not None else cursor.fetchall
            while batch := fetch():
                for values in batch:
                    row = list(values)
                    for position, (functions, expression) in converters:
                        value = row[position]
                        for function in functions:
                            value = function(value, expression, connection)
                        row[position] = value
                    yield dict(zip(names, row, strict=True))
                if chunk_size is None:
                    break
        finally:
            cursor.close()


def _probe(value: Any, serial: int) -> Any:
    """A value of value's kind whose parameter no constant of the statement and no other probe equals."""
    if isinstance(value, bool):
        raise TypeError(value)
    if isinstance(value, str):
        return f"probe-{serial}"
    if isinstance(value, Decimal):
        return Decimal(f"{9_000 + serial}.123457")
    if isinstance(value, int):
        return 20_001 + serial  # within a smallint column's range (pcie_gen), and every other's
    if isinstance(value, float):
        return 7_000.25 + serial
    raise TypeError(value)


def _probes(cleaned: dict[str, Any], terms: list[Term]) -> tuple[dict[str, Any], list[Term]]:
    serial = iter(range(10**6))
    probed = {}
    for name, value in cleaned.items():
        probed[name] = ([_probe(v, next(serial)) for v in value] if isinstance(value, list)
                        else _probe(value, next(serial)))
    probed_terms: list[Term] = [(column, lookup, values if lookup is None else
                                 [_probe(v, next(serial)) for v in values]) for column, lookup, values in terms]
    return probed, probed_terms


def _compile(rows: QuerySet):
    query = rows.query
    compiler = query.get_compiler(rows.db)
    sql, params = compiler.as_sql()
    names = list(query.selected) if query.selected else [
        *query.extra_select, *query.values_select, *query.annotation_select]
    converters = compiler.get_converters([s[0] for s in compiler.select[0:compiler.col_count]])
    return sql, tuple(params), converters, names


def _equal(a: Any, b: Any) -> bool:
    # Same type and value; a JSON parameter (psycopg's Jsonb, no __eq__) by the value it wraps.
    return type(a) is type(b) and getattr(a, "obj", a) == getattr(b, "obj", b)


def _template(search: Search, order, build_before: Callable[[], QuerySet]) -> _Template | object:
    if search.shape is None:
        return UNCACHED
    key = search.shape
    with _lock:
        template = _cache.pop(key, None)
        if template is not None:
            _cache[key] = template  # used last: dropped last (one-off shapes must not push out the CLI's default)
    if template is None:
        template = _learn(search, order, build_before)
        with _lock:  # threads of one process (gthread workers) may fill at once
            while len(_cache) >= MAX_ENTRIES:
                _cache.pop(next(iter(_cache)))  # the entry used longest ago
            _cache[key] = template
    return template


def _learn(search: Search, order, build_before: Callable[[], QuerySet]) -> _Template | object:
    try:
        before = build_before()
        real = _compile(_values(before, order, search.fields))
        probed_cleaned, probed_terms = _probes(search.cleaned, search.terms)
        probe = _compile(_values(_built(probed_cleaned, probed_terms), order, search.fields))
    except (EmptyResultSet, FullResultSet):  # Django answers without this statement: let it
        return UNCACHED
    except Exception:  # noqa: BLE001 - a filter that refuses a probe value: this shape is compiled by Django
        return UNCACHED
    sql, params, _, names = probe
    if sql != real[0] or names != real[3]:
        return UNCACHED
    expected = _groups(probed_cleaned, probed_terms)
    slots: list[tuple[int, int, int, Callable]] = []
    for position, param in enumerate(params):
        for group, values in enumerate(expected):
            for index, value in enumerate(values):
                if param == value or (isinstance(value, Decimal) and isinstance(param, float)
                                      and param == float(value)):
                    rebuild = REBUILD.get(type(param))
                    if rebuild is None:
                        return UNCACHED
                    slots.append((position, group, index, rebuild))
    # Each probe value found exactly once, else the slots are not known.
    if sorted((group, index) for _, group, index, _ in slots) != [
            (group, index) for group, values in enumerate(expected) for index in range(len(values))]:
        return UNCACHED
    # A group's k-th slot (by position) takes its k-th value: gpu_model's slugs go in sorted (UNORDERED).
    numbered: dict[int, int] = {}
    ordered_slots = []
    for position, group, _index, rebuild in sorted(slots):
        ordered_slots.append((position, group, numbered.get(group, 0), rebuild))
        numbered[group] = numbered.get(group, 0) + 1
    template = _Template(sql, list(params), ordered_slots, _fast_json(real[2]), names, before.db)
    if not _same(template.bind(search.groups()), real[1], template, search):
        return UNCACHED
    return template


def _same(bound: tuple, real: tuple, template: _Template, search: Search) -> bool:
    """The bound parameters equal Django's: in type and value, each UNORDERED group's as a set of positions."""
    if len(bound) != len(real):
        return False
    unordered_groups = {i for i, name in enumerate(search.cleaned) if name in UNORDERED}
    loose = {position for position, group, _, _ in template.slots if group in unordered_groups}
    if not all(_equal(a, b) for i, (a, b) in enumerate(zip(bound, real, strict=True)) if i not in loose):
        return False
    by_group: dict[int, list[int]] = {}
    for position, group, _, _ in template.slots:
        if position in loose:
            by_group.setdefault(group, []).append(position)
    return all(sorted((type(bound[p]).__name__, bound[p]) for p in positions)
               == sorted((type(real[p]).__name__, real[p]) for p in positions) for positions in by_group.values())


def clear() -> None:
    """Forget every template (tests)."""
    _cache.clear()


def cached(search: Search) -> _Template | object | None:
    """The cache's entry for the search's shape (tests)."""
    return _cache.get(search.shape) if search.shape is not None else None
