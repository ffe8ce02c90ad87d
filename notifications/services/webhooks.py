"""Users' webhook endpoints and the delivery of signed events to them.

An endpoint gets a random signing secret, stored encrypted (marketplace.encryption) and shown once. A delivery is
tried by the worker (`webhook_attempt`, from notifications.tasks.webhook_deliver): one POST with a short timeout
for the whole attempt (not per read: `_Deadline`) and no redirects, to the address the URL's check resolved (the
name is not resolved again, so no DNS rebinding to an internal host; no proxy from the environment either, which
would resolve it again); a 2xx answer delivers it;
anything else (an exception too) is retried by the task with exponential backoff (Celery's retry,
NOTIFICATIONS_WEBHOOK_BACKOFF_S × 2^(attempt-1)) until NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS. Every attempt is logged
(status code or error, time, duration) for the user to read. A paused endpoint is sent only test events.

One attempt of a delivery at a time: an attempt is claimed (`claimed_at`, under the row's lock) and the claim ends
when it is recorded; another task for the same delivery, or the resender, leaves it alone until then, or until
`in_flight_bound_s()` has passed (its worker was lost). Delivery is at least once: a worker lost after the POST and
before recording it makes the next attempt send the event again, with the same event id for the receiver to
de-duplicate (X-GPUMarket-Delivery, the body's "id").

An endpoint deleted while its events are written or sent: the endpoint's row is locked (FOR KEY SHARE, as a foreign
key would) while a delivery is written for it, a delivery's row while an attempt is recorded for it, and the DELETE
locks both before it deletes what goes with the endpoint; an attempt whose delivery is gone by the time it is
recorded ends with nothing recorded.
"""
import logging
import math
import secrets
import socket
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import requests
from django.conf import settings
from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.response import HTTPResponse

from core import dispatch
from core.api.scopes import ALL_SCOPES, PROVIDER, RENTER
from core.errors import IdempotencyKeyReused, NotFound, TooManyRequests, ValidationFailed
from core.security_mail import security_change_notify
from marketplace.encryption import decrypt_secret, encrypt_secret
from marketplace.models import User
from notifications.models import (
    DeliveryStatus,
    Kind,
    WebhookAttempt,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookTestEvent,
    roles_held,
)
from notifications.services.notify import WEBHOOK_DELIVER, delivery_queue, notify
from notifications.services.retry import backoff_s, recordable
from notifications.services.signing import SIGNATURE_HEADER, signature_header
from notifications.services.urls import WebhookTarget, webhook_target, webhook_url_check

log = logging.getLogger(__name__)

DESCRIPTION_MAX_LENGTH = 200
ENDPOINTS_PER_USER = 10
# The rate (DEFAULT_THROTTLE_RATES) of adding or changing an endpoint, per user, the API and the page together: each
# may resolve a host name the user chose inside the web request, and a slow name server held a web worker for the
# lookup's whole time limit, as often as asked (found by review).
ENDPOINT_WRITES_SCOPE = "webhook_endpoints"
ENDPOINT_WRITES_REFUSED = ("Too many webhook endpoints added or changed for now: nothing was changed. Try again in "
                           "{wait}.")


# An active endpoint none of whose attempts was delivered for this long is paused by the platform, its owner told
# once (as Stripe does after about three days): its events were all failing, each retried up to MAX_ATTEMPTS.
DISABLE_AFTER = timedelta(days=3)
# ... and only once this many events (deliveries, test events too) failed since then: the days alone paused an
# endpoint whose events are rare after two failed events four days apart. Events, not attempts: one event's retries
# (NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS, 8, within about an hour) are one failure seen again, not five.
DISABLE_MIN_FAILED_EVENTS = 5


def endpoint_writes_refused(wait_s: float) -> str:
    """What a client past the ENDPOINT_WRITES_SCOPE rate is told (with Retry-After)."""
    wait = max(1, math.ceil(wait_s))
    return ENDPOINT_WRITES_REFUSED.format(wait=f"{wait} second{'s' if wait != 1 else ''}")


def _secret_new() -> str:
    return f"whsec_{secrets.token_urlsafe(32)}"


def endpoint_secret(*, endpoint: WebhookEndpoint) -> str:
    return decrypt_secret(bytes(endpoint.secret_encrypted)).decode()


def _description(description: str) -> str:
    description = description.strip()
    if len(description) > DESCRIPTION_MAX_LENGTH:
        raise ValidationFailed(f"At most {DESCRIPTION_MAX_LENGTH} characters.", field="description")
    return description


class EndpointRequestReused(ValidationFailed):
    """The page form's token already added an endpoint, and this submission is not a replay of it to answer
    again (other values, or too late to show the secret again)."""


# How long the same form submitted again shows the endpoint's secret again: a double click or a slow page's second
# submission replaces the first answer, the only one that showed it. Later, the secret stays unshown.
REQUEST_REPLAY_S = 600


# What an endpoint receives, as the e-mail telling of a new one says it (by the roles of the key that added it).
_EVENTS_OF = {frozenset({RENTER, PROVIDER}): "instances, balance, payouts", frozenset({RENTER}): "instances, balance",
              frozenset({PROVIDER}): "nodes, payouts", frozenset(): "the account's own"}


def endpoint_create(*, user: User, url: str, description: str = "", base_url: str = "",
                    idempotency_key: str = "") -> tuple[WebhookEndpoint, str]:
    """A new endpoint and its signing secret (returned this once, never again). It receives the account's events
    until deleted: the address is told (as of a saved SSH key).

    With `idempotency_key` (a page form's token) the same submission again returns the endpoint it added and its
    secret (within REQUEST_REPLAY_S), adding and telling nothing; EndpointRequestReused otherwise."""
    endpoint, secret, _ = endpoint_create_once(user=user, url=url, description=description, base_url=base_url,
                                               idempotency_key=idempotency_key)
    return endpoint, secret


def endpoint_create_once(*, user: User, url: str, description: str = "", active: bool = True, base_url: str = "",
                         idempotency_key: str = "", request_fingerprint: str = "",
                         scopes: list[str] | tuple[str, ...] | None = None,
                         ) -> tuple[WebhookEndpoint, str, bool]:
    """endpoint_create, and whether it added the endpoint (False: the request's replay answered the earlier one).

    `request_fingerprint` (an API request's Idempotency-Key, core.idempotency): the key's earlier endpoint is
    answered as endpoint_for_idempotency_key says (its body's fingerprint compared, IdempotencyKeyReused
    otherwise); without it (a page form's token) its values are compared (EndpointRequestReused). `scopes`: those
    of the API key adding it, kept with it: it receives the kinds of their roles only (models.KIND_ROLES); None (the
    settings page, a session) every scope."""
    url = webhook_url_check(url)
    description = _description(description)
    with transaction.atomic():
        User.objects.select_for_update().filter(pk=user.pk).first()  # one count (and one key look-up) at a time
        if idempotency_key and request_fingerprint:
            earlier = endpoint_for_idempotency_key(user=user, idempotency_key=idempotency_key,
                                                   request_fingerprint=request_fingerprint, scopes=scopes)
            if earlier is not None:
                return *earlier, False
        elif idempotency_key:
            added = WebhookEndpoint.objects.filter(user=user, request_key=idempotency_key).first()
            if added is not None:
                return _replayed(added, url=url, description=description), endpoint_secret(endpoint=added), False
        if WebhookEndpoint.objects.filter(user=user).count() >= ENDPOINTS_PER_USER:
            raise ValidationFailed(f"At most {ENDPOINTS_PER_USER} endpoints; delete one first.", field="url")
        secret = _secret_new()
        endpoint = WebhookEndpoint.objects.create(user=user, url=url, description=description, active=active,
                                                  secret_encrypted=encrypt_secret(secret.encode()),
                                                  secret_hint=secret[:10], request_key=idempotency_key,
                                                  request_fingerprint=request_fingerprint,
                                                  scopes=list(ALL_SCOPES if scopes is None else scopes))
        security_change_notify(user=user, subject="A webhook endpoint was added to your account", base_url=base_url,
                               change=f"A webhook endpoint was added to your account: {url}. It receives your "
                                      f"account's events ({_EVENTS_OF[endpoint.roles]}) until it is deleted.")
    return endpoint, secret, True


def endpoint_for_idempotency_key(*, user: User, idempotency_key: str, request_fingerprint: str,
                                 scopes: list[str] | tuple[str, ...] | None = None,
                                 ) -> tuple[WebhookEndpoint, str] | None:
    """The endpoint an API request of the user's with this Idempotency-Key added, and its secret: a client that
    lost the answer (a timeout, a 502 after the commit) sends the request again and gets the answer it lost, the
    only one with the secret, as a page form submitted twice does (REQUEST_REPLAY_S). None when the key added
    none. IdempotencyKeyReused (422) when that request had another body, or when it is older than
    REQUEST_REPLAY_S: its secret was shown then and is not shown again; or when `scopes` (the asking key's) do not
    hold every role of the endpoint's: another key of the user's added it, and its secret is not this key's to read.
    """
    added = WebhookEndpoint.objects.filter(user=user, request_key=idempotency_key).first()
    if added is None:
        return None
    if added.request_fingerprint != request_fingerprint or not added.roles <= roles_held(scopes):
        raise IdempotencyKeyReused(f"This Idempotency-Key was used for another request: it added the webhook "
                                   f"endpoint {added.pk}. Use a new key for a new endpoint.")
    if timezone.now() - added.created_at > timedelta(seconds=REQUEST_REPLAY_S):
        raise IdempotencyKeyReused(f"This Idempotency-Key added the webhook endpoint {added.pk} more than "
                                   f"{REQUEST_REPLAY_S // 60} minutes ago; its secret was shown then and is not "
                                   "shown again. Use a new key for a new endpoint.")
    return added, endpoint_secret(endpoint=added)


def _replayed(endpoint: WebhookEndpoint, *, url: str, description: str) -> WebhookEndpoint:
    if (endpoint.url, endpoint.description) != (url, description):
        raise EndpointRequestReused(f"This form already added the endpoint {endpoint.url}. Check the values below "
                                    "and add again to add another.")
    if timezone.now() - endpoint.created_at > timedelta(seconds=REQUEST_REPLAY_S):
        raise EndpointRequestReused(f"This form already added the endpoint {endpoint.url}; its secret was shown "
                                    "then. Add again to add another.")
    return endpoint


def endpoint_update(*, endpoint: WebhookEndpoint, url: str | None = None, description: str | None = None,
                    active: bool | None = None, base_url: str = "") -> WebhookEndpoint:
    """The endpoint with the given values, read afresh under its row's lock: NotFound (a 404) when it was deleted
    meanwhile, where saving the caller's copy of a row that is gone raised a DatabaseError (a 500; found by review).
    The caller's copy gets the values set too.

    A new URL is told to the account's address: the events go elsewhere from now on. In one transaction: the
    e-mail goes when the change is saved (security_change_notify sends on commit), not for a change that was not.
    The values are checked before the row is locked (the URL's check resolves its name)."""
    changes: dict[str, Any] = {}
    if url is not None:
        changes["url"] = webhook_url_check(url)
    if description is not None:
        changes["description"] = _description(description)
    if active is not None:
        changes["active"] = active
    with transaction.atomic():
        # FOR NO KEY UPDATE: not held up by notify()'s FOR KEY SHARE on the endpoint (an open transaction of another
        # app's that told the user something held a pause up to gunicorn's timeout; found by review), and still
        # exclusive of endpoint_delete's FOR UPDATE.
        current = WebhookEndpoint.objects.select_for_update(no_key=True).filter(pk=endpoint.pk).first()
        if current is None:
            raise NotFound("This webhook endpoint was deleted.")
        if active and not current.active:  # a resume: a pause by the platform is over, its failing days start afresh
            changes.update(disabled_at=None, disabled_reason="", failing_since=None)
        if "url" in changes and changes["url"] != current.url:
            security_change_notify(user=current.user, subject="A webhook endpoint now sends elsewhere",
                                   base_url=base_url, change=f"Your webhook endpoint {current.pk} now sends your "
                                                             f"account's events to {changes['url']} (it sent them "
                                                             f"to {current.url}).")
        for name, value in changes.items():
            setattr(current, name, value)
            setattr(endpoint, name, value)
        if changes:
            current.save(update_fields=list(changes))
    return current


def endpoint_delete(*, endpoint: WebhookEndpoint) -> None:
    """Delete the endpoint with its deliveries and their attempts. The endpoint's row and then its deliveries' are
    locked before what goes with it is deleted: a delivery being written for it (notify, a test event) or an
    attempt being recorded commits first and is deleted too, instead of failing this DELETE at its commit on a
    row it had not seen.

    Set-wise, a handful of statements whatever the log's length: the deliveries are locked in the database (one
    count comes back, not a row per delivery), then the attempts and the deliveries are deleted by their endpoint.
    Before, every delivery's id was read into a list and Django's collector read them all again to cascade to their
    attempts: 28 s for 300,000 deliveries, and past gunicorn's timeout the DELETE rolled back and the endpoint kept
    receiving the account's events (found by review)."""
    with transaction.atomic():
        if WebhookEndpoint.objects.select_for_update().filter(pk=endpoint.pk).first() is None:
            return  # deleted meanwhile
        deliveries = WebhookDelivery.objects.filter(endpoint_id=endpoint.pk)
        with connection.cursor() as cursor:
            rows = connection.ops.quote_name(WebhookDelivery._meta.db_table)
            locked = f"SELECT 1 FROM {rows} WHERE endpoint_id = %s FOR UPDATE"  # noqa: S608 (the model's table)
            cursor.execute(f"SELECT count(*) FROM ({locked}) locked", [endpoint.pk])  # noqa: S608
        # No collector: attempts, then deliveries, each one DELETE ... WHERE (no signal handlers listen to them).
        attempts = WebhookAttempt.objects.filter(delivery_id__in=deliveries.values("pk"))
        attempts._raw_delete(attempts.db)
        deliveries._raw_delete(deliveries.db)
        endpoint.delete()


def endpoint_test(*, endpoint: WebhookEndpoint) -> WebhookDelivery:
    """Queue a `test` event to this endpoint (active or not), sent and logged like any other.

    At most NOTIFICATIONS_WEBHOOK_TESTS_PER_HOUR per user (TooManyRequests, a 429, past it): each one is up to
    NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS signed requests to a URL the user chose, which must not make the platform
    a way to flood someone else's server."""
    limit = settings.NOTIFICATIONS_WEBHOOK_TESTS_PER_HOUR
    hour_ago = timezone.now() - timedelta(hours=1)
    with transaction.atomic():
        User.objects.select_for_update().filter(pk=endpoint.user_id).first()  # one count at a time per user
        # The endpoint stays until this commits (a DELETE meanwhile waits, then takes the delivery along). NO KEY:
        # notify()'s FOR KEY SHARE in another open transaction does not hold the test button up (endpoint_update).
        if WebhookEndpoint.objects.select_for_update(no_key=True).filter(pk=endpoint.pk).first() is None:
            raise NotFound("This webhook endpoint was deleted.")
        # Counted from their own rows: the deliveries go with a deleted endpoint, the limit must not.
        tests = WebhookTestEvent.objects.filter(user_id=endpoint.user_id)
        tests.filter(at__lt=hour_ago).delete()  # past the window: never counted again
        if tests.count() >= limit:
            raise TooManyRequests(f"At most {limit} test events an hour: try again later. Real events are "
                                  "not limited.")
        WebhookTestEvent.objects.create(user_id=endpoint.user_id)
        return delivery_queue(endpoint=endpoint, kind=Kind.TEST, title="Test event",
                              message="A test event from the GPU marketplace: your endpoint receives and verifies "
                                      "signed events.",
                              payload={"endpoint": endpoint.pk})


# --------------------------------------------------------------------------------------- the worker's side


@dataclass(frozen=True)
class Attempt:
    number: int
    status_code: int | None
    error: str
    retry_in_s: float | None  # None: delivered, or given up


def in_flight_bound_s() -> float:
    """How long after its claim an attempt not yet recorded counts as in flight: its deadline, and a margin for
    recording it. Past that its worker was lost, and another attempt may be made."""
    return float(settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S + 60)


def _claim(delivery_id: int, after_attempts: int | None = None) -> tuple[WebhookDelivery, int] | None:
    """Count and claim the attempt about to be made (row locked), or None when there is none to make: the delivery
    is over or gone, another attempt of it is in flight, or it is finished here as failed without sending (a real
    event to a paused endpoint; a delivery whose attempts are all used, the last one lost with its worker, which
    the resender would queue forever)."""
    now = timezone.now()
    with transaction.atomic():
        delivery = (WebhookDelivery.objects.select_for_update(of=("self",)).select_related("endpoint")
                    .filter(pk=delivery_id).first())
        if delivery is None or delivery.status in (DeliveryStatus.SUCCEEDED, DeliveryStatus.FAILED):
            return None
        if delivery.claimed_at is not None and now - delivery.claimed_at < timedelta(seconds=in_flight_bound_s()):
            return None  # a duplicate task (a redelivery, the resender): the attempt in flight decides what follows
        if after_attempts is not None and delivery.attempts != after_attempts:
            # A task queued before an attempt that has been made since (a duplicate coming after a failed attempt:
            # the resender's during a queue backlog, a redelivered message): it attempted at once and started a
            # second retry chain, spending the attempts twice as fast (found by review). The chain that made the
            # attempt has queued its own retry. Counted, not timed: the workers' clocks need not agree.
            return None
        refusal = ""
        if not delivery.endpoint.active and delivery.kind != Kind.TEST:  # the page: "receives only test events"
            refusal = "Not sent: the endpoint is paused."
        elif delivery.attempts >= settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS:
            refusal = f"Given up after {delivery.attempts} attempts."
        if refusal:
            WebhookDelivery.transition_rows(WebhookDelivery.objects.filter(pk=delivery.pk), DeliveryStatus.FAILED,
                                            last_error=refusal, finished_at=timezone.now(), next_attempt_at=None)
            return None
        delivery.attempts += 1
        delivery.claimed_at = now
        delivery.save(update_fields=["attempts", "claimed_at"])
        return delivery, delivery.attempts


class _Deadline:
    """The whole attempt's time limit. requests' timeout bounds each socket read, so an endpoint that drips a
    byte per read would hold the worker (shared with the fleet's health checks) as long as it likes: when the
    time is up this shuts every connection the attempt opened, and the read blocked on it returns at once.

    It shuts its own duplicate of each socket's descriptor: over TLS the socket urllib3 opened is detached into
    an SSLSocket (before the handshake) and no longer names the connection, a duplicate still does, and
    shutdown() acts on the connection whichever descriptor names it. The outcome is decided once, under the lock:
    the answer's status and headers in first (`answered`), and the deadline no longer does anything; the deadline
    first, and the attempt had no answer, whatever a cut-off read parsed."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.expired = False
        self._decided = False
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> "_Deadline":
        self._token = _deadline.set(self)
        self._started = time.monotonic()
        self._timer.start()
        return self

    def remaining(self) -> float:
        """Seconds left (inside the `with`): what a step that cannot be shut down, the DNS lookup, may wait."""
        return max(self.seconds - (time.monotonic() - self._started), 0.0)

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        _deadline.reset(self._token)
        with self._lock:
            self._decided = True  # a timer firing now (cancel() cannot stop one already running) changes nothing
            for sock in self._sockets:
                sock.close()  # the duplicates only: the attempt's own sockets are closed with its session
            self._sockets.clear()

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            if self._decided:
                return
            duplicate = sock.dup()
            self._sockets.append(duplicate)
            if self.expired:
                _shut(duplicate)

    def answered(self) -> None:
        """The status line and headers are in, within the time: a deadline passing from now on (a worker busy
        before it got to cancel the timer) must not turn a delivered answer into "no answer"."""
        with self._lock:
            self._decided = True

    def _expire(self) -> None:
        with self._lock:
            if self._decided:
                return
            self.expired = True
            for sock in self._sockets:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # not close(): another thread's blocked recv wakes only on a shutdown
    except OSError:
        pass  # the connection is gone already


_deadline: ContextVar[_Deadline | None] = ContextVar("webhook_attempt_deadline", default=None)


def _watched(sock: socket.socket) -> socket.socket:
    deadline = _deadline.get()
    if deadline is not None:
        deadline.watch(sock)
    return sock


def _answered(response: HTTPResponse) -> HTTPResponse:
    deadline = _deadline.get()
    if deadline is not None:
        deadline.answered()
    return response


class _WatchedHTTPConnection(HTTPConnection):
    """Hands each socket it opens to the attempt's _Deadline (before TLS, so a slow handshake is bounded too),
    and tells it when the answer's status and headers are in."""

    def _new_conn(self) -> socket.socket:
        return _watched(super()._new_conn())

    def getresponse(self) -> HTTPResponse:  # type: ignore[override]  # as urllib3 itself, over http.client
        return _answered(super().getresponse())


class _WatchedHTTPSConnection(HTTPSConnection):
    def _new_conn(self) -> socket.socket:
        return _watched(super()._new_conn())

    def getresponse(self) -> HTTPResponse:  # type: ignore[override]  # as urllib3 itself, over http.client
        return _answered(super().getresponse())


class _WatchedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


class _AttemptAdapter(HTTPAdapter):
    """Sockets watched by the attempt's _Deadline; HTTPS to an address, with the URL's host name for SNI and the
    certificate check (urllib3 drops the TLS arguments for plain http)."""

    def __init__(self, hostname: str):
        self._hostname = hostname  # before HTTPAdapter's __init__, which makes the pool manager
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs.update(server_hostname=self._hostname, assert_hostname=self._hostname)
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}


def _send(target: WebhookTarget, body: bytes, headers: dict[str, str]) -> requests.Response:
    with requests.Session() as session:
        session.trust_env = False
        adapter = _AttemptAdapter(target.hostname)
        session.mount("https://", adapter)
        session.mount("http://", adapter)
        answer = session.post(target.connect_url, data=body, headers={**headers, "Host": target.host_header},
                              allow_redirects=False, timeout=settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S, stream=True,
                              verify=settings.NOTIFICATIONS_WEBHOOK_CA_BUNDLE or True)
        answer.close()  # the body is not read: only the status counts
        return answer


def _post(delivery: WebhookDelivery) -> tuple[int | None, str]:
    """(status code, error): one signed POST, within NOTIFICATIONS_WEBHOOK_TIMEOUT_S in all; nothing raised (an
    exception that escaped would leave the counted attempt unlogged and the delivery unfinished)."""
    timeout_s = settings.NOTIFICATIONS_WEBHOOK_TIMEOUT_S
    deadline = _Deadline(timeout_s)
    try:
        body = delivery.body.encode()
        headers = {
            "Content-Type": "application/json",
            "User-Agent": f"{settings.PLATFORM_NAME}-webhooks/1",
            "X-GPUMarket-Event": delivery.kind,
            "X-GPUMarket-Delivery": str(delivery.event_id),
            SIGNATURE_HEADER: signature_header(secret=endpoint_secret(endpoint=delivery.endpoint), body=body),
        }
        with deadline:  # the name's lookup too: a slow name server must not hold the worker past the limit
            target = webhook_target(delivery.endpoint.url, timeout_s=deadline.remaining())
            answer = _send(target, body, headers)
    except ValidationFailed as exc:
        return None, f"Not sent: {exc.message}"
    except Exception as exc:  # noqa: BLE001 (recorded as this attempt's failure, whatever it is)
        if deadline.expired or isinstance(exc, requests.Timeout):
            return None, f"No answer within {timeout_s} s."
        if isinstance(exc, requests.RequestException):
            return None, f"Could not connect: {type(exc).__name__}: {exc}"[:500]
        log.exception("webhook delivery %s: the attempt failed unexpectedly", delivery.pk)
        return None, f"Not sent: {type(exc).__name__}: {exc}"[:500]
    if deadline.expired:  # cut off before the answer was in: a partial status line may still have parsed
        return None, f"No answer within {timeout_s} s."
    if 200 <= answer.status_code < 300:
        return answer.status_code, ""
    return answer.status_code, f"Answered {answer.status_code} {answer.reason or ''}".strip()[:500]


def webhook_attempt(*, delivery_id: int, after_attempts: int | None = None) -> Attempt | None:
    """Make the delivery's next attempt and record it; None when there was nothing to do, or when the delivery
    was deleted (with its endpoint) while the attempt was in flight: there is nothing to record it on.
    `after_attempts`: the attempts made when the task was queued; another count means it is a duplicate (_claim)."""
    claimed = _claim(delivery_id, after_attempts)
    if claimed is None:
        return None
    delivery, number = claimed
    started = time.monotonic()
    status_code, answered = _post(delivery)
    # The error quotes what the receiver sent (its reason phrase, an exception's message): a NUL in it failed the
    # recording below, and the counted attempt went unlogged (found by review).
    error = (recordable(answered) or "Failed.") if answered else ""
    duration_ms = int((time.monotonic() - started) * 1000)
    now = timezone.now()
    retry_in: float | None = None
    if not error:
        target = DeliveryStatus.SUCCEEDED
    elif number >= settings.NOTIFICATIONS_WEBHOOK_MAX_ATTEMPTS:
        target = DeliveryStatus.FAILED
    else:
        target, retry_in = DeliveryStatus.RETRYING, backoff_s(number, base_s=settings.NOTIFICATIONS_WEBHOOK_BACKOFF_S)
    with transaction.atomic():
        # Locked while the attempt is written: a DELETE of the endpoint waits for it (endpoint_delete).
        if WebhookDelivery.objects.select_for_update().filter(pk=delivery.pk).values_list("pk").first() is None:
            log.info("webhook delivery %s was deleted during attempt %s: nothing recorded", delivery.pk, number)
            return None
        WebhookAttempt.objects.get_or_create(delivery_id=delivery.pk, number=number, defaults={
            "status_code": status_code, "error": error, "duration_ms": duration_ms, "at": now})
        values: dict[str, Any] = {"last_status_code": status_code, "last_error": error, "claimed_at": None}
        if retry_in is None:
            values.update(finished_at=now, next_attempt_at=None)
        else:
            values.update(next_attempt_at=now + timedelta(seconds=retry_in))
        WebhookDelivery.transition_rows(WebhookDelivery.objects.filter(pk=delivery.pk), target, **values)
    _endpoint_outcome(delivery.endpoint_id, delivered=not error, at=now)
    return Attempt(number, status_code, error, retry_in)


def _endpoint_outcome(endpoint_id: int, *, delivered: bool, at: datetime) -> None:
    """Keep the endpoint's `failing_since` (the first failed attempt since the last delivered one), and pause an
    active endpoint that has failed every attempt for DISABLE_AFTER, on at least DISABLE_MIN_FAILED_EVENTS events,
    with its reason, its owner told once (the `webhook_endpoint_disabled` notice: e-mail and the list, as they
    chose). After the attempt's own transaction: the endpoint's row is locked after the delivery's nowhere
    (endpoint_delete locks them the other way round)."""
    endpoints = WebhookEndpoint.objects.filter(pk=endpoint_id)
    if delivered:
        endpoints.filter(failing_since__isnull=False).update(failing_since=None)
        return
    endpoints.filter(failing_since__isnull=True).update(failing_since=at)
    with transaction.atomic():
        endpoint = (endpoints.select_for_update(no_key=True)
                    .filter(active=True, failing_since__lte=at - DISABLE_AFTER).select_related("user").first())
        if endpoint is None or endpoint.failing_since is None:
            return
        if _failed_events(endpoint_id, since=endpoint.failing_since) < DISABLE_MIN_FAILED_EVENTS:
            return  # rare events: too few failures yet to tell a broken endpoint from bad luck
        reason = (f"Paused by the platform: no attempt to deliver an event to it succeeded since "
                  f"{endpoint.failing_since:%Y-%m-%d %H:%M} UTC ({DISABLE_AFTER.days} days or more, "
                  f"{DISABLE_MIN_FAILED_EVENTS} events or more failed). Events are not sent to it until you "
                  "resume it.")
        endpoint.active, endpoint.disabled_at, endpoint.disabled_reason = False, at, reason
        endpoint.save(update_fields=["active", "disabled_at", "disabled_reason"])
        notify(user=endpoint.user, kind=Kind.WEBHOOK_ENDPOINT_DISABLED, dedupe_key=f"webhook_disabled:{endpoint.pk}:"
               f"{at.isoformat()}", payload={"endpoint": endpoint.pk, "url": endpoint.url,
                                             "message": f"Your webhook endpoint {endpoint.url}: {reason} Check it "
                                                        "answers 2xx, then resume it on its page or with the API."})


def _failed_events(endpoint_id: int, *, since: datetime) -> int:
    """How many of the endpoint's deliveries had an attempt fail at or after `since`, counted up to
    DISABLE_MIN_FAILED_EVENTS (all that the rule needs). From the attempts' log, no counter to keep: every attempt
    since `failing_since` failed (a delivered one clears it). A log pruned meanwhile (NOTIFICATIONS_WEBHOOK_LOG_DAYS)
    counts fewer, which only delays a pause."""
    failed = WebhookAttempt.objects.filter(delivery__endpoint_id=endpoint_id, at__gte=since).exclude(error="")
    return failed.order_by().values("delivery_id").distinct()[:DISABLE_MIN_FAILED_EVENTS].count()


def deliveries_resend(*, overdue_s: int = 300) -> int:
    """Queue again the deliveries whose next attempt is `overdue_s` late (a broker that refused them, a worker
    lost with its retry) and that have no attempt in flight (a queue backlog longer than `overdue_s`): the number
    queued.

    Oldest due first: after a broker outage the ones waiting longest are queued first. A row is marked queued (its
    next attempt "now") only if it is as it was when listed (the same attempts and claim): an attempt made and
    recorded while this run was sending (the task just queued, its own late retry) set its backoff, which the mark
    undid, and the next run queued it again ~5 min later instead of after the backoff (found by review)."""
    now = timezone.now()
    due = now - timedelta(seconds=overdue_s)
    idle = Q(claimed_at=None) | Q(claimed_at__lt=now - timedelta(seconds=in_flight_bound_s()))
    rows = list(WebhookDelivery.objects.filter(idle, status__in=[DeliveryStatus.PENDING, DeliveryStatus.RETRYING],
                                               next_attempt_at__lt=due)
                .order_by("next_attempt_at", "pk").values_list("pk", "attempts", "claimed_at")[:500])
    for delivery_id, attempts, claimed_at in rows:
        try:
            dispatch.send(WEBHOOK_DELIVER, delivery_id, attempts)
        except Exception as exc:  # noqa: BLE001 (kombu's many errors: the beat tries again)
            log.warning("delivery %s could not be queued (%s)", delivery_id, exc)
            break
        WebhookDelivery.objects.filter(pk=delivery_id, attempts=attempts, claimed_at=claimed_at,
                                       status__in=[DeliveryStatus.PENDING, DeliveryStatus.RETRYING]).update(
            next_attempt_at=timezone.now())
    return len(rows)
