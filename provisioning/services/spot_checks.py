"""Spot checks: at a random time (maintenance.nodes_reverify_due), the platform's challenge and memory proof on an
active node's idle GPUs, nothing else; a finding queues a full verification, whose verdict speaks for the node.
A spot check the node dodges (it drops the connection, falls silent, answers garbage or refuses) brings the node's
next full verification forward (verification.node_check_forward): dodging a spot check buys nothing.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from marketplace.models import GpuStatus, Node, NodeState, SliceStatus
from marketplace.stored_figures import run_findings
from provisioning.models import OPEN_JOB_STATUSES, Job, JobFault, JobKind, NodeEvent
from provisioning.services.faults import NOT_COUNTED, counts_against_node, error_fault
from provisioning.services.jobs import job_create
from provisioning.services.nodes import node_event, node_session
from provisioning.services.platform_checks import node_challenge, node_memory_proof, node_slice_challenge
from provisioning.services.runner import job_finish, job_step, log_lines
from provisioning.services.verification import CHECKS_KEPT_STATES, node_check_forward, node_verify_request
from provisioning.ssh_errors import AgentFailed, AgentGarbage, AgentTimeout, AuthFailed, NodeError, NodeUnreachable
from provisioning.verification.answers import MalformedAnswer, inventory_problems
from provisioning.verification.model import DeclaredModel, Finding


@transaction.atomic
def node_spot_check_request(*, node: Node) -> Job | None:
    """Queue a spot check of an active node's idle GPUs (maintenance.nodes_reverify_due, at a random time).
    None, with nothing queued, while any node job (a verification, another spot check) is open: the two never
    run at once. The node stays active and bookable; nothing is allocated."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state != NodeState.ACTIVE:
        return None
    if node.jobs.filter(instance__isnull=True, volume__isnull=True, status__in=OPEN_JOB_STATUSES).exists():
        return None
    job = job_create(kind=JobKind.NODE_SPOT_CHECK, node=node)
    job_step(job=job, message="queued: spot check at a random time")
    return job


def node_spot_check_run(*, job: Job) -> None:
    """The spot check, on a worker: the platform's challenge (verification/challenge.py) and memory proof
    (verification/memproof.py) on the node's GPUs that no renter holds now, and on its free MIG slices
    (node_slice_challenge, as a verification's), nothing else. The node is not taken out of `active` and no GPU is
    allocated: a renter may book one meanwhile, but its VM is created (or started) only once this job is no longer
    running with its worker beating (vms._node_check_under_way: its heartbeat younger than JOB_HEARTBEAT_STALE_S, at
    most NODE_CHECK_WAIT_MAX_S; review r54 #4; a re-verification is waited for alike). Started late, it works past its
    deadline and still holds bookings while it beats; a lost worker's holds them no longer. This job is marked running
    (runner.job_begin) before the free cards are read below, so a booking that commits after that read has a VM job that
    sees it running; one committed before it holds its cards, which are not tested. A clean answer is recorded (an event
    operators see); a finding (a wrong result, too slow or too fast, memory not held, no answer) queues a full
    verification at once, whose verdict speaks for the node: a spot check alone judges nothing. A free card the node's
    inventory leaves out is a dodge (spot_check_dodged's rule): the full verification is brought forward. Raises
    NodeError if the node cannot be reached."""
    node = job.node
    if node.state != NodeState.ACTIVE:
        _node_left_active(job, node)
        return
    if not (node.gpus.filter(status=GpuStatus.FREE).exists()
            or node.mig_slices.filter(status=SliceStatus.FREE).exists()):
        job_step(job=job, message="every GPU and MIG slice is rented: skipped")
        node_event(node=node, kind="spot_check_skipped",
                   message="Spot check skipped: every GPU and MIG slice is rented.")
        job_finish(job=job)
        return
    declared = DeclaredModel.from_gpu_model(node.gpu_model)
    job_step(job=job, message=f"connecting to {node.address}:{node.ssh_port}")
    findings: list[Finding] = []
    figures: dict[str, Any] = {}
    with node_session(node) as session:
        # Which card is which is read from nvidia-smi now, by UUID (free_cards_now): the stored indices are the last
        # verification's, and nvidia-smi may have numbered the cards anew since (a reboot, a card moved).
        inventory = session.agent("inventory")
        problems = inventory_problems(inventory)
        if problems:  # nothing of it is read: the full verification it queues judges it
            finding = MalformedAnswer("inventory", problems).finding
            node_spot_check_conclude(job=job, gpus=[], findings=[finding.as_dict()], figures={})
            return
        free, slices = free_cards_now(node, inventory), free_slices_now(node, inventory)
        missing = missing_free_cards(node, inventory)
        if missing:
            # Left out of this answer only (the health checks' gpu_presence sees a card off the bus within a
            # minute): not a clean skip, a dodge as a dropped connection is (review r54).
            _free_cards_missing(job, node, missing)
        if not free and not slices:
            if missing:
                job_finish(job=job, error=f"Free GPU {', '.join(map(str, missing))} did not answer to nvidia-smi: "
                                          "nothing to check.", fault=JobFault.NODE)
                node_check_forward(node_id=job.node_id)
                return
            job_step(job=job, message="no free GPU or MIG slice answers to nvidia-smi: skipped")
            node_event(node=node, kind="spot_check_skipped",
                       message="Spot check skipped: no free GPU or MIG slice of the node answers to nvidia-smi.")
            job_finish(job=job)
            return
        if free:
            findings, figures = node_challenge(job, session, declared, free)
            proved, proof = node_memory_proof(job, session, declared, free, inventory)
            findings, figures = findings + proved, {**figures, "memory_proof": proof}
        if slices:
            found, slice_figures, _ = node_slice_challenge(job, session, declared, inventory, slices)
            findings, figures = findings + found, {**figures, "mig_slices": slice_figures}
    node_spot_check_conclude(job=job, gpus=free, findings=[f.as_dict() for f in findings], figures=figures,
                             slices=len(slices))
    if missing:
        node_check_forward(node_id=job.node_id)


def _node_left_active(job: Job, node: Node) -> None:
    """The node is not active when its spot check comes to run: superseded (the provider's maintenance, an operator,
    the health checks), nothing failed in the check. But the spot check is not spent: the node left `active` after
    it was queued (a spot check is queued only for an active node), so it is due again
    (Node.next_spot_check_at = now) and the beat queues it once the node is active. Before, the next one was drawn
    6-42 h away when this one was queued, and a maintenance toggle while it waited dodged it at no cost (review
    r54). A try before this one that the node cut short (a connection dropped, an agent fallen silent: the task
    retried it) and then the node leaving `active` is a dodge: its full verification is brought forward, as once
    the task's retries are spent (node_spot_check_failed)."""
    message = f"The node is {node.state}, not active; nothing done."
    if node.state != NodeState.RETIRED:
        now = timezone.now()
        Node.objects.filter(pk=node.pk).filter(Q(next_spot_check_at__isnull=True) | Q(next_spot_check_at__gt=now)) \
            .update(next_spot_check_at=now, updated_at=now)
        message += " The spot check runs again once it is active."
        if _cut_short_by_the_node(job):
            node_event(node=node, kind="spot_check_failed_to_run", level=NodeEvent.Level.WARNING,
                       message="Spot check could not run: the node dropped it, then left active "
                               f"({node.state}). A full verification follows once it is active again.")
            node_check_forward(node_id=node.pk)
    job_finish(job=job, error=message, fault=JobFault.PLATFORM)


def _cut_short_by_the_node(job: Job) -> bool:
    """Whether an earlier try of this job ended on a transient error of the node's (the task retries only those,
    runner.run_job): not a try that waited for the platform's own SSH slots ("waiting for the node", NodeBusy),
    nor a worker lost (lost_runs)."""
    waited = any(str(line.get("message", "")).startswith("waiting for the node") for line in log_lines(job.log))
    return job.attempts > 1 and not job.lost_runs and not waited


def _free_cards_missing(job: Job, node: Node, missing: list[int]) -> None:
    cards = f"GPU{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
    job_step(job=job, message=f"free {cards} missing from nvidia-smi's answer: a full verification follows")
    node_event(node=node, kind="spot_check_gpu_missing", level=NodeEvent.Level.WARNING,
               message=f"Spot check: the node's free {cards} did not answer to nvidia-smi, so could not be checked. "
                       "A full verification follows.")


def free_cards_now(node: Node, inventory: dict[str, Any]) -> list[int]:
    """The nvidia-smi indices, in this inventory, of the node's cards that no renter holds: a card is found by its
    UUID, by its stored index only where its row has none (a UUID claimed by no row: repeated, or never read) and
    the card answering there reports no UUID another row holds. Before, the stored indices were taken as they were:
    after nvidia-smi numbered the cards anew, a renter's card was challenged in place of the free one."""
    rows = list(node.gpus.values_list("index", "uuid", "status"))
    known = {uuid for _, uuid, _ in rows if uuid}
    free_uuids = {uuid for _, uuid, status in rows if uuid and status == GpuStatus.FREE}
    free_bare = {index for index, uuid, status in rows if not uuid and status == GpuStatus.FREE}
    cards = inventory.get("gpus") or []
    seen = Counter(gpu.get("uuid") for gpu in cards if gpu.get("uuid"))
    free = []
    for gpu in cards:
        uuid, index = gpu.get("uuid"), gpu.get("index")
        if seen[uuid] > 1:
            continue  # one UUID on several cards tells none of them apart (gpu_uuid_repeated: a verification's)
        if uuid in free_uuids or (uuid not in known and index in free_bare):
            free.append(index)
    return sorted(free)


def free_slices_now(node: Node, inventory: dict[str, Any]) -> list[str]:
    """The UUIDs of the node's free MIG slices that this inventory lists once, as node_verify_run finds them: a
    card split into slices has status `mig`, never `free`, so before, a node whose idle capacity was slices was
    never spot-checked (review r54)."""
    devices = inventory.get("mig") or []
    seen = Counter(d.get("uuid") for d in devices if d.get("uuid"))
    free = set(node.mig_slices.filter(status=SliceStatus.FREE).exclude(uuid="").values_list("uuid", flat=True))
    return sorted(uuid for uuid, count in seen.items() if count == 1 and uuid in free)


def missing_free_cards(node: Node, inventory: dict[str, Any]) -> list[int]:
    """The stored indices of the node's free cards whose UUID this inventory does not list."""
    listed = {gpu.get("uuid") for gpu in inventory.get("gpus") or []}
    return sorted(index for index, uuid in node.gpus.filter(status=GpuStatus.FREE).exclude(uuid="")
                  .values_list("index", "uuid") if uuid not in listed)


@transaction.atomic
def node_spot_check_conclude(*, job: Job, gpus: list[int], findings: list[dict[str, Any]],
                             figures: dict[str, Any], slices: int = 0) -> Job | None:
    """Record the spot check's outcome; with findings the node's verdict does not already carry, queue a full
    verification naming them (returned). One it carries (a GPU degraded at the last verification, seen again)
    changes nothing: a full check queued each time made the spot checks' rhythm (a day) the full check's
    (found by review). Queued only while the node is active: a verification takes a node out of its provider's
    maintenance (a full benchmark on a server being worked on, review r54), so one that left `active` during the
    check gets it due at once (Node.next_check_at = now) and the beat queues it once it is active again, as
    verification._reverify_new_layout does."""
    node = Node.objects.select_for_update(no_key=True).get(pk=job.node_id)
    parts = [f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))}"] if gpus else []
    if slices:
        parts.append(f"{slices} MIG slice{'s' if slices > 1 else ''}")
    which = " and ".join(parts) or "the node"
    rates = [row.get("bf16_tflops") for row in (figures.get("gpus") or {}).values() if row.get("bf16_tflops")]
    measured = f" ({', '.join(f'{r:g}' for r in rates)} TFLOP/s BF16 measured by the platform)" if rates else ""
    if not findings:
        job_step(job=job, message=f"spot check of {which}: clean{measured}")
        node_event(node=node, kind="spot_check_passed",
                   message=f"Spot check of {which} passed the platform's challenge and memory "
                           f"proof{measured}.")
        job_finish(job=job)
        return None
    codes = ", ".join(sorted({f["code"] for f in findings}))
    job_step(job=job, message=f"spot check of {which}: {codes}")
    new = _not_on_the_verdict(node, findings)
    active = node.state == NodeState.ACTIVE
    if not new:
        outcome = " The node's verdict already says so."
    elif active:
        outcome = " A full verification was queued."
    else:
        outcome = f" A full verification follows once the node is active again (it is {node.state} now)."
    node_event(node=node, kind="spot_check_failed",
               message=f"Spot check of {which}: {codes}. " + " ".join(f["message"] for f in findings) + outcome,
               level=NodeEvent.Level.WARNING)
    job_finish(job=job)  # closed first: one node job at a time (job_one_open_node_job_per_node)
    if not new:
        return None
    if not active:
        if node.state in CHECKS_KEPT_STATES:
            now = timezone.now()
            Node.objects.filter(pk=node.pk).update(next_check_at=now, updated_at=now)
        return None
    return node_verify_request(node=node, reason=f"spot check found {codes}")


def _not_on_the_verdict(node: Node, findings: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The findings the node's latest verification did not make (the same code on the same GPU), and every one
    that rejects: a node listed with it must be judged again."""
    run = node.verifications.order_by("-created_at", "-id").only("findings").first()
    # Its stored findings read well-typed (stored_figures.run_findings): a string or a list of strings stored before
    # the answers were checked was an AttributeError, the spot check's job lost (found by review).
    known = {(f.get("code"), f.get("gpu_index")) for f in run_findings(run.findings if run else [])}
    return [f for f in findings
            if f.get("severity") == "reject" or (f.get("code"), f.get("gpu_index")) not in known]


def spot_check_dodged(error: NodeError) -> bool:
    """Whether the spot check failed by the node's doing: the connection broke or the node fell silent (past the
    task's retries), its agent answered garbage or refused, it refused the platform's key. Not a changed host key
    (quarantined already), nor any failure that is not the node's (faults.error_fault: a busy node, whose
    sessions are the platform's own, a node key of its own it cannot read, the platform's own failure or time)."""
    return counts_against_node(error) and isinstance(
        error, NodeUnreachable | AgentTimeout | AgentGarbage | AgentFailed | AuthFailed)


def node_spot_check_failed(*, job: Job, error: NodeError) -> None:
    """The node could not be spot-checked: said in an event. When the node dodged it (spot_check_dodged), its next
    full verification is brought forward, at most one per SPOT_CHECK_FORWARD_MIN_S after its last (node_check_forward),
    so that dropping the challenge is no way out of it and an honestly flaky node is not checked in a loop. Else
    (busy till the deadline, the platform's own failure) the next spot check comes at its drawn time."""
    dodged, fault = spot_check_dodged(error), error_fault(error)
    message = f"Spot check could not run: {error.message}"
    if dodged:
        message = message.rstrip(".") + ". A full verification follows."
    elif fault != JobFault.NODE:
        message = f"{message.rstrip()} {NOT_COUNTED[fault]}"
    node_event(node=job.node, kind="spot_check_failed_to_run", message=message,
               level=NodeEvent.Level.WARNING if dodged else NodeEvent.Level.INFO)
    job_finish(job=job, error=error.message, fault=fault)  # closed first: one node job at a time
    if dodged:
        node_check_forward(node_id=job.node_id)
