"""Use cases for providers' nodes: register, change, retire."""
from decimal import Decimal
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from django.conf import settings
from django.db import IntegrityError, transaction

from core.errors import Conflict, ValidationFailed
from marketplace.encryption import decrypt_secret, encrypt_secret
from marketplace.mig import layout_problems, price_problems
from marketplace.models import Gpu, GpuModel, GpuStatus, MigSliceAllocation, Node, NodeState, User
from marketplace.models.nodes import LISTABLE_VERDICTS
from marketplace.money import micros_to_usd, usd_to_micros
from marketplace.services.email_verification import email_verified_required

# Said to whoever brings a server that a live node already has; it never names that node or its provider.
DUPLICATE_HOST_KEY_MESSAGE = (
    "Another live node already has this SSH host key: a server can be registered only once. If you registered "
    "this server before, use that node or retire it first; otherwise check that this is your server's fingerprint."
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

    Only platform-made text (the public key) is spliced in; nothing the provider typed.
    """
    return (
        "mkdir -p ~/.ssh && chmod 700 ~/.ssh && "
        f"echo '{node.ssh_public_key}' >> ~/.ssh/authorized_keys && chmod 600 ~/.ssh/authorized_keys"
    )


@transaction.atomic
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

    A host key another live node has is refused (ValidationFailed on `host_key_fingerprint`, nothing written);
    so is a second live node at the same address and port (Conflict); so is a provider whose e-mail address is
    not verified (EmailNotVerified, 403)."""
    email_verified_required(user=provider)
    layout, prices = _check_mig(gpu_model.slug, gpu_count, mig_layout, mig_prices)
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
        if "node_unique_live_endpoint" in str(exc):
            raise Conflict(f"A live node is already registered at {address}:{ssh_port}.") from None
        if "node_unique_live_host_key" in str(exc):
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
) -> Node:
    """Change what a provider may change. Price changes never touch booked instances or created volumes. A new
    MIG layout takes effect at the next check (its slices are proven then); prices at once."""
    node = Node.objects.select_for_update().select_related("gpu_model").get(pk=node.pk)
    if node.state == NodeState.RETIRED:
        raise Conflict("The node is retired and cannot be changed.")
    if mig_layout is not None or mig_prices is not None:
        layout = node.mig_layout if mig_layout is None else mig_layout
        prices = ({k: micros_to_usd(v) for k, v in node.mig_prices_micros.items()} if mig_prices is None
                  else mig_prices)
        node.mig_layout, node.mig_prices_micros = _check_mig(node.gpu_model.slug, node.gpu_count, layout, prices)
    if name is not None:
        node.name = name
    if city is not None:
        node.city = city
    if datacenter is not None:
        node.datacenter = datacenter
    if price_per_gpu_hour is not None:
        node.price_per_gpu_hour_micros = usd_to_micros(price_per_gpu_hour)
    if disk_price_per_gb_month is not None:
        node.disk_price_per_gb_month_micros = usd_to_micros(disk_price_per_gb_month)
    if listed is not None:
        node.listed = listed
    if maintenance is True and node.state != NodeState.MAINTENANCE:
        if not node.can_transition_to(NodeState.MAINTENANCE):
            raise Conflict(f"A {node.state} node cannot go into maintenance; try again later.")
        node.transition_to(NodeState.MAINTENANCE)
    elif maintenance is False and node.state == NodeState.MAINTENANCE:
        node.transition_to(NodeState.ACTIVE if node.verdict in LISTABLE_VERDICTS else NodeState.PENDING)
    node.save()
    return node


def _check_mig(slug: str, gpu_count: int, layout: Any, prices: dict[str, Decimal] | None,
               ) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """The declared MIG layout and its prices per slice-hour (micro-dollars), or ValidationFailed naming the field."""
    problem = layout_problems(slug, gpu_count, layout)
    if problem:
        raise ValidationFailed(problem, field="mig_layout")
    layout = sorted(layout or [], key=lambda entry: entry["gpu"])
    micros = {name: usd_to_micros(price) for name, price in (prices or {}).items()}
    problem = price_problems(layout, micros)
    if problem:
        raise ValidationFailed(problem, field="mig_prices")
    return layout, micros


@transaction.atomic
def node_retire(*, node: Node) -> None:
    """Take a node off the market for good; refused while any of its GPUs is rented."""
    node = Node.objects.select_for_update().get(pk=node.pk)
    if node.state == NodeState.RETIRED:
        return
    rented = node.gpus.filter(status=GpuStatus.RENTED).count()
    if rented:
        raise Conflict(f"{rented} GPU(s) of this node are rented; wait until those instances end.")
    sliced = MigSliceAllocation.objects.filter(mig_slice__node=node, released_at__isnull=True).count()
    if sliced:
        raise Conflict(f"{sliced} MIG slice(s) of this node are rented; wait until those instances end.")
    node.transition_to(NodeState.RETIRED)
    node.listed = False
    node.save(update_fields=["state", "state_changed_at", "listed", "updated_at"])
    # Its GPUs are free to be registered again, on another node (constraint gpu_unique_uuid).
    node.gpus.exclude(uuid="").update(uuid="")
