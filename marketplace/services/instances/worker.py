"""What the provisioning tasks record: each move in its own short transaction, idempotent."""
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from marketplace.models import Instance, InterruptionOutcome, Node, NodeState
from marketplace.models.renting import FINAL_STATUSES
from marketplace.services.offer_rules import NODE_STATE_REASONS
from marketplace.validators import VM_PORT_NAME, is_port_number, validate_address
from notifications.services.notify import Kind
from provisioning.models import Job, JobKind
from provisioning.services.runner import log_lines

from .common import (
    S,
    _leave_running,
    _locked,
    _run_begins,
    _save,
    _stop_clock,
    instance_notify,
    instance_notify_by_operator,
    instance_release_gpus,
)
from .interruptions import interruption_close
from .secrets import instance_forget_secrets

# ------------------------------------------------------------------------- worker side (tasks)

# Why no job reaches a quarantined node (the renter's verbs there say it: lifecycle, instance_mark_destroyed).
QUARANTINED_REASON = (f"{NODE_STATE_REASONS[NodeState.QUARANTINED]}: its SSH host key changed, and the platform "
                      "does not talk to it until an operator has accepted the new key")
# A stop that no job could carry to a quarantined node (lifecycle.instance_stop, vms.vm_failed).
STOPPED_ON_QUARANTINED_NODE = (f"Stopped; the disk is kept. Its server cannot be reached now ({QUARANTINED_REASON}), "
                               "so its VM is stopped there when the platform reaches it again.")
# A start (or a restart) whose job gave up on a node quarantined meanwhile (opened before the quarantine, it met the
# changed key), with "The start"/"The restart": a start there is refused until the key is accepted (its node is not
# active), so not "start it again" (vms.vm_failed).
START_ON_QUARANTINED_NODE = ("{verb} did not go through: its server cannot be reached now (" + QUARANTINED_REASON
                             + "). It is stopped, its disk kept; it can be started again once the key is accepted.")
# How node_quarantine's interruptions name their cause (and a restart's that met the changed key: vms.vm_failed).
QUARANTINE_INTERRUPTION = ("its SSH host key changed; the platform no longer talks to it until an operator confirms "
                           "the key")
_DESTROYED_UNREACHED = ("Destroyed. Its server could not be reached, so the VM and its disk are removed when it "
                        "answers again; nothing is charged meanwhile.")
_DESTROYED_QUARANTINED = (f"Destroyed. Its server cannot be reached now ({QUARANTINED_REASON}), so the VM and its "
                          "disk are removed there once the key is accepted; nothing is charged meanwhile.")


@transaction.atomic
def instance_mark_provisioning(*, instance_id: int) -> Instance | None:
    """requested → provisioning. None when the instance is gone or in another state: do nothing then."""
    instance = _locked(instance_id)
    if instance is None or instance.status not in (S.REQUESTED, S.PROVISIONING):
        return None
    if instance.status == S.REQUESTED:
        instance.transition_to(S.PROVISIONING, "Creating the VM on the node")
        _save(instance)
    return instance


def _address(value: Any) -> bool:
    try:
        validate_address(value)
    except ValidationError:
        return False
    return True


def _mapped_port(name: Any, target: Any) -> bool:
    """A mapped port: "8888/tcp": {"host": an IP address or hostname, "port": 1 to 65535}. The worker checked the node's
    answer already (provisioning.services.vms.vm_address: its null hosts are the node's address, and which hosts a
    node may name); this keeps anything else out of what renters are shown."""
    return (isinstance(name, str) and VM_PORT_NAME.fullmatch(name) is not None and isinstance(target, dict)
            and isinstance(target.get("host"), str) and _address(target["host"]) and is_port_number(target.get("port")))


def _vm_facts(instance: Instance, vm: dict[str, Any]) -> list[str]:
    """Record what the node says the VM has: mapped ports, OS. Only well-formed values are kept; its disk size is
    only compared with the booked one."""
    fields = []
    ports = vm.get("ports")
    if isinstance(ports, dict) and all(_mapped_port(k, v) for k, v in ports.items()):
        instance.ports = {k: {"host": v["host"], "port": v["port"]} for k, v in ports.items()}
        fields.append("ports")
    os_name = vm.get("os")
    if isinstance(os_name, str) and os_name:
        instance.os = "".join(c for c in os_name if c.isprintable())[:200]
        fields.append("os")
    # The disk is the size the renter booked, sent to the node and billed while stopped: the node's (the
    # provider's) report is information, never a new size (before, a node answering 60000 GB on a start had the
    # disk's whole stopped past billed again at that size). A different one is logged for operators.
    disk = vm.get("disk_gb")
    if isinstance(disk, int) and not isinstance(disk, bool) and disk != instance.disk_gb:
        import logging  # (here: this function is all of this module that the storage fix may touch)

        logging.getLogger(__name__).warning(
            "instance %s: its node reports a %s GB disk; %s GB were booked (and are billed)", instance.pk,
            str(disk)[:20], instance.disk_gb)
    return fields


@transaction.atomic
def instance_mark_running(*, instance_id: int, ssh_host: str, ssh_port: int, ssh_user: str,
                          message: str = "", vm: dict[str, Any] | None = None) -> Instance:
    """provisioning/starting → running, with where to SSH in. Already running: the address is updated.

    `vm` is the agent's answer: its mapped `ports`, `os` and `disk_gb` are recorded when given.
    Raises InvalidTransition from any other state (e.g. a destroy was asked meanwhile).
    """
    instance = _locked(instance_id)
    if instance is None:
        raise Instance.DoesNotExist(instance_id)
    now = timezone.now()
    fields = ["ssh_host", "ssh_port", "ssh_user"]
    if instance.status == S.RUNNING:
        instance.status_message = (message or instance.status_message)[:500]
    else:
        instance.transition_to(S.RUNNING, message or "Running")
        instance.started_at, instance.stopped_at = _run_begins(instance, now), None
        fields += ["started_at", "stopped_at"]
        instance_notify(instance, Kind.INSTANCE_RUNNING, now.isoformat())
    instance.ssh_host, instance.ssh_port, instance.ssh_user = ssh_host, ssh_port, ssh_user
    fields += _vm_facts(instance, vm or {})
    _save(instance, *fields)
    return instance


# An operator's stop (lifecycle.instance_end_by_operator) is the first line of its stop job's log, with the reason:
# the renter is told who stopped it and why once it IS stopped (instance_mark_stopped), in place of the generic
# "Instance stopped". Told when asked, they got both, and the operator's ("its disk is kept") even for a stop that
# never reached the server and left the instance running (review r53). No model change: the job is that stop's record.
OPERATOR_STOP = "queued: a stop asked by an operator; reason: "
STOPPED_BY_OPERATOR = "Its GPUs are freed and its disk is kept: you can start it again."


def _operator_stop_reason(instance_id: int) -> str | None:
    """The operator's reason ("" for none) when the instance's latest job is a stop an operator asked; else None. Its
    latest job only: an older stop job still open (its worker lost after it stopped the VM) speaks for nothing now."""
    log = Job.objects.filter(instance_id=instance_id).order_by("-id").values_list("kind", "log").first()
    if log is None or log[0] != JobKind.INSTANCE_STOP:
        return None
    first = log_lines(log[1])[:1]  # a log that outgrew MAX_LOG_LINES lost it: the generic notice then
    message = str(first[0].get("message", "")) if first else ""
    return message.removeprefix(OPERATOR_STOP) if message.startswith(OPERATOR_STOP) else None


@transaction.atomic
def instance_mark_stopped(*, instance_id: int, message: str = "", cleanup_pending: bool = False,
                          only_in: tuple[str, ...] | None = None, operator_reason: str | None = None) -> Instance:
    """stopping/starting → stopped: the VM is stopped, its disk kept, and its GPUs freed.

    With `cleanup_pending` the node did not confirm the VM stopped (a stop or start job gave up): the instance is
    stopped for the renter all the same (nothing is billed for GPU time), but it keeps its GPUs, which its VM may
    still use, until the VM is confirmed stopped (`instance_cleanup_done`), started again or destroyed.
    Already stopped: nothing changes. With `only_in`, an instance in another state is left as it is; without it,
    raises InvalidTransition from any other state.

    The renter is told: that an operator stopped it and why when an operator asked this stop (`operator_reason`, or
    its stop job says so: OPERATOR_STOP), else that it stopped.
    """
    instance = _locked(instance_id)
    if instance is None:
        raise Instance.DoesNotExist(instance_id)
    if only_in is not None and instance.status not in only_in:
        return instance
    if instance.status != S.STOPPED:
        if operator_reason is None and instance.status == S.STOPPING:
            operator_reason = _operator_stop_reason(instance.pk)
        now = timezone.now()
        instance.transition_to(S.STOPPED, message or "Stopped; the disk is kept. Start it again at any time.")
        instance.stopped_at = now
        instance.vm_cleanup_pending = cleanup_pending
        if not cleanup_pending:
            instance_release_gpus(instance=instance, at=now)
        _save(instance, "stopped_at", "vm_cleanup_pending")
        if operator_reason is None:
            instance_notify(instance, Kind.INSTANCE_STOPPED, now.isoformat())
        else:  # its GPUs still held (the server did not confirm it): what the instance says instead
            instance_notify_by_operator(instance, Kind.INSTANCE_STOPPED_BY_OPERATOR, now.isoformat(), "stopped",
                                        instance.status_message if cleanup_pending else STOPPED_BY_OPERATOR,
                                        operator_reason)
    return instance


@transaction.atomic
def instance_mark_running_again(*, instance_id: int, message: str, only_in: tuple[str, ...]) -> Instance:
    """stopping/starting → running: a stop or restart that never reached the node, so the VM runs as before.
    Billing resumes from now (the time it waited is not billed). An instance not in `only_in` is left as it is."""
    instance = _locked(instance_id)
    if instance is None:
        raise Instance.DoesNotExist(instance_id)
    if instance.status not in only_in:
        return instance
    instance.transition_to(S.RUNNING, message)
    instance.started_at, instance.stopped_at = _run_begins(instance, timezone.now()), None
    _save(instance, "started_at", "stopped_at")
    return instance


@transaction.atomic
def instance_mark_destroyed(*, instance_id: int, cleanup_pending: bool = False) -> Instance:
    """destroying (or interrupted/stopped, see below) → destroyed: the renter's side ends; nothing is billed.

    Normally the VM and its disk are gone and its GPUs are freed. With `cleanup_pending` the node could not
    be reached: the instance ends for the renter all the same, but it keeps its GPUs (so nobody is given a
    GPU its VM may still use) until the reconciler has removed the VM (`instance_cleanup_done`).
    Already destroyed: nothing changes. Raises InvalidTransition from any other state.
    """
    instance = _locked(instance_id)
    if instance is None:
        raise Instance.DoesNotExist(instance_id)
    if instance.status != S.DESTROYED:
        now = timezone.now()
        _leave_running(instance, now)
        credit = interruption_close(instance=instance, now=now, outcome=InterruptionOutcome.DESTROYED)
        message = "Destroyed"
        if cleanup_pending:
            # Quarantined, the node answers (it was not "unreachable"), but no job talks to it until an operator
            # has accepted its new host key: said so, as the 409 of a restart there says it.
            quarantined = Node.objects.filter(pk=instance.node_id, state=NodeState.QUARANTINED).exists()
            message = (_DESTROYED_QUARANTINED if quarantined else _DESTROYED_UNREACHED) + credit
        instance.transition_to(S.DESTROYED, message)
        instance.destroyed_at = now
        instance.vm_cleanup_pending = cleanup_pending
        _stop_clock(instance, now)
        if not cleanup_pending:
            instance_release_gpus(instance=instance, at=now)
        _save(instance, "destroyed_at", "stopped_at", "vm_cleanup_pending", *instance_forget_secrets(instance))
    return instance


@transaction.atomic
def instance_cleanup_done(*, instance_id: int) -> list[int]:
    """The node confirmed that an over instance's VM is gone, or a stopped one's is stopped (the reconciler, or
    the job that removed it): free the GPUs it still held, and it is no longer waiting for its cleanup. Returns
    the GPUs freed. A stopped instance not waiting for its cleanup holds none; any other state keeps them."""
    instance = _locked(instance_id)
    if instance is None or instance.status not in (S.DESTROYED, S.FAILED, S.STOPPED):
        return []
    if instance.status == S.STOPPED and not instance.vm_cleanup_pending:
        return []
    if instance.vm_cleanup_pending:
        Instance.objects.filter(pk=instance.pk).update(vm_cleanup_pending=False, updated_at=timezone.now())
    return instance_release_gpus(instance=instance)


@transaction.atomic
def instance_mark_failed(*, instance_id: int, message: str, destroy_wins: bool = False,
                         only_in: tuple[str, ...] | None = None, cleanup_pending: bool = False,
                         disk_seen_at: datetime | None = None, stopped_before: datetime | None = None,
                         vm_gone: bool = False) -> Instance:
    """Any state but failed/destroyed → failed, with the reason; its GPUs are freed.

    A failed or destroyed instance stays as it is (the first reason is kept); with `destroy_wins` (a VM job
    that failed), so does a destroying one: the renter asked for a destroy, which its own job does. With
    `only_in`, an instance in another state is left as it is too (decided under its row lock). With
    `cleanup_pending` the node did not confirm its VM gone: it keeps its GPUs until `instance_cleanup_done`.

    `disk_seen_at`: a stopped instance whose VM (and disk) the node no longer lists has its disk billed up to that
    moment, the VM's last sighting, not up to now. `stopped_before`: a stopped instance whose stop came at or after
    that moment (a start and stop since the look that found its VM gone) is left as it is (decided under its lock).

    `vm_gone`: the caller knows its VM is gone from the node (`Instance.vm_gone`: its disk room and volumes are
    free at once); also marked on one failed already. Never with `cleanup_pending` (its VM may still be there).
    """
    instance = _locked(instance_id)
    if instance is None:
        raise Instance.DoesNotExist(instance_id)
    if (destroy_wins and instance.status == S.DESTROYING) or (only_in is not None and instance.status not in only_in):
        return instance
    if stopped_before is not None and instance.status == S.STOPPED and (
            instance.stopped_at is None or instance.stopped_at >= stopped_before):
        return instance
    if instance.status not in FINAL_STATUSES:
        now = timezone.now()
        _leave_running(instance, now, disk_until=disk_seen_at)
        credit = interruption_close(instance=instance, now=now, outcome=InterruptionOutcome.FAILED, reason=message)
        # The sentence about an interruption's credit is kept whole (a long reason is cut, not it): the failure's
        # notice below, on the channels the renter chose, is how they are told of it.
        instance.transition_to(S.FAILED, (message or "Failed")[:max(500 - len(credit), 0)] + credit)
        _stop_clock(instance, now)
        instance.vm_cleanup_pending = cleanup_pending
        instance.vm_gone = vm_gone and not cleanup_pending
        if not cleanup_pending:
            instance_release_gpus(instance=instance, at=now)
        _save(instance, "stopped_at", "vm_cleanup_pending", "vm_gone", *instance_forget_secrets(instance))
        instance_notify(instance, Kind.INSTANCE_FAILED, "failed")
        return instance
    if not instance.vm_cleanup_pending:  # those GPUs are kept for a VM still to be removed
        instance_release_gpus(instance=instance)  # no-op unless something left one live
    if vm_gone and not cleanup_pending:
        _vm_gone(instance)
    return instance


@transaction.atomic
def instance_vm_gone(*, instance_id: int) -> bool:
    """The node confirmed that a failed instance's VM is gone (the reconciler: not listed, removed, or its record of
    a missing one forgotten): it no longer holds disk room on the node, nor the volumes it mounted
    (`Instance.vm_gone`). True when it was marked now; any other state, or one marked already, is left as it is."""
    instance = _locked(instance_id)
    if instance is None or instance.status != S.FAILED or instance.vm_gone:
        return False
    _vm_gone(instance)
    return True


def _vm_gone(instance: Instance) -> None:
    """Mark a failed instance (row locked) as having no VM left on its node."""
    if instance.status == S.FAILED and not instance.vm_gone:
        instance.vm_gone = True
        Instance.objects.filter(pk=instance.pk).update(vm_gone=True, updated_at=timezone.now())


def instance_set_status_message(*, instance_id: int, message: str, only_in: tuple[str, ...] | None = None) -> None:
    """Progress text for the renter ("Pulling the image"); no state change. Written only while the instance is in
    `only_in` (a job's progress: the states the job acts in), else while it is not final. A job's progress written
    on an instance that had moved on meanwhile stayed there: "waiting for SSH on the VM" on a stopped one."""
    instances = Instance.objects.filter(pk=instance_id)
    instances = (instances.filter(status__in=only_in) if only_in is not None
                 else instances.exclude(status__in=FINAL_STATUSES))
    instances.update(status_message=message[:500], updated_at=timezone.now())


