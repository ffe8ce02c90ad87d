"""API key scopes (read, renter, provider) and expiry, on every API view: /api/v1/, billing and compat/vast/.

The walk over the URL configuration fails when a DRF view anywhere declares no scope rule, or when a path under
/api/ or /compat/vast/ is served by anything but a DRF view; the parametrised tests then send, to every one of
those paths, a key without the scope its rule needs and check the 403 names the scope.
"""
import json
import re
from datetime import timedelta

import pytest
from django.urls import URLPattern, URLResolver, get_resolver, resolve
from django.utils import timezone
from rest_framework.test import APIClient
from rest_framework.views import APIView

from billing.models import AccountKind, EventKind
from billing.services.notify import event_create
from core.api.scopes import (
    ALL_SCOPES,
    ANY,
    PROVIDER,
    PUBLIC,
    READ,
    RENTER,
    RENTER_OR_PROVIDER,
    is_rule,
    read_methods_of,
)
from marketplace.models import ApiKey
from marketplace.services.accounts import api_key_create
from notifications.models import Kind, Notification, WebhookDelivery, WebhookEndpoint
from notifications.services.notify import notify
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import ed25519_key

pytestmark = pytest.mark.django_db

API_PREFIXES = ("api/", "compat/vast/")


def _walk(patterns, prefix=""):
    for entry in patterns:
        if isinstance(entry, URLResolver):
            yield from _walk(entry.url_patterns, prefix + str(entry.pattern))
        elif isinstance(entry, URLPattern):
            yield prefix + str(entry.pattern), entry


def _sample_path(route: str) -> str:
    """A concrete path for a route: its parameters filled with a value each converter accepts."""
    route = re.sub(r"\(\?P<[a-z_]+>[^)]*\)", "1", route)
    route = re.sub(r"<(?:[a-z_]+:)?([a-z_]+)>", "1", route)
    route = route.replace("^", "").replace("$", "").replace("\\Z", "")
    return "/" + route.replace("\\", "")


def _api_patterns():
    for route, pattern in _walk(get_resolver().url_patterns):
        if route.startswith(API_PREFIXES):
            yield route, pattern


def _view_class(pattern: URLPattern):
    return getattr(pattern.callback, "cls", None) or getattr(pattern.callback, "view_class", None)


def test_every_drf_view_declares_a_scope_rule():
    undeclared, not_drf = [], []
    for route, pattern in _walk(get_resolver().url_patterns):
        cls = _view_class(pattern)
        is_drf = isinstance(cls, type) and issubclass(cls, APIView)
        if route.startswith(API_PREFIXES) and not is_drf:
            not_drf.append(route)
        if is_drf and not is_rule(getattr(cls, "api_scope", None)):
            undeclared.append(f"{route} ({cls.__module__}.{cls.__name__})")
    assert not undeclared, f"API views without an `api_scope` (core/api/scopes.py): {undeclared}"
    assert not not_drf, f"paths under the API that are not DRF views (no scope check): {not_drf}"


def _key(user, scopes, **kwargs) -> str:
    return api_key_create(user=user, name="-".join(scopes), scopes=scopes, **kwargs)[1]


def _client(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def _scoped_routes():
    """(route, sample path, rule) of every API path whose view authenticates keys."""
    seen = set()
    for route, pattern in _api_patterns():
        cls = _view_class(pattern)
        if not cls.authentication_classes:  # sign-up, log-in, the Stripe webhook: no key is ever read
            continue
        path = _sample_path(route)
        if path not in seen and path != "/compat/vast/":
            seen.add(path)
            yield pytest.param(path, getattr(cls, "api_scope", None), id=path)


@pytest.mark.parametrize(("path", "rule"), list(_scoped_routes()))
def test_a_read_only_key_cannot_write_anywhere(path, rule):
    client = _client(_key(UserFactory(), [READ]))
    reads = read_methods_of(getattr(resolve(path).func, "cls", None))  # a POST that only reads (Vast search)
    for method in ("post", "put", "patch", "delete"):
        r = getattr(client, method)(path, {}, format="json")
        if method.upper() in reads:
            assert r.status_code != 403, (method, path, r.content[:300])
            continue
        assert r.status_code == 403, (method, path, r.status_code, r.content[:300])
        body = r.json()
        text = body.get("detail") or body.get("msg")
        assert "scopes (read)" in text and method.upper() in text and ("`renter`" in text or "`provider`" in text), text


@pytest.mark.parametrize(("path", "rule"), [p for p in _scoped_routes() if isinstance(p.values[1], tuple)])
def test_a_key_without_the_views_scope_is_refused_naming_it(path, rule):
    other = {(RENTER,): [PROVIDER], (PROVIDER,): [RENTER]}.get(rule)
    if other is None:  # renter or provider: a key with either passes; none is missing
        return
    client = _client(_key(UserFactory(), other))
    r = client.get(path)
    assert r.status_code == 403, (path, r.status_code, r.content[:300])
    body = r.json()
    text = body.get("detail") or body.get("msg")
    assert f"`{rule[0]}`" in text and "`read`" in text, text


def test_every_view_declared_public_answers_an_anonymous_get():
    """A PUBLIC scope is a promise: GET /api/v1/ declared it and kept DRF's IsAuthenticated (found by review)."""
    refused = []
    for route, pattern in _api_patterns():
        cls = _view_class(pattern)
        if getattr(cls, "api_scope", None) != PUBLIC or "get" not in getattr(cls, "http_method_names", ()):
            continue
        path = _sample_path(route)
        status = APIClient().get(path).status_code
        if status in (401, 403):
            refused.append(f"{path}: {status}")
    assert not refused, refused


def test_the_rules_are_the_ones_published():
    rules = {_sample_path(route): _view_class(p).api_scope for route, p in _api_patterns()}
    assert rules["/api/v1/instances/"] == (RENTER,)
    assert rules["/api/v1/ssh-keys/1/"] == (RENTER,)
    assert rules["/api/v1/billing/balance/"] == (RENTER,)
    assert rules["/api/v1/billing/top-ups/"] == (RENTER,)
    assert rules["/api/v1/nodes/"] == (PROVIDER,)
    assert rules["/api/v1/nodes/1/benchmarks/"] == (PROVIDER,)
    assert rules["/api/v1/billing/earnings/"] == (PROVIDER,)
    assert rules["/api/v1/billing/payouts/"] == (PROVIDER,)
    assert rules["/compat/vast/api/v0/machines/"] == (PROVIDER,)
    assert rules["/compat/vast/api/v1/instances/"] == (RENTER,)
    assert rules["/api/v1/auth/me/"] == ANY and rules["/api/v1/offers/"] == PUBLIC


# --- what each scope can do, end to end ----------------------------------------------------------------------

def test_each_scope_does_its_own_part():
    ed25519_public_key = ed25519_key()
    user = UserFactory()
    read, renter, provider = (_client(_key(user, [s])) for s in (READ, RENTER, PROVIDER))
    for client in (read, renter, provider):
        assert client.get("/api/v1/auth/me/").status_code == 200
        assert client.get("/api/v1/offers/").status_code == 200  # public
    assert read.get("/api/v1/instances/").status_code == 200
    assert read.get("/api/v1/nodes/").status_code == 200
    assert read.get("/api/v1/billing/earnings/").status_code == 200
    assert renter.get("/api/v1/instances/").status_code == 200
    assert renter.post("/api/v1/ssh-keys/", {"public_key": ed25519_public_key}, format="json").status_code == 201
    assert renter.get("/api/v1/nodes/").status_code == 403
    assert renter.get("/api/v1/billing/earnings/").status_code == 403
    assert provider.get("/api/v1/nodes/").status_code == 200
    assert provider.get("/api/v1/billing/payouts/").status_code == 200
    assert provider.get("/api/v1/instances/").status_code == 403
    assert provider.get("/api/v1/billing/balance/").status_code == 403
    refused = read.post("/api/v1/ssh-keys/", {"public_key": ed25519_public_key}, format="json")
    assert refused.status_code == 403
    assert refused.json()["detail"].startswith("This API key's scopes (read) do not allow POST here: it needs the "
                                               "`renter` scope.")


def test_compat_views_check_scopes_too():
    user = UserFactory()
    provider = _client(_key(user, [PROVIDER]))
    renter = _client(_key(user, [RENTER]))
    r = provider.get("/compat/vast/api/v1/instances/")
    assert r.status_code == 403 and "`renter`" in r.json()["msg"]
    assert renter.get("/compat/vast/api/v1/instances/").status_code == 200
    assert renter.get("/compat/vast/api/v0/machines/").status_code == 403
    assert provider.get("/compat/vast/api/v0/machines/").status_code == 200


def test_keys_made_without_scopes_and_before_scopes_existed_may_do_everything():
    key, raw = api_key_create(user=UserFactory(), name="old")
    assert key.scopes == list(ALL_SCOPES) and key.expires_at is None
    field = ApiKey._meta.get_field("scopes")
    assert field.get_default() == list(ALL_SCOPES)  # what the migration gave existing keys
    client = _client(raw)
    assert client.get("/api/v1/nodes/").status_code == 200
    assert client.get("/api/v1/instances/").status_code == 200


# --- expiry ----------------------------------------------------------------------------------------------------

def test_an_expired_key_is_a_401_that_says_so():
    user = UserFactory()
    key, raw = api_key_create(user=user, name="short", expires_at=timezone.now() + timedelta(hours=1))
    client = _client(raw)
    assert client.get("/api/v1/auth/me/").status_code == 200
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    r = client.get("/api/v1/auth/me/")
    assert r.status_code == 401 and "expired" in r.json()["detail"] and r["WWW-Authenticate"].startswith("Bearer")
    r = client.get("/compat/vast/api/v0/users/current/")
    assert r.status_code == 401 and "expired" in r.json()["msg"]


# --- making keys through the API --------------------------------------------------------------------------------

def test_create_a_scoped_expiring_key_and_see_it_listed():
    user = UserFactory()
    client = _client(_key(user, list(ALL_SCOPES)))
    expires = (timezone.now() + timedelta(days=30)).replace(microsecond=0)
    r = client.post("/api/v1/api-keys/", {"name": "ci", "scopes": ["provider", "read"],
                                          "expires_at": expires.isoformat()}, format="json")
    assert r.status_code == 201, r.content
    made = r.json()
    assert made["scopes"] == ["read", "provider"] and made["expired"] is False and made["key"].startswith("gpm_")
    listed = {k["id"]: k for k in client.get("/api/v1/api-keys/").json()["results"]}
    assert listed[made["id"]]["scopes"] == ["read", "provider"]
    assert listed[made["id"]]["expires_at"].startswith(expires.strftime("%Y-%m-%dT%H:%M"))
    assert "key" not in listed[made["id"]]
    new = _client(made["key"])
    assert new.get("/api/v1/nodes/").status_code == 200 and new.get("/api/v1/instances/").status_code == 200
    assert new.post("/api/v1/ssh-keys/", {}, format="json").status_code == 403


@pytest.mark.parametrize(("body", "field"), [
    ({"scopes": ["admin"]}, "scopes"),
    ({"scopes": []}, "scopes"),
    ({"scopes": "read"}, "scopes"),
    ({"expires_at": "2000-01-01T00:00:00Z"}, "expires_at"),
    ({"expires_at": "tomorrow"}, "expires_at"),
])
def test_bad_scopes_and_expiry_are_a_400_naming_the_field(body, field):
    client = _client(_key(UserFactory(), list(ALL_SCOPES)))
    r = client.post("/api/v1/api-keys/", body, format="json")
    assert r.status_code == 400 and field in r.json(), r.content
    assert ApiKey.objects.count() == 1


def test_a_key_cannot_make_a_key_that_may_do_more_or_live_longer():
    user = UserFactory()
    renter = _client(_key(user, [RENTER]))
    r = renter.post("/api/v1/api-keys/", {"scopes": ["renter", "provider"]}, format="json")
    assert r.status_code == 403 and "provider" in r.json()["detail"]
    assert renter.post("/api/v1/api-keys/", {"scopes": ["renter"]}, format="json").status_code == 201
    soon = timezone.now() + timedelta(days=1)
    expiring = _client(_key(user, list(ALL_SCOPES), expires_at=soon))
    assert expiring.post("/api/v1/api-keys/", {}, format="json").status_code == 403
    later = (soon + timedelta(days=1)).isoformat()
    assert expiring.post("/api/v1/api-keys/", {"expires_at": later}, format="json").status_code == 403
    earlier = (soon - timedelta(hours=1)).isoformat()
    assert expiring.post("/api/v1/api-keys/", {"expires_at": earlier}, format="json").status_code == 201


def test_a_key_revokes_only_keys_within_its_own_scopes_and_itself():
    """As a key makes no key with scopes it lacks, it revokes none: a renter key (a training script's) revoked the
    account's provider keys, stopping its hosting automation. A read key revokes no other key, but itself it does
    (test_a_read_key_revokes_itself below; this test said once that it could not, as the code did, against the
    published API)."""
    user = UserFactory()
    renter_raw = _key(user, [RENTER])
    _key(user, [PROVIDER])
    reader_raw = _key(user, [READ])
    provider, reader = (ApiKey.objects.get(user=user, name=name) for name in ("provider", "read"))
    r = _client(reader_raw).delete(f"/api/v1/api-keys/{provider.pk}/")
    assert r.status_code == 403 and "scopes (read)" in r.json()["detail"], r.content
    r = _client(renter_raw).delete(f"/api/v1/api-keys/{provider.pk}/")
    assert r.status_code == 403 and "scopes it does not have itself (provider)" in r.json()["detail"]
    provider.refresh_from_db()
    assert provider.revoked_at is None
    wide_raw = _key(user, [READ, RENTER])
    assert _client(wide_raw).delete(f"/api/v1/api-keys/{reader.pk}/").status_code == 204  # within its scopes
    wide = ApiKey.objects.get(user=user, name="read-renter")
    assert _client(wide_raw).delete(f"/api/v1/api-keys/{wide.pk}/").status_code == 204  # itself
    assert _client(_key(user, list(ALL_SCOPES))).delete(f"/api/v1/api-keys/{provider.pk}/").status_code == 204


def test_a_read_key_revokes_itself():
    """The docs (the 403 of DELETE /api/v1/api-keys/{id}/, api_key_revoke) say a key can always revoke itself, the
    first thing to do with a leaked key: a `read` key's DELETE of itself was a 403 telling its finder to make a
    renter key first (review r49)."""
    user = UserFactory()
    raw = _key(user, [READ])
    key = ApiKey.objects.get(user=user, name="read")
    other = ApiKey.objects.get(pk=api_key_create(user=user, name="other", scopes=[READ])[0].pk)
    reader = _client(raw)
    for path in (f"/api/v1/api-keys/{other.pk}/", "/api/v1/api-keys/x/", "/api/v1/api-keys/99999999999999999999/"):
        r = reader.delete(path)  # another key, even one as narrow: still refused, before the view
        assert r.status_code == 403 and "scopes (read)" in r.json()["detail"], (path, r.content)
    r = reader.post("/api/v1/api-keys/", {"scopes": ["read"]}, format="json")  # and no other write either
    assert r.status_code == 403, r.content
    other.refresh_from_db()
    assert other.revoked_at is None
    assert reader.delete(f"/api/v1/api-keys/{key.pk}/").status_code == 204
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert reader.get("/api/v1/api-keys/").status_code == 401  # revoked: it works no more
    # Another user's key named by a read key is refused as before (its value is not that key's).
    stranger_key = api_key_create(user=UserFactory(), name="s", scopes=[READ])[0]
    assert _client(_key(user, [READ])).delete(f"/api/v1/api-keys/{stranger_key.pk}/").status_code == 403


# --- rows of one role read with a key of the other (review r55 LOW-1) ---------------------------------------------
# The walk above proves a key lacking a view's scope is refused; it cannot see a view open to any key (ANY, or
# renter-or-provider) whose rows belong to one role. Every such path that answers a GET is listed here: with the
# way its rows are told apart (seeded below, one row of each role, and read with a key of each single scope), or
# with why its answer is not per role. A new one fails test_every_get_open_to_both_roles_is_classified.

def _tags_of_notices(rows):
    return {r["payload"]["tag"] for r in rows}


def _tags_of_deliveries(rows):
    return {json.loads(r["body"])["data"]["tag"] for r in rows}


def _tags_of_endpoints(rows):
    return {r["description"] for r in rows}


def _tags_of_events(rows):
    return {r["data"]["tag"] for r in rows}


ROLE_ROWS = {
    "/api/v1/notifications/": _tags_of_notices,
    "/api/v1/webhook-deliveries/": _tags_of_deliveries,
    "/api/v1/webhook-endpoints/": _tags_of_endpoints,
    "/api/v1/billing/events/": _tags_of_events,
}
ROLE_DETAILS = {  # one row of a list above: its view's queryset, the list's (a hidden row is a 404)
    "/api/v1/notifications/1/": "/api/v1/notifications/",
    "/api/v1/webhook-deliveries/1/": "/api/v1/webhook-deliveries/",
    "/api/v1/webhook-endpoints/1/": "/api/v1/webhook-endpoints/",
}
ROLE_COUNTS = ("/api/v1/notifications/unread-count/",)  # counts the list's rows (checked below)
NOT_PER_ROLE = {
    "/api/v1/auth/me/": "the account itself",
    "/api/v1/api-keys/": "the account's keys (a key makes and revokes keys within its own scopes only)",
    "/api/v1/billing/profile/": "the account's billing settings; changing each needs its role's scope",
    "/api/v1/billing/refunds/": "operators' only",
    "/api/v1/notification-preferences/": "channels per event kind: no event's content",
    "/api/v1/notification-preferences/1/": "channels per event kind: no event's content",
    "/compat/vast/api/v0/users/current/": "the account; its balance is blanked for a key without renter (compat)",
    "/compat/vast/api/v0/users/current": "the account; its balance is blanked for a key without renter (compat)",
}


def _gets_open_to_both_roles():
    for route, pattern in _api_patterns():
        cls = _view_class(pattern)
        if getattr(cls, "api_scope", None) not in (ANY, RENTER_OR_PROVIDER):
            continue
        actions = getattr(pattern.callback, "actions", None)
        if (actions is not None and "get" in actions) or (actions is None and hasattr(cls, "get")):
            yield _sample_path(route)


def test_every_get_open_to_both_roles_is_classified():
    classified = set(ROLE_ROWS) | set(ROLE_DETAILS) | set(ROLE_COUNTS) | set(NOT_PER_ROLE)
    unclassified = sorted(set(_gets_open_to_both_roles()) - classified)
    assert not unclassified, (f"GETs open to renter and provider keys alike, whose rows nobody said are per role or "
                              f"not: {unclassified}")


def _seed_rows_of_each_role(user):
    """Rows tagged "renter", "provider", "account" (every key's) and, of endpoints, "both" (receiving both roles'
    events: listed to a key that may read both only), on every list of ROLE_ROWS."""
    for tag, scopes in (("renter", [RENTER]), ("provider", [PROVIDER]), ("both", list(ALL_SCOPES))):
        endpoint = WebhookEndpoint(user=user, url="https://hooks.example.com/in", secret_encrypted=b"x",
                                   secret_hint="whsec_ab", description=tag)
        endpoint.scopes = scopes  # as the key that added it had them
        endpoint.save()
    earnings = {"account": AccountKind.PROVIDER_EARNINGS}
    for n, (kind, payload, tag) in enumerate([
            (Kind.LOW_BALANCE, {"balance": "3.21"}, "renter"),
            (Kind.CREDIT_POSTED, {"amount": "5.000000"}, "renter"),  # to the wallet
            (Kind.INSTANCE_RUNNING, {"instance": 1}, "renter"),
            (Kind.PAYOUT_SENT, {"payout": 1, "amount": "1234.56"}, "provider"),
            (Kind.CREDIT_REVERSED, {**earnings, "amount": "2.000000"}, "provider"),
            (Kind.NODE_OFFLINE, {"node": 1}, "provider"),
            (Kind.ACCOUNT_REACTIVATED, {}, "account")]):
        notify(user=user, kind=kind, payload={**payload, "tag": tag}, dedupe_key=f"r55:{n}")
    for kind, data, tag in [(EventKind.LOW_BALANCE, {}, "renter"), (EventKind.CREDIT, {}, "renter"),
                            (EventKind.TOP_UP_SUCCEEDED, {}, "renter"), (EventKind.PAYOUT_PAID, {}, "provider"),
                            (EventKind.PAYOUT_FAILED, {}, "provider"), (EventKind.CREDIT, earnings, "provider")]:
        event_create(user=user, kind=kind, message=kind, data={**data, "tag": tag})


def _visible(tags, roles):
    both = {RENTER, PROVIDER}
    return {t for t in tags if t == "account" or ({t} if t != "both" else both) <= roles}


SINGLE_AND_WIDE_KEYS = [([RENTER], {RENTER}), ([PROVIDER], {PROVIDER}), ([READ], {RENTER, PROVIDER}),
                        ([READ, PROVIDER], {RENTER, PROVIDER}), (list(ALL_SCOPES), {RENTER, PROVIDER})]


@pytest.mark.parametrize("path", sorted(ROLE_ROWS))
@pytest.mark.parametrize(("scopes", "roles"), SINGLE_AND_WIDE_KEYS, ids=["-".join(k) for k, _ in SINGLE_AND_WIDE_KEYS])
def test_a_key_lists_the_rows_of_its_own_roles_only(path, scopes, roles):
    user = UserFactory()
    _seed_rows_of_each_role(user)
    session = APIClient()
    session.force_login(user)
    everything = ROLE_ROWS[path](session.get(path).json()["results"])  # a browser session is not scoped
    assert {"renter", "provider"} <= everything, (path, everything)
    r = _client(_key(user, scopes)).get(path)
    assert r.status_code == 200, (path, r.content[:300])
    assert ROLE_ROWS[path](r.json()["results"]) == _visible(everything, roles), (path, scopes)


ROW_TAGS = {  # each detail path's rows, with the tag _seed_rows_of_each_role gave them
    "/api/v1/notifications/1/": lambda: {n.pk: n.payload["tag"] for n in Notification.objects.all()},
    "/api/v1/webhook-deliveries/1/": lambda: {d.pk: d.notification.payload["tag"]
                                              for d in WebhookDelivery.objects.select_related("notification")},
    "/api/v1/webhook-endpoints/1/": lambda: {e.pk: e.description for e in WebhookEndpoint.objects.all()},
}


@pytest.mark.parametrize(("scopes", "roles"), SINGLE_AND_WIDE_KEYS, ids=["-".join(k) for k, _ in SINGLE_AND_WIDE_KEYS])
def test_a_keys_unread_count_and_row_reads_keep_to_its_roles(scopes, roles):
    user = UserFactory()
    _seed_rows_of_each_role(user)
    client = _client(_key(user, scopes))
    tags = ROW_TAGS["/api/v1/notifications/1/"]()
    unread = sum(1 for tag in tags.values() if _visible({tag}, roles))
    assert 0 < unread and client.get("/api/v1/notifications/unread-count/").json() == {"unread": unread}
    assert set(ROW_TAGS) == set(ROLE_DETAILS)
    for detail, rows in ROW_TAGS.items():
        for pk, tag in rows().items():
            status = client.get(detail.replace("/1/", f"/{pk}/")).status_code
            assert status == (200 if _visible({tag}, roles) else 404), (detail, tag, status)
