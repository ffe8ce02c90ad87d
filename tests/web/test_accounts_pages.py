"""Home, sign-up, log in, SSH keys and API keys pages: permissions, input kept on errors, CSRF, no secrets."""
import re

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from django.contrib.staticfiles import finders
from django.test import Client

from marketplace.models import ApiKey, SshKey, User
from marketplace.services.accounts import api_key_create, hash_api_key
from tests.marketplace.renting_helpers import add_key, ed25519_key
from tests.web.conftest import PASSWORD, logged_in

pytestmark = pytest.mark.django_db


def test_home_links_the_main_pages(client, web):
    anon = client.get("/").content.decode()
    assert 'href="/offers/"' in anon and 'href="/accounts/signup/"' in anon and 'href="/instances/"' not in anon
    page = web.get("/").content.decode()
    for url in ("/offers/", "/gpus/", "/instances/", "/nodes/", "/account/ssh-keys/", "/account/api-keys/"):
        assert f'href="{url}"' in page
    assert '<main id="main"' in page and 'aria-label="Main"' in page  # landmarks


def test_every_page_links_the_stylesheet_and_script(client):
    page = client.get("/offers/").content.decode()
    assert "/static/marketplace/site.css" in page and "/static/marketplace/site.js" in page
    # Served by whitenoise from STATIC_ROOT after collectstatic (scripts/release); found by the finders here.
    assert finders.find("marketplace/site.css") and finders.find("marketplace/site.js")


def test_signup_keeps_the_email_and_explains_the_password(client):
    r = client.post("/accounts/signup/", {"email": "New@Example.com", "password": "short"})
    assert r.status_code == 400
    page = r.content.decode()
    assert 'value="New@Example.com"' in page
    assert re.search(r'<input[^>]*name="password"[^>]*aria-invalid="true"', page)
    assert "id_password_errors" in page and "too short" in page
    assert not User.objects.exists()


def test_signup_shows_the_api_key_once_and_logs_in(client, mailoutbox):
    r = client.post("/accounts/signup/", {"email": "new@example.com", "password": "a long passphrase 42"})
    assert r.status_code == 200 and "Check your e-mail" in r.content.decode()
    link = re.search(r"http://testserver(/accounts/confirm/([^/\s]+)/)", mailoutbox[-1].body)
    r = client.post(link.group(1), {"token": link.group(2), "password": "a long passphrase 42"})
    assert r.status_code == 200 and r["Cache-Control"] == "no-store"
    raw = re.search(r'id="api-key">([^<]+)<', r.content.decode()).group(1)
    user = User.objects.get(email="new@example.com")
    assert ApiKey.objects.get(user=user).key_hash == hash_api_key(raw)
    assert client.get("/instances/").status_code == 200  # logged in
    assert raw not in client.get("/account/api-keys/").content.decode()


def test_signup_and_login_refuse_posts_without_csrf_token():
    client = Client(enforce_csrf_checks=True)
    assert client.post("/accounts/signup/", {"email": "x@example.com", "password": "a long passphrase 42"}
                       ).status_code == 403
    assert client.post("/accounts/login/", {"username": "x@example.com", "password": "x"}).status_code == 403


def test_login_keeps_the_email_on_a_wrong_password(client, renter):
    r = client.post("/accounts/login/", {"username": "Renter@example.com", "password": "wrong"})
    page = r.content.decode()
    assert 'value="Renter@example.com"' in page and "errorlist" in page  # as typed
    r = client.post("/accounts/login/?next=/instances/",
                    {"username": "renter@example.com", "password": "correct horse battery staple",
                     "next": "/instances/"})
    assert r.status_code == 302 and r["Location"] == "/instances/"


@pytest.mark.parametrize("url", ["/account/ssh-keys/", "/account/api-keys/", "/instances/", "/nodes/",
                                 "/nodes/new/"])
def test_private_pages_send_anonymous_visitors_to_log_in(client, url):
    r = client.get(url)
    assert r.status_code == 302 and r["Location"].startswith("/accounts/login/?next=")


# ------------------------------------------------------------------------------------------- SSH keys

def test_ssh_key_is_added_and_listed_with_its_fingerprint(web, renter):
    r = web.post("/account/ssh-keys/", {"name": "laptop", "public_key": ed25519_key("me@laptop"),
                                          "password": PASSWORD})
    assert r.status_code == 302
    key = SshKey.objects.get(user=renter)
    page = web.get("/account/ssh-keys/").content.decode()
    assert "laptop" in page and key.fingerprint in page and "ssh-ed25519" in page


def test_a_bad_ssh_key_is_explained_next_to_the_field_and_kept(web):
    r = web.post("/account/ssh-keys/", {"name": "mine", "public_key": "ssh-ed25519 notbase64!",
                                          "password": PASSWORD})
    assert r.status_code == 400
    page = r.content.decode()
    assert 'value="mine"' in page and "ssh-ed25519 notbase64!</textarea>" in page
    assert 'id="id_public_key_errors"' in page and "not valid base64" in page
    assert re.search(r'<textarea[^>]*aria-invalid="true"', page)


def test_a_pasted_private_key_is_refused_and_never_shown_back(web):
    private = ed25519.Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()).decode()
    r = web.post("/account/ssh-keys/", {"name": "oops", "public_key": private, "password": PASSWORD})
    page = r.content.decode()
    assert r.status_code == 400 and "private key" in page
    body = private.splitlines()[1]
    assert body not in page and "BEGIN OPENSSH PRIVATE KEY" not in page
    assert not SshKey.objects.exists()


PUTTY_PRIVATE = """PuTTY-User-Key-File-3: ssh-ed25519
Encryption: none
Comment: eddsa-key-20240101
Public-Lines: 2
AAAAC3NzaC1lZDI1NTE5AAAAIDCgjUi5tZWZ1E2u7rHq1wJ0d3BBXo9r8JmYv1y1
cI8r
Private-Lines: 1
AAAAIFSECRETSECRETSECRETSECRETSECRETSECRETSECRET0000
Private-MAC: 8e2b7f1c0f2f0c6f7b5d6f6a3a0d2e1b9c8d7e6f5a4b3c2d1e0f9a8b7c6d5e4f
"""


def test_a_pasted_putty_private_key_is_refused_as_one_never_shown_back_and_the_page_says_how_to_export(web):
    r = web.post("/account/ssh-keys/", {"name": "oops", "public_key": PUTTY_PRIVATE, "password": PASSWORD})
    page = r.content.decode()
    assert r.status_code == 400 and "SECRETSECRET" not in page and "Private-MAC" not in page
    assert "PuTTY private key" in page and "PuTTYgen" in page  # not "several lines": what to do instead
    assert not SshKey.objects.exists()


def test_the_same_key_twice_is_explained(web, renter):
    key = ed25519_key()
    assert web.post("/account/ssh-keys/", {"name": "a", "public_key": key, "password": PASSWORD}).status_code == 302
    r = web.post("/account/ssh-keys/", {"name": "b", "public_key": key, "password": PASSWORD})
    assert r.status_code == 400 and "already added this key" in r.content.decode()


def test_an_ssh_key_is_saved_only_with_the_password(web, renter):
    """A saved key opens every instance rented later: a session alone (a copied cookie) adds none."""
    key = ed25519_key("thief@host")
    for password, said in (("", "This field is required"), ("not it", "Your password was entered incorrectly")):
        r = web.post("/account/ssh-keys/", {"name": "x", "public_key": key, "password": password})
        page = r.content.decode()
        assert r.status_code == 400 and said in page and 'id="id_password_errors"' in page
        assert "thief@host" in page and "value=" not in re.findall(r'<input[^>]*name="password"[^>]*', page)[0]
    assert not SshKey.objects.filter(user=renter).exists()


def test_the_ssh_key_page_is_behind_the_log_in_lock_out(web, renter, settings):
    settings.LOGIN_FAILURES_PER_ACCOUNT = 2
    for _ in range(2):
        web.post("/account/ssh-keys/", {"public_key": ed25519_key(), "password": "wrong"})
    r = web.post("/account/ssh-keys/", {"public_key": ed25519_key(), "password": PASSWORD})
    assert r.status_code == 429 and int(r["Retry-After"]) > 0
    assert not SshKey.objects.filter(user=renter).exists()


def test_ssh_key_delete_is_owner_only_and_needs_csrf(web, csrf_web, renter, stranger):
    mine, theirs = add_key(renter, "mine"), add_key(stranger, "theirs")
    assert web.post(f"/account/ssh-keys/{theirs.pk}/delete/").status_code == 404
    assert web.get(f"/account/ssh-keys/{mine.pk}/delete/").status_code == 405
    assert csrf_web.post(f"/account/ssh-keys/{mine.pk}/delete/").status_code == 403
    assert web.post(f"/account/ssh-keys/{mine.pk}/delete/").status_code == 302
    assert list(SshKey.objects.values_list("name", flat=True)) == ["theirs"]
    assert "theirs" not in web.get("/account/ssh-keys/").content.decode()


def test_ssh_key_form_needs_csrf(csrf_web):
    assert csrf_web.post("/account/ssh-keys/", {"public_key": ed25519_key()}).status_code == 403


# ------------------------------------------------------------------------------------------- API keys

def test_api_key_is_shown_once_and_its_hash_never(web, renter):
    r = web.post("/account/api-keys/", {"name": "ci", "scopes": ["read", "renter", "provider"], "expires_in_days": 0,
                                          "password": PASSWORD})
    page = r.content.decode()
    raw = re.search(r'id="new-key">([^<]+)<', page).group(1)
    key = ApiKey.objects.get(user=renter, name="ci")
    assert key.key_hash == hash_api_key(raw) and r["Cache-Control"] == "no-store"
    later = web.get("/account/api-keys/").content.decode()
    assert raw not in later and key.prefix in later and "ci" in later
    for text in (page, later):
        assert key.key_hash not in text


def test_api_key_revoke_is_owner_only_and_needs_csrf(web, csrf_web, renter, stranger):
    mine, _ = api_key_create(user=renter, name="mine")
    theirs, _ = api_key_create(user=stranger, name="theirs")
    assert web.post(f"/account/api-keys/{theirs.pk}/revoke/").status_code == 404
    assert csrf_web.post(f"/account/api-keys/{mine.pk}/revoke/").status_code == 403
    assert web.post(f"/account/api-keys/{mine.pk}/revoke/").status_code == 302
    mine.refresh_from_db()
    theirs.refresh_from_db()
    assert mine.revoked_at is not None and theirs.revoked_at is None
    assert "mine" not in web.get("/account/api-keys/").content.decode()


def test_api_key_name_with_control_characters_is_refused(web):
    r = web.post("/account/api-keys/", {"name": "bad\x07name"})
    assert r.status_code == 400 and "Control characters" in r.content.decode()


def test_logout_needs_a_post_with_csrf(renter):
    client = Client(enforce_csrf_checks=True)
    client.force_login(renter)
    assert client.post("/accounts/logout/").status_code == 403
    plain = logged_in(renter)
    assert plain.get("/accounts/logout/").status_code == 405
    assert plain.post("/accounts/logout/").status_code == 302
    assert plain.get("/instances/").status_code == 302
