"""Notification e-mails a user may turn off carry one-click unsubscribe headers (RFC 2369 List-Unsubscribe, RFC 8058
List-Unsubscribe-Post); before, none did. The URL is signed per user and kind: a POST with no log-in and no CSRF
token (the mail client's) turns off that kind's e-mails only; a GET shows a button and changes nothing; a bad,
tampered, expired or outdated token is a 400 page, nothing changed. The always-on kinds carry no header."""

import email
import re
from datetime import timedelta

import pytest
from django.core import mail, signing
from django.test import Client
from django.utils import timezone

from marketplace.models import User
from notifications.models import Kind, Preference
from notifications.services import email as email_svc
from notifications.services import notify as notify_svc
from notifications.services import unsubscribe as unsubscribe_svc
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

SITE = "https://gpus.example.com/"


@pytest.fixture(autouse=True)
def site(settings):
    settings.SITE_URL = SITE


@pytest.fixture
def owner(db):
    return UserFactory(email="owner@example.com")


def _emailed(user, kind=Kind.PAYOUT_SENT, key="k1"):
    notification = notify_svc.notify(user=user, kind=kind, dedupe_key=key, payload={"message": "Something."})
    assert notification is not None
    mail.outbox.clear()
    assert email_svc.notification_email_send(notification_id=notification.pk).sent
    assert len(mail.outbox) == 1
    return mail.outbox[0]


def _path(message) -> str:
    header = message.extra_headers["List-Unsubscribe"]
    match = re.fullmatch(r"<https://gpus\.example\.com(/account/notifications/unsubscribe/[^/>]+/)>", header)
    assert match, header
    return match.group(1)


def _channels(user, kind):
    return notify_svc.channels_for(user_id=user.pk, kind=kind)


def test_a_notification_e_mail_carries_the_one_click_headers_and_the_link_in_its_text(owner):
    message = _emailed(owner)
    assert message.extra_headers["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    path = _path(message)
    assert f"https://gpus.example.com{path}" in message.body
    # As the mail client sees it: the headers are in the message sent (a long one folded, RFC 5322).
    sent = email.message_from_string(message.message().as_string())
    assert re.sub(r"\s+", "", sent["List-Unsubscribe"]) == f"<https://gpus.example.com{path}>"
    assert sent["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"


def test_one_click_post_without_log_in_or_csrf_turns_off_only_that_kind_s_e_mails(owner):
    path = _path(_emailed(owner))
    client = Client(enforce_csrf_checks=True)
    r = client.post(path, {"List-Unsubscribe": "One-Click"})
    assert r.status_code == 200 and "no more e-mails" in r.content.decode()
    assert _channels(owner, Kind.PAYOUT_SENT) == (True, False, True)  # in-app and webhook as they were
    assert _channels(owner, Kind.NODE_OFFLINE) == (True, True, True)
    # Again: still off, nothing else changed.
    assert client.post(path, {"List-Unsubscribe": "One-Click"}).status_code == 200
    assert Preference.objects.filter(user=owner).count() == 1
    # And the next e-mail of that kind is not sent.
    notification = notify_svc.notify(user=owner, kind=Kind.PAYOUT_SENT, dedupe_key="k2", payload={})
    mail.outbox.clear()
    assert not email_svc.notification_email_send(notification_id=notification.pk).sent
    assert mail.outbox == []


def test_a_get_shows_a_button_and_changes_nothing(owner):
    path = _path(_emailed(owner))
    r = Client().get(path)
    page = r.content.decode()
    assert r.status_code == 200 and '<form method="post"' in page and "Payout sent" in page
    assert _channels(owner, Kind.PAYOUT_SENT) == (True, True, True)
    assert not Preference.objects.exists()


def test_other_channels_kept_as_the_user_set_them(owner):
    notify_svc.preference_set(user=owner, kind=Kind.NODE_OFFLINE, in_app=False, email=True, webhook=False)
    path = _path(_emailed(owner, kind=Kind.NODE_OFFLINE))
    assert Client().post(path).status_code == 200
    assert _channels(owner, Kind.NODE_OFFLINE) == (False, False, False)


def _refused(path):
    r = Client().post(path)
    assert r.status_code == 400 and "nothing was changed" in r.content.decode()
    r = Client().get(path)
    assert r.status_code == 400 and "<form" not in r.content.decode().split("<main", 1)[-1]


def test_a_tampered_bad_or_expired_token_is_a_400_and_changes_nothing(owner, settings):
    path = _path(_emailed(owner))
    token = path.rsplit("/", 2)[1]
    # Another kind in a payload signed by someone else.
    forged = signing.TimestampSigner(salt="another").sign_object({"u": owner.pk, "k": "node_offline", "a": ""})
    for bad in [token[:-1] + ("A" if token[-1] != "A" else "B"), "not-a-token", forged]:
        _refused(f"/account/notifications/unsubscribe/{bad}/")
    # Expired.
    old = timezone.now() - timedelta(seconds=unsubscribe_svc.MAX_AGE_S + 60)
    signer = signing.TimestampSigner(salt=unsubscribe_svc.SALT)
    signer.timestamp = lambda: signing.b62_encode(int(old.timestamp()))  # type: ignore[method-assign]
    expired = signer.sign_object({"u": owner.pk, "k": Kind.PAYOUT_SENT.value, "a": ""})
    _refused(f"/account/notifications/unsubscribe/{expired}/")
    # Signed with another SECRET_KEY.
    key = settings.SECRET_KEY
    settings.SECRET_KEY = "x" * 60
    other = unsubscribe_svc.unsubscribe_token(user=owner, kind=Kind.PAYOUT_SENT)
    settings.SECRET_KEY = key
    _refused(f"/account/notifications/unsubscribe/{other}/")
    assert not Preference.objects.exists()


def test_a_link_sent_to_an_address_changed_since_does_nothing(owner):
    path = _path(_emailed(owner))
    User.objects.filter(pk=owner.pk).update(email="new.owner@example.com", email_changed_at=timezone.now())
    _refused(path)
    assert not Preference.objects.exists()


@pytest.mark.parametrize("kind", [Kind.ACCOUNT_DEACTIVATED, Kind.ACCOUNT_REACTIVATED])
def test_always_on_kinds_carry_no_unsubscribe_header(owner, kind):
    message = _emailed(owner, kind=kind)
    assert "List-Unsubscribe" not in message.extra_headers
    assert "unsubscribe" not in message.body
    assert unsubscribe_svc.unsubscribe_headers(user=owner, kind=Kind.TEST) == {}


def test_without_a_site_url_there_is_no_header(owner, settings):
    settings.SITE_URL = ""
    message = _emailed(owner)
    assert "List-Unsubscribe" not in message.extra_headers


def test_the_mandatory_mails_carry_no_header(owner, mailoutbox):
    Client().post("/accounts/password/reset/", {"email": owner.email})
    assert mailoutbox and all("List-Unsubscribe" not in m.extra_headers for m in mailoutbox)
