"""An operator turns an account off (deactivates it) or on again, and what that does to what it rents and lists.

Off (`account_deactivate`): its owner can no longer log in nor use an API key (the auth backend and
api_key_authenticate refuse an inactive account), and its sessions end for good (not back on reactivation; its API
keys are), so nobody could stop what it runs; the platform does:
- as a renter: its running instances are stopped as its own stop would (GPU billing ends at the stop; the disks stay,
  billed as storage as any stopped instance's, and so do its volumes: a mistaken deactivation loses no data); its
  bookings not running yet (requested, provisioning) are cancelled as its own destroy would (nothing was billed).
  An instance that comes to run later (a start or restart under way at that moment, an interruption that resumes, a
  stop that never reached its server) is stopped by the sweep (`accounts_deactivated_enforce`, beat every minute),
  as is everything of an account turned off some other way (a script setting `is_active`).
- as a provider: its nodes leave the offers and refuse new load, each with a 409 saying why: bookings, new volumes
  (models.nodes.offerable) and starting a renter's stopped instance (instances/lifecycle.py: its disk stays as it
  is); a booking and a start read the account under its row lock (instances/allocation.py). What renters run on
  them stays theirs, an interrupted one resuming too.
- its owner is told (notification `account_deactivated`, on every channel), with the operator's reason, and, when
  payouts matter to it (servers, earnings, a payout not sent), that its payouts are held until it is on again.
Its auto top-up setting is left as its owner set it (billing does not charge the card of an account that is off:
billing.services.top_ups; one pending then ends as not charged).
On again (`account_reactivate`): nothing restarts by itself, its nodes are offered again, its owner is told, and its
auto top-up is re-armed at once: a top-up starts if the balance is below the threshold (before, it waited for the
next tick, and up to an hour behind the top-up the deactivation had ended).

One transaction per step, as the instance verbs: the account's row, its record and the notice first, then each
instance on its own. Idempotent: an account already off is not turned off again (no record, no notice), and the pass
over its instances finds only what is still to do.
"""
import logging
from dataclasses import dataclass, field

from django.db import transaction
from django.db.models import F

from billing.models import Account, AccountKind, Payout, PayoutStatus
from billing.services.top_ups import auto_top_up_rearm
from core.errors import ApplicationError, ValidationFailed
from core.request_guard import has_control_character
from core.validators import CONTROL_CHARACTERS_MESSAGE
from marketplace.models import AccountStatusChange, Instance, InstanceStatus, Node, NodeState, User
from marketplace.services.instances import instance_destroy, instance_stop
from notifications.services.notify import Kind, notify

log = logging.getLogger(__name__)

S = InstanceStatus
REASON_MAX_LENGTH = 500
# Stopped by the pass while running; those in the other states of this list are stopped once they run again.
TO_STOP = (S.RUNNING, S.STARTING, S.STOPPING, S.INTERRUPTED)
# Bookings not running yet: cancelled (destroyed: its VM, if any, had nothing of the renter's yet).
TO_CANCEL = (S.REQUESTED, S.PROVISIONING)
# What the pass acts on now.
HALTED_NOW = (S.RUNNING, *TO_CANCEL)


@dataclass
class Halted:
    """What a pass over a deactivated account's instances did: instance ids."""

    stopped: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)

    def __iadd__(self, other: "Halted") -> "Halted":
        self.stopped += other.stopped
        self.cancelled += other.cancelled
        return self


def status_reason_clean(reason: str) -> str:
    """The reason as it is recorded and told; ValidationFailed (on `reason`) when too long or with a control
    character."""
    reason = reason.strip()
    if len(reason) > REASON_MAX_LENGTH:
        raise ValidationFailed(f"A reason has at most {REASON_MAX_LENGTH} characters.", field="reason")
    if has_control_character(reason):
        raise ValidationFailed(CONTROL_CHARACTERS_MESSAGE, field="reason")
    return reason


def account_deactivate(*, user: User, by: User | None = None, reason: str = "") -> AccountStatusChange | None:
    """Turn the account off (`by`: the operator; `reason` is told to its owner), then stop its running instances
    and cancel its bookings not running yet (after the caller's transaction commits, each in its own). The record,
    or None when the account was off already (its instances are passed over all the same: what an interrupted
    pass left is done now). Its earnings are not paid out while it is off (billing.services.payouts: no payout made,
    one pending held). ValidationFailed for an operator's own account, or a reason too long."""
    reason = status_reason_clean(reason)
    if by is not None and by.pk == user.pk:
        raise ValidationFailed("An operator cannot deactivate their own account; another operator can.",
                               field="is_active")
    change = None
    with transaction.atomic():
        # FOR UPDATE: waits for the bookings in flight on its nodes (they hold this row's key-share lock), and
        # those after see the account off.
        locked = User.objects.select_for_update().get(pk=user.pk)
        if locked.is_active:
            # Every session ends for good (sessions_epoch: models.accounts.User): a cookie from before, perhaps
            # the stolen one this is for, does not work again after a reactivation. API keys are kept (the
            # reactivation notice says they work again): they are refused while the account is off.
            User.objects.filter(pk=user.pk).update(is_active=False, sessions_epoch=F("sessions_epoch") + 1)
            user.sessions_epoch = locked.sessions_epoch + 1  # read under the lock: the caller's object as stored
            change = AccountStatusChange.objects.create(user=locked, active=False, by=by, reason=reason)
            _tell_deactivated(locked, change)
    user.is_active = False
    # After the commit: the instances' locks and ledger postings are not held with the account's row (nor inside an
    # admin request's transaction); robust: a failure is logged, and the sweep finishes within a minute.
    transaction.on_commit(lambda: renter_instances_halt(user_id=user.pk), robust=True)
    return change


def account_reactivate(*, user: User, by: User | None = None, reason: str = "") -> AccountStatusChange | None:
    """Turn the account on again: its owner logs in again, its nodes are offered again, its payouts resume (a held
    one with the next follow-up, new earnings with the next weekly run); nothing of its own is started. The record,
    or None when it was on already."""
    reason = status_reason_clean(reason)
    with transaction.atomic():
        locked = User.objects.select_for_update().get(pk=user.pk)
        if locked.is_active:
            return None
        User.objects.filter(pk=user.pk).update(is_active=True)
        change = AccountStatusChange.objects.create(user=locked, active=True, by=by, reason=reason)
        stopped = list(Instance.objects.filter(renter=locked, status=S.STOPPED).order_by("pk")
                       .values_list("pk", flat=True))
        message = " ".join(filter(None, [
            "Your account is active again" + (f": {reason}" if reason else "") + ".",
            "You can log in and use your API keys again.",
            f"Your stopped instances ({_ids(stopped)}) stay stopped: start them when you need them." if stopped
            else "",
            "Your servers take new rentals again." if _has_nodes(locked) else "",
            _payouts_resumed(locked)]))
        notify(user=locked, kind=Kind.ACCOUNT_REACTIVATED, dedupe_key=f"account_status:{change.pk}",
               payload={"message": message, "reason": reason})
    user.is_active = True
    # After the commit, in its own transaction (the profile's lock is not taken with the account's row): the
    # account's auto top-up, on as its owner left it, starts now if the balance is below its threshold.
    transaction.on_commit(lambda: auto_top_up_rearm(user_id=user.pk), robust=True)
    return change


def renter_instances_halt(*, user_id: int) -> Halted:
    """Stop the running instances and cancel the bookings not running yet of an account that is off (nothing for
    one that is on), each in its own transaction under its row lock. A refusal (the instance moved meanwhile, a job
    still open) is logged and left to the next sweep."""
    halted = Halted()
    ids = (Instance.objects.filter(renter_id=user_id, status__in=HALTED_NOW).order_by("pk")
           .values_list("pk", flat=True))
    for instance_id in ids:
        try:
            _halt(instance_id, halted)
        except ApplicationError as exc:
            log.info("instance %s of deactivated account %s not stopped now: %s", instance_id, user_id, exc)
    return halted


def _halt(instance_id: int, halted: Halted) -> None:
    with transaction.atomic():
        instance = Instance.objects.select_for_update().filter(pk=instance_id).first()
        # Read now, in this step: an account turned on again meanwhile keeps what it runs.
        if instance is None or User.objects.filter(pk=instance.renter_id, is_active=True).exists():
            return
        if instance.status == S.RUNNING:
            instance_stop(instance=instance)
            halted.stopped.append(instance.pk)
        elif instance.status in TO_CANCEL:
            instance_destroy(instance=instance)
            halted.cancelled.append(instance.pk)


def accounts_deactivated_enforce() -> Halted:
    """The sweep (beat, every minute): halt what deactivated accounts run now. Instances that came to run after
    their account's pass, and every instance of an account turned off without account_deactivate."""
    renters = (Instance.objects.filter(status__in=HALTED_NOW, renter__is_active=False).order_by()
               .values_list("renter_id", flat=True).distinct())
    halted = Halted()
    for renter_id in sorted(renters):
        halted += renter_instances_halt(user_id=renter_id)
    return halted


def _tell_deactivated(user: User, change: AccountStatusChange) -> None:
    """The notice, written with the record: what is stopped, cancelled and kept, as the pass will leave it."""
    mine = Instance.objects.filter(renter=user).order_by("pk")
    stopping = list(mine.filter(status__in=TO_STOP).values_list("pk", flat=True))
    cancelled = list(mine.filter(status__in=TO_CANCEL).values_list("pk", flat=True))
    reason = change.reason
    message = " ".join(filter(None, [
        "Your account was deactivated by the platform's operators" + (f": {reason}" if reason else "") + ".",
        "You can no longer log in or use your API keys.",
        f"Your running instances ({_ids(stopping)}) are being stopped: their disks are kept (billed as storage, as "
        "any stopped instance's), and so are your volumes." if stopping else "",
        f"Your bookings not running yet ({_ids(cancelled)}) are cancelled; nothing was charged for them."
        if cancelled else "",
        "Your servers take no new rentals; the instances renters have on them keep running." if _has_nodes(user)
        else "",
        "Your earnings are not paid out while your account is deactivated: they stay yours, and a payout not sent "
        "yet is held; payouts go out again after it is reactivated." if _earns(user) else "",
        "Write to the platform's operators to ask about it."]))
    notify(user=user, kind=Kind.ACCOUNT_DEACTIVATED, dedupe_key=f"account_status:{change.pk}",
           payload={"message": message, "reason": reason, "instances_stopped": stopping,
                    "bookings_cancelled": cancelled})


def _earns(user: User) -> bool:
    """Whether payouts matter to the account: servers that earn (renters' instances on them keep running), earnings
    not paid out, or a payout not sent yet (billing.services.payouts holds those of an account that is off)."""
    return (_has_nodes(user)
            or Account.objects.filter(user=user, kind=AccountKind.PROVIDER_EARNINGS, balance_micros__gt=0).exists()
            or Payout.objects.filter(provider=user, status=PayoutStatus.PENDING).exists())


def _payouts_resumed(user: User) -> str:
    """The reactivation notice's word on payouts (billing.services.payouts): a held one is sent by the next
    follow-up, what has accrued goes with the weekly runs."""
    if not _earns(user):
        return ""
    held = Payout.objects.filter(provider=user, status=PayoutStatus.PENDING).exists()
    return ("Your payouts resume: " + ("the payout held while your account was off is sent within minutes, and "
                                       if held else "") + "your earnings are paid out with the weekly payouts again.")


def _has_nodes(user: User) -> bool:
    return Node.objects.filter(provider=user).exclude(state=NodeState.RETIRED).exists()


def _ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids))
