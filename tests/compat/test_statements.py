"""The offer search's statement compiled once per query shape (compat.vast.statements): a request of a shape
another request filled must send the statement Django would have compiled for it, and answer what the plain rules
answer; values that change the statement's text get their own entry or none."""
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from compat.vast import offers, query, statements
from marketplace.selectors import offers_search
from tests.compat.test_offers_scan import market, market_rows  # noqa: F401 (the fixtures)

pytestmark = pytest.mark.usefixtures("market")
DEFAULTS = {"verified": {"eq": True}, "external": {"eq": False}, "rentable": {"eq": True}}


@pytest.fixture(autouse=True)
def empty_cache():
    statements.clear()
    yield
    statements.clear()


def parse(body: dict) -> query.Query:
    return query.parse({**DEFAULTS, "order": [["score", "desc"]], **body})


def plain(q: query.Query) -> list[dict]:
    """Every row of every offered node, every condition in Python: the search as the rules say."""
    rows = [row for node in offers_search().values(*offers.NODE_VALUES) for row in offers.offer_rows(node)
            if query.matches(row, q.conditions)]
    return query.sort(rows, q.order)[: q.limit]


def statement(q: query.Query) -> list[str]:
    """The search's statement as the server received it (values in; the server-side cursor's name, a counter,
    left out), not the catalogue's read nor the form's slug check (which the cached path skips)."""
    with CaptureQueriesContext(connection) as captured:
        offers.offers_find(q)
    return [re.sub(r"_django_curs_\w+", "CURSOR", s["sql"]) for s in captured.captured_queries
            if "marketplace_node" in s["sql"]]


def uncached(monkeypatch, q: query.Query):
    """The answer and statement of Django's own compile (no template)."""
    with monkeypatch.context() as m:
        m.setattr(statements, "_template", lambda *args: statements.UNCACHED)
        return offers.offers_find(q), statement(q)


# Pairs of one shape: the first fills the template, the second (other values) must be answered through it.
SAME_SHAPE = [
    ({"geolocation": {"eq": "DE"}, "dph_total": {"lt": 3.0}, "order": [["dph_total", "asc"]]},
     {"geolocation": {"eq": "US"}, "dph_total": {"lt": 1.3}, "order": [["dph_total", "asc"]]}),
    ({"gpu_name": {"eq": "RTX_A5000"}, "num_gpus": {"gte": 2}, "order": [["dph_total", "asc"]]},
     {"gpu_name": {"eq": "H100 SXM"}, "num_gpus": {"gte": 4}, "order": [["dph_total", "asc"]]}),
    ({"reliability": {"gte": 0.9}, "cpu_cores": {"gte": 16}, "order": [["disk_bw", "desc"]]},
     {"reliability": {"gte": 0.99}, "cpu_cores": {"gte": 64.0}, "order": [["disk_bw", "desc"]]}),
    ({"cpu_cores": {"in": [16, 32]}, "score": {"lte": 1.5}, "order": [["score", "asc"]]},
     {"cpu_cores": {"in": [64, 32.0]}, "score": {"lte": 3}, "order": [["score", "asc"]]}),
    ({"disk_space": {"gt": 1000.0}, "inet_down": {"lte": 5000.0}, "order": [["inet_down", "desc"]]},
     {"disk_space": {"gt": 499}, "inet_down": {"lte": 9400}, "order": [["inet_down", "desc"]]}),
    ({"gpu_ram": {"gte": 40000.0}, "order": [["gpu_total_ram", "desc"]]},
     {"gpu_ram": {"gte": 24000}, "order": [["gpu_total_ram", "desc"]]}),
    ({"machine_id": {"gt": 0}, "pci_gen": {"eq": 4}, "order": [["id", "desc"]]},
     {"machine_id": {"gt": 5}, "pci_gen": {"eq": 3.0}, "order": [["id", "desc"]]}),
    ({"verified": {"eq": False}, "num_gpus": {"eq": 2}, "order": [["num_gpus", "desc"]]},
     {"verified": {"eq": False}, "num_gpus": {"eq": 4}, "order": [["num_gpus", "desc"]]}),
    ({"order": [["geolocation", "asc"]], "reliability": {"gt": 0.95}},  # every node: no scan
     {"order": [["geolocation", "asc"]], "reliability": {"gt": 0.5}}),
]


@pytest.mark.parametrize(("first", "second"), SAME_SHAPE)
def test_a_shape_filled_by_one_request_answers_another_with_its_own_values(monkeypatch, first, second):
    a, b = parse(first), parse(second)
    expected_a, statement_a = uncached(monkeypatch, a)
    expected_b, statement_b = uncached(monkeypatch, b)
    assert expected_a == plain(a) and expected_b == plain(b)
    assert expected_a != expected_b, "values that give the same answer prove nothing"
    assert offers.offers_find(a) == expected_a  # fills the template
    assert len(statements._cache) == 1 and isinstance(next(iter(statements._cache.values())), statements._Template)
    assert offers.offers_find(b) == expected_b  # through it
    assert len(statements._cache) == 1
    # The very statements Django sends without the cache, values and all.
    assert statement(a) == statement_a
    assert statement(b) == statement_b


def test_several_gpu_models_bind_each_request_its_own():
    a = parse({"gpu_name": {"in": ["RTX 4090", "H100 SXM"]}, "order": [["dph_total", "asc"]]})
    b = parse({"gpu_name": {"in": ["RTX A5000", "A100 80GB SXM"]}, "order": [["dph_total", "asc"]]})
    expected_a, expected_b = plain(a), plain(b)
    assert expected_a and expected_b and expected_a != expected_b
    assert offers.offers_find(a) == expected_a
    assert offers.offers_find(b) == expected_b
    assert len(statements._cache) == 1


@pytest.mark.parametrize(("one", "other"), [
    ({"verified": {"eq": True}}, {"verified": {"eq": False}}),  # = or NOT =
    ({"cpu_cores": {"in": [16]}}, {"cpu_cores": {"in": [16, 32]}}),  # one placeholder or two
    ({"gpu_name": {"eq": "RTX 4090"}}, {"gpu_name": {"in": ["RTX 4090", "H100 SXM"]}}),  # one model or two
    ({"cpu_cores": {"gte": 32}}, {"cpu_cores": {"lte": 32}}),
    ({"cpu_cores": {"gte": 32}}, {"cpu_ram": {"gte": 32}}),  # not a column condition: no term
    ({"dph_total": {"lt": 1.0}}, {"dph_total": {"gt": 1.0}}),  # narrows, or Python only
    ({"reliability": {"gte": 0.9}}, {"reliability2": {"gte": 1.5}}),  # min_reliability, or not (above 1)
])
def test_values_that_change_the_text_get_their_own_entry(one, other):
    for body in (one, other):
        q = parse({**body, "order": [["dph_total", "asc"]]})
        assert offers.offers_find(q) == plain(q)
    assert len(statements._cache) == 2
    assert all(isinstance(t, statements._Template) for t in statements._cache.values())


def test_repeats_in_an_in_list_are_the_shape_without_them():
    """Django drops repeated values of `in` (32 and 32.0 are one integer): one placeholder."""
    a, b = parse({"cpu_cores": {"in": [32, 32.0, 32]}}), parse({"cpu_cores": {"in": [16]}})
    assert offers.offers_find(a) == plain(a)
    assert offers.offers_find(b) == plain(b)
    assert len(statements._cache) == 1


@pytest.mark.parametrize("body", [
    {"cpu_cores": {"in": []}},  # no term: the shape without it
    {"cpu_cores": {"eq": None}},  # Python only
    {"cpu_cores": {"neq": 32}},
    {"pci_gen": {"in": [None, 3]}},
    {"verified": {"eq": None}},
    {"rentable": {"eq": False}},
    {"cpu_cores": {"gte": -1}},  # below an unsigned column: Django drops the condition (another text)
    {"cpu_cores": {"gte": 10**12}},  # beyond the column: Django answers nothing without SQL
    {"cpu_cores": {"lt": 10**12}},
    {"machine_id": {"in": [1, 10**30]}},
    {"gpu_ram": {"gte": 1e30}},
    {"dph_total": {"lte": 1e300}},
    {"dph_total": {"lt": 0.0}},
])
def test_odd_values_answer_as_the_plain_rules(body):
    for order in ([["dph_total", "asc"]], [["geolocation", "asc"]]):
        q = parse({**body, "order": order})
        assert offers.offers_find(q) == plain(q)
        assert offers.offers_find(q) == plain(q)  # again, from the cache where it has the shape


def test_values_beyond_a_column_are_not_cached():
    q = parse({"cpu_cores": {"gte": 10**12}})
    search, _, _ = offers.search_of(q)
    assert search.shape is None
    assert offers.offers_find(q) == plain(q) == []
    assert statements.cached(search) is None and not statements._cache


def test_the_sim_setting_is_part_of_the_shape(settings):
    q = parse({"order": [["dph_total", "asc"]]})
    settings.SIM_NODES_ALLOWED = True
    assert offers.offers_find(q) == plain(q)
    settings.SIM_NODES_ALLOWED = False
    assert offers.offers_find(q) == plain(q)
    assert len(statements._cache) == 2


def test_a_template_that_fails_its_check_is_not_used(monkeypatch):
    """The check on the filling request (the SQL text and the bound parameters equal Django's): where it fails,
    the shape is compiled by Django on every request."""
    monkeypatch.setattr(statements, "_same", lambda *args: False)
    a = parse({"geolocation": {"eq": "DE"}, "order": [["dph_total", "asc"]]})
    b = parse({"geolocation": {"eq": "US"}, "order": [["dph_total", "asc"]]})
    assert offers.offers_find(a) == plain(a)
    assert list(statements._cache.values()) == [statements.UNCACHED]
    assert offers.offers_find(b) == plain(b)


def test_a_wrong_binding_fails_the_check(monkeypatch):
    """The check is not idle: a template that binds a value wrongly (a price one micro-dollar off) is refused."""
    real = statements.PARAMETERS["max_price_per_gpu_hour"]
    monkeypatch.setitem(statements.PARAMETERS, "max_price_per_gpu_hour", lambda value: [real(value)[0] + 1])
    q = parse({"dph_total": {"lt": 1.0}, "order": [["dph_total", "asc"]]})
    assert offers.offers_find(q) == plain(q)
    assert list(statements._cache.values()) == [statements.UNCACHED]


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(statements, "MAX_ENTRIES", 3)
    orders = ["dph_total", "score", "reliability", "disk_bw", "inet_down"]
    for field in orders:
        q = parse({"order": [[field, "desc"]]})
        assert offers.offers_find(q) == plain(q)
    assert len(statements._cache) == 3
    assert [key[1][0] for key in statements._cache] == orders[-3:]  # the oldest dropped first


def test_a_shape_in_use_outlives_one_off_shapes(monkeypatch):
    """Dropped is the shape used longest ago, not the one filled first: one-off shapes (in lists of every length)
    must not push out the CLI's default search (found by review: filled first, it was dropped first)."""
    monkeypatch.setattr(statements, "MAX_ENTRIES", 3)
    learnt = []
    real = statements._learn
    monkeypatch.setattr(statements, "_learn", lambda search, *a: (learnt.append(search.shape), real(search, *a))[1])
    hot = parse({})
    for n in range(1, 8):
        offers.offers_find(hot)
        q = parse({"machine_id": {"in": list(range(1, n + 1))}, "order": [["dph_total", "asc"]]})
        assert offers.offers_find(q) == plain(q)
    assert learnt.count(offers.search_of(hot)[0].shape) == 1 and len(learnt) == 8


def test_a_country_is_compared_as_the_rows_compare_it(db):
    """"\u212aR" (a Kelvin sign, then R) casefolds to "kr", as the rows compare a geolocation: it narrows to KR
    (found by review: upper() left it unknown and the search answered nothing)."""
    from tests.factories import make_listed_node

    make_listed_node(gpu_model="rtx-4090", gpu_count=1, country="KR")
    q = parse({"geolocation": {"eq": "\u212aR"}})
    assert plain(q) and offers.offers_find(q) == plain(q)
