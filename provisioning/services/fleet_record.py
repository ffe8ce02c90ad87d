"""Recording health checks, a batch at once, in a few set-based statements for the whole batch (a single check
is a batch of one: node_record_health). Offline after failures in a row (a node in maintenance stays there), back
when it answers, the instances a check interrupts (node silent, VM not running, GPU gone: gpu_presence).

For a batch of any size, in the common case (nodes answering, or failing, with nothing else to do), in one
transaction: the nodes locked (SELECT ... FOR NO KEY UPDATE), two statements for the day's health samples (insert
the missing rows, then count every node up in one UPDATE; a failed check of a node in maintenance with nobody on it
is not counted: announced_downtime, one read when there is one), two reads for the reliability figures (the samples
of the window and the failed jobs, grouped by node), the nodes updated (one UPDATE ... CASE, Django's
bulk_update) and their events inserted (one INSERT); when some nodes have been silent long enough to interrupt
their instances, one read for those with running instances; when answers list their GPUs, one read of those GPUs;
when answers list their VMs, one read of the stopped instances whose VM (and disk) may be gone (_stopped_vms_lost).
Only the rare cases take statements per node: a node gone offline (its provider told), instances to interrupt,
GPUs gone or back, and GPUs that changed (a re-verification to queue).
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import date, datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Case, Count, F, Q, Sum, Value, When
from django.utils import timezone

from marketplace.models import Instance, InstanceStatus, InterruptionCause, Node, NodeState
from marketplace.models.renting import vm_id_of
from marketplace.selectors import node_in_use_q
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import node_return_state
from notifications.services.notify import Kind, notify
from provisioning.agent.gpumarket_agent import inventory_hash as gpus_hash
from provisioning.models import OPEN, VM_JOB_KINDS, HealthSample, Job, NodeEvent
from provisioning.services.gpu_presence import Presence, gpus_presence, held_when, node_gpus_presence
from provisioning.services.nodes import (
    OFFLINE_AFTER_FAILED_CHECKS,
    VM_MISSING,
    VM_RESTARTING,
    VM_UNKNOWN,
    HealthResult,
    node_event,
    running_vm_ids_by_node,
    vm_state_unknown_reported,
)
from provisioning.services.reliability import RELIABILITY, failed_jobs_counted, node_inventory_changed

NODE_FIELDS = ["health_failures", "last_seen_at", "last_checked_at", "state", "last_error", "reliability",
               "updated_at"]


def nodes_record_health(results: Sequence[HealthResult], *, running_vm_ids: Mapping[int, set[str]],
                        now: datetime | None = None) -> dict[int, list[int]]:
    """Apply a batch of health checks (one result per node): offline after N failures in a row, back when it
    answers, the day's sample, the reliability figure, instances interrupted, a re-verification when the GPUs
    changed. `running_vm_ids`: per node, the VM ids of its instances running since before the probe (a node
    missing from it has none). Returns, per node, the ids of the instances interrupted by this check."""
    by_id = {r.node_id: r for r in results}
    if not by_id:
        return {}
    now = now or timezone.now()
    ids = sorted(by_id)
    last_healthy: dict[int, datetime | None] = {}
    # Cards gone from, or back in, nvidia-smi: one read for the batch.
    presence = gpus_presence({r.node_id: r.gpu_uuids for r in results if r.ok and r.gpu_uuids is not None})
    # Stopped instances whose VM (and disk) the answer no longer lists: one read for the batch, usually empty.
    disks_lost = _stopped_vms_lost(by_id)
    # The answers of nodes where this check finds a VM gone or stopped, or a card missing, are recorded once those
    # instances are interrupted (below): the meter bills up to last_seen_at, and a tick between the two billed the
    # lost instance up to this answer, past the check that last saw it, never given back; a check stopped between
    # them (a soft time limit) left it running and the next check took this answer as the VM's last sighting.
    answered_later: dict[int, datetime] = {}
    with transaction.atomic():
        nodes = list(Node.objects.select_for_update(no_key=True).filter(pk__in=ids).order_by("pk"))
        # The day's samples once the nodes are locked: each check counted as the state it met (announced_downtime).
        announced = announced_downtime([n for n in nodes if not by_id[n.pk].ok])
        health_samples_record(ok_ids=[i for i in ids if by_id[i].ok],
                              failed_ids=[i for i in ids if not by_id[i].ok and i not in announced], day=now.date())
        reliability = nodes_reliability(node_ids=ids, now=now)
        events = []
        for node in nodes:
            result = by_id[node.pk]
            last_healthy[node.pk] = node.last_seen_at  # the last moment the node was known to be well
            events += _apply(node, result, now)
            answered = node.last_seen_at
            if result.ok and answered is not None and answered != last_healthy[node.pk] and (
                    (node.pk in presence and presence[node.pk].missing) or node.pk in disks_lost
                    or any(_vms_lost(result, running_vm_ids.get(node.pk, set())))):
                answered_later[node.pk], node.last_seen_at = answered, last_healthy[node.pk]
            node.reliability = reliability.get(node.pk, 0.0)
            node.last_checked_at = node.updated_at = now
        Node.objects.bulk_update(nodes, NODE_FIELDS)
        if events:
            NodeEvent.objects.bulk_create(events)
    # Instances whose billing a stop, restart or destroy closed since the probe began, for a VM (or card) the answer
    # shows lost: given back now, before any interruption or notice of the batch, so that a check stopped there
    # (Celery's soft time limit) has given it already; no later check can (its look begins after the stop). Again
    # once the interruptions are done, for those stopped meanwhile (once each: the reversal's key).
    _usage_after_loss_given_back(by_id, last_healthy, presence)
    went_offline = {e.node_id for e in events if e.kind == "offline"}
    for node in nodes:  # rare: once per outage
        if node.pk in went_offline:
            _tell_offline(node)
    # Nodes silent for long enough to interrupt their instances: those with running instances, in one read.
    threshold = settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS
    silent = [n.pk for n in nodes if not by_id[n.pk].ok and n.health_failures >= threshold]
    renting = set(Instance.objects.filter(node_id__in=silent, status=InstanceStatus.RUNNING)
                  .values_list("node_id", flat=True).distinct()) if silent else set()
    interrupted: dict[int, list[int]] = {}
    for node in nodes:
        result = by_id[node.pk]
        if not result.ok and node.pk not in renting:
            continue  # nothing running to interrupt (and no GPUs to re-verify on a silent node)
        lost = _interrupt(node, result, last_healthy[node.pk], running_vm_ids.get(node.pk, set()))
        sighting = _sighting(last_healthy[node.pk], result.probed_at)
        if lost:
            interrupted[node.pk] = lost
            node_event(node=node, kind="instances_interrupted",
                       message=f"Instance(s) {', '.join(map(str, lost))} interrupted: "
                       f"{'the node is unreachable' if not result.ok else 'their VM is not running'}.",
                       level=NodeEvent.Level.CRITICAL)
        if node.pk in presence:
            # With the probe's start: a holder stopped since the first give-back is given back before the
            # interruptions of the card's other holders, or with the decision not to interrupt it (gpu_presence).
            lost += node_gpus_presence(node=node, presence=presence[node.pk], last_seen=sighting,
                                       looked_at=result.probed_at)
            if lost:
                interrupted[node.pk] = lost
        if node.pk in disks_lost:  # before last_seen_at moves on: the storage meter bills stopped disks up to it
            _stopped_vms_lost_fail(node, disks_lost[node.pk], since=sighting, probed_at=result.probed_at)
        if node.pk in answered_later:  # its losses recorded: the meter may bill its other instances up to it
            node.last_seen_at = answered_later[node.pk]
            Node.objects.filter(Q(last_seen_at__isnull=True) | Q(last_seen_at__lt=node.last_seen_at), pk=node.pk) \
                .update(last_seen_at=node.last_seen_at)
        if result.ok and result.inventory_hash and _gpus_changed(node, result.inventory_hash):
            node_inventory_changed(node_id=node.pk, reported_hash=result.inventory_hash)
    # Once every interruption of the batch is done: those a stop, restart or destroy overtook since the first call
    # (a VM's own interruption gives back one it finds stopped under its lock: _vms_lost_interrupt).
    _usage_after_loss_given_back(by_id, last_healthy, presence)
    _disk_after_loss_given_back(by_id, last_healthy)
    return interrupted


def _apply(node: Node, result: HealthResult, now: datetime) -> list[NodeEvent]:
    """The node's row after this check (in memory), and the events it raises."""
    if result.ok:
        node.health_failures = 0
        # When it answered (its probe began then: at most the probe's round trip before the answer), not when the
        # batch recorded it: billing closes at last_seen_at when its instances are interrupted, and the batch
        # records after its slowest probe (up to HEALTH_PROBE_DEADLINE_S), so renters paid for up to two minutes
        # past the last healthy answer (found by review). Never moved back (an answer older than the last one).
        seen = result.probed_at or now
        if node.last_seen_at is None or seen > node.last_seen_at:
            node.last_seen_at = seen
        if node.state == NodeState.OFFLINE:
            # As node_record_health: active while renters are on it whatever its verdict (watched, not listed).
            # Sent pending instead, a rejected node's renters were no longer checked nor their instances resumed
            # (found by review).
            node.transition_to(node_return_state(node=node))
            node.last_error = ""
            return [NodeEvent(node=node, kind="back_online", message="The node answers health checks again.",
                              level=NodeEvent.Level.INFO)]
        return []
    node.health_failures += 1
    node.last_error = result.error
    # A node in maintenance stays there: its provider ends it, and node_update sends it offline then. (Sent
    # offline here, its next answer ended the provider's maintenance and listed it again.) A node being verified
    # is left to its check, which puts it where it belongs when it cannot reach it (node_verify_failed): a check
    # probed before its provider asked for the verification, recorded after, sent it offline again, told its
    # provider so once more, and the queued verification ended "The node is offline, not verifying; nothing done"
    # as the platform's failure (found by review). Its failed checks still count (its renters, if any, are
    # interrupted as anywhere else).
    if node.health_failures >= OFFLINE_AFTER_FAILED_CHECKS and node.can_transition_to(NodeState.OFFLINE) \
            and node.state not in (NodeState.OFFLINE, NodeState.MAINTENANCE, NodeState.VERIFYING):
        node.transition_to(NodeState.OFFLINE)
        return [NodeEvent(node=node, kind="offline", level=NodeEvent.Level.WARNING,
                          message=f"{node.health_failures} health checks failed in a row: {result.error}")]
    return []


def _tell_offline(node: Node) -> None:
    """The provider hears that its node went offline (once per time it went), on the channels it chose."""
    notify(user=node.provider, kind=Kind.NODE_OFFLINE,
           dedupe_key=f"node_offline:{node.pk}:{node.state_changed_at.isoformat()}", payload={
               "node": node.pk, "name": node.name, "message": f"Node {node.name} is offline: "
               f"{node.health_failures} health checks failed in a row ({node.last_error[:300]}). It takes no new "
               "rentals until it answers again."})


def node_record_health(*, node_id: int, ok: bool, error: str = "", inventory_hash: str | None = None,
                       vms: dict[str, str] | None = None, probed_at: datetime | None = None,
                       running_vm_ids: set[str] | None = None, gpu_uuids: list[str] | None = None) -> list[int]:
    """One node's health check, recorded as a batch of one (one rule for both: a copy kept for single checks had
    drifted from the batch the fleet runs, which sent a node in maintenance offline and told no provider that its
    node went offline). Returns the ids of the instances it interrupted."""
    result = HealthResult(node_id, ok, error, inventory_hash=inventory_hash, vms=vms, probed_at=probed_at,
                          gpu_uuids=gpu_uuids)
    if running_vm_ids is None:
        running_vm_ids = running_vm_ids_by_node(node_ids=[node_id], probed_before=probed_at).get(node_id, set())
    return nodes_record_health([result], running_vm_ids={node_id: running_vm_ids}).get(node_id, [])


def _sighting(last_healthy: datetime | None, probed_at: datetime | None) -> datetime | None:
    """The last sighting of what an answer finds lost (a VM gone or stopped, its disk, a card): the node's previous
    healthy answer, but never past the moment this answer's probe began. A check of the node begun later, recorded
    while this probe ran, moved last_seen_at on without seeing it (it did not look at the VMs, or could not read this
    one's state): billed up to it, a lost run or a vanished disk was billed past the probe that found it gone. The
    reconciler's rule for its list (reconcile._last_sighting)."""
    if last_healthy is None or probed_at is None:
        return last_healthy
    return min(last_healthy, probed_at)


def _interrupt(node: Node, result: HealthResult, last_healthy: datetime | None, running: set[str]) -> list[int]:
    if not result.ok and node.health_failures >= settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS:
        return instance_svc.node_instances_interrupt(
            node_id=node.pk, since=last_healthy, cause=InterruptionCause.NODE_LOST,
            # Not the SSH error: it is written for the provider (their login, address, what to run) and this
            # detail reaches the renter; the node keeps it as last_error.
            detail=f"{node.health_failures} health checks failed in a row")
    if result.ok and result.vms is not None:
        gone, stopped = _vms_lost(result, running)
        # Unknown (its engine has it but cannot give its state now): not judged, neither stopped nor gone (found by
        # review: one such domain failed the whole answer, and every renter on the node was interrupted).
        for vm_id in sorted(vm_id for vm_id, state in result.vms.items() if state == VM_UNKNOWN):
            vm_state_unknown_reported(node=node, vm_id=vm_id)
        # Restarting (docker: the container exits and the engine runs it again): the renter's own container, on its
        # GPUs, billed as running; the renter is told. Taken as stopped, every restart interrupted the instance and
        # credited the renter at the provider's expense (found by the second review).
        restarting = running & {vm_id for vm_id, state in result.vms.items() if state == VM_RESTARTING}
        if restarting:
            instances_restarting_told(node_id=node.pk, vm_ids=restarting)
        lost = []
        answered_at = result.probed_at + timedelta(seconds=result.seconds) if result.probed_at else None
        for vm_ids, detail in ((gone, "the server answers, but the VM is no longer on it"),
                               (stopped, "the server answers, but the VM is not running on it")):
            if vm_ids:
                lost += _vms_lost_interrupt(node, since=_sighting(last_healthy, result.probed_at), vm_ids=vm_ids,
                                            started_before=result.probed_at,
                                            answered_at=answered_at, detail=detail)
        return sorted(lost)
    return []


def _vms_lost_interrupt(node: Node, *, since: datetime | None, vm_ids: set[str], started_before: datetime | None,
                        detail: str, answered_at: datetime | None = None) -> list[int]:
    """Interrupt the node's running instances whose VM (in `vm_ids`) the answer shows gone or stopped, each only if
    its current run began before the probe (`started_before`), decided under its row lock as the reconciler does
    (reconcile._running_vm_lost). The instances were read without a lock, then each interrupted under its lock
    asking only whether it still ran: a renter's restart that finished in between (the probe caught its VM
    mid-restart) left it running, started after the probe, and it was interrupted all the same, for a VM that
    runs (its renter told, credited at the provider's expense, a start queued; found by review). Returns the ids
    interrupted now.

    One that is no longer running under its lock, its billing closed since the probe began by a stop, restart or
    destroy (the renter's, a zero-balance stop, a failure) for a VM the answer shows lost, is given back what that
    close billed after `since` in the same transaction (interruptions.lost_usage_give_back, once: its reversal key).
    Before, that was left to a step after every node of the batch was interrupted (_usage_after_loss_given_back, still
    run for the rest): a check stopped in between (Celery's soft time limit, another node's interruptions taking
    long) gave nothing back, and no later check can, as its look began after the stop."""
    if started_before is None:  # no probe time: every running instance of the node is judged by the answer
        return instance_svc.node_instances_interrupt(node_id=node.pk, since=since, cause=InterruptionCause.VM_LOST,
                                                     vm_ids=vm_ids, detail=detail)
    # The instances the fleet read as running since before the probe (`vm_ids`: their VMs, named by the platform),
    # whatever their state now (a stopped one keeps its run's start): those no longer running are given back, below.
    # One whose run began since (a restart done meanwhile) is left to _usage_after_loss_given_back.
    ids = sorted(int(m.group(1)) for m in map(_OUR_VM_ID.fullmatch, vm_ids) if m is not None)
    done = []
    for instance_id in Instance.objects.filter(node_id=node.pk, pk__in=ids, started_at__lt=started_before) \
            .order_by("pk").values_list("pk", flat=True):
        with transaction.atomic():
            if not Instance.objects.select_for_update().filter(
                    pk=instance_id, status=InstanceStatus.RUNNING, started_at__lt=started_before).exists():
                # Stopped, or running again since the probe: not interrupted (a run begun since is judged by the next
                # check). One whose billing a stop closed since the probe began is given back its time after `since`.
                instance_svc.lost_usage_give_back(instance_id=instance_id, since=since, looked_at=started_before,
                                                  answered_at=answered_at, detail=detail)
                continue
            if instance_svc.instance_interrupt(instance_id=instance_id, since=since, cause=InterruptionCause.VM_LOST,
                                               detail=detail) is not None:
                done.append(instance_id)
    return done


_DISK_LOST = ("Its VM and disk are no longer on the server (removed there while the instance was stopped), so it "
              "cannot be started again; its disk is billed up to the last health check that still listed it. "
              "Destroy it, and rent another instance to carry on.")


def _stopped_vms_lost(by_id: Mapping[int, HealthResult]) -> dict[int, dict[int, bool]]:
    """Per node whose answer lists its VMs, its stopped instances (stopped before the probe, no VM job open) whose
    VM the answer does not list, or lists missing (its container or domain removed on the node): their disk is
    gone. One read for the batch. Before, the check judged only running VMs: it ignored a stopped one's absence
    and moved the node's last_seen_at on, and the storage meter billed the vanished disk up to each check until
    the reconciler failed the instance, billed up to its own pass (found by review)."""
    looked = {node_id: r for node_id, r in by_id.items() if r.ok and r.vms is not None and r.probed_at is not None}
    if not looked:
        return {}
    rows = (Instance.objects.filter(node_id__in=looked, status=InstanceStatus.STOPPED, stopped_at__isnull=False)
            .exclude(pk__in=Job.objects.filter(OPEN, kind__in=VM_JOB_KINDS, instance__isnull=False)
                     .values("instance_id"))
            .order_by("pk").values_list("pk", "node_id", "stopped_at"))
    lost: dict[int, dict[int, bool]] = {}  # {node id: {instance id: nothing of its VM left, not even its record}}
    for pk, node_id, stopped_at in rows:
        vms, probed_at = looked[node_id].vms or {}, looked[node_id].probed_at
        state = vms.get(vm_id_of(pk))
        if stopped_at is not None and probed_at is not None and stopped_at < probed_at and (
                state is None or state == VM_MISSING):
            lost.setdefault(node_id, {})[pk] = state is None
    return lost


def _stopped_vms_lost_fail(node: Node, instance_ids: Mapping[int, bool], *, since: datetime | None,
                           probed_at: datetime | None) -> None:
    """Fail the stopped instances whose VM and disk the answer no longer lists, as the reconciler does
    (reconcile._judge_stopped), with their disk billed up to `since`: the node's previous answer, which listed the
    VM (had it not, that check would have failed the instance), but never past this probe's start (_sighting), or
    its stop when that came later. Decided under each instance's row lock: one started, destroyed, or stopped again
    since the probe is left as it is. `instance_ids`: {id: whether the answer does not list its VM at all}; such an
    instance has nothing left there (Instance.vm_gone: its disk room and volumes are free at once), while the record
    of a VM listed missing still counts as mounting its volumes until the reconciler removes it."""
    if since is None:  # never answered before: no sighting to bill up to; left to the reconciler
        return
    for instance_id, gone in sorted(instance_ids.items()):
        failed = instance_svc.instance_mark_failed(
            instance_id=instance_id, only_in=(InstanceStatus.STOPPED,), message=_DISK_LOST, disk_seen_at=since,
            stopped_before=probed_at, vm_gone=gone)
        if failed.status == InstanceStatus.FAILED:
            node_event(node=node, kind="vm_vanished",
                       message=f"The VM of instance {instance_id} (stopped) vanished with its disk.",
                       level=NodeEvent.Level.WARNING)


# A VM name the platform gives (marketplace.models.renting.vm_id_of): inst-<instance id>, in ASCII digits.
_OUR_VM_ID = re.compile(r"inst-([1-9][0-9]{0,18})", re.ASCII)


def _usage_after_loss_given_back(by_id: Mapping[int, HealthResult], last_healthy: Mapping[int, datetime | None],
                                 presence: Mapping[int, Presence]) -> None:
    """The instances whose VM an answer shows gone or stopped (or that held a card it shows missing), but that the
    check did not interrupt: their billing was closed after the probe began, by a stop, restart or destroy (a
    zero-balance stop, a failure) that came between the answer and the interruption, up to that moment, for a VM
    already lost. What their run was billed after the node's last healthy check (the VM's last sighting, where the
    interruption would have closed it) is given back (interruptions.lost_usage_give_back, which decides under the
    instance's lock and gives it once). Before, the interruption found them no longer running and did nothing: the
    renter paid up to a health interval for a VM that was gone. One read for the batch, usually empty: instances
    billed past their node's last healthy check that are not running since before its probe."""
    looked: dict[int, tuple[HealthResult, datetime, datetime]] = {}  # node id: (answer, probe began, last healthy)
    for node_id, result in by_id.items():
        since = _sighting(last_healthy.get(node_id), result.probed_at)
        if result.ok and result.probed_at is not None and since is not None and (
                result.vms is not None or (node_id in presence and presence[node_id].missing)):
            looked[node_id] = (result, result.probed_at, since)
    if not looked:
        return
    rows = (Instance.objects.filter(node_id__in=looked, billed_until__gt=min(s for _, _, s in looked.values()))
            .exclude(status=InstanceStatus.RUNNING, started_at__lt=min(p for _, p, _ in looked.values()))
            .order_by("pk").values_list("pk", "node_id", "status", "started_at", "billed_until"))
    moved: dict[int, list[int]] = {}
    for pk, node_id, status, started_at, billed_until in rows:
        _, probed_at, since = looked[node_id]
        if billed_until is not None and billed_until > since and not (
                status == InstanceStatus.RUNNING and started_at is not None and started_at < probed_at):
            moved.setdefault(node_id, []).append(pk)
    for node_id, ids in moved.items():
        result, probed_at, since = looked[node_id]
        gone, stopped = _vms_lost(result, {vm_id_of(pk) for pk in ids})
        cards = held_when(instance_ids=ids, gpu_ids=presence[node_id].missing, at=probed_at) \
            if node_id in presence else set()
        answered_at = probed_at + timedelta(seconds=result.seconds)
        for pk in ids:
            if pk in cards:  # a card is not taken down by a job of the instance: no job is asked about
                instance_svc.lost_usage_give_back(
                    instance_id=pk, since=since, looked_at=probed_at, answered_at=None,
                    detail="a GPU it holds is no longer listed by nvidia-smi on the server")
            elif vm_id_of(pk) in gone | stopped:
                instance_svc.lost_usage_give_back(
                    instance_id=pk, since=since, looked_at=probed_at, answered_at=answered_at,
                    detail="the server answers, but the VM is " + (
                        "no longer on it" if vm_id_of(pk) in gone else "not running on it"))


def _disk_after_loss_given_back(by_id: Mapping[int, HealthResult],
                                last_healthy: Mapping[int, datetime | None]) -> None:
    """The instances stopped before the probe whose VM (and disk) the answer does not list, or lists missing, but
    that the check did not fail (_stopped_vms_lost_fail): no longer stopped, their renter's start or destroy came
    after the probe began and billed their disk up to that request. What their disk was billed after the node's
    last healthy check (the disk's last sighting, where the failure would have ended it) is given back
    (interruptions.lost_disk_give_back, which decides under the instance's lock and gives it once). One read for
    the batch, as _usage_after_loss_given_back: usually empty."""
    # node id: (its VMs as answered, the answer's seconds, probe began, last healthy)
    looked: dict[int, tuple[Mapping[str, str], float, datetime, datetime]] = {}
    for node_id, result in by_id.items():
        since = _sighting(last_healthy.get(node_id), result.probed_at)
        if result.ok and result.vms is not None and result.probed_at is not None and since is not None:
            looked[node_id] = (result.vms, result.seconds, result.probed_at, since)
    if not looked:
        return
    rows = (Instance.objects.filter(node_id__in=looked, stopped_at__lt=max(p for _, _, p, _ in looked.values()),
                                    disk_billed_until__gt=min(s for _, _, _, s in looked.values()))
            .exclude(status=InstanceStatus.STOPPED).order_by("pk")
            .values_list("pk", "node_id", "stopped_at", "disk_billed_until"))
    for pk, node_id, stopped_at, disk_billed_until in rows:
        vms, seconds, probed_at, since = looked[node_id]
        if stopped_at is not None and stopped_at < probed_at and disk_billed_until is not None \
                and disk_billed_until > since and vms.get(vm_id_of(pk), VM_MISSING) == VM_MISSING:
            instance_svc.lost_disk_give_back(
                instance_id=pk, since=since, looked_at=probed_at,
                answered_at=probed_at + timedelta(seconds=seconds),
                detail="the server answers, but the stopped VM and its disk are no longer on it")


def _vms_lost(result: HealthResult, running: set[str]) -> tuple[set[str], set[str]]:
    """Of the VMs `running` (their instances running since before the probe), those an answer shows gone and those
    it shows stopped."""
    if not result.ok or result.vms is None:
        return set(), set()
    # Gone: not listed, or listed `missing` (recorded on the node, its container or domain removed there); the
    # reconciler that follows fails its instance. Stopped: started again by that reconciler.
    gone = running & ({vm_id for vm_id, state in result.vms.items() if state == VM_MISSING}
                      | (running - set(result.vms)))
    stopped = running & {vm_id for vm_id, state in result.vms.items()
                         if state not in ("running", VM_MISSING, VM_UNKNOWN, VM_RESTARTING)}
    return gone, stopped


RESTARTING_MESSAGE = ("Its container keeps exiting and the server starts it again (an image without the /bin/sh the "
                      "platform's entry script runs on, or one that runs out of memory), so SSH may not answer. See "
                      "its logs. It holds its GPUs and is billed as running until you stop or destroy it.")


def instances_restarting_told(*, node_id: int, vm_ids: set[str]) -> None:
    """Tell the renters of running instances whose VM the node lists as restarting, once (their status message).
    Such an instance is neither interrupted nor judged lost: its container is the renter's own image, on the
    instance's GPUs, and the engine keeps running it; the message goes when the VM is seen running again."""
    ids = [pk for pk in Instance.objects.filter(node_id=node_id, status=InstanceStatus.RUNNING)
           .exclude(status_message=RESTARTING_MESSAGE).values_list("pk", flat=True) if vm_id_of(pk) in vm_ids]
    for instance_id in ids:
        instance_svc.instance_set_status_message(instance_id=instance_id, message=RESTARTING_MESSAGE,
                                                 only_in=(InstanceStatus.RUNNING,))


def instances_running_again(*, node_id: int, vm_ids: set[str]) -> None:
    """The restarting message goes from running instances whose VM the node lists as running again."""
    ids = [pk for pk in Instance.objects.filter(node_id=node_id, status=InstanceStatus.RUNNING,
                                                status_message=RESTARTING_MESSAGE).values_list("pk", flat=True)
           if vm_id_of(pk) in vm_ids]
    if ids:
        Instance.objects.filter(pk__in=ids, status=InstanceStatus.RUNNING, status_message=RESTARTING_MESSAGE) \
            .update(status_message="", updated_at=timezone.now())


def _gpus_changed(node: Node, reported_hash: str) -> bool:
    """Whether an active node reports other GPUs than it was verified with (node_inventory_changed decides)."""
    stored = (node.inventory or {}).get("gpus")
    return node.state == NodeState.ACTIVE and stored is not None and gpus_hash(stored) != reported_hash


def announced_downtime(failed: Sequence[Node]) -> set[int]:
    """Of these nodes whose check failed, those whose provider announced the downtime: in maintenance with no renter on
    it (marketplace.selectors.node_in_use_q: an instance not over, stopped ones included, GPUs still held, or a
    renter's volume). Their failed checks are counted in neither column of the day's sample, so announced maintenance
    does not lower the reliability figure (before, a node powered off for an announced maintenance lost as much as
    one that failed unannounced: 10 checks answered and 10 failed in maintenance gave 0.5; found by review). Its
    answered checks still count, and its failures in a row still do (node_return_state: offline when maintenance ends
    on a failed check). With renters on it, maintenance excuses nothing: a provider could otherwise hide an outage
    its renters lived through (their instances interrupted as on any node) by announcing maintenance once it began. A
    read only when some node in maintenance failed its check."""
    in_maintenance = [n.pk for n in failed if n.state == NodeState.MAINTENANCE]
    if not in_maintenance:
        return set()
    rented = set(Node.objects.filter(node_in_use_q(), pk__in=in_maintenance).values_list("pk", flat=True))
    return set(in_maintenance) - rented


def health_samples_record(*, ok_ids: Sequence[int], failed_ids: Sequence[int], day: date) -> None:
    """Count one check for each node in its row for `day`: the missing rows inserted, then one UPDATE."""
    ids = [*ok_ids, *failed_ids]
    if not ids:
        return
    HealthSample.objects.bulk_create([HealthSample(node_id=i, day=day) for i in ids], ignore_conflicts=True)
    HealthSample.objects.filter(day=day, node_id__in=ids).update(
        ok=F("ok") + Case(When(node_id__in=list(ok_ids), then=Value(1)), default=Value(0)),
        failed=F("failed") + Case(When(node_id__in=list(failed_ids), then=Value(1)), default=Value(0)),
    )


def nodes_reliability(*, node_ids: Sequence[int], now: datetime) -> dict[int, float]:
    """reliability.node_reliability for many nodes: two grouped reads."""
    since = now - timedelta(days=RELIABILITY["window_days"])
    checks = {row["node_id"]: (row["ok_sum"] or 0, row["failed_sum"] or 0) for row in
              HealthSample.objects.filter(node_id__in=node_ids, day__gt=since.date()).values("node_id")
              .annotate(ok_sum=Sum("ok"), failed_sum=Sum("failed")).order_by()}
    failed_jobs = dict(failed_jobs_counted(since=since).filter(node_id__in=node_ids)
                       .values("node_id").annotate(n=Count("id")).order_by().values_list("node_id", "n"))
    values = {}
    for node_id in node_ids:
        ok, failed = checks.get(node_id, (0, 0))
        if not ok + failed:
            values[node_id] = 0.0
            continue
        value = ok / (ok + failed) - RELIABILITY["failed_job_penalty"] * failed_jobs.get(node_id, 0)
        values[node_id] = round(min(1.0, max(0.0, value)), 4)
    return values
