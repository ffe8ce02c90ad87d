"""Offers as Vast.ai shows them: one offer per (node, GPU count), whose id stays valid while the node is offered.

A Vast offer has a fixed number of GPUs and `create instance ID` sends none, while one of our offers is a node
with some free GPUs. So node 12 with 3 free GPUs is shown as the offers 1201, 1202 and 1203 (`id = node * 100 +
GPUs`): the id names the same node and count in every search, and booking it asks for that many GPUs.

An id also names a listing at a price, as Vast's does (re-listing a machine there makes new asks): it carries the
node's price generation (Node.price_generation, bumped on every raise of its GPU or disk price, never on a cut),
`id = (generation * NODE_SPAN + node) * 100 + GPUs`. Until its first raise a node's ids are the plain ones above; an
id from a search before a raise books nothing (compat.vast.booking.ask_book: a 409 naming both prices and the new
id), and one of the current generation books at most the price its search showed (a cut books at the lower price).

The rows come from the same selector and FilterSet as GET /api/v1/offers/ (marketplace.selectors.offers_search,
marketplace.api.offers.OfferFilter): the query's conditions that map onto a node's columns narrow the nodes in SQL
(a superset of the answer), then every condition is applied exactly to the per-count rows. When the first key of
the order maps onto the nodes' columns, the nodes are read in that order, a batch at a time, until no node left
can have a row before the last one kept (`_scan`): the default search reads a few dozen nodes instead of every
offered one (docs/BENCHMARKS.md, "Vast.ai-compatible offer search"). That statement is compiled by Django once
per query shape, each request's values bound into it (compat.vast.statements). The host's measured facts fill
Vast's fields where they mean the same (`host_fields`), and so do the benchmark's memory and NVLink bandwidths
(`measured_fields`); a fact not measured yet is absent, never invented, and so are the fields this platform does
not measure at all (upload speed, DLPerf, CPU architecture...).
"""
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import F, Q, QuerySet
from django.db.models.expressions import Combinable, OrderBy
from django.http import QueryDict

from core.errors import NotFound
from core.money import MICROS_PER_USD
from marketplace import stored_figures
from marketplace.api.offers import COUNTRY_CHOICES, OfferFilter
from marketplace.models import GpuModel, Node, Runtime, Verdict
from marketplace.models.host import cuda_version_text
from marketplace.selectors import nvlink_gpus_free, offers_search
from marketplace.validators import MAX_GPUS_PER_NODE

from . import statements
from .query import Condition, Query, gpu_name_key, matcher, norm_for, sort

ID_BASE = 100  # above MAX_GPUS_PER_NODE: the last two digits are the GPU count
assert MAX_GPUS_PER_NODE < ID_BASE
# Node ids stay below it (ten billion nodes), so the digits above a node's are its price generation: generation 0
# gives the plain ids, and an id stays within a JSON number's exact integers (2**53) for thousands of raises.
NODE_SPAN = 10**10


def offer_id(node_id: int, num_gpus: int, generation: int = 0) -> int:
    return (generation * NODE_SPAN + node_id) * ID_BASE + num_gpus


def offer_of(ask_id: int) -> tuple[int, int, int]:
    """(node id, GPU count, price generation) of an offer id; a 404 for an id no offer could have."""
    rest, num_gpus = divmod(ask_id, ID_BASE)
    generation, node_id = divmod(rest, NODE_SPAN)
    if node_id < 1 or not 1 <= num_gpus <= MAX_GPUS_PER_NODE:
        raise NotFound(f"There is no offer {ask_id}: take an id from `vastai search offers`.")
    return node_id, num_gpus, generation


def usd(micros: int) -> float:
    """Integer micro-dollars as the JSON number Vast sends. Sums and products are taken in micros, then converted
    once: $0.10 × 3 as floats is 0.30000000000000004, which `dph_total<=0.3` would not match. Python's division of
    two integers is correctly rounded, so this is float(micros_to_usd(micros)) exactly, without a Decimal per row
    (tests/compat/test_matching.py holds them equal)."""
    return micros / MICROS_PER_USD


# What offer_rows reads of a node of offers_search: plain values, not a Node and a GpuModel per node (a search
# reads every matching node, thousands of them; issue 14).
HOST_VALUES = ("cpu_model", "cpu_cores", "ram_gb", "disk_left_gb", "disk_bandwidth_mbs", "net_mbps",
               "driver_version", "cuda_version", "pcie_gen")
NODE_VALUES = ("id", "gpu_model__name", "gpu_model__memory_mib", "price_per_gpu_hour_micros", "benchmark_summary",
               "reliability", "score", "country", "verdict", "runtime", "num_gpus_free",
               "disk_price_per_gb_month_micros", "nvlink_gpus_free", "price_generation", *HOST_VALUES)


def host_fields(node: dict[str, Any]) -> dict[str, Any]:
    """Vast's host fields from the node's measured facts (marketplace.models.host), only those measured:
    cpu_name, cpu_cores (logical CPUs), cpu_ram (MiB, as gpu_ram), disk_space (GB left to book:
    selectors.disk_left_gb), disk_bw (MB/s),
    inet_down (Mbit/s from the platform to the node, the only direction measured: no inet_up), driver_version,
    cuda_max_good (the highest CUDA version the driver runs) and pci_gen."""
    cuda = cuda_version_text(node["cuda_version"])
    facts = {
        "cpu_name": node["cpu_model"] or None, "cpu_cores": node["cpu_cores"],
        "cpu_ram": node["ram_gb"] * 1024 if node["ram_gb"] is not None else None,
        "disk_space": float(node["disk_left_gb"]) if node["disk_left_gb"] is not None else None,
        "disk_bw": node["disk_bandwidth_mbs"], "inet_down": node["net_mbps"],
        "driver_version": node["driver_version"] or None, "cuda_max_good": float(cuda) if cuda else None,
        "pci_gen": float(node["pcie_gen"]) if node["pcie_gen"] is not None else None,
    }
    return {name: value for name, value in facts.items() if value is not None}


def measured_fields(stored: Any) -> dict[str, Any]:
    """Vast's figures from the node's benchmark summary (what /api/v1/offers/ shows as `benchmark`), only those
    measured, each read through stored_figures (a value of the wrong kind is not measured): gpu_mem_bw, the median
    GPU memory bandwidth per GPU (GB/s: median_per_gpu.memory_bandwidth_gbs). bw_nvlink is an offer's own
    (nvlink_bandwidth, _own_fields)."""
    fields: dict[str, Any] = {}
    memory_bw = stored_figures.median(stored, "memory_bandwidth_gbs")
    if memory_bw is not None:
        fields["gpu_mem_bw"] = memory_bw
    return fields


def nvlink_bandwidth(stored: Any) -> float | None:
    """The server's NVLink peer-to-peer bandwidth (GB/s), what an offer whose GPUs can all be on one island shows
    as bw_nvlink: the measured `nvlink.p2p_gbs` where the GPUs are NVLink-connected, and 0 where the check found
    them not connected (Vast's 0 for no NVLink). A connected node whose p2p figure is its PCIe one
    (interconnect.nvlink_summary takes the median over every pair when no NVLink pair was measured, and then p2p_gbs
    is pcie_p2p_gbs) has no NVLink figure: None (absent), never the PCIe one under NVLink's name."""
    nvlink = stored_figures.as_object(stored).get("nvlink")
    if isinstance(nvlink, dict):
        connected, p2p = nvlink.get("connected"), stored_figures.number(nvlink.get("p2p_gbs"))
        if connected is False:
            return 0.0
        if connected is True and p2p is not None and p2p != stored_figures.number(nvlink.get("pcie_p2p_gbs")):
            return p2p
    return None


@dataclass(frozen=True)
class NvlinkNow:
    """A node's NVLink as its offers show it now: `bandwidth` (nvlink_bandwidth, its offers' bw_nvlink figure),
    `on_one_island` (nvlink_gpus_free: the most free GPUs on one island) and its islands."""

    bandwidth: float | None
    on_one_island: int
    islands: list[list[int]]

    def listed(self, num_gpus: int) -> bool:
        """Whether the offer of `num_gpus` GPUs is listed as NVLink now: bw_nvlink above 0 (_own_fields) for two
        GPUs or more, which are joined by NVLink only on one island."""
        return num_gpus >= 2 and bool(self.bandwidth) and num_gpus <= self.on_one_island


def nvlink_now(node_id: int) -> NvlinkNow:
    """The node's NvlinkNow, read as offers_search reads it (one query; nothing for no such node)."""
    row = (Node.objects.filter(pk=node_id).annotate(nvlink_gpus_free=nvlink_gpus_free())
           .values_list("benchmark_summary", "nvlink_gpus_free").first())
    if row is None:
        return NvlinkNow(None, 0, [])
    summary = stored_figures.nvlink_summary(stored_figures.as_object(row[0]).get("nvlink"))
    return NvlinkNow(nvlink_bandwidth(row[0]), row[1] or 0, summary["islands"] if summary is not None else [])


def runtime_fields(runtime: str) -> dict[str, Any]:
    """A node's runtime as its offers show it: `runtime` itself and Vast's flag for the same fact, vms_enabled (the
    offer's instances are virtual machines: libvirt)."""
    return {"runtime": runtime, "vms_enabled": runtime == Runtime.LIBVIRT}


def node_fields(node: dict[str, Any]) -> dict[str, Any]:
    """The fields every offer of a node of offers_search (given as its NODE_VALUES) has alike."""
    return {
        "machine_id": node["id"], "gpu_name": node["gpu_model__name"], "gpu_ram": node["gpu_model__memory_mib"],
        "reliability": node["reliability"], "reliability2": node["reliability"], "score": node["score"],
        # The stored figure only as a finite number (stored_figures.median): not an int beyond a float's range in the
        # answer, nor text that `pcie_bw>=N` or an order by it compared with a number (a TypeError, a 500), nor a
        # summary or medians of the wrong kind (an AttributeError, a 500).
        "pcie_bw": stored_figures.median(node["benchmark_summary"], "h2d_gbs"),
        "geolocation": str(node["country"]) or None,
        "verification": node["verdict"], "verified": node["verdict"] == Verdict.VERIFIED,
        "rentable": True, "rented": False, "external": False, **runtime_fields(node["runtime"]),
        # USD per GB per 30-day month, from integer micros as dph_total: /api/v1/offers/' disk_price_per_gb_month.
        "storage_cost": usd(node["disk_price_per_gb_month_micros"]),
        **measured_fields(node["benchmark_summary"]), **host_fields(node),
    }


def offer_rows(node: dict[str, Any], common: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The offers of one node of offers_search, given as its NODE_VALUES (and its node_fields, if at hand)."""
    common = node_fields(node) if common is None else common
    return [{**own, **common} for own in _own_fields(node)]


def _own_fields(node: dict[str, Any]) -> list[dict[str, Any]]:
    """What each offer of the node has of its own (PER_ROW), one per GPU count. bw_nvlink (nvlink_bandwidth) only
    for a count of GPUs that can all be on one NVLink island now (the node's `nvlink_gpus_free`, its free GPUs
    against its islands), 0 above it: the node's figure on every count was a 2-GPU offer at 230 GB/s whose booking
    got two GPUs of different islands, 21 GB/s over PCIe (found by review)."""
    pk, memory_mib, generation = node["id"], node["gpu_model__memory_mib"], node["price_generation"]
    per_gpu_micros = node["price_per_gpu_hour_micros"]
    bandwidth, on_one_island = nvlink_bandwidth(node["benchmark_summary"]), node["nvlink_gpus_free"]
    own = []
    for n in range(1, node["num_gpus_free"] + 1):
        ask, price = offer_id(pk, n, generation), usd(per_gpu_micros * n)
        row = {"id": ask, "ask_contract_id": ask, "num_gpus": n, "gpu_total_ram": memory_mib * n,
               "dph_total": price, "dph_base": price}
        if bandwidth is not None:
            row["bw_nvlink"] = bandwidth if n <= on_one_island else 0.0
        own.append(row)
    return own


def _narrowing(conditions: list[Condition]) -> QueryDict | None:
    """The OfferFilter parameters implied by the conditions (a superset of the answer), or None when they
    cannot match any offer."""
    params = QueryDict(mutable=True)
    countries = {code for code, _ in COUNTRY_CHOICES}
    for c in conditions:
        if c.field == "gpu_name" and c.op in ("eq", "in"):
            wanted = {gpu_name_key(v) for v in (c.value if c.op == "in" else [c.value]) if isinstance(v, str)}
            catalogue = GpuModel.objects.values_list("slug", "name")
            slugs = [slug for slug, name in catalogue if gpu_name_key(name) in wanted]
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
            code = c.value.casefold().upper()  # as the rows compare it (casefold): "\u212aR" is KR
            if code not in countries:
                return None
            params["country"] = code
    return params


# Row fields equal to a node column's value (or a non-decreasing function of it: ram_gb * 1024, float(...)), with
# whether that column is an integer. A condition on them narrows the nodes in SQL, and ordering on them is a scan.
NODE_COLUMNS: dict[str, tuple[str, bool]] = {
    "machine_id": ("id", True), "gpu_ram": ("gpu_model__memory_mib", True), "reliability": ("reliability", False),
    "reliability2": ("reliability", False), "score": ("score", False), "cpu_cores": ("cpu_cores", True),
    "cpu_ram": ("ram_gb", True), "disk_space": ("disk_left_gb", True), "disk_bw": ("disk_bandwidth_mbs", False),
    "inet_down": ("net_mbps", False), "pci_gen": ("pcie_gen", True),
}
Bound = Callable[[dict[str, Any]], Any]
LOOKUPS = {"eq": "exact", "gt": "gt", "gte": "gte", "lt": "lt", "lte": "lte", "in": "in"}


def _number(value: Any, integer: bool) -> bool:
    # An integer column compares with a whole number only: Django rounds a fraction for an IntegerField's lookup.
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return not integer or isinstance(value, int) or value.is_integer()


# The fields of a row that depend on the node's runtime alone (runtime_fields).
RUNTIME_FIELDS = {"runtime", "vms_enabled"}


def _runtimes(conditions: list[Condition]) -> list[str] | None:
    """The runtimes whose rows pass every condition on `runtime` and `vms_enabled` (runtime_fields), each runtime's
    fields put through the rows' own check (matcher): a node column condition `runtime IN (...)` that keeps exactly
    the nodes the rows' check keeps, for every operator (eq, neq, in, notin; null, case; query._coerce refuses a
    value that names no runtime). None where no condition says anything of the runtime: all of them pass (a node's
    runtime is one of Runtime's, what node_register and node_update take); [] where none does."""
    of_runtime = [c for c in conditions if c.field in RUNTIME_FIELDS]
    if not of_runtime:
        return None
    keeps = matcher(of_runtime)
    passing = [runtime for runtime in Runtime.values if keeps(runtime_fields(runtime))]
    return None if len(passing) == len(Runtime.values) else passing


def _column_terms(conditions: list[Condition]) -> list[statements.Term]:
    """The conditions that are exactly a comparison of a node column, as SQL terms (what OfferFilter does not say):
    `verified`, the NODE_COLUMNS but cpu_ram (a multiple of the column), and last the runtimes the conditions on
    `runtime` and `vms_enabled` keep (_runtimes: one `in`, left out where they keep every runtime; the search
    answers nothing without SQL where they keep none). None compares unlike NULL in SQL,
    and neq/notin keep a null row: those stay in Python only. A value is given as Django makes it of the column
    (an integer column's whole float as an int, an `in` list without repeats), which changes no statement's rows
    and makes the statement's shape plain (compat.vast.statements)."""
    terms: list[statements.Term] = []
    for c in conditions:
        if c.field == "verified" and c.op == "eq" and isinstance(c.value, bool):
            terms.append(("verified", None, [c.value]))
        elif c.field in NODE_COLUMNS and c.field != "cpu_ram" and c.op in LOOKUPS:
            column, integer = NODE_COLUMNS[c.field]
            values = c.value if c.op == "in" else [c.value]
            if values and all(_number(v, integer) for v in values):
                made = [int(v) if integer else float(v) for v in values]
                terms.append((column, LOOKUPS[c.op], list(dict.fromkeys(made))))
    runtimes = _runtimes(conditions)
    if runtimes:
        terms.append(("runtime", "in", runtimes))
    return terms


def _column_filters(conditions: list[Condition]) -> Q:
    """The same conditions as one Q, with their values as given: how the search built its statement before
    compat.vast.statements (a new shape's template is checked against it, and an uncached shape runs it)."""
    q = Q()
    for c in conditions:
        if c.field == "verified" and c.op == "eq" and isinstance(c.value, bool):
            q &= Q(verdict=Verdict.VERIFIED) if c.value else ~Q(verdict=Verdict.VERIFIED)
        elif c.field in NODE_COLUMNS and c.field != "cpu_ram" and c.op in LOOKUPS:
            column, integer = NODE_COLUMNS[c.field]
            values = c.value if c.op == "in" else [c.value]
            if values and all(_number(v, integer) for v in values):
                q &= Q(**{f"{column}__{LOOKUPS[c.op]}": [int(v) for v in values] if c.op == "in" and integer
                          else c.value})
    runtimes = _runtimes(conditions)
    if runtimes:
        q &= Q(runtime__in=runtimes)
    return q


def offers_find(query: Query) -> list[dict[str, Any]]:
    found = search_of(query)
    if found is None:
        return []
    search, build, scan = found
    if scan is not None:
        return _scan(search, build, query, *scan)
    return every_offer(search.rows(None, build, None), query)


def search_of(query: Query) -> tuple[statements.Search, Callable[[], QuerySet], tuple[OrderBy, Bound] | None] | None:
    """The query's statement (compiled once per query shape, each request's values bound into it:
    compat.vast.statements), the nodes' queryset as built before that (`build`: OfferFilter's form, then the column
    conditions; what an uncached shape runs and a new template is checked against) and the scan, if any; None when
    no offer can match."""
    params = _narrowing(query.conditions)
    if params is None or _runtimes(query.conditions) == []:
        return None

    def build() -> QuerySet:
        filtered = OfferFilter(data=params, queryset=offers_search())
        return (filtered.qs if filtered.is_valid() else offers_search()).filter(_column_filters(query.conditions))

    field, descending = query.order[0]
    scan = _scan_order(field, descending)
    search = statements.Search(params, _column_terms(query.conditions),
                               (field, descending) if scan is not None else None, NODE_VALUES)
    return search, build, scan


# The fields offer_rows sets per GPU count; every other field is the node's (node_fields), alike on all its rows.
PER_ROW = {"id", "ask_contract_id", "num_gpus", "gpu_total_ram", "dph_total", "dph_base", "bw_nvlink"}


def matching_rows(nodes: list[dict[str, Any]], conditions: list[Condition]) -> list[dict[str, Any]]:
    """The rows of these nodes that match: a condition on a node's field is checked once per node, not per row
    (the same answer: the row has the node's value), and a node that fails one builds no rows."""
    node_matches = matcher([c for c in conditions if c.field not in PER_ROW])
    of_row = [c for c in conditions if c.field in PER_ROW]
    row_matches = matcher(of_row)
    rows: list[dict[str, Any]] = []
    for node in nodes:
        common = node_fields(node)
        if not node_matches(common):
            continue
        if not of_row:
            rows.extend(offer_rows(node, common))
            continue
        # A row's own fields are checked before the node's are copied into it: most rows of a price or count
        # condition fail it (the price scraper's 1,000 answers came from 6,700 rows built whole).
        rows.extend({**own, **common} for own in _own_fields(node) if row_matches(own))
    return rows


def every_offer(nodes: Iterable[dict[str, Any]], query: Query) -> list[dict[str, Any]]:
    """The answer from every row of every node (an order whose first key is no node column's), the nodes given as
    their NODE_VALUES."""
    return sort(matching_rows(list(nodes), query.conditions), query.order)[: query.limit]


def _scan_order(field: str, descending: bool) -> tuple[OrderBy, Bound] | None:
    """How to read the nodes in the order of their rows' `field`: the SQL order of the nodes, and the bound of a
    node's rows, its lowest value of `field` (ascending) or highest (descending), which never decreases (increases)
    along that order. None where there is no such order (text, a JSON value, `num_gpus` ascending: 1 on every node).
    """
    price, free, memory = F("price_per_gpu_hour_micros"), F("num_gpus_free"), F("gpu_model__memory_mib")
    order: Combinable
    bound: Bound
    if field in NODE_COLUMNS:  # the same on every row of a node
        order, bound = F(NODE_COLUMNS[field][0]), lambda node: node_fields(node).get(field)
    elif field in ("dph_total", "dph_base"):
        order, bound = ((price * free, lambda node: usd(node["price_per_gpu_hour_micros"] * node["num_gpus_free"]))
                        if descending else (price, lambda node: usd(node["price_per_gpu_hour_micros"])))
    elif field == "storage_cost":  # usd() of the column: the same order
        order, bound = (F("disk_price_per_gb_month_micros"),
                        lambda node: usd(node["disk_price_per_gb_month_micros"]))
    elif field == "gpu_total_ram":
        order, bound = ((memory * free, lambda node: node["gpu_model__memory_mib"] * node["num_gpus_free"])
                        if descending else (memory, lambda node: node["gpu_model__memory_mib"]))
    elif field == "num_gpus" and descending:
        order, bound = free, lambda node: node["num_gpus_free"]
    elif field in ("id", "ask_contract_id"):  # offer_id's order: the generation, then the node
        order = F("price_generation") * NODE_SPAN + F("id")
        bound = (lambda node: offer_id(node["id"], node["num_gpus_free"], node["price_generation"])) if descending \
            else (lambda node: offer_id(node["id"], 1, node["price_generation"]))
    else:
        return None
    return (order.desc(nulls_last=True) if descending else order.asc(nulls_last=True)), bound


FIRST_BATCH = 32  # nodes read beyond the limit at first; each next batch is 4 times the one before


def _scan(search: statements.Search, build: Callable[[], QuerySet], query: Query, order: OrderBy,
          bound: Bound) -> list[dict[str, Any]]:
    """The answer, reading the nodes in `order` a batch at a time until the query's limit of matching rows is kept
    and every node left can only have rows after the last of them: each node left has a bound at or past the last
    node read's (the order), and a row after that bound (strictly: a tie could still come first by a later key or
    its id). A node with no value (NULLS LAST) bounds nothing: the scan then reads to the end."""
    field, descending = query.order[0]
    norm = norm_for(field)
    kept: list[dict[str, Any]] = []
    size = query.limit + FIRST_BATCH
    # One statement read a batch at a time (a server-side cursor, inside a transaction on PostgreSQL): one state of
    # the market. A batch per statement skipped a node, or read one twice, when a booking between two of them moved
    # the nodes across the point reached (found by review).
    with transaction.atomic():
        nodes_read = search.rows(order, build, size)
        while True:
            batch = list(itertools.islice(nodes_read, size))
            kept.extend(matching_rows(batch, query.conditions))
            if len(batch) < size:
                break  # every node read
            size *= 4
            if len(kept) >= query.limit:
                kept = sort(kept, query.order)[: query.limit]  # a row past the limit now stays past it
                last, left = norm(kept[-1].get(field)), norm(bound(batch[-1]))
                if last is not None and left is not None and (last > left if descending else last < left):
                    break
    return sort(kept, query.order)[: query.limit]
