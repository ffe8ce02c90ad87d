"""The low-balance warning, and the notice it gives before a stop at zero when a renter's cost per second went up
without a funds check and left the balance low.

- The warning (`low_balance_warn`): a `low_balance` event and notification saying how long the balance lasts at
  the renter's burn rate and what happens at zero. billing.services.enforcement sends it after a meter tick, once
  per crossing of BILLING_LOW_BALANCE_WARNING_S.
- A cost that rises without a funds check (`balance_recheck_on_cost_rise`) can make a balance low, or find it at
  zero, at once, with nothing warned before (at $0/h, or while not billed, nothing burned):
  - a raise: a re-check that raises the price of a running instance (or of one that will run without another
    funds check: starting, provisioning): marketplace.services.instances.pricing (found by review: the next tick
    stopped a renter who had done nothing wrong, with no warning);
  - a resume: an interrupted instance (not billed while its node or GPU was lost) that runs again, or is started
    again by the platform: marketplace.services.instances.interruptions (found the same way: a balance that went
    to zero meanwhile, by other instances or storage, stopped it at the next tick; at zero, with nothing else of
    theirs running, nothing had warned).
  Each re-reads the balance against the new burn rate; when it is low, the renter is warned then (again, with the
  new figures, if warned before) and their running instances are not stopped at zero before
  BILLING_LOW_BALANCE_WARNING_S after it (`stop_not_before`): the notice the ordinary warning gives. What runs
  meanwhile is billed as always and owed if the balance goes below zero; a later rise within that notice keeps
  its deadline. One notice per low balance (found by review: an interruption spanning each deadline renewed it,
  and an instance ran hour after hour at zero; a renter stopped at zero was given an hour more): none after a stop
  at zero or a notice run out, until the balance recovers (enforcement then clears both). An ordinary low balance
  is untouched. The deadline is shown while it holds: the balance's API and
  page (billing.selectors), and the operators' BillingProfile admin.
"""
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from billing import selectors
from billing.models import BillingProfile, EventKind
from billing.services.ledger import wallet_balance
from billing.services.notify import event_create
from marketplace.models import User
from marketplace.money import micros_to_usd, usd_rate_text, usd_text
from notifications.services.notify import Kind, notify

# What made the cost rise, said in the warning before "so they are not stopped before ...".
RAISED = "An instance's price was raised just now"


def resumed_text(*, instance_id: int, running: bool) -> str:
    """A resume's `why`: the interrupted instance runs again, or is being started again (billed once it runs)."""
    return (f"Instance {instance_id} runs again after an interruption just now" if running else
            f"Instance {instance_id} is being started again after an interruption (billed once it runs)")


def _at(moment: datetime) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


def duration_text(seconds: int) -> str:
    if seconds >= 2 * 86400:
        return f"{seconds // 86400} days"
    if seconds >= 2 * 3600:
        return f"{seconds // 3600} hours"
    if seconds >= 120:
        return f"{seconds // 60} minutes"
    return f"{max(seconds, 0)} seconds"


def billing_profile_lock(*, user_id: int) -> BillingProfile:
    """The user's billing profile (created if missing), locked FOR UPDATE until the transaction ends. Taken before
    the user's instances (enforcement stops them under it; a raise or a resume takes it before the instance's)."""
    profile, _ = BillingProfile.objects.get_or_create(user_id=user_id)
    return BillingProfile.objects.select_for_update().get(pk=profile.pk)


def low_balance_warn(*, renter_id: int, balance: int, rate: int, remaining: int, now: datetime,
                     again: bool = False, stop_not_before: datetime | None = None, why: str = RAISED) -> int:
    """Warn the renter that `balance` lasts `remaining` seconds at `rate` micro-dollars an hour: 1 when warned, 0
    when they had been (since the last crossing) and not `again`. `stop_not_before`: a cost rise's notice, said
    after `why` (what rose: RAISED, or resumed_text)."""
    with transaction.atomic():
        profile = billing_profile_lock(user_id=renter_id)
        if profile.low_balance_warned_at is not None and not again:
            return 0
        profile.low_balance_warned_at = now
        profile.save(update_fields=["low_balance_warned_at"])
        user = User.objects.get(pk=renter_id)
        # What happens at zero, said for what the renter has: a renter billed for storage alone runs nothing.
        grace = duration_text(settings.BILLING_GRACE_PERIOD_S)
        message = (f"Your balance is {usd_text(balance)}: about {duration_text(remaining)} of your running "
                   f"instances and storage ({usd_rate_text(rate)} per hour). At zero running instances are stopped, "
                   f"and {grace} later stopped instances and volumes are deleted; top up to keep them.")
        data: dict[str, str | int] = {"balance": str(micros_to_usd(balance)), "per_hour": str(micros_to_usd(rate)),
                                      "seconds_left": remaining}
        if stop_not_before is not None:
            message += f" {why}, so they are not stopped before {_at(stop_not_before)}."
            data["stop_not_before"] = stop_not_before.isoformat()
        # The e-mail goes out through notifications, on the channels the renter chose.
        event_create(user=user, kind=EventKind.LOW_BALANCE, message=message, data=data)
        notify(user=user, kind=Kind.LOW_BALANCE, payload={**data, "message": message},
               dedupe_key=f"low_balance:{renter_id}:{now.isoformat()}")
    return 1


@dataclass(frozen=True)
class LowBalanceNotice:
    """A renter's balance found low by a cost rise: the figures, and the stop's earliest moment."""

    balance_micros: int
    rate_micros: int  # per hour: running instances, storage, and the instance whose cost rose if not running yet
    seconds_left: int
    stop_not_before: datetime | None  # None: this low balance had its notice (or its stop at zero) already

    def as_data(self) -> dict[str, str | None]:
        """What the rise's own event adds to its data."""
        return {"balance": str(micros_to_usd(self.balance_micros)),
                "stop_not_before": self.stop_not_before.isoformat() if self.stop_not_before else None}

    def note(self) -> str:
        """What the rise's own message adds: the figures, and until when nothing stops."""
        rate = f"{usd_rate_text(self.rate_micros)}/h for your instances and storage"
        if self.stop_not_before is None:
            if self.balance_micros <= 0:
                return (f" Your balance is {usd_text(self.balance_micros)}, which does not cover the {rate}: top up "
                        "now. While it is at zero your running instances are stopped (this low balance had its "
                        "notice already).")
            return (f" Your balance, {usd_text(self.balance_micros)}, lasts about {duration_text(self.seconds_left)} "
                    f"at {rate}: top up to keep your instances running; at zero they are stopped.")
        until = _at(self.stop_not_before)
        if self.balance_micros <= 0:
            return (f" Your balance is {usd_text(self.balance_micros)}, which does not cover the {rate}: top up "
                    f"before {until}. Until then your instances keep running (what they use is owed); after it, "
                    f"they are stopped while the balance is at zero.")
        return (f" Your balance, {usd_text(self.balance_micros)}, lasts about {duration_text(self.seconds_left)} at "
                f"{rate}: top up to keep your instances running. Should it reach zero, they are not stopped before "
                f"{until}.")


def balance_recheck_on_cost_rise(*, renter_id: int, now: datetime, pending_micros: int = 0,
                                 why: str = RAISED) -> LowBalanceNotice | None:
    """After the renter's cost per second rose without a funds check (committed with it: a raise, a resume): their
    balance against their burn rate now, as enforcement counts it, plus `pending_micros` an hour (the instance's
    price when it is not running yet). None when the balance is not low. When it is: warn now (saying `why`) and
    keep their running instances from a stop at zero until BILLING_LOW_BALANCE_WARNING_S from now (an earlier
    rise's deadline, still ahead, is kept, and not warned again), once per low balance: none for a renter stopped at
    zero already, or whose notice ran out with no recovery since (then `stop_not_before` is None: the note says so).
    Call it under the renter's billing profile lock taken before the instance's (billing_profile_lock)."""
    user = User.objects.get(pk=renter_id)
    rate = selectors.burn_rate(user=user).total_micros + pending_micros
    balance = wallet_balance(user_id=renter_id)
    left = selectors.seconds_left(balance_micros=balance, rate_micros=rate)
    if left is None or left >= settings.BILLING_LOW_BALANCE_WARNING_S:
        return None
    profile = billing_profile_lock(user_id=renter_id)
    if stop_notice_holds(profile=profile, now=now):  # an earlier rise's notice, still ahead: kept
        return LowBalanceNotice(balance_micros=balance, rate_micros=rate, seconds_left=left,
                                stop_not_before=profile.stop_not_before)
    if profile.depleted_at is not None or profile.stop_not_before is not None:
        # One notice per low balance (found by review): a renter stopped at zero already, or whose notice has run
        # out with no recovery since (enforcement clears both when the balance recovers), gets none again: else an
        # interruption spanning each deadline renewed it, and an instance ran hour after hour at zero.
        return LowBalanceNotice(balance_micros=balance, rate_micros=rate, seconds_left=left, stop_not_before=None)
    profile.stop_not_before = now + timedelta(seconds=settings.BILLING_LOW_BALANCE_WARNING_S)
    profile.save(update_fields=["stop_not_before"])
    low_balance_warn(renter_id=renter_id, balance=balance, rate=rate, remaining=left, now=now, again=True,
                     stop_not_before=profile.stop_not_before, why=why)
    return LowBalanceNotice(balance_micros=balance, rate_micros=rate, seconds_left=left,
                            stop_not_before=profile.stop_not_before)


def stop_notice_holds(*, profile: BillingProfile, now: datetime) -> bool:
    """Whether a cost rise's notice still keeps the renter's running instances from a stop at zero."""
    return selectors.stop_notice_until(stop_not_before=profile.stop_not_before, now=now) is not None
