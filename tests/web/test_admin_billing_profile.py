"""Setting a provider's payout account (found by review): profile_update judged auto top-up on every change, so
with auto top-up on and its amount now outside the top-up bounds (BILLING_TOP_UP_MIN_USD moved), setting only the
Stripe Connect account was refused: a 500 in the admin, a 400 naming the amount from the API. Auto top-up is judged
when a change moves it; what the service refuses is shown on the admin's form, nothing of it written."""
from decimal import Decimal

import pytest
from rest_framework.test import APIClient

from billing.models import BillingProfile, Card
from billing.services import profiles
from billing.services.customers import profile_for
from core.errors import ValidationFailed
from marketplace.services.accounts import api_key_create
from tests.web.conftest import logged_in
from tests.web.test_admin_pages import change_form

pytestmark = pytest.mark.django_db

PROFILE = "/api/v1/billing/profile/"


@pytest.fixture
def auto_top_up_out_of_bounds(renter, settings):
    """Auto top-up on at $20, then the minimum top-up raised to $50."""
    card = Card.objects.create(user=renter, stripe_payment_method_id="pm_bounds_1")
    profiles.profile_update(user=renter, changes=profiles.ProfileChanges(
        auto_top_up_enabled=True, auto_top_up_card_id=card.pk, auto_top_up_threshold_micros=5_000_000,
        auto_top_up_amount_micros=20_000_000))
    settings.BILLING_TOP_UP_MIN_USD = Decimal("50")
    return profile_for(user=renter)


def _url(profile: BillingProfile) -> str:
    return f"/admin/billing/billingprofile/{profile.pk}/change/"


def _stored(profile: BillingProfile) -> BillingProfile:
    return BillingProfile.objects.get(pk=profile.pk)


def test_an_operator_sets_the_payout_account_of_a_profile_whose_auto_top_up_is_out_of_bounds(
        operator, auto_top_up_out_of_bounds):
    profile = auto_top_up_out_of_bounds
    r = logged_in(operator).post(_url(profile), {"stripe_connect_account_id": "acct_ops1"})
    assert r.status_code == 302, r.content.decode()[:2000]
    stored = _stored(profile)
    assert stored.stripe_connect_account_id == "acct_ops1"
    assert (stored.auto_top_up_enabled, stored.auto_top_up_amount_micros) == (True, 20_000_000)  # left as it was


def test_what_the_service_refuses_is_shown_on_the_form_and_nothing_is_written(operator, renter, monkeypatch):
    profile = profile_for(user=renter)
    real = profiles.profile_update

    def written_then_refused(**kwargs):
        real(**kwargs)
        raise ValidationFailed("Refused for this test.", field="stripe_connect_account_id")

    monkeypatch.setattr(profiles, "profile_update", written_then_refused)
    r = logged_in(operator).post(_url(profile), {"stripe_connect_account_id": "acct_ops2"})
    assert r.status_code == 200 and "Refused for this test." in r.content.decode()
    assert _stored(profile).stripe_connect_account_id == ""


def _provider_api(user) -> APIClient:
    _, raw = api_key_create(user=user, name="payouts", scopes=["provider"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def test_the_api_sets_the_payout_account_whatever_auto_top_up_holds_and_judges_auto_top_up_when_it_moves(
        renter, auto_top_up_out_of_bounds):
    api = _provider_api(renter)
    r = api.patch(PROFILE, {"stripe_connect_account_id": "acct_mine"}, format="json")
    assert r.status_code == 200, r.content
    # Sent back as they are, the auto top-up settings are no change.
    r = api.patch(PROFILE, {"stripe_connect_account_id": "acct_mine2", "auto_top_up_enabled": True,
                            "auto_top_up_threshold": "5.00"}, format="json")
    assert r.status_code == 200, r.content
    assert _stored(auto_top_up_out_of_bounds).stripe_connect_account_id == "acct_mine2"
    # A change of auto top-up is judged whole: its amount is now out of bounds.
    with pytest.raises(ValidationFailed) as refused:
        profiles.profile_update(user=renter, changes=profiles.ProfileChanges(auto_top_up_threshold_micros=7_000_000))
    assert set(refused.value.errors) == {"auto_top_up_amount"}
    assert _stored(auto_top_up_out_of_bounds).auto_top_up_threshold_micros == 5_000_000


# ------------------------------------------------------------------ a page opened before the payouts moved
#
# The form compared the posted account with the profile as read at the save, not with what the page showed: a page
# opened on acct_OLD, saved unchanged after the provider moved its payouts to acct_NEW through the API, wrote acct_OLD
# back and e-mailed the owner "Your payout account was changed" (found by review). The page now sends the account it
# showed; an account that moved since is refused on the form, nothing saved, unless the page's value agrees with it.


def _payout_mails(mailoutbox) -> int:
    return sum(m.subject.endswith("Your payout account was changed") for m in mailoutbox)


def test_a_page_opened_before_the_provider_moved_its_payouts_does_not_write_the_old_account_back(
        operator, renter, mailoutbox, django_capture_on_commit_callbacks):
    def committed(call):  # the e-mail goes when the change commits
        with django_capture_on_commit_callbacks(execute=True):
            return call()

    def by_the_provider(account: str) -> None:
        committed(lambda: profiles.profile_update(
            user=renter, changes=profiles.ProfileChanges(stripe_connect_account_id=account)))

    by_the_provider("acct_OLD")
    profile, ops = profile_for(user=renter), logged_in(operator)
    data = change_form(ops, _url(profile), "billingprofile_form")
    assert data["stripe_connect_account_id"] == data["initial-stripe_connect_account_id"] == ["acct_OLD"]
    by_the_provider("acct_NEW")
    assert _payout_mails(mailoutbox) == 2
    r = committed(lambda: ops.post(_url(profile), data))  # Save, nothing changed
    assert r.status_code == 200, "refused"  # before: 302, acct_OLD written back and its owner told
    assert "Changed by someone else since you opened this page: it is “acct_NEW” now." in r.content.decode()
    assert _stored(profile).stripe_connect_account_id == "acct_NEW"
    assert _payout_mails(mailoutbox) == 2

    data["stripe_connect_account_id"] = ["acct_NEW"]  # a stale page that agrees: nothing to change, nobody told
    assert committed(lambda: ops.post(_url(profile), data)).status_code == 302
    assert _stored(profile).stripe_connect_account_id == "acct_NEW" and _payout_mails(mailoutbox) == 2

    data = change_form(ops, _url(profile), "billingprofile_form")  # opened again: the operator's change is made
    data["stripe_connect_account_id"] = ["acct_OPS"]
    assert committed(lambda: ops.post(_url(profile), data)).status_code == 302
    assert _stored(profile).stripe_connect_account_id == "acct_OPS" and _payout_mails(mailoutbox) == 3
