"""Reads that encode marketplace rules."""
from __future__ import annotations

import shlex
from collections.abc import Iterable
from datetime import UTC, datetime
from functools import cache
from typing import TYPE_CHECKING, Any, TypedDict

from django.conf import settings
from django.db.models import (
    BooleanField,
    Case,
    Count,
    Exists,
    F,
    Func,
    IntegerField,
    OuterRef,
    Prefetch,
    Q,
    QuerySet,
    Subquery,
    Sum,
    Value,
    When,
)
from django.db.models.expressions import Combinable
from django.db.models.functions import Coalesce, Greatest, Least
from django.db.models.lookups import In

from billing.selectors import storage_given_back, usage_given_back
from marketplace.models import (
    Gpu,
    GpuAllocation,
    GpuStatus,
    Instance,
    InstanceStatus,
    MigSlice,
    MigSliceAllocation,
    Node,
    NodeState,
    Runtime,
    SliceStatus,
    User,
    Volume,
)
from marketplace.models.nodes import (
    ANSWERING,
    LISTABLE_VERDICTS,
    MIG_RUNTIMES,
    OFFERABLE,
    SCORE_PER_DOLLAR,
    Verdict,
    provider_active,
)
from marketplace.models.renting import FINAL_STATUSES, OVER_DISK_KEPT
from marketplace.models.volumes import DISK_VOLUME_STATES

OFFER_DEFERRED = ("ssh_public_key", "ssh_private_key_encrypted", "inventory", "last_error")


class OfferAnnotations(TypedDict):
    """What offers_search annotates on each node."""

    num_gpus_free: int
    nvlink_gpus_free: int
    score_per_dollar: float | None
    disk_left_gb: int | None


if TYPE_CHECKING:  # django-stubs' helper, for the type checker only
    from django_stubs_ext import WithAnnotations

    Offer = WithAnnotations[Node, OfferAnnotations]


def _free_gpus() -> QuerySet[Gpu]:
    return Gpu.objects.filter(node=OuterRef("pk"), status=GpuStatus.FREE)


class _HasKey(Func):
    """Whether a JSON object (the first expression) has the key the second expression gives: Django's `has_key`
    lookup takes a constant key only. PostgreSQL's jsonb `?`; elsewhere (SQLite, the demo) JSON_TYPE of the key's
    path, `$."<key>"` (a profile's name has a dot, never a quote)."""

    output_field = BooleanField()
    arity = 2
    template = "(JSON_TYPE(%(expressions)s || '\"') IS NOT NULL)"
    arg_joiner = ", '$.\"' || "

    def as_postgresql(self, compiler: Any, connection: Any, **extra_context: Any) -> tuple[str, Any]:
        return self.as_sql(compiler, connection, template="(%(expressions)s)", arg_joiner=" ? ", **extra_context)


def _bookable_slices(prices: Any, runtime: Any) -> QuerySet[MigSlice]:
    """The MIG slices a renter can book (the offers' rule for slices; booking asks the same: instances.booking and
    instances.mig): free, on a GPU still split (status `mig`) and not lost (fallen off the bus:
    provisioning.services.gpu_presence), of a profile its node prices now (`mig_prices_micros`: a layout declared
    anew takes effect at the next check, its prices at once, so the old profiles' slices leave the offers at once),
    on a node whose runtime rents slices (MIG_RUNTIMES: not libvirt). `prices`, `runtime`: its node's
    `mig_prices_micros` and `runtime`, as expressions (an outer query's, or through the slice's node)."""
    return MigSlice.objects.filter(In(runtime, list(MIG_RUNTIMES)), _HasKey(prices, F("profile")),
                                   status=SliceStatus.FREE, gpu__status=GpuStatus.MIG, gpu__lost_at__isnull=True)


def free_slices(profile: str | None = None) -> QuerySet[MigSlice]:
    """A node's bookable MIG slices (OuterRef("pk")), by _bookable_slices' rule."""
    slices = _bookable_slices(OuterRef("mig_prices_micros"), OuterRef("runtime")).filter(node=OuterRef("pk"))
    return slices.filter(profile=profile) if profile else slices


def free_slices_by_node(node_ids: list[int]) -> dict[int, dict[str, int]]:
    """{node id: {profile: bookable slices}} for these nodes (_bookable_slices' rule: every profile in it has a
    price), in one query (the offers page's rows)."""
    out: dict[int, dict[str, int]] = {}
    if not node_ids:
        return out
    rows = (_bookable_slices(F("node__mig_prices_micros"), F("node__runtime"))
            .filter(node_id__in=node_ids).order_by().values_list("node_id", "profile").annotate(n=Count("*")))
    for node_id, profile, n in rows:
        out.setdefault(node_id, {})[profile] = n
    return out


def free_gpu_count() -> Coalesce:
    """A node's free GPUs (OuterRef("pk")), for an annotation. A subquery, not Count("gpus", filter=...): that
    aggregate joins every GPU under a GROUP BY, also in a list's count of nodes; Django leaves an unused subquery
    out of count() and runs it for the rows shown only."""
    free = _free_gpus().order_by().values("node").annotate(n=Count("*")).values("n")
    return Coalesce(Subquery(free), Value(0))


class NvlinkGpusFree(Func):
    """A node's most free GPUs on one NVLink island (0 where the check found no NVLink): its stored islands
    (benchmark_summary.nvlink.islands, read only where `connected` is a JSON true) against its free GPUs, in the
    offers' own query. The `nvlink` of an offer was the server's (found by review: with islands [[0,1],[2,3]] and
    GPUs 1 and 2 free, nvlink=true&min_gpus=2 listed it and the booking got two GPUs over PCIe). Expressions:
    the node's benchmark_summary and id. Constants only, no parameters (offer_query's slots stay the filters')."""

    output_field = IntegerField()
    arity = 2

    def _sql(self, compiler: Any, connection: Any, template: str) -> tuple[str, list[Any]]:
        (summary, summary_params), (node, node_params) = (compiler.compile(e) for e in self.get_source_expressions())
        q = connection.ops.quote_name
        sql = template.format(s=summary, node=node, gpu=q(Gpu._meta.db_table), index=q("index"),
                              status=q("status"), free=GpuStatus.FREE.value)
        # The summary's column appears three times in the text, the node's once.
        return sql, [*summary_params, *summary_params, *summary_params, *node_params]

    def as_sqlite(self, compiler: Any, connection: Any, **extra_context: Any) -> tuple[str, Any]:  # the demo
        return self._sql(compiler, connection, (
            "(SELECT COALESCE(MAX(c), 0) FROM (SELECT COUNT(*) AS c FROM json_each(CASE WHEN "
            "json_type({s}, '$.nvlink.connected') = 'true' AND json_type({s}, '$.nvlink.islands') = 'array' "
            "THEN json_extract({s}, '$.nvlink.islands') ELSE '[]' END) AS isl "
            "JOIN {gpu} g ON g.node_id = {node} AND g.{status} = '{free}' AND EXISTS (SELECT 1 FROM "
            "json_each(CASE WHEN isl.type = 'array' THEN isl.value ELSE '[]' END) AS m "
            "WHERE m.type = 'integer' AND m.value = g.{index}) GROUP BY isl.key) AS per_island)"))

    def as_postgresql(self, compiler: Any, connection: Any, **extra_context: Any) -> tuple[str, Any]:
        # A JSON array contains a number it lists (`[0, 1] @> 1`); a member that is no array contains no index.
        return self._sql(compiler, connection, (
            "(SELECT COALESCE(MAX(c), 0) FROM (SELECT COUNT(*) AS c FROM jsonb_array_elements(CASE WHEN "
            "{s} @> '{{\"nvlink\": {{\"connected\": true}}}}' AND jsonb_typeof({s} -> 'nvlink' -> 'islands') = "
            "'array' THEN {s} -> 'nvlink' -> 'islands' ELSE '[]'::jsonb END) WITH ORDINALITY AS isl(members, k) "
            "JOIN {gpu} g ON g.node_id = {node} AND g.{status} = '{free}' AND jsonb_typeof(isl.members) = 'array' "
            "AND isl.members @> to_jsonb(g.{index}) GROUP BY isl.k) AS per_island)"))


def nvlink_gpus_free() -> NvlinkGpusFree:
    """NvlinkGpusFree of each node of a Node queryset (an annotation; computed for the rows a page shows, or for
    every candidate when the `nvlink` filter asks)."""
    return NvlinkGpusFree(F("benchmark_summary"), F("pk"))


# Before any instance or volume: "since the last report" for a node never reported (its room is not judged then).
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def over_but_holding_its_disk() -> Q:
    """Instance filter: over (destroyed or failed), yet its disk is still on its node. A failed one that ran (its
    VM, disk and all, is kept there, stopped, until it is destroyed: services.volumes._failed_vm_kept), unless its VM
    is known gone (`vm_gone`: the node said so, or was retired), and any
    whose VM is still to be removed (instances_awaiting_cleanup: it still holds a GPU or a MIG slice, or
    `vm_cleanup_pending`). The volumes' holders are these too (services.volumes.volume_holder_ids).

    Kept apart from the live ones (not final) so that those are still read from their partial index
    (instance_node_live_idx); these are read from the node's history, which the failed-that-ran narrow first."""
    instance = OuterRef("pk")
    return OVER_DISK_KEPT | (Q(status__in=FINAL_STATUSES) & (
        Q(Exists(GpuAllocation.objects.filter(instance_id=instance, released_at__isnull=True)))
        | Q(Exists(MigSliceAllocation.objects.filter(instance_id=instance, released_at__isnull=True)))))


def holds_its_disk() -> Q:
    """Instance filter: its disk takes room on its node (services/disk_room.py): not over, or over but holding it
    (over_but_holding_its_disk). A failed instance's disk was counted free the moment it failed, while its VM kept
    it: the same disk could be promised twice (found by review, r49)."""
    return ~Q(status__in=FINAL_STATUSES) | over_but_holding_its_disk()


def disk_left_gb() -> Case:
    """services/disk_room.py's room left (GB; null when never reported) of each node of a Node queryset, as an
    annotation: computed for the rows a page shows, or for every candidate when a filter or an ordering asks."""
    since = {"created_at__gte": Coalesce(OuterRef("host_checked_at"), Value(_EPOCH))}

    def gb(instances: QuerySet[Instance]) -> Combinable:  # their disks' sum (all on the one node)
        return Coalesce(Subquery(instances.order_by().values("node_id").annotate(gb=Sum("disk_gb")).values("gb")), 0)

    def promised(**when: Any) -> Combinable:
        # The instances holding disk, from their partial indexes (never the node's history): the live ones and the
        # over ones kept (OVER_DISK_KEPT). An instance over that holds disk only through a GPU or MIG slice not yet
        # released (until the reconciler's cleanup, minutes) is left out here, where reading the allocations of
        # every candidate node cost a disk-filtered search 69 -> 124 ms p95 (bench/offers_search.py, r49): the
        # listing may show its room for those minutes, and the booking, which counts it (disk_room.node_disk_room,
        # _promised_sql), refuses what no longer fits.
        here = Instance.objects.filter(node_id=OuterRef("pk"), **when)
        volumes = (Volume.objects.filter(node_id=OuterRef("pk"), state__in=DISK_VOLUME_STATES, **when)
                   .order_by().values("node_id").annotate(gb=Sum("size_gb")).values("gb"))
        return (gb(here.exclude(status__in=FINAL_STATUSES)) + gb(here.filter(OVER_DISK_KEPT))
                + Coalesce(Subquery(volumes), 0))

    by_report = F("disk_free_gb") - promised(**since)
    return Case(When(disk_free_gb__isnull=True, then=Value(None)),
                When(disk_total_gb__isnull=True, then=Greatest(by_report, Value(0))),
                default=Greatest(Least(by_report, F("disk_total_gb") - promised()), Value(0)),
                output_field=IntegerField())


def offers_search(*, values_list: tuple[str, ...] | None = None) -> QuerySet[Offer]:
    """Every node a renter can book now: active, verified or degraded, listed, its last health check answered, its
    provider's account active (not deactivated by an operator), with free GPUs or bookable MIG slices
    (models.nodes.offerable; free_slices).

    Annotates `num_gpus_free`, `nvlink_gpus_free` (the most free GPUs on one NVLink island: NvlinkGpusFree),
    `score_per_dollar` (score per USD per GPU-hour) and `disk_left_gb` (the disk room a booking can still ask for,
    disk_left_gb) so that filters and ordering run in SQL.

    "Has a free GPU" is an EXISTS, not `num_gpus_free > 0`: PostgreSQL runs it as a
    semi-join over the partial indexes node_offer_idx and gpu_free_node_idx, and the
    per-node count is then computed only for the rows of the page (or for every
    candidate when a `min_gpus` filter asks for it). See docs/BENCHMARKS.md.

    An offer never shows the node's keys, inventory or errors: they are deferred, so a
    page neither reads nor decodes them (and the key ciphertext stays out of a public
    endpoint's memory).

    Built once and cloned per call: building it (two subqueries, a join, deferred fields) was about a
    millisecond of each offers request. `values_list`: the same rows as tuples of these fields (the
    offers list's fast path), also built once.
    """
    found = _offers_search(values_list).all()
    return found if settings.SIM_NODES_ALLOWED else found.exclude(runtime=Runtime.SIM)  # models.nodes.offerable


@cache
def _offers_search(values_list: tuple[str, ...] | None) -> QuerySet[Offer]:
    if values_list is not None:
        return _offers_search(None).values_list(*values_list)
    return (
        Node.objects.filter(OFFERABLE, ANSWERING, provider_active())
        .filter(Exists(_free_gpus()) | Exists(free_slices()))
        .annotate(num_gpus_free=free_gpu_count(), nvlink_gpus_free=nvlink_gpus_free(),
                  score_per_dollar=SCORE_PER_DOLLAR, disk_left_gb=disk_left_gb())
        .select_related("gpu_model")
        .defer(*OFFER_DEFERRED)
    )


def offers_with_free_gpus(offers: QuerySet[Node], *, at_least: int) -> QuerySet[Node]:
    """Narrow `offers` to nodes with at least `at_least` (>= 1) free GPUs.

    Same rows as filtering on `num_gpus_free >= at_least`, but as one grouped pass over
    gpu_free_node_idx (`id IN (... GROUP BY node_id HAVING COUNT(*) >= n)`) instead of a
    count per candidate node: about 3x faster on the bench data (docs/BENCHMARKS.md).
    """
    enough = (
        Gpu.objects.filter(status=GpuStatus.FREE)
        .order_by()
        .values("node")
        .annotate(n=Count("*"))
        .filter(n__gte=at_least)
        .values("node")
    )
    return offers.filter(pk__in=enough)


NODE_VIEW_PERMISSION = "marketplace.view_node"
NODE_CHANGE_PERMISSION = "marketplace.change_node"


def operator_sees_nodes(user: User) -> bool:
    """A staff account the admin shows every node to: its view or change permission (ModelAdmin's own rule)."""
    return user.is_staff and (user.has_perm(NODE_VIEW_PERMISSION) or user.has_perm(NODE_CHANGE_PERMISSION))


def nodes_for_user(*, user: User) -> QuerySet[Node]:
    """A provider's own live nodes; operators allowed to view or change nodes (the admin's rule) see every live node.
    A staff account without it sees its own only, as the admin refuses it every node's page (found by review: any
    staff account read every provider's address, SSH user and checks)."""
    nodes = Node.objects.exclude(state=NodeState.RETIRED).select_related("gpu_model")
    if not operator_sees_nodes(user):
        nodes = nodes.filter(provider=user)
    # Not one query per GPU for its model, nor per slice for its GPU.
    return nodes.prefetch_related("gpus__gpu_model",
                                  Prefetch("mig_slices", queryset=MigSlice.objects.select_related("gpu")))


_NOT_OFFERED_STATES: dict[str, str] = {
    NodeState.PENDING: "the server has not been verified yet",
    NodeState.VERIFYING: "the server is being verified",
    NodeState.REJECTED: "the server was rejected by the benchmark check",
    NodeState.MAINTENANCE: "the server is in maintenance",
    NodeState.OFFLINE: "the server is offline (not answering health checks)",
    NodeState.QUARANTINED: "the server is quarantined (its SSH host key changed)",
    NodeState.RETIRED: "the server is retired",
}


def node_not_offered_reason(node: Node) -> str:
    """Why renters cannot book the node's free GPUs now, in words; "" when they can (given a free GPU).

    The offers' own rule (OFFERABLE: active, verified or degraded, listed; ANSWERING: its last health check
    answered), so that a page never calls a GPU "free" that no renter can book. Its other part, the provider's
    account active, is not asked: the pages that call this show providers their own nodes, and a deactivated
    provider cannot log in.
    """
    if node.state != NodeState.ACTIVE:
        return _NOT_OFFERED_STATES.get(node.state, f"the server is {node.state}")
    if node.verdict not in LISTABLE_VERDICTS:
        return ("its latest benchmark check rejected it" if node.verdict == Verdict.REJECTED
                else "it has not passed the benchmark check")
    if not node.listed:
        return "it is not listed"
    if node.health_failures:
        return "it did not answer its last health check"
    return ""


def instance_ssh_command(instance: Instance) -> str | None:
    """How the renter logs in (the API's `ssh_command`, the instance page's line): only while it runs.

    Renters paste it into their shell, and its parts are the node's word (checked when recorded:
    provisioning.services.vms.vm_address): each is shell-quoted all the same."""
    if instance.status != InstanceStatus.RUNNING or not (instance.ssh_host and instance.ssh_port):
        return None
    return shlex.join(["ssh", "-p", str(instance.ssh_port), f"{instance.ssh_user or 'root'}@{instance.ssh_host}"])


def instances_with_given_back(instances: QuerySet[Instance]) -> QuerySet[Instance]:
    """The instances, each annotated with what was given back to its renter of its charges since, in the list's own
    query (correlated subqueries; 0 when none): `usage_given_back_micros` of its GPU time's (the reversals of its
    usage intervals' ledger transactions: usage billed after its VM's last sighting,
    billing.services.metering.usage_give_back, or an operator's; billing.selectors.usage_given_back_micros says
    the same for a set of ids) and `disk_given_back_micros` of its disk's while stopped (an operator's reversal of
    a storage charge: billing.selectors.storage_given_back).

    The instance's cost_micros and disk_cost_micros stay what was charged (the meter's cumulative arithmetic reads
    them); what the renter paid, as the ledger, the statement and the balance count it, is each less its own.
    Before, the disk's was not carried: disk_cost_so_far read as charged after an operator's reversal."""
    return instances.annotate(
        usage_given_back_micros=usage_given_back(OuterRef("pk")),
        disk_given_back_micros=storage_given_back("disk", object_id=OuterRef("pk"), owner_id=OuterRef("renter_id")))


def volumes_with_given_back(volumes: QuerySet[Volume]) -> QuerySet[Volume]:
    """The volumes, each annotated with `given_back_micros`: what an operator's reversals of its storage charges gave
    back to its owner (billing.selectors.storage_given_back), in the list's own query. Its cost_micros stays what was
    charged; what the owner paid, as the ledger says, is that less this. Before, the volumes API and page read
    cost_micros. (No net annotation: one on top of it repeats the subquery in the SQL.)"""
    return volumes.annotate(
        given_back_micros=storage_given_back("volume", object_id=OuterRef("pk"), owner_id=OuterRef("owner_id")))


def node_in_use_q() -> Q:
    """Node filter: renters are on the node. An instance of it not destroyed or failed (stopped ones too: their
    disk is there), a GPU or MIG slice still allocated, an instance destroyed while the node was away whose VM
    is still to be removed (instances_awaiting_cleanup), or a renter's volume on its disk (DISK_VOLUME_STATES:
    being created, available, or being deleted there). Such a node stays where the platform watches it
    (provisioning.services.nodes.watched_nodes), never pending or rejected; its verdict keeps it off the offers.
    Before, volumes did not count: a node holding only volumes was rejected by a re-check and left unwatched, a
    deletion its job gave up on stayed `deleting` for ever (no reconcile finished it), its retire was refused for
    ever, and the unwatched time was billed at once when it was seen again (found by review r53)."""
    node = OuterRef("pk")
    over = (InstanceStatus.DESTROYED, InstanceStatus.FAILED)
    return (Q(Exists(Volume.objects.filter(node_id=node, state__in=DISK_VOLUME_STATES)))
            | Q(Exists(Instance.objects.filter(node_id=node).exclude(status__in=over)))
            | Q(Exists(GpuAllocation.objects.filter(gpu__node_id=node, released_at__isnull=True)))
            | Q(Exists(MigSliceAllocation.objects.filter(mig_slice__node_id=node, released_at__isnull=True)))
            | Q(Exists(Instance.objects.filter(node_id=node, status=InstanceStatus.DESTROYED,
                                               vm_cleanup_pending=True))))


def instances_awaiting_cleanup(*, node_id: int) -> list[int]:
    """Instances of the node that are over (destroyed or failed) but whose VM may still be on it: they still
    hold a GPU or a MIG slice, or were destroyed while the node could not be reached (`vm_cleanup_pending`: a
    stopped instance holds no GPU that would say so); and stopped or failed ones whose job gave up before the
    node confirmed their VM stopped or gone (`vm_cleanup_pending`, GPUs kept). The reconciler removes their VMs;
    a node is not retired before."""
    return sorted(instances_awaiting_cleanup_by_node(node_ids=[node_id]).get(node_id, set()))


def instances_awaiting_cleanup_by_node(*, node_ids: Iterable[int]) -> dict[int, set[int]]:
    """instances_awaiting_cleanup for several nodes at once: {node id: instance ids}, nodes with none left out.
    Asked of the allocations, not through the instance's reverse relations, where `released_at__isnull=True`
    would also match an instance with none at all (every MIG instance has no GPU allocation)."""
    node_ids = list(node_ids)
    over = (InstanceStatus.DESTROYED, InstanceStatus.FAILED)
    gpus = GpuAllocation.objects.filter(gpu__node_id__in=node_ids, released_at__isnull=True,
                                        instance__status__in=over).values_list("gpu__node_id", "instance_id")
    slices = MigSliceAllocation.objects.filter(mig_slice__node_id__in=node_ids, released_at__isnull=True,
                                               instance__status__in=over).values_list("mig_slice__node_id",
                                                                                      "instance_id")
    pending = Instance.objects.filter(node_id__in=node_ids, vm_cleanup_pending=True).values_list("node_id", "pk")
    found: dict[int, set[int]] = {}
    for node_id, instance_id in gpus.union(slices, pending, all=True):  # one query, not three
        found.setdefault(node_id, set()).add(instance_id)
    return found
