"""MIG slices: the rentable parts of a GPU split by its provider's declared layout, and who holds them.

A slice exists once a check found it configured as declared (provisioning.services.mig). Its parent GPU is then
in status `mig`, which whole-GPU booking never takes (it rents only `free` GPUs), and a slice is booked only while
its parent is `mig`, read under a share lock on the parent's row: a slice and its parent GPU are never in two live
allocations at once. A slice is in at most one live allocation (a unique constraint, as for GPUs).
"""
from django.db import models
from django.db.models import Q
from django.utils import timezone

from core.transitions import StatefulModel, Transitions

from .nodes import Gpu, Node, held_stays_rented
from .renting import Instance


class SliceStatus(models.TextChoices):
    FREE = "free", "Free"
    RENTED = "rented", "Rented"
    UNAVAILABLE = "unavailable", "Unavailable (its last check did not prove it)"


SS = SliceStatus
SLICE_TRANSITIONS = Transitions({
    SS.FREE: {SS.RENTED, SS.UNAVAILABLE},
    SS.RENTED: {SS.FREE, SS.UNAVAILABLE},
    SS.UNAVAILABLE: {SS.FREE},
}, actions={
    "rent": (SS.RENTED, {SS.FREE}),
    "release": (SS.FREE, {SS.RENTED}),
})


class MigSlice(StatefulModel, models.Model):
    transitions = SLICE_TRANSITIONS

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="mig_slices")
    gpu = models.ForeignKey(Gpu, on_delete=models.CASCADE, related_name="mig_slices", help_text="The parent GPU.")
    profile = models.CharField(max_length=20, help_text="The MIG profile, e.g. 3g.40gb (marketplace.mig).")
    device = models.PositiveSmallIntegerField(help_text="The MIG device number on its GPU (`nvidia-smi -L`).")
    uuid = models.CharField(max_length=64, blank=True,
                            help_text="MIG-... as `nvidia-smi -L` prints it; empty once its node is retired.")
    memory_mib = models.PositiveIntegerField(help_text="What the check measured the slice to hold.")
    status = models.CharField(max_length=12, choices=SliceStatus.choices, default=SliceStatus.FREE)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["node_id", "gpu_id", "device"]
        verbose_name = "MIG slice"
        constraints = [
            # A retired node's slices let go of their UUIDs, as its GPUs do: the card may be registered again.
            models.UniqueConstraint(fields=["uuid"], condition=~Q(uuid=""), name="mig_slice_unique_uuid"),
            SLICE_TRANSITIONS.check_constraint("status", "mig_slice_status_declared"),
        ]
        indexes = [
            # Free slices per node and profile: offers and booking read only this.
            models.Index(fields=["node", "profile"], condition=Q(status=SliceStatus.FREE), name="mig_slice_free_idx"),
        ]

    def __str__(self):
        return f"MIG {self.profile} {self.device} of {self.gpu}"

    def clean(self) -> None:
        held_stays_rented(self, "MIG slice")
        super().clean()


class MigSliceAllocation(models.Model):
    """An instance holds a slice from `allocated_at` until `released_at`."""

    instance = models.ForeignKey(Instance, on_delete=models.PROTECT, related_name="slice_allocations")
    mig_slice = models.ForeignKey(MigSlice, on_delete=models.PROTECT, related_name="allocations")
    allocated_at = models.DateTimeField(default=timezone.now)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["mig_slice_id"]
        constraints = [
            models.UniqueConstraint(fields=["mig_slice"], condition=Q(released_at__isnull=True),
                                    name="mig_slice_in_at_most_one_live_allocation"),
        ]

    def __str__(self):
        return f"{self.mig_slice} → instance {self.instance_id}"
