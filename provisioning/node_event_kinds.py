"""Which node events a node's provider sees, under what title, and whether with their stored message.

A `NodeEvent`'s message is written for operators (the admin's node events). A kind shows to the node's provider
(`GET /api/v1/nodes/{id}/events/`, the server's page) only when it is in PROVIDER_KINDS: with its provider-facing
title, and with its stored message only where `message_shown` says so. Every kind any writer stores is in
PROVIDER_KINDS or in OPERATOR_ONLY_KINDS (tests/provisioning/test_round54_node_events_api.py reads every writer in
the code base: a new kind is shown to nobody but operators until it is classified here).

`message_shown` is True only where every writer of the kind was read and its message holds nothing about renters
(user ids, e-mails, what they run), operators or other providers: the node's own hardware, addresses, host keys and
volumes, the ids of the instances on it (its VMs are named `inst-<id>` on the provider's own server), the check's
findings (written for providers: the benchmarks API shows them), or the same words as the node's `last_error`
(which the node's page and the API show its provider already). A message that carries an operator's e-mail
(`host_key_accepted`, the operator's retire, unlist and maintenance) or the node agent's error text (docker's or
libvirt's words, which may quote a renter's container, image or volume) is blanked; its title still says what
happened. Audited writers: provisioning/services/{nodes,fleet_record,gpu_presence,spot_checks,reliability,
reconcile,verification,maintenance,mig,volumes,vms}.py and marketplace/services/nodes.py.

Plain data and two reads; no model rule lives here. Layering (DESIGN.md): the API (provisioning/api.py) and the
provider's page (marketplace/web/providers.py) read it; no service needs it.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from django.db.models import QuerySet

from provisioning.models import NodeEvent


@dataclass(frozen=True)
class ProviderKind:
    title: str
    message_shown: bool


def _shown(title: str) -> ProviderKind:
    return ProviderKind(title, True)


def _title_only(title: str) -> ProviderKind:
    return ProviderKind(title, False)


PROVIDER_KINDS: dict[str, ProviderKind] = {
    # Health checks (fleet_record): the count and the check's error, the node's last_error.
    "offline": _shown("Went offline: health checks failed"),
    "back_online": _shown("Back online"),
    "instances_interrupted": _shown("Instances interrupted"),
    # Host key (services/nodes.py, verification.py).
    "host_key_pinned": _shown("SSH host key pinned"),
    "host_key_changed": _shown("SSH host key changed: quarantined"),
    "host_key_accepted": _title_only("New SSH host key accepted by an operator"),  # the operator's e-mail
    # GPUs and inventory (gpu_presence, reliability).
    "gpu_lost": _shown("GPU lost: no longer listed by nvidia-smi"),
    "gpu_back": _shown("Lost GPU back"),
    "inventory_changed": _shown("GPU inventory changed: a new check is due"),
    # Spot checks (spot_checks): the findings as the benchmarks API shows them; the job's error.
    "spot_check_skipped": _shown("Spot check skipped"),
    "spot_check_passed": _shown("Spot check passed"),
    "spot_check_failed": _shown("Spot check failed"),
    "spot_check_failed_to_run": _shown("Spot check could not run"),
    "spot_check_gpu_missing": _shown("Spot check: a free GPU did not answer"),  # the node's card indices only
    # Verification (verification.py, maintenance.py): the node's last_error and the check's findings.
    "verified_verified": _shown("Verified"),
    "verified_degraded": _shown("Verified as degraded: listed, flagged"),
    "verified_rejected": _shown("Rejected by the benchmark check"),
    "verification_failed": _shown("Verification could not be completed"),
    "verification_dropped": _shown("Verification dropped: the node stopped answering"),
    "verification_retries_stopped": _shown("Verification retries stopped"),
    "failed_while_rented": _shown("Failed its check while rented"),
    "renters_price_cut": _shown("Renters' prices cut: measured worse"),
    "renters_price_raised_back": _shown("Renters' prices raised back: measured better"),
    # MIG (verification.py, mig.py): the other node is never named.
    "mig_layout_pending": _shown("Declared MIG layout pending"),
    "mig_layout_changed_during_check": _shown("MIG layout changed during the check"),
    "mig_slices_duplicate": _shown("A MIG device belongs to another node's slices"),
    # VMs (reconcile, fleet_record, services/nodes.py): VM names and instance ids of this server.
    "vm_vanished": _shown("VM vanished"),
    "vm_not_running": _shown("VM found not running"),
    "vm_missing": _shown("VM missing"),
    "vm_cleaned_up": _shown("VM of a destroyed instance removed"),
    "orphan_destroyed": _shown("VM no instance owns destroyed"),
    "unrecorded_vm_removed": _shown("Unrecorded VM removed"),
    "stopped_vm_running": _shown("Stopped instance's VM found running: stopped"),
    "foreign_vm": _shown("VM not made by the platform found (left as it is)"),
    "vm_stop_failed": _title_only("Could not stop a VM"),  # the agent's error text
    "vm_destroy_failed": _title_only("Could not remove a VM"),  # the agent's error text
    "vm_state_unknown": _title_only("The node cannot read a VM's state"),  # the agent's error text
    # Volumes and disks (reconcile, services/nodes.py): volume names and ids of this server.
    "orphan_volume_deleted": _shown("Unknown volume deleted"),
    "orphan_volume_in_use": _shown("Unknown volume in use (left as it is)"),
    "volume_found": _shown("Missing volume found again"),
    "volume_missing": _shown("Volume missing on the server"),
    "volume_lost": _shown("Volume lost"),
    "volume_deleted_late": _shown("Volume deleted after the server came back"),
    "orphan_volume_delete_failed": _title_only("Could not delete an unknown volume"),  # the agent's error text
    "volume_delete_failed": _title_only("Could not delete a volume"),  # the agent's error text
    "disk_limit_not_enforced": _shown("Disk size limits not enforced"),
    # vms._pull_failure: the disk filled during a renter's own image's pull (docker's words may quote the image).
    "pull_no_space": _title_only("Disk full while pulling an image"),
    # The provider's new address, SSH port or user, proven (marketplace/services/nodes.py node_endpoint_set): the
    # node's own endpoints and host key, and the ids of the instances on it whose SSH host followed.
    "endpoint_changed": _shown("SSH address changed"),
    # Retire and operators' actions (marketplace/services/nodes.py): the operator's e-mail is in theirs.
    "retired_unreachable": _shown("Retired while unreachable"),
    "retired_by_operator": _title_only("Retired by an operator"),
    "unlisted_by_operator": _title_only("Taken off the offers by an operator"),
    "maintenance_by_operator": _title_only("Put into maintenance by an operator"),
}

# Kinds shown to operators only (the admin), each with why.
OPERATOR_ONLY_KINDS: dict[str, str] = {
    # verification.node_verify_conclude writes f"verified_{verdict}"; a check concludes verified, degraded or
    # rejected, never unverified: listed so that every value of that kind is classified.
    "verified_unverified": "never written by a check; not a verdict a provider is told",
}


def provider_title(kind: str) -> str:
    shown = PROVIDER_KINDS.get(kind)
    return shown.title if shown is not None else ""


def provider_message(event: NodeEvent) -> str:
    """The event's stored message where its kind's messages are safe to show its provider; "" otherwise."""
    shown = PROVIDER_KINDS.get(event.kind)
    return event.message if shown is not None and shown.message_shown else ""


def node_events_for_provider(*, node_id: int) -> QuerySet[NodeEvent]:
    """The node's events its provider may see (PROVIDER_KINDS), newest first. The caller has decided that the
    caller may see the node."""
    return NodeEvent.objects.filter(node_id=node_id, kind__in=list(PROVIDER_KINDS)).order_by("-created_at", "-id")


@dataclass(frozen=True)
class ShownEvent:
    id: int
    created_at: datetime
    level: str
    kind: str
    title: str
    message: str


def recent_events_for_provider(*, node_id: int, limit: int = 20) -> list[ShownEvent]:
    """The node's `limit` latest provider-visible events as shown to its provider (one query)."""
    return [ShownEvent(e.pk, e.created_at, e.level, e.kind, provider_title(e.kind), provider_message(e))
            for e in node_events_for_provider(node_id=node_id)[:limit]]
