"""Storage metering: volumes while they exist, and the disks of stopped instances, per second at the price per
GB-month (30 days) their node published when they were created, in balanced ledger transactions.

The arithmetic, with cumulative rounding as for GPU time (billing.services.metering), so totals do not depend on
how often the meter runs:

    cost(S seconds) = floor(size_gb × price_per_gb_month_micros × S / SECONDS_PER_MONTH)
    fee(S seconds)  = floor(cost(S) × platform_fee_bps / 10000)

- A volume is billed from `available_at` (created on its node) until its deletion is asked for (volume_delete
  closes it at that moment); a volume whose deletion the node refused is billed again from where it stopped, or
  from the node's answer when an outage came between (node_storage_outage_end moves a deleting volume on too).
- A stopped instance's disk is billed from `stopped_at` while it is stopped; leaving `stopped` (start, destroy,
  failure) closes it at that moment (marketplace.services.instances.common._leave_running), or, while its node's
  latest health check failed, at its last healthy moment (storage_billed_until), as a volume's deletion does.
  A look that finds its VM and disk gone ends its charge at their last sighting (the check fails it there); a
  start or destroy asked between that look and the check bills up to its own moment, and what it billed after
  the sighting is given back (disk_give_back, once), as GPU time is in the same race (metering.usage_give_back).
- A volume its node's list did not have is billed up to that look and no further (`Volume.missing_since`): ended as
  lost at the next look that misses it too, billed on from where it stopped if a later list has it again.
- The size billed is the one booked (`Instance.disk_gb`, `Volume.size_gb`): what a node reports never changes it.
- A disk's give-back re-bases its meter at the seconds paid for (`Instance.disk_rate_base_*` moved on by the
  seconds given back and what they were charged, as metering.usage_give_back re-bases GPU time), so seconds billed
  after it cost cost(paid + s) - cost(paid) (fee likewise), where they cost cost(billed + s) - cost(billed) before:
  up to one micro-dollar off what the seconds paid for cost. disk_cost_micros == disk_rate_base_cost_micros +
  cost(disk_billed_seconds - disk_rate_base_seconds).

Each charge is one database transaction with the volume's (or instance's) row locked: the ledger transaction
(idempotency key `storage:volume:<id>:<start µs>` or `storage:disk:<id>:<start µs>`) and the totals on the row.
The renter's wallet pays, the provider earns the amount minus the platform's fee, as for GPU time.
The ledger transaction is dated when it is posted, not at the end of the time it covers (which can be in a month
that is over: the last seconds of a month billed by the first tick of the next, or an outage's catch-up); its memo
names the span it charges for. A month's statement and earnings are final once it is over (review r55 MEDIUM-1:
each charge was dated at the node's last health check, so every month end changed the month that had just ended).

A node that does not answer: GPU time's rule. The meter bills no further than the node's last healthy moment
(`Node.last_seen_at`). A short silence (fewer than NODE_INTERRUPT_AFTER_FAILED_CHECKS failed checks in a row, which
interrupts no instance either) is caught up when the node answers. An outage (that many failed checks or more) is
never billed: when the node answers again, the reconciler (which runs before the node takes anything again) calls
`node_storage_outage_end`, which bills its volumes and stopped disks up to the last healthy moment and moves their
billing on to that moment of its answer, so the meter starts from there. The first answer counts (the periodic
reconciler's, between two health checks, as for the GPU time it resumes), unless a check failed again after it.
Storage closed by a state change during an outage (a deletion, a destroy, a start) ends at the last healthy moment
(storage_billed_until).
"""
import logging
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from billing import selectors
from billing.models import AccountKind, LedgerTransaction, TransactionKind
from billing.pricing import EPOCH, MICROSECOND, SECOND
from billing.services.ledger import LedgerError, ledger_post, platform_account, span_text, user_account
from billing.services.metering import node_billable_until
from marketplace.models import Instance, InstanceStatus, Node, Volume, VolumeState
from marketplace.models.host import SECONDS_PER_MONTH

log = logging.getLogger(__name__)


def storage_key(what: str, object_id: int, start: datetime) -> str:
    """The ledger idempotency key of the charge for `what` ("volume" or "disk") that starts at `start`."""
    return f"storage:{what}:{object_id}:{(start - EPOCH) // MICROSECOND}"


def storage_cost(*, size_gb: int, price_per_gb_month_micros: int, seconds: int) -> int:
    return size_gb * price_per_gb_month_micros * seconds // SECONDS_PER_MONTH


def storage_rate_per_hour_micros(*, size_gb: int, price_per_gb_month_micros: int) -> int:
    """What it costs per hour (rounded down): for the low-balance warnings' burn rate."""
    return size_gb * price_per_gb_month_micros * 3600 // SECONDS_PER_MONTH


@dataclass(frozen=True)
class _Charge:
    start: datetime
    end: datetime
    seconds: int
    amount: int
    fee: int


def _next(*, since: datetime, until: datetime, billed_seconds: int, size_gb: int, price: int,
          bps: int) -> _Charge | None:
    """The charge for the seconds from `since` to `until` after `billed_seconds` already billed: the cumulative
    cost at this size over all of them less that over the billed ones, so time billed already is never priced
    again (a size that changed, which nothing should do, would reach only new seconds) and the amount is never
    negative: what the ledger is posted is what the row adds."""
    seconds = int((until - since).total_seconds())
    if seconds <= 0:
        return None
    billed = storage_cost(size_gb=size_gb, price_per_gb_month_micros=price, seconds=billed_seconds)
    new_cost = storage_cost(size_gb=size_gb, price_per_gb_month_micros=price, seconds=billed_seconds + seconds)
    amount = new_cost - billed
    fee = new_cost * bps // 10_000 - billed * bps // 10_000
    return _Charge(start=since, end=since + seconds * SECOND, seconds=seconds, amount=amount, fee=fee)


def _post(*, key: str, renter_id: int, node_id: int, charge: _Charge, memo: str) -> None:
    """Post a storage charge, dated now (when it is posted): never in a month that is over."""
    if charge.amount < 0:  # cannot happen (_next); were it to, neither the ledger nor the row takes it
        raise LedgerError(f"{key}: a storage charge of {charge.amount} µ$")
    if charge.amount == 0:  # nothing to post (a free or tiny disk): the row adds 0 too
        return
    provider_id = Node.objects.values_list("provider_id", flat=True).get(pk=node_id)
    lines = [(user_account(user_id=renter_id, kind=AccountKind.CUSTOMER_WALLET), -charge.amount)]
    if charge.amount - charge.fee:
        lines.append((user_account(user_id=provider_id, kind=AccountKind.PROVIDER_EARNINGS),
                      charge.amount - charge.fee))
    if charge.fee:
        lines.append((platform_account(kind=AccountKind.PLATFORM_REVENUE), charge.fee))
    _, created = ledger_post(idempotency_key=key, kind=TransactionKind.STORAGE, lines=lines, memo=memo)
    if not created:  # the row said otherwise: refuse rather than charge twice
        raise LedgerError(f"{key} was already posted")


def volume_storage_close(*, volume: Volume, until: datetime | None = None) -> int:
    """Charge an available (or deleting) volume up to `until`; the amount charged. Call with its row locked.
    Never past `missing_since`: its node's list did not have it then (marketplace.services.volumes.
    volume_mark_missing), so nothing after is charged unless a later list finds it again (which clears that)."""
    until = until or timezone.now()
    if volume.missing_since is not None:
        until = min(until, volume.missing_since)
    if volume.available_at is None or volume.state not in (VolumeState.AVAILABLE, VolumeState.DELETING):
        return 0
    since = max(volume.billed_until or volume.available_at, volume.available_at)
    charge = _next(since=since, until=until, billed_seconds=volume.billed_seconds,
                   size_gb=volume.size_gb, price=volume.price_per_gb_month_micros, bps=volume.platform_fee_bps)
    if charge is None:
        return 0
    with transaction.atomic():
        _post(key=storage_key("volume", volume.pk, charge.start), renter_id=volume.owner_id,
              node_id=volume.node_id, charge=charge,
              memo=f"Volume {volume.pk} ({volume.size_gb} GB): {charge.seconds} s "
                   f"{span_text(charge.start, charge.end)}")
        Volume.objects.filter(pk=volume.pk).update(
            billed_until=charge.end, billed_seconds=F("billed_seconds") + charge.seconds,
            cost_micros=F("cost_micros") + charge.amount)
    volume.billed_until = charge.end
    volume.billed_seconds += charge.seconds
    volume.cost_micros += charge.amount
    return charge.amount


def instance_disk_close(*, instance: Instance, until: datetime | None = None) -> int:
    """Charge a stopped instance's disk up to `until`; the amount charged. Call with its row locked."""
    until = until or timezone.now()
    if instance.status != InstanceStatus.STOPPED or instance.stopped_at is None:
        return 0
    since = max(instance.disk_billed_until or instance.stopped_at, instance.stopped_at)
    # Priced from the disk's rate base (moved on by its give-backs): the seconds paid for since it.
    charge = _next(since=since, until=until, billed_seconds=instance.disk_billed_seconds
                   - instance.disk_rate_base_seconds, size_gb=instance.disk_gb,
                   price=instance.disk_price_per_gb_month_micros, bps=instance.platform_fee_bps)
    if charge is None:
        return 0
    with transaction.atomic():
        _post(key=storage_key("disk", instance.pk, charge.start),
              renter_id=instance.renter_id, node_id=instance.node_id, charge=charge,
              memo=f"Instance {instance.pk}'s disk while stopped ({instance.disk_gb} GB): {charge.seconds} s "
                   f"{span_text(charge.start, charge.end)}")
        Instance.objects.filter(pk=instance.pk).update(
            disk_billed_until=charge.end, disk_billed_seconds=F("disk_billed_seconds") + charge.seconds,
            disk_cost_micros=F("disk_cost_micros") + charge.amount)
    instance.disk_billed_until = charge.end
    instance.disk_billed_seconds += charge.seconds
    instance.disk_cost_micros += charge.amount
    return charge.amount


# ------------------------------------------------------------------------ disk billed past a loss


@dataclass(frozen=True)
class DiskGivenBack:
    amount_micros: int  # back to the renter's wallet
    fee_micros: int  # of it, taken back from the platform's revenue (the rest from the provider's earnings)
    seconds: int
    start: datetime  # the whole second of the disk's billing at or before `since`: its charge ends here now
    end: datetime  # where its billing had ended (the request that closed it)
    transactions: list[int]  # the reversals posted, one per storage charge involved


def _disk_charges(instance_id: int) -> list[tuple[datetime, LedgerTransaction]]:
    """The disk's storage charges (ledger transactions keyed storage:disk:<id>:<start µs>), by their start."""
    prefix = f"storage:disk:{instance_id}:"
    rows = LedgerTransaction.objects.filter(kind=TransactionKind.STORAGE, idempotency_key__startswith=prefix)
    return sorted(((EPOCH + int(t.idempotency_key[len(prefix):]) * MICROSECOND, t) for t in rows),
                  key=lambda row: row[0])


def disk_give_back(*, instance: Instance, since: datetime, seen_at: datetime, memo: str,
                   customer_note: str) -> DiskGivenBack | None:
    """Give back what a stopped instance's disk was billed for its time after `since`: a look at its node (a health
    probe, the reconciler's list) began at `seen_at` and found its VM and disk gone, last seen at `since`, but the
    instance had left `stopped` after that look began (its renter's start or destroy, between the probe and the
    check that fails it), and that request closed the disk's billing at its own moment (the node answering:
    storage_billed_until is `now`), past the last sighting. The check, finding it no longer stopped, left it
    (instance_mark_failed's `only_in`), so the renter paid for a disk the platform treats as lost from `since`: the
    disk's charge now ends there, as the failure would have ended it (`disk_seen_at`) and as a running instance's
    GPU time given back ends (billing.services.metering.usage_give_back).

    The disk's charge ends at its last whole second at or before `since` (the billing's seconds run from the stop),
    to the micro-dollar with the storage meter's cumulative rounding from the disk's rate base (cost and fee
    alike): each storage charge after it is reversed in full, the one across it in part, each by one REVERSAL
    transaction (`reverses` it: at most once, ledger key `reversal:<id>`, as an operator's reversal), the renter's
    wallet credited, the provider's earnings and the platform's revenue debited in the charge's proportions. The
    instance's own disk totals stay what was charged (as after an operator's reversal: the API and pages read the
    ledger's net, billing.selectors.storage_given_back); in the same transaction the disk's meter is re-based at
    the seconds paid for (_disk_rebase_after_give_back), so that its later seconds, should it be stopped and billed
    again, cost what the seconds paid for cost (before, up to one micro-dollar off).

    None, and nothing posted, when there is nothing to give back: still stopped (a check that fails it bills its
    disk up to `since` itself), billed no further than `since`, its billing closed before the look began (the
    charge that closed it was posted before `seen_at`: not a request in the race), or any of those charges
    reversed already. Call it under the instance's row lock, as every writer of its billing; the accounts are
    locked in id order by ledger_post. Assumes, as the race allows, no outage moved the disk's billing on between
    `since` and the close (node_storage_outage_end moves it on only at an answer after an outage)."""
    end = instance.disk_billed_until
    if instance.status == InstanceStatus.STOPPED or instance.stopped_at is None or end is None or end <= since:
        return None
    # This stop's charges that end after `since`: each ends where the next begins, the last at disk_billed_until.
    charges = [(start, txn) for start, txn in _disk_charges(instance.pk) if start >= instance.stopped_at]
    tail: list[tuple[datetime, LedgerTransaction]] = []
    for start, txn in reversed(charges):
        tail.insert(0, (start, txn))
        if start <= since:
            break
    if not tail or tail[-1][1].created_at < seen_at:
        return None  # closed before the look began (or by the meter): not this race
    if LedgerTransaction.objects.filter(reverses_id__in=[txn.pk for _, txn in tail]).exists():
        return None  # given back (or reversed by an operator) already
    first = tail[0][0]
    cut = first if since <= first else first + ((since - first) // SECOND) * SECOND
    if cut >= end:
        return None
    seconds_back = (end - cut) // SECOND
    # Costs from the disk's rate base (0 and 0 until a give-back moved it), as the meter priced them.
    paid = instance.disk_billed_seconds - instance.disk_rate_base_seconds  # since the base
    kept_cost = storage_cost(size_gb=instance.disk_gb, seconds=max(paid - seconds_back, 0),
                             price_per_gb_month_micros=instance.disk_price_per_gb_month_micros)
    bps = instance.platform_fee_bps
    charged = {txn.pk: _charged(txn) for _, txn in tail}  # (amount, fee) each charge posted
    # What was charged since the base before the charge across `cut`: the row's total less the base's and the tail's.
    cost = instance.disk_cost_micros - instance.disk_rate_base_cost_micros - sum(
        amount for amount, _ in charged.values())
    back: list[tuple[LedgerTransaction, int, int]] = []
    for start, txn in tail:
        amount, fee = charged[txn.pk]
        if start >= cut:
            back.append((txn, amount, fee))
        else:  # across it: what its seconds before `cut` cost stays charged, and the fee on that
            kept = min(max(kept_cost - cost, 0), amount)
            fee_kept = (cost + kept) * bps // 10_000 - cost * bps // 10_000
            back.append((txn, amount - kept, min(max(fee - fee_kept, 0), amount - kept)))
        cost += amount
    back = [(txn, amount, fee) for txn, amount, fee in back if amount > 0]
    base = _disk_rebase_after_give_back(instance, seconds_back)
    try:
        with transaction.atomic():
            posted = [_disk_reverse(instance, txn, amount, fee, memo, customer_note) for txn, amount, fee in back]
            if posted:
                Instance.objects.filter(pk=instance.pk).update(disk_rate_base_seconds=base[0],
                                                               disk_rate_base_cost_micros=base[1])
    except (IntegrityError, _ReversedMeanwhile):  # an operator's reversal of one of them came first: all undone
        return None
    if not posted:
        return None
    instance.disk_rate_base_seconds, instance.disk_rate_base_cost_micros = base
    return DiskGivenBack(amount_micros=sum(a for _, a, _ in back), fee_micros=sum(f for _, _, f in back),
                         seconds=seconds_back, start=cut, end=end, transactions=posted)


def _disk_rebase_after_give_back(instance: Instance, seconds: int) -> tuple[int, int]:
    """The disk meter's rate base (disk_rate_base_seconds, disk_rate_base_cost_micros) once its last `seconds`
    billed are given back: moved on by them, its cost by what they were charged, so that the next seconds cost
    cost(paid + s) - cost(paid) from the seconds paid for since the base (paid = disk_billed_seconds - base's
    seconds), where they cost cost(billed + s) - cost(billed) before; disk_cost_micros is still the base's cost
    plus the cumulative cost of the seconds billed after it (metering._rebase_after_give_back, for GPU time)."""
    base_seconds = min(instance.disk_rate_base_seconds + seconds, instance.disk_billed_seconds)
    return base_seconds, instance.disk_cost_micros - storage_cost(
        size_gb=instance.disk_gb, price_per_gb_month_micros=instance.disk_price_per_gb_month_micros,
        seconds=instance.disk_billed_seconds - base_seconds)


# The reason of each reversal a disk's give-back posts (what tells them from an operator's: tests/billing/invariants).
DISK_GIVE_BACK_REASON = ("Disk billed after the last sighting of a VM and disk found lost, given back "
                         "(storage.disk_give_back).")


class _ReversedMeanwhile(Exception):
    pass


def _charged(txn: LedgerTransaction) -> tuple[int, int]:
    """What a storage charge took from the renter's wallet, and the platform's fee of it."""
    moved = {e.account.kind: e.amount_micros for e in txn.entries.select_related("account")}
    return -moved.get(AccountKind.CUSTOMER_WALLET, 0), moved.get(AccountKind.PLATFORM_REVENUE, 0)


def _disk_reverse(instance: Instance, txn: LedgerTransaction, amount: int, fee: int, memo: str,
                  customer_note: str) -> int:
    """Reverse `amount` of a storage charge, `fee` of it the platform's, on the accounts the charge used."""
    accounts = {e.account.kind: e.account for e in txn.entries.select_related("account")}
    lines = [(accounts.get(AccountKind.CUSTOMER_WALLET)
              or user_account(user_id=instance.renter_id, kind=AccountKind.CUSTOMER_WALLET), amount)]
    if amount - fee:
        provider_id = Node.objects.values_list("provider_id", flat=True).get(pk=instance.node_id)
        lines.append((accounts.get(AccountKind.PROVIDER_EARNINGS)
                      or user_account(user_id=provider_id, kind=AccountKind.PROVIDER_EARNINGS), -(amount - fee)))
    if fee:
        lines.append((accounts.get(AccountKind.PLATFORM_REVENUE)
                      or platform_account(kind=AccountKind.PLATFORM_REVENUE), -fee))
    charged, _ = _charged(txn)
    whole = "" if amount == charged else f" ({amount} of its {charged} micro-dollars)"
    reversal, created = ledger_post(
        idempotency_key=f"reversal:{txn.pk}", kind=TransactionKind.REVERSAL, lines=lines, reverses=txn,
        memo=f"Reverses #{txn.pk}{whole}: {memo}", customer_note=customer_note,
        reason=DISK_GIVE_BACK_REASON)
    if not created:
        raise _ReversedMeanwhile(txn.pk)
    return reversal.pk


def storage_burn_per_hour() -> dict[int, int]:
    """Renter -> micro-dollars per hour of their available volumes and stopped instances' disks (rounded down):
    billing.selectors.storage_burn_per_hour, the rule the balance's API and page read too."""
    return selectors.storage_burn_per_hour()


@dataclass
class StorageMeterResult:
    volumes: int = 0
    disks: int = 0
    charged_micros: int = 0


def storage_billed_until(*, node_id: int, now: datetime) -> datetime:
    """Where a storage charge closed by a state change ends: GPU time's rule (node_billable_until): `now` while
    the node answers, or its last healthy moment while its latest health check failed (a disk or volume on a
    node that stopped answering is not billed for the outage; the meter stops there too, and an outage is never
    caught up: node_storage_outage_end). Before, it was the last health check even on a healthy node: each
    deletion, start or destroy of a stopped instance dropped up to a health interval of storage, which the
    provider lost."""
    return node_billable_until(node_id=node_id, now=now)


def node_storage_outage_end(*, node_id: int, now: datetime | None = None, unseen: bool = False) -> int:
    """The node answers again (its reconciler calls this first): when its health checks had failed long enough to
    be an outage (NODE_INTERRUPT_AFTER_FAILED_CHECKS in a row, as interrupts its instances), its available volumes
    and stopped instances' disks are billed up to its last healthy moment and not for the outage: their billing
    goes on from `now`. The meter caught the outage up before (found by review: a volume kept through a 3-hour
    outage was billed the 3 hours when the node came back, though the renter could not reach it). A shorter
    silence is left to the meter, which catches it up as it does GPU time. Returns how many were moved on.

    Both reconcilers call it: the periodic one when it reaches the node between two health checks, then the
    health check's own, before its answer is recorded (which ends the outage: health_failures back to 0). Billing
    moved on at an answer after the node's last check stays there, as GPU time resumed by that reconcile is billed
    from it: moved again, the time from the first answer to the health check's was never billed (found by
    test_storage_outage_sequence: up to a health interval, each outage the periodic reconciler saw end first). A
    check recorded since (one that failed again: the node flapped) moves it on again, as GPU time is interrupted
    again: that silence is an outage too. The node's last check is `Node.last_checked_at`
    (fleet_record.nodes_record_health writes it at every check, answered or failed).

    `unseen`: the platform did not check the node at all since its last healthy moment (it was quarantined: an
    operator accepted its new host key), which is an outage whatever its failed checks say.

    One short transaction each, the row locked (waiting for a meter or a change that holds it: both end quickly,
    and neither takes the node's row); never moves billing backwards, so a second call before the next check
    changes nothing."""
    now = now or timezone.now()
    row = Node.objects.filter(pk=node_id).values_list("last_seen_at", "health_failures", "last_checked_at").first()
    if row is None or row[0] is None or (row[1] < settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS and not unseen):
        return 0
    last_healthy, moved = min(row[0], now), 0
    # Billing moved on after this moment was moved at an answer since the node's last check: it stays.
    answered_after = max(last_healthy, row[2] or last_healthy)
    billed = (VolumeState.AVAILABLE, VolumeState.DELETING)
    for volume_id in (Volume.objects.filter(node_id=node_id, state__in=billed).order_by("pk")
                      .values_list("pk", flat=True)):
        with transaction.atomic():
            volume = Volume.objects.select_for_update().filter(pk=volume_id, state__in=billed).first()
            if volume is None or volume.available_at is None:
                continue
            # One being deleted is not charged (its billing stopped when the deletion was asked for) but moved on
            # too: if the node then refuses the deletion (volume_delete_refused: a VM there still mounts it), it is
            # billed again from this answer, not across the outage (found by review: 3 h 20 min billed for it). One
            # asked before the outage began loses the time from the request to the outage too (its provider's loss,
            # in the renter's favour: nothing on the row keeps where the outage began, and a refusal is rare).
            if volume.state == VolumeState.AVAILABLE:
                volume_storage_close(volume=volume, until=last_healthy)
            if _to_move_on(start=volume.available_at, billed_until=volume.billed_until, after=answered_after,
                           now=now):
                Volume.objects.filter(pk=volume.pk).update(billed_until=now)
                moved += 1
    for instance_id in (Instance.objects.filter(node_id=node_id, status=InstanceStatus.STOPPED,
                                                stopped_at__isnull=False).order_by("pk").values_list("pk", flat=True)):
        with transaction.atomic():
            instance = (Instance.objects.select_for_update(of=("self",))
                        .filter(pk=instance_id, status=InstanceStatus.STOPPED).first())
            if instance is None or instance.stopped_at is None:
                continue
            instance_disk_close(instance=instance, until=last_healthy)
            if _to_move_on(start=instance.stopped_at, billed_until=instance.disk_billed_until,
                           after=answered_after, now=now):
                Instance.objects.filter(pk=instance.pk).update(disk_billed_until=now)
                moved += 1
    if moved:
        log.info("storage: node %s answered after an outage from %s; %s volume(s) and disk(s) billed on from %s",
                 node_id, last_healthy, moved, now)
    return moved


def _to_move_on(*, start: datetime, billed_until: datetime | None, after: datetime, now: datetime) -> bool:
    """Whether storage billed from `start` up to `billed_until` is to be billed on from `now`: not when it is
    there already, nor when it was moved on at an answer `after` the node's last check (past its start: the close
    of an earlier stop, before this one began, is not a move)."""
    if max(billed_until or start, start) >= now:
        return False
    return not (billed_until is not None and billed_until > start and billed_until > after)


def storage_meter(*, now: datetime | None = None) -> StorageMeterResult:
    """The tick's storage part: every available volume and every stopped instance's disk, up to `now` (or the
    moment its node was last seen healthy), one short transaction each; rows locked elsewhere are skipped (the
    change that holds them bills them, or the next tick does)."""
    now = now or timezone.now()
    result = StorageMeterResult()
    seen = dict(Node.objects.filter(volumes__state=VolumeState.AVAILABLE).values_list("pk", "last_seen_at")
                .distinct())
    for volume_id in (Volume.objects.filter(state=VolumeState.AVAILABLE, price_per_gb_month_micros__gt=0)
                      .order_by("pk").values_list("pk", flat=True)):
        with transaction.atomic():
            volume = (Volume.objects.select_for_update(skip_locked=True)
                      .filter(pk=volume_id, state=VolumeState.AVAILABLE).first())
            if volume is None:
                continue
            result.volumes += 1
            last_seen = seen.get(volume.node_id) or now
            result.charged_micros += volume_storage_close(volume=volume, until=min(now, last_seen))
    stopped = (Instance.objects.filter(status=InstanceStatus.STOPPED, stopped_at__isnull=False,
                                       disk_price_per_gb_month_micros__gt=0).order_by("pk"))
    for instance_id, node_seen in stopped.values_list("pk", "node__last_seen_at"):
        with transaction.atomic():
            instance = (Instance.objects.select_for_update(skip_locked=True, of=("self",))
                        .filter(pk=instance_id, status=InstanceStatus.STOPPED).first())
            if instance is None:
                continue
            result.disks += 1
            result.charged_micros += instance_disk_close(instance=instance, until=min(now, node_seen or now))
    return result
