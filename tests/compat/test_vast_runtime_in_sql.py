"""`search offers`' conditions on `runtime` (and Vast's `vms_enabled`, the same fact) narrow the nodes in SQL, as
the other node-column conditions do (compat.vast.offers._runtimes): they were applied to the rows in Python only,
after the nodes were read, so a search for the rare runtime read every node of the others (the scan found no row
of it in its first batches and read on, to the end). The answers stay exactly the plain rules' (every row of every
offered node, every condition in Python), and a value that names no runtime is a 400."""
import pytest

from compat.vast import offers, query, statements
from marketplace.models import Node
from marketplace.selectors import offers_search
from tests import module_rows
from tests.compat.test_offers_scan import market, market_rows  # noqa: F401 (the fixtures)
from tests.factories import UserFactory, make_listed_node

V0 = "/compat/vast/api/v0"
DEFAULTS = {"verified": {"eq": True}, "external": {"eq": False}, "rentable": {"eq": True}}


@pytest.fixture(autouse=True)
def empty_cache():
    statements.clear()
    yield
    statements.clear()


@pytest.fixture(autouse=True)
def _market_only_where_asked(request):
    """The market is built once for the module's last tests (test_offers_scan.market_rows): the tests above them,
    with rows of their own, must not run beside it."""
    module_rows.require_absent(request, "market")


def parse(body: dict) -> query.Query:
    return query.parse({**DEFAULTS, "order": [["score", "desc"]], **body})


def plain(q: query.Query) -> list[dict]:
    """Every row of every offered node, every condition in Python: the search as the rules say."""
    rows = [row for node in offers_search().values(*offers.NODE_VALUES) for row in offers.offer_rows(node)
            if query.matches(row, q.conditions)]
    return query.sort(rows, q.order)[: q.limit]


def nodes_read(monkeypatch, q: query.Query) -> tuple[list[dict], int]:
    """The answer, and how many nodes the search read from the database (every node it read is given to
    matching_rows, once)."""
    seen = []
    real = offers.matching_rows

    def counting(nodes, conditions):
        seen.extend(node["id"] for node in nodes)
        return real(nodes, conditions)

    with monkeypatch.context() as m:
        m.setattr(offers, "matching_rows", counting)
        answer = offers.offers_find(q)
    assert len(seen) == len(set(seen))
    return answer, len(seen)


@pytest.fixture
def mostly_docker(db):
    """40 docker nodes that come first in the default order (score), and 3 libvirt nodes after them."""
    provider = UserFactory()
    docker = [make_listed_node(provider, gpu_model="rtx-a4000", gpu_count=1, runtime="docker", score=3.0)
              for _ in range(40)]
    libvirt = [make_listed_node(provider, gpu_model="rtx-a4000", gpu_count=2, runtime="libvirt", score=1.0)
               for _ in range(3)]
    return docker, libvirt


@pytest.mark.parametrize("body", [
    {"runtime": {"eq": "libvirt"}},
    {"runtime": {"eq": "LIBVIRT"}},
    {"runtime": {"neq": "docker"}},
    {"runtime": {"in": ["libvirt", "sim"]}},
    {"runtime": {"notin": ["docker"]}},
    {"vms_enabled": {"eq": True}},
    {"vms_enabled": {"neq": False}},
    {"runtime": {"eq": "libvirt"}, "order": [["dph_total", "asc"]]},
    {"runtime": {"eq": "libvirt"}, "order": [["geolocation", "asc"]]},  # no scan: every node, as it comes
])
def test_a_runtime_condition_reads_only_the_nodes_of_that_runtime(mostly_docker, monkeypatch, body):
    """On the old code the default search (score desc, limit 2) read its first batch of 34 docker nodes, found no
    libvirt row, and read on to all 43; an order that is no scan read all 43 as well."""
    _, libvirt = mostly_docker
    for limit in (2, 64):
        q = parse({**body, "limit": limit})
        answer, read = nodes_read(monkeypatch, q)
        assert answer == plain(q) and {row["machine_id"] for row in answer} <= {node.pk for node in libvirt}
        assert len(answer) == min(limit, 6)
        assert read == len(libvirt), f"limit {limit}: read {read} nodes"


def test_the_docker_search_reads_no_libvirt_node(mostly_docker, monkeypatch):
    docker, _ = mostly_docker
    q = parse({"runtime": {"eq": "docker"}, "order": [["score", "asc"]], "limit": 5})
    answer, read = nodes_read(monkeypatch, q)
    assert answer == plain(q) and len(answer) == 5 and {row["runtime"] for row in answer} == {"docker"}
    assert read == len(docker)  # the docker nodes only (ties on score: all of them); the libvirt ones came first


@pytest.mark.parametrize(("body", "named"), [
    ({"runtime": {"eq": "kvm"}}, "'kvm'"),
    ({"runtime": {"neq": "dockr"}}, "'dockr'"),
    ({"runtime": {"in": ["docker", "vm"]}}, "'vm'"),
    ({"runtime": {"notin": [""]}}, "''"),
    ({"runtime": {"eq": "docker "}}, "'docker '"),
])
def test_a_value_that_names_no_runtime_is_a_400(anon, db, body, named):
    """It answered nothing (eq, in) or everything (neq, notin), silently: a typo looked like an empty market."""
    make_listed_node(gpu_model="rtx-a4000", gpu_count=1, runtime="docker")
    r = anon.post(f"{V0}/bundles/", {**DEFAULTS, **body}, format="json")
    assert r.status_code == 400, r.json()
    assert r.json()["msg"] == f"`runtime` is one of docker, libvirt, sim (how the node runs instances), not {named}."
    ok = anon.post(f"{V0}/bundles/", {**DEFAULTS, "runtime": {"in": ["DOCKER", None]}}, format="json")
    assert ok.status_code == 200 and len(ok.json()["offers"]) == 1


# Every operator on both fields, their values as query.parse takes them (case, a value twice, null, an empty list),
# and conditions that keep every runtime (no SQL term) or none (no statement at all).
BODIES = [
    {"runtime": {"eq": "docker"}},
    {"runtime": {"eq": "Docker"}},
    {"runtime": {"eq": "\u017fim"}},  # a long s: casefolds to "sim", as the rows compare text
    {"runtime": {"eq": None}},  # no node's runtime is null: nothing
    {"runtime": {"neq": "libvirt"}},
    {"runtime": {"neq": None}},  # every node
    {"runtime": {"in": ["docker", "SIM", "docker"]}},
    {"runtime": {"in": []}},
    {"runtime": {"in": [None, "libvirt"]}},
    {"runtime": {"notin": ["docker", "libvirt"]}},
    {"runtime": {"notin": []}},
    {"runtime": {"notin": ["docker", "libvirt", "sim"]}},
    {"runtime": {"eq": "docker", "neq": "docker"}},
    {"runtime": {"in": ["docker", "libvirt"], "notin": ["libvirt"]}},
    {"vms_enabled": {"eq": True}},
    {"vms_enabled": {"eq": "false"}},
    {"vms_enabled": {"neq": True}},
    {"vms_enabled": {"in": [True, False]}},
    {"vms_enabled": {"notin": [False]}},
    {"vms_enabled": {"eq": None}},
    {"vms_enabled": {"eq": False}, "runtime": {"neq": "sim"}},
    {"vms_enabled": {"eq": True}, "runtime": {"eq": "docker"}},
    {"runtime": {"eq": "libvirt"}, "gpu_name": {"eq": "RTX 4090"}, "num_gpus": {"gte": 2}},
    {"runtime": {"notin": ["sim"]}, "cpu_cores": {"gte": 32}, "verified": {"eq": False}},
]


@pytest.mark.usefixtures("market")
@pytest.mark.parametrize("body", BODIES)
def test_every_operator_answers_as_the_plain_rules(monkeypatch, body):
    for order in ([["score", "desc"]], [["dph_total", "asc"]], [["geolocation", "asc"]]):
        for limit in (1, 10, 1000):
            monkeypatch.setattr(offers, "FIRST_BATCH", 1 - limit)  # the scan stops as early as it can
            q = parse({**body, "order": order, "limit": limit})
            expected = plain(q)
            assert offers.offers_find(q) == expected, (order, limit)
            assert offers.offers_find(q) == expected, (order, limit)  # again, from the cache where it has the shape


@pytest.mark.usefixtures("market")
def test_the_market_holds_every_runtime():
    assert set(Node.objects.values_list("runtime", flat=True)) == {"docker", "libvirt", "sim"}


@pytest.mark.parametrize(("first", "second"), [
    ({"runtime": {"eq": "docker"}}, {"runtime": {"eq": "libvirt"}}),
    ({"runtime": {"in": ["docker", "sim"]}}, {"runtime": {"notin": ["docker"]}}),  # one runtime IN (_, _) each
    ({"runtime": {"neq": "sim"}, "cpu_cores": {"gte": 32}}, {"runtime": {"neq": "docker"}, "cpu_cores": {"gte": 16}}),
])
@pytest.mark.usefixtures("market")
def test_a_runtime_shape_filled_by_one_request_answers_another_with_its_own_values(first, second):
    for order in ([["score", "desc"]], [["geolocation", "asc"]]):
        a, b = parse({**first, "order": order}), parse({**second, "order": order})
        expected_a, expected_b = plain(a), plain(b)
        assert expected_a and expected_b and expected_a != expected_b
        assert offers.offers_find(a) == expected_a  # fills the template
        assert offers.offers_find(b) == expected_b  # through it
    assert len(statements._cache) == 2
    assert all(isinstance(t, statements._Template) for t in statements._cache.values())
    search, _, _ = offers.search_of(parse(first))
    assert ("term", "runtime", "in", 1 if "eq" in first["runtime"] else 2) in search.shape[0]


@pytest.mark.usefixtures("market")
def test_conditions_no_runtime_passes_send_no_statement(django_assert_num_queries):
    q = parse({"runtime": {"eq": "docker"}, "vms_enabled": {"eq": True}})
    assert plain(q) == []
    with django_assert_num_queries(0):
        assert offers.offers_find(q) == []
