"""Use cases for providers' nodes: register, change, retire."""
import math
import shlex
from collections.abc import Callable
from decimal import Decimal
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Count

from core import addresses as core_addresses
from core.addresses import AddressNotAllowed, LookupTooSlow, node_address_targets
from core.errors import Conflict, ValidationFailed
from core.sql import constraint_violated
from marketplace.encryption import decrypt_secret, encrypt_secret
from marketplace.mig import layout_problems, price_problems
from marketplace.models import (
    Gpu,
    GpuModel,
    Instance,
    InstanceStatus,
    Node,
    NodeState,
    Runtime,
    SliceStatus,
    User,
    Volume,
    VolumeState,
)
from marketplace.models.nodes import LISTABLE_VERDICTS, MIG_RUNTIMES
from marketplace.models.renting import FINAL_STATUSES
from marketplace.money import micros_to_usd, usd_to_micros
from marketplace.selectors import instances_awaiting_cleanup, node_in_use_q
from marketplace.services import instances as instance_svc
from marketplace.services.email_verification import email_verified_required
from marketplace.services.volumes import node_volumes_lost
from notifications.services.notify import Kind, notify
from provisioning.models import OPEN_JOB_STATUSES, JobKind, NodeEvent

# Said to a provider who registers a host key one of their own live nodes has. Another account's nodes are never
# looked at when registering: whether a server is on the platform is told only to whoever proved they control it,
# at its first contact (provisioning.verification.identity.duplicate_host_key).
DUPLICATE_HOST_KEY_MESSAGE = (
    "Another live node of yours already has this SSH host key: a server can be registered only once. Use that "
    "node or retire it first; otherwise check that this is your server's fingerprint."
)


def _generate_keypair(comment: str) -> tuple[bytes, str]:
    """A fresh ed25519 pair: (OpenSSH private key bytes, one-line public key)."""
    private = Ed25519PrivateKey.generate()
    private_bytes = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return private_bytes, f"{public.decode()} {comment}"


def node_private_key(*, node: Node) -> bytes:
    """The node's private key in OpenSSH format, decrypted in memory for the SSH client only."""
    return decrypt_secret(bytes(node.ssh_private_key_encrypted))  # a memoryview from some database drivers


def node_install_command(*, node: Node) -> str:
    """The one line a provider runs on the server, as `ssh_user`, to let the platform in.

    Only platform-made text (the public key line) is spliced in, nothing the provider typed, and shell-quoted: the
    key's comment carries settings.PLATFORM_NAME, an operator's brand name, and an apostrophe in it ("Bob's GPUs")
    ended the single quotes it was put in, so the line every provider copies failed or ran something else (found by
    review, r54).
    """
    return (
        "mkdir -p ~/.ssh && chmod 700 ~/.ssh && "
        f"echo {shlex.quote(node.ssh_public_key)} >> ~/.ssh/authorized_keys && chmod 600 ~/.ssh/authorized_keys"
    )


# Simulated GPUs are checked with CPU-sized work: a GPU-less box with the sim agent would pass (found by review).
SIM_REFUSED = ("This platform takes real GPU servers only: the `sim` runtime (simulated GPUs) is for tests and "
               "demos. Choose docker or libvirt.")


def node_address_check(*, address: str, ssh_port: int) -> None:
    """ValidationFailed on `address` unless the platform may connect to a server there (core.addresses: a public
    address, or one in settings.NODE_ADDRESS_ALLOWED_NETWORKS): a name is resolved, and every address it has must
    be, since a connection may take any of them. The workers check again at every connection (a name's answer may
    change: provisioning.ssh)."""
    try:
        node_address_targets(address, ssh_port)
    except AddressNotAllowed as exc:
        raise ValidationFailed(f"Not a public address: {exc.message} Give the server's public IP address, or a "
                               "name that resolves only to public addresses.", field="address") from None
    except LookupTooSlow:
        within = core_addresses.NODE_LOOKUP_TIMEOUT_S
        raise ValidationFailed(f"The host name did not resolve within {within:g} s: {address}. Check its name "
                               "servers, or give the server's public IP address.", field="address") from None
    except (OSError, UnicodeError):  # socket.gaierror: no such name (now), or no IPv4/IPv6 address for it
        raise ValidationFailed(f"The host name does not resolve: {address}. Check its DNS records, or give the "
                               "server's public IP address.", field="address") from None


# The throttle scope of registering (settings.REST_FRAMEWORK's DEFAULT_THROTTLE_RATES, NODE_REGISTER_THROTTLE_RATE):
# the API's POST /api/v1/nodes/ and the register page count in one budget per user.
REGISTER_SCOPE = "node_register"
REGISTER_THROTTLED = "Too many servers registered for now: nothing was registered. Try again in {wait}."


def register_throttled(wait_s: float) -> str:
    """What a provider past the REGISTER_SCOPE rate is told (with Retry-After)."""
    wait = max(1, math.ceil(wait_s))
    return REGISTER_THROTTLED.format(wait=f"{wait} second{'s' if wait != 1 else ''}")


# The throttle scope of changing a node's address, SSH port or user (NODE_ENDPOINT_THROTTLE_RATE): the API's PATCH
# /api/v1/nodes/{id}/ and the server's settings page count in one budget per user. Each change of a node the
# platform reached is an SSH connection, inside the web request, to any public host and port the provider types,
# whose answer tells whether an SSH server is there and its host key (review r55 MEDIUM-3).
ENDPOINT_SCOPE = "node_endpoint"
ENDPOINT_THROTTLED = ("Too many changes of a server's address, SSH port or user for now: nothing was changed. Try "
                      "again in {wait}.")


def endpoint_throttled(wait_s: float) -> str:
    """What a provider past the ENDPOINT_SCOPE rate is told (with Retry-After)."""
    wait = max(1, math.ceil(wait_s))
    return ENDPOINT_THROTTLED.format(wait=f"{wait} second{'s' if wait != 1 else ''}")


PENDING_CAP_REFUSED = (
    "You have {count} servers that have not passed their first contact yet, the most a provider may have at once "
    "({cap}): the platform keeps trying each of them over SSH. Install the platform's key on them (the install "
    "command on each server's page) and verify them, or retire the ones you will not use, then register this one."
)


def _pending_cap_check(provider: User) -> None:
    """Conflict when the provider has settings.NODE_PENDING_MAX live nodes that never proved they control their
    server: each is retried over SSH on its own (provisioning.services.maintenance.nodes_verify_pending), to
    whatever public address and port was typed. Before, one account could register thousands at blackholed
    addresses, holding the SSH workers renters' instances wait on and making the platform probe strangers'
    servers (found by review, r54)."""
    cap = settings.NODE_PENDING_MAX
    count = (Node.objects.filter(provider=provider, control_proven_at__isnull=True)
             .exclude(state=NodeState.RETIRED).count())
    if count >= cap:
        raise Conflict(PENDING_CAP_REFUSED.format(count=count, cap=cap))


def node_register(
    *,
    provider: User,
    name: str,
    address: str,
    ssh_port: int,
    ssh_user: str,
    country: str,
    gpu_model: GpuModel,
    gpu_count: int,
    price_per_gpu_hour: Decimal,
    runtime: str,
    city: str = "",
    datacenter: str = "",
    host_key_fingerprint: str = "",
    disk_price_per_gb_month: Decimal | None = None,
    nvlink_declared: bool = False,
    mig_layout: list[dict[str, Any]] | None = None,
    mig_prices: dict[str, Decimal] | None = None,
) -> Node:
    """Create a pending node, its declared GPUs, and the platform's key pair for it.

    A host key one of the provider's own live nodes has is refused (ValidationFailed on `host_key_fingerprint`,
    nothing written); so is a second live node of theirs at the same address and port (Conflict); so is a provider
    whose e-mail address is not verified (EmailNotVerified, 403); so is an address the platform does not connect to
    (node_address_check: ValidationFailed on `address`, checked before the transaction: a name is resolved); so is
    a provider with settings.NODE_PENDING_MAX nodes that never passed their first contact (Conflict naming the cap
    and what to do: _pending_cap_check).
    Another account's node at the same address, or with the same host key, is not looked at: a node reserves its
    server only once it proved it controls it (Node.control_proven_at, set at first contact), and a server another
    proven live node holds is refused at this node's first contact (provisioning.services.nodes._pin_host_key).
    Before, any pending node reserved them: anyone could register someone else's server (its address, or the host
    key `ssh-keyscan` reads) first and keep its owner out for good, and the refusal told any account whether a
    server was on the platform (found by review)."""
    email_verified_required(user=provider)
    if runtime == Runtime.SIM and not settings.SIM_NODES_ALLOWED:
        raise ValidationFailed(SIM_REFUSED, field="runtime")
    layout, prices = _check_mig(gpu_model.slug, gpu_count, mig_layout, mig_prices, runtime=runtime)
    _pending_cap_check(provider)  # before the name's lookup too: a provider at the cap costs no DNS query
    node_address_check(address=address, ssh_port=ssh_port)
    with transaction.atomic():
        # One registration of this provider at a time (the count below), as the caps on volumes and API keys lock
        # the user's row. No key update: an insert whose foreign key names them takes FOR KEY SHARE on it.
        User.objects.select_for_update(no_key=True).filter(pk=provider.pk).first()
        _pending_cap_check(provider)
        return _node_create(provider=provider, name=name, address=address, ssh_port=ssh_port, ssh_user=ssh_user,
                            country=country, city=city, datacenter=datacenter, gpu_model=gpu_model,
                            gpu_count=gpu_count, nvlink_declared=nvlink_declared, layout=layout, prices=prices,
                            price_per_gpu_hour=price_per_gpu_hour, runtime=runtime,
                            host_key_fingerprint=host_key_fingerprint,
                            disk_price_per_gb_month=disk_price_per_gb_month)


def _node_create(*, provider: User, name: str, address: str, ssh_port: int, ssh_user: str, country: str, city: str,
                 datacenter: str, gpu_model: GpuModel, gpu_count: int, nvlink_declared: bool,
                 layout: list[dict[str, Any]], prices: dict[str, int], price_per_gpu_hour: Decimal, runtime: str,
                 host_key_fingerprint: str, disk_price_per_gb_month: Decimal | None) -> Node:
    node = Node(
        provider=provider,
        name=name,
        address=address,
        ssh_port=ssh_port,
        ssh_user=ssh_user,
        country=country,
        city=city,
        datacenter=datacenter,
        gpu_model=gpu_model,
        gpu_count=gpu_count,
        nvlink_declared=nvlink_declared,
        mig_layout=layout,
        mig_prices_micros=prices,
        price_per_gpu_hour_micros=usd_to_micros(price_per_gpu_hour),
        runtime=runtime,
        host_key_fingerprint=host_key_fingerprint,
        state=NodeState.PENDING,
    )
    if disk_price_per_gb_month is not None:
        node.disk_price_per_gb_month_micros = usd_to_micros(disk_price_per_gb_month)
    try:
        with transaction.atomic():
            node.save()
    except IntegrityError as exc:
        # The provider's own live nodes only (a new node has proved nothing: the constraints on proven nodes
        # never refuse it). By name, never in the error's text, whose DETAIL quotes the provider's own values.
        violated = constraint_violated(exc)
        if violated == "node_unique_own_live_endpoint":
            raise Conflict(f"A live node of yours is already registered at {address}:{ssh_port}.",
                           field="address") from None  # a page shows it there; the API's 409 names no field
        if violated == "node_unique_own_live_host_key":
            raise ValidationFailed(DUPLICATE_HOST_KEY_MESSAGE, field="host_key_fingerprint") from None
        raise
    private_bytes, public_line = _generate_keypair(f"{settings.PLATFORM_NAME}-node-{node.pk}")
    node.ssh_private_key_encrypted = encrypt_secret(private_bytes)
    node.ssh_public_key = public_line
    node.save(update_fields=["ssh_private_key_encrypted", "ssh_public_key"])
    # Until the inventory reads them, GPUs are what the provider declared.
    Gpu.objects.bulk_create(
        Gpu(node=node, index=i, gpu_model=gpu_model, memory_mib=gpu_model.memory_mib) for i in range(gpu_count)
    )
    return node


@transaction.atomic
def node_update(
    *,
    node: Node,
    name: str | None = None,
    city: str | None = None,
    datacenter: str | None = None,
    price_per_gpu_hour: Decimal | None = None,
    listed: bool | None = None,
    maintenance: bool | None = None,
    disk_price_per_gb_month: Decimal | None = None,
    mig_layout: list[dict[str, Any]] | None = None,
    mig_prices: dict[str, Decimal] | None = None,
    host_key_fingerprint: str | None = None,
) -> Node:
    """Change what a provider may change. Price changes never touch booked instances or created volumes. A new
    MIG layout takes effect at the next check (its slices are proven then; one under way when it is declared applies
    its slices only to the cards whose layout did not change, and queues another: verification.node_verify_conclude);
    prices at once. Putting an unlisted node back on the offers (`listed` True) is listing: EmailNotVerified (403)
    while the provider's address is not verified, as for node_register.
    The host key fingerprint given at registration (`host_key_fingerprint`; empty: the key seen at first contact is
    pinned) may be corrected until the node's first contact (control_proven_at): one the server does not show fails
    that contact as the registration's mistake (provisioning.services.nodes.DeclaredHostKeyWrong), and before, the
    provider could not correct it (found by review). Not while a check runs, nor once the key is pinned (Conflict);
    one of the provider's own live nodes declares or has is refused as at registration (ValidationFailed).
    The address, SSH port and user are not changed here: provisioning.services.endpoint_change.node_endpoint_change
    proves a new one first (node_endpoint_check, then node_endpoint_set), and node_change stores it and these
    together (node_update_check first)."""
    node = Node.objects.select_for_update(no_key=True).select_related("gpu_model").get(pk=node.pk)
    if node.state == NodeState.RETIRED:
        raise Conflict("The node is retired and cannot be changed.")
    if host_key_fingerprint is not None and host_key_fingerprint != node.host_key_fingerprint:
        if node.control_proven_at is not None:
            raise Conflict("The node's SSH host key was pinned at its first contact and cannot be changed here. If "
                           "the server was reinstalled, an operator confirms its new key.")
        if node.state == NodeState.VERIFYING:
            raise Conflict("The host key fingerprint cannot be changed while the node's check runs; try again once "
                           "it has ended.")
        node.host_key_fingerprint = host_key_fingerprint
    if mig_layout is not None or mig_prices is not None:
        layout = node.mig_layout if mig_layout is None else mig_layout
        # Prices not sent are the stored ones, less those of profiles the layout no longer uses: an empty layout
        # (MIG off) or one profile fewer needs no price deleted beside it. A price sent for an unused one is refused.
        prices = ({k: micros_to_usd(v) for k, v in node.mig_prices_micros.items()} if mig_prices is None
                  else mig_prices)
        node.mig_layout, node.mig_prices_micros = _check_mig(node.gpu_model.slug, node.gpu_count, layout, prices,
                                                             runtime=node.runtime, unused_dropped=mig_prices is None)
    if name is not None:
        node.name = name
    if city is not None:
        node.city = city
    if datacenter is not None:
        node.datacenter = datacenter
    before = node.price_per_gpu_hour_micros, node.disk_price_per_gb_month_micros
    if price_per_gpu_hour is not None:
        node.price_per_gpu_hour_micros = usd_to_micros(price_per_gpu_hour)
    if disk_price_per_gb_month is not None:
        node.disk_price_per_gb_month_micros = usd_to_micros(disk_price_per_gb_month)
    if node.price_per_gpu_hour_micros > before[0] or node.disk_price_per_gb_month_micros > before[1]:
        # A raise makes new Vast-compatible ask ids (Node.price_generation): one from an earlier search must not
        # book at the new price. Under this row lock, so a booking checking the id sees the raise or precedes it.
        node.price_generation += 1
        node.price_before_raise_micros, node.disk_price_before_raise_micros = before
    if listed and not node.listed:
        # Back on the offers is listing again: the rule node_register applies.
        email_verified_required(user=User.objects.get(pk=node.provider_id))
    if listed is not None:
        node.listed = listed
    if maintenance is True and node.state != NodeState.MAINTENANCE:
        if not node.can_transition_to(NodeState.MAINTENANCE):
            later = "; try again once its check has ended" if node.state == NodeState.VERIFYING else ""
            raise Conflict(f"A {node.state} node cannot go into maintenance{later}.")
        node.transition_to(NodeState.MAINTENANCE)
    elif maintenance is False and node.state == NodeState.MAINTENANCE:
        # Not straight to active: a node that stopped answering is reconciled by the health check first.
        node.transition_to(node_return_state(node=node))
    try:
        with transaction.atomic():
            node.save()
    except IntegrityError as exc:
        if constraint_violated(exc) == "node_unique_own_live_host_key":  # by name (core.sql)
            raise ValidationFailed(DUPLICATE_HOST_KEY_MESSAGE, field="host_key_fingerprint") from None
        raise
    return node


class _Checked(Exception):
    """node_update_check's way out of its transaction once node_update has taken every field."""


def node_update_check(*, node: Node, **fields: Any) -> None:
    """node_update's refusals of `fields` (EmailNotVerified, Conflict, ValidationFailed, InvalidTransition), with
    nothing stored: the change is made in a transaction that is then rolled back (its on_commit callbacks with it).
    Before an endpoint change is proven (provisioning.services.endpoint_change.node_change): a request refused for
    another field makes no SSH connection and stores nothing (review r55 MEDIUM-1)."""
    if not fields:
        return
    try:
        with transaction.atomic():
            node_update(node=node, **fields)
            raise _Checked
    except _Checked:
        pass


ENDPOINT_FIELDS = ("address", "ssh_port", "ssh_user")
ENDPOINT_CHANGED = "endpoint_changed"  # the node event of a stored change (provisioning/node_event_kinds.py)
_ENDPOINT_STATES_REFUSED: dict[str, str] = {
    NodeState.RETIRED: "The node is retired and cannot be changed.",
    NodeState.VERIFYING: "The address, SSH port and user cannot be changed while the node's check runs; try again "
                         "once it has ended.",
    NodeState.QUARANTINED: "The node is quarantined: its server showed another SSH host key than the pinned one. "
                           "Its address cannot be changed until an operator has confirmed the server's key.",
}


ENDPOINT_CHECK_RUNS = ("The address, SSH port and user cannot be changed while the node's {what} runs: it would "
                       "test the server at the old address, and its result would be taken for the new one. Try "
                       "again once it has ended.")


def _endpoint_refusal(node: Node) -> str:
    """Why `node`'s endpoint cannot change now ('' when it can): its state, or a check job under way. An active
    node stays active while it is re-verified (verification.node_verify_request) and while spot-checked: that job
    talks to the old endpoint, and its failure there would count against the moved node (review r55)."""
    refused = _ENDPOINT_STATES_REFUSED.get(node.state)
    if refused:
        return refused
    open_kind = (node.jobs.filter(kind__in=(JobKind.NODE_VERIFY, JobKind.NODE_SPOT_CHECK),
                                  status__in=OPEN_JOB_STATUSES).values_list("kind", flat=True).first())
    if open_kind is not None:
        return ENDPOINT_CHECK_RUNS.format(what="spot check" if open_kind == JobKind.NODE_SPOT_CHECK
                                          else "verification")
    return ""


def node_endpoint_needs_proof(node: Node) -> bool:
    """Whether a new address, SSH port or user must be proven before it is stored
    (provisioning.services.endpoint_change): every node the platform reached, whose pinned host key says which
    server it is. A pending node never contacted (control_proven_at null) reserves nothing and has no key to
    prove: its endpoint is simply changed, and its first contact checks the new one."""
    return not (node.control_proven_at is None and node.state == NodeState.PENDING)


def node_endpoint_check(*, node: Node, address: str, ssh_port: int, ssh_user: str) -> Node:
    """The checks of a new endpoint before anything connects to it, as at registration (node_register): a node
    that cannot move now (retired, checked, quarantined: Conflict), a node to prove with no pinned key (Conflict:
    nothing could prove the server there is this one), an address the platform does not connect to
    (node_address_check: ValidationFailed on `address`, a name resolved within its bound), another live node of
    the provider's at the same address and port (Conflict, registration's words). Returns the node as it is now."""
    node = Node.objects.get(pk=node.pk)
    refused = _endpoint_refusal(node)
    if refused:
        raise Conflict(refused)
    if node_endpoint_needs_proof(node) and not node.host_key_fingerprint:
        raise Conflict("The node has no SSH host key pinned, so nothing proves that the server at the new address "
                       "is this one. Verify it at its current address first.")
    node_address_check(address=address, ssh_port=ssh_port)
    if (address, ssh_port) != (node.address, node.ssh_port) and (
            Node.objects.filter(provider_id=node.provider_id, address=address, ssh_port=ssh_port)
            .exclude(state=NodeState.RETIRED).exclude(pk=node.pk).exists()):
        raise Conflict(f"A live node of yours is already registered at {address}:{ssh_port}.")
    return node


ENDPOINT_CHANGED_MEANWHILE = ("The node's SSH endpoint was changed to {now} by another request while this one was "
                              "checked; nothing was changed. Check the node's address, then try again.")


@transaction.atomic
def node_endpoint_set(*, node: Node, address: str, ssh_port: int, ssh_user: str, proven_with: str | None,
                      was: tuple[str, int, str] | None = None) -> Node:
    """Store a node's new address, SSH port and user: `proven_with` is the pinned host key the server there
    presented, having accepted the node's own key (provisioning.services.endpoint_change), None for a node that
    needs no proof (node_endpoint_needs_proof). `was`: the (address, SSH port, user) the check and proof started
    from; compared under the node's lock (compare-and-set): when another change was stored meanwhile, Conflict
    (ENDPOINT_CHANGED_MEANWHILE) instead of overwriting it (before, two changes at once both proved, and the last
    one stored won, unseen by the first: review r55). Conflict, nothing stored, when the node changed meanwhile (its
    state, or its pinned key) or when another live node holds the address and port (the constraints). A node that
    needs no proof (never contacted) loses its `last_error`: it describes the old endpoint, and the first contact at
    the new one (endpoint_change.node_change queues it) writes its own. Instances
    whose SSH host or mapped ports were the node's old address (the agent's null: the node's own address) get the
    new one, and their renters a notice; an `endpoint_changed` node event says what changed. Pooled connections
    are not reused (provisioning.services.nodes.connection_identity holds the endpoint); an offline node comes back
    through its next health check."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    refused = _endpoint_refusal(node)  # under the node's lock, as a check job is queued (node_verify_request)
    if refused:
        raise Conflict(refused)
    if (proven_with is None) == node_endpoint_needs_proof(node) or (
            proven_with is not None and proven_with != node.host_key_fingerprint):
        raise Conflict("The node changed while its new address was checked; nothing was changed. Try again.")
    old_address, old_port, old_user = node.address, node.ssh_port, node.ssh_user
    if (old_address, old_port, old_user) == (address, ssh_port, ssh_user):
        return node  # already there (the same change twice): nothing to overwrite
    if was is not None and (old_address, old_port, old_user) != was:
        raise Conflict(ENDPOINT_CHANGED_MEANWHILE.format(now=f"{old_user}@{old_address}:{old_port}"))
    node.address, node.ssh_port, node.ssh_user = address, ssh_port, ssh_user
    fields = ["address", "ssh_port", "ssh_user", "updated_at"]
    if proven_with is None:
        node.last_error = ""  # the old endpoint's first contact: its new one is about to be tried
        fields.append("last_error")
    try:
        with transaction.atomic():
            node.save(update_fields=fields)
    except IntegrityError as exc:
        violated = constraint_violated(exc)  # by name (core.sql)
        if violated == "node_unique_own_live_endpoint":
            raise Conflict(f"A live node of yours is already registered at {address}:{ssh_port}.") from None
        if violated == "node_unique_live_endpoint":
            raise Conflict(f"Another live node is registered at {address}:{ssh_port}: the same server cannot be "
                           "listed twice.") from None
        raise
    moved = _instances_moved(node, old_address, address) if old_address != address else []
    how = (f"with its pinned host key {proven_with} and this node's key accepted there" if proven_with
           else "no proof: the node was never contacted; its first contact checks it")
    event = NodeEvent.objects.create(
        node=node, kind=ENDPOINT_CHANGED, level=NodeEvent.Level.INFO,
        message=(f"SSH endpoint changed by the provider from {old_user}@{old_address}:{old_port} to "
                 f"{ssh_user}@{address}:{ssh_port} ({how})."
                 + (f" SSH host of instances {', '.join(str(i.pk) for i in moved)} changed to {address}."
                    if moved else "")))
    for instance in moved:
        transaction.on_commit(_renter_told_moved(instance, event.pk, address), robust=True)
    return node


def _instances_moved(node: Node, old: str, new: str) -> list[Instance]:
    """The node's instances not over whose SSH host or mapped ports named its old address, changed to the new."""
    moved = []
    for instance in (Instance.objects.select_for_update(no_key=True).filter(node=node)
                     .exclude(status__in=FINAL_STATUSES).order_by("pk")):
        fields = []
        if instance.ssh_host == old:
            instance.ssh_host = new
            fields.append("ssh_host")
        ports = instance.ports if isinstance(instance.ports, dict) else {}
        if any(isinstance(target, dict) and target.get("host") == old for target in ports.values()):
            instance.ports = {name: ({**target, "host": new} if isinstance(target, dict) and target.get("host") == old
                                     else target) for name, target in ports.items()}
            fields.append("ports")
        if fields:
            instance.save(update_fields=[*fields, "updated_at"])
            moved.append(instance)
    return moved


def _renter_told_moved(instance: Instance, event_id: int, address: str) -> Callable[[], None]:
    """The notice to the renter of `instance` (after the commit): its SSH host is now `address`."""
    user_id, instance_id = instance.renter_id, instance.pk

    def tell() -> None:
        notify(user=User.objects.get(pk=user_id), kind=Kind.INSTANCE_RUNNING, title="Instance's SSH address changed",
               dedupe_key=f"instance-{instance_id}-endpoint-{event_id}",
               payload={"instance_id": instance_id, "ssh_host": address,
                        "message": f"The server of instance {instance_id} moved to a new address: connect to "
                                   f"{address} from now on (the port and user are unchanged). The instance and its "
                                   "data are as they were."})
    return tell


MIG_RUNTIME_REFUSED = ("The {runtime} runtime cannot rent MIG slices: a KVM virtual machine gets a MIG slice only "
                       "through NVIDIA vGPU, which it does not use. Declare no layout (an empty list), or run the "
                       "server with the docker runtime.")


def _check_mig(slug: str, gpu_count: int, layout: Any, prices: dict[str, Decimal] | None, *, runtime: str,
               unused_dropped: bool = False) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The declared MIG layout and its prices per slice-hour (micro-dollars), or ValidationFailed naming the field.
    A layout on a node whose runtime rents no slices (models.nodes.MIG_RUNTIMES: libvirt) is refused: its agent
    refuses them, and its slices were offered and booked, then failed on the node. `unused_dropped`: the prices of
    profiles the layout does not use are left out, not refused (the stored prices, when none were sent)."""
    problem = layout_problems(slug, gpu_count, layout)
    if problem:
        raise ValidationFailed(problem, field="mig_layout")
    if layout and runtime not in MIG_RUNTIMES:
        raise ValidationFailed(MIG_RUNTIME_REFUSED.format(runtime=runtime), field="mig_layout")
    layout = sorted(layout or [], key=lambda entry: entry["gpu"])
    micros = {name: usd_to_micros(price) for name, price in (prices or {}).items()}
    if unused_dropped:
        used = {profile for entry in layout for profile in entry["profiles"]}
        micros = {name: price for name, price in micros.items() if name in used}
    problem = price_problems(layout, micros)
    if problem:
        raise ValidationFailed(problem, field="mig_prices")
    return layout, micros


def node_in_use(*, node_id: int) -> bool:
    """Whether renters are on the node (marketplace.selectors.node_in_use_q says what counts)."""
    return Node.objects.filter(node_in_use_q(), pk=node_id).exists()


def node_return_state(*, node: Node) -> str:
    """The state a node goes back to from maintenance (node_update) or from offline once it answered and was
    reconciled (provisioning.services.fleet_record.nodes_record_health): offline while its last health check
    failed (the health check reconciles it before it takes rentals again); active if its verdict lists it or
    renters are on it (node_in_use); pending otherwise (it waits for a verification)."""
    if node.health_failures > 0:
        return NodeState.OFFLINE
    if node.verdict in LISTABLE_VERDICTS or node_in_use(node_id=node.pk):
        return NodeState.ACTIVE
    return NodeState.PENDING


def node_unreachable(node: Node) -> bool:
    """Whether the health checks say the node cannot be reached: enough failures in a row that its running
    instances are interrupted, or offline with its last check failed. Offline alone is not enough: a check that
    failed on the platform's side (a lost worker, a busy node) sends a node offline that still answers, and
    retiring it as unreachable would fail instances its reconciler could still resume."""
    failures = node.health_failures
    return failures >= settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS or (node.state == NodeState.OFFLINE and failures > 0)


# Said when a retired node's interrupted instances are ended (the renter reads it, with the credit).
RETIRED_WHILE_INTERRUPTED = ("its server stopped answering and its provider then retired it, so the VM and its "
                             "disk cannot be recovered")
RETIRED_WHILE_STOPPED = ("its server stopped answering and its provider then retired it, so its disk cannot be "
                         "recovered; the disk is billed up to the server's last healthy moment")


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _retire_refusal(node: Node, unreachable: bool, ending: list[int]) -> str:
    """Why the node cannot be retired now, in words its provider can act on; '' when it can. `ending`: the
    interrupted and stopped instances the retire ends (an unreachable node's)."""
    instances = Instance.objects.filter(node=node).exclude(status__in=FINAL_STATUSES).exclude(pk__in=ending)
    by_status: dict[str, int] = dict(instances.values("status").annotate(n=Count("pk")).values_list("status", "n"))
    stopped = by_status.pop(InstanceStatus.STOPPED, 0)
    # An unreachable node's volumes end with the retire (node_volumes_lost); a reachable one's are renters' data,
    # and those being deleted are the platform's to finish (their job, or the reconciler, in minutes).
    volumes = deleting = 0
    if not unreachable:
        live = Volume.objects.filter(node=node).exclude(state__in=(VolumeState.DELETED, VolumeState.FAILED))
        deleting = live.filter(state=VolumeState.DELETING).count()
        volumes = live.count() - deleting
    reasons = []
    if by_status:
        states = ", ".join(f"{n} {status}" for status, n in sorted(by_status.items()))
        reasons.append(f"renters' instances are live on it ({states}); it can be retired once they have ended")
    if stopped or volumes:
        held = " and ".join(text for n, text in (
            (stopped, _count(stopped, "stopped instance", "stopped instances")),
            (volumes, _count(volumes, "volume", "volumes"))) if n)
        done = "destroyed or deleted" if stopped and volumes else "destroyed" if stopped else "deleted"
        # The verb agrees with what is held ("1 volume keeps", "1 stopped instance and 1 volume keep").
        if stopped + volumes == 1:
            reasons.append(f"{held} keeps a renter's data on it, and a retired server never comes back: it can be "
                           f"retired once its renter has {done} it")
        else:
            reasons.append(f"{held} keep renters' data on it, and a retired server never comes back: it can be "
                           f"retired once their renters have {done} them")
    # The platform finishes a deletion or a VM's removal at the node's next reconcile (minutes), except on a
    # quarantined node: no job talks to it until an operator has accepted its new host key (volumes.volume_delete).
    later = ("it can be retired once an operator has accepted its new host key, so that the platform can reach it "
             "again" if node.state == NodeState.QUARANTINED else "try again in a few minutes")
    if deleting:
        reasons.append(f"the platform is still deleting {_count(deleting, 'volume', 'volumes')} on it; {later}")
    if not reasons and not unreachable:
        # Destroyed while the node was away: the reconciler removes their VMs at its next pass (minutes).
        cleanup = len(instances_awaiting_cleanup(node_id=node.pk))
        if cleanup:
            vms = _count(cleanup, "destroyed instance", "destroyed instances")
            reasons.append(f"the platform is still removing the VM of {vms} from it; {later}")
    if not reasons:
        return ""
    return ("This node cannot be retired yet: " + "; ".join(reasons)
            + ". Unlist it meanwhile so that it takes no new rentals.")


def _retire_ends(node: Node, unreachable: bool, *, lock: bool) -> tuple[list[int], list[int]]:
    """The interrupted and the stopped instances a retire of `node` ends (an unreachable node's; none otherwise),
    locked when `lock` (the retire itself: no reconcile resumes one between the count and its end)."""
    if not unreachable:
        return [], []
    instances = Instance.objects.select_for_update() if lock else Instance.objects.all()

    def ids(status: str) -> list[int]:
        return list(instances.filter(node=node, status=status).order_by("pk").values_list("pk", flat=True))
    return ids(InstanceStatus.INTERRUPTED), ids(InstanceStatus.STOPPED)


def node_retire_refusal(*, node: Node) -> str:
    """Why node_retire would refuse `node` now, in the refusal's own words ('' when it would retire it, or when it
    is retired already). Read-only, no locks: for pages, so that they offer the retire only where the service
    takes it (found by review: the node page offered it on a node with a renter's volume; the click was refused)."""
    if node.state == NodeState.RETIRED:
        return ""
    unreachable = node_unreachable(node)
    ending, stopped = _retire_ends(node, unreachable, lock=False)
    return _retire_refusal(node, unreachable, ending + stopped)


def _release_unreachable(node: Node, interrupted: list[int], stopped: list[int]) -> list[str]:
    """Retiring an unreachable node: end what its renters can no longer get back (the VMs cannot be reached, and
    a retired server is never reconciled). Its `interrupted` instances fail, credited and told as the
    interruption path does (interruption_close); its `stopped` ones fail too, their disks billed up to its last
    healthy moment (the storage rule), their renters told; destroyed ones whose VM was still to be removed let go
    of their GPUs; its volumes are deleted, billed up to its last healthy moment, their renters told
    (node_volumes_lost). Returns what was done, for the node's event."""
    done = []
    # A retired server is never reached again: nothing of theirs is left there to keep room or volumes for.
    for instance_id in interrupted:
        instance_svc.instance_mark_failed(instance_id=instance_id, message=f"Failed: {RETIRED_WHILE_INTERRUPTED}.",
                                          vm_gone=True)
    if interrupted:
        done.append(f"interrupted instance(s) {', '.join(map(str, interrupted))} ended as failed (credited)")
    for instance_id in stopped:
        instance_svc.instance_mark_failed(instance_id=instance_id, message=f"Failed: {RETIRED_WHILE_STOPPED}.",
                                          only_in=(InstanceStatus.STOPPED,), vm_gone=True)
    if stopped:
        done.append(f"stopped instance(s) {', '.join(map(str, stopped))} ended as failed (their disks billed up to "
                    "its last healthy moment)")
    held = instances_awaiting_cleanup(node_id=node.pk)
    for instance_id in held:
        if not instance_svc.instance_cleanup_done(instance_id=instance_id):  # destroyed: its GPUs; failed: here
            instance_svc.instance_mark_failed(instance_id=instance_id, message="", vm_gone=True)
    if held:
        done.append(f"the GPUs of destroyed instance(s) {', '.join(map(str, held))} released without removing "
                    "their VMs, which could not be reached")
    lost = node_volumes_lost(node_id=node.pk)
    if lost:
        done.append(f"volume(s) {', '.join(map(str, lost))} ended with it (billed up to its last healthy moment)")
    return done


@transaction.atomic
def node_retire(*, node: Node) -> None:
    """Take a node off the market for good (never checked, reconciled or booked again; its address, host key and
    GPUs may be registered again).

    Refused (Conflict naming what stands in the way, nothing changed) while renters' instances are on it that
    are not over, while stopped instances or volumes keep renters' data on it (a retired server never comes
    back: re-registered, its reconciler would delete them as unknown), or while the reconciler still has to
    remove a destroyed instance's VM or a volume being deleted. An unreachable node (node_unreachable) can be
    retired all the same: its interrupted instances fail with the interruption's credit, its stopped ones fail
    (their disks billed up to its last healthy moment), the GPUs of destroyed ones are released, and its volumes
    are deleted (billed up to its last healthy moment, their renters told), said in an event for the provider."""
    node = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if node.state == NodeState.RETIRED:
        return
    unreachable = node_unreachable(node)
    # Locked before they are counted: no reconcile resumes one between the count and its end here. Stopped ones
    # too: their disks are on a server that no longer answers (before, they held the retire back for good, their
    # renters billed for disks nobody could reach until they destroyed them).
    ending, stopped = _retire_ends(node, unreachable, lock=True)
    refusal = _retire_refusal(node, unreachable, ending + stopped)
    if refusal:
        raise Conflict(refusal)
    done = _release_unreachable(node, ending, stopped) if unreachable else []
    # Its failed instances' VMs are never reached again (nor reconciled): they hold no room or volume there any more
    # (their renters may still destroy them; nothing is left to remove).
    for instance_id in Instance.objects.filter(node=node, status=InstanceStatus.FAILED, vm_gone=False) \
            .order_by("pk").values_list("pk", flat=True):
        instance_svc.instance_vm_gone(instance_id=instance_id)
    node.transition_to(NodeState.RETIRED)
    node.listed = False
    node.save(update_fields=["state", "state_changed_at", "listed", "updated_at"])
    if done:
        NodeEvent.objects.create(node=node, kind="retired_unreachable", level=NodeEvent.Level.WARNING,
                                 message="Retired while unreachable: " + "; ".join(done) + ".")
    # Its GPUs and MIG slices are free to be registered again, on another node (constraints gpu_unique_uuid and
    # mig_slice_unique_uuid); a slice of a retired server is never rented again.
    node.gpus.exclude(uuid="").update(uuid="")
    node.mig_slices.exclude(uuid="", status=SliceStatus.UNAVAILABLE).update(uuid="", status=SliceStatus.UNAVAILABLE)


# An operator's retire, unlist or maintenance from the admin (marketplace/admin/nodes.py): the event's kind, the
# words for what was done, and what it means for the provider (review r53: the only record was the admin's log,
# which providers never see, and retiring is for good).
OPERATOR_NODE_ACTIONS = {
    "retire": ("retired_by_operator", "retired", "It is retired for good: never checked or booked again."),
    "unlist": ("unlisted_by_operator", "unlisted", "It is off the offers and takes no new rentals; instances on it "
               "keep running."),
    "maintenance": ("maintenance_by_operator", "put into maintenance", "It takes no new rentals while it is in "
                    "maintenance; instances on it keep running."),
}


@transaction.atomic
def node_change_by_operator(*, node: Node, action: str, by: User, reason: str = "") -> bool:
    """An operator retires, unlists or puts into maintenance a provider's node (`action`, a key of
    OPERATOR_NODE_ACTIONS) through the provider's own services (node_retire, node_update: their rules, their
    Conflicts), records it as a node event with the operator and the reason, and tells the provider why
    (node_changed_by_operator, on the channels they chose). False when the node was so already: nothing done,
    recorded or told. `reason` is the operator's, cleaned by the caller."""
    event_kind, done, meaning = OPERATOR_NODE_ACTIONS[action]
    current = Node.objects.select_for_update(no_key=True).get(pk=node.pk)
    if action == "retire":
        if current.state == NodeState.RETIRED:
            return False
        node_retire(node=current)
    elif action == "unlist":
        if not current.listed:
            return False
        node_update(node=current, listed=False)
    else:
        if current.state == NodeState.MAINTENANCE:
            return False
        node_update(node=current, maintenance=True)
    why = f" Reason: {reason}" if reason else ""
    event = NodeEvent.objects.create(node=current, kind=event_kind, level=NodeEvent.Level.WARNING,
                                     message=f"{done.capitalize()} by an operator ({by.email}).{why}")
    message = (f"An operator of {settings.PLATFORM_NAME} {done} your node {current.name}. {meaning}{why}"
               + ("" if reason else " Contact support if you do not know why."))
    notify(user=User.objects.get(pk=current.provider_id), kind=Kind.NODE_CHANGED_BY_OPERATOR,
           dedupe_key=f"node_changed_by_operator:{current.pk}:{event.pk}",
           payload={"node": current.pk, "name": current.name, "action": action, "done": done, "reason": reason,
                    "message": message})
    return True
