"""Verifying a node: queue the check, run it over SSH (inventory, the benchmark, the platform's own checks in
platform_checks.py), judge it with the acceptance policy, record it, and list, flag or reject the node; an
operator accepting a quarantined node's new host key, which verifies it again. Spot checks of an active node's
idle GPUs: spot_checks.py. (Re-verification and spot checks at random times: maintenance.nodes_reverify_due.)

A node that is active is re-verified in place: it stays active (and bookable) while the check runs; a VM
booked meanwhile is created once the check has ended (vms._node_check_under_way), not on a card under test. If a
re-verification rejects a node that renters are using, the node stays active for them (its verdict keeps it
off the offers), operators get a critical event and the renters a status message.
"""
from __future__ import annotations

import math
import secrets
import statistics
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from billing.services.low_balance import billing_profile_lock
from billing.services.storage import node_storage_outage_end
from core.errors import Conflict, TooManyRequests
from core.sql import constraint_violated
from marketplace.mig import layout_by_gpu
from marketplace.models import (
    GpuAllocation,
    Instance,
    InstanceStatus,
    MigSliceAllocation,
    Node,
    NodeState,
    Runtime,
    Verdict,
)
from marketplace.models.nodes import LISTABLE_VERDICTS, PROVEN_LIVE
from marketplace.models.renting import FINAL_STATUSES
from marketplace.services import instances as instance_svc
from marketplace.services.nodes import SIM_REFUSED, node_in_use
from notifications.services.notify import Kind, notify
from provisioning.models import OPEN_JOB_STATUSES, Job, JobFault, JobKind, JobStatus, NodeEvent, VerificationRun
from provisioning.selectors import fleet_reference
from provisioning.services.faults import NOT_COUNTED, counts_against_node, error_fault
from provisioning.services.host_facts import node_apply_host_facts
from provisioning.services.jobs import JobConflict, job_create, job_send_again_if_unsent
from provisioning.services.mig import cards_awaiting, node_apply_mig_slices
from provisioning.services.nodes import (
    DuplicateHardware,
    node_apply_inventory,
    node_event,
    node_session,
)
from provisioning.services.platform_checks import (
    node_challenge,
    node_memory_proof,
    node_network_test,
    node_slice_challenge,
)
from provisioning.services.runner import job_finish, job_step
from provisioning.ssh_errors import (
    AgentAnswerRefused,
    AgentFailed,
    AgentGarbage,
    AgentTimeout,
    AuthFailed,
    HostKeyMismatch,
    NodeError,
    NodeUnreachable,
)
from provisioning.verification import challenge_verdict
from provisioning.verification.answers import MalformedAnswer, benchmark_problems, inventory_problems, storable
from provisioning.verification.mig import judge_mig, pending_layout, repeated_mig_findings
from provisioning.verification.model import REJECT, DeclaredModel, Finding
from provisioning.verification.policy import judge
from provisioning.verification.tolerances import TOLERANCES
from provisioning.verification.wording import reasons_text

# How long the platform waits for the benchmark's answer beyond the bound the agent enforces on itself.
BENCHMARK_SSH_MARGIN_S = 30
BENCHMARK_DEVICE = "cuda"  # the verification's benchmark runs on the GPUs, never the agent's CPU mode


class BenchmarkTimeout(NodeError):
    """The benchmark ran past its bound. Not retried: a benchmark that hangs once likely hangs again."""

    code = "benchmark_timeout"
    fault = JobFault.NODE  # faults.error_fault


# The node-level job kinds (no instance): one of them open per node at a time (job_one_open_node_job_per_node).
NODE_JOB_KINDS = (JobKind.NODE_VERIFY, JobKind.NODE_SPOT_CHECK)
# The verdicts the provider is told about (when a check changes the node's verdict to one of them).
NOTIFIED_VERDICTS: dict[str, str] = {Verdict.REJECTED: Kind.NODE_REJECTED, Verdict.DEGRADED: Kind.NODE_DEGRADED}


# A check whose node its provider retired while it ran: superseded, nothing judged (node_verify_run, _conclude).
RETIRED_DURING_CHECK = "The node was retired during its check; nothing more was done or judged."


def draw_delay(min_s: int, max_s: int) -> timedelta:
    """A delay drawn uniformly between min_s and max_s from the system's CSPRNG (secrets): the times of the next
    checks follow from no data anyone outside the platform sees (not the node's id, not the last check's time),
    so a provider cannot tell when a node will next be checked, only that it will be within the published bounds."""
    low, high = sorted((max(int(min_s), 0), max(int(max_s), 0)))
    return timedelta(seconds=low + secrets.randbelow(high - low + 1))


# Draws of the exponential's uniform variable: 53 bits, a float's mantissa.
_UNIFORM_BITS = 53


def draw_spot_gap() -> timedelta:
    """The time to a node's next spot check, drawn from `secrets` so that a check just ended promises no quiet
    time: SPOT_CHECK_MIN_S (a small floor) plus an exponential, memoryless gap, at most SPOT_CHECK_MAX_S, its mean
    SPOT_CHECK_MEAN_S. Before, it was uniform between 6 and 42 h: for 6 h after each spot check (an SSH login and
    the challenge the provider sees) none could come, a safe window to use the idle cards elsewhere (review r54).
    Now, whatever time has passed since the last one, the next is as likely in the coming hour (about 4 % at the
    defaults) as ever."""
    floor, cap = sorted((max(int(settings.SPOT_CHECK_MIN_S), 0), max(int(settings.SPOT_CHECK_MAX_S), 0)))
    mean = min(max(float(settings.SPOT_CHECK_MEAN_S), floor), cap)
    if cap <= floor or mean <= floor:
        return timedelta(seconds=floor)
    scale = exponential_scale(mean - floor, cap - floor)
    uniform = (secrets.randbelow(1 << _UNIFORM_BITS) + 1) / (1 << _UNIFORM_BITS)  # in (0, 1]
    return timedelta(seconds=floor + min(-scale * math.log(uniform), cap - floor))


def exponential_scale(mean: float, cap: float) -> float:
    """The scale of an exponential that, cut at `cap`, has this mean: E[min(X, cap)] = scale * (1 - e^(-cap/scale)),
    which grows with the scale towards `cap`; solved by bisection (a mean at the cap gets a scale of 1e12 s)."""
    def cut_mean(scale: float) -> float:
        return scale * -math.expm1(-cap / scale)

    low, high = mean, mean
    while cut_mean(high) < mean and high < 1e12:
        high *= 2
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if cut_mean(middle) < mean else (low, middle)
    return high


def node_draw_next_checks(node: Node, *, now: datetime | None = None, spot: bool = True) -> None:
    """When a verification ends: draw the node's next full check (REVERIFY_MIN_S..REVERIFY_MAX_S) and, with
    `spot`, its next spot check (draw_spot_gap), in memory (the caller saves)."""
    now = now or timezone.now()
    node.next_check_at = now + draw_delay(settings.REVERIFY_MIN_S, settings.REVERIFY_MAX_S)
    if spot:
        node.next_spot_check_at = now + draw_spot_gap()


# The states a node's drawn check times are kept through: it comes back active from them (node_return_state), and
# maintenance.nodes_reverify_due queues what is due then.
CHECKS_KEPT_STATES = (NodeState.ACTIVE, NodeState.MAINTENANCE, NodeState.OFFLINE)


def node_check_forward(*, node_id: int, now: datetime | None = None) -> datetime | None:
    """Bring a node's next full verification forward (a spot check it dodged: spot_checks.py), to now but never
    sooner than SPOT_CHECK_FORWARD_MIN_S after its last recorded verification: an honestly flaky node is checked
    again, not in a loop. maintenance.nodes_reverify_due queues it when the time comes: at once for an active
    node, once it is active again for one in maintenance or offline (a dodge followed by a maintenance toggle is no
    way out of it: review r54). Returns the time set, or None when nothing was moved (in no state it returns
    active from, or due sooner already)."""
    now = now or timezone.now()
    with transaction.atomic():
        node = Node.objects.select_for_update(no_key=True).get(pk=node_id)
        if node.state not in CHECKS_KEPT_STATES:
            return None
        last = node.verifications.order_by("-created_at").values_list("created_at", flat=True).first()
        at = max(now, last + timedelta(seconds=settings.SPOT_CHECK_FORWARD_MIN_S)) if last else now
        if node.next_check_at is not None and node.next_check_at <= at:
            return None
        node.next_check_at = at
        node.save(update_fields=["next_check_at", "updated_at"])
        return at


class VerifyCooldown(TooManyRequests):
    """The node's provider asked for a verification within NODE_VERIFY_COOLDOWN_S of the end of its last one that
    ended with a verdict (429, code verify_cooldown). The times ride along (`finished_at`, `available_at`, and in
    the API's body), and `retry_after`, the whole seconds to wait (the answer's Retry-After)."""

    code = "verify_cooldown"

    def __init__(self, *, node_id: int, verdict: str, finished_at: datetime, available_at: datetime,
                 now: datetime) -> None:
        finished_at, available_at = finished_at.astimezone(UTC), available_at.astimezone(UTC)
        self.node_id, self.verdict, self.finished_at, self.available_at = node_id, verdict, finished_at, available_at
        self.retry_after = max(1, math.ceil((available_at - now).total_seconds()))
        self.every = _duration(max(int(settings.NODE_VERIFY_COOLDOWN_S), 0))  # "15 minutes"
        # The time a page shows in minutes (HH:MM): rounded up, so that asking at the minute shown is never refused.
        self.available_minute = (available_at if not (available_at.second or available_at.microsecond) else
                                 available_at.replace(second=0, microsecond=0) + timedelta(minutes=1))
        minutes = math.ceil(self.retry_after / 60)
        wait = (f"{self.retry_after} second{'s' if self.retry_after != 1 else ''}" if self.retry_after < 120
                else f"{minutes} minutes")
        super().__init__(
            f"Node {node_id} was last verified at {finished_at:%Y-%m-%d %H:%M:%S} UTC (verdict: {verdict}); its "
            f"next verification may be asked for from {available_at:%Y-%m-%d %H:%M:%S} UTC, in {wait}. A node is "
            f"verified again at its provider's request at most once per {self.every} "
            "after a check that reached a verdict; nothing was queued.",
            extra={"code": self.code, "node": node_id, "verdict": verdict,
                   "last_verified_at": finished_at.isoformat(), "verify_again_at": available_at.isoformat()})


def _duration(seconds: int) -> str:
    """900 -> "15 minutes", 3600 -> "1 hour", 90 -> "90 seconds"."""
    if seconds % 3600 == 0:
        return f"{seconds // 3600} hour{'s' if seconds != 3600 else ''}"
    if seconds % 60 == 0:
        return f"{seconds // 60} minute{'s' if seconds != 60 else ''}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"


def node_verify_cooldown(node: Node, *, now: datetime | None = None) -> VerifyCooldown | None:
    """The refusal the node's provider would get for asking for its verification now, or None when they may.
    Counted from the end of its last verification that ended with a verdict (its job succeeded with a
    VerificationRun: passed, degraded or rejected, whoever asked for it, the schedule's included): a check that
    ended without one (unreachable, the platform's key refused, a host key, the platform's own failure, superseded)
    is one the provider must be able to retry at once, once they fixed the address or key, so it neither starts a
    cooldown nor ends one. The first verification of a node has none to wait for."""
    cooldown = max(int(settings.NODE_VERIFY_COOLDOWN_S), 0)
    if not cooldown:
        return None
    last = (Job.objects.filter(node_id=node.pk, kind=JobKind.NODE_VERIFY, status=JobStatus.SUCCEEDED,
                               verification__isnull=False, finished_at__isnull=False)
            .order_by("-finished_at", "-pk").values_list("finished_at", "verification__verdict").first())
    if last is None:
        return None
    finished_at, verdict = last
    if finished_at is None:  # not so (finished_at__isnull=False): for the type checker
        return None
    now = now or timezone.now()
    available_at = finished_at + timedelta(seconds=cooldown)
    if available_at <= now:
        return None
    return VerifyCooldown(node_id=node.pk, verdict=verdict, finished_at=finished_at, available_at=available_at,
                          now=now)


def node_verify_deferred(node: Node, *, now: datetime | None = None) -> tuple[VerifyCooldown, datetime] | None:
    """For the platform's own checks that its provider's change of the node starts: its GPU inventory changed (a
    power limit, MIG or ECC mode, the driver: reliability.node_inventory_changed) or its MIG layout changed during a
    check (_reverify_new_layout). The provider can make such a change at will and undo it (`nvidia-smi -pl`), so
    these are bound by the provider's cooldown too: else each flip would be a fresh verdict at once, the re-roll
    NODE_VERIFY_COOLDOWN_S stops (found by review). None: no cooldown, the caller queues the check now. Else the
    refusal and when the check is due: the node's next full check (Node.next_check_at, what
    maintenance.nodes_reverify_due queues an active node's check by) brought forward to the cooldown's end, unless
    it is due sooner already (a drawn time, a dodged spot check: not the provider's to choose)."""
    now = now or timezone.now()
    refusal = node_verify_cooldown(node, now=now)
    if refusal is None:
        return None
    at = refusal.available_at
    Node.objects.filter(Q(next_check_at__isnull=True) | Q(next_check_at__gt=at), pk=node.pk) \
        .update(next_check_at=at, updated_at=now)
    due = Node.objects.filter(pk=node.pk).values_list("next_check_at", flat=True).first() or at
    return refusal, max(due, now)


@transaction.atomic
def node_verify_request(*, node: Node, reason: str = "", by_provider: bool = False) -> Job:
    """Queue a verification (the provider after installing the key, the schedule, a changed inventory).
    Idempotent: while one is queued or running, that one is returned. An active node stays active.
    `by_provider`: its provider asked (the API's POST .../verify/ and the Verify button, nothing else): refused
    with VerifyCooldown within NODE_VERIFY_COOLDOWN_S of its last check with a verdict (node_verify_cooldown).
    Operators (the admin's Re-verify, the API's verify of another provider's node) and the platform's own checks
    (the schedule, a changed inventory, a spot check's findings, a first contact at a changed endpoint, a MIG
    layout changed during a check, pending nodes' retries) are not bound by it."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    open_job = node.jobs.filter(kind__in=NODE_JOB_KINDS, status__in=OPEN_JOB_STATUSES).first()
    if open_job is not None and open_job.kind == JobKind.NODE_SPOT_CHECK:
        # A spot check lasts a minute or two: the verification waits for it (job_one_open_node_job_per_node).
        raise JobConflict(f"A spot check of node {node.pk} is under way; try again in a few minutes.")
    if open_job is not None:
        job_send_again_if_unsent(open_job)  # one the broker never took (it was down): now, not at the next dispatch
        return open_job
    if not node.verify_allowed():
        raise Conflict(f"A {node.state} node cannot be verified.")
    if by_provider:
        # Under the node's lock, which a check's conclusion takes too: its verdict is either seen or not yet made.
        refusal = node_verify_cooldown(node)
        if refusal is not None:
            raise refusal
    if node.state in (NodeState.PENDING, NodeState.REJECTED):
        # Nobody checked it there (watched_nodes): storage left on it (a volume on a node rejected before volumes
        # kept a node in use) is not billed for that time, quarantine's rule (node_accept_host_key); before, its
        # verification marked it seen and the meter billed the whole unwatched time at once (found by review r53).
        node_id = node.pk
        transaction.on_commit(lambda: node_storage_outage_end(node_id=node_id, unseen=True), robust=True)
    if node.state not in (NodeState.VERIFYING, NodeState.ACTIVE):
        node.transition_to(NodeState.VERIFYING)
        node.save(update_fields=["state", "state_changed_at", "updated_at"])
    job = job_create(kind=JobKind.NODE_VERIFY, node=node)
    if reason:
        job_step(job=job, message=f"queued: {reason}")
    return job


@transaction.atomic
def node_accept_host_key(*, node: Node, operator_email: str) -> None:
    """An operator confirms a quarantined node's new host key: pin it and verify again."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state != NodeState.QUARANTINED or not node.seen_host_key_fingerprint:
        return
    old, node.host_key_fingerprint = node.host_key_fingerprint, node.seen_host_key_fingerprint
    node.seen_host_key_fingerprint = ""
    node.last_error = ""
    try:
        with transaction.atomic():
            node.save()
    except IntegrityError as exc:
        # Held by a proven live node (node_unique_live_host_key), or by another live node of the same provider
        # (node_unique_own_live_host_key): the node named is the one holding it, not any other unproven one.
        violated = constraint_violated(exc)
        if violated == "node_unique_live_host_key":
            holders = Node.objects.filter(PROVEN_LIVE)
        elif violated == "node_unique_own_live_host_key":
            holders = Node.objects.exclude(state=NodeState.RETIRED).filter(provider_id=node.provider_id)
        else:
            raise
        other = (holders.exclude(pk=node.pk).filter(host_key_fingerprint=node.host_key_fingerprint)
                 .values_list("pk", flat=True).first())
        raise Conflict(f"Node {node.pk}'s new host key {node.host_key_fingerprint} is pinned on live node "
                           f"{other}: the same server twice. Retire one of them first.") from None
    node_event(node=node, kind="host_key_accepted",
               message=f"{operator_email} accepted host key {node.host_key_fingerprint} "
                       f"(was {old}).", level=NodeEvent.Level.WARNING)
    # Nobody checked it while it was quarantined: its storage is not billed for that time (as for an outage),
    # moved on before the verification can make it healthy again. After the commit: the node's row is released
    # first (storage rows are locked before node rows elsewhere).
    node_id = node.pk
    transaction.on_commit(lambda: node_storage_outage_end(node_id=node_id, unseen=True), robust=True)
    # The operator's action is what takes a quarantined node back to verification (the provider's verify does
    # not: Node.verify_allowed). Before, this went straight to node_verify_request, which refused a quarantined
    # node: every accept was rolled back, and the node stayed quarantined for good.
    node.transition_to(NodeState.VERIFYING)
    node.save(update_fields=["state", "state_changed_at", "updated_at"])
    node_verify_request(node=node)


def rented_slice_uuids(node: Node) -> list[str]:
    """MIG slices held by a renter's instance: not benchmarked, not judged, kept as they are."""
    return sorted(MigSliceAllocation.objects.filter(mig_slice__node=node, released_at__isnull=True)
                  .values_list("mig_slice__uuid", flat=True))


def rented_gpu_indices(node: Node) -> list[int]:
    """GPUs held by a renter's instance: the benchmark leaves them alone (they are busy, or passed to a VM)."""
    return sorted(GpuAllocation.objects.filter(gpu__node=node, released_at__isnull=True)
                  .values_list("gpu__index", flat=True))


def gpu_holders_by_uuid(node: Node) -> dict[str, set[int]]:
    """The instances holding each of the node's cards (whole or by a MIG slice), by the card's UUID: when a card
    has left the bus, nvidia-smi numbers the others anew, and a rented card may answer at another's index. Read
    before an inventory is stored (its rows follow nvidia-smi's index)."""
    holders: dict[str, set[int]] = {}
    whole = GpuAllocation.objects.filter(gpu__node=node, released_at__isnull=True).exclude(gpu__uuid="")
    sliced = MigSliceAllocation.objects.filter(mig_slice__gpu__node=node, released_at__isnull=True).exclude(
        mig_slice__gpu__uuid="")
    for uuid, instance_id in [*whole.values_list("gpu__uuid", "instance_id"),
                              *sliced.values_list("mig_slice__gpu__uuid", "instance_id")]:
        holders.setdefault(uuid, set()).add(instance_id)
    return holders


def held_cards(node: Node, inventory: dict[str, Any]) -> dict[int, frozenset[str]]:
    """The cards renters hold, by their index in `inventory`, each with the UUIDs of the rented MIG slices on it
    (empty: held whole): what verification.mig.pending_layout takes. A card is found by its UUID (nvidia-smi numbers
    the cards anew when one has left the bus), by its stored index only when it has none; a rented slice by its
    own UUID first. Read before the inventory is stored (the GPU rows follow nvidia-smi's index)."""
    gpus = inventory.get("gpus") or []
    by_uuid = {g.get("uuid"): g.get("index") for g in gpus if g.get("uuid")}
    indices = {g.get("index") for g in gpus}
    slice_at = {d.get("uuid"): d.get("gpu") for d in inventory.get("mig") or []}

    def index_of(card_uuid: str, card_index: int) -> int | None:
        return by_uuid.get(card_uuid) if card_uuid else (card_index if card_index in indices else None)

    held: dict[int, set[str]] = {}
    for card_uuid, card_index in GpuAllocation.objects.filter(gpu__node=node, released_at__isnull=True).values_list(
            "gpu__uuid", "gpu__index"):
        index = index_of(card_uuid, card_index)
        if index is not None:
            held.setdefault(index, set())
    for uuid, card_uuid, card_index in MigSliceAllocation.objects.filter(
            mig_slice__node=node, released_at__isnull=True).values_list(
            "mig_slice__uuid", "mig_slice__gpu__uuid", "mig_slice__gpu__index"):
        index = slice_at[uuid] if uuid in slice_at else index_of(card_uuid, card_index)
        if index is not None:
            held.setdefault(index, set()).add(uuid)
    return {index: frozenset(uuids) for index, uuids in held.items()}


def mig_pending_text(layout: list[dict[str, Any]] | None, pending: list[int]) -> str:
    """What the provider is told of the cards whose declared layout waits for their renters, or, free now, for the
    provider to configure them so (pending_layout)."""
    declared = layout_by_gpu(layout)
    cards = "; ".join(f"GPU {g} ({', '.join(declared[g]) if g in declared else 'whole'})" for g in pending)
    card = "the card" if len(pending) == 1 else "each card"
    return (f"Declared MIG layout pending for {cards}: the check leaves the layout it has and judges the declared "
            f"one once {card} is free of renters and configured so on the server (configure a free card as "
            "declared, then verify again); until then it is not offered in its new form.")


def node_verify_run(*, job: Job) -> None:
    """The check itself, on a worker: inventory, benchmark, policy, verdict. Raises NodeError if the node
    cannot be reached (the task decides whether to retry) or the benchmark runs past its bound."""
    node = job.node
    if node.state not in (NodeState.VERIFYING, NodeState.ACTIVE):
        # Superseded (the provider's maintenance or retirement, an operator): nothing failed on the node.
        job_finish(job=job, error=f"The node is {node.state}, not verifying; nothing done.", fault=JobFault.PLATFORM)
        return
    if node.runtime == Runtime.SIM and not settings.SIM_NODES_ALLOWED:
        # Registered while the platform took simulated GPUs: its checks would be sized for a CPU (found by review).
        node_verify_conclude(job=job, verdict=Verdict.REJECTED, inventory={}, figures={},
                             findings=[Finding(REJECT, "sim_not_accepted", SIM_REFUSED).as_dict()],
                             judged_layout=node.mig_layout)
        return
    declared = DeclaredModel.from_gpu_model(node.gpu_model)
    # The MIG layout this check judges, as it was when it began: the provider may declare another meanwhile
    # (node_update), and the conclusion applies this check's slices only to the cards whose layout did not change.
    judged_layout = list(node.mig_layout or [])
    rented = rented_gpu_indices(node)
    limit = settings.BENCHMARK_TIME_LIMIT_S
    bench, bench_error = None, ""
    job_step(job=job, message=f"connecting to {node.address}:{node.ssh_port}")
    inventory: dict[str, Any] = {}
    net_mbps: float | None = None
    challenged: tuple[list[Finding], dict[str, Any]] = ([], {})
    disproved: set[str] = set()  # MIG slices that failed the platform's challenge
    malformed: list[Finding] = []  # an answer that failed its check (verification/answers.py)
    holders: dict[str, set[int]] = {}
    held: dict[int, frozenset[str]] = {}
    pending: list[int] = []  # cards whose declared MIG layout waits for their renters (pending_layout)
    # Free cards declared anew, still as last judged: the provider configures them by hand (pending_layout).
    awaiting = cards_awaiting(node, layout_by_gpu(judged_layout))
    try:
        with node_session(node) as session:  # a host key another live node has: DuplicateHardware, nothing pinned
            job_step(job=job, message="reading the hardware inventory")
            looked_at = timezone.now()  # a card it finds missing was last seen before: gpu_presence
            try:
                inventory = session.agent("inventory")
            except AgentAnswerRefused as exc:  # NaN, a number out of range, a NUL: malformed, as a check finds
                raise MalformedAnswer("inventory", [exc.reason]) from None
            problems = inventory_problems(inventory)
            if problems:  # nothing of it is read or stored: it is the node's verdict
                inventory = {}
                raise MalformedAnswer("inventory", problems)
            # The cards renters hold, by UUID as they were before this inventory: one may now answer at another
            # index (nvidia-smi numbers the cards anew when one has left the bus).
            holders = gpu_holders_by_uuid(node)
            held = held_cards(node, inventory)
            # The GPUs are claimed before anything runs on them: a GPU another live node holds is not benchmarked.
            if not node_apply_inventory(node=node, inventory=inventory, looked_at=looked_at):
                # Retired meanwhile (its provider): nothing claimed, nothing more run or judged.
                job_finish(job=job, error=RETIRED_DURING_CHECK, fault=JobFault.PLATFORM)
                return
            net_mbps = node_network_test(job, session)
            layout = layout_by_gpu(judged_layout)
            rented_slices = rented_slice_uuids(node)
            pending = pending_layout(layout, inventory.get("gpus") or [], inventory.get("mig") or [], held,
                                     awaiting)
            if pending:
                job_step(job=job, message=mig_pending_text(judged_layout, pending))
            # A card split into MIG slices is measured per slice (its free slices), never whole; a card whose
            # layout is pending is not judged, nor its free slices measured; nor those of a card whose listing
            # repeats a MIG device (withheld: the MIG check names it), whose UUIDs the agent refuses twice.
            withheld = {f.gpu_index for f in repeated_mig_findings(inventory.get("mig") or [])}
            # A rented card is found by its UUID (held_cards, holders), by its stored index only where its row has
            # none: nvidia-smi may have numbered the cards anew since the last check. Before, a free card now at a
            # rented card's old index was left out of the benchmark and the challenge (a fault on it unseen).
            free = [g["index"] for g in inventory.get("gpus", []) if g.get("index") not in held
                    and g.get("uuid") not in holders and g.get("index") not in layout]
            slices = [d["uuid"] for d in inventory.get("mig") or [] if d.get("gpu") in layout
                      and d.get("gpu") not in pending and d.get("gpu") not in withheld
                      and d.get("uuid") not in rented_slices]
            if free or slices:
                job_step(job=job, message=f"benchmarking GPU{'s' if len(free) > 1 else ''} {', '.join(map(str, free))} "
                                          f"(at most {limit} s)")
                # On the GPUs, said so: an answer measured on another device (the agent's "cpu" mode, which the
                # policy judges as figures only) is malformed (benchmark_problems).
                request = {"quick": settings.BENCHMARK_QUICK, "time_limit_s": limit, "gpu_indices": free,
                           "device": BENCHMARK_DEVICE}
                if slices:
                    request["mig_uuids"] = slices
                try:
                    bench = session.agent("benchmark", request=request, timeout=limit + BENCHMARK_SSH_MARGIN_S)
                except AgentAnswerRefused as exc:  # as benchmark_problems would name it: judged malformed
                    malformed.append(MalformedAnswer("benchmark", [exc.reason]).finding)
                except AgentTimeout:
                    raise BenchmarkTimeout(f"The benchmark did not answer within {limit + BENCHMARK_SSH_MARGIN_S} s "
                                           "and was abandoned. Check that the GPUs and their driver respond "
                                           "(`nvidia-smi`), then verify again.") from None
                except AgentFailed as exc:
                    if exc.code == "benchmark_timeout":
                        raise BenchmarkTimeout(f"The benchmark did not finish within {limit} s and was stopped "
                                               f"({exc.message}). Check that the GPUs and their driver respond "
                                               "(`nvidia-smi`), then verify again.") from None
                    if exc.code == "invalid_request":
                        raise
                    bench_error = exc.message  # no PyTorch, no CUDA, a crash: the provider can act on it
                problems = (benchmark_problems(bench, free, slices, device=BENCHMARK_DEVICE) if bench is not None
                            else [])
                if problems:  # e.g. {"ok": true} alone, a GPU twice, NaN: nothing it says is judged or kept
                    malformed.append(MalformedAnswer("benchmark", problems).finding)
                    bench = None
                if free:
                    challenged = node_challenge(job, session, declared, free)
                    proved = node_memory_proof(job, session, declared, free, inventory)
                    challenged = (challenged[0] + proved[0], {**challenged[1], "memory_proof": proved[1]})
                if slices:
                    found, slice_figures, disproved = node_slice_challenge(job, session, declared, inventory, slices)
                    challenged = (challenged[0] + found, {**challenged[1], "mig_slices": slice_figures})
            else:
                job_step(job=job, message="every GPU is rented: identity checks only, no benchmark")
    except DuplicateHardware as exc:
        # The same server (or its GPUs) registered twice: the node that came first keeps its listing.
        job_step(job=job, message="this server is already registered as another node")
        node_verify_conclude(job=job, verdict=Verdict.REJECTED, findings=[exc.finding.as_dict()],
                             inventory=inventory, figures={"rented_gpus": rented}, judged_layout=judged_layout)
        return
    except MalformedAnswer as exc:
        # The node's fault, not the platform's: a rejection naming what is wrong, active node or not.
        job_step(job=job, message=f"the node's {exc.command} answer is malformed")
        node_verify_conclude(job=job, verdict=Verdict.REJECTED, findings=[exc.finding.as_dict()],
                             inventory=inventory, figures={"rented_gpus": rented}, judged_layout=judged_layout)
        return
    job_step(job=job, message="judging the GPUs against the catalogue")
    fleet = (fleet_reference(node.gpu_model_id, exclude_node_id=node.pk, exclude_provider_id=node.provider_id)
             if bench is not None else None)
    if fleet is not None:
        job_step(job=job, message=f"comparing with {fleet.nodes} {node.gpu_model.name} nodes of {fleet.providers} "
                                  "other providers")
    mig = judge_mig(declared, layout_by_gpu(judged_layout), inventory, bench, rented_slice_uuids(node), disproved,
                    held, awaiting)
    result = judge(declared, node.gpu_count, inventory.get("gpus", []), bench, bench_error, challenge=challenged[0],
                   fleet=fleet, topology=inventory.get("topology"), nvlink_declared=node.nvlink_declared, mig=mig,
                   malformed=malformed, platform_rates=challenge_verdict.platform_rates(challenged[1]))
    figures = {**result.figures, "rented_gpus": rented, "platform_to_node_mbps": net_mbps}
    if pending:
        figures["mig_pending"] = pending
    if challenged[1]:
        figures["challenge"] = challenged[1]
    if bench is not None:
        figures["agent_version"] = bench.get("agent_version")
    node_verify_conclude(job=job, verdict=result.verdict, findings=[f.as_dict() for f in result.findings],
                         inventory=inventory, figures=figures, score=result.score, holders=holders,
                         judged_layout=judged_layout)


# The measured medians a renter compares offers by (the full figures stay on the VerificationRun).
OFFER_SUMMARY_FIGURES = ("bf16_tflops", "tf32_tflops", "fp32_tflops", "memory_bandwidth_gbs", "h2d_gbs",
                         "cnn_train_images_s", "cnn_infer_images_s", "power_draw_w", "bf16_tflops_per_w")


def offer_summary(run: VerificationRun) -> dict[str, Any]:
    """The summary shown on offers, stored on the node so that the search path needs no join."""
    median = (run.figures or {}).get("median") or {}
    return {
        "checked_at": run.created_at.isoformat(),
        "verdict": run.verdict,
        "median_per_gpu": {key: median.get(key) for key in OFFER_SUMMARY_FIGURES},
        "nvlink": (run.figures or {}).get("nvlink"),
        "findings": sorted({f["code"] for f in run.findings}),
    }


@transaction.atomic
def node_verify_conclude(*, job: Job, verdict: str, findings: list[dict[str, Any]], inventory: dict[str, Any],
                         figures: dict[str, Any] | None = None, score: float | None = None,
                         error: str = "", holders: dict[str, set[int]] | None = None,
                         judged_layout: list[dict[str, Any]] | None = None) -> VerificationRun | None:
    """Record the check's verdict and act on it (state, offers, renters, provider). `error`: the job fails with
    it (a verification that could not be completed by the node's doing, judged by why: node_verify_failed).
    `holders`: the instances holding each card, by UUID, before the inventory was stored (gpu_holders_by_uuid).
    `judged_layout`: the MIG layout the check judged (None: the one declared now). Where the provider declared
    another meanwhile, the cards it changed keep their status and their slices are not listed from this check
    (node_apply_mig_slices), and a new verification is queued to judge the layout declared now.
    A node retired while the check ran is not judged (None): no verdict, run, slices or notification; before, its
    provider was told a verdict about the node they had just retired (found by review)."""
    # No key update: the renters' billing profiles are locked below (a raise back), while enforcement holds one
    # and inserts a stop job naming this node (FOR KEY SHARE, which FOR UPDATE blocked: a deadlock).
    node = Node.objects.select_for_update(no_key=True).get(pk=job.node_id)
    if node.state == NodeState.RETIRED:
        job_finish(job=job, error=RETIRED_DURING_CHECK, fault=JobFault.PLATFORM)
        return None
    # Its renters' billing profiles next, in id order, before any of their instances: a cut then a raise back in
    # this check lock an instance, then its renter's profile (for the low-balance notice), where enforcement locks
    # the profile, then the instance, to stop it at zero (found by review: "deadlock detected").
    for renter_id in sorted(set(Instance.objects.filter(node=node).exclude(status__in=FINAL_STATUSES)
                                .values_list("renter_id", flat=True))):
        billing_profile_lock(user_id=renter_id)
    # Then its instances not over, in id order, before any GPU row (node_apply_mig_slices takes them FOR UPDATE):
    # a destroy's or stop's confirmation locks its instance, then its GPUs (instance_release_gpus, and a MIG
    # release's share lock on the slices' cards), where this check locked the GPUs and then, cutting or raising
    # prices or telling renters, those instances (found by review: "deadlock detected", the confirmation or the
    # whole verdict rolled back).
    # FOR UPDATE, the mode those later steps take (instances.common._locked): no upgrade to wait for.
    list(Instance.objects.select_for_update().filter(node=node).exclude(status__in=FINAL_STATUSES)
         .order_by("pk").values_list("pk", flat=True))
    previous_verdict = node.verdict
    # What renters' prices are measured against: the last score of a check that listed the node (a rejection's
    # score says nothing of how fast it is; compared with it, the next check cut no one).
    listed = (VerificationRun.objects.filter(node=node, verdict__in=LISTABLE_VERDICTS, score__isnull=False)
              .order_by("-created_at", "-pk").values_list("score", "verdict", "figures").first())
    listed_score = listed[0] if listed else None
    if listed_score is None and previous_verdict in LISTABLE_VERDICTS:
        listed_score = node.score  # listed with no check recorded (made so by hand, or before checks were kept)
    # What a cut compares this check's score with: the listed check's score of the same cards where it can say.
    cut_basis = (same_cards_score(listed[2], listed[1], figures or {}) if listed else None) or listed_score
    # The cards it compared, kept with the cut for the raise back to compare the same ones (instances.pricing).
    compared = cut_cards(listed[2], listed[1], figures or {}, verdict) if listed else None
    measured = measured_cards(figures or {}, verdict)
    # What the platform derived from the node's answers (the challenge's and memory proof's figures, messages
    # quoting the node) may carry NaN or NUL, which no JSON or text column takes.
    findings, inventory, figures = storable(findings), storable(inventory), storable(figures or {})
    run = VerificationRun.objects.create(node=node, job=job, verdict=verdict, findings=findings,
                                         inventory=inventory, figures=figures or {}, score=score)
    node.verdict = verdict
    if score is not None:
        node.score = score
    node.benchmark_summary = offer_summary(run)
    if inventory:
        # Dated when the job began, before the agent read its disk (not the verdict's moment, minutes later): a
        # disk booked meanwhile is one the free space read could not count (found by review; disk_room).
        node_apply_host_facts(node, inventory, (figures or {}).get("platform_to_node_mbps"),
                              min(run.created_at, job.started_at or job.created_at))
    renters = list(Instance.objects.filter(node=node).exclude(status__in=FINAL_STATUSES).values_list("pk", flat=True))
    if verdict == Verdict.REJECTED:
        reasons = reasons_text(findings, severity="reject")  # each said once, with the GPUs it concerns
        node.last_error = "Rejected: " + reasons
        # Not yanked from under its renters: it stays active for them (one verified from maintenance, or from
        # offline, becomes active), where health checks, the reconciler and the meter watch it; the verdict
        # keeps it off the offers.
        if renters or node_in_use(node_id=node.pk):
            if node.state == NodeState.VERIFYING:
                node.transition_to(NodeState.ACTIVE)
        elif node.state in (NodeState.VERIFYING, NodeState.ACTIVE):
            node.transition_to(NodeState.REJECTED)
    else:
        node.last_error = reasons_text(findings)
        if node.state == NodeState.VERIFYING:
            node.transition_to(NodeState.ACTIVE)
    pending = (figures or {}).get("mig_pending") or []
    if pending:  # told where the check's outcome is (the API's last_error, the node's events)
        note = mig_pending_text(judged_layout if judged_layout is not None else node.mig_layout, pending)
        node.last_error = f"{node.last_error} {note}".strip()
        node_event(node=node, kind="mig_layout_pending", message=note)
    node_draw_next_checks(node)
    node.save()
    changed = node_apply_mig_slices(node=node, slices=(figures or {}).get("mig_slices") or [],
                                    listable=verdict in LISTABLE_VERDICTS, judged_layout=judged_layout,
                                    pending=pending)
    levels: dict[str, str] = {Verdict.VERIFIED: NodeEvent.Level.INFO, Verdict.DEGRADED: NodeEvent.Level.WARNING}
    level = levels.get(verdict, NodeEvent.Level.WARNING)
    node_event(node=node, kind=f"verified_{verdict}", message=node.last_error or "All checks passed.", level=level)
    if verdict in NOTIFIED_VERDICTS and verdict != previous_verdict:  # a new verdict, not every re-check
        notify(user=node.provider, kind=NOTIFIED_VERDICTS[verdict], dedupe_key=f"node_{verdict}:{node.pk}:{run.pk}",
               payload={"node": node.pk, "name": node.name, "verdict": verdict, "score": node.score,
                        "message": f"Node {node.name}: {node.last_error}"})
    if verdict == Verdict.REJECTED and renters:
        node_event(node=node, kind="failed_while_rented",
                   message=f"The node failed its benchmark check while {len(renters)} instance(s) use it; it stays "
                           f"up for them and takes no new rentals. {reasons}", level=NodeEvent.Level.CRITICAL)
        # Only a running instance "keeps running": an interrupted one keeps saying why it is (a lost GPU, found by
        # walking the demo: the rejection its loss caused told its renter it was running), a stopped one its own.
        for instance_id in Instance.objects.filter(pk__in=renters, status=InstanceStatus.RUNNING).values_list(
                "pk", flat=True):
            instance_svc.instance_set_status_message(
                instance_id=instance_id,
                message="This instance's server failed its latest benchmark check "
                        f"({', '.join(sorted({f['code'] for f in findings if f['severity'] == 'reject'}))}). "
                        "Your instance keeps running; consider moving your work to another server.")
    if renters and (figures or {}).get("failed") not in FAILURES_NOT_ABOUT_RENTERS:
        _price_cut_if_worse(node, verdict, score, cut_basis or 0.0, findings, inventory, holders or {}, compared)
    if renters and verdict in LISTABLE_VERDICTS:
        _price_back_if_better(node, score, listed_score, measured)
    job_finish(job=job, error=error, fault=JobFault.NODE if error else "")
    if changed:
        _reverify_new_layout(node, changed)
    return run


def _reverify_new_layout(node: Node, changed: list[int]) -> None:
    """The provider declared another MIG layout for these cards while the check ran (node_update): say so, and
    queue a verification that judges the layout declared now (this check's job is finished: one open at a time).
    Not out of the provider's maintenance (a verification request takes a node out of it, the provider's own verb;
    re-splitting the cards is what they are doing): the check is then due at once, and the re-verification beat
    queues it when the maintenance ends (found by the second review round: the check ran on the old split and
    rejected the node). Within the provider's cooldown (this check's verdict just started one: a change during
    each check was a fresh verdict at once, node_verify_deferred), not now either: an active node's check is due at
    the cooldown's end and the beat queues it then; a node in another state (rejected: the beat queues none) is
    verified again when its provider asks, from then."""
    cards = ", ".join(map(str, changed))
    in_maintenance = node.state == NodeState.MAINTENANCE
    deferred = node_verify_deferred(node) if in_maintenance or node.verify_allowed() else None
    if deferred is None:
        when = " once the maintenance ends" if in_maintenance else ""
    elif node.state in (NodeState.ACTIVE, NodeState.MAINTENANCE):
        refusal, due = deferred
        when = (f", due at {due:%Y-%m-%d %H:%M:%S} UTC{' (once the maintenance ends)' if in_maintenance else ''}, "
                f"when the {refusal.every} after this check's verdict are over")
    else:
        refusal = deferred[0]
        when = (f" when its provider asks for it (Verify), from {refusal.available_minute:%Y-%m-%d %H:%M} UTC, the "
                f"{refusal.every} after this check's verdict over")
    node_event(node=node, kind="mig_layout_changed_during_check", level=NodeEvent.Level.WARNING,
               message=f"The MIG layout of GPU {cards} changed during the check: this check's slices of "
                       f"{'it' if len(changed) == 1 else 'them'} are not listed and "
                       f"{'its' if len(changed) == 1 else 'their'} status stays as it was; a new check judges the "
                       f"layout declared now{when}.")
    if deferred is not None:
        return
    if in_maintenance:
        Node.objects.filter(pk=node.pk).update(next_check_at=timezone.now())
    elif node.verify_allowed():
        node_verify_request(node=node, reason="the MIG layout changed during the check")


def _price_cut_if_worse(node: Node, verdict: str, score: float | None, previous_score: float,
                        findings: list[dict[str, Any]], inventory: dict[str, Any],
                        holders: dict[str, set[int]], cards: dict[str, list[float]] | None = None) -> None:
    """Hardware found worse while rented: cut its renters' prices in proportion to the score (the published rule:
    docs/ARCHITECTURE.md). A rejection without a usable score is a full cut for the renters it is about
    (renters_concerned); noise within the tolerance is no cut.
    A check that measured nothing (every GPU rented: no benchmark, score None) is no evidence of worse hardware:
    verified or degraded, it cuts nothing. `cards`: the cards a score cut compared (cut_cards), kept with it."""
    only = None
    if verdict == Verdict.REJECTED and not score:
        # No measure of how much worse: the renters whose hardware the rejection is about pay nothing, the others
        # (on cards the findings do not name) go on as they are.
        ratio, only = Fraction(0), renters_concerned(node, findings, inventory, holders)
        if not only:
            return
    elif score is None or not previous_score or previous_score <= 0:
        return  # nothing measured now, or nothing to compare with
    else:
        ratio = instance_svc.score_share(score, previous_score)
    if ratio >= 1 - Fraction(settings.HARDWARE_PRICE_CUT_TOLERANCE):
        return
    named = {f["code"] for f in findings if f["severity"] in ("reject", "degrade")} - NOT_ABOUT_RENTERS
    codes = sorted(named) or ["lower score"]
    cut = instance_svc.node_instances_price_cut(node_id=node.pk, ratio=ratio, reason=", ".join(codes),
                                                score_before=previous_score or 0.0, only=only,
                                                cards=cards if only is None else None)
    if cut:
        node_event(node=node, kind="renters_price_cut",
                   message=f"Measured {float(ratio):.0%} of the score it had before ({', '.join(codes)}): "
                           f"the price of instance(s) {', '.join(map(str, cut))} was cut to match.",
                   level=NodeEvent.Level.WARNING)


def _card_scores(gpus: Any) -> dict[str, float]:
    """The finite, positive scores of the cards a check's figures list, by UUID (a card without either left out)."""
    rows = [g for g in gpus if isinstance(g, dict)] if isinstance(gpus, list) else []
    return {g["uuid"]: float(g["score"]) for g in rows if isinstance(g.get("uuid"), str) and g["uuid"]
            and isinstance(g.get("score"), int | float) and not isinstance(g.get("score"), bool)
            and math.isfinite(g["score"]) and g["score"] > 0}


def measured_cards(figures: dict[str, Any], verdict: str) -> dict[str, float] | None:
    """This check's score of each whole card it measured, by UUID, as its score counts it (policy.node_score: times
    its verdict's factor). None where it cannot say (no factor: a rejection)."""
    factor = TOLERANCES["score_factor"].get(verdict)
    if not factor:
        return None
    return {uuid: score * float(factor) for uuid, score in _card_scores(figures.get("gpus")).items()}


def cut_cards(listed_figures: Any, listed_verdict: str, figures: dict[str, Any],
              verdict: str) -> dict[str, list[float]] | None:
    """The cards this check measured, by UUID: [the score the check that listed the node gave it, this check's],
    each times its check's verdict factor (what a cut compares: same_cards_score). None where it cannot say (a
    card measured now that the listed check did not score, no UUID, MIG slices in the score)."""
    if not isinstance(listed_figures, dict) or listed_figures.get("mig_slices") or figures.get("mig_slices"):
        return None
    before, now = measured_cards(listed_figures, listed_verdict), measured_cards(figures, verdict)
    gpus = figures.get("gpus")
    rows = gpus if isinstance(gpus, list) else []
    if (before is None or not now
            or any(isinstance(g, dict) and g.get("score") is not None and g.get("uuid") not in now for g in rows)
            or not set(now) <= set(before)):
        return None
    return {uuid: [round(before[uuid], 4), round(score, 4)] for uuid, score in now.items()}


def same_cards_score(listed_figures: Any, listed_verdict: str, figures: dict[str, Any]) -> float | None:
    """The score the check that listed the node gave the cards this check measured (found by UUID), as this
    check's score is made (policy.node_score: their mean, times the listed verdict's factor). A re-check measures
    the free cards only, and the cards of one node differ by up to node_median_max_deviation unflagged: before, its
    score over the slower free cards, unchanged, was compared with the listed score over all of them and cut the
    renters of the faster ones. None where it cannot say (a card measured now that the listed
    check did not score, no UUID, MIG slices in the score, or the same cards as then): the listed score then."""
    if not isinstance(listed_figures, dict) or listed_figures.get("mig_slices") or figures.get("mig_slices"):
        return None

    def scores(gpus: Any) -> dict[Any, Any]:
        rows = [g for g in gpus if isinstance(g, dict)] if isinstance(gpus, list) else []
        return {g.get("uuid"): g.get("score") for g in rows if isinstance(g.get("uuid"), str) and g.get("uuid")}

    before, now = scores(listed_figures.get("gpus")), figures.get("gpus") or []
    measured = [g.get("uuid") for g in now if isinstance(g, dict) and g.get("score") is not None]
    if not measured or set(measured) == set(before):
        return None
    if not all(isinstance(before.get(u), int | float) and not isinstance(before.get(u), bool)
               and math.isfinite(before[u]) and before[u] > 0 for u in measured):
        return None
    factor = TOLERANCES["score_factor"].get(listed_verdict)
    if not factor:
        return None
    return round(statistics.fmean(float(before[u]) for u in measured) * float(factor), 2)


def _price_back_if_better(node: Node, score: float | None, listed_score: float | None,
                          measured: dict[str, float] | None = None) -> None:
    """A check that lists the node: the renters whose price an earlier one cut pay what this score earns (with no
    score, the last listed one's), up to their price before the cut (instances.pricing); where the cut compared
    cards, what those same cards earn now, once this check measured the ones that caused it (`measured`: its score
    of each card, measured_cards). Not while the node's health checks fail: raised then, the price would reach back
    to its last healthy moment; the next check that lists it raises it."""
    if node.health_failures:
        return
    raised = instance_svc.node_instances_price_follow(node_id=node.pk, score=score, last_score=listed_score,
                                                      measured=measured)
    if raised:
        node_event(node=node, kind="renters_price_raised_back",
                   message=f"Measured better again: the price of instance(s) {', '.join(map(str, raised))} went "
                           "back up with it (never above their price before the cut).")


# Rejection codes that are no evidence against any renter's hardware: a card missing from the server is the loss
# rule's (gpu_presence: its holder interrupted, credited and unbilled while it is gone, full price again when it is
# back), and one more than declared harms nobody. Before, a card fallen off the bus cut every renter of the node
# to $0/h for good (found by walking the demo), and so did a libvirt node's re-check (a rented card is bound to
# vfio-pci, out of the host's nvidia-smi).
NOT_ABOUT_RENTERS = frozenset({"gpu_count"})


# Checks that could not be completed (node_verify_failed, its figures' "failed") that are no evidence against any
# renter's hardware: a re-check benchmarks the free cards only, never a rented one, so a benchmark that hung says
# nothing of the cards renters hold. The rejection takes the node off the offers; before, it also cut every renter
# to $0/h until a later check passed. (An agent that answers garbage or refuses the platform's key is the whole
# server's: that cut stays.)
FAILURES_NOT_ABOUT_RENTERS = frozenset({BenchmarkTimeout.code})


def renters_concerned(node: Node, findings: list[dict[str, Any]], inventory: dict[str, Any] | None = None,
                      holders: dict[str, set[int]] | None = None) -> set[int]:
    """The node's live instances a rejection's findings are about: all of them for a finding about the whole server,
    the holders of that GPU (whole or by a MIG slice) for one naming a GPU: found by the card's UUID in this
    inventory when `holders` knows it (nvidia-smi numbers the cards anew when one has left the bus), else by the
    row at that index; for a card whose UUID another card of this inventory reports too, every card sharing it is,
    by both. A MIG slice's own finding is about a free slice (a re-check never tests a rented one)."""
    rejects = [f for f in findings if f["severity"] == "reject" and f["code"] not in NOT_ABOUT_RENTERS
               and not f["code"].startswith("mig_slice_")]
    live = Instance.objects.filter(node=node).exclude(status__in=FINAL_STATUSES)
    if any(f.get("gpu_index") is None for f in rejects):
        return set(live.values_list("pk", flat=True))
    uuid_at = {g.get("index"): g.get("uuid") for g in (inventory or {}).get("gpus", [])}
    sharing: dict[Any, set[Any]] = {}  # a UUID -> the indices of the cards reporting it
    for card_index, card_uuid in uuid_at.items():
        if card_uuid:
            sharing.setdefault(card_uuid, set()).add(card_index)
    found: set[int] = set()
    by_row: set[int] = set()
    for index in {f["gpu_index"] for f in rejects}:
        uuid = uuid_at.get(index)
        if uuid and len(sharing[uuid]) > 1:
            # One UUID on several cards (gpu_uuid_repeated, one finding per card): it tells none of them apart, so
            # each is concerned, by its row and by the UUID as held before: the UUID's holder alone was one holder,
            # often the wrong one (found in round 50).
            by_row |= sharing[uuid]
            found |= (holders or {}).get(uuid, set())
        elif holders and uuid in holders:
            found |= holders[uuid]
        elif not holders or uuid is None:
            by_row.add(index)
    if by_row:
        whole = GpuAllocation.objects.filter(gpu__node=node, gpu__index__in=by_row, released_at__isnull=True)
        sliced = MigSliceAllocation.objects.filter(mig_slice__gpu__node=node, mig_slice__gpu__index__in=by_row,
                                                   released_at__isnull=True)
        found |= set(whole.values_list("instance_id", flat=True)) | set(sliced.values_list("instance_id", flat=True))
    return set(live.filter(pk__in=found).values_list("pk", flat=True)) if found else set()


# An active node whose verifications were dropped (unreachable or silent past every retry) this many times in a
# row, while it stayed active (its health checks did not take it offline), is rejected: else dropping every
# check would keep its last verdict and listing for ever. One drop is the network's benefit of the doubt.
VERIFICATIONS_DROPPED_TO_REJECT = 2


def node_dropped(error: NodeError) -> bool:
    """The node stopped answering the check (the connection broke or stayed silent, past the task's retries). Never
    a failure that is not the node's (faults.error_fault): an address the platform refuses, a time limit that ran
    out while the platform waited on itself."""
    return isinstance(error, NodeUnreachable | AgentTimeout) and counts_against_node(error)


def node_at_fault(error: NodeError) -> bool:
    """Whether a verification that could not be completed failed by the node's doing: its agent answered garbage
    or refused (AgentFailed, but for a request the platform got wrong: invalid_request), its benchmark hung, it
    refused the platform's key. Not the network's (unreachable, timeouts: the health check judges those), a busy
    node's, nor the platform's own (an internal error, a lost worker: faults.error_fault)."""
    if not counts_against_node(error):
        return False
    return isinstance(error, AgentFailed | AgentGarbage | BenchmarkTimeout | AuthFailed)


@transaction.atomic
def node_verify_failed(*, job: Job, error: NodeError) -> None:
    """The node could not be checked: say why, and put it back where a retry can start. A node that failed by its
    own doing (node_at_fault) is not left listed on its last verdict: active, or verifying (or gone offline
    meanwhile) with a verdict that lists it, the check is recorded as a rejection naming the failure,
    as any rejection (its renters keep their instances, judged; one without goes rejected). Before, only an active
    node was: a verified node checked from offline, or after an operator accepted its new host key, went offline
    on its old verdict and its next good health check listed it again (found by review). A pending node keeps its
    retries (maintenance.nodes_verify_pending); a failure not the node's keeps its verdict (offline, checked
    again). A node its provider put into maintenance during the check is not judged by it (node_verify_run's rule:
    the provider is working on it; the second review round found this rule rejecting it and cutting its renters'
    prices to $0): an event says so, as before."""
    node = Node.objects.select_for_update(no_key=True).get(pk=job.node_id)
    dropped = node.state == NodeState.ACTIVE and node_dropped(error)
    said = ""
    if node_at_fault(error) and (node.state == NodeState.ACTIVE or (
            node.verdict in LISTABLE_VERDICTS
            and node.state not in (NodeState.MAINTENANCE, NodeState.QUARANTINED, NodeState.RETIRED))):
        said = f"The verification could not be completed: {error.message}"
    elif dropped:
        last = node.verifications.order_by("-created_at").values_list("created_at", flat=True).first()
        before = NodeEvent.objects.filter(node=node, kind="verification_dropped")
        drops = 1 + (before.filter(created_at__gt=last) if last else before).count()
        if drops >= VERIFICATIONS_DROPPED_TO_REJECT:
            said = (f"The node stopped answering {drops} verifications in a row while it stayed online (the "
                    f"last: {error.message})")
    if said:
        finding = Finding(REJECT, "verification_failed", f"{said.rstrip('.')}. Make sure the node lets the "
                                                         "platform's checks run to the end, then verify again.")
        node_verify_conclude(job=job, verdict=Verdict.REJECTED, findings=[finding.as_dict()], inventory={},
                             figures={"rented_gpus": rented_gpu_indices(node), "failed": error.code},
                             error=storable(error.message))
        return
    fault = error_fault(error)
    message = storable(error.message if fault == JobFault.NODE else f"{error.message} {NOT_COUNTED[fault]}")
    if not (isinstance(error, HostKeyMismatch) and node.state == NodeState.QUARANTINED and node.last_error):
        node.last_error = message
    # Else the check met the changed host key the node is quarantined for (quarantined by this check, or already
    # for that key: HostKeyStillChanged): its last_error stays the quarantine's (node_quarantine: both keys, the
    # quarantine, that an operator must confirm the new key), what its provider acts on. Before, it was replaced
    # by the check's own failure, which does not say the node is quarantined (and, for a key met again, called it
    # "the platform's failure").
    if node.state == NodeState.VERIFYING:
        node.transition_to(NodeState.PENDING if node.verdict == Verdict.UNVERIFIED else NodeState.OFFLINE)
    node_draw_next_checks(node)  # an active node checked in place stays active: it is due again at a new time
    node.save()
    # A drop is counted (VERIFICATIONS_DROPPED_TO_REJECT); any other failure is only told.
    node_event(node=node, kind="verification_dropped" if dropped else "verification_failed", message=message,
               level=NodeEvent.Level.WARNING)
    job_finish(job=job, error=message, fault=fault)
