"""Every e-mail the platform sends a user about an event follows their notification preference for it (found by
review): the billing events e-mailed straight from billing.services.notify.event_create (a zero balance, a destroy
warning, a chargeback, a failed payout, a price change, an instance resumed to `starting`, ...) went whatever the
user chose. Now each billing event kind has the preference that covers it (EMAIL_PREFERENCE: the notice's kind
for the same event where there is one, else the new billing_notice kind), and a notice's e-mail whose preference
was turned off before it was sent is not sent.

The kinds are enumerated, so a kind added later without a preference check fails here. The mails that always go
(no preference; not tested here): sign-up, password reset and change, e-mail verification, the security changes of
core.security_mail, an account's deactivation and reactivation (ALWAYS_ON_KINDS)."""
import re
from decimal import Decimal

import pytest
from django.core import mail
from django.test import Client

from billing.models import BillingEvent, EventKind
from billing.services.enforcement import balances_enforce
from billing.services.ledger import credit_grant, ledger_reverse
from billing.services.notify import ALWAYS_EMAILED, EMAIL_PREFERENCE, event_create
from marketplace.models import Instance
from marketplace.money import usd_to_micros
from marketplace.services import instances as instance_svc
from notifications.models import (
    ALWAYS_ON_KINDS,
    EMAIL_ONLY_KINDS,
    PREFERENCE_KINDS,
    EmailStatus,
    Kind,
    Notification,
    WebhookDelivery,
)
from notifications.services import notify as svc
from notifications.services import webhooks
from provisioning.services.fleet_record import node_record_health
from tests.billing.helpers import node, running
from tests.factories import UserFactory, user_without_address

from .conftest import run_queued

pytestmark = pytest.mark.django_db

NOTICE_KINDS = [k for k in PREFERENCE_KINDS if k not in EMAIL_ONLY_KINDS]


def _all_off(user, *, but: str | None = None) -> None:
    """E-mail off for every kind a user can choose (`but` on)."""
    for kind in PREFERENCE_KINDS:
        svc.preference_set(user=user, kind=kind, in_app=True, email=kind == but, webhook=True)


def test_every_kind_is_either_chosen_by_the_user_or_always_told():
    """A new kind is a preference kind unless it is added, with its reason, to ALWAYS_ON_KINDS (models.py)."""
    assert set(ALWAYS_ON_KINDS) == {Kind.TEST, Kind.ACCOUNT_DEACTIVATED, Kind.ACCOUNT_REACTIVATED}
    assert set(PREFERENCE_KINDS) | set(ALWAYS_ON_KINDS) == set(Kind)
    assert set(EMAIL_ONLY_KINDS) <= set(PREFERENCE_KINDS)


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
@pytest.mark.parametrize("kind", NOTICE_KINDS)
def test_every_notice_kind_follows_each_channel_of_its_preference(kind, on, owner, receiver, queued,
                                                                   django_capture_on_commit_callbacks):
    webhooks.endpoint_create(user=owner, url=receiver.url)
    other = Kind.LOW_BALANCE if kind != Kind.LOW_BALANCE else Kind.CREDIT_POSTED
    svc.preference_set(user=owner, kind=other, in_app=not on, email=not on, webhook=not on)  # no bearing
    svc.preference_set(user=owner, kind=kind, in_app=on, email=on, webhook=on)
    with django_capture_on_commit_callbacks(execute=True):
        notice = svc.notify(user=owner, kind=kind, payload={"message": "It happened."}, dedupe_key=f"r47:{kind}")
    assert notice is not None
    run_queued(queued)
    notice.refresh_from_db()
    assert notice.in_app is on
    assert notice.email_status == (EmailStatus.SENT if on else EmailStatus.NONE)
    assert len(mail.outbox) == (1 if on else 0)
    assert WebhookDelivery.objects.filter(notification=notice).count() == (1 if on else 0)
    assert len(receiver.requests) == (1 if on else 0)


@pytest.mark.parametrize("kind", NOTICE_KINDS)
def test_a_notice_e_mail_turned_off_before_it_is_sent_is_not_sent(kind, owner, queued,
                                                                  django_capture_on_commit_callbacks):
    """A retry an hour later, a backlog: the user's choice when it is sent decides (before, it went)."""
    with django_capture_on_commit_callbacks(execute=True):
        notice = svc.notify(user=owner, kind=kind, payload={}, dedupe_key=f"r47-late:{kind}")
    assert notice is not None and notice.email_status == EmailStatus.PENDING
    svc.preference_change(user=owner, kind=kind, channels={"email": False})
    run_queued(queued)
    notice.refresh_from_db()
    assert mail.outbox == [] and notice.email_status == EmailStatus.FAILED
    assert "turned off" in notice.email_error


def test_an_e_mail_only_kind_is_never_a_notice(owner):
    for kind in EMAIL_ONLY_KINDS:
        with pytest.raises(ValueError, match="only e-mailed"):
            svc.notify(user=owner, kind=kind, payload={}, dedupe_key="r47:only")
    assert not Notification.objects.exists()


def test_every_billing_event_kind_has_the_preference_that_covers_its_e_mail():
    assert set(EMAIL_PREFERENCE) == set(EventKind)
    assert set(EMAIL_PREFERENCE.values()) <= set(PREFERENCE_KINDS)
    # The same event told by a notice is e-mailed as that notice's kind is.
    assert EMAIL_PREFERENCE[EventKind.INSTANCE_RESUMED] == Kind.INSTANCE_RUNNING
    assert EMAIL_PREFERENCE[EventKind.BALANCE_DEPLETED] == Kind.BILLING_NOTICE


@pytest.mark.parametrize("kind", [k for k in EventKind if k not in ALWAYS_EMAILED])
def test_no_billing_event_is_e_mailed_with_every_e_mail_turned_off(kind, owner,
                                                                    django_capture_on_commit_callbacks):
    """Without reading EMAIL_PREFERENCE: fails on the old code for every kind."""
    _all_off(owner)
    with django_capture_on_commit_callbacks(execute=True):
        event = event_create(user=owner, kind=kind, message="It happened.", email=True)
    assert mail.outbox == [] and not event.emailed


def test_the_last_warning_before_a_destroy_is_e_mailed_whatever_the_preferences(owner,
                                                                              django_capture_on_commit_callbacks):
    """The one billing e-mail that ignores the preferences: the warning that instances and disks will be destroyed
    for an unpaid balance (data lost cannot be brought back)."""
    assert ALWAYS_EMAILED == {EventKind.DESTROY_WARNING}
    _all_off(owner)
    with django_capture_on_commit_callbacks(execute=True):
        event = event_create(user=owner, kind=EventKind.DESTROY_WARNING, message="Destroyed tomorrow.", email=True)
        quiet = event_create(user=owner, kind=EventKind.DESTROY_WARNING, message="Only recorded.")
    assert [m.body for m in mail.outbox] == ["Destroyed tomorrow."] and event.emailed and not quiet.emailed


@pytest.mark.parametrize("on", [True, False], ids=["on", "off"])
@pytest.mark.parametrize("kind", [k for k in EventKind if k not in ALWAYS_EMAILED])
def test_each_billing_event_follows_the_e_mail_choice_of_its_preference(kind, on, owner,
                                                                       django_capture_on_commit_callbacks):
    covering = EMAIL_PREFERENCE[kind]
    if on:
        _all_off(owner, but=covering)  # only its own preference on: it alone decides
    else:
        svc.preference_set(user=owner, kind=covering, in_app=True, email=False, webhook=True)
    with django_capture_on_commit_callbacks(execute=True):
        event = event_create(user=owner, kind=kind, message="It happened.", email=True)
        quiet = event_create(user=owner, kind=kind, message="Only recorded.")  # email=False: never sent
    assert len(mail.outbox) == (1 if on else 0) and event.emailed is on and not quiet.emailed
    if on:
        assert mail.outbox[0].to == [owner.email] and mail.outbox[0].body == "It happened."


def test_a_billing_event_for_a_user_without_an_address_is_not_e_mailed(django_capture_on_commit_callbacks):
    user = user_without_address()
    with django_capture_on_commit_callbacks(execute=True):
        event = event_create(user=user, kind=EventKind.CHARGEBACK, message="x", email=True)
    assert mail.outbox == [] and not event.emailed


# -------------------------------------------------------------------------------------- the two bugs, end to end


def _fund(user, usd: str):
    txn, _ = credit_grant(user=user, amount_micros=usd_to_micros(Decimal(usd)), reason="test funds")
    return txn


@pytest.mark.parametrize("email", [True, False], ids=["on", "off"])
def test_the_zero_balance_stop_is_e_mailed_only_as_the_renter_chose(email, django_capture_on_commit_callbacks,
                                                                     monkeypatch):
    """Before, "Your balance reached zero" went to a renter who had turned billing notices' e-mail off."""
    monkeypatch.setattr("core.dispatch.send", lambda *a, **k: None)  # the jobs' and notices' tasks: not run
    renter = UserFactory()
    svc.preference_set(user=renter, kind=Kind.BILLING_NOTICE, in_app=True, email=email, webhook=True)
    funds = _fund(renter, "10.00")
    instance = running(renter, node("1.000000"))
    ledger_reverse(txn=funds, reason="credited by mistake")  # the balance at or below zero
    mail.outbox.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert balances_enforce().depleted == 1
    assert Instance.objects.get(pk=instance.pk).status == "stopping"
    depleted = BillingEvent.objects.get(user=renter, kind=EventKind.BALANCE_DEPLETED)
    assert depleted.emailed is email
    assert len([m for m in mail.outbox if "Your balance reached zero" in m.subject]) == (1 if email else 0)


@pytest.mark.parametrize("email", [True, False], ids=["on", "off"])
@pytest.mark.parametrize("vm_running", [True, False], ids=["to-running", "to-starting"])
def test_a_resumed_instance_is_e_mailed_only_as_the_renter_chose(email, vm_running, settings, monkeypatch,
                                                                 django_capture_on_commit_callbacks):
    """An interrupted instance whose server is back: resumed to `running` it was told by the INSTANCE_RUNNING
    notice (as chosen); to `starting` (the VM stopped, started again) "Your instance is running again" was
    e-mailed straight to the renter whatever they chose. Both now follow the INSTANCE_RUNNING preference."""
    sent: list[tuple] = []
    monkeypatch.setattr("core.dispatch.send", lambda name, *args, task_id=None: sent.append((name, args)))
    renter = UserFactory()
    svc.preference_set(user=renter, kind=Kind.INSTANCE_RUNNING, in_app=True, email=email, webhook=True)
    _fund(renter, "50.00")
    host = node("1.000000")
    instance = running(renter, host)
    for _ in range(settings.NODE_INTERRUPT_AFTER_FAILED_CHECKS):
        node_record_health(node_id=host.pk, ok=False, error="timed out")
    assert Instance.objects.get(pk=instance.pk).status == "interrupted"
    node_record_health(node_id=host.pk, ok=True)
    mail.outbox.clear()
    sent.clear()
    resume = instance_svc.instance_resume if vm_running else instance_svc.instance_restart_interrupted
    with django_capture_on_commit_callbacks(execute=True):
        assert resume(instance_id=instance.pk) is not None
    assert Instance.objects.get(pk=instance.pk).status == ("running" if vm_running else "starting")
    run_queued([s for s in sent if s[0] == "notifications.tasks.email_send"])
    resumed = BillingEvent.objects.get(user=renter, kind=EventKind.INSTANCE_RESUMED)
    assert len(mail.outbox) == (1 if email else 0), [m.subject for m in mail.outbox]
    if not vm_running:
        assert resumed.emailed is email


def test_the_settings_page_offers_only_the_e_mail_box_of_an_e_mail_only_kind_and_saves_it(owner,
                                                                                        django_capture_on_commit_callbacks):
    web = Client()
    web.force_login(owner)
    page = "/account/notifications/settings/"
    html = web.get(page).content.decode()
    form = re.search(r'<form method="post">(.*?)</form>', html, re.S).group(1)
    boxes = re.findall(r'<input type="checkbox" name="([^"]+)"', form)
    assert "billing_notice:email" in boxes
    assert "billing_notice:in_app" not in boxes and "billing_notice:webhook" not in boxes
    assert {b.split(":")[0] for b in boxes} == {k.value for k in PREFERENCE_KINDS}
    fields = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form))
    fields.update({name: "on" for name in re.findall(r'<input type="checkbox" name="([^"]+)"[^>]* checked>', form)})
    del fields["billing_notice:email"]  # unticked
    assert web.post(page, fields).status_code == 302
    assert svc.channels_for(user_id=owner.pk, kind=Kind.BILLING_NOTICE)[1] is False
    with django_capture_on_commit_callbacks(execute=True):
        event_create(user=owner, kind=EventKind.INSTANCES_DESTROYED, message="Soon.", email=True)
    assert mail.outbox == []
