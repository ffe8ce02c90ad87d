"""`create instance` made safe to retry.

The vastai client re-sends the same PUT /asks/ID/ (up to 3 times, on a 502/503/504, a dropped connection or its
120 s timeout). On Vast.ai an ask is gone once booked, so a retry books nothing; here an offer id stays bookable
(compat.vast.offers), so a retry would book a second instance. Hence: the same user sending the same offer id with
the same body, while the instance it made is live and younger than COMPAT_CREATE_REPLAY_WINDOW_S, gets that
instance again.

It rides on the API's Idempotency-Key machinery (instance_create, the unique index
`instance_unique_idempotency_key`): the booking carries the key `vast-ask:<fingerprint>`, so two identical creates
in flight at once are decided by the index, never by "check, then insert". A key whose instance is no longer
replayed (destroyed, failed, stopped, or past the window) is given up by the next identical create, which takes it.
An explicit `Idempotency-Key` header is honoured instead, as POST /api/v1/instances/ does: the same key and body
get the same instance for good, another body a 422.

An offer id names a listing at a price (compat.vast.offers: it carries the node's price generation). ask_book holds
the id's generation against the node's under the node's lock: an id from a search before a raise of the GPU or disk
price is a 409 (AskPriceRaised) that books nothing; one of the current generation books with the price read there as
the most the renter pays (within a generation the prices only fall, so it is at most what the search showed).
"""
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django.utils.crypto import salted_hmac

from core.errors import Conflict, NotFound
from core.idempotency import request_fingerprint
from core.money import usd_rate_text
from marketplace.models import Instance, InstanceStatus, Node, User
from marketplace.services import instances as instance_svc

from . import offers

REPLAY_KEY_PREFIX = "vast-ask:"
S = InstanceStatus
# On its way to running, or running: what a retry of the create that made it should still be answered with.
REPLAYABLE = (S.REQUESTED, S.PROVISIONING, S.STARTING, S.RUNNING, S.INTERRUPTED)


def create_fingerprint(*, ask_id: int, body: dict[str, Any]) -> str:
    """The create's fingerprint: the offer id and the body. Keyed (HMAC), because the body holds env values and a
    registry password: no plain hash of them is stored."""
    canonical = request_fingerprint({"ask": ask_id, "body": body})
    return salted_hmac("compat-vast-create", canonical, algorithm="sha256").hexdigest()


def _replayable(instance: Instance) -> bool:
    window = timedelta(seconds=settings.COMPAT_CREATE_REPLAY_WINDOW_S)
    return instance.status in REPLAYABLE and instance.created_at >= timezone.now() - window


def ask_replayed(*, renter: User, fingerprint: str, idempotency_key: str) -> Instance | None:
    """The instance an earlier identical create made, when a retry is to be answered with it; else None.
    With an explicit key: the API's rule (IdempotencyKeyReused, a 422, for the same key with another body)."""
    if idempotency_key:
        return instance_svc.instance_for_idempotency_key(renter=renter, idempotency_key=idempotency_key,
                                                         request_fingerprint=fingerprint)
    earlier = Instance.objects.filter(renter=renter, idempotency_key=REPLAY_KEY_PREFIX + fingerprint).first()
    return earlier if earlier is not None and _replayable(earlier) else None


def replay_message(instance: Instance, *, idempotency_key: str) -> str:
    """What a replayed create says beside the instance's id, and what books another: with the client's own
    Idempotency-Key, another key (that key answers this instance for good, whatever the label); with the automatic
    key, another --label (another body)."""
    age = max(0, int((timezone.now() - instance.created_at).total_seconds()))
    if idempotency_key:
        return (f"A create with the same Idempotency-Key was sent {age} s ago: this is instance {instance.pk}, which "
                "it made, not a new one. To book another instance, send it with another Idempotency-Key.")
    return (f"The same create was sent {age} s ago: this is instance {instance.pk}, which it made, not a new one. "
            "To book another instance of this offer, give it another --label.")


def _share_lock_node(node_id: int) -> None:
    """The node's row locked FOR SHARE until the transaction ends: the lock a booking takes on it first
    (marketplace.services.instances.allocation), so bookings on it still run side by side. Django has no FOR SHARE;
    elsewhere than PostgreSQL the booking's own lock is enough (SQLite serialises writes)."""
    if connection.vendor != "postgresql":
        return
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT 1 FROM {connection.ops.quote_name(Node._meta.db_table)} "  # noqa: S608 (a table name)
                       "WHERE id = %s FOR SHARE", [node_id])


class AskPriceRaised(Conflict):
    """The offer id is from a search before the node's price rose (409, code price_changed, as the API's
    PriceChanged): nothing is booked; the message names the prices and the offer's id now."""

    code = "price_changed"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _refuse_raised(ask_id: int, num_gpus: int, generation: int, node: Mapping[str, Any]) -> None:
    """AskPriceRaised where the id's price generation is before the node's (read under the node's lock); NotFound
    for one after it (no search showed it)."""
    now = node["price_generation"]
    if generation == now:
        return
    if generation > now:
        raise NotFound(f"There is no offer {ask_id}: take an id from `vastai search offers`.", field="id")
    gpu, disk = node["price_per_gpu_hour_micros"], node["disk_price_per_gb_month_micros"]
    gpu_was, disk_was = node["price_before_raise_micros"], node["disk_price_before_raise_micros"]
    raises = now - generation
    # The prices just before the last raise are what this id's search showed (at most) only for one raise since.
    when = "when you searched" if raises == 1 else f"before the last of the {raises} raises since your search"
    was = (f" (it was {usd_rate_text(gpu_was * num_gpus)}/hour, disk {usd_rate_text(disk_was)} per GB-month, "
           f"{when})" if gpu_was is not None and disk_was is not None else "")
    new_id = offers.offer_id(node["id"], num_gpus, now)
    raise AskPriceRaised(
        f"Offer {ask_id}'s price has risen since your search: its {_plural(num_gpus, 'GPU')} now cost "
        f"{usd_rate_text(gpu * num_gpus)}/hour, disk {usd_rate_text(disk)} per GB-month{was}. Nothing was booked. "
        f"Search again (`vastai search offers`): at the new price it is offer {new_id}.", field="id",
        extra={"new_ask_id": new_id, "dph_total": offers.usd(gpu * num_gpus), "storage_cost": offers.usd(disk)})


@transaction.atomic
def ask_book(*, renter: User, fingerprint: str, idempotency_key: str, ask_id: int, price_generation: int,
             **booking: Any) -> Instance:
    """instance_create with the create's key: the explicit one, else `vast-ask:<fingerprint>`. A concurrent
    identical create that inserted first is answered (instance_create's unique-index race). One transaction: a
    booking refused (no funds, taken GPUs) leaves the key on the instance that held it. `ask_id`'s
    `price_generation` is held against the node's first, under the node's lock (AskPriceRaised)."""
    key = idempotency_key or REPLAY_KEY_PREFIX + fingerprint
    # The node's row before the instance's, as every writer of both takes them (see below); FOR SHARE until the
    # booking commits, so a raise (node_update's FOR NO KEY UPDATE) waits for it or is seen here.
    _share_lock_node(booking["node_id"])
    node = Node.objects.filter(pk=booking["node_id"]).values(
        "id", "price_generation", "price_per_gpu_hour_micros", "disk_price_per_gb_month_micros",
        "price_before_raise_micros", "disk_price_before_raise_micros").first()
    if node is not None:  # else instance_create answers that there is no such offer
        _refuse_raised(ask_id, booking["num_gpus"], price_generation, node)
        # The GPU price read under the lock as the most the renter pays: _refuse_price_above checks it again where
        # the booking reads the price.
        booking["max_price_micros"] = node["price_per_gpu_hour_micros"]
    if not idempotency_key:
        stale = Instance.objects.filter(renter=renter, idempotency_key=key).first()
        if stale is not None and not _replayable(stale):
            # The node's row before the instance's, as every writer of both takes them (the booking below, a
            # retire ending the node's stopped instances, a verification repricing them): the instance's UPDATE
            # first deadlocked with a retire of its node (found by review: a 500). The node is locked above (its
            # key names the same offer id), with the lock the booking takes on it.
            # Given up by its primary key and key together: never a newer holder's (a concurrent create may have
            # given it up and booked meanwhile).
            Instance.objects.filter(pk=stale.pk, idempotency_key=key).update(idempotency_key="",
                                                                            request_fingerprint="")
    instance, _ = instance_svc.instance_create(renter=renter, idempotency_key=key, request_fingerprint=fingerprint,
                                               **booking)
    return instance
