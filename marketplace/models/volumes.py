"""Volumes: storage a renter creates on a node, mounts into instances there, and keeps after they are gone.

The state machine lives here (VOLUME_TRANSITIONS). A volume is billed per second while it exists on its node
(from `available_at` until its deletion is asked for), at the price per GB-month its node published when it was
created (billing.services.storage). A volume is mounted by at most one instance that is not destroyed or failed:
the booking locks the volume's row and checks (marketplace.services.volumes), as deleting does.
"""
import secrets

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.utils import timezone

from core.idempotency import IDEMPOTENCY_KEY_MAX_LENGTH
from core.transitions import StatefulModel, Transitions

from .nodes import Node
from .renting import Instance

VOLUME_NAME_PATTERN = r"^vol-[a-z0-9]{8,32}$"  # the agent's contract (vm create's `volumes`, volume create)
MAX_VOLUME_GB = 65536


def new_volume_name() -> str:
    """The volume's name on the node: random, never from user input."""
    return f"vol-{secrets.token_hex(8)}"


class VolumeState(models.TextChoices):
    CREATING = "creating", "Creating on its node"
    AVAILABLE = "available", "Available"
    DELETING = "deleting", "Deleting"
    DELETED = "deleted", "Deleted"
    FAILED = "failed", "Failed: it could not be created"


V = VolumeState
# The volumes that count in a renter's commitments (services/funds.py, whose comment says why the ones being
# created count too) and caps.
COMMITTED_VOLUME_STATES = (VolumeState.CREATING, VolumeState.AVAILABLE)
# The volumes that hold room on their node's disk (services/disk_room.py): those committed, and those being
# deleted, whose data is there until their node deletes it (found by review: an instance being destroyed counted,
# a volume being deleted did not).
DISK_VOLUME_STATES = (*COMMITTED_VOLUME_STATES, VolumeState.DELETING)
VOLUME_TRANSITIONS = Transitions({
    V.CREATING: {V.AVAILABLE, V.FAILED},
    # DELETING -> AVAILABLE: the node refused (an instance still mounts it there); -> FAILED: the same for a volume
    # whose creation had failed (it was never available, so never billed: it does not become available now).
    V.AVAILABLE: {V.DELETING},
    V.DELETING: {V.DELETED, V.AVAILABLE, V.FAILED},
    V.FAILED: {V.DELETING},
    V.DELETED: set(),
}, actions={
    "delete": (V.DELETING, {V.AVAILABLE, V.FAILED}),
})


class Volume(StatefulModel, models.Model):
    transitions = VOLUME_TRANSITIONS
    state_field = "state"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="volumes")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="volumes")
    name = models.CharField(max_length=40, unique=True, default=new_volume_name,
                            help_text="Its name on the node (vol-...).")
    label = models.CharField(max_length=100, blank=True)
    size_gb = models.PositiveIntegerField()
    state = models.CharField(max_length=10, choices=VolumeState.choices, default=VolumeState.CREATING)
    status_message = models.CharField(max_length=500, blank=True)
    # Price snapshot at creation: micro-dollars per GB per 30-day month, and the platform's fee in basis points.
    price_per_gb_month_micros = models.BigIntegerField()
    platform_fee_bps = models.PositiveIntegerField(default=0)
    # Metering (billing.services.storage), written with this row locked: billed per whole second from
    # `available_at`; cost_micros == floor(size_gb * price_per_gb_month_micros * billed_seconds / SECONDS_PER_MONTH).
    billed_until = models.DateTimeField(null=True, blank=True)
    billed_seconds = models.BigIntegerField(default=0)
    cost_micros = models.BigIntegerField(default=0)
    # A create sent twice (an Idempotency-Key, a page's form token) makes one volume: unique per owner.
    idempotency_key = models.CharField(max_length=IDEMPOTENCY_KEY_MAX_LENGTH, blank=True)
    request_fingerprint = models.CharField(max_length=64, blank=True, help_text="SHA-256 of the create request.")
    created_at = models.DateTimeField(default=timezone.now)
    available_at = models.DateTimeField(null=True, blank=True, help_text="When it was created on its node.")
    deleted_at = models.DateTimeField(null=True, blank=True, help_text="When its deletion was asked for.")
    # An available volume its node's list did not have (the reconciler's look that asked at this moment): billed no
    # further, not mountable; cleared when a later list has it, ended as lost when the next look misses it too
    # (marketplace.services.volumes.volume_mark_missing, volume_mark_lost).
    missing_since = models.DateTimeField(null=True, blank=True,
                                         help_text="When its node's list first lacked it.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(condition=Q(size_gb__gte=1, size_gb__lte=MAX_VOLUME_GB), name="volume_size_range"),
            models.CheckConstraint(condition=Q(price_per_gb_month_micros__gte=0), name="volume_price_non_negative"),
            models.CheckConstraint(condition=Q(billed_seconds__gte=0, cost_micros__gte=0),
                                   name="volume_billing_totals_non_negative"),
            VOLUME_TRANSITIONS.check_constraint("state", "volume_state_declared"),
            models.UniqueConstraint(fields=["owner", "idempotency_key"], condition=~Q(idempotency_key=""),
                                    name="volume_unique_idempotency_key"),
        ]
        indexes = [models.Index(fields=["state"], name="volume_state_idx"),
                   # A node's volumes made since its last check, without its deleted ones: the offers' disk room
                   # (services/disk_room.py) reads it per node listed.
                   models.Index(fields=["node", "created_at"], include=["size_gb"], name="volume_node_held_idx",
                                condition=Q(state__in=DISK_VOLUME_STATES))]

    def __str__(self):
        return f"{self.name} ({self.size_gb} GB, {self.state})"


class VolumeMount(models.Model):
    """Volume `volume` is mounted at `mount` in instance `instance` (from its creation on)."""

    instance = models.ForeignKey(Instance, on_delete=models.PROTECT, related_name="volume_mounts")
    volume = models.ForeignKey(Volume, on_delete=models.PROTECT, related_name="mounts")
    mount = models.CharField(max_length=255)

    class Meta:
        ordering = ["instance_id", "mount"]
        constraints = [
            models.UniqueConstraint(fields=["instance", "volume"], name="volume_mount_once_per_instance"),
            models.UniqueConstraint(fields=["instance", "mount"], name="volume_mount_path_once_per_instance"),
        ]

    def __str__(self):
        return f"{self.volume} at {self.mount} in instance {self.instance_id}"
