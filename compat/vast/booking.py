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
"""
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone
from django.utils.crypto import salted_hmac

from core.idempotency import request_fingerprint
from marketplace.models import Instance, InstanceStatus, Node, User
from marketplace.services import instances as instance_svc

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


@transaction.atomic
def ask_book(*, renter: User, fingerprint: str, idempotency_key: str, **booking: Any) -> Instance:
    """instance_create with the create's key: the explicit one, else `vast-ask:<fingerprint>`. A concurrent
    identical create that inserted first is answered (instance_create's unique-index race). One transaction: a
    booking refused (no funds, taken GPUs) leaves the key on the instance that held it."""
    key = idempotency_key or REPLAY_KEY_PREFIX + fingerprint
    if not idempotency_key:
        stale = Instance.objects.filter(renter=renter, idempotency_key=key).first()
        if stale is not None and not _replayable(stale):
            # The node's row before the instance's, as every writer of both takes them (the booking below, a
            # retire ending the node's stopped instances, a verification repricing them): the instance's UPDATE
            # first deadlocked with a retire of its node (found by review: a 500). The same node (its key names the
            # same offer id), with the lock the booking takes on it.
            _share_lock_node(booking["node_id"])
            # Given up by its primary key and key together: never a newer holder's (a concurrent create may have
            # given it up and booked meanwhile).
            Instance.objects.filter(pk=stale.pk, idempotency_key=key).update(idempotency_key="",
                                                                            request_fingerprint="")
    instance, _ = instance_svc.instance_create(renter=renter, idempotency_key=key, request_fingerprint=fingerprint,
                                               **booking)
    return instance
