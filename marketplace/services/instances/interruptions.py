"""Interruptions: the platform lost a running instance's node or VM, through no fault of the renter. (Price cuts,
when a re-verification finds a rented node's hardware worse, are pricing.py's.)

One rule, applied here for every cause (health checks failing, the node quarantined because its host key changed,
the VM found gone or not running by a health check or by the reconciler, a GPU it holds gone from the node's
nvidia-smi: provisioning.services.gpu_presence):
- the instance moves to `interrupted` at once, and its billing is closed at the last moment its node was
  seen healthy (`since`), never at the moment the loss was noticed;
- the renter gets an event (API and email) at once, and a service credit by the published rule
  (billing.services.credits), charged to the provider, topped up until the interruption ends;
- a VM (or card) found lost whose instance is no longer running when the interruption comes, its billing closed
  after the look began by a stop, restart or destroy asked between the answer and the interruption, up to that
  moment: what that run was billed after `since` is given back, once (lost_usage_give_back); a stopped instance's
  VM and disk found gone, whose renter's start or destroy came between the look and the check that fails it and
  billed its disk up to that request: what the disk was billed after `since` is given back, once
  (lost_disk_give_back);
- it ends when the node answers again (a lost GPU's: once the card is listed again): the VM is intact →
  `running` (billing restarts); the VM is stopped → `starting` (the platform starts it again); the VM is gone →
  `failed` with a reason; or the renter deletes it.
- billed again with no funds check of the renter's (`running`, or `starting`: billed once it runs), the resume
  re-reads their balance against what they now pay, as a price raise does (billing.services.low_balance): when
  it went low or to zero meanwhile (other instances, storage), they are warned at once, the resume's message says
  so, and their instances are not stopped at zero before the warning's notice (BILLING_LOW_BALANCE_WARNING_S) has
  passed. Before, the next meter tick stopped a renter whose balance was at zero with no warning at all (nothing of
  theirs burned while it was interrupted), or one whose balance was low with a minute's.
"""
import logging
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from billing.models import EventKind
from billing.services.credits import interruption_credit
from billing.services.low_balance import balance_recheck_on_cost_rise, billing_profile_lock, resumed_text
from billing.services.metering import usage_give_back
from billing.services.notify import event_create
from billing.services.storage import disk_give_back
from marketplace.models import Instance, Interruption, InterruptionCause, InterruptionOutcome, Node
from marketplace.models.renting import vm_id_of
from marketplace.money import micros_to_usd, usd_text
from notifications.services.notify import Kind
from provisioning.models import Job, JobKind
from provisioning.services.jobs import JobConflict, job_create

from .common import S, _leave_running, _locked, _run_begins, _save, instance_notify

log = logging.getLogger(__name__)


def _at(moment: datetime) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC"


def vm_last_seen_at(*, instance: Instance) -> datetime | None:
    """The last moment the platform saw a running instance's VM alive, where its billing ends when the VM is found
    gone or not running: its node's last health check, whose answer lists the node's VMs (a running instance whose
    VM it does not show running is interrupted by that check, so every one still running was seen by it), or the
    instance's start when that came later (its VM's SSH answered then). None when neither is known."""
    seen = Node.objects.filter(pk=instance.node_id).values_list("last_seen_at", flat=True).first()
    started = instance.started_at
    return max(seen, started) if seen is not None and started is not None else seen or started


def node_instances_interrupt(*, node_id: int, since: datetime | None, cause: str, detail: str,
                             vm_ids: set[str] | None = None, started_before: datetime | None = None) -> list[int]:
    """Interrupt the node's running instances (only those whose VM id is in `vm_ids`, when given).

    `since` is the last moment the node (or the VM) was seen healthy. Instances that became running after
    `started_before` (the probe that found the loss began before they ran) are left alone.
    Returns the ids interrupted now.

    The list is read without a lock; each instance is interrupted only if it is still running and, with
    `started_before`, its current run still began before it, both decided under its row lock in the transaction that
    interrupts it (instance_interrupt). Asking only "still running?" there, a renter's restart that finished in
    between (the probe caught its VM mid-restart) left it running, started after the probe, and it was interrupted
    all the same (as the health check's own copy of this was, ccdc738). Its node and VM id never change.
    """
    running = Instance.objects.filter(node_id=node_id, status=S.RUNNING)
    if started_before is not None:
        running = running.filter(started_at__lt=started_before)
    done = []
    for instance_id in running.order_by("pk").values_list("pk", flat=True):
        if vm_ids is not None and vm_id_of(instance_id) not in vm_ids:
            continue
        if instance_interrupt(instance_id=instance_id, since=since, cause=cause, detail=detail,
                              started_before=started_before) is not None:
            done.append(instance_id)
    return done


def instance_interrupt(*, instance_id: int, since: datetime | None, cause: str, detail: str,
                       started_before: datetime | None = None) -> Interruption | None:
    """running → interrupted, billed up to `since` and not after; None if it is not running (any more), or, with
    `started_before`, its current run did not begin before that (running again since: not judged by what was seen
    then). Both decided under its row lock."""
    with transaction.atomic():
        instance = _locked(instance_id)
        if instance is None or instance.status != S.RUNNING:
            return None
        # Read under the lock, as the other state changes do: a wait for it (a long tick batch holding the row)
        # would otherwise cap `since` and the credit at a stale moment.
        now = timezone.now()
        if started_before is not None and (instance.started_at is None or instance.started_at >= started_before):
            return None
        # Never before it started running, nor before what was already billed (which stopped at the node's
        # last healthy moment anyway: the meter bills no further than that).
        started = instance.started_at
        assert started is not None  # running: it has started
        since = min(max(since or now, started, instance.billed_until or started), now)
        _leave_running(instance, since)
        what = {str(InterruptionCause.NODE_LOST): "its server stopped answering",
                str(InterruptionCause.GPU_LOST): "a GPU it holds vanished from its server (fallen off the bus)",
                }.get(cause, "its VM stopped running on the server")
        back = ("once the card answers again (usually after the provider restarts the server)"
                if cause == InterruptionCause.GPU_LOST else "if the server comes back with the VM intact")
        instance.transition_to(S.INTERRUPTED, f"Interrupted: {what} ({detail[:200]}). Billing stopped at "
                                              f"{_at(since)}; it resumes only when the instance runs again.")
        instance.stopped_at = since
        _save(instance, "stopped_at")
        interruption = Interruption.objects.create(instance=instance, cause=cause, detail=detail[:500],
                                                   started_at=since, detected_at=now)
        credit = interruption_credit(interruption_id=interruption.pk, until=now)
        told = event_create(  # e-mailed by notifications (below), on the channels the renter chose
            user=instance.renter, kind=EventKind.INSTANCE_INTERRUPTED,
            message=(f"Instance {instance.pk} was interrupted: {what}. Billing stopped at {_at(since)}, the last "
                     "moment it was seen healthy, and you are credited for the time lost "
                     f"({usd_text(credit.total_micros)} so far, charged to the provider). It resumes by "
                     f"itself {back}; you can also destroy it now at no charge."),
            data={"instance": instance.pk, "cause": cause, "billing_stopped_at": since.isoformat(),
                  "credited": str(micros_to_usd(credit.total_micros))},
        )
        instance_notify(instance, Kind.INSTANCE_INTERRUPTED, str(interruption.pk), told.message)
    return interruption


# The jobs that take a VM down: one of them at work while a look at the node was under way may be why its answer
# did not show the VM running.
_VM_DOWN_JOBS = (JobKind.INSTANCE_STOP, JobKind.INSTANCE_RESTART, JobKind.INSTANCE_DESTROY)


def lost_usage_give_back(*, instance_id: int, since: datetime | None, looked_at: datetime,
                         answered_at: datetime | None, detail: str) -> int:
    """A look at the node (a health probe that began at `looked_at`, the reconciler's list) found the instance's VM,
    or a card it holds, lost, last seen at `since`, but the instance was not interrupted: its billing had been closed
    after the look began, by its renter's stop, restart or destroy (or a zero-balance stop, a failure) between the
    answer and the interruption, up to that moment, for a VM that was gone. Give that time back: what its run was
    billed after `since` (billing.services.metering.usage_give_back: reversed in the ledger, the renter's wallet
    credited, the provider's earnings and the platform's fee debited in the charge's proportions, once), and tell
    the renter. Nothing for an instance the interruption judges (running since before the look), one whose billing
    closed before the look began (not running then: its own stop may have stopped its VM) or at `since`, nor when
    `answered_at` is given (a VM judged by the answer, not a card) and a stop, restart or destroy job of it began
    between the look and its answer (that job may be why the VM was not listed running). Returns the micro-dollars
    given back (0: nothing done, no event).

    Its row lock, then the accounts' in id order (ledger_post), as every writer of its billing: no node lock is
    held, and none taken."""
    if since is None:
        return 0
    with transaction.atomic():
        instance = _locked(instance_id)
        if instance is None or (instance.status == S.RUNNING and instance.started_at is not None
                                and instance.started_at < looked_at):
            return 0  # running since before the look: the interruption's to judge
        if answered_at is not None and Job.objects.filter(
                instance_id=instance_id, kind__in=_VM_DOWN_JOBS, started_at__gte=looked_at,
                started_at__lte=answered_at).exists():
            return 0
        given = usage_give_back(
            instance=instance, since=since, seen_at=looked_at,
            memo=f"instance {instance.pk}: billed after its VM's last sighting ({detail[:120]})",
            customer_note=("Given back: time billed after your instance's VM was last seen, found lost by a check "
                           "just as the instance stopped running."))
        if given is None:
            return 0
        event_create(
            user=instance.renter, kind=EventKind.CREDIT,
            message=(f"{usd_text(given.amount_micros)} given back for instance {instance.pk}: a check found its VM "
                     f"lost ({detail[:200]}) just as it stopped running, and it was billed up to then; it was last "
                     f"seen at {_at(since)}, so its billing for that run now ends at {_at(given.start)} "
                     f"({given.seconds} s given back)."),
            data={"instance": instance.pk, "amount": str(micros_to_usd(given.amount_micros)),
                  "billing_stopped_at": given.start.isoformat(), "seconds": given.seconds,
                  "transactions": given.transactions},
        )
    return given.amount_micros


def lost_disk_give_back(*, instance_id: int, since: datetime | None, looked_at: datetime, detail: str,
                        answered_at: datetime | None = None) -> int:
    """A look at the node (a health probe that began at `looked_at`, the reconciler's list) found a stopped
    instance's VM and disk gone, last seen at `since`, but the instance was no longer stopped when the check came to
    fail it (instance_mark_failed's `only_in` left it): its renter's start or destroy came between the probe and the
    check, and closed the disk's billing at its own moment, past the last sighting. The disk's charge ends at
    `since`, as the failure would have ended it (its `disk_seen_at`) and as a running instance's GPU time does in
    the same race (lost_usage_give_back): what the disk was billed after it is given back
    (billing.services.storage.disk_give_back: reversed in the ledger, the renter's wallet credited, the provider's
    earnings and the platform's fee debited in the charge's proportions, once), and the renter told. Nothing for an
    instance still stopped (the check fails it, its disk billed up to `since`), nor one whose disk's billing was
    closed before the look began, nor when `answered_at` is given and a stop, restart or destroy job of it began
    between the look and its answer (a destroy's job may be why the VM was not listed). Returns the micro-dollars
    given back (0: nothing done, no event).

    Its row lock, then the accounts' in id order (ledger_post), as every writer of its billing."""
    if since is None:
        return 0
    with transaction.atomic():
        instance = _locked(instance_id)
        if instance is None:
            return 0
        if answered_at is not None and Job.objects.filter(
                instance_id=instance_id, kind__in=_VM_DOWN_JOBS, started_at__gte=looked_at,
                started_at__lte=answered_at).exists():
            return 0
        given = disk_give_back(
            instance=instance, since=since, seen_at=looked_at,
            memo=f"instance {instance.pk}: disk billed after its last sighting ({detail[:120]})",
            customer_note=("Given back: your stopped instance's disk was billed after it was last seen; a check "
                           "found it gone just as you started or destroyed the instance."))
        if given is None:
            return 0
        event_create(
            user=instance.renter, kind=EventKind.CREDIT,
            message=(f"{usd_text(given.amount_micros)} given back for instance {instance.pk}'s disk: a check found "
                     f"its VM and disk gone ({detail[:200]}) just as you started or destroyed it, and the disk was "
                     f"billed up to then; it was last seen at {_at(since)}, so its disk's billing now ends at "
                     f"{_at(given.start)} ({given.seconds} s given back)."),
            data={"instance": instance.pk, "disk": True, "amount": str(micros_to_usd(given.amount_micros)),
                  "billing_stopped_at": given.start.isoformat(), "seconds": given.seconds,
                  "transactions": given.transactions},
        )
    return given.amount_micros


def _interruption_end(instance: Instance, now: datetime, outcome: str) -> Interruption | None:
    """Close the instance's open interruption (inside the caller's transaction, instance row locked)."""
    interruption = Interruption.objects.select_for_update().filter(instance_id=instance.pk, ended_at=None).first()
    if interruption is None:
        return None
    interruption.ended_at = now
    interruption.transition_to(outcome)
    interruption.save(update_fields=["ended_at", "outcome"])
    return interruption


def _credited_text(interruption: Interruption | None, now: datetime) -> tuple[str, int]:
    if interruption is None:
        return "", 0
    credit = interruption_credit(interruption_id=interruption.pk, until=now)
    lost = interruption.lost_seconds(now)
    return (f" It was out of reach for {lost // 60} min {lost % 60:02d} s, which was not billed; you were credited "
            f"{usd_text(credit.total_micros)} for it."), credit.total_micros


def _leave_interrupted(instance_id: int, to: str, message: str, outcome: str, event: str) -> Instance | None:
    """interrupted → `to`: end the interruption, post the rest of the credit and tell the renter `event` (plus
    what was credited, and the balance's notice when it is low now), all in one transaction. None when the instance
    is not interrupted (any more)."""
    now = timezone.now()
    with transaction.atomic():
        renter_id = Instance.objects.filter(pk=instance_id).values_list("renter_id", flat=True).first()
        if renter_id is None:
            return None
        # Billed again: the balance re-read below may warn and hold the renter's billing profile. Locked first, as
        # enforcement does before it stops their instances and a raise before the instance (no lock-order cycle).
        billing_profile_lock(user_id=renter_id)
        instance = _locked(instance_id)
        if instance is None or instance.status != S.INTERRUPTED:
            return None
        instance.transition_to(to, message)
        fields = []
        if to == S.RUNNING:  # billed again from now: the time away never is
            instance.started_at, instance.stopped_at = _run_begins(instance, now), None
            fields = ["started_at", "stopped_at"]
        _save(instance, *fields)
        text, credited = _credited_text(_interruption_end(instance, now, outcome), now)
        if to == S.STARTING:
            try:
                job_create(kind=JobKind.INSTANCE_START, node=instance.node, instance=instance)
            except JobConflict:
                # A START job of its own is still open: one whose worker marked it running, then was lost before
                # closing the job. It stays interrupted (credited, not billed), all of this undone, until that
                # job is closed (run again it finds nothing to do; the reaper ends it at its deadline); the next
                # reconcile starts it then.
                transaction.set_rollback(True)
                log.info("instance %s: not started again yet: its START job is still open", instance_id)
                return None
        # After the credit (it counts): the renter's balance against what they pay with it billed again.
        low = balance_recheck_on_cost_rise(
            renter_id=instance.renter_id, now=now, why=resumed_text(instance_id=instance.pk, running=to == S.RUNNING),
            pending_micros=0 if to == S.RUNNING else instance.price_per_hour_micros)
        text += low.note() if low is not None else ""
        told = event_create(user=instance.renter, kind=EventKind.INSTANCE_RESUMED, email=to != S.RUNNING,
                            message=event.format(instance=instance.pk, at=_at(now)) + text,
                            data={"instance": instance.pk, "credited": str(micros_to_usd(credited)),
                                  **(low.as_data() if low is not None else {})})
        if to == S.RUNNING:  # e-mailed by notifications, on the channels the renter chose
            instance_notify(instance, Kind.INSTANCE_RUNNING, now.isoformat(), told.message)
    return instance


def instance_resume(*, instance_id: int) -> Instance | None:
    """interrupted → running: the node answered again and the VM is running. Billing restarts now."""
    return _leave_interrupted(instance_id, S.RUNNING, "Running again after an interruption.",
                              InterruptionOutcome.RESUMED,
                              "Instance {instance} is running again; billing restarted at {at}.")


def instance_restart_interrupted(*, instance_id: int) -> Instance | None:
    """interrupted → starting: the node answered again but the VM is stopped; queue its start (same GPUs).
    None, the instance left interrupted, while a START job of its own is still open (asked again later)."""
    return _leave_interrupted(instance_id, S.STARTING, "Its server is back; starting the VM again.",
                              InterruptionOutcome.RESTARTED,
                              "Instance {instance}'s server is back, with the VM stopped: it is being started "
                              "again; billing restarts once it runs.")


def interruption_close(*, instance: Instance, now: datetime, outcome: str, reason: str = "") -> str:
    """For the failure and destroy paths (instance row locked, still `interrupted`): end the interruption,
    post the rest of the credit, and, when it failed, record why on the renter's billing events. Returns the
    sentence about the credit ('' if the instance was not interrupted), for the caller's message: the renter is
    told of a failure by its INSTANCE_FAILED notice (instance_mark_failed), which carries it."""
    if instance.status != S.INTERRUPTED:
        return ""
    interruption = _interruption_end(instance, now, outcome)
    text, credited = _credited_text(interruption, now)
    if outcome == InterruptionOutcome.FAILED:
        # Not e-mailed: this e-mailed the renter directly whatever they chose for failed instances, besides the
        # failure's notice on the channels they chose (found by review).
        event_create(user=instance.renter, kind=EventKind.INSTANCE_LOST,
                     message=f"Instance {instance.pk} could not be recovered: {reason}{text}",
                     data={"instance": instance.pk, "credited": str(micros_to_usd(credited))})
    return text
