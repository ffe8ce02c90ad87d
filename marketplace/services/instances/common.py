"""What the instance use cases share: the funds refusal, reads, locking and allocation helpers, the funds check."""
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import Case, F, IntegerField, Prefetch, QuerySet, Sum, Value, When
from django.utils import timezone

from billing.services.ledger import funds_required_micros, wallet_balance
from billing.services.metering import usage_close
from billing.services.storage import instance_disk_close
from core.errors import Conflict, IdempotencyKeyReused, PaymentRequired
from core.sql import ModelInsert, prepared_cursor
from marketplace.models import (
    Gpu,
    GpuAllocation,
    GpuStatus,
    Instance,
    InstanceStatus,
    MigSliceAllocation,
    Node,
    NodeState,
    User,
    VolumeMount,
)
from marketplace.models.nodes import LISTABLE_VERDICTS
from marketplace.money import usd_text
from notifications.services.notify import notify

from .mig import instance_release_slices, instance_slice_gpu_indices

S = InstanceStatus
MAX_DISK_GB = 2000
WAITING = "Waiting for a worker"


class InsufficientFunds(PaymentRequired):
    """The renter's balance does not cover the first hour of their instances with this one (HTTP 402).

    `funds` holds the figures, so that a page can say it in its own words (the message names the API).
    """

    def __init__(self, message: str, funds: "Funds"):
        super().__init__(message)
        self.funds = funds


# ----------------------------------------------------------------------------------------- reads


def instances_for_user(*, user: User) -> QuerySet[Instance]:
    """A renter's own instances, each with `live_allocations` (the GPUs it holds now) and `live_slices` (the MIG
    slices it holds now, with their GPUs) prefetched: a list reads no row per instance.

    Operators too see only their own here: they see everyone's in the admin.
    """
    live = GpuAllocation.objects.filter(released_at__isnull=True).select_related("gpu").order_by("gpu__index")
    live_slices = MigSliceAllocation.objects.filter(released_at__isnull=True).select_related("mig_slice__gpu")
    return (
        Instance.objects.filter(renter=user)
        .select_related("image", "gpu_model")
        # its node's NVLink islands, in the same query: instance_on_one_nvlink_island reads them
        .annotate(node_nvlink_islands=F("node__benchmark_summary__nvlink__islands"))
        .prefetch_related(Prefetch("allocations", queryset=live, to_attr="live_allocations"),
                          Prefetch("slice_allocations", queryset=live_slices, to_attr="live_slices"),
                          Prefetch("volume_mounts", queryset=VolumeMount.objects.select_related("volume")))
    )


def instance_gpu_indices(*, instance: Instance) -> list[int]:
    """The node's GPU indices the instance holds now (live allocations), sorted; a MIG instance's: the GPUs its
    slices are on."""
    if instance.mig_profile:
        return instance_slice_gpu_indices(instance=instance)
    live = getattr(instance, "live_allocations", None)
    if live is not None:
        return sorted(a.gpu.index for a in live)
    return sorted(
        GpuAllocation.objects.filter(instance=instance, released_at__isnull=True).values_list("gpu__index", flat=True)
    )


def instance_for_idempotency_key(*, renter: User, idempotency_key: str, request_fingerprint: str) -> Instance | None:
    """The instance an earlier request with this key created, or None.

    Raises IdempotencyKeyReused when that request had another body.
    """
    existing = Instance.objects.filter(renter=renter, idempotency_key=idempotency_key).first()
    if existing is not None and existing.request_fingerprint != request_fingerprint:
        raise IdempotencyKeyReused(
            f"This Idempotency-Key was already used for a different request (it created instance {existing.pk}). "
            "Send the same body to get that instance again, or use a new key for a new request."
        )
    return existing


# -------------------------------------------------------------------------------------- helpers


def _lock_node_for_booking(node_id: int, *, count_gpus: bool = False) -> Node | None:
    """Read the node and hold a share lock on its row until the transaction ends.

    `count_gpus`: also set `node.gpu_total` (all its GPUs, any status), in the same round trip. The node comes
    back with only the columns booking reads (the rest deferred) and `nvlink_islands` (JSON text)."""
    if connection.vendor == "postgresql":
        # Django has no FOR SHARE. A fixed statement, prepared per connection (core/sql.py): every booking runs it.
        # FOR SHARE locks the node's row only (the count's subquery reads, it locks nothing).
        with prepared_cursor() as cursor:
            cursor.execute(_NODE_FOR_BOOKING_SQL if count_gpus else _NODE_FOR_START_SQL, [node_id])
            row = cursor.fetchone()
        if row is None:
            return None
        *columns, total, islands = row
        node = Node.from_db(connection.alias, _NODE_FOR_BOOKING_FIELDS,
                            [_NODE_JSON[i](v) if i in _NODE_JSON else v for i, v in enumerate(columns)])
        node.nvlink_islands = islands  # type: ignore[attr-defined]  # for node_nvlink_islands
        if count_gpus:
            node.gpu_total = total  # type: ignore[attr-defined]
        return node
    found = Node.objects.select_for_update().filter(pk=node_id).first()  # SQLite: writes are serialised anyway
    if found is not None and count_gpus:
        found.gpu_total = Gpu.objects.filter(node_id=node_id).count()  # type: ignore[attr-defined]
    return found


# In the model's field order: Model.from_db takes a subset's values in that order.
_NODE_FOR_BOOKING_FIELDS = tuple(f.attname for f in Node._meta.concrete_fields if f.attname in {
    "id", "state", "verdict", "listed", "runtime", "gpu_model_id", "price_per_gpu_hour_micros",
    "disk_price_per_gb_month_micros", "inventory", "mig_prices_micros"})
# jsonb reaches Django as text (its psycopg loaders): decoded here as JSONField.from_db_value would
_NODE_JSON = {i: (lambda v: None if v is None else json.loads(v))
              for i, name in enumerate(_NODE_FOR_BOOKING_FIELDS) if name in ("inventory", "mig_prices_micros")}


def _node_for_booking_sql(count_gpus: bool) -> str:
    table, gpu_table = Node._meta.db_table, Gpu._meta.db_table
    total = f"(SELECT count(*) FROM {gpu_table} g WHERE g.node_id = n.id)" if count_gpus else "NULL"  # noqa: S608
    return (f"SELECT {', '.join(f'n.{name}' for name in _NODE_FOR_BOOKING_FIELDS)}, {total} AS gpu_total, "  # noqa: S608
            # the NVLink islands the check found, for a topology-aware allocation (_allocate_free_gpus)
            f"(n.benchmark_summary -> 'nvlink' -> 'islands')::text AS nvlink_islands "
            f"FROM {table} n WHERE n.id = %s FOR SHARE OF n")


_NODE_FOR_BOOKING_SQL = _node_for_booking_sql(True)
_NODE_FOR_START_SQL = _node_for_booking_sql(False)


_NODE_STATE_REASONS: dict[str, str] = {
    NodeState.PENDING: "its node has not been verified yet",
    NodeState.VERIFYING: "its node is being verified",
    NodeState.REJECTED: "its node did not pass the benchmark check",
    NodeState.MAINTENANCE: "its node is in maintenance",
    NodeState.OFFLINE: "its node is offline",
    NodeState.QUARANTINED: "its node is quarantined",
    NodeState.RETIRED: "its node was retired by its provider",
}


def _booking_refusal(node: Node) -> str | None:
    if node.state != NodeState.ACTIVE:
        return _NODE_STATE_REASONS.get(node.state, f"its node is {node.state}")
    if node.verdict not in LISTABLE_VERDICTS:
        return "its node has not passed the benchmark check"
    if not node.listed:
        return "its provider has unlisted it"
    return None


def _lock_free_gpus(node_id: int, count: int, prefer: Sequence[int] = ()) -> list[Gpu]:
    """Lock up to `count` free GPUs of the node (FOR UPDATE SKIP LOCKED), `prefer` ids first, then by index."""
    gpus = Gpu.objects.select_for_update(skip_locked=True).filter(node_id=node_id, status=GpuStatus.FREE)
    if prefer:
        rank = Case(When(pk__in=list(prefer), then=Value(0)), default=Value(1), output_field=IntegerField())
        gpus = gpus.annotate(_rank=rank).order_by("_rank", "index")
    else:
        gpus = gpus.order_by("index")
    return list(gpus[:count])


def _allocate(instance: Instance, gpus: list[Gpu], at: datetime) -> None:
    Gpu.transition_rows(Gpu.objects.filter(pk__in=[g.pk for g in gpus]), GpuStatus.RENTED, action="rent")
    try:
        with transaction.atomic():
            GpuAllocation.objects.bulk_create(GpuAllocation(instance=instance, gpu=g, allocated_at=at) for g in gpus)
    except IntegrityError as exc:  # the database's guarantee caught a GPU marked free while allocated
        if "gpu_in_at_most_one_live_allocation" in str(exc):
            raise Conflict("The GPUs were taken by another booking meanwhile; try again.") from None
        raise


def node_nvlink_islands(node: Node) -> list[list[int]]:
    """The NVLink islands _lock_node_for_booking read with the node (JSON text), or those of its last check."""
    raw = getattr(node, "nvlink_islands", None)
    if raw is None and "benchmark_summary" in node.__dict__:  # the ORM path (SQLite) loads the whole row
        raw = ((node.benchmark_summary or {}).get("nvlink") or {}).get("islands")
    return parse_islands(raw)


def instance_on_one_nvlink_island(*, instance: Instance) -> bool | None:
    """Whether the GPUs the instance holds are all on one NVLink island of its node (instances_for_user reads the
    islands with it); None for fewer than two GPUs, or a node without NVLink."""
    islands = parse_islands(getattr(instance, "node_nvlink_islands", None))
    held = set(instance_gpu_indices(instance=instance))
    if len(held) < 2 or not islands:
        return None
    return any(held <= set(island) for island in islands)


def parse_islands(raw: object) -> list[list[int]]:
    """NVLink islands from JSON text or an already decoded list; [] for anything else."""
    try:
        islands = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return []
    return islands if isinstance(islands, list) and all(isinstance(i, list) for i in islands) else []


def island_of_index(islands: Sequence[Sequence[int]] | None) -> list[int | None]:
    """Per GPU index, the number of its NVLink island (None: on no island), as the allocation's SQL array."""
    out: list[int | None] = []
    for number, island in enumerate(islands or []):
        for index in island:
            if isinstance(index, int) and 0 <= index < 1024:
                out.extend([None] * (index + 1 - len(out)))
                out[index] = number
    return out


def _allocate_free_gpus(instance: Instance, node_id: int, count: int, at: datetime,
                        islands: Sequence[Sequence[int]] | None = None, *, insert_instance: bool = False) -> int:
    """A booking's GPUs in one round trip: lock up to `count` free GPUs of the node (FOR UPDATE SKIP LOCKED, by
    index), mark them rented and allocate them to the instance. Returns how many it took: fewer than `count`
    means the caller must raise (Conflict) so that its transaction rolls all of it back.

    `insert_instance`: the instance is not saved yet, and its INSERT goes in the same statement (a booking's:
    one round trip less); it has its id afterwards. A concurrent booking with the same Idempotency-Key still
    waits on the unique index inside the statement, then fails it.

    With the node's NVLink `islands` (two or more GPUs), the GPUs come from one island when one has `count` free:
    the smallest such island (the larger stay whole for larger bookings); else the island with the most free
    first. The free counts are read in the same statement without locks: a concurrent booking may make the
    choice less than best, never the allocation wrong (the locks and the unique index still decide).

    No savepoint: on any error here the booking's transaction ends anyway (the caller raises out of it)."""
    if connection.vendor != "postgresql":
        if insert_instance:
            instance.save(force_insert=True)
        gpus = _lock_free_gpus(node_id, count)
        if len(gpus) == count:
            _allocate(instance, gpus, at)
        return len(gpus)
    q = connection.ops.quote_name
    gpu, allocation = q(Gpu._meta.db_table), q(GpuAllocation._meta.db_table)
    state = q(Gpu.state_field)  # the column is named as the field
    sources = sorted(Gpu.transitions.action_sources("rent"))  # the transition table's rule, as transition_rows
    island_of = island_of_index(islands) if count > 1 else []
    if island_of:
        # Each GPU off the islands is an island of its own (-1 - index); best fit first, then by index.
        island = f"COALESCE((%s::int[])[g.{q('index')} + 1], -1 - g.{q('index')})"
        picked = (f"free AS (SELECT g.id, {island} AS island FROM {gpu} g "  # noqa: S608
                  f"WHERE g.node_id = %s AND g.{state} = %s), "
                  f"sizes AS (SELECT island, count(*) AS n FROM free GROUP BY island), "
                  f"picked AS (SELECT g.id FROM {gpu} g JOIN free f ON f.id = g.id JOIN sizes s ON s.island = f.island "
                  f"WHERE g.node_id = %s AND g.{state} = %s "
                  f"ORDER BY CASE WHEN s.n >= %s THEN s.n ELSE 100000 - s.n END, f.island, g.{q('index')} "
                  f"LIMIT %s FOR UPDATE OF g SKIP LOCKED), ")
        params: list[Any] = [island_of, node_id, GpuStatus.FREE, node_id, GpuStatus.FREE, count, count]
    else:
        picked = (f"picked AS (SELECT id FROM {gpu} WHERE node_id = %s AND {state} = %s "  # noqa: S608
                  f"ORDER BY {q('index')} LIMIT %s FOR UPDATE SKIP LOCKED), ")
        params = [node_id, GpuStatus.FREE, count]
    rented = (f"rented AS (UPDATE {gpu} g SET {state} = %s FROM picked WHERE g.id = picked.id "  # noqa: S608
              f"AND g.{state} = ANY(%s) RETURNING g.id) ")
    params += [GpuStatus.RENTED, sources]
    if insert_instance:
        sql = (f"WITH inst AS ({_instance_insert().sql}), {picked}{rented}, "  # noqa: S608
               f"alloc AS (INSERT INTO {allocation} (instance_id, gpu_id, allocated_at) "
               f"SELECT inst.id, rented.id, %s FROM inst, rented RETURNING 1) "
               f"SELECT (SELECT id FROM inst), (SELECT count(*) FROM alloc)")
        params = [*_instance_insert().values(instance), *params, at]
    else:
        sql = (f"WITH {picked}{rented}"  # noqa: S608
               f"INSERT INTO {allocation} (instance_id, gpu_id, allocated_at) SELECT %s, id, %s FROM rented")
        params += [instance.pk, at]
    try:
        with prepared_cursor() as cursor:  # every booking runs it: prepared per connection (core/sql.py)
            cursor.execute(sql, params)
            if not insert_instance:
                return int(cursor.rowcount)
            instance.pk, taken = cursor.fetchone()
    except IntegrityError as exc:  # the database's guarantee caught a GPU marked free while allocated
        if "gpu_in_at_most_one_live_allocation" in str(exc):
            raise Conflict("The GPUs were taken by another booking meanwhile; try again.") from None
        raise
    instance._state.adding = False
    instance._state.db = connection.alias
    return int(taken)


@functools.cache
def _instance_insert() -> ModelInsert:
    return ModelInsert(Instance)


def instance_insert(instance: Instance) -> None:
    """An instance's INSERT; on PostgreSQL one fixed statement, prepared per connection (bookings run it)."""
    if connection.vendor != "postgresql":
        instance.save(force_insert=True)
        return
    with prepared_cursor() as cursor:
        _instance_insert().insert(cursor, instance)


def instance_release_gpus(*, instance: Instance, at: datetime | None = None) -> list[int]:
    """End every live allocation of the instance and free its GPUs; the indices released.

    Call inside the transaction that holds the instance's row lock. A GPU that was marked
    unavailable meanwhile stays unavailable. Idempotent: with nothing live it does nothing.
    """
    at = at or timezone.now()
    if instance.mig_profile:  # its slices, not whole GPUs (instances/mig.py); the parents' indices
        indices = instance_slice_gpu_indices(instance=instance)
        instance_release_slices(instance=instance, at=at)
        return indices
    live = list(
        GpuAllocation.objects.filter(instance_id=instance.pk, released_at__isnull=True)
        .select_related("gpu").order_by("gpu_id")
    )
    if not live:
        return []
    gpu_ids = [a.gpu_id for a in live]
    GpuAllocation.objects.filter(pk__in=[a.pk for a in live]).update(released_at=at)
    Gpu.transition_rows(Gpu.objects.filter(pk__in=gpu_ids), GpuStatus.FREE, action="release")
    return sorted(a.gpu.index for a in live)


def _locked(instance_id: int) -> Instance | None:
    return Instance.objects.select_for_update().filter(pk=instance_id).first()


def _save(instance: Instance, *fields: str) -> None:
    instance.save(update_fields=["status", "status_message", "updated_at", *fields])


def instance_notify(instance: Instance, kind: str, key: str, message: str = "") -> None:
    """Tell the renter, on the channels they chose, that the instance entered a state (once per `key`)."""
    notify(user=instance.renter, kind=kind, dedupe_key=f"{kind}:{instance.pk}:{key}",
           payload={"instance": instance.pk, "label": instance.label, "status": instance.status,
                    "message": message or instance.status_message})


def _stop_clock(instance: Instance, now: datetime) -> None:
    """Set stopped_at when an instance that was running (since started_at) ends some other way."""
    if instance.started_at is not None and (instance.stopped_at is None or instance.stopped_at < instance.started_at):
        instance.stopped_at = now


# ------------------------------------------------------------------------------------------ funds

# The instances that count towards a renter's burn rate when they rent or start one more: those billed now
# (running) and those that will be billed without another check once a worker is done (booked, starting,
# restarting). Stopping, stopped, failed and destroy* ones are not billed, and anything else counts only
# when it is added here. Interrupted ones are not billed and do not count: a renter whose server died must
# be able to rent a replacement; if it comes back, the low-balance warning and the stop at zero apply.
COMMITTED_STATUSES = (S.REQUESTED, S.PROVISIONING, S.STARTING, S.RUNNING)


@dataclass(frozen=True)
class Funds:
    """A renter's balance against BILLING_FUNDS_REQUIRED_S of their whole burn rate with one more instance."""

    balance_micros: int
    committed_rate_micros: int  # per hour: their instances in COMMITTED_STATUSES
    added_rate_micros: int  # per hour: the instance being rented or started
    required_micros: int  # BILLING_FUNDS_REQUIRED_S of both together
    missing_micros: int  # 0 when the balance covers it, or when funds are not required
    required_s: int
    enforced: bool  # BILLING_REQUIRE_FUNDS

    @property
    def rate_micros(self) -> int:
        return self.committed_rate_micros + self.added_rate_micros


def committed_rate_micros(*, renter_id: int) -> int:
    """What the renter's running and about-to-run instances (COMMITTED_STATUSES) cost per hour."""
    if connection.vendor == "postgresql":  # every booking runs it: the SQL once, not an aggregate compiled each time
        with prepared_cursor() as cursor:
            cursor.execute(_COMMITTED_RATE_SQL, [renter_id, list(COMMITTED_STATUSES)])
            return int(cursor.fetchone()[0])
    return (Instance.objects.filter(renter_id=renter_id, status__in=COMMITTED_STATUSES).order_by()
            .aggregate(rate=Sum("price_per_hour_micros"))["rate"] or 0)


_COMMITTED_RATE_SQL = (f"SELECT COALESCE(SUM(price_per_hour_micros), 0) FROM {Instance._meta.db_table} "  # noqa: S608
                       "WHERE renter_id = %s AND status = ANY(%s)")


def funds_for(*, renter_id: int, price_per_hour_micros: int, lock: bool = False) -> Funds:
    """The funds check's figures for renting (or starting) one more instance at this hourly price.

    The rule: the balance must hold BILLING_FUNDS_REQUIRED_S (one hour) of everything the renter would then
    be paying for, not of the new instance alone. `lock` is for the check inside a booking or start
    transaction (_check_funds); pages read without it.
    """
    # The wallet first: with `lock`, a booking or start of the same renter that held the lock has
    # committed when this returns, and the read of the instances below sees what it added.
    balance = wallet_balance(user_id=renter_id, lock=lock)
    committed = committed_rate_micros(renter_id=renter_id)
    required = funds_required_micros(price_per_hour_micros=committed + price_per_hour_micros)
    enforced = settings.BILLING_REQUIRE_FUNDS
    return Funds(balance_micros=balance, committed_rate_micros=committed, added_rate_micros=price_per_hour_micros,
                 required_micros=required, missing_micros=max(required - balance, 0) if enforced else 0,
                 required_s=settings.BILLING_FUNDS_REQUIRED_S, enforced=enforced)


def _check_funds(renter_id: int, price_per_hour_micros: int, what: str) -> None:
    """Renting or starting needs BILLING_FUNDS_REQUIRED_S (one hour) of the renter's whole burn rate with it.

    Race safety: the check runs inside the booking's (or start's) transaction and first locks the renter's
    wallet row, so two bookings of one renter run it one after the other and the second counts the first's
    instance. The wallet row, not the user or billing profile: it is the row every charge to this renter
    locks already (ledger_post, the meter), it is locked last and alone here (after the node's share lock
    or the instance's lock), so it adds no lock-order cycle, and other renters never wait for it.
    """
    if not settings.BILLING_REQUIRE_FUNDS:
        return
    funds = funds_for(renter_id=renter_id, price_per_hour_micros=price_per_hour_micros, lock=True)
    if funds.missing_micros:
        raise InsufficientFunds(f"{what} needs {_funds_span(funds.required_s)} of what your instances cost "
                                f"in your balance. {_funds_figures(funds)} (POST /api/v1/billing/top-ups/).",
                                funds)


def _funds_span(seconds: int) -> str:
    hours = seconds / 3600
    return "one hour" if hours == 1 else f"{hours:g} hours"


def _funds_figures(funds: Funds) -> str:
    span = _funds_span(funds.required_s)
    added = f"{usd_text(funds.added_rate_micros)}/h"
    if funds.committed_rate_micros:
        rate = (f"Your running and starting instances cost {usd_text(funds.committed_rate_micros)}/h; "
                f"with this one {usd_text(funds.rate_micros)}/h")
    else:
        rate = f"This instance costs {added}"
    return (f"{rate}; {span} needs {usd_text(funds.required_micros)}. Your balance is "
            f"{usd_text(funds.balance_micros)}; top up at least {usd_text(funds.missing_micros)}")


def _leave_running(instance: Instance, now: datetime) -> None:
    """The instance stops being billed: charge its usage up to now (call before it leaves `running`), or its
    disk's while stopped (call before it leaves `stopped`)."""
    if instance.status == S.RUNNING:
        usage_close(instance=instance, until=now)
    elif instance.status == S.STOPPED:
        instance_disk_close(instance=instance, until=now)


def _gpus_text(n: int) -> str:
    return f"{n} GPU" if n == 1 else f"{n} GPUs"
