"""Jobs (one row per piece of work a worker does on a node) and node events for operators."""
from django.db import models
from django.db.models import Q
from django.utils import timezone

from core.transitions import StatefulModel, Transitions


class JobKind(models.TextChoices):
    NODE_VERIFY = "node_verify", "Verify node"
    NODE_SPOT_CHECK = "node_spot_check", "Spot-check node"
    INSTANCE_PROVISION = "instance_provision", "Provision instance"
    INSTANCE_START = "instance_start", "Start instance"
    INSTANCE_STOP = "instance_stop", "Stop instance"
    INSTANCE_RESTART = "instance_restart", "Restart instance"
    INSTANCE_DESTROY = "instance_destroy", "Destroy instance"
    VOLUME_CREATE = "volume_create", "Create volume"
    VOLUME_DELETE = "volume_delete", "Delete volume"


class JobStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


class JobFault(models.TextChoices):
    """Whose failure a failed job is (runner.job_finish records it where the failure is decided). Only the node's
    count against it (reliability.RELIABILITY): a failure the platform caused (its own SSH sessions holding the
    node, its time running out while it waited on itself, a lost worker, its own bug, a refusal of its own) or the
    renter's (their image, their destroy superseding the job) says nothing about the node. HOST_KEY: the job met the
    changed SSH host key its node is quarantined for already (nodes.HostKeyStillChanged): the node's doing, but
    counted once, by the quarantine (its critical event, the failure of the job or check that met it first), so not
    again; nor the platform's (before, such jobs were: the operators' count of the platform's failures took them)."""

    NODE = "node", "The node's"
    PLATFORM = "platform", "The platform's"
    RENTER = "renter", "The renter's"
    HOST_KEY = "host_key", "The node's changed host key (counted once, by its quarantine)"


J = JobStatus
JOB_TRANSITIONS = Transitions({
    # SUCCEEDED/FAILED from QUEUED: closed by a service or the reaper before any worker claimed it.
    J.QUEUED: {J.RUNNING, J.SUCCEEDED, J.FAILED},
    # RUNNING again: a retry, or a takeover of a lost worker's job, claims it anew (runner.job_begin).
    J.RUNNING: {J.RUNNING, J.SUCCEEDED, J.FAILED},
    J.SUCCEEDED: set(),
    J.FAILED: set(),
})
# Open: not final (queued, running).
OPEN_JOB_STATUSES = tuple(s for s in JobStatus if s not in JOB_TRANSITIONS.final)
OPEN = Q(status__in=OPEN_JOB_STATUSES)
# The jobs that create, start or stop an instance's VM. While one is open, a destroy waits for it, and the
# reconciler frees no GPU of the instance: the job may be making a VM on them (services.vms, reconcile).
VM_JOB_KINDS = (JobKind.INSTANCE_PROVISION, JobKind.INSTANCE_START, JobKind.INSTANCE_RESTART, JobKind.INSTANCE_STOP)


class Job(StatefulModel, models.Model):
    transitions = JOB_TRANSITIONS

    kind = models.CharField(max_length=24, choices=JobKind.choices)
    node = models.ForeignKey("marketplace.Node", on_delete=models.CASCADE, related_name="jobs")
    instance = models.ForeignKey("marketplace.Instance", null=True, blank=True, on_delete=models.CASCADE,
                                 related_name="jobs")
    volume = models.ForeignKey("marketplace.Volume", null=True, blank=True, on_delete=models.CASCADE,
                               related_name="jobs")
    status = models.CharField(max_length=10, choices=JobStatus.choices, default=JobStatus.QUEUED)
    step = models.CharField(max_length=200, blank=True, help_text="What the job is doing now.")
    attempts = models.PositiveSmallIntegerField(default=0)
    error = models.TextField(blank=True)
    fault = models.CharField(max_length=8, choices=JobFault.choices, blank=True, default="",
                             help_text="Whose failure it is (failed jobs only); only the node's count against its "
                                       "reliability.")
    log = models.JSONField(default=list, blank=True, help_text="[{at, message}] of the steps taken.")
    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    deadline = models.DateTimeField(help_text="A job still open after this is failed by the reaper.")
    # The outbox (provisioning/services/jobs.py): the row is the truth; the broker only carries a copy of it.
    sent_at = models.DateTimeField(null=True, blank=True, help_text="When it was last handed to the broker.")
    send_attempts = models.PositiveIntegerField(default=0, help_text="Times it was handed (or tried) to the broker.")
    send_error = models.CharField(max_length=500, blank=True, help_text="Why the last hand-off failed, if it did.")
    # Who runs it now (provisioning/services/runner.py): the execution that claimed it, and its last sign of life.
    runner = models.CharField(max_length=255, blank=True,
                              help_text="'<task id> <worker>:<pid>:<nonce>' of the execution holding it; "
                                        "empty when none does (queued, or waiting to be retried).")
    heartbeat_at = models.DateTimeField(null=True, blank=True,
                                        help_text="Last sign of life of the execution holding it (or when a "
                                                  "retry is due). Stale: the dispatcher sends the job again.")
    lost_runs = models.PositiveSmallIntegerField(default=0, help_text="Executions lost with their worker.")

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            JOB_TRANSITIONS.check_constraint("status", "job_status_declared"),
            # runner.job_finish closes a job and stamps it in one write.
            models.CheckConstraint(condition=OPEN | Q(finished_at__isnull=False), name="job_finished_has_finished_at"),
            # A fault is one of the declared ones, and only a failed job has one.
            models.CheckConstraint(condition=Q(fault="") | Q(status=JobStatus.FAILED, fault__in=JobFault.values),
                                   name="job_fault_of_a_failed_job"),
            # One open job of each kind per instance: each instance job is queued with the *ing state that asks
            # for it (a verb asked again in that state queues nothing). Kinds differ when one overlaps another
            # by design: a destroy asked while the provision still runs. provisioning.services.jobs.job_create
            # answers a Conflict when this is hit.
            models.UniqueConstraint(fields=["instance", "kind"], condition=OPEN & Q(instance__isnull=False),
                                    name="job_one_open_per_instance_and_kind"),
            # One open node-level job (a verification or a spot check) per node: node_verify_request returns the
            # open verification, and answers a Conflict while a spot check runs (a minute at most); a spot check
            # is not queued while any node job is open. So a spot check and a full verification never overlap.
            models.UniqueConstraint(fields=["node"], condition=OPEN & Q(instance__isnull=True, volume__isnull=True),
                                    name="job_one_open_node_job_per_node"),
            # One open job of each kind per volume (a create, then a delete asked meanwhile, may overlap).
            models.UniqueConstraint(fields=["volume", "kind"], condition=OPEN & Q(volume__isnull=False),
                                    name="job_one_open_per_volume_and_kind"),
        ]
        indexes = [
            models.Index(fields=["status", "deadline"], name="job_open_deadline_idx"),
            models.Index(fields=["node", "-created_at"], name="job_node_recent_idx"),
            # What the job relay picks (provisioning/services/relay.py): the jobs never handed to the broker.
            models.Index(fields=["id"], condition=Q(status="queued", sent_at__isnull=True, send_attempts=0),
                         name="job_relay_unsent_idx"),
            # The dashboard's "failed in 24 h" counts (operations/dashboard.py): job_open_deadline_idx read every
            # failed job ever made and filtered finished_at on the table (review r54).
            models.Index(fields=["finished_at"], condition=Q(status="failed"), name="job_failed_finished_idx"),
        ]

    def __str__(self):
        return f"{self.get_kind_display()} #{self.pk} ({self.status})"


class NodeEvent(models.Model):
    """Something operators should see about a node: quarantine, offline, back online, orphans."""

    class Level(models.TextChoices):
        INFO = "info", "Info"
        WARNING = "warning", "Warning"
        CRITICAL = "critical", "Critical"

    node = models.ForeignKey("marketplace.Node", on_delete=models.CASCADE, related_name="events")
    level = models.CharField(max_length=10, choices=Level.choices, default=Level.INFO)
    kind = models.CharField(max_length=40)
    message = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            # The dashboard's critical events of the last 7 days, newest first (operations/dashboard.py): with no
            # index but the node's, the table (never pruned) was read in full on each admin front page (review r54).
            models.Index(fields=["-created_at"], name="nodeevent_recent_idx"),
            # A node's events, newest first (its page, the provider's events API): the node's rows in order.
            models.Index(fields=["node", "-created_at", "-id"], name="nodeevent_node_recent_idx"),
        ]

    def __str__(self):
        return f"{self.kind} on node {self.node_id}"


class VerificationRun(models.Model):
    """One verification of a node: what was read and measured, the findings and the verdict."""

    node = models.ForeignKey("marketplace.Node", on_delete=models.CASCADE, related_name="verifications")
    job = models.OneToOneField(Job, null=True, blank=True, on_delete=models.SET_NULL, related_name="verification")
    verdict = models.CharField(max_length=12)
    findings = models.JSONField(default=list, blank=True, help_text="[{severity, code, message, gpu_index}]")
    inventory = models.JSONField(default=dict, blank=True)
    figures = models.JSONField(default=dict, blank=True, help_text="Measured figures, per GPU.")
    score = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["node", "-created_at"], name="verification_node_recent_idx")]

    def __str__(self):
        return f"verification {self.pk} of node {self.node_id}: {self.verdict}"


class HealthSample(models.Model):
    """Health checks of a node per day: how many answered and how many did not (the reliability figure's input).
    One row per node and day, counted up, so 30 days of minute-by-minute checks are 30 rows."""

    node = models.ForeignKey("marketplace.Node", on_delete=models.CASCADE, related_name="health_samples")
    day = models.DateField()
    ok = models.PositiveIntegerField(default=0)
    failed = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["node_id", "-day"]
        constraints = [models.UniqueConstraint(fields=["node", "day"], name="health_sample_one_per_node_day")]

    def __str__(self):
        return f"node {self.node_id} on {self.day}: {self.ok} ok, {self.failed} failed"
