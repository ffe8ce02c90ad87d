"""Providers' servers (nodes), their GPUs, and the node state machine.

The allowed state transitions live here and nowhere else (NODE_TRANSITIONS, on core.transitions): services call
`Node.transition_to`, which raises InvalidTransition for a move the table does not allow.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import connection, models
from django.db.models import Q
from django.db.models.fields.json import KeyTextTransform
from django.db.models.functions import Cast
from django.utils import timezone
from django_countries.fields import CountryField

from core.transitions import StatefulModel, Transitions

from .accounts import User
from .catalogue import GpuModel
from .host import DEFAULT_DISK_PRICE_PER_GB_MONTH_MICROS, NodeHostFacts

if TYPE_CHECKING:
    from .mig import MigSlice


class NodeState(models.TextChoices):
    PENDING = "pending", "Pending: waiting for the first verification"
    VERIFYING = "verifying", "Verifying: the benchmark check is running"
    ACTIVE = "active", "Active"
    REJECTED = "rejected", "Rejected by the benchmark check"
    MAINTENANCE = "maintenance", "Maintenance"
    OFFLINE = "offline", "Offline: not answering health checks"
    QUARANTINED = "quarantined", "Quarantined: its SSH host key changed"
    RETIRED = "retired", "Retired by its provider"


S = NodeState
NODE_TRANSITIONS = Transitions({
    S.PENDING: {S.VERIFYING, S.MAINTENANCE, S.RETIRED},
    S.VERIFYING: {S.ACTIVE, S.REJECTED, S.PENDING, S.OFFLINE, S.QUARANTINED, S.RETIRED},
    S.ACTIVE: {S.VERIFYING, S.MAINTENANCE, S.OFFLINE, S.REJECTED, S.QUARANTINED, S.RETIRED},
    S.REJECTED: {S.VERIFYING, S.RETIRED},
    # OFFLINE: maintenance ends while its last health check failed (node_update); the health check, not the
    # provider, brings it back once it answers and is reconciled.
    S.MAINTENANCE: {S.ACTIVE, S.PENDING, S.VERIFYING, S.OFFLINE, S.QUARANTINED, S.RETIRED},
    S.OFFLINE: {S.ACTIVE, S.PENDING, S.VERIFYING, S.MAINTENANCE, S.QUARANTINED, S.RETIRED},
    # Only an operator who accepted the new host key sends a node back to verification.
    S.QUARANTINED: {S.VERIFYING, S.RETIRED},
    S.RETIRED: set(),
}, actions={
    # The provider's verbs, read by the API's services and the node page's buttons alike. Verify: an active
    # node is re-verified in place (it stays active); asked while verifying, the open check is returned
    # (Node.verify_allowed); a quarantined node goes back to verification only by an operator's action.
    "verify": (S.VERIFYING, {S.PENDING, S.REJECTED, S.ACTIVE, S.OFFLINE, S.MAINTENANCE}),
    "retire": (S.RETIRED, None),
})


class Verdict(models.TextChoices):
    UNVERIFIED = "unverified", "Not verified yet"
    VERIFIED = "verified", "Verified"
    DEGRADED = "degraded", "Degraded: listed, flagged, lower score"
    REJECTED = "rejected", "Rejected"


class Runtime(models.TextChoices):
    DOCKER = "docker", "Docker with the NVIDIA container toolkit"
    LIBVIRT = "libvirt", "KVM virtual machines (libvirt, VFIO passthrough)"
    SIM = "sim", "Simulated GPU server"


LISTABLE_VERDICTS = (Verdict.VERIFIED, Verdict.DEGRADED)
# What of a node renters can book (given a free GPU) its own row says: the partial indexes `node_offer_idx` and
# `node_offer_spd_idx` are built on it (PostgreSQL uses a partial index only when the query's WHERE implies the
# index's condition). The whole rule is offerable(): also its last health check answered (ANSWERING) and its
# provider's account active (provider_active(), which no index condition on the node can hold).
OFFERABLE = Q(state=NodeState.ACTIVE, verdict__in=LISTABLE_VERDICTS, listed=True)
# Its last health check answered (`health_failures`, back to 0 at its next answer): a node that missed one takes no
# new load (offer_rules.node_refusal, and the start of a stopped instance: its jobs would not reach it), and its
# renters are interrupted once NODE_INTERRUPT_AFTER_FAILED_CHECKS are missed in a row. Beside OFFERABLE, not in it:
# the partial indexes keep their condition (no index to rebuild, and a node does not leave them at each miss).
ANSWERING = Q(health_failures=0)
# The runtimes that rent MIG slices: a KVM guest gets a MIG slice only through NVIDIA vGPU, which the libvirt runtime
# does not do (its agent refuses `mig_uuids`); services.nodes refuses a layout on it, the offers and booking its slices.
MIG_RUNTIMES = (Runtime.DOCKER, Runtime.SIM)


def provider_active() -> Q:
    """Its provider's account is not deactivated (marketplace.services.account_status). Asked as "not one of the
    deactivated accounts": PostgreSQL reads those few once (the index `user_inactive_idx`) and probes a hash per
    node, where a join looked up every offered node's provider (the join was the slower of the two on the offers'
    count and first page over bench/offers_search.py's data; no figures were recorded)."""
    return ~Q(provider__in=User.objects.filter(is_active=False).values("pk"))


def offerable() -> Q:
    """OFFERABLE, with its last health check answered (ANSWERING), its provider's account active (an operator's
    deactivation takes its nodes off the offers), and, where the platform takes no simulated GPUs
    (settings.SIM_NODES_ALLOWED off), not a sim node registered before it was turned off: its checks were sized for
    a CPU (found by review)."""
    rule = OFFERABLE & ANSWERING & provider_active()
    return rule if settings.SIM_NODES_ALLOWED else rule & ~Q(runtime=Runtime.SIM)
# A live node that proved it controls its server (Node.control_proven_at): the nodes whose address and port, and
# host key, are unique (node_unique_live_endpoint, node_unique_live_host_key).
PROVEN_LIVE = ~Q(state="retired") & Q(control_proven_at__isnull=False)
# Score per USD per GPU-hour (the offers' default order); the expression of `node_offer_spd_idx`.
SCORE_PER_DOLLAR = models.ExpressionWrapper(
    models.F("score") * 1_000_000.0 / models.F("price_per_gpu_hour_micros"), output_field=models.FloatField()
)


def slice_price_micros(profile: str) -> Cast:
    """The node's price per slice-hour of MIG `profile` (micro-dollars), what booking a slice of it charges
    (instances.booking._slice_price: `mig_prices_micros[profile]`, never the whole GPU's price); null where the node
    does not price the profile (booking refuses it, and its slices are not offered: selectors.free_slices). In SQL:
    `(mig_prices_micros ->> profile)::bigint`, the offers' filter and order under `mig_profile`."""
    return Cast(KeyTextTransform(profile, "mig_prices_micros"), models.BigIntegerField())


def slice_score_per_dollar(profile: str) -> models.ExpressionWrapper:
    """SCORE_PER_DOLLAR with the price per slice-hour of `profile`: the same ranking of slices of one profile as of
    their cards (a profile is the same share of every card it splits), by what a slice costs."""
    return models.ExpressionWrapper(models.F("score") * 1_000_000.0 / slice_price_micros(profile),
                                    output_field=models.FloatField())


class Node(StatefulModel, NodeHostFacts):
    transitions = NODE_TRANSITIONS
    state_field = "state"

    provider = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="nodes")
    name = models.CharField(max_length=100)
    address = models.CharField(max_length=253, help_text="Hostname or IP address the platform connects to.")
    ssh_port = models.PositiveIntegerField(default=22)
    ssh_user = models.CharField(max_length=32)
    host_key_fingerprint = models.CharField(
        max_length=60, blank=True, help_text="SHA256:... of the node's SSH host key; pinned once known."
    )
    country = CountryField()
    city = models.CharField(max_length=100, blank=True)
    datacenter = models.CharField(max_length=100, blank=True)
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, related_name="nodes",
                                  help_text="The model the provider declares.")
    gpu_count = models.PositiveSmallIntegerField()
    # The provider's claim that the GPUs are NVLink-connected; the check holds it against what nvidia-smi shows.
    nvlink_declared = models.BooleanField(default=False)
    # The provider's MIG layout, [{"gpu": index, "profiles": ["3g.40gb", ...]}] (marketplace.mig checks it), and
    # the price of each of its profiles per slice-hour in micro-dollars ({"3g.40gb": 900000}). The check holds the
    # layout against what nvidia-smi shows; only then are the slices rentable (MigSlice).
    mig_layout = models.JSONField(default=list, blank=True)
    mig_prices_micros = models.JSONField(default=dict, blank=True)
    # Money is integers: micro-dollars (1e-6 USD) per GPU-hour.
    price_per_gpu_hour_micros = models.BigIntegerField()
    # Storage (volumes, and the disks of stopped instances): micro-dollars per GB per 30-day month, billed per
    # second; each volume and instance keeps the price it was created at.
    disk_price_per_gb_month_micros = models.BigIntegerField(default=DEFAULT_DISK_PRICE_PER_GB_MONTH_MICROS)
    # Bumped on every raise of either price (services.nodes.node_update), never on a cut: the Vast-compatible ask
    # ids carry it (compat.vast.offers.offer_id), so an id from a search before a raise books nothing (a 409) and
    # one from a search since books at most the price it showed. The prices just before the last raise, for that
    # 409 to name what the search showed (None: never raised).
    price_generation = models.PositiveIntegerField(default=0)
    price_before_raise_micros = models.BigIntegerField(null=True, blank=True)
    disk_price_before_raise_micros = models.BigIntegerField(null=True, blank=True)
    runtime = models.CharField(max_length=10, choices=Runtime.choices)

    state = models.CharField(max_length=12, choices=NodeState.choices, default=NodeState.PENDING)
    state_changed_at = models.DateTimeField(default=timezone.now)
    verdict = models.CharField(max_length=12, choices=Verdict.choices, default=Verdict.UNVERIFIED)
    listed = models.BooleanField(default=True, help_text="The provider's switch: unlisted nodes get no new rentals.")
    score = models.FloatField(default=0.0, help_text="Measured performance relative to a reference card.")
    reliability = models.FloatField(default=0.0, help_text="0..1 from uptime and failed jobs.")
    last_error = models.TextField(blank=True, help_text="The last failure, in words a provider can act on.")
    last_seen_at = models.DateTimeField(null=True, blank=True, help_text="Last successful contact.")
    health_failures = models.PositiveIntegerField(default=0, help_text="Consecutive failed health checks.")
    last_checked_at = models.DateTimeField(null=True, blank=True,
                                           help_text="The last health check recorded, answered or failed.")
    inventory = models.JSONField(default=dict, blank=True, help_text="The agent's last inventory.")
    benchmark_summary = models.JSONField(
        default=dict, blank=True, help_text="What renters see of the last verification: when, verdict, medians."
    )
    # Drawn at random (provisioning.services.verification.draw_delay) when a check ends; operators see them in
    # the admin, providers nowhere (a check they could predict could be dodged).
    next_check_at = models.DateTimeField(null=True, blank=True, db_index=True,
                                         help_text="When its next full verification is due (drawn at random).")
    next_spot_check_at = models.DateTimeField(null=True, blank=True, db_index=True,
                                              help_text="When its idle GPUs are next spot-checked (drawn at random).")
    seen_host_key_fingerprint = models.CharField(
        max_length=60, blank=True, help_text="A different host key seen on contact (quarantined nodes)."
    )
    # Set at first contact (provisioning.services.nodes._pin_host_key): the platform logged in to the server with
    # this node's own key, which only someone who controls the server could install, and pinned the host key it
    # showed. Only then does the node hold its address and port and its host key (node_unique_live_endpoint,
    # node_unique_live_host_key): a node nobody proved (null) holds nothing, else anyone could register someone
    # else's server (its address, or the host key `ssh-keyscan` reads) first and keep its owner out for good.
    control_proven_at = models.DateTimeField(
        null=True, blank=True, editable=False,
        help_text="When the platform first logged in to the server with this node's key (it pinned its host key "
                  "then); until then the node reserves neither its address nor its host key.")

    ssh_public_key = models.TextField(help_text="The platform's per-node public key (OpenSSH format).")
    ssh_private_key_encrypted = models.BinaryField(editable=False, help_text="Fernet token; never shown.")

    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["id"]
        constraints = [
            # One server, one live node, among the nodes that proved they control it (control_proven_at): a
            # node's address and port, or its host key, on two of them is the same server listed twice; the later
            # one is refused at its first contact (provisioning.services.nodes._pin_host_key: DuplicateHardware).
            # A node not yet proven reserves neither (registering them never tells an account whether a server is
            # on the platform, and squats nothing); retired nodes let them go.
            models.UniqueConstraint(
                fields=["address", "ssh_port"],
                condition=PROVEN_LIVE,
                name="node_unique_live_endpoint",
                violation_error_message="Another live node already uses this address and SSH port.",
            ),
            models.UniqueConstraint(
                fields=["host_key_fingerprint"],
                condition=PROVEN_LIVE & ~Q(host_key_fingerprint=""),
                name="node_unique_live_host_key",
                violation_error_message="Another live node already has this SSH host key.",
            ),
            # A provider's own live nodes, proven or not: registering the same server twice is refused at once
            # (services.nodes._node_create: 409 on the address, 400 on the host key), which tells them nothing
            # about anyone else's nodes.
            models.UniqueConstraint(
                fields=["provider", "address", "ssh_port"],
                condition=~Q(state="retired"),
                name="node_unique_own_live_endpoint",
                violation_error_message="You already have a live node at this address and SSH port.",
            ),
            models.UniqueConstraint(
                fields=["provider", "host_key_fingerprint"],
                condition=~Q(state="retired") & ~Q(host_key_fingerprint=""),
                name="node_unique_own_live_host_key",
                violation_error_message="You already have a live node with this SSH host key.",
            ),
            models.CheckConstraint(condition=Q(ssh_port__gte=1, ssh_port__lte=65535), name="node_port_range"),
            models.CheckConstraint(condition=Q(price_per_gpu_hour_micros__gt=0), name="node_price_positive"),
            models.CheckConstraint(condition=Q(disk_price_per_gb_month_micros__gte=0),
                                   name="node_disk_price_non_negative"),
            models.CheckConstraint(condition=Q(gpu_count__gte=1), name="node_gpu_count_positive"),
            models.CheckConstraint(condition=Q(reliability__gte=0, reliability__lte=1), name="node_reliability_0_1"),
            NODE_TRANSITIONS.check_constraint("state", "node_state_declared"),
        ]
        indexes = [
            models.Index(fields=["state", "verdict", "listed"], name="node_listable_idx"),
            models.Index(fields=["country", "city"], name="node_location_idx"),
            models.Index(fields=["price_per_gpu_hour_micros"], name="node_price_idx"),
            # Offers search (docs/BENCHMARKS.md): the bookable nodes' ids, merged with
            # gpu_free_node_idx for "has a free GPU" (the COUNT of every page) ...
            models.Index(fields=["id"], condition=OFFERABLE, name="node_offer_idx"),
            # ... and the default order, -score_per_dollar, read in order with no sort.
            models.Index(SCORE_PER_DOLLAR.desc(), models.F("id"), condition=OFFERABLE, name="node_offer_spd_idx"),
        ]

    def __str__(self):
        return f"{self.name} ({self.address}:{self.ssh_port})"

    def verify_allowed(self) -> bool:
        """May a verification be asked for now (provisioning.services.verification.node_verify_request)?"""
        return self.state == NodeState.VERIFYING or self.allows("verify")

    def transition_to(self, target: str) -> None:
        """Move to `target` in memory (the caller saves, with state_changed_at). Raises InvalidTransition."""
        super().transition_to(target)
        self.state_changed_at = timezone.now()


class GpuStatus(models.TextChoices):
    FREE = "free", "Free"
    RENTED = "rented", "Rented"
    UNAVAILABLE = "unavailable", "Unavailable (failed a check or taken out by the provider)"
    # Split into MIG slices: rented per slice (MigSlice), never whole. Only a free GPU becomes one, and it becomes
    # free again only with none of its slices allocated (provisioning.services.mig, under the GPU's row lock).
    MIG = "mig", "Split into MIG slices"


G = GpuStatus
GPU_TRANSITIONS = Transitions({
    G.FREE: {G.RENTED, G.UNAVAILABLE, G.MIG},
    # FREE/UNAVAILABLE: only once no instance holds it (Gpu.clean, the admin's check); a GPU marked unavailable
    # stays out when it is released.
    G.RENTED: {G.FREE, G.UNAVAILABLE},
    G.UNAVAILABLE: {G.FREE},
    G.MIG: {G.FREE, G.UNAVAILABLE},
}, actions={
    # Set-based, in marketplace.services.instances.common: only a free GPU is rented, only a rented one freed.
    "rent": (G.RENTED, {G.FREE}),
    "release": (G.FREE, {G.RENTED}),
})


class Gpu(StatefulModel, models.Model):
    transitions = GPU_TRANSITIONS

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="gpus")
    index = models.PositiveSmallIntegerField(help_text="nvidia-smi index on the node.")
    uuid = models.CharField(max_length=64, blank=True, help_text="GPU-... as read by the inventory.")
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, related_name="+")
    memory_mib = models.PositiveIntegerField()
    pci_bus_id = models.CharField(max_length=32, blank=True)
    status = models.CharField(max_length=12, choices=GpuStatus.choices, default=GpuStatus.FREE)
    lost_at = models.DateTimeField(
        null=True, blank=True,
        help_text="When a health check first found this GPU missing from the node's nvidia-smi (fallen off the bus); "
                  "empty while it answers. A lost GPU is not rented, and its instance waits interrupted.")

    class Meta:
        ordering = ["node_id", "index"]
        verbose_name = "GPU"
        constraints = [
            models.UniqueConstraint(fields=["node", "index"], name="gpu_unique_index_per_node"),
            # A GPU (its UUID) in at most one live node. A constraint cannot see the node's state (another
            # table), so this one is unconditional on the row and the services keep a UUID only on live nodes'
            # GPUs: node_retire clears them, and a node whose inventory names a GPU another node holds claims
            # none (node_apply_inventory). The first node to claim a UUID keeps it; no check-then-insert.
            models.UniqueConstraint(fields=["uuid"], condition=~Q(uuid=""), name="gpu_unique_uuid",
                                    violation_error_message="Another live node already has a GPU with this UUID."),
            GPU_TRANSITIONS.check_constraint("status", "gpu_status_declared"),
        ]
        indexes = [
            models.Index(fields=["node", "status"], name="gpu_node_status_idx"),
            # Free GPUs per node: the offers search's EXISTS and num_gpus_free read only this.
            models.Index(fields=["node"], condition=Q(status=GpuStatus.FREE), name="gpu_free_node_idx"),
        ]

    def __str__(self):
        return f"GPU {self.index} of node {self.node_id}"

    def clean(self) -> None:
        held_stays_rented(self, "GPU")
        super().clean()


def held_stays_rented(row: Gpu | MigSlice, what: str) -> None:
    """A form's (the admin's) check for a GPU or a MIG slice: one that an instance holds (an allocation not
    released) keeps its status until the instance releases it. Taken out from under its instance, it would be
    booked twice (free) or let its node be retired with the VM still running (unavailable), and the node would go
    where nothing watches, meters or reconciles it. In a transaction (the admin's form and save share one) the
    row is locked first, so no booking takes it between this check and the save."""
    if row.pk is None:
        return
    rows = type(row)._default_manager.filter(pk=row.pk)
    if connection.in_atomic_block:
        rows = rows.select_for_update()
    stored = rows.values_list("status", flat=True).first()
    if stored is None or stored == row.status:
        return
    if isinstance(row, Gpu) and stored == GpuStatus.MIG:
        # Split into slices, it is held through its slices' allocations, and leaves `mig` only through its
        # node's check (provisioning.services.mig), which re-reads the card; the Node page's GPU rows too.
        raise ValidationError({"status": "This GPU is split into MIG slices: it leaves MIG only through its "
                                         "node's check (declare the node's MIG layout without it, then verify)."})
    holder = row.allocations.filter(released_at__isnull=True).values_list("instance_id", "instance__status").first()
    if holder is not None:
        raise ValidationError({"status": (
            f"Instance {holder[0]} ({holder[1]}) holds this {what}: it stays {stored} until that instance "
            f"releases it (stopped, destroyed or failed). Unlist the node, or put it into maintenance, so that it "
            f"takes no new rentals, and change this {what} once the instance is over.")})
