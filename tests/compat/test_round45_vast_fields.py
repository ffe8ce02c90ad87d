"""Review round 45 (compat/vast): Vast's fields for what the platform does offer and measure, and the host's view of
its GPUs, answer as the platform's own API does for the same object.

1. `search offers` answers the node's disk price (`storage_cost`, exact from integer micros), the measured GPU
   memory and NVLink bandwidths (`gpu_mem_bw`, `bw_nvlink`) and Vast's alias `cuda_vers`, which it refused as "not
   measured or offered"; `list machine -s` sets the disk price instead of refusing it.
2. `search offers` filters on `runtime` (and Vast's `vms_enabled`), which the libvirt refusal tells the renter to
   choose by.
3. `show machine(s)` shows a GPU taken out of service (status unavailable) as such, not as free.
"""
import pytest

from marketplace.models import Gpu, Instance, Node
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import add_key

V0 = "/compat/vast/api/v0"
# What `vastai search offers` sends by default, before the user's own query.
DEFAULTS = {"verified": {"eq": True}, "external": {"eq": False}, "rentable": {"eq": True},
            "order": [["score", "desc"]], "type": "on-demand", "allocated_storage": 5.0}


def _search(client, **query):
    return client.post(f"{V0}/bundles/", {**DEFAULTS, **query}, format="json")


def _ids(response) -> list[int]:
    assert response.status_code == 200, response.json().get("msg", "")[:200]
    return [o["machine_id"] for o in response.json()["offers"]]


# ------------------------------------------------------------------------------ 1. disk price, measured figures

SUMMARY = {"median_per_gpu": {"memory_bandwidth_gbs": 400.0, "h2d_gbs": 20.0},
           "nvlink": {"connected": True, "p2p_gbs": 50.0, "pcie_p2p_gbs": None, "islands": [[0, 1]]}}


def test_search_offers_answers_the_disk_price_and_measured_figures_the_platforms_own_offer_carries(anon, db):
    node = make_listed_node(gpu_model="rtx-a4000", gpu_count=2, price="0.300000")
    Node.objects.filter(pk=node.pk).update(disk_price_per_gb_month_micros=250_000, benchmark_summary=SUMMARY)
    native = anon.get("/api/v1/offers/").json()["results"][0]
    assert native["disk_price_per_gb_month"] == "0.250000"
    assert native["benchmark"]["median_per_gpu"]["memory_bandwidth_gbs"] == 400.0
    assert native["benchmark"]["nvlink"]["p2p_gbs"] == 50.0
    for field, value in (("storage_cost", 0.3), ("gpu_mem_bw", 300.0), ("bw_nvlink", 10.0)):
        r = _search(anon, **{field: {"lte" if field == "storage_cost" else "gte": value}})
        assert _ids(r) == [node.pk, node.pk], field
    rows = _search(anon).json()["offers"]
    assert [(row["storage_cost"], row["gpu_mem_bw"], row["bw_nvlink"]) for row in rows] == [(0.25, 400.0, 50.0)] * 2
    # Filters that exclude it, and the order on each.
    for field, op, value in (("storage_cost", "lt", 0.25), ("gpu_mem_bw", "gt", 400.0), ("bw_nvlink", "gt", 50.0)):
        assert _ids(_search(anon, **{field: {op: value}})) == [], field
        assert _ids(_search(anon, order=[[field, "desc"]])) == [node.pk, node.pk], field


def test_storage_cost_is_exact_from_micros_and_orders_the_nodes_by_their_disk_price(anon, db):
    """$0.1/GB-month as micros is exactly 0.1 (usd()), so `storage_cost<=0.1` matches it; the order by storage_cost
    (a scan over the nodes in their disk price's order) agrees with the rows."""
    prices = [100_000, 30_000, 1_234_567, 0]
    nodes = [make_listed_node(gpu_model="rtx-a4000", gpu_count=1) for _ in prices]
    for node, micros in zip(nodes, prices, strict=True):
        Node.objects.filter(pk=node.pk).update(disk_price_per_gb_month_micros=micros)
    r = _search(anon, storage_cost={"lte": 0.1})
    assert sorted(_ids(r)) == sorted([nodes[0].pk, nodes[1].pk, nodes[3].pk])
    assert {o["storage_cost"] for o in r.json()["offers"]} == {0.1, 0.03, 0.0}
    for descending in (False, True):
        r = _search(anon, order=[["storage_cost", "desc" if descending else "asc"]], limit=2)
        want = sorted(zip(prices, (n.pk for n in nodes), strict=True), reverse=descending)
        assert _ids(r) == [pk for _, pk in want[:2]], descending
    assert _search(anon, storage_cost={"eq": 1.234567}).json()["offers"][0]["machine_id"] == nodes[2].pk


def test_cuda_vers_is_vasts_alias_of_cuda_max_good(anon, db):
    node = make_listed_node(gpu_model="rtx-a4000", gpu_count=1)
    Node.objects.filter(pk=node.pk).update(cuda_version=12040)
    other = make_listed_node(gpu_model="rtx-a4000", gpu_count=1)
    Node.objects.filter(pk=other.pk).update(cuda_version=11080)
    assert _ids(_search(anon, cuda_vers={"gte": 12.0})) == [node.pk]
    assert _ids(_search(anon, cuda_vers={"gte": 11.0}, order=[["cuda_vers", "asc"]])) == [other.pk, node.pk]


@pytest.mark.parametrize(("summary", "wanted"), [
    ([], {}),  # a summary that is no object
    ({}, {}),
    ({"median_per_gpu": {"memory_bandwidth_gbs": "400"}}, {}),  # text is no measured number
    ({"median_per_gpu": [400.0]}, {}),
    ({"nvlink": {"connected": False, "p2p_gbs": 25.0, "islands": []}}, {"bw_nvlink": 0.0}),  # no NVLink: Vast's 0
    ({"nvlink": {"connected": True, "p2p_gbs": None}}, {}),
    ({"nvlink": {"connected": True, "p2p_gbs": True}}, {}),
    # Connected, but no NVLink pair measured: p2p_gbs is the median over the PCIe pairs, not NVLink's figure.
    ({"nvlink": {"connected": True, "p2p_gbs": 25.0, "pcie_p2p_gbs": 25.0}}, {}),
    # (with its islands, as every check writes them: an offer's bw_nvlink is for GPUs on one island, round 47)
    ({"nvlink": {"connected": True, "p2p_gbs": 90.0, "pcie_p2p_gbs": 25.0, "islands": [[0, 1]]}},
     {"bw_nvlink": 90.0}),
    ({"nvlink": {"connected": "yes", "p2p_gbs": 90.0}}, {}),
    ({"nvlink": "NV4"}, {}),
    ({"median_per_gpu": {"memory_bandwidth_gbs": 1500.5}}, {"gpu_mem_bw": 1500.5}),
])
def test_measured_figures_are_absent_until_measured_never_invented(anon, db, summary, wanted):
    node = make_listed_node(gpu_model="rtx-a4000", gpu_count=2)
    Node.objects.filter(pk=node.pk).update(benchmark_summary=summary)
    row = _search(anon).json()["offers"][0]
    assert {k: row[k] for k in ("gpu_mem_bw", "bw_nvlink") if k in row} == wanted
    r = _search(anon, bw_nvlink={"gte": 1.0}, gpu_mem_bw={"gte": 1.0})
    assert _ids(r) == ([node.pk, node.pk] if wanted.get("bw_nvlink") and wanted.get("gpu_mem_bw") else [])


def test_list_machine_sets_the_disk_price_as_the_nodes_api_does(client_for, db):
    """`vastai list machine ID -g 0.5 -s 0.2` sets the disk price (Vast's price_disk, USD per GB-month), which was
    refused as "a node has one price, per GPU-hour"; its range and parsing are the API's."""
    node = make_listed_node(gpu_model="rtx-a4000", gpu_count=1, listed=False)
    host = client_for(node.provider)
    url = f"{V0}/machines/create_asks/"
    r = host.put(url, {"machine": node.pk, "price_gpu": 0.5, "price_disk": 0.2}, format="json")
    assert r.status_code == 200, r.json()
    node.refresh_from_db()
    assert (node.listed, node.price_per_gpu_hour_micros, node.disk_price_per_gb_month_micros) == (True, 500_000,
                                                                                                  200_000)
    native = client_for(node.provider).get(f"/api/v1/nodes/{node.pk}/").json()
    assert native["disk_price_per_gb_month"] == "0.200000"
    assert host.put(url, {"machine": node.pk, "price_disk": "0.05"}, format="json").status_code == 200
    node.refresh_from_db()
    assert (node.price_per_gpu_hour_micros, node.disk_price_per_gb_month_micros) == (500_000, 50_000)
    for bad in (11, -0.1, "cheap", True, "NaN", "Infinity", 1e308, [0.1]):
        r = host.put(url, {"machine": node.pk, "price_disk": bad}, format="json")
        assert r.status_code == 400 and "price_disk is USD per GB per month" in r.json()["msg"], bad
    node.refresh_from_db()
    assert node.disk_price_per_gb_month_micros == 50_000
    r = host.put(url, {"machine": node.pk, "price_inetu": 0.1}, format="json")
    assert r.status_code == 400 and "price_inetu (-u) is not offered here" in r.json()["msg"]
    assert "one price" not in r.json()["msg"]


# --------------------------------------------------------------------------------------------- 2. runtime

def test_search_offers_can_filter_the_runtime_that_the_libvirt_refusal_tells_the_renter_to_choose(api, anon, db):
    libvirt = make_listed_node(gpu_model="rtx-a4000", gpu_count=1, runtime="libvirt", score=2.0)
    docker = make_listed_node(gpu_model="rtx-a4000", gpu_count=1, runtime="docker", score=1.0)
    add_key(api.user)
    refused = api.put(f"{V0}/asks/{libvirt.pk * 100 + 1}/", {"image": "cuda-12-4", "disk": 20,
                                                          "env": {"HF_TOKEN": "x"}}, format="json")
    assert refused.status_code == 400
    assert "take an offer whose runtime is docker (`vastai search offers 'runtime=docker'`)" in refused.json()["msg"]
    assert not Instance.objects.exists()
    rows = _search(anon).json()["offers"]
    assert [(o["machine_id"], o["runtime"], o["vms_enabled"]) for o in rows] == [
        (libvirt.pk, "libvirt", True), (docker.pk, "docker", False)]
    assert _ids(_search(anon, runtime={"eq": "docker"})) == [docker.pk]  # `vastai search offers 'runtime=docker'`
    assert _ids(_search(anon, runtime={"eq": "Docker"})) == [docker.pk]  # text compares without case
    assert _ids(_search(anon, runtime={"neq": "libvirt"})) == [docker.pk]
    assert _ids(_search(anon, runtime={"in": ["docker", "sim"]})) == [docker.pk]
    assert _ids(_search(anon, runtime={"notin": ["docker"]})) == [libvirt.pk]
    assert _ids(_search(anon, vms_enabled={"eq": False})) == [docker.pk]  # Vast's own field for it
    assert _ids(_search(anon, vms_enabled={"eq": "true"})) == [libvirt.pk]
    assert _ids(_search(anon, order=[["runtime", "asc"]])) == [docker.pk, libvirt.pk]
    r = _search(anon, runtime={"gte": "docker"})
    assert r.status_code == 400 and "use eq, neq, in or notin" in r.json()["msg"]
    r = _search(anon, runtime={"eq": 3})
    assert r.status_code == 400 and "`runtime` takes text" in r.json()["msg"]


# -------------------------------------------------------------------------------------- 3. GPU out of service

def test_show_machine_does_not_show_a_gpu_taken_out_of_service_as_free(client_for, db):
    node = make_listed_node(gpu_model="rtx-a4000", gpu_count=2)
    Gpu.objects.filter(node=node, index=1).update(status="unavailable")
    native = client_for(node.provider).get(f"/api/v1/nodes/{node.pk}/").json()
    assert [g["status"] for g in native["gpus"]] == ["free", "unavailable"]
    offers = client_for(node.provider).get("/api/v1/offers/").json()["results"]
    assert [o["num_gpus_free"] for o in offers] == [1]
    host = client_for(node.provider)
    assert host.get(f"{V0}/machines/{node.pk}?owner=me").json()[0]["gpu_occupancy"] == "_ x"
    assert host.get(f"{V0}/machines?owner=me").json()["machines"][0]["gpu_occupancy"] == "_ x"
