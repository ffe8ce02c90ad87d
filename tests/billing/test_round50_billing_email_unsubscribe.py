"""Billing e-mails a user may turn off carry the one-click unsubscribe of the preference that covers them, as the
notices' e-mails do (faaf6e5 added it to those only): a low-balance e-mail's POST turns off low-balance e-mails, a
billing notice's the billing notices. The warning before an unpaid balance's instances are destroyed, e-mailed
whatever the preferences say, carries none: turning it off would not stop it."""
import re

import pytest
from django.core import mail
from django.test import Client

from billing.models import EventKind
from billing.services.notify import event_create
from notifications.models import Kind
from notifications.services import notify as notify_svc
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)  # the e-mail goes on commit


@pytest.fixture(autouse=True)
def site(settings):
    settings.SITE_URL = "https://gpus.example.com/"


@pytest.mark.parametrize(("event_kind", "preference"), [
    (EventKind.LOW_BALANCE, Kind.LOW_BALANCE),
    (EventKind.TOP_UP_FAILED, Kind.BILLING_NOTICE),
])
def test_a_billing_e_mail_unsubscribes_from_its_own_preference_in_one_click(event_kind, preference):
    user = UserFactory(email="renter@example.com")
    mail.outbox.clear()
    event_create(user=user, kind=event_kind, message="Your balance.", email=True)
    assert len(mail.outbox) == 1
    message = mail.outbox[0]
    assert message.extra_headers["List-Unsubscribe-Post"] == "List-Unsubscribe=One-Click"
    url = re.fullmatch(r"<https://gpus\.example\.com(/account/notifications/unsubscribe/[^/>]+/)>",
                       message.extra_headers["List-Unsubscribe"])
    assert url and url.group(1) in message.body
    assert notify_svc.channels_for(user_id=user.pk, kind=preference) == (True, True, True)
    assert Client(enforce_csrf_checks=True).post(url.group(1), {"List-Unsubscribe": "One-Click"}).status_code == 200
    assert notify_svc.channels_for(user_id=user.pk, kind=preference) == (True, False, True)  # e-mail only
    mail.outbox.clear()
    event_create(user=user, kind=event_kind, message="Again.", email=True)
    assert mail.outbox == []  # turned off


def test_the_always_sent_destroy_warning_carries_no_unsubscribe():
    user = UserFactory(email="renter@example.com")
    mail.outbox.clear()
    event_create(user=user, kind=EventKind.DESTROY_WARNING, message="Destroyed soon.", email=True)
    assert len(mail.outbox) == 1
    assert "List-Unsubscribe" not in mail.outbox[0].extra_headers
    assert "unsubscribe" not in mail.outbox[0].body
