"""Review r52 (provider finding 4): a provider who removed or changed their payout account while a payout was
pending (Stripe had not confirmed its transfer) was told "earnings stay here until you set one", by the page and
the e-mail, while the payout's next try pays the account it was made out to. That destination is kept (the first
transfer may have landed; the retry uses the same transfer group and Idempotency-Key): the page, its confirmation
and the e-mail now name each pending payout, its amount and the old account it goes to, and why."""
from datetime import date, timedelta

import pytest

from billing.models import PayoutStatus
from billing.services import payouts, profiles
from tests.billing.test_payouts_shown import _earn, _provider, connect  # noqa: F401 (connect: a fixture)
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

MONDAY = date(2026, 3, 9)  # the run for the week 2026-03-02 .. 2026-03-08
OLD = "acct_1OldAccount"
PASSWORD = "correct horse battery staple"  # tests.factories.UserFactory's


def _pending(clock, connect):  # noqa: F811 (the fixture)
    provider = _provider(account=OLD)
    _earn(clock, provider, hours=5)  # $42.50 after the fee
    connect.mode = "down"  # the transfer's outcome is not known: it stays pending, to be tried again
    [payout] = payouts.payouts_run(today=MONDAY)
    assert payout.status == PayoutStatus.PENDING and payout.destination == OLD
    connect.mode = "ok"
    return provider, payout


def test_the_e_mail_on_removal_names_the_pending_payout_and_its_old_account(
        clock, connect, mailoutbox, django_capture_on_commit_callbacks):  # noqa: F811 (the fixture)
    provider, payout = _pending(clock, connect)
    with django_capture_on_commit_callbacks(execute=True):
        profiles.profile_update(user=provider, changes=profiles.ProfileChanges(stripe_connect_account_id=""))
    (mail,) = mailoutbox
    body = " ".join(mail.body.split())
    assert f"from {OLD} to none" in body
    assert "(earnings stay on the platform until one is set)" not in body
    assert f"A payout of $42.50 (week 2026-03-02 to 2026-03-08) to {OLD} is still being sent there, to the account " \
           "it was made out to" in body and "could pay it twice" in body
    # What the e-mail says is what happens: the next try pays the account the payout was made out to.
    payouts.payouts_send_pending(now=clock.now + timedelta(days=1))
    payout.refresh_from_db()
    assert payout.status == PayoutStatus.PAID and [t["destination"] for t in connect.made] == [OLD]


def test_the_e_mail_on_a_change_names_it_too_and_without_one_says_earnings_stay(
        clock, connect, mailoutbox, django_capture_on_commit_callbacks):  # noqa: F811 (the fixture)
    provider, _ = _pending(clock, connect)
    with django_capture_on_commit_callbacks(execute=True):
        profiles.profile_update(user=provider,
                                changes=profiles.ProfileChanges(stripe_connect_account_id="acct_1NewAccount"))
    body = " ".join(mailoutbox[-1].body.split())
    assert f"from {OLD} to acct_1NewAccount" in body and f"$42.50 (week 2026-03-02 to 2026-03-08) to {OLD}" in body
    # A provider with no pending payout: the plain words, nothing of a payout.
    other = _provider(account="acct_1Other")
    with django_capture_on_commit_callbacks(execute=True):
        profiles.profile_update(user=other, changes=profiles.ProfileChanges(stripe_connect_account_id=""))
    body = " ".join(mailoutbox[-1].body.split())
    assert "(earnings stay on the platform until one is set)" in body and "still being sent" not in body


def test_the_page_and_its_confirmation_name_the_pending_payout(clock, connect):  # noqa: F811 (the fixture)
    provider, _ = _pending(clock, connect)
    web = logged_in(provider)
    page = web.post("/payouts/", {"stripe_connect_account_id": "", "password": PASSWORD}, follow=True)
    text = " ".join(page.content.decode().split())
    assert page.status_code == 200
    assert "earnings stay here until you set one" not in text
    assert "earnings not in a payout being sent stay here until you set one" in text
    assert f"A payout of $42.50 (week 2026-03-02 to 2026-03-08) to {OLD} is still being sent there" in text
    # The page itself, shown again later, says it too (above the form, and at the payout's row).
    text = " ".join(web.get("/payouts/").content.decode().split())
    assert 'id="pending-elsewhere"' in text and f"to {OLD}" in text
    assert "not your current account" in text

    web.post("/payouts/", {"stripe_connect_account_id": "acct_1NewAccount", "password": PASSWORD})
    text = " ".join(web.get("/payouts/").content.decode().split())
    assert 'id="pending-elsewhere"' in text and "not your current account" in text
    web.post("/payouts/", {"stripe_connect_account_id": OLD, "password": PASSWORD})  # back to it: nothing to say
    text = " ".join(web.get("/payouts/").content.decode().split())
    assert 'id="pending-elsewhere"' not in text and "not your current account" not in text


def test_removal_without_a_pending_payout_says_earnings_stay():
    provider = _provider(account=OLD)
    page = logged_in(provider).post("/payouts/", {"stripe_connect_account_id": "", "password": PASSWORD},
                                    follow=True)
    text = " ".join(page.content.decode().split())
    assert "Payout account removed: earnings stay here until you set one." in text and "still being sent" not in text
