"""Volumes: a renter's storage on one node, created there by a job, mounted into instances on that node at their
creation, kept across stop/start and after the instances are gone, deleted only when asked (and confirmed).

API side: `volume_create` (`volume_create_once` for a create that may be sent twice), `volume_delete`, and
`volume_mounts_for_booking` (the booking's checks of `volumes: [{"volume": id, "mount": "/data"}]`). Worker side:
the `volume_mark_*` functions, each in its own short transaction with the volume's row locked, idempotent.
Billing: billing.services.storage (from `available_at` until the deletion is asked for).

Creating one is renting: the balance must hold one hour of the renter's whole burn rate with it (the funds check of
marketplace.services.funds, 402), within the caps per renter (VOLUMES_PER_USER_MAX, VOLUMES_TOTAL_GB_PER_USER_MAX,
409) and the node's reported free disk (409).

A deletion is undone only when the node refuses it (a VM there still mounts the volume: `volume_delete_refused`).
One that could not reach the node stays `deleting`, its billing closed at the request, and is finished when the node
answers (the reconciler, provisioning.services.reconcile); one on a quarantined node is left so at once, no job
sent (none reaches that node until an operator accepts its new host key); a node retired while unreachable ends its
volumes with it (`node_volumes_lost`), and one left on a retired node (failed) is deleted at once, no job sent.

A volume is held by at most one instance (`_live_mount`): one that is not destroyed or failed, or one whose VM may
still be on the node, mounting it (the node's agent counts every VM record it has: it refuses the volume's delete,
and mounts it in a second VM all the same). A failed instance that ran (`started_at`) keeps its VM there, stopped,
or the node's record of it, until it is destroyed (its destroy job removes the VM); one over with its VM still to be
removed holds it too (`instances_awaiting_cleanup`). A failed instance that never ran holds it no more: its VM was
removed with its failure (or it waits for the cleanup above); nor does a failed one whose VM is known gone
(`Instance.vm_gone`). A constraint cannot see the instance's state, so the
booking locks the volumes' rows (FOR UPDATE, in id order) and then looks for a live mount; a deletion locks the row
and looks the same way. Two bookings of one volume run one after the other, and the second sees the first's mount;
a later mount means the earlier ones were let go for good (a failed instance let go and destroyed after does not
take the volume back).
"""
import posixpath
import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, Exists, OuterRef, Prefetch, QuerySet, Sum
from django.utils import timezone

from billing.models import EventKind
from billing.services.metering import platform_fee_bps
from billing.services.notify import event_create
from billing.services.storage import (
    storage_billed_until,
    storage_rate_per_hour_micros,
    volume_storage_close,
)
from core.errors import Conflict, IdempotencyKeyReused, NotFound, ValidationFailed
from core.idempotency import create_once
from marketplace.models import Instance, InstanceStatus, Node, NodeState, User, Volume, VolumeMount, VolumeState
from marketplace.models.nodes import Runtime
from marketplace.models.renting import FINAL_STATUSES
from marketplace.models.volumes import MAX_VOLUME_GB
from marketplace.selectors import instances_awaiting_cleanup, instances_awaiting_cleanup_by_node
from marketplace.services.disk_room import DiskDoesNotFit, node_disk_room
from marketplace.services.email_verification import email_verified_required
from marketplace.services.funds import COMMITTED_VOLUME_STATES, funds_for, funds_refuse_if_short
from marketplace.services.offer_rules import NODE_STATE_REASONS, node_refusal
from notifications.services.notify import Kind, notify
from provisioning.models import OPEN, Job, JobKind
from provisioning.services.jobs import job_create

MAX_VOLUMES_PER_INSTANCE = 8
MAX_MOUNT_CHARS = 255
_MOUNT_RE = re.compile(r"/[A-Za-z0-9._/-]+", re.ASCII)  # fullmatch: "$" let a trailing newline through
# The node agent's refusals (provisioning/agent/gpumarket_agent/options.py FORBIDDEN_MOUNTS, RESERVED_MOUNTS: its own
# mounts in a container), so that no booking the platform takes fails on the node (tests/marketplace/test_volumes.py
# feeds what this accepts to the agent's check).
# A volume at one of the agent's mounts (the renter's SSH keys at /root/.ssh/authorized_keys among them) was taken,
# and the node's docker refused the create ("Duplicate mount point"), counted as the node's failure (found by review):
# tests/provisioning/test_reserved_mounts.py holds the two lists equal.
# The system's own folders: the kernel's, and what the instance's SSH server and the platform's entry wrapper need
# to start it (its program and libraries, its configuration and host keys in /etc, its run-time folders). A volume
# over one (its content the renter's: over /etc/ssh, sshd has no configuration) could keep sshd from starting, and
# so a catalogue image's silent SSH server had to be taken as the renter's doing, never the node's (found by review).
# A path is judged as the folder it names (/usr/../etc is /etc) and refused above one too (/var holds /var/run).
_SYSTEM_MOUNT_ROOTS = ("/proc", "/sys", "/dev", "/bin", "/boot", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/run",
                       "/sbin", "/usr", "/var/empty", "/var/run")
_AGENT_MOUNTS = ("/.gpumarket", "/.gpumarket-state", "/root/.ssh/authorized_keys")
_FORBIDDEN_MOUNT_ROOTS = _SYSTEM_MOUNT_ROOTS + _AGENT_MOUNTS
# The runtimes whose VMs mount no volume: the libvirt agent refuses a `vm create` naming one (runtimes/libvirt.py
# LibvirtRuntime.check_spec; the booking refuses `volumes` there, instances.booking.RUNTIME_REFUSED_OPTIONS). A volume
# was created there all the same and billed per GB-month, and every booking mounting it failed on the node (found by
# review): tests/marketplace/test_round44_libvirt_options.py holds the two lists in step with the agent.
VOLUMELESS_RUNTIMES = frozenset({Runtime.LIBVIRT})


def node_mounts_volumes(node: Node) -> bool:
    """Whether instances on this node can mount volumes (so whether a volume can be created there)."""
    return node.runtime not in VOLUMELESS_RUNTIMES


# ----------------------------------------------------------------------------------------- reads


def volumes_for_user(*, user: User, include_deleted: bool = False) -> QuerySet[Volume]:
    """A renter's own volumes (deleted ones only when asked), with their mounts and those instances."""
    volumes = Volume.objects.filter(owner=user).select_related("node")
    if not include_deleted:
        volumes = volumes.exclude(state=VolumeState.DELETED)
    return volumes.prefetch_related(Prefetch("mounts", queryset=VolumeMount.objects.select_related("instance")))


def volume_live_instance_ids(volume: Volume) -> list[int]:
    """The instances whose own row says they hold it: not destroyed or failed, or failed after they ran (their VM
    kept on the node: _failed_vm_kept); with prefetched mounts, no query. Not every holder: one destroyed or failed
    whose VM is still to be removed from the node holds it too (volume_holder_ids)."""
    mounts = list(volume.mounts.all())
    latest = max((m.pk for m in mounts), default=None)
    return sorted(m.instance_id for m in mounts if _holds(m.instance, superseded=m.pk != latest))


def volume_holder_ids(volume: Volume, *, awaiting_cleanup: dict[int, set[int]] | None = None) -> list[int]:
    """Every instance that holds it, as its delete's refusal reads them (_live_mount): those of
    volume_live_instance_ids, and any that mounts it whose VM is still to be removed from the node
    (instances_awaiting_cleanup). `awaiting_cleanup`: instances_awaiting_cleanup_by_node for its node, read once
    for a page of volumes; else read here (one query)."""
    if awaiting_cleanup is None:
        awaiting_cleanup = instances_awaiting_cleanup_by_node(node_ids=[volume.node_id])
    leaving = awaiting_cleanup.get(volume.node_id, set())
    return sorted(set(volume_live_instance_ids(volume))
                  | {m.instance_id for m in volume.mounts.all() if m.instance_id in leaving})


def _failed_vm_kept(instance: Instance) -> bool:
    """A failed instance whose VM may still be on its node, mounting its volumes: it ran (its VM was made and kept,
    stopped, by its failure; or gone with the node's record of it kept, which counts as a mount there too). Only its
    destroy removes that VM for sure. One that never ran had its VM removed by its failure (vms.vm_failed destroys
    it, or waits for the cleanup: instances_awaiting_cleanup), as the reconciler does (started_at None). One whose VM
    is known gone (`vm_gone`: the node said so, or was retired) holds nothing either: before, its volume stayed
    unusable, and its disk room taken, until its renter destroyed it (found by review)."""
    return instance.status == InstanceStatus.FAILED and instance.started_at is not None and not instance.vm_gone


def _holds(instance: Instance, *, superseded: bool) -> bool:
    """Whether the instance's mount holds the volume, read from its row only. `superseded`: a later instance mounts
    the volume, so this one had let it go (failed with its VM gone) when that one was booked; its destroy, asked
    since (failed → destroying), takes nothing back."""
    if instance.status in FINAL_STATUSES:
        return _failed_vm_kept(instance)
    return not (superseded and instance.status == InstanceStatus.DESTROYING)


# Why a mount holds a volume (_live_mount).
_LIVE, _FAILED_VM, _LEAVING = "live", "failed", "leaving"


def _live_mount(volume: Volume) -> tuple[VolumeMount | None, str]:
    """A mount that holds the volume, and why: _LIVE (its instance is not destroyed or failed), _FAILED_VM (failed,
    its VM kept on the node: _failed_vm_kept) or _LEAVING (over, with its VM still on the node: destroyed while the
    node was away, or its destroy gave up; that VM may still mount it until the reconciler removes it, as it may
    still use its GPUs).

    A failed instance's mount was let go as soon as it failed: the node's record of its VM still mounted the volume,
    so a deletion was accepted (billing stopped), refused by the node and billed again, and a second instance
    mounted it beside the old VM (found by review)."""
    mounts = VolumeMount.objects.filter(volume_id=volume.pk).select_related("instance").order_by("instance_id")
    latest = mounts.order_by("-pk").values_list("pk", flat=True).first()
    for mount in mounts.exclude(instance__status=InstanceStatus.DESTROYED):
        if _holds(mount.instance, superseded=mount.pk != latest):
            return mount, _FAILED_VM if mount.instance.status == InstanceStatus.FAILED else _LIVE
    leaving = instances_awaiting_cleanup(node_id=volume.node_id)
    return (mounts.filter(instance_id__in=leaving).first() if leaving else None), _LEAVING


def _held_by(mount: VolumeMount, why: str) -> str:
    """Why `mount` keeps the volume, to the renter."""
    if why == _LEAVING:
        return (f"instance {mount.instance_id} is destroyed, but its VM, which mounts it, is still to be removed from "
                "the node (when the node answers); try again then")
    if why == _FAILED_VM:
        return (f"instance {mount.instance_id} failed, but its VM, which mounts it, is still on the node; destroy the "
                "instance first (that removes its VM)")
    return f"instance {mount.instance_id} mounts it; destroy the instance first"


# ------------------------------------------------------------------------------------- API side


def volume_create(*, owner: User, node_id: int, size_gb: int, label: str = "") -> Volume:
    """Create a volume on a node renters can book, at its published price per GB-month, and queue its creation.

    Raises EmailNotVerified (403: the renter's address is not verified), ValidationFailed (no such offer, size out
    of range, a server whose VMs cannot mount volumes: node_mounts_volumes), Conflict (the node takes no new
    rentals, has less free disk, or the renter's caps would be passed) or InsufficientFunds (402, while funds are
    required: the balance does not hold one hour of everything the renter pays for with this volume)."""
    return volume_create_once(owner=owner, node_id=node_id, size_gb=size_gb, label=label)[0]


def volume_for_idempotency_key(*, owner: User, idempotency_key: str, request_fingerprint: str) -> Volume | None:
    """The volume an earlier request with this key created, or None.

    Raises IdempotencyKeyReused when that request had another body."""
    existing = Volume.objects.filter(owner=owner, idempotency_key=idempotency_key).first()
    if existing is not None and existing.request_fingerprint != request_fingerprint:
        raise IdempotencyKeyReused(
            f"This Idempotency-Key was already used for a different request (it created volume {existing.pk}). "
            "Send the same body to get that volume again, or use a new key for a new request.")
    return existing


def volume_create_once(*, owner: User, node_id: int, size_gb: int, label: str = "", idempotency_key: str = "",
                       request_fingerprint: str = "") -> tuple[Volume, bool]:
    """volume_create for a request that may come twice (a retry, a double-clicked form): returns (volume, created);
    with an `idempotency_key` seen before and the same body, the earlier volume and False (nothing is billed
    twice). Raises as volume_create does, and IdempotencyKeyReused (422) for the same key with another body."""
    email_verified_required(user=owner)  # a volume is rented storage: the rule of booking an instance

    def insert() -> Volume:
        with transaction.atomic():
            return _volume_insert(owner=owner, node_id=node_id, size_gb=size_gb, label=label,
                                  idempotency_key=idempotency_key, request_fingerprint=request_fingerprint)

    return create_once(idempotency_key, lambda: volume_for_idempotency_key(
        owner=owner, idempotency_key=idempotency_key, request_fingerprint=request_fingerprint), insert)


def _volume_insert(*, owner: User, node_id: int, size_gb: int, label: str, idempotency_key: str,
                   request_fingerprint: str) -> Volume:
    if not 1 <= size_gb <= MAX_VOLUME_GB:
        raise ValidationFailed(f"A volume is 1 to {MAX_VOLUME_GB} GB.", field="size_gb")
    node = Node.objects.select_for_update(no_key=True).filter(pk=node_id).first()
    if node is None:
        raise ValidationFailed(f"There is no offer {node_id}; pick one from /api/v1/offers/.", field="offer")
    refusal = node_refusal(node, provider_active=_provider_active(node))
    if refusal:  # the booking's rule and words (it named no reason, a deactivated provider's included)
        raise Conflict(f"Offer {node_id} takes no new rentals now: {refusal}. Create the volume on another offer.")
    if not node_mounts_volumes(node):
        raise ValidationFailed(f"Offer {node_id}'s server runs virtual machines from cloud images (libvirt), which "
                               "cannot mount volumes yet: a volume there could never be used. Create it on a docker "
                               "offer.", field="offer")
    _check_free_disk(node, size_gb)
    # One create of this renter at a time (the count, the sum and the funds below): the user's row, as the caps
    # on API keys and webhook endpoints lock it; after the node's lock, before the wallet's (the booking's order).
    # No key update: a booking of theirs holds the wallet and then inserts its instance, whose foreign key to
    # them takes FOR KEY SHARE on this row (FOR UPDATE blocked it: a deadlock).
    User.objects.select_for_update(no_key=True).filter(pk=owner.pk).first()
    _check_caps(owner, size_gb)
    if settings.BILLING_REQUIRE_FUNDS:
        rate = storage_rate_per_hour_micros(size_gb=size_gb,
                                            price_per_gb_month_micros=node.disk_price_per_gb_month_micros)
        funds_refuse_if_short(funds_for(renter_id=owner.pk, price_per_hour_micros=rate, lock=True, thing="volume"),
                              "Creating this volume")
    volume = Volume.objects.create(
        owner=owner, node=node, size_gb=size_gb, label=label, state=VolumeState.CREATING,
        status_message="Waiting for a worker to create it",
        price_per_gb_month_micros=node.disk_price_per_gb_month_micros,
        platform_fee_bps=platform_fee_bps(),
        idempotency_key=idempotency_key, request_fingerprint=request_fingerprint if idempotency_key else "",
    )
    job_create(kind=JobKind.VOLUME_CREATE, node=node, volume=volume)
    return volume


def _provider_active(node: Node) -> bool:
    """Whether the node's provider's account is active, read under a key-share lock on its row, as a booking reads
    it (instances.allocation._lock_node_for_booking): a deactivation under way (account_status.account_deactivate,
    FOR UPDATE) is waited for and what it committed is read. Read unlocked, a create overlapping a deactivation put a
    new billed volume on the deactivated provider's node (found by review)."""
    if connection.vendor != "postgresql":  # SQLite: writes are serialised anyway; Django has no FOR KEY SHARE
        return bool(User.objects.filter(pk=node.provider_id).values_list("is_active", flat=True).first())
    with connection.cursor() as cursor:  # a locked row is read as last committed, after any wait (READ COMMITTED)
        cursor.execute(f"SELECT is_active FROM {User._meta.db_table} WHERE id = %s FOR KEY SHARE",  # noqa: S608
                       [node.provider_id])
        row = cursor.fetchone()
    return bool(row and row[0])


# The volumes that count towards a renter's caps: those that are, or are about to be, on a node for them (the
# funds check's committed volumes: the same states).
_HELD = COMMITTED_VOLUME_STATES


def _check_caps(owner: User, size_gb: int) -> None:
    """Conflict naming the cap when one more volume of `size_gb` passes the renter's count or total size."""
    held = Volume.objects.filter(owner=owner, state__in=_HELD).order_by().aggregate(n=Count("pk"), gb=Sum("size_gb"))
    count, total = held["n"], held["gb"] or 0
    most, most_gb = settings.VOLUMES_PER_USER_MAX, settings.VOLUMES_TOTAL_GB_PER_USER_MAX
    if count + 1 > most:
        raise Conflict(f"You have {count} volumes; at most {most} volumes per account. Delete one you no longer "
                       "need first.")
    if total + size_gb > most_gb:
        raise Conflict(f"Your volumes hold {total} GB; at most {most_gb} GB in all per account, so this one can be "
                       f"{max(most_gb - total, 0)} GB at most. Delete one you no longer need, or make it smaller.")


def _check_free_disk(node: Node, size_gb: int) -> None:
    """Conflict naming the room left when `size_gb` is more than the node's disk has left to promise
    (disk_room: what its server reported free, less the instance disks and volumes promised there since)."""
    room = node_disk_room(node)
    if room is not None and size_gb > room.left_gb:
        raise DiskDoesNotFit(node.pk, room, size_gb, "a volume", "Make it smaller, or create it on another offer.",
                             field="size_gb")


# Said to the renter of a volume deleted while its node is quarantined (worded as an instance's refused restart there).
DELETING_ON_QUARANTINED_NODE = (
    f"Deleting: {NODE_STATE_REASONS[NodeState.QUARANTINED]}: its SSH host key changed, and the platform does not "
    "talk to it until an operator has accepted the new key. It is no longer billed, and is deleted there once the "
    "key is accepted.")

# Said of a volume deleted on a retired node (volume_delete): the platform never talks to that server again.
DELETED_ON_RETIRED_NODE = ("Deleted: its server was retired, and the platform no longer talks to it; nothing of the "
                           "volume is kept for you there.")


@transaction.atomic
def volume_delete(*, volume: Volume, confirm: str) -> Volume:
    """Delete a volume for good: `confirm` must be its name. Billing ends now; a job deletes it on its node (on a
    quarantined node, the node's reconcile once an operator has accepted its new host key; on a retired node, which
    nothing reaches again, it is deleted at once, no job sent).

    Raises ValidationFailed (`confirm` is not its name), Conflict (an instance holds it, volume_holder_ids: one that
    mounts it and is neither destroyed nor failed, one that failed after it ran, its VM kept on the node until it is
    destroyed, or one destroyed or failed whose VM is still to be removed from the node; or it is still being
    created). Asked again while deleting: nothing changes."""
    volume = Volume.objects.select_for_update().get(pk=volume.pk)
    if confirm != volume.name:
        raise ValidationFailed(f"Deleting a volume cannot be undone: send its name, {volume.name}, as `confirm`.",
                               field="confirm")
    if volume.state == VolumeState.DELETING:
        return volume
    if volume.state == VolumeState.DELETED:
        raise Conflict("The volume is already deleted.")
    mount, why = _live_mount(volume)
    if mount is not None:
        raise Conflict(f"The volume cannot be deleted yet: {_held_by(mount, why)}." if why != _LIVE
                       else f"Instance {mount.instance_id} mounts this volume; destroy the instance first.")
    if not volume.allows("delete"):
        raise Conflict(f"The volume is {volume.state}; delete it once it is created.")
    now = timezone.now()
    volume_storage_close(volume=volume, until=storage_billed_until(node_id=volume.node_id, now=now))
    volume.transition_to(VolumeState.DELETING)
    volume.deleted_at = now
    node = Node.objects.get(pk=volume.node_id)
    if node.state == NodeState.RETIRED:
        # Nothing reaches a retired server again (no job, no reconcile): its job stayed queued against it, the volume
        # `deleting` for ever, or the platform reached into a server it had let go (found by review). Only a failed
        # volume is left on one (a retire ends or refuses the others: nodes.node_retire): never billed, ended here.
        volume.transition_to(VolumeState.DELETED)
        volume.status_message = DELETED_ON_RETIRED_NODE
        volume.save(update_fields=["state", "deleted_at", "status_message", "updated_at"])
        return volume
    quarantined = node.state == NodeState.QUARANTINED
    volume.status_message = DELETING_ON_QUARANTINED_NODE if quarantined else "Waiting for a worker to delete it"
    volume.save(update_fields=["state", "deleted_at", "status_message", "updated_at"])
    if not quarantined:
        job_create(kind=JobKind.VOLUME_DELETE, node=node, volume=volume)
    # A quarantined node (its SSH host key changed) is talked to by no job until an operator accepts the new key:
    # its delete job met the changed key at once, failed against the node and quarantined it again. The deletion
    # is taken all the same (as an instance's destroy there: lifecycle._node_reach), left `deleting` with no job
    # open, as a delete job that gave up is (volume_delete_waiting): the node's reconcile deletes it there once
    # the key is accepted and the node verified again (volumes_to_finish_deleting).
    return volume


@dataclass(frozen=True)
class MountRequest:
    volume: Volume
    mount: str


def _system_folder(mount: str) -> str:
    """Why `mount` (an absolute path) is refused as a system folder (_SYSTEM_MOUNT_ROOTS), judged as the folder it
    names once '.', '..', '//' and a trailing '/' are resolved; "" when it is none."""
    path = posixpath.normpath("/" + mount.lstrip("/"))  # normpath keeps a leading "//", which names / on Linux
    said = mount if path == mount else f"{mount} (that is {path})"
    if path == "/":
        return f"{said} cannot be /"
    for root in _SYSTEM_MOUNT_ROOTS:
        if path == root or path.startswith(root + "/"):
            return f"{said} cannot be {root} or under it: a system folder the instance's SSH server needs"
        if root.startswith(path + "/"):
            return f"{said} cannot be {path}: it holds {root}, a system folder the instance's SSH server needs"
    return ""


def _mount_problem(mount: object) -> str:
    if not isinstance(mount, str) or not mount:
        return "is an absolute path, e.g. /data"
    if len(mount) > MAX_MOUNT_CHARS or not _MOUNT_RE.fullmatch(mount):
        return f"is an absolute path of letters, digits and . _ - / (at most {MAX_MOUNT_CHARS} characters)"
    system = _system_folder(mount)
    if system:
        return system
    if ".." in mount.split("/") or "//" in mount or posixpath.normpath(mount) != mount:
        return "must be a normalised path (no '..', '.', '//' or trailing '/')"
    for root in _AGENT_MOUNTS:
        if mount == root or mount.startswith(root + "/"):
            return f"cannot be {root} or under it: the platform mounts its own files there in every instance"
    return ""


def volume_mounts_for_booking(*, renter: User, node_id: int, specs: list[dict[str, Any]]) -> list[MountRequest]:
    """Check the booking's `volumes` and lock their rows (call inside the booking's transaction, after the node's
    lock). Raises ValidationFailed (field `volumes`) for a volume that is not the renter's, on another node, named
    twice, or a bad or repeated mount path; Conflict for a volume not available or mounted by a live instance."""
    if not specs:
        return []
    if len(specs) > MAX_VOLUMES_PER_INSTANCE:
        raise ValidationFailed(f"At most {MAX_VOLUMES_PER_INSTANCE} volumes per instance.", field="volumes")
    ids: list[int] = []
    mounts: list[str] = []
    for n, spec in enumerate(specs):
        volume_id, mount = spec.get("volume"), spec.get("mount")
        if not isinstance(volume_id, int) or isinstance(volume_id, bool):
            raise ValidationFailed(f"volumes[{n}].volume is the id of one of your volumes.", field="volumes")
        problem = _mount_problem(mount)
        if problem:
            raise ValidationFailed(f"volumes[{n}].mount {problem}.", field="volumes")
        if mount in mounts:
            raise ValidationFailed(f"volumes[{n}].mount: {mount} is given twice.", field="volumes")
        if volume_id in ids:
            raise ValidationFailed(f"volumes[{n}]: volume {volume_id} is mounted twice.", field="volumes")
        ids.append(volume_id)
        mounts.append(str(mount))
    locked = {v.pk: v for v in Volume.objects.select_for_update().filter(pk__in=ids, owner=renter).order_by("pk")}
    requests = []
    for n, (volume_id, mount) in enumerate(zip(ids, mounts, strict=True)):
        volume = locked.get(volume_id)
        if volume is None or volume.state == VolumeState.DELETED:
            raise ValidationFailed(f"volumes[{n}]: you have no volume {volume_id}.", field="volumes")
        if volume.node_id != locked[ids[0]].node_id:
            raise ValidationFailed(f"volumes[{n}]: volume {volume_id} is on node {volume.node_id}, the others on "
                                   f"node {locked[ids[0]].node_id}; an instance mounts volumes of one node only.",
                                   field="volumes")
        if volume.node_id != node_id:
            raise ValidationFailed(f"volumes[{n}]: volume {volume_id} is on node {volume.node_id}; book an offer "
                                   "on that node to mount it.", field="volumes")
        if volume.state != VolumeState.AVAILABLE:
            raise Conflict(f"Volume {volume_id} is {volume.state}; it can be mounted once it is available.")
        if volume.missing_since is not None:  # the node's check fails a VM whose volume is not there
            raise Conflict(f"Volume {volume_id} cannot be mounted now: its server did not list it at its latest "
                           "check. Try again after the next check.")
        live, why = _live_mount(volume)
        if live is not None:
            raise Conflict(f"Volume {volume_id} cannot be mounted yet: {_held_by(live, why)}." if why != _LIVE
                           else f"Volume {volume_id} is mounted by instance {live.instance_id}; an instance that is "
                                "not destroyed keeps it.")
        requests.append(MountRequest(volume=volume, mount=mount))
    return requests


def volume_mounts_attach(*, instance: Instance, requests: list[MountRequest]) -> None:
    """Record the mounts of a new instance (inside its booking's transaction)."""
    VolumeMount.objects.bulk_create(VolumeMount(instance=instance, volume=r.volume, mount=r.mount) for r in requests)


def volume_agent_specs(*, instance: Instance) -> list[dict[str, str]]:
    """The `volumes` of the agent's `vm create` request: [{"name": "vol-...", "mount": "/data"}]."""
    return [{"name": m.volume.name, "mount": m.mount}
            for m in VolumeMount.objects.filter(instance=instance).select_related("volume").order_by("mount")]


def volume_for_user(*, user: User, volume_id: int) -> Volume:
    volume = volumes_for_user(user=user, include_deleted=True).filter(pk=volume_id).first()
    if volume is None:
        raise NotFound("No such volume.")
    return volume


# ------------------------------------------------------------------------------------ worker side


def _locked(volume_id: int) -> Volume | None:
    return Volume.objects.select_for_update().filter(pk=volume_id).first()


@transaction.atomic
def volume_mark_available(*, volume_id: int, at: datetime | None = None) -> Volume | None:
    """creating → available: created on its node; billing starts now. None when it is no longer creating."""
    volume = _locked(volume_id)
    if volume is None or volume.state != VolumeState.CREATING:
        return volume
    volume.transition_to(VolumeState.AVAILABLE)
    volume.available_at = at or timezone.now()
    volume.status_message = "Available"
    volume.save(update_fields=["state", "available_at", "status_message", "updated_at"])
    return volume


@transaction.atomic
def volume_mark_failed(*, volume_id: int, message: str) -> Volume | None:
    """creating → failed (nothing was billed)."""
    volume = _locked(volume_id)
    if volume is None or volume.state != VolumeState.CREATING:
        return volume
    volume.transition_to(VolumeState.FAILED)
    volume.status_message = (message or "Failed")[:500]
    volume.save(update_fields=["state", "status_message", "updated_at"])
    return volume


@transaction.atomic
def volume_mark_deleted(*, volume_id: int) -> Volume | None:
    """deleting → deleted: gone from its node (its billing closed when the deletion was asked for)."""
    volume = _locked(volume_id)
    if volume is None or volume.state != VolumeState.DELETING:
        return volume
    volume.transition_to(VolumeState.DELETED)
    volume.status_message = "Deleted"
    volume.save(update_fields=["state", "status_message", "updated_at"])
    return volume


@transaction.atomic
def volume_delete_refused(*, volume_id: int, message: str) -> Volume | None:
    """deleting → available: the node refused to delete it (a VM there still mounts it). It exists, so it is billed
    again, from the refusal on (billed_until moved to now, never back): the platform took the deletion, having found
    no instance that holds it (_live_mount), and told the renter that billing stopped; the time from the request to
    the node's answer is not charged. (It was billed again from where billing stopped, the request, and the renter
    charged for time they had been told was not billed; found by review.) A volume whose creation had failed (never
    available, never billed) goes back to failed instead: the renter was told it could not be created, and it is not
    billed or mountable now; the reconciler deletes its disk if the node has one.

    Only for the node's refusal: a deletion that could not reach the node is not undone (volume_delete_waiting).

    The owner of one billed again is told, once per refused request (a billing event, e-mailed as billing notices
    are): their page said billing stopped, and it starts again. Before, only the status line changed (found by
    review r53); the grace period's deletion, refused, was asked again at every tick
    (billing.services.enforcement._grace now gives it a new warning and grace period)."""
    volume = Volume.objects.select_for_update(of=("self",)).select_related("owner").filter(pk=volume_id).first()
    if volume is None or volume.state != VolumeState.DELETING:
        return volume
    fields = ["state", "deleted_at", "status_message", "updated_at"]
    now = timezone.now()
    if volume.available_at is not None:
        volume.transition_to(VolumeState.AVAILABLE)
        if volume.billed_until is None or volume.billed_until < now:
            volume.billed_until = max(now, volume.available_at)
            fields.append("billed_until")
        billing = f"It exists, so it is billed again from now ({now:%Y-%m-%d %H:%M:%S} UTC)."
    else:
        volume.transition_to(VolumeState.FAILED)
        billing = ""
    volume.deleted_at = None
    volume.status_message = f"Not deleted: {message}"[:500]
    volume.save(update_fields=fields)
    if billing:  # a failed one was never billed and is not now: its billing changed in nothing, its status says why
        event_create(user=volume.owner, kind=EventKind.VOLUME_NOT_DELETED, email=True,
                     message=(f"Volume {volume.name}{f' ({volume.label})' if volume.label else ''} was not deleted: "
                              f"{message[:300]}. {billing} Delete it again once nothing on its server mounts it."),
                     data={"volume": volume.pk, "name": volume.name})
    return volume


@transaction.atomic
def volume_delete_waiting(*, volume_id: int, message: str, answered: bool = False) -> Volume | None:
    """The delete job gave up without the node's answer (unreachable, or the job was lost or reaped): the volume
    stays `deleting`, billed up to the request as it was, and the reconciler deletes it when the node answers.
    Undone, it was billed again from the node's last healthy moment, the outage and every second after the
    renter's request with it, and the grace period's deletion asked again at every tick (found by review).

    `answered`: the node answered, with an error other than its refusal (its engine could not delete it, e.g.
    `docker volume rm` failing): said so, not "could not be reached" (found by review r53); retried the same way."""
    volume = _locked(volume_id)
    if volume is None or volume.state != VolumeState.DELETING:
        return volume
    if answered:
        said = (f"Deleting: its server answered but could not delete it ({message[:300]}). Billing stopped when the "
                "deletion was asked for; the platform tries again at its server's next check, and operators are told.")
    else:
        said = (f"Deleting: its server could not be reached ({message[:300]}). Billing stopped when the deletion "
                "was asked for; it is deleted there when the server answers again.")
    if volume.status_message != said[:500]:
        volume.status_message = said[:500]
        volume.save(update_fields=["status_message", "updated_at"])
    return volume


def volumes_to_finish_deleting(*, node_id: int) -> list[Volume]:
    """The node's volumes still `deleting` with no job of theirs open: their job gave up without the node's answer
    (volume_delete_waiting), for its reconciler to finish now that the node answers."""
    open_jobs = Job.objects.filter(OPEN, kind=JobKind.VOLUME_DELETE, volume_id=OuterRef("pk"))
    return list(Volume.objects.filter(node_id=node_id, state=VolumeState.DELETING)
                .exclude(Exists(open_jobs)).order_by("pk"))


# Said to the renter of a volume its server's list did not have at one look (volume_mark_missing).
MISSING_ONCE = ("Available, but its server did not list it at its latest check: it is not billed and cannot be "
                "mounted while this lasts, and it is ended as lost if the next check does not find it either.")
# Said to the renter of a volume its server no longer has (volume_mark_lost).
LOST_ON_NODE = ("its server no longer has it (two checks in a row found it gone there), so the volume and its data "
                "cannot be recovered")


@transaction.atomic
def volume_mark_missing(*, volume_id: int, at: datetime) -> Volume | None:
    """An available volume that its node's volume list, asked at `at`, does not have: billed up to `at` and no
    further (billing.services.storage stops at `missing_since`), refused to bookings, its renter shown why. Not
    ended yet: one list can be wrong (a volume being moved, the engine's list cut short), as a VM listed missing
    only interrupts its instance at the first look. The next look ends it (volume_mark_lost) or clears this
    (volume_mark_seen). Before, it stayed `available` and billed for ever, with a warning only operators read, who
    had no means to settle it (found by review r53). Nothing happens to a volume marked so already, or not available."""
    volume = _locked(volume_id)
    if volume is None or volume.state != VolumeState.AVAILABLE or volume.missing_since is not None:
        return volume
    volume_storage_close(volume=volume, until=at)
    volume.missing_since = at
    volume.status_message = MISSING_ONCE
    volume.save(update_fields=["missing_since", "status_message", "updated_at"])
    return volume


@transaction.atomic
def volume_mark_seen(*, volume_id: int) -> Volume | None:
    """Its node lists it again after a look that did not (volume_mark_missing): available as before, billed on from
    now. Not for the time it was missing, though its data may have been there all along: its renter was told it was
    not billed and could not mount it meanwhile (the next tick billed the whole gap at once, found by review r53)."""
    volume = _locked(volume_id)
    if volume is None or volume.missing_since is None:
        return volume
    volume.missing_since = None
    fields = ["missing_since", "status_message", "updated_at"]
    if volume.state == VolumeState.AVAILABLE:
        volume.status_message = "Available"
        if volume.billed_until is not None:
            volume.billed_until = max(volume.billed_until, timezone.now())
            fields.append("billed_until")
    volume.save(update_fields=fields)
    return volume


@transaction.atomic
def volume_mark_lost(*, volume_id: int, by: str = "") -> Volume | None:
    """An available volume missing on its node at two looks in a row (the reconciler), or one an operator ends from
    the admin (`by`: their address) once a look found it missing: deleted, billed up to the first look that missed
    it (`missing_since`), its renter told (VOLUME_LOST), as a volume lost with a retired node is (node_volumes_lost).
    Nothing is asked of the node (it has nothing to delete). None, or the volume unchanged, when it is not available
    and marked missing."""
    volume = Volume.objects.select_for_update(of=("self",)).select_related("owner").filter(pk=volume_id).first()
    if volume is None or volume.state != VolumeState.AVAILABLE or volume.missing_since is None:
        return volume
    volume_storage_close(volume=volume, until=volume.missing_since)  # nothing after it (volume_storage_close)
    volume.transition_to(VolumeState.DELETING)
    volume.transition_to(VolumeState.DELETED)
    volume.deleted_at = timezone.now()
    volume.status_message = f"Deleted: {LOST_ON_NODE}."[:500]
    volume.save(update_fields=["state", "deleted_at", "status_message", "updated_at"])
    notify(user=volume.owner, kind=Kind.VOLUME_LOST, dedupe_key=f"volume_lost:{volume.pk}",
           payload={"volume": volume.pk, "name": volume.name, "label": volume.label,
                    "message": f"Volume {volume.name} ({volume.size_gb} GB) is deleted: {LOST_ON_NODE}"
                               f"{' (confirmed by an operator)' if by else ''}. It was billed up to the first check "
                               f"that did not find it ({volume.missing_since:%Y-%m-%d %H:%M:%S} UTC), not after."})
    return volume


# Said to the renter when the server of their volume is retired while unreachable.
LOST_WITH_NODE = ("its server stopped answering and its provider then retired it, so the volume and its data cannot "
                  "be recovered")


def node_volumes_lost(*, node_id: int) -> list[int]:
    """A node retired while unreachable (marketplace.services.nodes.node_retire; nothing can reach it again): its
    volumes end with it. An available one is deleted, billed up to the node's last healthy moment (never for the
    outage), and its renter is told; one being deleted is deleted (billed up to its request already); one being
    created fails (never billed). Returns the ids of the volumes ended. Call inside the retire's transaction."""
    ended = []
    now = timezone.now()
    until = storage_billed_until(node_id=node_id, now=now)  # the node's, the same for each of its volumes
    for volume in (Volume.objects.select_for_update(of=("self",)).select_related("owner").filter(node_id=node_id)
                   .order_by("pk").exclude(state__in=(VolumeState.DELETED, VolumeState.FAILED))):
        ended.append(volume.pk)
        if volume.state == VolumeState.CREATING:
            volume.transition_to(VolumeState.FAILED)
            volume.status_message = f"Failed: {LOST_WITH_NODE}."
            volume.save(update_fields=["state", "status_message", "updated_at"])
            continue
        if volume.state == VolumeState.AVAILABLE:
            volume_storage_close(volume=volume, until=until)
            volume.transition_to(VolumeState.DELETING)
            volume.deleted_at = now
            notify(user=volume.owner, kind=Kind.VOLUME_LOST,
                   dedupe_key=f"volume_lost:{volume.pk}",
                   payload={"volume": volume.pk, "name": volume.name, "label": volume.label,
                            "message": f"Volume {volume.name} ({volume.size_gb} GB) is deleted: {LOST_WITH_NODE}. "
                                       f"It was billed up to its server's last healthy moment "
                                       f"({volume.billed_until or volume.available_at:%Y-%m-%d %H:%M:%S} UTC)."})
        volume.transition_to(VolumeState.DELETED)
        volume.status_message = f"Deleted: {LOST_WITH_NODE}."
        volume.save(update_fields=["state", "deleted_at", "status_message", "updated_at"])
    return ended
