"""A booking's statements: the node read with its share lock (and the renter's wallet lock), the GPUs' allocation,
and the instance's INSERT. On PostgreSQL a booking is four round trips: BEGIN, the node and wallet
(`_lock_node_for_booking`), one WITH statement (`_allocate_free_gpus`, or `_allocate_free_slices` for MIG slices:
the committed burn rate, the instance, its GPUs or slices and its provisioning job), COMMIT. Each statement is
fixed SQL that PostgreSQL prepares once per connection (core/sql.py).

Lock order, the same in every booking: the node's row (share) with its provider's account row (key share: an
operator's deactivation, which locks it for update, waits for the bookings in flight and the later ones see it), the
volumes the renter attaches, the renter's wallet row, then free GPUs (SKIP LOCKED, so never waited for)."""
import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.db.models import Case, Exists, IntegerField, OuterRef, Q, Value, When

from billing.models import Account, AccountKind
from core.errors import Conflict
from core.sql import ModelInsert, constraint_violated, prepared_cursor
from marketplace.models import Gpu, GpuAllocation, GpuStatus, Instance, MigSliceAllocation, Node, User
from marketplace.services.disk_room import (
    DISK_PROMISED_ALL_SQL,
    DISK_PROMISED_SQL,
    disk_room_from_columns,
    node_disk_room,
)
from marketplace.services.funds import COMMITTED_RATE_SQL, committed_rate_micros
from provisioning.models import Job
from provisioning.services.jobs import job_create, job_insert_for_new_instance, job_new, job_queued

from .mig import LIVE_SLICE_INDEX, SLICES_TAKEN_MESSAGE, allocate_free_slices_orm, free_slices_ctes


def _lock_node_for_booking(node_id: int, *, count_gpus: bool = False, wallet_of: int | None = None) -> Node | None:
    """Read the node and hold a share lock on its row until the transaction ends.

    Also sets `node.provider_active`: whether its provider's account is active, read under that row's key-share
    lock (a deactivation, marketplace.services.account_status, is not missed by a booking in flight).
    `count_gpus`: also set `node.gpu_total` (all its GPUs, any status), in the same round trip. `wallet_of`: also
    lock that user's wallet row FOR UPDATE, in the same round trip and after the node's row (the order a booking
    takes them in: the module's docstring), and set `node.wallet_balance_micros` (0 for a user with no wallet
    row yet); with no such node, no wallet is locked. The node comes back with only the columns booking reads
    (the rest deferred) and `nvlink_islands` (JSON text)."""
    if connection.vendor == "postgresql":
        # Django has no FOR SHARE. A fixed statement, prepared per connection (core/sql.py): every booking runs it.
        # FOR SHARE locks the node's row only (the count's subquery reads, it locks nothing).
        sql = _NODE_FOR_BOOKING_SQL if count_gpus else _NODE_FOR_START_SQL
        params: list[Any] = [node_id]
        if wallet_of is not None:
            sql = _NODE_AND_WALLET_FOR_BOOKING_SQL if count_gpus else _NODE_AND_WALLET_FOR_START_SQL
            params += [AccountKind.CUSTOMER_WALLET.value, wallet_of]
        with prepared_cursor() as cursor:
            cursor.execute(sql, params)
            row = cursor.fetchone()
        if row is None:
            return None
        if wallet_of is not None:
            *row, balance = row
        *columns, total, islands, provider_active, disk_promised, disk_promised_all = row
        node = Node.from_db(connection.alias, _NODE_FOR_BOOKING_FIELDS,
                            [_NODE_JSON[i](v) if i in _NODE_JSON else v for i, v in enumerate(columns)])
        node.nvlink_islands = islands  # type: ignore[attr-defined]  # for node_nvlink_islands
        node.provider_active = provider_active  # type: ignore[attr-defined]  # for offer_rules.node_refusal
        if count_gpus:
            node.gpu_total = total  # type: ignore[attr-defined]
            node.disk_room = disk_room_from_columns(  # type: ignore[attr-defined]
                node.disk_free_gb, disk_promised, node.disk_total_gb, disk_promised_all)
        if wallet_of is not None:
            node.wallet_balance_micros = balance or 0  # type: ignore[attr-defined]
        return node
    found = Node.objects.select_for_update().filter(pk=node_id).first()  # SQLite: writes are serialised anyway
    if found is not None:
        found.provider_active = User.objects.filter(pk=found.provider_id).values_list(  # type: ignore[attr-defined]
            "is_active", flat=True).first()
    if found is not None and count_gpus:
        found.gpu_total = Gpu.objects.filter(node_id=node_id).count()  # type: ignore[attr-defined]
        found.disk_room = node_disk_room(found)  # type: ignore[attr-defined]
    if found is not None and wallet_of is not None:
        wallet = Account.objects.select_for_update().filter(kind=AccountKind.CUSTOMER_WALLET, user_id=wallet_of)
        found.wallet_balance_micros = wallet.values_list("balance_micros", flat=True).first() or 0  # type: ignore[attr-defined]
    return found


# In the model's field order: Model.from_db takes a subset's values in that order.
_NODE_FOR_BOOKING_FIELDS = tuple(f.attname for f in Node._meta.concrete_fields if f.attname in {
    "id", "state", "verdict", "listed", "health_failures", "runtime", "gpu_model_id", "price_per_gpu_hour_micros",
    "disk_price_per_gb_month_micros", "inventory", "mig_prices_micros", "disk_free_gb", "disk_total_gb"})
# jsonb reaches Django as text (its psycopg loaders): decoded here as JSONField.from_db_value would
_NODE_JSON = {i: (lambda v: None if v is None else json.loads(v))
              for i, name in enumerate(_NODE_FOR_BOOKING_FIELDS) if name in ("inventory", "mig_prices_micros")}


def _node_for_booking_sql(count_gpus: bool) -> str:
    table, gpu_table, user_table = Node._meta.db_table, Gpu._meta.db_table, User._meta.db_table
    total = f"(SELECT count(*) FROM {gpu_table} g WHERE g.node_id = n.id)" if count_gpus else "NULL"  # noqa: S608
    promised = DISK_PROMISED_SQL if count_gpus else "NULL"  # a booking's disk must fit (disk_room)
    promised_all = DISK_PROMISED_ALL_SQL if count_gpus else "NULL"
    return (f"SELECT {', '.join(f'n.{name}' for name in _NODE_FOR_BOOKING_FIELDS)}, {total} AS gpu_total, "  # noqa: S608
            # the NVLink islands the check found, for a topology-aware allocation (_allocate_free_gpus)
            f"(n.benchmark_summary -> 'nvlink' -> 'islands')::text AS nvlink_islands, "
            # Its provider's account, locked: a row locked by this statement is read as committed after any wait
            # (a plain read, or a subquery, would keep the statement's snapshot: active, when a deactivation this
            # statement waited for had just committed). KEY SHARE: the account's ordinary updates (a log-in's
            # last_login) do not wait for bookings.
            f"u.is_active AS provider_active, {promised} AS disk_promised, {promised_all} AS disk_promised_all "
            f"FROM {table} n JOIN {user_table} u ON u.id = n.provider_id "
            f"WHERE n.id = %s FOR SHARE OF n FOR KEY SHARE OF u")


def _node_and_wallet_sql(node_sql: str) -> str:
    """The node's statement, then the wallet's lock. The outer SELECT reads a row of `node_row` (the node, locked
    by its own FOR SHARE) before it computes its columns, among them the subquery that locks the wallet: node
    first, wallet second, as in every booking (tests/marketplace/test_booking_statements.py holds the order)."""
    wallet = (f"SELECT balance_micros FROM {Account._meta.db_table} "  # noqa: S608 (the model's table)
              "WHERE kind = %s AND user_id = %s FOR UPDATE")  # one per kind and user
    return (f"WITH node_row AS ({node_sql}), wallet_row AS ({wallet}) "  # noqa: S608 (fixed SQL)
            "SELECT node_row.*, (SELECT balance_micros FROM wallet_row) FROM node_row")


_NODE_FOR_BOOKING_SQL = _node_for_booking_sql(True)
_NODE_FOR_START_SQL = _node_for_booking_sql(False)
_NODE_AND_WALLET_FOR_BOOKING_SQL = _node_and_wallet_sql(_NODE_FOR_BOOKING_SQL)
_NODE_AND_WALLET_FOR_START_SQL = _node_and_wallet_sql(_NODE_FOR_START_SQL)


def _lock_free_gpus(node_id: int, count: int, prefer: Sequence[int] = (),
                    islands: Sequence[Sequence[int]] | None = None) -> list[Gpu]:
    """Lock up to `count` free GPUs of the node (FOR UPDATE SKIP LOCKED), `prefer` ids first, then by index.

    With the node's NVLink `islands` (PostgreSQL), chosen as a booking chooses them (`_island_picked_sql`, the one
    ranking), for one GPU as for several: all the `prefer` ids when all are free, else the booking's island,
    keeping as many of them as that rule allows. A start of a stopped instance that may move (not a container)
    takes its GPUs so, and a booking on SQLite (the demo's database: the same ranking in Python, `_island_ranked`;
    by index, a booking there with require_nvlink was refused, and a Vast one spanned islands, beside a free
    island). Without islands, as before."""
    # One GPU too (found by review): by index a one-GPU start took a card of a whole island beside a free card off
    # the islands or in a smaller one, breaking up the island a later multi-GPU booking needed.
    island_of = island_of_index(islands)
    if island_of and connection.vendor != "postgresql":  # SQLite serialises writes: no lock to skip
        free = list(Gpu.objects.select_for_update().filter(node_id=node_id, status=GpuStatus.FREE))
        return sorted(_island_ranked(free, island_of, count, prefer), key=lambda g: g.index)
    if island_of:
        q = connection.ops.quote_name
        sql = (f"WITH {_island_picked_sql(prefer=True)} "  # noqa: S608 (fixed SQL)
               f"SELECT g.* FROM {q(Gpu._meta.db_table)} g WHERE g.id IN (SELECT id FROM picked) "
               f"ORDER BY g.{q('index')}")
        return list(Gpu.objects.raw(sql, _island_picked_params(island_of, node_id, count, prefer=prefer)))
    gpus = Gpu.objects.select_for_update(skip_locked=True).filter(node_id=node_id, status=GpuStatus.FREE)
    if prefer:
        rank = Case(When(pk__in=list(prefer), then=Value(0)), default=Value(1), output_field=IntegerField())
        gpus = gpus.annotate(_rank=rank).order_by("_rank", "index")
    else:
        gpus = gpus.order_by("index")
    return list(gpus[:count])


def _island_ranked(free: list[Gpu], island_of: list[int | None], count: int, prefer: Sequence[int] = ()) -> list[Gpu]:
    """`_island_picked_sql`'s choice among the node's `free` GPUs, in Python (SQLite): up to `count` of them.
    tests/marketplace/test_nvlink_start_require.py holds the two equal."""
    def island(gpu: Gpu) -> int:
        number = island_of[gpu.index] if 0 <= gpu.index < len(island_of) else None
        return number if number is not None else -1 - gpu.index

    wanted = set(prefer)
    sizes: dict[int, int] = {}
    kept: dict[int, int] = {}
    for gpu in free:
        sizes[island(gpu)] = sizes.get(island(gpu), 0) + 1
        kept[island(gpu)] = kept.get(island(gpu), 0) + (gpu.pk in wanted)
    keep_all = sum(gpu.pk in wanted for gpu in free) >= count

    def rank(gpu: Gpu) -> tuple[int, ...]:
        n, was = sizes[island(gpu)], gpu.pk in wanted
        fit = n if n >= count else 100000 - n
        if not prefer:
            return (fit, island(gpu), gpu.index)
        return (0 if was and keep_all else 1, fit, -kept[island(gpu)], island(gpu), 0 if was else 1, gpu.index)

    return sorted(free, key=rank)[:count]


def _allocate(instance: Instance, gpus: list[Gpu], at: datetime) -> None:
    Gpu.transition_rows(Gpu.objects.filter(pk__in=[g.pk for g in gpus]), GpuStatus.RENTED, action="rent")
    try:
        with transaction.atomic():
            GpuAllocation.objects.bulk_create(GpuAllocation(instance=instance, gpu=g, allocated_at=at) for g in gpus)
    except IntegrityError as exc:  # the database's guarantee caught a GPU marked free while allocated
        if constraint_violated(exc) == "gpu_in_at_most_one_live_allocation":  # by name, not in the text (core.sql)
            raise Conflict("The GPUs were taken by another booking meanwhile; try again.") from None
        raise


def node_nvlink_islands(node: Node) -> list[list[int]]:
    """The NVLink islands _lock_node_for_booking read with the node (JSON text), or those of its last check."""
    from marketplace.stored_figures import as_object, nvlink_summary

    raw = getattr(node, "nvlink_islands", None)
    if raw is None and "benchmark_summary" in node.__dict__:  # the ORM path (SQLite) loads the whole row
        # Stored JSON of any shape (a summary or nvlink that is no object was an AttributeError, a booking's or a
        # start's 500 on this path; found by review): read as stored_figures reads it, GPU indices only.
        nvlink = nvlink_summary(as_object(node.benchmark_summary).get("nvlink"))
        raw = nvlink["islands"] if nvlink is not None else None
    return parse_islands(raw)


def gpus_held_and_free(instance: Instance, node_id: int) -> tuple[set[int], set[int]]:
    """(indices of the GPUs the instance holds, indices of the node's free GPUs), in one query: a booking with
    require_nvlink checks what it took against the islands (booking._refuse_across_islands)."""
    held = GpuAllocation.objects.filter(gpu_id=OuterRef("pk"), instance_id=instance.pk, released_at__isnull=True)
    rows = (Gpu.objects.filter(node_id=node_id).annotate(held=Exists(held))
            .filter(Q(held=True) | Q(status=GpuStatus.FREE)).values_list("index", "held"))
    found: tuple[set[int], set[int]] = (set(), set())
    for index, is_held in rows:
        found[0 if is_held else 1].add(index)
    return found


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


def _island_picked_sql(*, prefer: bool) -> str:
    """The NVLink ranking of free GPUs, booking's and a moving start's (`_lock_free_gpus`): the CTEs `free`, `sizes`
    and `picked`, the ids of up to `count` free GPUs of the node, locked FOR UPDATE SKIP LOCKED. Each GPU off the
    islands is an island of its own (-1 - index). Best fit first: the smallest island with `count` free (the
    larger stay whole for larger bookings), else the island with the most free first; then by island, then by
    index. Parameters: `_island_picked_params`.

    `prefer` (the GPUs a stopped instance held): all of them first when all are free (keeping them is best);
    otherwise the same ranking, with, among islands ranked alike, those holding more of them first, and in an
    island them first. The text without `prefer` is the booking's prepared statement's: leave it unchanged."""
    q = connection.ops.quote_name
    gpu, state, index = q(Gpu._meta.db_table), q(Gpu.state_field), q("index")  # the column is named as the field
    island = f"COALESCE((%s::int[])[g.{index} + 1], -1 - g.{index})"
    was = ", g.id = ANY(%s::bigint[]) AS was" if prefer else ""
    kept = ", count(*) FILTER (WHERE was) AS kept" if prefer else ""
    keep_all = "CASE WHEN f.was AND (SELECT count(*) FROM free WHERE was) >= %s THEN 0 ELSE 1 END, " if prefer else ""
    fit = "CASE WHEN s.n >= %s THEN s.n ELSE 100000 - s.n END"
    order = (f"{keep_all}{fit}, s.kept DESC, f.island, f.was DESC, g.{index}" if prefer
             else f"{fit}, f.island, g.{index}")
    return (f"free AS (SELECT g.id, {island} AS island{was} FROM {gpu} g "  # noqa: S608 (fixed SQL)
            f"WHERE g.node_id = %s AND g.{state} = %s), "
            f"sizes AS (SELECT island, count(*) AS n{kept} FROM free GROUP BY island), "
            f"picked AS (SELECT g.id FROM {gpu} g JOIN free f ON f.id = g.id JOIN sizes s ON s.island = f.island "
            f"WHERE g.node_id = %s AND g.{state} = %s "
            f"ORDER BY {order} "
            f"LIMIT %s FOR UPDATE OF g SKIP LOCKED)")


def _island_picked_params(island_of: list[int | None], node_id: int, count: int,
                          prefer: Sequence[int] | None = None) -> list[Any]:
    """`_island_picked_sql`'s parameters, in its order (`prefer` given: its text with `prefer=True`)."""
    if prefer is None:
        return [island_of, node_id, GpuStatus.FREE, node_id, GpuStatus.FREE, count, count]
    return [island_of, list(prefer), node_id, GpuStatus.FREE, node_id, GpuStatus.FREE, count, count, count]


@dataclass(frozen=True)
class Booked:
    """What a booking's statement did: GPUs (or MIG slices) taken (fewer than asked: the caller raises, rolling all
    of it back), the renter's committed burn rate before this instance (with `rate_of`), the provisioning job
    (with `job_kind`)."""

    taken: int
    committed_rate_micros: int | None
    job: Job | None


def _allocate_free_gpus(instance: Instance, node: Node, count: int, at: datetime,
                        islands: Sequence[Sequence[int]] | None = None, *, rate_of: int | None = None,
                        job_kind: str | None = None) -> Booked:
    """A booking in one round trip: insert the unsaved `instance` (it has its id afterwards), lock up to `count`
    free GPUs of the node (FOR UPDATE SKIP LOCKED, by index), mark them rented and allocate them to it.

    `rate_of`: also read that renter's committed burn rate (funds.committed_rate_micros) for the funds check. The
    statement starts after the wallet's lock was granted (`_lock_node_for_booking(wallet_of=...)`), so it counts
    every instance of a booking of the same renter that held the lock before; its snapshot is the statement's,
    so it does not count this instance. The caller checks the funds and raises when short: the rollback undoes
    the rest. `job_kind`: also insert the instance's provisioning job (then handed off as job_create does).

    A concurrent booking with the same Idempotency-Key waits on the unique index inside the statement, then
    fails it (IntegrityError, which instance_create answers).

    With the node's NVLink `islands`, the GPUs come from one island when one has `count` free: the smallest such
    island (the larger stay whole for larger bookings); else the island with the most free first. A one-GPU
    booking too: a free card off every island (an island of one) first, else one of the island with the fewest
    free; by index it took GPU 0 and broke up the island a later multi-GPU booking needed (found by review). The
    free counts are read in the same statement without locks: a concurrent booking may make the choice less than
    best, never the allocation wrong (the locks and the unique index still decide).

    No savepoint: on any error here the booking's transaction ends anyway (the caller raises out of it)."""
    if connection.vendor != "postgresql":
        rate = committed_rate_micros(renter_id=rate_of) if rate_of is not None else None
        instance.save(force_insert=True)
        gpus = _lock_free_gpus(node.pk, count, islands=islands)
        if len(gpus) == count:
            _allocate(instance, gpus, at)
        job = (job_create(kind=job_kind, node=node, instance=instance, savepoint=False)
               if job_kind is not None else None)
        return Booked(len(gpus), rate, job)
    q = connection.ops.quote_name
    gpu = q(Gpu._meta.db_table)
    state = q(Gpu.state_field)  # the column is named as the field
    sources = sorted(Gpu.transitions.action_sources("rent"))  # the transition table's rule, as transition_rows
    island_of = island_of_index(islands)
    if island_of:
        picked = _island_picked_sql(prefer=False) + ", "
        gpu_params: list[Any] = _island_picked_params(island_of, node.pk, count)
    else:
        picked = (f"picked AS (SELECT id FROM {gpu} WHERE node_id = %s AND {state} = %s "  # noqa: S608
                  f"ORDER BY {q('index')} LIMIT %s FOR UPDATE SKIP LOCKED), ")
        gpu_params = [node.pk, GpuStatus.FREE, count]
    rented = (f"rented AS (UPDATE {gpu} g SET {state} = %s FROM picked WHERE g.id = picked.id "  # noqa: S608
              f"AND g.{state} = ANY(%s) RETURNING g.id)")
    return _book_units(instance, node, picked + rented, [*gpu_params, GpuStatus.RENTED, sources],
                       GpuAllocation, "gpu_id", at, rate_of=rate_of, job_kind=job_kind,
                       live_index="gpu_in_at_most_one_live_allocation",
                       taken_meanwhile="The GPUs were taken by another booking meanwhile; try again.")


def _allocate_free_slices(instance: Instance, node: Node, profile: str, count: int, at: datetime, *,
                          rate_of: int | None = None, job_kind: str | None = None) -> Booked:
    """A MIG booking in one round trip, as `_allocate_free_gpus`: up to `count` free slices of `profile` on the
    node's split GPUs (mig.free_slices_ctes: the GPUs' rows under a share lock, the slices SKIP LOCKED)."""
    if connection.vendor != "postgresql":
        rate = committed_rate_micros(renter_id=rate_of) if rate_of is not None else None
        instance.save(force_insert=True)
        taken = allocate_free_slices_orm(instance, node.pk, profile, count, at)
        job = (job_create(kind=job_kind, node=node, instance=instance, savepoint=False)
               if job_kind is not None else None)
        return Booked(taken, rate, job)
    ctes, params = free_slices_ctes(node.pk, profile, count)
    return _book_units(instance, node, ctes, params, MigSliceAllocation, "mig_slice_id", at, rate_of=rate_of,
                       job_kind=job_kind, live_index=LIVE_SLICE_INDEX, taken_meanwhile=SLICES_TAKEN_MESSAGE)


def _book_units(instance: Instance, node: Node, taking: str, taking_params: list[Any],
                allocation_model: type[GpuAllocation] | type[MigSliceAllocation],
                unit_column: str, at: datetime, *, rate_of: int | None, job_kind: str | None, live_index: str,
                taken_meanwhile: str) -> Booked:
    """The booking's one statement: [the committed rate,] the instance, the CTEs `taking` (which end in `rented`,
    the ids of the units taken), their allocations to the instance [, the job]. PostgreSQL."""
    allocation = connection.ops.quote_name(allocation_model._meta.db_table)
    # Every sub-statement of a WITH sees one snapshot, and each data-modifying one runs once, to the end.
    ctes = [f"inst AS ({_instance_insert().sql})", taking,
            f"alloc AS (INSERT INTO {allocation} (instance_id, {unit_column}, allocated_at) "  # noqa: S608
            f"SELECT inst.id, rented.id, %s FROM inst, rented RETURNING 1)"]
    params: list[Any] = [*_instance_insert().values(instance), *taking_params, at]
    outputs = ["(SELECT id FROM inst)", "(SELECT count(*) FROM alloc)"]
    if rate_of is not None:
        ctes.insert(0, f"rate AS ({COMMITTED_RATE_SQL})")
        params[:0] = [rate_of]
        outputs.append("(SELECT * FROM rate)")
    job = None
    if job_kind is not None:
        job = job_new(kind=job_kind, node=node, instance=instance)
        job_sql, job_params = job_insert_for_new_instance(job, instance_id_sql="(SELECT id FROM inst)")
        ctes.append(f"job AS ({job_sql})")
        params += job_params
        outputs.append("(SELECT id FROM job)")
    sql = f"WITH {', '.join(ctes)} SELECT {', '.join(outputs)}"
    try:
        with prepared_cursor() as cursor:  # every booking runs it: prepared per connection (core/sql.py)
            cursor.execute(sql, params)
            row = cursor.fetchone()
    except IntegrityError as exc:  # the database's guarantee caught a unit marked free while allocated
        if constraint_violated(exc) == live_index:  # by name, never in the text (core.sql)
            raise Conflict(taken_meanwhile) from None
        raise
    instance.pk, taken = row[0], int(row[1])
    instance._state.adding = False
    instance._state.db = connection.alias
    rate = int(row[2]) if rate_of is not None else None
    if job is not None:
        job.pk = row[-1]
        job.instance = instance  # its instance_id, now that the instance has one
        job._state.adding = False
        job._state.db = connection.alias
        job_queued(job)
    return Booked(taken, rate, job)


@functools.cache
def _instance_insert() -> ModelInsert:
    return ModelInsert(Instance)
