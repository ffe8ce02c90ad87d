"""Sign-up, login, the current user, API keys, and throttling of the auth endpoints."""
import hashlib
import re

import pytest
from django.conf import settings
from django.db import connection
from rest_framework.throttling import ScopedRateThrottle

from marketplace.models import ApiKey, User
from tests.factories import UserFactory, api_key_for

pytestmark = pytest.mark.django_db

REGISTER = "/api/v1/auth/register/"
LOGIN = "/api/v1/auth/login/"
CONFIRM = "/api/v1/auth/confirm/"
ME = "/api/v1/auth/me/"
KEYS = "/api/v1/api-keys/"
PASSWORD = "correct horse battery staple"  # what UserFactory sets
GOOD_PASSWORD = "a long enough pass 42"


def bearer(client, key):
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def stored_anywhere(text: str) -> list[str]:
    """The tables of the whole database with a row whose text form contains `text`."""
    hits = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f'SELECT count(*) FROM "{table}" AS t WHERE t::text LIKE %s', [f"%{text}%"])  # noqa: S608
            if cursor.fetchone()[0]:
                hits.append(table)
    return hits


# --- register ---------------------------------------------------------------------------------------------------

def signup_token(mailoutbox, email: str) -> str:
    """The token of the last sign-up e-mail sent to `email`."""
    message = [m for m in mailoutbox if m.to == [email]][-1]
    return re.search(r"^The token: (\S+)$", message.body, re.M).group(1)


def test_register_sends_a_token_that_creates_the_account_and_a_working_key(anon, mailoutbox):
    r = anon.post(REGISTER, {"email": "New.User@Example.COM", "password": GOOD_PASSWORD})
    assert r.status_code == 202, r.content
    assert set(r.json()) == {"detail"} and "e-mail" in r.json()["detail"]
    assert not User.objects.exists()  # nothing until the address's owner confirms
    token = signup_token(mailoutbox, "new.user@example.com")
    assert GOOD_PASSWORD not in mailoutbox[-1].body and "/accounts/confirm/" in mailoutbox[-1].body

    r = anon.post(CONFIRM, {"token": token, "password": GOOD_PASSWORD})
    assert r.status_code == 201, r.content
    body = r.json()
    assert body["user"]["email"] == "new.user@example.com"
    assert body["user"]["is_staff"] is False
    assert "password" not in body["user"]
    assert body["key"]["prefix"] == body["api_key"][:12]
    user = User.objects.get(email="new.user@example.com")
    assert user.check_password(GOOD_PASSWORD)
    assert bearer(anon, body["api_key"]).get(ME).json()["email"] == "new.user@example.com"
    # A token works once.
    assert anon.post(CONFIRM, {"token": token, "password": GOOD_PASSWORD}).status_code == 400
    assert User.objects.count() == 1 and ApiKey.objects.count() == 1


def test_a_sign_up_token_for_the_longest_address_fits_the_confirm_forms():
    """The token carries the address: written as \\u escapes, a long address of non-ASCII characters with a
    production password hash (PBKDF2) made a token longer than SIGNUP_TOKEN_MAX_LENGTH, which the page's and the
    API's confirm refuse: such an account could never be confirmed (found by review)."""
    from django.contrib.auth.hashers import PBKDF2PasswordHasher

    from marketplace.services import accounts
    from marketplace.validators import EMAIL_MAX_LENGTH, SIGNUP_TOKEN_MAX_LENGTH

    password_hash = PBKDF2PasswordHasher().encode("a long enough pass 42x", PBKDF2PasswordHasher().salt())
    for character in ("a", "é", "漢", "\U0001f600"):  # 1 to 4 bytes in UTF-8
        email = ("x@" + character * EMAIL_MAX_LENGTH)[:EMAIL_MAX_LENGTH]
        token = accounts._signup_token(email=email, password_hash=password_hash)
        assert len(token) <= SIGNUP_TOKEN_MAX_LENGTH, (character, len(token))
        assert accounts._signup_payload(token)["email"] == email


@pytest.mark.parametrize("token", ["", "garbage", "gAAAAABnot-a-real-token==", "x" * 2001])
def test_confirm_refuses_a_bad_token(anon, token):
    r = anon.post(CONFIRM, {"token": token, "password": GOOD_PASSWORD})
    assert r.status_code == 400
    assert "token" in r.json()
    assert not User.objects.exists()


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"email": "weak@example.com", "password": "short"}, "password"),
        ({"email": "weak@example.com", "password": "1234567890123"}, "password"),  # numeric only
        ({"email": "weak@example.com", "password": "password1234"}, "password"),  # common
        ({"email": "similar.person@example.com", "password": "similar.person"}, "password"),
        ({"email": "not-an-email", "password": GOOD_PASSWORD}, "email"),
        ({"email": "a@b@example.com", "password": GOOD_PASSWORD}, "email"),
        ({"email": "", "password": GOOD_PASSWORD}, "email"),
        ({"password": GOOD_PASSWORD}, "email"),
        ({"email": "x@example.com"}, "password"),
        ({"email": 42, "password": GOOD_PASSWORD}, "email"),
        ({"email": "x@example.com", "password": GOOD_PASSWORD, "is_staff": True}, "is_staff"),
    ],
    ids=["too-short", "numeric", "common", "like-the-email", "invalid-email", "two-ats", "empty-email",
         "no-email", "no-password", "email-not-a-string", "unknown-field"],
)
def test_register_rejects_bad_input_and_writes_nothing(anon, mailoutbox, payload, field):
    r = anon.post(REGISTER, payload)
    assert r.status_code == 400
    assert field in r.json()
    assert User.objects.count() == 0
    assert ApiKey.objects.count() == 0
    assert mailoutbox == []


def test_register_with_a_taken_email_answers_as_for_a_new_one_and_tells_only_the_owner(anon, mailoutbox):
    UserFactory(email="taken@example.com")
    taken = anon.post(REGISTER, {"email": "Taken@Example.com", "password": GOOD_PASSWORD})
    new = anon.post(REGISTER, {"email": "free@example.com", "password": GOOD_PASSWORD})
    assert taken.status_code == new.status_code == 202
    assert taken.json() == new.json()
    assert User.objects.count() == 1
    note = [m for m in mailoutbox if m.to == ["taken@example.com"]][-1]
    assert "already has one" in note.body and "token" not in note.body.lower()
    assert User.objects.get(email="taken@example.com").check_password(PASSWORD)  # unchanged


# --- login ------------------------------------------------------------------------------------------------------

def test_login_replaces_the_key_of_its_name(anon):
    user = UserFactory(email="me@example.com")
    first = anon.post(LOGIN, {"email": "ME@example.com", "password": PASSWORD})
    second = anon.post(LOGIN, {"email": "me@example.com", "password": PASSWORD})
    assert first.status_code == second.status_code == 200
    assert first.json()["user"]["id"] == user.pk
    assert first.json()["api_key"] != second.json()["api_key"]
    assert first.json()["key"]["name"] == "login" and first.json()["replaced_keys"] == []
    assert [k["id"] for k in second.json()["replaced_keys"]] == [first.json()["key"]["id"]]
    assert user.api_keys.active().count() == 1
    assert bearer(anon, first.json()["api_key"]).get(ME).status_code == 401  # replaced: revoked
    assert bearer(anon, second.json()["api_key"]).get(ME).json()["id"] == user.pk


@pytest.mark.parametrize(
    "credentials",
    [
        {"email": "me@example.com", "password": "wrong password here"},
        {"email": "nobody@example.com", "password": PASSWORD},
    ],
    ids=["wrong-password", "unknown-email"],
)
def test_login_failure_is_a_400_that_does_not_tell_which_part_was_wrong(anon, credentials):
    UserFactory(email="me@example.com")
    r = anon.post(LOGIN, credentials)
    assert r.status_code == 400
    assert r.json() == {"detail": ["Invalid email or password."]}
    assert ApiKey.objects.count() == 0


def test_login_of_a_deactivated_account_fails(anon):
    UserFactory(email="gone@example.com", is_active=False)
    assert anon.post(LOGIN, {"email": "gone@example.com", "password": PASSWORD}).status_code == 400


def test_login_names_missing_fields(anon):
    r = anon.post(LOGIN, {})
    assert r.status_code == 400
    assert set(r.json()) == {"email", "password"}


# --- throttling -------------------------------------------------------------------------------------------------

def _auth_rate_limit() -> int:
    rate = settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]["auth"]
    assert ScopedRateThrottle.THROTTLE_RATES["auth"] == rate
    num_requests, _duration = ScopedRateThrottle().parse_rate(rate)
    return num_requests


def test_auth_endpoints_are_throttled_after_the_configured_rate(anon):
    UserFactory(email="me@example.com")
    limit = _auth_rate_limit()
    for n in range(limit):  # a new email each time: the per-account lock-out (test_login_hardening) stays out
        assert anon.post(LOGIN, {"email": f"me{n}@example.com", "password": "guessing again"}).status_code == 400
    r = anon.post(LOGIN, {"email": "me@example.com", "password": PASSWORD})
    assert r.status_code == 429
    assert "detail" in r.json()
    assert int(r.headers["Retry-After"]) > 0
    # Register shares the budget: guessing cannot move to the other endpoint.
    assert anon.post(REGISTER, {"email": "new@example.com", "password": GOOD_PASSWORD}).status_code == 429
    assert anon.post(CONFIRM, {"token": "anything", "password": GOOD_PASSWORD}).status_code == 429


def test_other_endpoints_are_not_throttled_by_the_auth_rate(api):
    for _ in range(_auth_rate_limit() + 1):
        assert api.get(ME).status_code == 200


# --- me ---------------------------------------------------------------------------------------------------------

def test_me_shows_the_key_owner(api, user):
    r = api.get(ME)
    assert r.status_code == 200
    assert r.json() == {"id": user.pk, "email": user.email, "email_verified": True, "is_staff": False,
                        "date_joined": r.json()["date_joined"]}


@pytest.mark.parametrize(
    "header",
    [None, "Bearer", "Bearer gpm_doesnotexist", "Bearer two parts", "Token abc"],
    ids=["none", "no-key", "unknown-key", "extra-part", "other-scheme"],
)
def test_me_without_a_valid_key_is_401(anon, header):
    if header:
        anon.credentials(HTTP_AUTHORIZATION=header)
    r = anon.get(ME)
    assert r.status_code == 401
    assert "detail" in r.json()
    assert r.headers["WWW-Authenticate"].startswith("Bearer")


def test_me_of_a_deactivated_user_is_401(anon):
    user = UserFactory()
    key = api_key_for(user)
    User.objects.filter(pk=user.pk).update(is_active=False)
    assert bearer(anon, key).get(ME).status_code == 401


# --- API keys ---------------------------------------------------------------------------------------------------

def test_create_key_shows_it_once_and_stores_only_its_sha256(api, user):
    r = api.post(KEYS, {"name": "laptop"})
    assert r.status_code == 201, r.content
    body = r.json()
    raw = body["key"]
    assert raw.startswith("gpm_") and len(raw) > 40
    assert body["prefix"] == raw[:12] and body["name"] == "laptop" and body["last_used_at"] is None

    stored = ApiKey.objects.get(pk=body["id"])
    assert stored.key_hash == hashlib.sha256(raw.encode()).hexdigest()
    assert stored_anywhere(raw) == []
    assert stored_anywhere(raw[12:]) == []  # not even the secret part

    listed = api.get(KEYS).json()["results"]
    assert {k["id"] for k in listed} == set(user.api_keys.values_list("id", flat=True))
    assert all("key" not in k and "key_hash" not in k for k in listed)
    assert raw not in str(listed)


def test_every_answer_that_shows_a_new_key_says_no_store(anon, api, mailoutbox):
    """The key is in that answer only: no browser, proxy or client cache may keep it (as the key pages and the
    webhook endpoint API say)."""
    anon.post(REGISTER, {"email": "fresh@example.com", "password": GOOD_PASSWORD})
    confirmed = anon.post(CONFIRM, {"token": signup_token(mailoutbox, "fresh@example.com"), "password": GOOD_PASSWORD})
    logged_in = anon.post(LOGIN, {"email": "fresh@example.com", "password": GOOD_PASSWORD})
    made = api.post(KEYS, {"name": "ci"})
    for r, status in ((confirmed, 201), (logged_in, 200), (made, 201)):
        assert r.status_code == status and r.json().get("api_key", r.json().get("key", "")).startswith("gpm_")
        assert r["Cache-Control"] == "no-store", (r.request["PATH_INFO"], r.get("Cache-Control"))


def test_an_account_holds_at_most_the_configured_number_of_keys(anon, api, user, settings):
    settings.API_KEYS_PER_USER_MAX = 3  # the key `api` is authenticated with is one of them
    assert [api.post(KEYS, {"name": f"k{i}"}).status_code for i in range(2)] == [201, 201]
    refused = api.post(KEYS, {"name": "one too many"})
    assert refused.status_code == 409 and "3 API keys" in refused.json()["detail"], refused.content
    assert "DELETE /api/v1/api-keys/{id}/" in refused.json()["detail"]
    assert not ApiKey.objects.filter(name="one too many").exists() and user.api_keys.active().count() == 3
    # a log-in with a key name of its own is refused the same way; one that replaces its name's key is not
    assert anon.post(LOGIN, {"email": user.email, "password": PASSWORD, "key_name": "laptop"}).status_code == 409
    assert anon.post(LOGIN, {"email": user.email, "password": PASSWORD, "key_name": "k0"}).status_code == 200
    revoke = next(k["id"] for k in api.get(KEYS).json()["results"] if k["name"] == "k1")  # not the one in use
    assert api.delete(f"{KEYS}{revoke}/").status_code == 204
    assert api.post(KEYS, {"name": "room again"}).status_code == 201
    assert user.api_keys.active().count() == 3


def test_a_new_key_works_and_records_its_last_use(anon, api):
    raw = api.post(KEYS, {}).json()["key"]
    key = ApiKey.objects.get(prefix=raw[:12])
    assert key.last_used_at is None
    assert bearer(anon, raw).get(ME).status_code == 200
    key.refresh_from_db()
    assert key.last_used_at is not None


def test_list_keys_shows_only_your_active_keys(api, user):
    other = UserFactory()
    api_key_for(other)
    revoked = ApiKey.objects.get(pk=api.post(KEYS, {"name": "old"}).json()["id"])
    api.delete(f"{KEYS}{revoked.pk}/")
    ids = {k["id"] for k in api.get(KEYS).json()["results"]}
    assert ids == set(user.api_keys.filter(revoked_at__isnull=True).values_list("id", flat=True))
    assert revoked.pk not in ids and not ids & set(other.api_keys.values_list("id", flat=True))


def test_revoked_key_gets_401(anon, api):
    created = api.post(KEYS, {"name": "ci"}).json()
    assert api.delete(f"{KEYS}{created['id']}/").status_code == 204
    assert ApiKey.objects.get(pk=created["id"]).revoked_at is not None
    r = bearer(anon, created["key"]).get(ME)
    assert r.status_code == 401
    assert api.get(ME).status_code == 200  # the caller's own key is untouched


def test_revoking_the_key_in_use_locks_that_key_out(api):
    own = api.get(KEYS).json()["results"][0]["id"]
    assert api.delete(f"{KEYS}{own}/").status_code == 204
    assert api.get(ME).status_code == 401


def test_another_users_key_is_404_and_stays_valid(anon, api):
    victim = UserFactory()
    victim_raw = api_key_for(victim)
    victim_key = victim.api_keys.get()
    r = api.delete(f"{KEYS}{victim_key.pk}/")
    assert r.status_code == 404
    assert r.json() == api.delete(f"{KEYS}999999999/").json()  # indistinguishable from a key that does not exist
    victim_key.refresh_from_db()
    assert victim_key.revoked_at is None
    assert bearer(anon, victim_raw).get(ME).status_code == 200


@pytest.mark.parametrize("key_id", ["999999999", "abc", "1.5"])
def test_deleting_a_key_that_does_not_exist_is_a_json_404(api, key_id):
    r = api.delete(f"{KEYS}{key_id}/")
    assert r.status_code == 404
    assert r.headers["Content-Type"] == "application/json"
    assert "detail" in r.json()


def test_deleting_an_already_revoked_key_is_404(api):
    key_id = api.post(KEYS, {}).json()["id"]
    assert api.delete(f"{KEYS}{key_id}/").status_code == 204
    assert api.delete(f"{KEYS}{key_id}/").status_code == 404


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"name": "x" * 101}, "name"),
        ({"name": "bad\x00name"}, "name"),
        ({"name": "line\nbreak"}, "name"),
        ({"name": 7}, "name"),
        ({"name": "ok", "key": "gpm_chosen_by_me"}, "key"),
        ({"name": "ok", "expires": "never"}, "expires"),
    ],
    ids=["too-long", "nul", "newline", "not-a-string", "read-only-key", "unknown-field"],
)
def test_create_key_rejects_bad_input(api, user, payload, field):
    before = ApiKey.objects.count()
    r = api.post(KEYS, payload)
    assert r.status_code == 400
    assert field in r.json()
    assert ApiKey.objects.count() == before


@pytest.mark.parametrize(("method", "path"), [("get", KEYS), ("post", KEYS), ("delete", f"{KEYS}1/")])
def test_api_keys_need_authentication(anon, method, path):
    assert getattr(anon, method)(path).status_code == 401
