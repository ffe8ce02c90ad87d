"""What renters own and run: SSH keys, images, instances, and which GPUs an instance holds.

The instance state machine lives here (INSTANCE_TRANSITIONS, on core.transitions) and nowhere else, with the
renter's verbs (which state allows stop, start, restart, destroy) that the API and the pages both read. A GPU can
never be in two live instances: GpuAllocation has a unique constraint on the GPU among
allocations not yet released.
"""
from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.utils import timezone

from core.idempotency import IDEMPOTENCY_KEY_MAX_LENGTH
from core.transitions import StatefulModel, Transitions

from .catalogue import GpuModel
from .nodes import Gpu, Node


class SshKey(models.Model):
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="ssh_keys")
    name = models.CharField(max_length=100, blank=True)
    public_key = models.TextField(help_text="'<type> <base64>' as OpenSSH writes it, without options.")
    fingerprint = models.CharField(max_length=60, help_text="SHA256:... as `ssh-keygen -lf` prints it.")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name = "SSH key"
        constraints = [
            models.UniqueConstraint(fields=["user", "fingerprint"], name="sshkey_unique_per_user"),
        ]

    def __str__(self):
        return f"{self.name or self.fingerprint} ({self.user})"


class Image(models.Model):
    """A template renters start from, with what each runtime needs to run it."""

    slug = models.SlugField(max_length=40, unique=True)
    name = models.CharField(max_length=100)
    description = models.TextField(blank=True)
    docker_image = models.CharField(max_length=200, blank=True, help_text="Container image for `docker` nodes.")
    libvirt_image = models.CharField(max_length=200, blank=True,
                                     help_text="Cloud image file name for `libvirt` nodes.")
    min_disk_gb = models.PositiveIntegerField(default=20)
    active = models.BooleanField(default=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name

    def supports(self, runtime: str) -> bool:
        # A simulated node accepts any image and runs none of it: its VMs are shells on the demo host (with the
        # host's OS, which the instance shows), so the catalogue's descriptions say none of the software is there.
        return {"docker": bool(self.docker_image), "libvirt": bool(self.libvirt_image), "sim": True}[runtime]

    @property
    def runtimes(self) -> list[str]:
        return [r for r in ("docker", "libvirt", "sim") if self.supports(r)]


class InstanceStatus(models.TextChoices):
    REQUESTED = "requested", "Requested"
    PROVISIONING = "provisioning", "Provisioning"
    RUNNING = "running", "Running"
    INTERRUPTED = "interrupted", "Interrupted: its node or VM stopped answering"
    STOPPING = "stopping", "Stopping"
    STOPPED = "stopped", "Stopped"
    STARTING = "starting", "Starting"
    DESTROYING = "destroying", "Destroying"
    DESTROYED = "destroyed", "Destroyed"
    FAILED = "failed", "Failed"


IS = InstanceStatus
INSTANCE_TRANSITIONS = Transitions({
    IS.REQUESTED: {IS.PROVISIONING, IS.FAILED, IS.DESTROYING},
    IS.PROVISIONING: {IS.RUNNING, IS.FAILED, IS.DESTROYING},
    # STARTING: a restart. INTERRUPTED: the platform lost its node or its VM (billing stops).
    IS.RUNNING: {IS.STOPPING, IS.STARTING, IS.DESTROYING, IS.FAILED, IS.INTERRUPTED},
    # RUNNING: the node answered again with the VM up; STARTING: with the VM down (it is started again);
    # FAILED: the VM is gone; DESTROYED: the renter deleted it while the node was unreachable (the VM is
    # removed when the node answers again).
    IS.INTERRUPTED: {IS.RUNNING, IS.STARTING, IS.FAILED, IS.DESTROYING, IS.DESTROYED},
    # RUNNING: a stop that never reached the node (the VM runs as before: vms.vm_failed).
    IS.STOPPING: {IS.STOPPED, IS.RUNNING, IS.FAILED, IS.DESTROYING},
    # FAILED: its VM vanished from the node; DESTROYED: deleted while its node is unreachable.
    IS.STOPPED: {IS.STARTING, IS.DESTROYING, IS.FAILED, IS.DESTROYED},
    IS.STARTING: {IS.RUNNING, IS.STOPPED, IS.FAILED, IS.DESTROYING},
    IS.DESTROYING: {IS.DESTROYED, IS.FAILED},
    IS.FAILED: {IS.DESTROYING},
    IS.DESTROYED: set(),
}, actions={
    # The renter's verbs (marketplace.services.instances.lifecycle; the API's actions and the page's buttons):
    # verb: (the state it takes, the states it may be asked in). Asked again in the state it takes, a verb
    # changes nothing; destroy from interrupted (or stopped on an unreachable node) ends at destroyed at once.
    "stop": (IS.STOPPING, {IS.RUNNING}),
    "start": (IS.STARTING, {IS.STOPPED}),
    "restart": (IS.STARTING, {IS.RUNNING}),
    "destroy": (IS.DESTROYING, None),
})
# States in which an instance may hold GPUs (allocations not released). A destroying instance
# keeps its GPUs until the node confirms the VM is gone (instance_mark_destroyed releases them).
LIVE_STATUSES = (IS.REQUESTED, IS.PROVISIONING, IS.RUNNING, IS.INTERRUPTED, IS.STOPPING, IS.STARTING,
                 IS.DESTROYING)
# States the instance never leaves by itself (no worker is acting on it).
FINAL_STATUSES = (IS.DESTROYED, IS.FAILED)
# Over (destroyed or failed) and its disk still on its node: failed after it ran (the VM is kept, stopped, until it is
# destroyed), unless its VM is known gone (`vm_gone`), or its VM still to be removed by a cleanup. The instances over
# that still hold a GPU or a MIG slice are the other such ones (marketplace.selectors.over_but_holding_its_disk);
# these two have an index of their own.
OVER_DISK_KEPT = Q(status__in=FINAL_STATUSES) & (Q(status=IS.FAILED, started_at__isnull=False, vm_gone=False)
                                                 | Q(vm_cleanup_pending=True))
# A renter's instances that their burn rate counts (GPU time, or a stopped one's disk: services.funds), indexed
# apart from their history (`instance_renter_live_idx`): a renter who booked and destroyed thousands of short jobs
# made every booking of theirs read all of them.
RATE_COUNTED_STATUSES = (IS.REQUESTED, IS.PROVISIONING, IS.STARTING, IS.RUNNING, IS.STOPPED)


def vm_id_of(instance_id: int) -> str:
    """The name of instance `instance_id`'s VM on its node (the agent's vm_id)."""
    return f"inst-{instance_id}"


class Instance(StatefulModel, models.Model):
    transitions = INSTANCE_TRANSITIONS

    renter = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="instances")
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="instances")
    gpu_model = models.ForeignKey(GpuModel, on_delete=models.PROTECT, related_name="+")
    num_gpus = models.PositiveSmallIntegerField()
    # A MIG instance: `num_gpus` slices of this profile (MigSliceAllocation), priced per slice-hour; "" otherwise.
    mig_profile = models.CharField(max_length=20, blank=True)
    # Booked with require_nvlink: its GPUs all on one NVLink island of the node, at the booking and at every start
    # that takes GPUs again (lifecycle.instance_start refuses, 409, rather than spanning islands).
    require_nvlink = models.BooleanField(default=False, help_text=(
        "Booked with require_nvlink: its GPUs are kept on one NVLink island of the node, also when a start of the "
        "stopped instance takes GPUs again (refused rather than spanning islands)."))
    # A catalogue image, or (image None) the renter's own OCI reference in `image_ref`.
    image = models.ForeignKey(Image, on_delete=models.PROTECT, related_name="instances", null=True, blank=True)
    image_ref = models.CharField(max_length=512, blank=True,
                                 help_text="The renter's own image: an OCI reference (when `image` is empty).")
    # Registry login for a private image: a Fernet token of {"username", "password"} (marketplace.encryption),
    # sent to the node for the pull only, never shown; cleared once the instance is failed or destroyed.
    # `registry_auth` says that one was given (all the API ever shows of it).
    registry_auth_encrypted = models.BinaryField(null=True, blank=True, editable=False,
                                                 help_text="Fernet token; never shown.")
    registry_auth = models.BooleanField(default=False, help_text="Whether a registry login was given.")
    # Environment variables (renters put API keys there): the values are a Fernet token of the {NAME: value} object,
    # sent to the node in the `vm create` request only and cleared once the instance is failed or destroyed; the
    # names, in the renter's order, are all the API and the pages show (values masked).
    env_encrypted = models.BinaryField(null=True, blank=True, editable=False, help_text="Fernet token; never shown.")
    env_names = models.JSONField(default=list, blank=True, help_text="The names of the environment variables set.")
    onstart = models.TextField(blank=True, help_text="Script run once at the first boot, inside the instance.")
    ports_requested = models.JSONField(default=list, blank=True, help_text="Container TCP ports to expose.")
    ports = models.JSONField(default=dict, blank=True,
                             help_text='Where they are reachable, as the node mapped them: {"8888/tcp": {...}}.')
    min_cuda_version = models.CharField(max_length=8, blank=True, help_text="The renter's minimum, e.g. 12.2.")
    os = models.CharField(max_length=200, blank=True,
                          help_text="The instance's OS as its node read it (PRETTY_NAME).")
    label = models.CharField(max_length=100, blank=True)
    disk_gb = models.PositiveIntegerField()
    ssh_public_keys = models.JSONField(default=list, help_text="The keys injected at creation (public halves).")

    status = models.CharField(max_length=12, choices=InstanceStatus.choices, default=InstanceStatus.REQUESTED)
    status_message = models.CharField(max_length=500, blank=True)
    ssh_host = models.CharField(max_length=253, blank=True)
    ssh_port = models.PositiveIntegerField(null=True, blank=True)
    ssh_user = models.CharField(max_length=32, blank=True)

    # Price snapshot at booking, integer micro-dollars: later price changes never reach it.
    price_per_gpu_hour_micros = models.BigIntegerField()
    price_per_hour_micros = models.BigIntegerField()
    # Platform fee snapshot at booking, in basis points (1500 = 15 %): the provider earns the price
    # minus this share, for the instance's whole life, whatever PLATFORM_FEE_PERCENT becomes later.
    platform_fee_bps = models.PositiveIntegerField(default=0)
    # Metering (billing.services.metering), written only with this row locked. The instance is billed
    # while `running`, per whole second since `started_at`; `billed_until` is where its last usage
    # interval ended, `billed_seconds` and `cost_micros` the totals over its whole life, so that
    # cost_micros == floor(price_per_hour_micros * billed_seconds / 3600) always (cumulative rounding), counted
    # from the last price change or give-back if there was one (rate_base_*, below).
    billed_until = models.DateTimeField(null=True, blank=True)
    billed_seconds = models.BigIntegerField(default=0)
    cost_micros = models.BigIntegerField(default=0)
    # Of billed_seconds, those given back since (billed after its VM's last sighting, found lost just as a stop
    # closed its run: billing.services.metering.usage_give_back, under this row's lock). billed_seconds and
    # cost_micros stay what was charged; the seconds paid for, which every page and API shows, are billed_seconds −
    # given_back_seconds. A give-back moves the rate base (below) on by its seconds and what they were charged, so
    # the seconds billed later cost what they would have after the seconds paid for.
    given_back_seconds = models.BigIntegerField(default=0)
    # A price change while rented (hardware measured worse, or better again: instances.pricing) starts a new
    # stretch at the new price, and a give-back moves it on (metering._rebase_after_give_back): cost_micros ==
    # rate_base_cost_micros + floor(price_per_hour_micros × (billed_seconds − rate_base_seconds) / 3600). Both are 0
    # for an instance whose price never changed and nothing was given back.
    rate_base_seconds = models.BigIntegerField(default=0)
    rate_base_cost_micros = models.BigIntegerField(default=0)
    # Its price per GPU-hour before its first cut, and its node's score then: a later re-check that measures the
    # node better raises the price back towards it, never above (instances.pricing). Null when never cut, or
    # since its price is back in full.
    price_before_cut_per_gpu_hour_micros = models.BigIntegerField(null=True, blank=True)
    score_before_cut = models.FloatField(null=True, blank=True)
    # Its disk while stopped (billing.services.storage): the node's price per GB-month at booking, billed per
    # second from `stopped_at` while stopped; disk_cost_micros == disk_rate_base_cost_micros + floor(disk_gb ×
    # price × (disk_billed_seconds − disk_rate_base_seconds) / SECONDS_PER_MONTH) (cumulative rounding, as for its
    # GPU time). The disk's rate base is 0 and 0 until a give-back (storage.disk_give_back) moves it on by the
    # seconds given back and what they were charged, so that later seconds cost what the seconds paid for cost,
    # as a give-back re-bases the GPU meter (rate_base_*); its cost is then what the give-backs gave back.
    disk_price_per_gb_month_micros = models.BigIntegerField(default=0)
    disk_billed_until = models.DateTimeField(null=True, blank=True)
    disk_billed_seconds = models.BigIntegerField(default=0)
    disk_cost_micros = models.BigIntegerField(default=0)
    disk_rate_base_seconds = models.BigIntegerField(default=0)
    disk_rate_base_cost_micros = models.BigIntegerField(default=0)

    idempotency_key = models.CharField(max_length=IDEMPOTENCY_KEY_MAX_LENGTH, blank=True)
    request_fingerprint = models.CharField(max_length=64, blank=True, help_text="SHA-256 of the create request.")

    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True, help_text="When it last became running.")
    stopped_at = models.DateTimeField(null=True, blank=True)
    destroyed_at = models.DateTimeField(null=True, blank=True)
    vm_cleanup_pending = models.BooleanField(
        default=False, help_text="Destroyed while its node could not be reached: its VM and disk are still to be "
                                 "removed by the reconciler (a stopped instance holds no GPU that would say so).")
    # Failed, and the platform knows its VM is gone from the node (the node said it has none, or lists it missing;
    # the provisioning removed it, or never made it; the node was retired): its disk room and the volumes it
    # mounted are free for others at once. Without it a failed instance that ran keeps both until its renter
    # destroys it, as its VM, the renter's data on it, may still be there (OVER_DISK_KEPT).
    vm_gone = models.BooleanField(
        default=False, help_text="Failed with its VM known to be gone from its node: it holds no disk room there, "
                                 "nor the volumes it mounted.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.UniqueConstraint(
                fields=["renter", "idempotency_key"], condition=~Q(idempotency_key=""),
                name="instance_unique_idempotency_key",
            ),
            models.CheckConstraint(condition=Q(num_gpus__gte=1), name="instance_num_gpus_positive"),
            models.CheckConstraint(condition=Q(platform_fee_bps__lte=10_000), name="instance_fee_at_most_100_percent"),
            models.CheckConstraint(condition=Q(billed_seconds__gte=0, cost_micros__gte=0),
                                   name="instance_billing_totals_non_negative"),
            INSTANCE_TRANSITIONS.check_constraint("status", "instance_status_declared"),
            # Exactly one of a catalogue image and the renter's own reference.
            models.CheckConstraint(condition=Q(image__isnull=False, image_ref="") | (Q(image__isnull=True)
                                                                                     & ~Q(image_ref="")),
                                   name="instance_image_xor_reference"),
        ]
        indexes = [models.Index(fields=["status"], name="instance_status_idx"),
                   # A node's instances booked since its last check, without its history: the offers' disk room
                   # (services/disk_room.py) reads it per node listed.
                   models.Index(fields=["node", "created_at"], include=["disk_gb"], name="instance_node_live_idx",
                                condition=~Q(status__in=FINAL_STATUSES)),
                   # The same for the few over whose disk is kept (OVER_DISK_KEPT): the node's history stays unread.
                   models.Index(fields=["node", "created_at"], include=["disk_gb"], name="instance_node_kept_idx",
                                condition=OVER_DISK_KEPT),
                   models.Index(fields=["renter"], name="instance_renter_live_idx",
                                condition=Q(status__in=RATE_COUNTED_STATUSES)),
                   # The operators' list's date drill-down (admin/renting.py, DateDrillDown): its bounds and each
                   # period's rows are a MIN read in the index, its choices range lookups.
                   models.Index(fields=["created_at"], name="instance_created_at_idx")]

    def __str__(self):
        return f"instance {self.pk} ({self.status})"

    @property
    def vm_id(self) -> str:
        """The VM's name on the node: derived from the id, never from user input."""
        return vm_id_of(self.pk)

    @property
    def image_name(self) -> str:
        """What it runs, in words: the catalogue image's slug, or the renter's own reference."""
        image = self.image  # None without a query when image_id is None
        return image.slug if image is not None else self.image_ref

    def transition_to(self, target: str, message: str = "") -> None:
        """Move to `target` in memory (the caller saves). Raises InvalidTransition."""
        super().transition_to(target)
        self.status_message = message[:500]


class GpuAllocation(models.Model):
    """An instance holds a GPU from `allocated_at` until `released_at`."""

    instance = models.ForeignKey(Instance, on_delete=models.PROTECT, related_name="allocations")
    gpu = models.ForeignKey(Gpu, on_delete=models.PROTECT, related_name="allocations")
    allocated_at = models.DateTimeField(default=timezone.now)
    released_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["gpu__index"]
        constraints = [
            models.UniqueConstraint(fields=["gpu"], condition=Q(released_at__isnull=True),
                                    name="gpu_in_at_most_one_live_allocation"),
        ]

    def __str__(self):
        return f"{self.gpu} → instance {self.instance_id}"


class InterruptionCause(models.TextChoices):
    NODE_LOST = "node_lost", "The node stopped answering health checks"
    VM_LOST = "vm_lost", "The VM stopped running on the node"
    GPU_LOST = "gpu_lost", "A GPU of the instance vanished from the node (fell off the bus)"


class InterruptionOutcome(models.TextChoices):
    RESUMED = "resumed", "Resumed: the VM was intact"
    RESTARTED = "restarted", "The VM was started again"
    FAILED = "failed", "Failed: the VM was gone"
    DESTROYED = "destroyed", "Destroyed by the renter"


# An interruption is open (no outcome) until it ends, once, with one of the outcomes.
INTERRUPTION_TRANSITIONS = Transitions({
    "": set(InterruptionOutcome),
    **{outcome: set() for outcome in InterruptionOutcome},
})


class Interruption(StatefulModel, models.Model):
    """A stretch of time in which a running instance was out of the renter's reach through no fault of theirs.

    Billing stopped at `started_at` (the last moment the node was seen healthy, or the VM seen running);
    `ended_at` is when the instance left `interrupted`. The renter is credited by the published rule
    (billing.services.credits): `credited_seconds` of lost time were credited so far, `credited_micros` in all.
    """

    transitions = INTERRUPTION_TRANSITIONS
    state_field = "outcome"

    instance = models.ForeignKey(Instance, on_delete=models.PROTECT, related_name="interruptions")
    cause = models.CharField(max_length=12, choices=InterruptionCause.choices)
    detail = models.CharField(max_length=500, blank=True, help_text="What the platform saw, in words.")
    started_at = models.DateTimeField(help_text="Last moment the node or VM was seen healthy; billing stopped here.")
    detected_at = models.DateTimeField()
    ended_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=12, choices=InterruptionOutcome.choices, blank=True)
    credited_seconds = models.BigIntegerField(default=0)
    credited_micros = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            # At most one open interruption per instance: a second detection finds the first.
            models.UniqueConstraint(fields=["instance"], condition=Q(ended_at__isnull=True),
                                    name="interruption_one_open_per_instance"),
            models.CheckConstraint(condition=Q(detected_at__gte=F("started_at")),
                                   name="interruption_detected_after_start"),
            models.CheckConstraint(condition=Q(credited_seconds__gte=0, credited_micros__gte=0),
                                   name="interruption_credit_non_negative"),
            INTERRUPTION_TRANSITIONS.check_constraint("outcome", "interruption_outcome_declared"),
            # Ended exactly when it has an outcome (marketplace.services.instances.interruptions sets both).
            models.CheckConstraint(condition=Q(ended_at__isnull=True, outcome="") | (Q(ended_at__isnull=False)
                                                                                    & ~Q(outcome="")),
                                   name="interruption_ended_iff_outcome"),
        ]
        # The operators' list's date drill-down (admin/renting.py, DateDrillDown), as the instances'.
        indexes = [models.Index(fields=["started_at"], name="interruption_started_at_idx")]

    def __str__(self):
        return f"interruption {self.pk} of instance {self.instance_id} ({self.cause})"

    def lost_seconds(self, until) -> int:
        """Whole seconds lost from `started_at` to `ended_at` (or `until` while still open)."""
        end = self.ended_at or until
        return max(int((end - self.started_at).total_seconds()), 0)
