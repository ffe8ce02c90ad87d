"""Offers as Vast.ai shows them: one offer per (node, GPU count), whose id stays valid while the node is offered.

A Vast offer has a fixed number of GPUs and `create instance ID` sends none, while one of our offers is a node
with some free GPUs. So node 12 with 3 free GPUs is shown as the offers 1201, 1202 and 1203 (`id = node * 100 +
GPUs`): the id names the same node and count in every search, and booking it asks for that many GPUs.

The rows come from the same selector and FilterSet as GET /api/v1/offers/ (marketplace.selectors.offers_search,
marketplace.api.offers.OfferFilter): the query's conditions that the FilterSet knows narrow the nodes in SQL,
then every condition is applied exactly to the per-count rows. The host's measured facts fill Vast's fields
where they mean the same (`host_fields`); a fact not measured yet is absent, never invented, and so are the fields
this platform does not measure at all (upload speed, DLPerf, CPU architecture...).
"""
from typing import Any

from django.http import QueryDict

from core.errors import NotFound
from core.money import micros_to_usd
from marketplace.api.offers import COUNTRY_CHOICES, OfferFilter
from marketplace.models import GpuModel, Node, Verdict
from marketplace.models.host import cuda_version_text
from marketplace.selectors import offers_search
from marketplace.validators import MAX_GPUS_PER_NODE

from .query import Condition, Query, gpu_name_key, matches, sort

ID_BASE = 100  # above MAX_GPUS_PER_NODE: the last two digits are the GPU count
assert MAX_GPUS_PER_NODE < ID_BASE


def offer_id(node_id: int, num_gpus: int) -> int:
    return node_id * ID_BASE + num_gpus


def offer_of(ask_id: int) -> tuple[int, int]:
    """(node id, GPU count) of an offer id; a 404 for an id no offer could have."""
    node_id, num_gpus = divmod(ask_id, ID_BASE)
    if node_id < 1 or not 1 <= num_gpus <= MAX_GPUS_PER_NODE:
        raise NotFound(f"There is no offer {ask_id}: take an id from `vastai search offers`.")
    return node_id, num_gpus


def usd(micros: int) -> float:
    """Integer micro-dollars as the JSON number Vast sends. Sums and products are taken in micros, then converted
    once: $0.10 × 3 as floats is 0.30000000000000004, which `dph_total<=0.3` would not match."""
    return float(micros_to_usd(micros))


# What offer_rows reads of a node of offers_search: plain values, not a Node and a GpuModel per node (a search
# reads every matching node, thousands of them; issue 14).
HOST_VALUES = ("cpu_model", "cpu_cores", "ram_gb", "disk_free_gb", "disk_bandwidth_mbs", "net_mbps",
               "driver_version", "cuda_version", "pcie_gen")
NODE_VALUES = ("id", "gpu_model__name", "gpu_model__memory_mib", "price_per_gpu_hour_micros", "benchmark_summary",
               "reliability", "score", "country", "verdict", "runtime", "num_gpus_free", *HOST_VALUES)


def host_fields(node: dict[str, Any]) -> dict[str, Any]:
    """Vast's host fields from the node's measured facts (marketplace.models.host), only those measured:
    cpu_name, cpu_cores (logical CPUs), cpu_ram (MiB, as gpu_ram), disk_space (free GB), disk_bw (MB/s),
    inet_down (Mbit/s from the platform to the node, the only direction measured: no inet_up), driver_version,
    cuda_max_good (the highest CUDA version the driver runs) and pci_gen."""
    cuda = cuda_version_text(node["cuda_version"])
    facts = {
        "cpu_name": node["cpu_model"] or None, "cpu_cores": node["cpu_cores"],
        "cpu_ram": node["ram_gb"] * 1024 if node["ram_gb"] is not None else None,
        "disk_space": float(node["disk_free_gb"]) if node["disk_free_gb"] is not None else None,
        "disk_bw": node["disk_bandwidth_mbs"], "inet_down": node["net_mbps"],
        "driver_version": node["driver_version"] or None, "cuda_max_good": float(cuda) if cuda else None,
        "pci_gen": float(node["pcie_gen"]) if node["pcie_gen"] is not None else None,
    }
    return {name: value for name, value in facts.items() if value is not None}


def offer_rows(node: dict[str, Any]) -> list[dict[str, Any]]:
    """The offers of one node of offers_search, given as its NODE_VALUES."""
    pk, memory_mib = node["id"], node["gpu_model__memory_mib"]
    per_gpu_micros = node["price_per_gpu_hour_micros"]
    medians = (node["benchmark_summary"] or {}).get("median_per_gpu") or {}
    common = {
        "machine_id": pk, "gpu_name": node["gpu_model__name"], "gpu_ram": memory_mib,
        "reliability": node["reliability"], "reliability2": node["reliability"], "score": node["score"],
        "pcie_bw": medians.get("h2d_gbs"), "geolocation": str(node["country"]) or None,
        "verification": node["verdict"], "verified": node["verdict"] == Verdict.VERIFIED,
        "rentable": True, "rented": False, "external": False, "runtime": node["runtime"], **host_fields(node),
    }
    return [
        {"id": offer_id(pk, n), "ask_contract_id": offer_id(pk, n), "num_gpus": n, "gpu_total_ram": memory_mib * n,
         "dph_total": usd(per_gpu_micros * n), "dph_base": usd(per_gpu_micros * n), **common}
        for n in range(1, node["num_gpus_free"] + 1)
    ]


def _narrowing(conditions: list[Condition]) -> QueryDict | None:
    """The OfferFilter parameters implied by the conditions (a superset of the answer), or None when they
    cannot match any offer."""
    params = QueryDict(mutable=True)
    countries = {code for code, _ in COUNTRY_CHOICES}
    for c in conditions:
        if c.field == "gpu_name" and c.op in ("eq", "in"):
            wanted = {gpu_name_key(v) for v in (c.value if c.op == "in" else [c.value]) if isinstance(v, str)}
            slugs = [m.slug for m in GpuModel.objects.all() if gpu_name_key(m.name) in wanted]
            if not slugs:
                return None
            params.setlist("gpu_model", slugs)
        elif c.field == "num_gpus" and c.op in ("eq", "gte", "gt") and c.value is not None:
            at_least = c.value + 1 if c.op == "gt" else c.value
            if at_least > MAX_GPUS_PER_NODE:
                return None
            if at_least > 1:
                params["min_gpus"] = str(at_least)
        elif c.field == "dph_total" and c.op in ("lte", "lt") and c.value is not None:
            if c.value < 0:
                return None
            params["max_price_per_gpu_hour"] = str(min(c.value, 1_000_000))  # one GPU costs at most the total
        elif c.field in ("reliability", "reliability2") and c.op == "gte" and 0 <= (c.value or 0) <= 1:
            params["min_reliability"] = str(c.value)
        elif c.field == "geolocation" and c.op == "eq" and isinstance(c.value, str):
            if c.value.upper() not in countries:
                return None
            params["country"] = c.value.upper()
    return params


def offers_find(query: Query) -> list[dict[str, Any]]:
    params = _narrowing(query.conditions)
    if params is None:
        return []
    filtered = OfferFilter(data=params, queryset=offers_search())
    nodes = (filtered.qs if filtered.is_valid() else offers_search()).values(*NODE_VALUES)
    rows = [row for node in nodes for row in offer_rows(node) if matches(row, query.conditions)]
    return sort(rows, query.order)[: query.limit]


def node_for_offer(ask_id: int) -> Node:
    node_id, _ = offer_of(ask_id)
    node = Node.objects.filter(pk=node_id).first()
    if node is None:
        raise NotFound(f"There is no offer {ask_id}: take an id from `vastai search offers`.")
    return node
