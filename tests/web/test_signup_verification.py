"""E-mail verification before renting or listing, end to end through the file e-mail backend the demo uses: an
account exists only once the link e-mailed to its address comes back, so whoever rents or lists has proven the
address. A bad, expired or spent link says so and creates nothing."""
import re
from pathlib import Path

import pytest
from django.test import Client
from rest_framework.test import APIClient

from marketplace.models import ApiKey, Instance, User
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import ed25519_key

pytestmark = pytest.mark.django_db

EMAIL = "verify.me@example.com"
PASSWORD = "a long passphrase 42"
INVALID = "This link is invalid, has expired, or was used already."


@pytest.fixture
def inbox(settings, tmp_path) -> Path:
    settings.EMAIL_BACKEND = "django.core.mail.backends.filebased.EmailBackend"
    settings.EMAIL_FILE_PATH = str(tmp_path)
    return tmp_path


def _sign_up(client: Client, inbox: Path) -> str:
    """Sign up on the page and read the confirmation link (its path) from the newest file in the inbox."""
    r = client.post("/accounts/signup/", {"email": EMAIL, "password": PASSWORD})
    assert r.status_code == 200 and "Check your e-mail" in r.content.decode()
    newest = max(inbox.iterdir(), key=lambda p: p.stat().st_mtime_ns)
    mail = newest.read_text()
    assert f"To: {EMAIL}" in mail
    return re.search(r"http://testserver(/accounts/confirm/[^/\s]+/)", mail).group(1)


def _rent(raw_key: str, node):
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_key}")
    return api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                           "ssh_public_key": ed25519_key()}, format="json")


def test_no_account_before_the_link_and_renting_works_after_it(client, inbox):
    node = make_listed_node()
    path = _sign_up(client, inbox)
    # Until the link comes back there is no account: nothing can log in, rent or list.
    assert not User.objects.filter(email=EMAIL).exists()
    assert APIClient().post("/api/v1/auth/login/", {"email": EMAIL, "password": PASSWORD},
                            format="json").status_code == 400

    page = client.get(path)  # a mail scanner opening the link uses nothing up
    assert page.status_code == 200 and not User.objects.filter(email=EMAIL).exists()
    token = re.search(r'name="token" value="([^"]+)"', page.content.decode()).group(1)
    done = client.post(path, {"token": token, "password": PASSWORD})
    raw = re.search(r'id="api-key">([^<]+)<', done.content.decode()).group(1)
    assert done.status_code == 200 and User.objects.get(email=EMAIL).email_verified_at is not None

    r = _rent(raw, node)
    assert r.status_code == 201, r.content
    assert Instance.objects.get(pk=r.json()["id"]).renter.email == EMAIL
    assert client.get("/instances/").status_code == 200  # the link logged the browser in


def _refused(client: Client, path: str, token: str) -> None:
    r = client.post(path, {"token": token, "password": PASSWORD})
    assert r.status_code == 400 and INVALID in r.content.decode()


def test_a_changed_token_is_refused_and_creates_nothing(client, inbox):
    path = _sign_up(client, inbox)
    token = path.split("/")[-2]
    forged = token[:-5] + ("A" if token[-5] != "A" else "B") + token[-4:]
    _refused(client, path, forged)
    _refused(client, path, "not-a-token")
    assert not User.objects.exists() and not ApiKey.objects.exists()


def test_an_expired_link_is_refused_and_creates_nothing(client, inbox, settings):
    path = _sign_up(client, inbox)
    settings.SIGNUP_CONFIRM_TTL_S = -1  # issued longer ago than the links last
    _refused(client, path, path.split("/")[-2])
    assert not User.objects.exists()


def test_a_link_works_once_and_a_second_sign_up_gets_no_new_link(client, inbox):
    path = _sign_up(client, inbox)
    token = path.split("/")[-2]
    assert client.post(path, {"token": token, "password": PASSWORD}).status_code == 200
    user = User.objects.get(email=EMAIL)
    password_hash = user.password
    _refused(Client(), path, token)
    # Signing up again with the address now taken e-mails its owner a note, never a link that could change it.
    other = Client()
    other.post("/accounts/signup/", {"email": EMAIL, "password": "another passphrase 99"})
    newest = max(inbox.iterdir(), key=lambda p: p.stat().st_mtime_ns).read_text()
    assert "already has one" in newest.replace("=\n", "") and "/accounts/confirm/" not in newest
    user.refresh_from_db()
    assert user.password == password_hash and ApiKey.objects.filter(user=user).count() == 1
