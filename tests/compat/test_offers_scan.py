"""`vastai search offers` reads the nodes in the order of the query's first key and stops early (compat.vast.offers
_scan) and narrows them in SQL: the answers must be exactly those of building every offer row of every offered node
in Python, then filtering, sorting and cutting (over offers_search(), with no narrowing)."""
import random

import pytest

from compat.vast import offers, query
from marketplace.models import Gpu, Node
from marketplace.selectors import offers_search
from tests import module_rows
from tests.factories import UserFactory, make_listed_node, make_node

MODELS = ("rtx-a5000", "rtx-4090", "a100-80gb-sxm", "h100-sxm")
# Bodies as the CLI sends them (its defaults, then the user's query), each with small limits so that the scan
# reads several batches and has to stop on ties.
QUERIES = [
    {},
    {"order": [["dph_total", "asc"]]},
    {"order": [["dph_total", "desc"]]},
    {"order": [["dph_base", "desc"], ["score", "asc"]]},
    {"gpu_name": {"eq": "RTX_A5000"}, "num_gpus": {"gte": 1}, "order": [["dph_total", "asc"]]},
    {"gpu_name": {"in": ["RTX 4090", "H100 SXM"]}, "reliability": {"gt": 0.95}, "geolocation": {"notin": ["SE"]}},
    {"num_gpus": {"gte": 2}, "reliability": {"gte": 0.9}, "verified": {"eq": False}, "order": [["num_gpus", "desc"]]},
    {"num_gpus": {"eq": 3}, "order": [["num_gpus", "asc"], ["dph_total", "desc"]]},
    {"geolocation": {"eq": "DE"}, "dph_total": {"lt": 3.0}, "order": [["dph_total", "asc"]]},
    {"gpu_ram": {"gte": 40000.0}, "order": [["reliability", "desc"], ["dph_total", "asc"]]},
    {"gpu_ram": {"lt": 40000.5}, "order": [["gpu_ram", "asc"]]},
    {"cpu_cores": {"gte": 32}, "order": [["disk_bw", "desc"]]},
    {"cpu_cores": {"neq": 32}, "order": [["cpu_cores", "asc"]]},
    {"disk_space": {"gt": 1000.0}, "inet_down": {"lte": 5000.0}, "order": [["inet_down", "desc"]]},
    {"order": [["cpu_ram", "asc"], ["id", "desc"]]},
    {"order": [["pci_gen", "desc"]]},
    {"order": [["gpu_total_ram", "desc"]]},
    {"order": [["gpu_total_ram", "asc"]]},
    {"order": [["id", "desc"]]},
    {"machine_id": {"gt": 0}, "order": [["ask_contract_id", "asc"]]},
    {"score": {"lte": 1.5}, "order": [["score", "asc"]]},
    {"order": [["geolocation", "asc"], ["dph_total", "asc"]]},  # text: every row, as before
    {"order": [["pcie_bw", "desc"]]},
    {"rented": {"eq": True}},
    {"order": [["storage_cost", "asc"], ["dph_total", "asc"]]},
    {"storage_cost": {"lte": 0.1}, "runtime": {"eq": "docker"}, "order": [["storage_cost", "desc"]]},
    {"vms_enabled": {"eq": True}, "order": [["gpu_mem_bw", "desc"]]},
    {"bw_nvlink": {"gte": 0.0}, "order": [["bw_nvlink", "desc"], ["storage_cost", "asc"]]},
]


@pytest.fixture(scope="module")
def market_rows(request, django_db_setup, django_db_blocker):
    """The market's rows, built once for the module (tests/module_rows.py): each test's writes are rolled back."""
    with module_rows.rows_for_module(request, django_db_blocker, _build_market):
        yield


@pytest.fixture
def market(market_rows, db):
    """Nodes with ties on every key the scan orders on (price, score, reliability, host facts), some host facts
    unmeasured (null), partly rented, degraded ones and one not listed (_build_market). The same rows for every
    test of a module (built once: a test that does not use them comes before the first that does)."""


def _build_market() -> None:
    rng = random.Random(7)
    more = random.Random(45)  # the disk price, runtime and bandwidths (round 45): rng's draws as before
    provider = UserFactory()
    for i in range(36):
        node = make_listed_node(provider, gpu_model=rng.choice(MODELS), gpu_count=rng.choice((1, 2, 4, 8)),
                                price=rng.choice(("0.400000", "0.800000", "1.250000", "2.000000")),
                                country=rng.choice(("DE", "SE", "US")), score=rng.choice((0.8, 1.0, 1.2, 3.0)),
                                reliability=rng.choice((0.9, 0.96, 0.99)))
        measured = rng.random() < 0.7
        Node.objects.filter(pk=node.pk).update(
            verdict="degraded" if i % 7 == 3 else "verified",
            cpu_cores=rng.choice((16, 32, 64)) if measured else None,
            ram_gb=rng.choice((128, 512)) if measured else None,
            disk_free_gb=rng.choice((500, 1000, 2000)) if measured else None,
            disk_bandwidth_mbs=rng.choice((900.0, 1800.0)) if measured else None,
            net_mbps=rng.choice((940.0, 5000.0, 9400.0)) if measured else None,
            pcie_gen=rng.choice((3, 4)) if measured else None,
            benchmark_summary={"median_per_gpu": {"h2d_gbs": rng.choice((12.0, 24.5)),
                                                  "memory_bandwidth_gbs": more.choice((768.0, 2039.0))},
                               "nvlink": {"connected": more.random() < 0.5, "p2p_gbs": more.choice((25.0, 90.0))}}
            if measured else {},
            disk_price_per_gb_month_micros=more.choice((50_000, 100_000, 100_000, 250_000)),
            runtime=more.choice(("docker", "libvirt", "sim")))
        rented = rng.randint(0, node.gpu_count)
        Gpu.objects.filter(node=node, index__lt=rented).update(status="rented")
    make_node(provider, gpu_model="rtx-4090", gpu_count=2)  # not offered: pending


@pytest.mark.parametrize("body", QUERIES)
def test_the_scan_answers_as_every_row_in_python(market, monkeypatch, body):
    for limit in (1, 3, 10, 64):  # in one test: the market is built once for the four (0.3 s each)
        # A first batch of one node, then 4, 16...: the scan stops as early as it can, so a bound that is not one
        # shows.
        monkeypatch.setattr(offers, "FIRST_BATCH", 1 - limit)
        q = query.parse({"verified": {"eq": True}, "external": {"eq": False}, "rentable": {"eq": True},
                         "order": [["score", "desc"]], **body, "limit": limit})
        # Every row of every node offered, nothing narrowed in SQL, every condition on every row: the search as it
        # was.
        rows = [row for node in offers_search().values(*offers.NODE_VALUES) for row in offers.offer_rows(node)
                if query.matches(row, q.conditions)]
        expected = query.sort(rows, q.order)[:limit]
        if body != {"rented": {"eq": True}}:
            assert expected, f"limit {limit}: a query with no answer proves nothing"
        assert offers.offers_find(q) == expected, f"limit {limit}"


def test_a_booking_during_the_scan_neither_drops_an_offer_nor_repeats_one(market, monkeypatch):
    """Review: a statement per batch saw the market move between two of them (a node rented out, or freed), and
    the next batch skipped a node or read one again. One statement reads the whole scan from one state."""
    monkeypatch.setattr(offers, "FIRST_BATCH", -9)  # batches of 1, 4, 16... nodes
    q = query.parse({"order": [["machine_id", "asc"]], "limit": 10})
    expected = offers.offers_find(q)
    first = []
    real = offers.matching_rows

    def then_book(batch, conditions):
        if not first:  # after the first batch, its first node is rented out whole
            first.append(batch[0]["id"])
            Gpu.objects.filter(node_id=batch[0]["id"]).update(status="rented")
        return real(batch, conditions)

    monkeypatch.setattr(offers, "matching_rows", then_book)
    got = offers.offers_find(q)
    assert first and got == expected
    assert len({row["id"] for row in got}) == len(got)
