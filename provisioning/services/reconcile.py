"""Reconciling one node: its VMs and volumes, as the agent lists them, against the database's instances and
volumes.

Run by the fleet's reconcile batches (provisioning.services.fleet), and by the health check for a node that
answers again after failures."""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.services.storage import node_storage_outage_end
from marketplace.models import Instance, InstanceStatus, InterruptionCause, Node, Volume, VolumeState
from marketplace.selectors import instances_awaiting_cleanup
from marketplace.services import instances as instance_svc
from marketplace.services import volumes as volume_svc
from provisioning.models import OPEN, VM_JOB_KINDS, Job, NodeEvent
from provisioning.services.fleet_record import instances_restarting_told, instances_running_again
from provisioning.services.gpu_presence import instance_waits_for_gpu
from provisioning.services.nodes import (
    VM_HOLDING_GPUS,
    VM_MISSING,
    VM_RESTARTING,
    VM_UNKNOWN,
    node_event,
    node_session,
    vm_state_unknown_reported,
)
from provisioning.services.vms import vm_forget_missing
from provisioning.ssh import NodeSession
from provisioning.ssh_errors import AgentFailed, AgentGarbage
from provisioning.ssh_pool import SshPool

# What the platform names its VMs (inst-<instance id>), read from the node's answer, which its provider controls: ASCII
# digits only (\d took "inst-١", an Arabic-Indic one, as instance 1), whole (no trailing newline, which "$" let
# through) and bounded (int() refuses over 4,300 digits: a ValueError that failed the node's whole pass).
_VM_ID = re.compile(r"inst-([1-9][0-9]{0,18})", re.ASCII)
# The instances the node's VM list judges (each only if in the same state before and after the list, a running one
# only if its current run began before it).
_JUDGED = (InstanceStatus.RUNNING, InstanceStatus.INTERRUPTED, InstanceStatus.STOPPED)
log = logging.getLogger(__name__)


def node_reconcile(node: Node, *, pool: SshPool | None = None) -> dict[str, int]:
    """Compare the node's VMs with the database, and act on every difference:

    - a VM no instance owns is removed (an orphan), as is the VM of an instance destroyed while the node was
      unreachable (whose GPUs are then freed); one the node fails to remove is reported once (`vm_destroy_failed`)
      and tried again at the next pass, its instance's GPUs kept, the rest of the pass carried on. Only under a
      name the platform gives (inst-<id>): any other the node lists is no VM of ours, and is left as it is,
      reported once (`foreign_vm`);
    - a VM the node lists as `missing` (recorded there, its container or domain removed on the node) is judged as
      gone: it can neither run nor be started again, and no disk of it is left;
    - an interrupted instance resumes when its VM runs, is started again when its VM is stopped, and fails
      when its VM is gone; a running instance whose VM vanished or is not running is interrupted, as the health
      check does it (billed up to the VM's last sighting, the renter told and credited), then fails or is started
      again (`_running_vm_lost`), only if its current run began before the list was asked for (one restarted or
      started while the node answered is judged by the next list, as the health check's `started_before`); one
      whose VM is listed `missing` is only interrupted, and fails at a later look that finds it missing still (two
      looks, not one answer of the node's engine);
    - a failed instance's VM that still runs is stopped (its GPUs were released), and one of an instance that
      never ran is destroyed with its disk; the node's record of a failed instance's VM it lists as missing is
      removed once the instance has been failed a while (it held the instance's volumes there: `_forget_missing`);
      a stop the node refuses never ends the pass (`_stop_vm`: a running VM it has no record of is removed as
      unrecorded, any other refusal reported once);
    - a stopped instance fails when its VM is gone (its disk went with it: billed up to its last sighting, and it
      could never start again), and its VM is stopped when found running (its GPUs were released: another renter
      may hold them); not while a job that starts or stops it is open (the list cannot show what that job does).
      One whose VM is gone but that its renter started or destroyed meanwhile is given back what that request
      billed the disk after the sighting (`_disk_given_back_after_list`);
    - then the volumes (`_reconcile_volumes`).

    With a `pool`, over the worker's kept connection to the node (provisioning.ssh_pool).
    """
    counts = {"orphans_destroyed": 0, "instances_failed": 0, "resumed": 0, "restarted": 0, "cleaned_up": 0,
              "stopped_vms_stopped": 0, "orphan_volumes_deleted": 0, "volumes_missing": 0, "volumes_deleted": 0,
              "volumes_lost": 0}
    with node_session(node, pool=pool) as session:
        # Which instances were running, interrupted or stopped before the node was asked: only those can be
        # judged by the list, and only in the same state after it. One that became running while the node
        # answered (its VM made just after the list) is judged next time, not failed for a VM the list could not
        # show yet; so is one stopped meanwhile (its VM listed as still running).
        judged_before = dict(Instance.objects.filter(node=node, status__in=_JUDGED).values_list("pk", "status"))
        # Failed ones not yet known to have no VM left: one the list does not show at all is marked so below.
        failed_before = set(Instance.objects.filter(node=node, status=InstanceStatus.FAILED, vm_gone=False)
                            .values_list("pk", flat=True))
        making = _making_vms(node)
        making_before = set(making)
        # A running instance is judged only by a list asked for after its current run began: one restarted (or
        # started) while the node answered was running before and after the list, and its VM, listed mid-restart,
        # was taken as lost (found by review). The health check's guard (`started_before`).
        listed_at = timezone.now()
        vms = _listed(session.agent("vm", "list", {"runtime": node.runtime}), "vms", "vm_id")
        answered_at = timezone.now()
        # A job open before or after the list may make a VM the list could not show: its instance keeps its GPUs
        # (the job removes a VM of an instance destroyed meanwhile, then frees them; found by review).
        making |= _making_vms(node)
        # Read the database after the node, so an instance created meanwhile is known.
        known: dict[int | None, Instance] = {
            i.pk: i for i in Instance.objects.filter(node=node).exclude(status=InstanceStatus.DESTROYED)}
        # Destroyed ones whose VM the node still has, or that wait for their cleanup (GPUs held, or destroyed
        # while the node was away): the node answered its list, so each is cleaned up below.
        destroyed = set(Instance.objects.filter(node=node, status=InstanceStatus.DESTROYED,
                                                pk__in=_vm_instance_ids(vms)).values_list("pk", flat=True))
        destroyed |= set(Instance.objects.filter(pk__in=instances_awaiting_cleanup(node_id=node.pk),
                                                 status=InstanceStatus.DESTROYED).values_list("pk", flat=True))
        seen = {}
        missing: set[int] = set()  # instances whose VM the node lists as missing
        settled: set[int] = set()  # instances whose VM the node stopped or removed in this pass, on our asking
        unremoved: set[int | None] = set()  # instances whose VM the node failed to remove in this pass
        unknown: set[int | None] = set()  # instances whose VM's state the node cannot give (VM_UNKNOWN): unjudged
        removed: set[int] = set()  # failed instances whose VM (record and all) the node removed in this pass
        vm: dict[str, Any] | None
        for vm in vms:
            match = _VM_ID.fullmatch(vm.get("vm_id", ""))
            instance_id = int(match.group(1)) if match else None
            if vm.get("state") == VM_UNKNOWN:
                # Its engine has it but cannot say now (a libvirt domain whose domstate fails): neither removed,
                # stopped, failed, resumed nor started again, its GPUs held; reported once (found by review).
                vm_state_unknown_reported(node=node, vm_id=vm["vm_id"], error=str(vm.get("error") or ""))
                unknown.add(instance_id)
                continue
            instance = known.get(instance_id)
            if instance is None and match is None:
                _foreign(node, vm["vm_id"])
                continue
            if instance is None:
                answer = _remove_vm(node, session, vm["vm_id"])
                if answer is None:
                    unremoved.add(instance_id)
                elif instance_id in destroyed:
                    node_event(node=node, kind="vm_cleaned_up",
                               message=f"Removed VM {vm['vm_id']}: its instance was destroyed "
                                       "while the node was unreachable.")
                elif answer.get("existed") is not False:  # the node removed it (not gone already by itself)
                    node_event(node=node, kind="orphan_destroyed",
                               message=f"Destroyed VM {vm['vm_id']}, which no instance owns.",
                               level=NodeEvent.Level.WARNING)
                    counts["orphans_destroyed"] += 1
                continue
            if vm.get("state") == VM_MISSING:  # a missing VM is judged as gone, as one not listed
                missing.add(instance.pk)
            else:
                seen[instance.pk] = vm
            if instance.status == InstanceStatus.FAILED and instance.started_at is None:
                # It never ran (its provisioning failed or was reaped while the VM was being made): nothing of
                # the renter's is on it, so the VM goes with its disk, as the task's own failure handler does.
                if _remove_vm(node, session, vm["vm_id"]) is not None:
                    settled.add(instance.pk)
                    removed.add(instance.pk)
            elif instance.status == InstanceStatus.FAILED and vm.get("state") in VM_HOLDING_GPUS:
                # A failed instance's GPUs are released, or held until its VM is seen stopped (below): its VM
                # must not keep using them.
                if _stop_vm(node, session, vm["vm_id"], instance.pk):
                    settled.add(instance.pk)
        # Stopped before the list, whose VM it does not show (or shows missing), no VM job open then, but no longer
        # stopped: a start or destroy asked while the node answered billed the disk up to itself, past its last
        # sighting; given back now, before any instance is judged, as GPU time is below.
        listed = {int(m.group(1)): vm.get("state") for vm in vms if (m := _VM_ID.fullmatch(vm.get("vm_id", "")))}
        for instance_id, status in judged_before.items():
            was = known.get(instance_id)
            if status == InstanceStatus.STOPPED and instance_id not in making_before | unknown and (
                    listed.get(instance_id, VM_MISSING) == VM_MISSING) and (
                    was is None or was.status != InstanceStatus.STOPPED):
                _disk_given_back_after_list(node, instance_id, listed_at=listed_at, answered_at=answered_at)
        for instance_id in destroyed - making - unremoved - unknown:
            counts["cleaned_up"] += bool(instance_svc.instance_cleanup_done(instance_id=instance_id))
        for instance in known.values():
            vm = seen.get(instance.pk)
            if judged_before.get(instance.pk) == InstanceStatus.RUNNING and instance.pk not in unknown and not (
                    instance.status == InstanceStatus.RUNNING and instance.started_at is not None
                    and instance.started_at < listed_at) and (vm is None or vm.get("state") not in _SEEN_RUNNING):
                # Running before the list, not since: its billing closed while the node answered (a stop, restart
                # or destroy), for a VM the list shows lost. Given back before any instance is judged (a pass
                # stopped among them, by Celery's soft time limit, gave nothing back; no later pass can).
                _given_back_after_list(node, instance.pk, vm, listed_at=listed_at, answered_at=answered_at,
                                       missing=instance.pk in missing)
        for instance in known.values():
            vm = seen.get(instance.pk)
            if judged_before.get(instance.pk) != instance.status or instance.pk in unknown:
                continue
            if instance.status == InstanceStatus.RUNNING and not (
                    instance.started_at is not None and instance.started_at < listed_at):
                continue  # its current run began while the node answered: judged by the next list
            if instance.status == InstanceStatus.INTERRUPTED:
                if vm is None:
                    # Not listed at all: nothing of it is left there (vm_gone). Listed missing, the node's record
                    # of it still counts as mounting its volumes there, until _forget_missing removes it.
                    instance_svc.instance_mark_failed(
                        instance_id=instance.pk, only_in=(InstanceStatus.INTERRUPTED,),
                        message=_MISSING_FAILED if instance.pk in missing else
                        "Its server answered again, but the VM was gone; the GPUs were released.",
                        vm_gone=instance.pk not in missing)
                    counts["instances_failed"] += 1
                elif instance_waits_for_gpu(instance_id=instance.pk):
                    continue  # its VM may run, its card does not: it resumes once the card answers again
                elif vm.get("state") in VM_HOLDING_GPUS:  # restarting: the renter's container, as before (below)
                    counts["resumed"] += instance_svc.instance_resume(instance_id=instance.pk) is not None
                else:
                    counts["restarted"] += instance_svc.instance_restart_interrupted(instance_id=instance.pk) \
                        is not None
            elif instance.status == InstanceStatus.RUNNING and vm is not None and vm.get("state") == VM_RESTARTING:
                # The renter's own container that the engine keeps running again (docker): not a lost VM (judged
                # lost, the instance was interrupted and credited at the provider's expense, then restarted, every
                # pass; found by the second review). Left running on its GPUs, billed; its renter told.
                instances_restarting_told(node_id=node.pk, vm_ids={instance.vm_id})
            elif instance.status == InstanceStatus.RUNNING and (vm is None or vm.get("state") != "running"):
                _running_vm_lost(node, instance, vm, counts, listed_at=listed_at, answered_at=answered_at,
                                 missing=instance.pk in missing)
            elif instance.status == InstanceStatus.STOPPED and instance.pk not in making:
                if _judge_stopped(node, session, instance, vm, counts, listed_at=listed_at, answered_at=answered_at,
                                  missing=instance.pk in missing):
                    settled.add(instance.pk)
        instances_running_again(node_id=node.pk,
                                vm_ids={v["vm_id"] for v in seen.values() if v.get("state") == "running"})
        # Failed before the list and no VM job open: one the node does not list at all (nor its record), or whose VM
        # it removed here, has nothing left there; its disk room and volumes are free (Instance.vm_gone).
        for instance_id in sorted(failed_before - making - {i for i in unknown if i is not None}):
            if instance_id not in listed or instance_id in removed:
                instance_svc.instance_vm_gone(instance_id=instance_id)
        _forget_missing(node, session, known, missing - making - settled)
        _release_held(node, known, seen, settled, making | {i for i in unknown if i is not None}, counts)
        _reconcile_volumes(node, session, counts)
    return counts


_MISSING_FAILED = ("Its VM is no longer on the server (its container or domain was removed there); the GPUs "
                   "were released.")


def _running_vm_lost(node: Node, instance: Instance, vm: dict[str, Any] | None, counts: dict[str, int], *,
                     listed_at: datetime, answered_at: datetime | None = None, missing: bool = False) -> None:
    """A running instance whose VM the list shows gone, or not running: interrupted as the health check does it
    (billing closed at the VM's last sighting, the renter told and credited), then failed when the VM is gone
    (there is nothing to start again) or started again. Before, a gone VM's instance failed with its billing
    closed at this pass, up to a health interval after the VM was last seen, and without the interruption's word
    or credit; a stopped one was left running, billed until the next health check saw it.

    A VM the node lists as `missing` (its record there, its container or domain not found by the engine) is only
    interrupted here: a later look (the next pass, or the one after the next health check) fails the instance if
    it is missing still, or resumes it if it runs. Its GPUs stay held meanwhile. One engine answer is not enough to
    fail a renter's running instance and free its GPUs for good: a lookup that failed for a moment read as missing
    (libvirt's, found by review), and the pass after found a failed instance whose VM ran, and stopped it.

    Only while its current run began before the list (`listed_at`), decided under its row lock: a restart asked
    and finished since the pass read the instance leaves it running, started after the list (found by review).
    One no longer running because its billing was closed since the list (a stop, restart or destroy asked
    meanwhile) is given back what that close billed after the VM's last sighting (_given_back_after_list)."""
    gone = vm is None
    state = "missing" if missing else "gone" if vm is None else str(vm.get("state"))[:40]
    with transaction.atomic():
        if Instance.objects.select_for_update().filter(
                pk=instance.pk, status=InstanceStatus.RUNNING, started_at__lt=listed_at).exists():
            seen = instance_svc.vm_last_seen_at(instance=instance)
            interruption = instance_svc.instance_interrupt(
                instance_id=instance.pk, since=min(seen, listed_at) if seen is not None else None,
                cause=InterruptionCause.VM_LOST,
                detail="the VM is no longer on the server" if gone else f"the VM was found {state} on the server")
            # The meter may have billed it past the list already, up to a health check recorded while the node
            # answered (its probe begun after the list, judging nothing of the VM): the interruption cannot close
            # billing before what was billed, so that time is given back here, under the same lock (before, the
            # renter paid up to that check for a VM the list found lost).
            if interruption is not None:
                _given_back_after_list(node, instance.pk, vm, listed_at=listed_at,
                                       answered_at=answered_at or listed_at, missing=missing)
        else:
            # No longer running, or running again since the list: judged by the next one. One whose billing a stop,
            # restart or destroy asked since the list closed is given back its time after the VM's last sighting,
            # in this transaction (its row locked): left for a step after it, a pass stopped in between (Celery's
            # soft time limit) gave nothing back, and no later pass can (its list is asked for after the stop).
            interruption = None
            _given_back_after_list(node, instance.pk, vm, listed_at=listed_at,
                                   answered_at=answered_at or listed_at, missing=missing)
    if interruption is None:
        return
    if missing:
        node_event(node=node, kind="vm_missing",
                   message=f"The node lists the VM of instance {instance.pk} as missing (its container or domain "
                           "not found) while it was running; interrupted. It fails if a later look finds it "
                           "missing still.", level=NodeEvent.Level.WARNING)
        return
    node_event(node=node, kind="vm_vanished" if gone else "vm_not_running",
               message=f"The VM of instance {instance.pk} was {state} while it was running; interrupted.",
               level=NodeEvent.Level.WARNING)
    if gone:  # not listed at all (a missing one returned above): nothing of it is left there
        instance_svc.instance_mark_failed(
            instance_id=instance.pk, only_in=(InstanceStatus.INTERRUPTED,),
            message="The VM disappeared from the server; the GPUs were released.", vm_gone=True)
        counts["instances_failed"] += 1
    else:
        counts["restarted"] += instance_svc.instance_restart_interrupted(instance_id=instance.pk) is not None


# A VM state the list shows for a VM that runs (a docker container the engine keeps running again: the renter's own)
_SEEN_RUNNING = ("running", VM_RESTARTING)


def _given_back_after_list(node: Node, instance_id: int, vm: dict[str, Any] | None, *, listed_at: datetime,
                           answered_at: datetime, missing: bool) -> None:
    """An instance running before the list, whose VM the list shows gone or not running, but that was not interrupted:
    its billing was closed since the list was asked for (a stop, restart or destroy), up to then. What its run was
    billed after the VM's last sighting (the node's last health check, or the list itself when a check recorded
    since) is given back, once (interruptions.lost_usage_give_back: not when a job of it that takes the VM down
    began while the node answered). Also for one this pass interrupted that the meter billed past the sighting."""
    state = "missing" if missing else "gone" if vm is None else str(vm.get("state"))[:40]
    instance_svc.lost_usage_give_back(
        instance_id=instance_id, since=_last_sighting(node, listed_at), looked_at=listed_at,
        answered_at=answered_at,
        detail="the VM is no longer on the server" if vm is None else f"the VM was found {state} on the server")


def _disk_given_back_after_list(node: Node, instance_id: int, *, listed_at: datetime, answered_at: datetime) -> None:
    """A stopped instance whose VM and disk the list shows gone, but that was not failed: its renter's start or
    destroy, asked since the list was, closed its disk's billing at that request, past the disk's last sighting (the
    node's last health check, or the list itself when a check recorded since). What the disk was billed after the
    sighting is given back, once, as the health check gives it (interruptions.lost_disk_give_back: not when a job
    of it that takes the VM down began while the node answered). Before, the reconciler gave nothing back. Also for
    one this pass failed whose disk the storage meter billed past the sighting."""
    instance_svc.lost_disk_give_back(
        instance_id=instance_id, since=_last_sighting(node, listed_at), looked_at=listed_at,
        answered_at=answered_at, detail="the stopped VM and its disk are no longer on the server")


def _last_sighting(node: Node, listed_at: datetime) -> datetime | None:
    """The last sighting of a VM this pass's list shows gone (or not running): the node's last health check, whose
    answer listed it, but never past the list (`listed_at`). A check recorded while the node answered the list, its
    probe begun after the list was asked for, moved last_seen_at on without seeing the VM (its answer judged nothing
    of it: a state the engine could not give; or it did not look at the VMs); billed up to it, a vanished disk or a
    lost run was billed past the list that found it gone (found by review). None when the node was never seen."""
    seen = Node.objects.filter(pk=node.pk).values_list("last_seen_at", flat=True).first()
    return min(seen, listed_at) if seen is not None else None


def _forget_missing(node: Node, session: NodeSession, known: dict[int | None, Instance],
                    instance_ids: set[int]) -> None:
    """The failed instances (failed before this pass or in it) whose VM the node lists as missing: the node
    removes its record of the VM, and only if its container or domain is still gone (vms.vm_forget_missing).
    The record counted as mounting the instance's volumes there: the renter's volume delete was refused until the
    instance was destroyed (found by review). Before the volumes are listed, so that they are free in this pass."""
    # Only once failed for a while (no change to the row for VM_FORGET_MISSING_AFTER_S), never in the pass that
    # failed it: an engine outage (dockerd started on another data root) lists every VM missing, and once it
    # ends the engine may bring a container back running with no record left to stop it by (found by review).
    quiet_since = timezone.now() - timedelta(seconds=settings.VM_FORGET_MISSING_AFTER_S)
    failed = set(Instance.objects.filter(pk__in=instance_ids, status=InstanceStatus.FAILED,
                                         updated_at__lte=quiet_since).values_list("pk", flat=True))
    for instance_id in sorted(failed):
        instance = known[instance_id]
        if vm_forget_missing(session=session, instance=instance):
            log.info("reconcile: node %s removed its record of VM %s (instance %s failed, its VM gone)", node.pk,
                     instance.vm_id, instance_id)
            instance_svc.instance_vm_gone(instance_id=instance_id)  # nothing of it left there now


def _release_held(node: Node, known: dict[int | None, Instance], seen: dict[int, dict[str, Any]],
                  settled: set[int], making: set[int], counts: dict[str, int]) -> None:
    """A stopped or failed instance whose VM job gave up before the node confirmed the VM stopped or gone kept
    its GPUs (`vm_cleanup_pending`): released once the list shows its VM gone or not running, or this pass had
    it stopped or removed. Not while a VM job of it is open (a start takes the VM over), and instance_cleanup_done
    decides again under the row lock (a start asked since leaves them held)."""
    waiting = set(instances_awaiting_cleanup(node_id=node.pk)) - making
    for instance_id in sorted(waiting):
        instance = known.get(instance_id)
        if instance is None or instance.status not in (InstanceStatus.STOPPED, InstanceStatus.FAILED):
            continue  # destroyed ones are cleaned up above; another state is a job's
        vm = seen.get(instance_id)
        if vm is None or vm.get("state") not in VM_HOLDING_GPUS or instance_id in settled:
            counts["cleaned_up"] += bool(instance_svc.instance_cleanup_done(instance_id=instance_id))


def _stop_vm(node: Node, session: NodeSession, vm_id: str, instance_id: int) -> bool:
    """`vm stop` of a listed VM that must not run (a failed or stopped instance's): True when the node stopped or
    removed it. The node's refusal never ends the pass (found by review: every pass, and every health check that
    reconciles, failed for good, and the node went offline). A running VM the node has no record of (not_found:
    the record was removed as missing, then the engine brought the container back, `--restart unless-stopped`,
    on GPUs given to another renter) is removed as an unrecorded VM is (`_remove_vm`), said once
    (`unrecorded_vm_removed`). Any other refusal is reported once (`vm_stop_failed`) and tried at the next pass."""
    try:
        session.agent("vm", "stop", {"runtime": node.runtime, "vm_id": vm_id})
        return True
    except AgentFailed as exc:
        if exc.code == "not_found":
            if _remove_vm(node, session, vm_id) is None:
                return False
            if not NodeEvent.objects.filter(node=node, kind="unrecorded_vm_removed",
                                            message__startswith=f"Removed VM {vm_id},").exists():
                node_event(node=node, kind="unrecorded_vm_removed",
                           message=f"Removed VM {vm_id}, found running though the node has no record of it "
                                   f"(instance {instance_id} is not to run).", level=NodeEvent.Level.WARNING)
            return True
        log.warning("reconcile: node %s could not stop VM %s: %s", node.pk, vm_id, exc)
        if exc.code != "busy" and not NodeEvent.objects.filter(
                node=node, kind="vm_stop_failed", message__startswith=f"Could not stop VM {vm_id}:").exists():
            node_event(node=node, kind="vm_stop_failed",
                       message=f"Could not stop VM {vm_id}: {exc.message[:500]} Instance {instance_id} is not "
                               "to run; it is tried again at every reconcile.",
                       level=NodeEvent.Level.WARNING)
        return False


def _remove_vm(node: Node, session: NodeSession, vm_id: str) -> dict[str, Any] | None:
    """`vm destroy` of a listed VM that must go: the node's answer, or None when it refused (its engine could not
    remove it). A refusal is reported once per VM (a `vm_destroy_failed` warning for operators; logged at every
    pass after) and tried again at the next pass; the pass goes on. Before, it ended the node's whole pass, every
    pass: its instances were no longer judged, nor its volumes."""
    try:
        return session.agent("vm", "destroy", {"runtime": node.runtime, "vm_id": vm_id})
    except AgentFailed as exc:
        log.warning("reconcile: node %s could not remove VM %s: %s", node.pk, vm_id, exc)
        reported = NodeEvent.objects.filter(node=node, kind="vm_destroy_failed",
                                            message__startswith=f"Could not remove VM {vm_id}:").exists()
        if not reported and exc.code != "busy":  # busy: another agent run holds the VM's lock; next pass
            node_event(node=node, kind="vm_destroy_failed",
                       message=f"Could not remove VM {vm_id}: {exc.message[:500]} It is tried again at every "
                               "reconcile.", level=NodeEvent.Level.WARNING)
        return None


def _foreign(node: Node, vm_id: str) -> None:
    """A VM the node lists under a name the platform never gives (not inst-<id>, whole, in ASCII digits): not
    ours to remove, whatever made it (a person's gpumarket-* container or domain, a name the node's answer spelled
    oddly). Reported once per name, for operators; left as it is. Before, it was destroyed as an orphan: on libvirt
    the node undefined the domain and deleted its work folder, disk and all (found by review)."""
    shown = ascii(vm_id[:80])
    if NodeEvent.objects.filter(node=node, kind="foreign_vm", message__startswith=f"VM {shown} ").exists():
        return
    node_event(node=node, kind="foreign_vm",
               message=f"VM {shown} on the node is not one the platform makes (inst-<instance id>); left as it "
                       "is.", level=NodeEvent.Level.WARNING)


def _listed(answer: dict[str, Any], key: str, name: str) -> list[dict[str, Any]]:
    """The node's list (`vms` or `volumes`): a list of objects, each naming itself by a string `name`, with every
    other field the pass reads of the type the agent gives (`_FIELDS`). Anything else is the node's garbage, a
    NodeError like a node that does not answer, never a TypeError that ended the fleet's whole batch, nor a value
    read as something it does not say (found by review: a `used_by` of [1] raised TypeError; one of "" was read
    as no VM mounting the volume, and a VM with no `state` as a VM not running, its instance interrupted)."""
    items = answer.get(key)
    fields, described = _FIELDS[key]
    if not isinstance(items, list) or not all(
            isinstance(i, dict) and isinstance(i.get(name), str) and fields(i) for i in items):
        raise AgentGarbage(f"The agent's `{key}` list is not a list of objects each with a string `{name}` "
                           f"and {described}: update the agent, or tell operators.")
    return items


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


# Per list, the fields the pass reads beside the name, as the agent gives them (vm.py's vm_list, volumes.py's
# volume_list): a VM's `state`, a string, and its `error` when it has one; a volume's `used_by`, the names of the
# VMs that mount it (none when left out). `size_gb` is only shown in an event, whatever it is.
_FIELDS: dict[str, tuple[Callable[[dict[str, Any]], bool], str]] = {
    "vms": (lambda vm: isinstance(vm.get("state"), str) and isinstance(vm.get("error", ""), str),
            "a string `state` (and `error`, when given)"),
    "volumes": (lambda vol: _strings(vol.get("used_by", [])), "a `used_by` list of VM names (when given)"),
}


def _judge_stopped(node: Node, session: NodeSession, instance: Instance, vm: dict[str, Any] | None,
                   counts: dict[str, int], *, listed_at: datetime, answered_at: datetime,
                   missing: bool = False) -> bool:
    """A stopped instance (stopped before and after the list, no VM job open): its VM must be there, stopped.
    True when its running VM was stopped here. One whose VM is gone but that a start or destroy asked since the
    database was read left `stopped` is not failed, and is given back what that request billed its disk after the
    sighting (_disk_given_back_after_list). `missing`: the node lists its VM missing (its record kept there, which
    counts as mounting its volumes until _forget_missing removes it); else one not listed has nothing left there."""
    if vm is None:
        # Decided under its row lock: a start asked since the database was read is left to its job. Its disk is
        # billed up to the VM's last sighting: the node's last health check, whose answer listed it (one that did
        # not failed the instance: fleet_record._stopped_vms_lost), not up to this pass; never past this list
        # (_last_sighting: a check recorded since moved last_seen_at on without seeing the VM).
        failed = instance_svc.instance_mark_failed(
            instance_id=instance.pk, only_in=(InstanceStatus.STOPPED,), disk_seen_at=_last_sighting(node, listed_at),
            message="Its VM and disk are no longer on the server (removed there while the instance was stopped), "
                    "so it cannot be started again; its disk is not billed any more. Destroy it, and rent "
                    "another instance to carry on.", vm_gone=not missing)
        if failed.status == InstanceStatus.FAILED:
            node_event(node=node, kind="vm_vanished",
                       message=f"The VM of instance {instance.pk} (stopped) vanished with its disk.",
                       level=NodeEvent.Level.WARNING)
            counts["instances_failed"] += 1
        # Failed, its disk billed up to the sighting, unless the storage meter billed it further already (up to a
        # health check recorded while the node answered the list, judging nothing of the VM): given back here, as
        # for one a start or destroy left no longer stopped (before, the renter paid up to that check).
        _disk_given_back_after_list(node, instance.pk, listed_at=listed_at, answered_at=answered_at)
        return False
    if vm.get("state") in VM_HOLDING_GPUS:  # a container restarting holds its GPUs too (agent: docker_state)
        # Its GPUs were released when it stopped. A start asked since the list (a job open now, or the instance
        # no longer stopped) owns the VM: leave it to that job. Asked after this check, its job starts the VM
        # again, or the health check finds it not running and the instance is restarted.
        if instance.pk in _making_vms(node) or not Instance.objects.filter(
                pk=instance.pk, status=InstanceStatus.STOPPED).exists():
            return False
        if not _stop_vm(node, session, vm["vm_id"], instance.pk):
            return False
        node_event(node=node, kind="stopped_vm_running",
                   message=f"Stopped VM {vm['vm_id']}, found running while instance {instance.pk} is stopped.",
                   level=NodeEvent.Level.WARNING)
        counts["stopped_vms_stopped"] += 1
        return True
    return False


def _making_vms(node: Node) -> set[int]:
    """The node's instances with a job open that creates, starts or stops their VM."""
    return set(Job.objects.filter(OPEN, node=node, kind__in=VM_JOB_KINDS, instance__isnull=False)
               .values_list("instance_id", flat=True))


def _reconcile_volumes(node: Node, session: NodeSession, counts: dict[str, int]) -> None:
    """The node's volumes (listed after the VMs were put right, so an orphan VM no longer holds one) against the
    database's:

    - a volume on the node that the platform does not know, or deleted, and that no VM mounts, is deleted there
      (an orphan: a crash between the node's create and the database, or a delete the node never confirmed);
      one a VM still mounts is reported, not touched; one whose delete the node refuses (an unrecorded container
      still mounts it) is reported once and tried again at the next pass, the pass going on
      (`_delete_orphan_volume`);
    - so is one whose creation failed on the platform (its job gave up or was reaped while the node made it):
      the renter was told it could not be created, and it is never billed;
    - a volume the platform has as available on this node that the node's list does not have is marked missing at
      the first look (billed no further, not mountable, its renter shown why; a warning event for operators) and
      ended at the next look that misses it too (deleted, billed up to the first look, its renter told:
      volume_mark_lost), as a VM listed missing is judged gone only at a second look; one listed again is
      available as before. Before, it stayed available and billed for ever, its renter untold (found by review r53);
    - a volume whose deletion's job gave up without reaching the node (still `deleting`, no job open) is deleted
      there now, and marked deleted (its billing closed at the request); the node's refusal (a VM mounts it)
      undoes the deletion, as the job's would.
    Volumes being created or deleted by an open job are left to it. Each rule needs the volume's state from before
    the node was asked as well as after: a create or delete that finished while the node answered is judged next
    time (else a volume just made would be reported missing, and one just deleted deleted twice).

    First, the node answers: an outage it had is not billed to the storage on it (node_storage_outage_end)."""
    node_storage_outage_end(node_id=node.pk)
    _finish_deletions(node, session, counts)
    before = dict(Volume.objects.filter(node=node).values_list("name", "state"))
    listed_at = timezone.now()
    try:
        listed = _listed(session.agent("volume", "list", {}), "volumes", "name")
    except (AgentFailed, AgentGarbage) as exc:  # the VMs are reconciled already: the node is not "unreachable"
        log.warning("reconcile: node %s could not list its volumes: %s", node.pk, exc)
        return
    # Read the database after the node, so a volume created meanwhile is known.
    rows = {v.name: v for v in Volume.objects.filter(node=node)}
    removable = (VolumeState.DELETED, VolumeState.FAILED)
    on_node = set()
    for vol in listed:
        name = vol.get("name", "")
        on_node.add(name)
        row = rows.get(name)
        if row is not None and not (row.state in removable and before.get(name) == row.state):
            continue
        if vol.get("used_by"):
            _orphan_volume_in_use(node, name, vol["used_by"])
            continue
        if not _delete_orphan_volume(node, session, name):
            continue
        why = ("which the platform does not know" if row is None else "deleted on the platform"
               if row.state == VolumeState.DELETED else f"whose creation failed on the platform (volume {row.pk})")
        node_event(node=node, kind="orphan_volume_deleted",
                   message=f"Deleted volume {name} ({vol.get('size_gb')} GB), {why}.",
                   level=NodeEvent.Level.WARNING)
        counts["orphan_volumes_deleted"] += 1
    for name, row in rows.items():
        if row.state != VolumeState.AVAILABLE or before.get(name) != VolumeState.AVAILABLE:
            continue
        if name in on_node:
            if row.missing_since is not None:
                volume_svc.volume_mark_seen(volume_id=row.pk)
                node_event(node=node, kind="volume_found",
                           message=f"Volume {name} (volume {row.pk}), missing at an earlier check, is listed by the "
                                   "node again; billed on from where it stopped.")
            continue
        if row.missing_since is None:  # the first look that misses it
            volume_svc.volume_mark_missing(volume_id=row.pk, at=listed_at)
            node_event(node=node, kind="volume_missing",
                       message=f"Volume {name} (volume {row.pk}) is available on the platform but missing on the "
                               "node; no longer billed. It is ended as lost if the next check misses it too.",
                       level=NodeEvent.Level.WARNING)
            counts["volumes_missing"] += 1
        elif row.missing_since < listed_at:  # missed by an earlier look too: gone
            lost = volume_svc.volume_mark_lost(volume_id=row.pk)
            if lost is not None and lost.state == VolumeState.DELETED:
                node_event(node=node, kind="volume_lost",
                           message=f"Volume {name} (volume {row.pk}) was missing on the node at two checks in a "
                                   "row: deleted on the platform, billed up to the first, its renter told.",
                           level=NodeEvent.Level.WARNING)
                counts["volumes_lost"] += 1


def _orphan_volume_in_use(node: Node, name: str, used_by: list[str]) -> None:
    """An orphan volume (unknown to the platform, or deleted or failed there) that VMs still mount: left as it is,
    reported when this starts and when the VMs mounting it change (the node's latest `orphan_volume_in_use` event
    for the volume says otherwise), logged at every pass. Before, an event was written at every pass while it
    lasted (every reconcile cycle, and every health check that reconciled the node), flooding the node's events."""
    log.info("reconcile: node %s: orphan volume %s is mounted by %s; left as it is", node.pk, name, used_by)
    prefix = f"Volume {name}, "
    message = (f"{prefix}unknown to the platform or deleted there, is mounted by VM {', '.join(sorted(used_by))}; "
               "left as it is.")
    latest = NodeEvent.objects.filter(node=node, kind="orphan_volume_in_use", message__startswith=prefix) \
        .order_by("-id").values_list("message", flat=True).first()
    if latest != message:
        node_event(node=node, kind="orphan_volume_in_use", message=message, level=NodeEvent.Level.WARNING)


def _delete_orphan_volume(node: Node, session: NodeSession, name: str) -> bool:
    """`volume delete` of an orphan volume: True when the node deleted it. The node's refusal never ends the pass
    (found by review: an unrecorded container the pass could not remove still mounting the volume, its engine
    refused every pass, and every health check that reconciles the node failed, so it stayed offline, its
    renters resumed and interrupted again at every check). Reported once per volume (`orphan_volume_delete_failed`,
    for operators; logged at every pass after) and tried again at the next pass."""
    try:
        session.agent("volume", "delete", {"name": name})
        return True
    except AgentFailed as exc:
        log.warning("reconcile: node %s could not delete orphan volume %s: %s", node.pk, name, exc)
        prefix = f"Could not delete volume {name}:"
        if exc.code != "busy" and not NodeEvent.objects.filter(
                node=node, kind="orphan_volume_delete_failed", message__startswith=prefix).exists():
            node_event(node=node, kind="orphan_volume_delete_failed",
                       message=f"{prefix} {exc.message[:500]} It is unknown to the platform or deleted or failed "
                               "there; it is tried again at every reconcile.", level=NodeEvent.Level.WARNING)
        return False


def _finish_deletions(node: Node, session: NodeSession, counts: dict[str, int]) -> None:
    """Delete on the node the volumes whose delete job gave up without its answer (the agent's delete is
    idempotent: gone already is done). Before the list below, which would otherwise see them as known."""
    for volume in volume_svc.volumes_to_finish_deleting(node_id=node.pk):
        try:
            session.agent("volume", "delete", {"name": volume.name})
        except AgentFailed as exc:
            if exc.code == "volume_in_use":  # the node's refusal, as the job's: the volume stays, billed again
                volume_svc.volume_delete_refused(volume_id=volume.pk, message=f"its node says: {exc.message}")
            else:  # tried again at the next pass
                log.warning("reconcile: node %s could not delete volume %s: %s", node.pk, volume.name, exc)
                _delete_failed_reported(node, volume, exc)
            continue
        done = volume_svc.volume_mark_deleted(volume_id=volume.pk)
        if done is not None and done.state == VolumeState.DELETED:
            node_event(node=node, kind="volume_deleted_late",
                       message=f"Deleted volume {volume.name} (volume {volume.pk}), whose deletion was asked for "
                               "while the node could not be reached.")
            counts["volumes_deleted"] += 1


def _delete_failed_reported(node: Node, volume: Volume, exc: AgentFailed) -> None:
    """A renter's volume the node answered it could not delete (its engine failed, not its refusal): its renter
    reads why (volume_delete_waiting), and operators get one `volume_delete_failed` warning per volume, as for an
    orphan's (_delete_orphan_volume); tried again at every pass. Before, only a log line, the volume `deleting` and
    holding its disk room for ever, its renter told the server "could not be reached" (found by review r53)."""
    if exc.code == "busy":  # another agent run holds the volume's lock: next pass
        return
    volume_svc.volume_delete_waiting(volume_id=volume.pk, message=exc.message, answered=True)
    prefix = f"Could not delete volume {volume.name} (volume {volume.pk}):"
    if not NodeEvent.objects.filter(node=node, kind="volume_delete_failed", message__startswith=prefix).exists():
        node_event(node=node, kind="volume_delete_failed",
                   message=f"{prefix} {exc.message[:500]} Its renter asked for its deletion (billing stopped then); "
                           "it is tried again at every reconcile, and the node cannot be retired before.",
                   level=NodeEvent.Level.WARNING)


def _vm_instance_ids(vms: list[dict[str, Any]]) -> list[int]:
    return [int(m.group(1)) for vm in vms if (m := _VM_ID.fullmatch(vm.get("vm_id", "")))]
