"""Low and empty balances, acted on after every meter tick.

- Low: when a renter's balance covers less than BILLING_LOW_BALANCE_WARNING_S of their running instances,
  they get a `low_balance` event and an email, once per crossing (again only after the balance has
  recovered above the threshold, or nothing ran, in between).
- Empty (balance ≤ 0): their running instances are stopped (disk kept; billing ends at the stop) in the
  same tick, with a `balance_depleted` event and email. The balance can dip below zero by at most one
  tick of usage; that is owed, and the next top-up settles it. Not before a cost rise's notice ends:
  a price raise, or an interrupted instance's resume, that found the balance low warned then, and its renter
  keeps running until BILLING_LOW_BALANCE_WARNING_S after it (billing.services.low_balance), owing what runs
  meanwhile.
- Grace: stopped instances of a renter whose balance stays at or below zero are destroyed
  BILLING_GRACE_PERIOD_S after it reached zero, with a `destroy_warning` event and email
  BILLING_DESTROY_WARNING_S before; so are their failed instances whose VM, kept on the node, mounts one of their
  volumes, and those volumes are deleted (storage is billed while it exists) with every other of theirs that no
  instance holds past the deadline (_doomed): the warning names each one, those that these instances mount
  included. Only what a warning named is destroyed, at the time it named: what becomes doomed after the warning
  is due (an instance stopped or failed later, a volume that came later) gets its own full grace period and its own
  warning (_grace). A top-up that brings the balance above zero ends all of it.
- Storage counts: the burn rate the low-balance warning uses includes the renter's volumes and their stopped
  instances' disks (billing.services.storage), and a balance taken to zero by storage alone starts the grace
  period all the same.
- Auto top-up: renters who turned it on and are below their threshold get a top-up started; not those whose account
  an operator deactivated (billing.services.top_ups).
"""
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Prefetch, Sum
from django.utils import timezone

from billing.models import Account, AccountKind, BillingProfile, EventKind
from billing.services.ledger import wallet_balance
from billing.services.low_balance import billing_profile_lock, low_balance_warn, stop_notice_holds
from billing.services.notify import event_create
from billing.services.storage import storage_burn_per_hour
from billing.services.top_ups import auto_top_up_start
from core.errors import ApplicationError
from marketplace.models import Instance, InstanceStatus, User, Volume, VolumeMount, VolumeState
from marketplace.selectors import instances_awaiting_cleanup_by_node
from marketplace.services.instances import instance_destroy, instance_stop
from marketplace.services.volumes import volume_delete, volume_holder_ids

log = logging.getLogger(__name__)


@dataclass
class EnforceResult:
    warned: int = 0
    depleted: int = 0
    stopped: int = 0
    destroy_warned: int = 0
    destroyed: int = 0
    auto_top_ups: int = 0


def balances_enforce(*, now: datetime | None = None) -> EnforceResult:
    now = now or timezone.now()
    result = EnforceResult()
    burn = dict(  # renter -> micro-dollars per hour of their running instances
        Instance.objects.filter(status=InstanceStatus.RUNNING).order_by().values("renter_id")
        .annotate(rate=Sum("price_per_hour_micros")).values_list("renter_id", "rate")
    )
    storage = storage_burn_per_hour()  # renter -> micro-dollars per hour of their volumes and stopped disks
    with_stopped = set(Instance.objects.filter(status=InstanceStatus.STOPPED).order_by()
                       .values_list("renter_id", flat=True).distinct()) | set(storage)
    flagged = set(BillingProfile.objects.exclude(low_balance_warned_at=None, depleted_at=None, stop_not_before=None)
                  .values_list("user_id", flat=True))
    renters = set(burn) | with_stopped | flagged
    balances = dict(Account.objects.filter(kind=AccountKind.CUSTOMER_WALLET, user_id__in=renters)
                    .values_list("user_id", "balance_micros"))
    profiles = {p.user_id: p for p in BillingProfile.objects.filter(user_id__in=renters)}

    for renter_id in sorted(renters):
        balance = balances.get(renter_id, 0)
        profile = profiles.get(renter_id)
        warned = profile is not None and profile.low_balance_warned_at is not None
        gpu_rate = burn.get(renter_id)
        rate = (gpu_rate or 0) + storage.get(renter_id, 0)
        if gpu_rate and balance <= 0:
            stopped = _deplete(renter_id, now)
            result.stopped += stopped
            result.depleted += stopped > 0
            continue
        if rate and balance * 3600 // rate < settings.BILLING_LOW_BALANCE_WARNING_S:
            if not warned:
                result.warned += low_balance_warn(renter_id=renter_id, balance=balance, rate=rate,
                                                  remaining=max(balance, 0) * 3600 // rate, now=now)
        elif warned and profile is not None:  # recovered, or nothing runs: the next low balance is a new crossing
            BillingProfile.objects.filter(pk=profile.pk).update(low_balance_warned_at=None)
        if balance > 0 and profile is not None and profile.stop_not_before is not None and not (
                rate and balance * 3600 // rate < settings.BILLING_LOW_BALANCE_WARNING_S):
            # Recovered (not merely nothing running, at zero): a later cost rise may give a new notice
            # (low_balance.balance_recheck_on_cost_rise gives one per low balance).
            BillingProfile.objects.filter(pk=profile.pk).update(stop_not_before=None)
        if balance > 0:
            if profile is not None and profile.depleted_at is not None:
                BillingProfile.objects.filter(pk=profile.pk).update(depleted_at=None, destroy_warned_at=None,
                                                                    destroy_deadlines={})
        elif renter_id in with_stopped:
            warned_now, destroyed_now = _grace(renter_id, now)
            result.destroy_warned += warned_now
            result.destroyed += destroyed_now
        elif profile is not None and profile.destroy_deadlines:
            # Nothing left to destroy (the renter deleted what was named): no deadline is shown for it any more.
            BillingProfile.objects.filter(pk=profile.pk).update(destroy_deadlines={})

    # Not for a deactivated account: its owner can no longer log in to turn auto top-up off, and storage stays billed,
    # so each tick would charge their card again (auto_top_up_start checks it too, under the profile's lock).
    for user_id in (BillingProfile.objects.filter(auto_top_up_enabled=True, user__is_active=True)
                    .values_list("user_id", flat=True)):
        if auto_top_up_start(user_id=user_id) is not None:
            result.auto_top_ups += 1
    return result


def _deplete(renter_id: int, now: datetime) -> int:
    """Stop the renter's running instances (their balance is at or below zero); how many were stopped. None while
    a cost rise's notice holds (a raise, a resume: billing.services.low_balance)."""
    with transaction.atomic():
        profile = billing_profile_lock(user_id=renter_id)
        if wallet_balance(user_id=renter_id) > 0:  # topped up meanwhile
            return 0
        if stop_notice_holds(profile=profile, now=now):  # warned at the rise; stopped no sooner than it said
            return 0
        stopped = []
        for instance in Instance.objects.filter(renter_id=renter_id, status=InstanceStatus.RUNNING).order_by("pk"):
            try:
                instance_stop(instance=instance)
                stopped.append(instance.pk)
            except ApplicationError as exc:  # it changed state meanwhile
                log.info("could not stop instance %s at zero balance: %s", instance.pk, exc)
        newly = profile.depleted_at is None
        if newly:
            profile.depleted_at = now
            profile.destroy_warned_at = None
            profile.destroy_deadlines = {}
            profile.save(update_fields=["depleted_at", "destroy_warned_at", "destroy_deadlines"])
        if stopped:
            assert profile.depleted_at is not None  # set above if it was not
            destroy_at = profile.depleted_at + timedelta(seconds=settings.BILLING_GRACE_PERIOD_S)
            event_create(
                user=User.objects.get(pk=renter_id), kind=EventKind.BALANCE_DEPLETED, email=True,
                message=(f"Your balance reached zero, so your running instances ({', '.join(map(str, stopped))}) "
                         f"were stopped. Their disks are kept (and billed as storage) until "
                         f"{destroy_at:%Y-%m-%d %H:%M} UTC; after that they are destroyed unless you top up."),
                data={"instances": stopped, "destroy_at": destroy_at.isoformat()},
            )
    return len(stopped)


def _doomed(renter_id: int) -> tuple[list[Instance], list[Volume], dict[int, list[int]]]:
    """What the grace period ends for a renter at zero: the instances it destroys, and the volumes it deletes (with
    the instances that hold each one now: volume_holder_ids, the rule of volume_delete's refusal).

    The instances: their stopped ones (disks billed), and their failed ones that hold one of their volumes (their VM
    kept on the node, mounting it: only a destroy removes it). The volumes: those that nothing holds once these
    instances are destroyed (none holds them, or only these, or instances already on their way out: destroying, or
    destroyed with their VM still to be removed). Before, a failed instance was never destroyed, so its volume's
    deletion was refused at every tick and the volume billed for ever past the deadline; and a volume a stopped
    instance mounted was left out of the warning, yet deleted the tick after that instance was destroyed (both
    found by review)."""
    stopped = list(Instance.objects.filter(renter_id=renter_id, status=InstanceStatus.STOPPED).order_by("pk"))
    volumes = list(Volume.objects.filter(owner_id=renter_id, state=VolumeState.AVAILABLE).order_by("pk")
                   .prefetch_related(Prefetch("mounts", queryset=VolumeMount.objects.select_related("instance"))))
    awaiting = instances_awaiting_cleanup_by_node(node_ids={v.node_id for v in volumes}) if volumes else {}
    holders = {v.pk: volume_holder_ids(v, awaiting_cleanup=awaiting) for v in volumes}
    mounted = {m.instance_id: m.instance for v in volumes for m in v.mounts.all()}
    failed = [mounted[i] for i in sorted({i for ids in holders.values() for i in ids})
              if mounted[i].status == InstanceStatus.FAILED]
    leaving = (InstanceStatus.DESTROYING, InstanceStatus.DESTROYED)
    ending = {i.pk for i in stopped + failed} | {i for i, instance in mounted.items() if instance.status in leaving}
    doomed = [v for v in volumes if set(holders[v.pk]) <= ending]
    return sorted(stopped + failed, key=lambda i: i.pk), doomed, {v.pk: holders[v.pk] for v in doomed}


def _listed(things: list[str]) -> str:
    return ", ".join(things) or "none"


def _key(thing: Instance | Volume) -> str:
    return f"{'instance' if isinstance(thing, Instance) else 'volume'}:{thing.pk}"


def _grace(renter_id: int, now: datetime) -> tuple[bool, bool]:
    """For a renter at zero with stopped instances or storage: warn before the grace period ends, destroy after it.
    (warned, destroyed).

    Each thing _doomed finds gets its time in profile.destroy_deadlines when first found: the end of the grace period
    that began at zero if found before that period's warning went out (and before its end), else its own full grace
    period from now (an instance stopped, or failed, after the warning; a volume that came later). It is destroyed
    only once a warning named it with its time and that time passed, and each warning comes at least
    BILLING_DESTROY_WARNING_S before the time it names (that time later if a tick came late). Before, whatever
    _doomed found at the deadline was destroyed, though no warning had named what became doomed after it (found by
    review), and a deadline reached with no warning sent (no tick in time) destroyed everything unwarned."""
    with transaction.atomic():
        profile, _ = BillingProfile.objects.get_or_create(user_id=renter_id)
        profile = BillingProfile.objects.select_for_update().get(pk=profile.pk)
        if wallet_balance(user_id=renter_id) > 0:
            return False, False
        if profile.depleted_at is None:
            profile.depleted_at = now
            profile.save(update_fields=["depleted_at"])
        grace = timedelta(seconds=settings.BILLING_GRACE_PERIOD_S)
        notice = timedelta(seconds=settings.BILLING_DESTROY_WARNING_S)
        deadline = profile.depleted_at + grace
        instances, volumes, holders = _doomed(renter_id)
        doomed: dict[str, Instance | Volume] = {_key(i): i for i in instances} | {_key(v): v for v in volumes}
        # Only what is still doomed keeps its time (the renter destroyed it, or it was destroyed at its time): the
        # balance API and page show this record, and a stale entry said a gone thing was still to be destroyed.
        record: dict[str, dict[str, Any]] = {key: value for key, value in (profile.destroy_deadlines or {}).items()
                                             if key in doomed}
        # Asked at its time (`asked`) and doomed still: its server refused (volume_delete_refused: a VM there still
        # mounts the volume, and its renter was told it is billed again). It gets its own full grace period and a
        # new warning, as one doomed after the warning does. Before, the entry stayed warned and past its time: the
        # deletion was asked again at every tick (60 s), each time e-mailing "your volumes were deleted", billing a
        # minute and sending the node a new delete job, for as long as the node refused (found by review r53).
        for key in [key for key, value in record.items() if value.get("asked")]:
            del record[key]
        for key in sorted(doomed.keys() - record.keys()):
            at = deadline if profile.destroy_warned_at is None and now < deadline else now + grace
            record[key] = {"at": at.isoformat(), "warned": False}
        due = {key for key in doomed if record[key]["warned"] and now >= datetime.fromisoformat(record[key]["at"])}
        warn = [key for key in doomed if not record[key]["warned"]
                and now >= datetime.fromisoformat(record[key]["at"]) - notice]
        user = User.objects.get(pk=renter_id) if due or warn else None
        destroyed = False
        if due:
            assert user is not None
            asked = _destroy(user, [i for i in instances if _key(i) in due],
                             [v for v in volumes if _key(v) in due], holders)
            destroyed = bool(asked)
            for key in asked:  # kept while it is doomed still, which says its deletion was refused (above)
                record[key] = {**record[key], "asked": now.isoformat()}
        if warn:
            assert user is not None
            # One time for all this warning names: none sooner than its own, none sooner than the notice allows.
            at = max([datetime.fromisoformat(record[key]["at"]) for key in warn] + [now + notice])
            for key in warn:
                record[key] = {"at": at.isoformat(), "warned": True}
            if profile.destroy_warned_at is None:
                profile.destroy_warned_at = now
            _warn(user, [i for i in instances if _key(i) in warn], [v for v in volumes if _key(v) in warn],
                  holders, at)
        if record != profile.destroy_deadlines:
            profile.destroy_deadlines = record
            profile.save(update_fields=["destroy_deadlines", "destroy_warned_at"])
    return bool(warn), destroyed


def _warn(user: User, instances: list[Instance], volumes: list[Volume], holders: dict[int, list[int]],
          at: datetime) -> None:
    """The destroy warning: each thing it names is destroyed at `at` (and nothing that it does not name)."""
    stopped = [str(i.pk) for i in instances if i.status == InstanceStatus.STOPPED]
    failed = [str(i.pk) for i in instances if i.status != InstanceStatus.STOPPED]
    named = [v.name + (f" (mounted by instance {', '.join(map(str, holders[v.pk]))})" if holders[v.pk] else "")
             for v in volumes]
    parts = ([f"your stopped instances ({_listed(stopped)}), with their disks"] if stopped else []) + (
        [f"your failed instances whose VM still mounts a volume ({_listed(failed)})"] if failed else []) + (
        [f"your volumes ({_listed(named)})"] if named else [])
    event_create(user=user, kind=EventKind.DESTROY_WARNING, email=True,
                 message=(f"Your balance is at zero. Unless you top up before, these are destroyed at "
                          f"{at:%Y-%m-%d %H:%M} UTC: {'; '.join(parts)}."),
                 data={"instances": [i.pk for i in instances], "volumes": [v.pk for v in volumes],
                       "destroy_at": at.isoformat()})


def _destroy(user: User, instances: list[Instance], volumes: list[Volume],
             holders: dict[int, list[int]]) -> list[str]:
    """Destroy what a warning named whose time passed, and tell the renter what was; the keys (_key) of what was
    asked to go. A volume's deletion is the node's to confirm (it may refuse: volume_delete_refused tells the renter
    then), so it is told as asked, billing stopped, not as done."""
    destroyed: list[tuple[int, bool]] = []  # (id, whether it was stopped rather than failed)
    for instance in instances:
        was_stopped = instance.status == InstanceStatus.STOPPED
        try:
            instance_destroy(instance=instance)
            destroyed.append((instance.pk, was_stopped))
        except ApplicationError as exc:
            log.info("could not destroy instance %s after the grace period: %s", instance.pk, exc)
    deleted: list[str] = []
    deleted_keys: list[str] = []
    for volume in volumes:
        if holders[volume.pk]:  # deleted at a later tick, once the instances that hold it are gone from the node
            continue
        try:
            volume_delete(volume=volume, confirm=volume.name)
            deleted.append(volume.name)
            deleted_keys.append(_key(volume))
        except ApplicationError as exc:
            log.info("could not delete volume %s after the grace period: %s", volume.pk, exc)
    if not destroyed and not deleted:
        return []
    stopped = [str(pk) for pk, was_stopped in destroyed if was_stopped]
    failed = [str(pk) for pk, was_stopped in destroyed if not was_stopped]
    parts = ([f"your stopped instances ({_listed(stopped)}) were destroyed with their disks"] if stopped else []) + (
        [f"your failed instances that held a volume ({_listed(failed)}) were destroyed"] if failed else []) + (
        [f"your volumes ({_listed(deleted)}) are being deleted on their servers (no longer billed)"]
        if deleted else [])
    event_create(user=user, kind=EventKind.INSTANCES_DESTROYED, email=True,
                 message=(f"Your balance stayed at zero past the time the destroy warning gave, so "
                          f"{'; '.join(parts)}."),
                 data={"instances": [pk for pk, _ in destroyed], "volumes": deleted})
    return [f"instance:{pk}" for pk, _ in destroyed] + deleted_keys
