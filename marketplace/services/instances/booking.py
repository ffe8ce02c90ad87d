"""Booking: an instance is created with its GPUs allocated atomically (API side)."""
import json
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from billing.services.metering import platform_fee_bps
from core import metrics
from core.errors import Conflict, ValidationFailed
from core.idempotency import create_once
from core.money import micros_to_usd, usd_rate_text
from marketplace.encryption import encrypt_secret
from marketplace.models import (
    Image,
    Instance,
    User,
)
from marketplace.models.nodes import MIG_RUNTIMES, Node, Runtime
from marketplace.services.disk_room import DiskDoesNotFit
from marketplace.services.email_verification import email_verified_required
from marketplace.services.funds import _check_funds, funds_of, funds_refuse_if_short
from marketplace.services.offer_rules import node_refusal
from marketplace.services.volumes import volume_mounts_attach, volume_mounts_for_booking
from marketplace.validators import MAX_INSTANCE_KEYS
from provisioning.models import JobKind

from .allocation import (
    _allocate_free_gpus,
    _allocate_free_slices,
    _lock_node_for_booking,
    gpus_held_and_free,
    node_nvlink_islands,
)
from .common import (
    MAX_DISK_GB,
    WAITING,
    S,
    _gpus_text,
    instance_for_idempotency_key,
)
from .mig import free_slice_count
from .options import InstanceOptions, cuda_tuple
from .secrets import env_encrypt

# ------------------------------------------------------------------------------ booking (API side)


@metrics.BOOKING_SECONDS.time()  # booking latency for Prometheus (core/metrics.py)
def instance_create(
    *,
    renter: User,
    node_id: int,
    num_gpus: int,
    image: Image | str,
    ssh_public_keys: list[str],
    disk_gb: int | None = None,
    label: str = "",
    options: InstanceOptions | None = None,
    idempotency_key: str = "",
    request_fingerprint: str = "",
    volumes: list[dict[str, Any]] | None = None,
    mig_profile: str = "",
    require_nvlink: bool = False,
    max_price_micros: int | None = None,
    max_disk_price_micros: int | None = None,
) -> tuple[Instance, bool]:
    """Book `num_gpus` GPUs of a node as a new instance and queue its provisioning.

    `image` is a catalogue Image or the renter's own OCI reference (a str, already checked by
    options.clean_image_reference); `options` (env, onstart, ports, registry login, minimum CUDA version) are
    already validated (options.instance_options). `ssh_public_keys` are already validated and normalised.
    `require_nvlink`: the GPUs all on one NVLink island of the node, or a 409 (never booked across islands).
    `max_price_micros`: the most the renter agreed to pay per unit-hour (a GPU-hour, or with `mig_profile` a
    slice-hour: the price the booking snapshots), or None for whatever the node asks when the booking runs; a
    higher price now is PriceChanged (409), checked on the price read under the node's lock.
    `max_disk_price_micros`: the same for the disk's price per GB-month (what the disk costs while stopped, snapshot
    on the instance too), or None for whatever the node asks.
    Returns (instance, created): with an Idempotency-Key seen before (same body), the earlier instance and False.
    Raises EmailNotVerified (403), ValidationFailed (400), Conflict (409), InsufficientFunds (402) or
    IdempotencyKeyReused (422); on any of them nothing was written.
    """
    email_verified_required(user=renter)
    if require_nvlink and (mig_profile or num_gpus < 2):
        raise ValidationFailed("NVLink joins two or more whole GPUs: ask for num_gpus of 2 or more without "
                               "mig_profile, or leave out require_nvlink.", field="require_nvlink")

    def book_it() -> Instance:
        keys = list(dict.fromkeys(ssh_public_keys))
        if not keys:
            raise ValidationFailed("Give at least one SSH key: `ssh_keys` (ids of your keys) and/or "
                                   "`ssh_public_key`.", field="ssh_keys")
        # Here and not in each caller: every path (API, compat, web) joins saved and pasted keys its own way, and
        # the agent refuses more than MAX_INSTANCE_KEYS, so a longer list would be booked and then fail on the node.
        if len(keys) > MAX_INSTANCE_KEYS:
            raise ValidationFailed(f"At most {MAX_INSTANCE_KEYS} SSH keys go on one instance; this request names "
                                   f"{len(keys)} (saved and pasted together).", field="ssh_keys")
        with transaction.atomic():
            return _book(renter=renter, node_id=node_id, num_gpus=num_gpus, image=image, keys=keys,
                         disk_gb=disk_gb, label=label, options=options or InstanceOptions(),
                         idempotency_key=idempotency_key, request_fingerprint=request_fingerprint,
                         volumes=volumes or [], mig_profile=mig_profile, require_nvlink=require_nvlink,
                         max_price_micros=max_price_micros, max_disk_price_micros=max_disk_price_micros)

    # A retry racing its original gets the original, also where the original's GPUs or disk would refuse it.
    return create_once(idempotency_key, lambda: instance_for_idempotency_key(
        renter=renter, idempotency_key=idempotency_key, request_fingerprint=request_fingerprint), book_it)


# The disk an image of the renter's own gets when they name none (the catalogue's smallest minimum).
OWN_IMAGE_DEFAULT_DISK_GB = 20


def _check_image(image: Image | str, node: Node) -> int:
    """Whether the image can run on the node; returns its minimum disk."""
    if isinstance(image, str):  # the renter's own OCI image: a container engine runs it, a KVM node cannot
        if node.runtime == "libvirt":
            raise ValidationFailed("This node runs virtual machines from cloud images (libvirt): it cannot run a "
                                   "container image of your own. Pick a catalogue image or a docker node.",
                                   field="image")
        return OWN_IMAGE_DEFAULT_DISK_GB
    if not image.active:
        raise ValidationFailed(f"The image {image.slug} is no longer offered.", field="image")
    if not image.supports(node.runtime):
        raise ValidationFailed(
            f"The image {image.slug} cannot run on this node: its runtime is {node.runtime}, and the image "
            f"has a build only for {', '.join(r for r in image.runtimes if r != 'sim')}.",
            field="image",
        )
    return image.min_disk_gb


# What a node's agent refuses in a `vm create`, by the node's runtime (the booking's fields; the agent's own check is
# provisioning/agent/gpumarket_agent/runtimes/libvirt.py LibvirtRuntime.check_spec, whose `mig_uuids` is the booking's
# `mig_profile`, refused by _slice_price). Booked, such an instance failed on the node minutes after the 201, its GPUs
# held meanwhile, and a volume there was billed with nothing able to mount it (found by review).
# tests/marketplace/test_round44_libvirt_options.py holds this equal to what check_spec refuses.
RUNTIME_REFUSED_OPTIONS: dict[str, tuple[str, ...]] = {Runtime.LIBVIRT: ("env", "onstart", "ports", "volumes")}
_OPTION_WORDS = {"env": "environment variables", "onstart": "an on-start script", "ports": "exposed ports",
                 "volumes": "volumes"}


def runtime_refused_options(runtime: str) -> tuple[str, ...]:
    """The booking fields (env, onstart, ports, volumes) a node of this runtime cannot honour."""
    return RUNTIME_REFUSED_OPTIONS.get(runtime, ())


def runtime_option_refusal(runtime: str, field: str) -> str:
    """Why a node of this runtime takes no `field` (a sentence), or "" when it does."""
    if field not in runtime_refused_options(runtime):
        return ""
    if field == "volumes":
        return ("This offer's server runs virtual machines from cloud images (libvirt), which cannot mount volumes "
                "yet.")
    return (f"This offer's server runs virtual machines from cloud images (libvirt), which take no "
            f"{_OPTION_WORDS[field]} yet.")


def _check_runtime_options(node: Node, options: InstanceOptions, volumes: list[dict[str, Any]]) -> None:
    """400 naming each option given that the node's agent would refuse (RUNTIME_REFUSED_OPTIONS); nothing written.
    `extra["runtime"]` says which runtime refused them (compat.vast words it in its own options' names)."""
    given = {"env": bool(options.env), "onstart": bool(options.onstart), "ports": bool(options.ports),
             "volumes": bool(volumes)}
    problems = {field: f"{runtime_option_refusal(node.runtime, field)} Leave out `{field}`, or pick a docker offer."
                for field in runtime_refused_options(node.runtime) if given[field]}
    if problems:
        field, message = next(iter(problems.items()))
        raise ValidationFailed(message, field=field, errors={name: [text] for name, text in problems.items()},
                               extra={"runtime": node.runtime})


def _slice_price(node: Node, mig_profile: str) -> int:
    """A MIG booking's price per slice-hour; 400 naming the field for a profile the node does not rent out, or on a
    node whose runtime rents no slices (libvirt: services.nodes refuses it a layout; one declared before is left)."""
    if node.runtime not in MIG_RUNTIMES:
        raise ValidationFailed(f"This offer rents no MIG slices: its node runs {node.runtime} virtual machines, which "
                               "get whole GPUs only. Leave out `mig_profile`, or pick a docker offer.",
                               field="mig_profile")
    prices = node.mig_prices_micros or {}  # read by _lock_node_for_booking
    if mig_profile not in prices:
        offered = ", ".join(sorted(prices)) or "none"
        raise ValidationFailed(f"This offer rents no MIG {mig_profile} slices (its MIG profiles: {offered}).",
                               field="mig_profile")
    return int(prices[mig_profile])


class PriceChanged(Conflict):
    """The node's price per unit-hour (or its disk's per GB-month) is now above the most the renter agreed to (409,
    code price_changed): the provider raised it after the renter saw it. Nothing is booked; the figures ride along
    (`price_micros`, `max_price_micros`, and in the API's body as decimals) so a client or page can show the new
    price and ask again.
    """

    code = "price_changed"

    def __init__(self, *, price_micros: int, max_price_micros: int, unit: str, disk: bool = False) -> None:
        """`disk`: the price raised is the disk's per GB-month (`unit` "GB-month"), named by the disk's fields."""
        self.price_micros, self.max_price_micros, self.unit, self.disk = price_micros, max_price_micros, unit, disk
        now, agreed = (("disk_price_per_gb_month", "max_disk_price_per_gb_month") if disk
                       else ("price_per_gpu_hour", "max_price_per_gpu_hour"))
        what = "this offer's disk" if disk else "this offer"
        super().__init__(
            f"The price changed: {what} now costs {usd_rate_text(price_micros)} "
            f"per {unit}, more than the {usd_rate_text(max_price_micros)} per {unit} you agreed to. Nothing was "
            f"booked; book again at the new price if it suits you.",
            extra={"code": self.code, now: str(micros_to_usd(price_micros)),
                   agreed: str(micros_to_usd(max_price_micros))})


def _refuse_price_above(price: int, max_price_micros: int | None, mig_profile: str) -> None:
    """PriceChanged where the price read under the node's lock is above the renter's maximum (a cut books)."""
    if max_price_micros is not None and price > max_price_micros:
        raise PriceChanged(price_micros=price, max_price_micros=max_price_micros,
                           unit=f"MIG {mig_profile} slice-hour" if mig_profile else "GPU-hour")


def _refuse_disk_price_above(price: int, max_price_micros: int | None) -> None:
    """PriceChanged where the disk's price per GB-month read under the node's lock is above the renter's maximum:
    a stopped instance's disk is billed at it, and the funds check counts it (a cut books)."""
    if max_price_micros is not None and price > max_price_micros:
        raise PriceChanged(price_micros=price, max_price_micros=max_price_micros, unit="GB-month", disk=True)


def _slices_short(node_id: int, mig_profile: str, wanted: int, taken: int) -> None:
    """Fewer slices were taken than asked for: more than are free is a 400 naming `num_gpus`; free ones that
    concurrent bookings hold locked (free in the committed rows, skipped by SKIP LOCKED) are a race, 409."""
    free = free_slice_count(node_id, mig_profile) + taken  # those taken here were free, and are rented in this txn
    if wanted > free:
        raise ValidationFailed(f"This offer has {free} free MIG {mig_profile} slice{'s' if free != 1 else ''}; "
                               f"ask for 1 to {max(free, 1)}.", field="num_gpus")
    have = "No slice was" if not taken else f"Only {taken} {'was' if taken == 1 else 'were'}"
    raise Conflict(f"{have} free of MIG profile {mig_profile} on this node at the moment of booking; another "
                   f"booking took them meanwhile. Try again.")


def _refuse_across_islands(instance: Instance, node_id: int, num_gpus: int, islands: list[list[int]]) -> None:
    """409 (rolling the booking back) where the GPUs just allocated span NVLink islands: no island had `num_gpus`
    free (or a concurrent booking held them locked). Says how many do share one, the offer's nvlink_gpus_free."""
    held, free = gpus_held_and_free(instance, node_id)
    if any(held <= set(island) for island in islands):
        return
    most = max((len((held | free) & set(island)) for island in islands), default=0)
    raise Conflict(f"No {num_gpus} free GPUs of offer {node_id} share an NVLink island now (at most {most} do): "
                   f"book {most} or fewer with require_nvlink, or leave it out to book GPUs across islands "
                   f"(PCIe between them).", field="require_nvlink")


def _refuse_if_short(node: Node, committed_rate: int, price_per_hour_micros: int) -> None:
    """The funds check on the balance read with the node (under the wallet's lock) and the committed rate read
    after it; 402 when short."""
    balance: int = node.wallet_balance_micros  # type: ignore[attr-defined]  # set by _lock_node_for_booking
    funds_refuse_if_short(funds_of(balance_micros=balance, committed_rate_micros=committed_rate,
                                   price_per_hour_micros=price_per_hour_micros), "Renting this instance")


def _check_cuda(node: Node, wanted: str) -> None:
    if not wanted:
        return
    have = (node.inventory or {}).get("cuda_version")
    have_tuple, wanted_tuple = cuda_tuple(have), cuda_tuple(wanted)
    if have_tuple is None:
        raise ValidationFailed(f"This node's CUDA version is not known, so it cannot be shown to run CUDA {wanted}; "
                       "pick another offer or leave out `min_cuda_version`.", field="min_cuda_version")
    if wanted_tuple is not None and have_tuple < wanted_tuple:
        raise ValidationFailed(f"This node's driver supports CUDA up to {have}, lower than the {wanted} you asked for; "
                       "pick an offer with a newer driver (offers show it).", field="min_cuda_version")


def _book(*, renter: User, node_id: int, num_gpus: int, image: Image | str, keys: list[str], disk_gb: int | None,
          label: str, options: InstanceOptions, idempotency_key: str, request_fingerprint: str,
          volumes: list[dict[str, Any]], mig_profile: str = "", require_nvlink: bool = False,
          max_price_micros: int | None = None, max_disk_price_micros: int | None = None) -> Instance:
    # The funds check's wallet lock comes with the node's read, unless volumes are attached: their locks come
    # between the two (allocation.py's lock order), and the wallet is locked by _check_funds after them.
    funds_required = settings.BILLING_REQUIRE_FUNDS
    wallet_with_node = funds_required and not volumes
    node = _lock_node_for_booking(node_id, count_gpus=True, wallet_of=renter.pk if wallet_with_node else None)
    if node is None:
        raise ValidationFailed(f"There is no offer {node_id}; pick one from /api/v1/offers/.", field="offer")
    refusal = node_refusal(node, provider_active=node.provider_active)  # type: ignore[attr-defined]
    if refusal:
        raise Conflict(f"Offer {node_id} is not available: {refusal}.")
    total: int = node.gpu_total  # type: ignore[attr-defined]  # set by _lock_node_for_booking
    if mig_profile:
        price = _slice_price(node, mig_profile)
    elif num_gpus > total:
        raise ValidationFailed(f"This node has {_gpus_text(total)}; ask for 1 to {total}.", field="num_gpus")
    else:
        price = node.price_per_gpu_hour_micros
    # On the row read FOR SHARE: a price change (FOR NO KEY UPDATE) waits for this booking, or this one sees it.
    _refuse_price_above(price, max_price_micros, mig_profile)
    _refuse_disk_price_above(node.disk_price_per_gb_month_micros, max_disk_price_micros)
    min_disk = _check_image(image, node)
    _check_runtime_options(node, options, volumes)
    _check_cuda(node, options.min_cuda_version)
    disk = min_disk if disk_gb is None else disk_gb
    if not min_disk <= disk <= MAX_DISK_GB:
        what = f"The {image.slug} image" if isinstance(image, Image) else "An image of your own"
        raise ValidationFailed(f"{what} needs {min_disk} to {MAX_DISK_GB} GB of disk.", field="disk_gb")
    room = node.disk_room  # type: ignore[attr-defined]  # set by _lock_node_for_booking
    if room is not None and disk > room.left_gb:
        raise DiskDoesNotFit(node_id, room, disk, "an instance disk", "Ask for less disk (disk_gb), or rent another "
                             "offer.", field="disk_gb")
    mounts = volume_mounts_for_booking(renter=renter, node_id=node.pk, specs=volumes)  # locks the volumes
    if funds_required and not wallet_with_node:
        _check_funds(renter.pk, price * num_gpus, "Renting this instance")
    now = timezone.now()
    # The row goes in first: a concurrent request with the same Idempotency-Key blocks here on the
    # unique index until this transaction ends, then fails and answers with this instance.
    instance = Instance(
        renter=renter, node=node, gpu_model_id=node.gpu_model_id, num_gpus=num_gpus, label=label,
        mig_profile=mig_profile, require_nvlink=require_nvlink,
        image=image if isinstance(image, Image) else None, image_ref=image if isinstance(image, str) else "",
        registry_auth=options.registry_auth is not None,
        registry_auth_encrypted=(encrypt_secret(json.dumps(options.registry_auth).encode())
                                 if options.registry_auth is not None else None),
        env_names=list(options.env), env_encrypted=env_encrypt(options.env),
        onstart=options.onstart, ports_requested=options.ports,
        min_cuda_version=options.min_cuda_version, disk_gb=disk, ssh_public_keys=keys, status=S.REQUESTED,
        status_message=WAITING,
        # A MIG instance's "GPU" price is its slice price: billing meters price_per_hour_micros either way.
        price_per_gpu_hour_micros=price,
        price_per_hour_micros=price * num_gpus, platform_fee_bps=platform_fee_bps(),
        disk_price_per_gb_month_micros=node.disk_price_per_gb_month_micros,
        idempotency_key=idempotency_key, request_fingerprint=request_fingerprint if idempotency_key else "",
        created_at=now,
    )
    # The committed rate, the instance, its GPUs (or slices) and its job in one statement (allocation.py).
    rate_of = renter.pk if wallet_with_node else None
    if mig_profile:
        booked = _allocate_free_slices(instance, node, mig_profile, num_gpus, now, rate_of=rate_of,
                                       job_kind=JobKind.INSTANCE_PROVISION)
    else:
        islands = node_nvlink_islands(node)
        if require_nvlink and not any(len(island) >= num_gpus for island in islands):
            raise Conflict(f"Offer {node_id} has no NVLink island of {num_gpus} GPUs (its islands: "
                           f"{islands or 'none'}); book fewer GPUs, another offer, or leave out require_nvlink.",
                           field="require_nvlink")
        booked = _allocate_free_gpus(instance, node, num_gpus, now, islands=islands,
                                     rate_of=rate_of, job_kind=JobKind.INSTANCE_PROVISION)
    if booked.committed_rate_micros is not None:  # short of funds comes first: the rollback undoes the rest
        _refuse_if_short(node, booked.committed_rate_micros, price * num_gpus)
    taken = booked.taken
    if taken < num_gpus and mig_profile:  # raising rolls back the instance and the slices taken
        _slices_short(node.pk, mig_profile, num_gpus, taken)
    if taken < num_gpus:  # raising rolls back the instance and whatever was taken
        free = "No GPU is" if not taken else f"Only {_gpus_text(taken)} {'is' if taken == 1 else 'are'}"
        raise Conflict(f"{free} free on this node now; you asked for {num_gpus}.")
    if require_nvlink:  # the allocation takes one island when one has enough free; else it spanned them
        _refuse_across_islands(instance, node_id, num_gpus, islands)
    if mounts:
        volume_mounts_attach(instance=instance, requests=mounts)
    return instance
