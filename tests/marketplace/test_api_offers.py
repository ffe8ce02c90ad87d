"""The public offers search: what is listed, every filter, every ordering, pagination, bad filter values."""
import pytest

from marketplace.models import Gpu, GpuStatus, Node, NodeState, Verdict
from tests import module_rows
from tests.factories import make_listed_node, make_node

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _market_only_where_asked(request):
    module_rows.require_absent(request, "market")

URL = "/api/v1/offers/"


def ids(response):
    assert response.status_code == 200, response.content
    return [row["id"] for row in response.json()["results"]]


def rent(node, n):
    for gpu in Gpu.objects.filter(node=node).order_by("index")[:n]:
        gpu.status = GpuStatus.RENTED
        gpu.save(update_fields=["status"])


def test_only_active_verified_or_degraded_listed_nodes_with_free_gpus_appear(anon):
    verified = make_listed_node()
    degraded = make_node(state=NodeState.ACTIVE, verdict=Verdict.DEGRADED, score=0.7, reliability=0.9)
    partly_rented = make_listed_node(gpu_count=4)
    rent(partly_rented, 3)
    hidden = [
        make_node(),  # pending, unverified
        make_node(state=NodeState.VERIFYING),
        make_node(state=NodeState.ACTIVE, verdict=Verdict.UNVERIFIED),
        make_node(state=NodeState.REJECTED, verdict=Verdict.REJECTED),
        make_node(state=NodeState.ACTIVE, verdict=Verdict.REJECTED),
        make_node(state=NodeState.MAINTENANCE, verdict=Verdict.VERIFIED),
        make_node(state=NodeState.OFFLINE, verdict=Verdict.VERIFIED),
        make_node(state=NodeState.RETIRED, verdict=Verdict.VERIFIED),
        make_listed_node(listed=False),
    ]
    fully_rented = make_listed_node(gpu_count=2)
    rent(fully_rented, 2)
    hidden.append(fully_rented)
    unavailable = make_listed_node(gpu_count=1)
    Gpu.objects.filter(node=unavailable).update(status=GpuStatus.UNAVAILABLE)
    hidden.append(unavailable)

    r = anon.get(URL)
    assert sorted(ids(r)) == sorted([verified.pk, degraded.pk, partly_rented.pk])
    rows = {row["id"]: row for row in r.json()["results"]}
    assert rows[verified.pk]["verified"] is True and rows[verified.pk]["verdict"] == "verified"
    assert rows[degraded.pk]["verified"] is False and rows[degraded.pk]["verdict"] == "degraded"
    assert (rows[partly_rented.pk]["num_gpus_free"], rows[partly_rented.pk]["num_gpus_total"]) == (1, 4)
    for node in hidden:
        assert anon.get(f"{URL}{node.pk}/").status_code == 404


def test_an_offer_row_has_every_documented_field(anon):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=8, price="0.790000", score=1.2, reliability=0.97,
                            country="NL", city="Amsterdam", datacenter="AMS3", runtime="docker")
    row = anon.get(f"{URL}{node.pk}/").json()
    expected = {
        "id": node.pk,
        "gpu_model": "rtx-a6000",
        "gpu_model_name": "RTX A6000",
        "num_gpus_free": 8,
        "num_gpus_total": 8,
        "gpu_memory_gb": 48,
        "price_per_gpu_hour": "0.790000",
        "country": "NL",
        "city": "Amsterdam",
        "datacenter": "AMS3",
        "reliability": 0.97,
        "score": 1.2,
        "score_per_dollar": pytest.approx(1.2 / 0.79),
        "verified": True,
        "verdict": "verified",
        "runtime": "docker",
    }
    assert {name: row.get(name) for name in expected} == expected  # at least these fields (others may follow)


def test_score_per_dollar_is_score_per_usd_per_gpu_hour(anon):
    node = make_listed_node(score=1.5, price="0.600000")
    assert anon.get(f"{URL}{node.pk}/").json()["score_per_dollar"] == pytest.approx(2.5)


def test_offers_are_public_and_do_not_show_provider_details(anon):
    make_listed_node()
    row = anon.get(URL).json()["results"][0]
    for private in ("address", "ssh_port", "ssh_user", "public_key", "install_command", "provider"):
        assert private not in row


def test_offers_are_read_only(api):
    node = make_listed_node()
    assert api.post(URL, {"gpu_model": "l4"}).status_code == 405
    assert api.delete(f"{URL}{node.pk}/").status_code == 405


@pytest.mark.parametrize("offer_id", ["999999999", "abc", "1.5"])
def test_an_unknown_offer_is_a_json_404(anon, offer_id):
    r = anon.get(f"{URL}{offer_id}/")
    assert r.status_code == 404 and "detail" in r.json()


# --- pagination -------------------------------------------------------------------------------------------------

def test_ties_are_broken_by_id_so_pages_are_stable(anon):
    nodes = [make_listed_node(price="1.000000", score=1.0) for _ in range(4)]
    assert ids(anon.get(URL, {"ordering": "price_per_gpu_hour"})) == [n.pk for n in nodes]
    assert ids(anon.get(URL, {"ordering": "-price_per_gpu_hour"})) == [n.pk for n in nodes]


def test_pagination(anon):
    nodes = [make_listed_node(price=f"{p}.000000") for p in range(1, 6)]
    first = anon.get(URL, {"ordering": "price_per_gpu_hour", "page_size": 2})
    body = first.json()
    assert body["count"] == 5 and body["previous"] is None
    assert ids(first) == [nodes[0].pk, nodes[1].pk]
    second = anon.get(body["next"])
    assert ids(second) == [nodes[2].pk, nodes[3].pk]
    last = anon.get(URL, {"ordering": "price_per_gpu_hour", "page_size": 2, "page": 3})
    assert ids(last) == [nodes[4].pk] and last.json()["next"] is None
    assert anon.get(URL, {"page_size": 2, "page": 4}).status_code == 404


def test_default_page_size_is_50(anon):
    for _ in range(51):
        make_listed_node(gpu_count=1)
    body = anon.get(URL).json()
    assert body["count"] == 51 and len(body["results"]) == 50 and body["next"]


# --- filters ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def market_rows(request, django_db_setup, django_db_blocker):
    """The market's rows, built once for the module (tests/module_rows.py): each test's writes are rolled back."""
    with module_rows.rows_for_module(request, django_db_blocker, _build_market) as pks:
        yield pks


@pytest.fixture
def market(market_rows):
    """Five offers that differ in every filtered property (_build_market; the module's last tests: those above them
    make rows of their own)."""
    by_pk = Node.objects.in_bulk(market_rows.values())
    return {name: by_pk[pk] for name, pk in market_rows.items()}


def _build_market() -> dict[str, int]:
    nodes = {
        "a4000": make_listed_node(gpu_model="rtx-a4000", gpu_count=1, price="0.200000", score=0.3,
                                  reliability=0.90, country="US", city="Dallas"),
        "a6000": make_listed_node(gpu_model="rtx-a6000", gpu_count=4, price="0.800000", score=1.0,
                                  reliability=0.95, country="DE", city="Frankfurt"),
        "a100": make_listed_node(gpu_model="a100-80gb-sxm", gpu_count=8, price="1.800000", score=2.4,
                                 reliability=0.99, country="DE", city="Berlin"),
        "h100": make_listed_node(gpu_model="h100-sxm", gpu_count=8, price="3.500000", score=6.0,
                                 reliability=0.999, country="FI", city="Helsinki"),
        "h100b": make_listed_node(gpu_model="h100-sxm", gpu_count=2, price="2.900000", score=5.5,
                                  reliability=0.97, country="US", city="Dallas"),
    }
    return {name: node.pk for name, node in nodes.items()}


def names(market, response):
    by_id = {node.pk: name for name, node in market.items()}
    return sorted(by_id[i] for i in ids(response))


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, ["a100", "a4000", "a6000", "h100", "h100b"]),
        ({"gpu_model": "h100-sxm"}, ["h100", "h100b"]),
        ({"gpu_model": ["rtx-a4000", "a100-80gb-sxm"]}, ["a100", "a4000"]),
        ({"gpu_model": "l4"}, []),
        ({"min_gpus": 4}, ["a100", "a6000", "h100"]),
        ({"min_gpus": 8}, ["a100", "h100"]),
        ({"min_gpu_memory_gb": 48}, ["a100", "a6000", "h100", "h100b"]),
        ({"min_gpu_memory_gb": 80}, ["a100", "h100", "h100b"]),
        ({"max_price_per_gpu_hour": "0.8"}, ["a4000", "a6000"]),  # inclusive
        ({"max_price_per_gpu_hour": "0.799999"}, ["a4000"]),
        ({"max_price_per_gpu_hour": "100"}, ["a100", "a4000", "a6000", "h100", "h100b"]),
        ({"country": "DE"}, ["a100", "a6000"]),
        ({"country": "FR"}, []),
        ({"city": "dallas"}, ["a4000", "h100b"]),  # case-insensitive
        ({"min_reliability": "0.97"}, ["a100", "h100", "h100b"]),
        ({"min_reliability": "1"}, []),
        ({"min_score": "2.4"}, ["a100", "h100", "h100b"]),
        ({"min_score": 0}, ["a100", "a4000", "a6000", "h100", "h100b"]),
        ({"gpu_model": "h100-sxm", "country": "US", "min_gpus": 2}, ["h100b"]),
        ({"country": "DE", "max_price_per_gpu_hour": "1", "min_score": "0.5"}, ["a6000"]),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else None,
)
def test_filters(anon, market, params, expected):
    assert names(market, anon.get(URL, params)) == expected


def test_min_gpus_counts_free_gpus_not_installed_ones(anon, market):
    rent(market["a100"], 5)
    assert names(market, anon.get(URL, {"min_gpus": 4})) == ["a6000", "h100"]
    assert names(market, anon.get(URL, {"min_gpus": 3})) == ["a100", "a6000", "h100"]


# --- ordering ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("ordering", "expected"),
    [
        ("price_per_gpu_hour", ["a4000", "a6000", "a100", "h100b", "h100"]),
        ("-price_per_gpu_hour", ["h100", "h100b", "a100", "a6000", "a4000"]),
        ("score", ["a4000", "a6000", "a100", "h100b", "h100"]),
        ("-score", ["h100", "h100b", "a100", "a6000", "a4000"]),
        # score per dollar: a4000 1.5, a6000 1.25, a100 1.33, h100 1.71, h100b 1.90
        ("score_per_dollar", ["a6000", "a100", "a4000", "h100", "h100b"]),
        ("-score_per_dollar", ["h100b", "h100", "a4000", "a100", "a6000"]),
        ("reliability", ["a4000", "a6000", "h100b", "a100", "h100"]),
        ("-reliability", ["h100", "a100", "h100b", "a6000", "a4000"]),
        (None, ["h100b", "h100", "a4000", "a100", "a6000"]),  # default: best value first
    ],
)
def test_ordering(anon, market, ordering, expected):
    by_id = {node.pk: name for name, node in market.items()}
    params = {"ordering": ordering} if ordering else {}
    assert [by_id[i] for i in ids(anon.get(URL, params))] == expected


# --- bad input --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"gpu_model": "nope"}, "gpu_model"),
        ({"gpu_model": ["h100-sxm", "nope"]}, "gpu_model"),
        ({"country": "XX"}, "country"),
        ({"country": "Germany"}, "country"),
        ({"country": "de"}, "country"),
        ({"min_gpus": 0}, "min_gpus"),
        ({"min_gpus": "1.5"}, "min_gpus"),
        ({"min_gpus": "many"}, "min_gpus"),
        ({"min_gpu_memory_gb": -1}, "min_gpu_memory_gb"),
        ({"max_price_per_gpu_hour": "-1"}, "max_price_per_gpu_hour"),
        ({"max_price_per_gpu_hour": "cheap"}, "max_price_per_gpu_hour"),
        ({"min_reliability": 2}, "min_reliability"),
        ({"min_reliability": -0.1}, "min_reliability"),
        ({"min_score": -1}, "min_score"),
        ({"min_score": "NaN"}, "min_score"),
        ({"city": "x" * 101}, "city"),
        ({"ordering": "colour"}, "ordering"),
        ({"ordering": "address"}, "ordering"),
        ({"country": ""}, "country"),
        ({"min_gpus": ""}, "min_gpus"),
        ({"max_price": 1}, "max_price"),  # misspelt
        ({"gpu": "h100-sxm"}, "gpu"),
        ({"page": 0}, "page"),
        ({"page": "abc"}, "page"),
        ({"page": "last"}, "page"),
        ({"page_size": 0}, "page_size"),
        ({"page_size": 201}, "page_size"),
        ({"page_size": "all"}, "page_size"),
        ({"nvlink": "maybe"}, "nvlink"),
        ({"nvlink": ""}, "nvlink"),
    ],
    ids=lambda v: str(v) if isinstance(v, dict) else None,
)
def test_bad_filter_values_are_a_400_naming_the_parameter(anon, market, params, field):
    r = anon.get(URL, params)
    assert r.status_code == 400, r.content
    assert field in r.json()


def test_offers_show_and_filter_nvlink_as_the_check_found_it(anon, market):
    islands = {"connected": True, "islands": [[0, 1, 2, 3], [4, 5, 6, 7]], "links_per_gpu": 12, "p2p_gbs": 231.5,
               "pcie_p2p_gbs": 21.8}
    pcie = {"connected": False, "islands": [], "links_per_gpu": None, "p2p_gbs": 19.6, "pcie_p2p_gbs": 19.6}
    for name, nvlink in (("a100", islands), ("a6000", pcie)):
        market[name].benchmark_summary = {"verdict": "verified", "median_per_gpu": {}, "findings": [],
                                          "nvlink": nvlink}
        market[name].save(update_fields=["benchmark_summary"])
    rows = {row["id"]: row for row in anon.get(URL).json()["results"]}
    assert rows[market["a100"].pk]["nvlink"] is True
    assert rows[market["a100"].pk]["benchmark"]["nvlink"] == islands
    assert rows[market["a6000"].pk]["nvlink"] is False and rows[market["a6000"].pk]["benchmark"]["nvlink"] == pcie
    assert rows[market["h100"].pk]["nvlink"] is False  # not read yet: not claimed for it
    assert names(market, anon.get(URL, {"nvlink": "true"})) == ["a100"]
    assert sorted(names(market, anon.get(URL, {"nvlink": "false"}))) == ["a4000", "a6000", "h100", "h100b"]
