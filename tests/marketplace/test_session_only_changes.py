"""What a browser session alone (a copied cookie) cannot do, and what the account's address is told.

Making an API key outlives the session and a password change; a new payout account redirects the earnings;
turning two-factor on ends every other session (the owner's own, locking them out). Each needs the password (the
pages) or an API key (the API), and a change of the payout account or of two-factor is e-mailed to the address.
"""
import pytest
from django_otp.oath import totp
from rest_framework.test import APIClient

from billing.services import profiles
from billing.services.customers import profile_for
from marketplace.models import ApiKey
from marketplace.services import two_factor
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery staple"  # tests.factories.UserFactory's
KEYS = "/api/v1/api-keys/"
PROFILE = "/api/v1/billing/profile/"


def _session(user) -> APIClient:
    client = APIClient()
    client.force_login(user)
    return client


def test_a_browser_session_alone_makes_no_api_key(user, api):
    refused = _session(user).post(KEYS, {"name": "from a cookie"}, format="json")
    assert refused.status_code == 403 and "browser session alone cannot" in refused.json()["detail"]
    assert not ApiKey.objects.filter(user=user, name="from a cookie").exists()
    made = api.post(KEYS, {"name": "from a key"}, format="json")  # an API key may make another (as before)
    assert made.status_code == 201 and made.json()["key"]


def test_the_payout_account_is_changed_with_a_key_only_and_told_by_e_mail(user, api, mailoutbox,
                                                                         django_capture_on_commit_callbacks):
    refused = _session(user).patch(PROFILE, {"stripe_connect_account_id": "acct_thief"}, format="json")
    assert refused.status_code == 403 and "Payouts page" in refused.json()["detail"]
    assert api.get(PROFILE).json()["stripe_connect_account_id"] == "" and not mailoutbox
    # Other settings stay open to the session (auto top-up and the like): only where the money goes is guarded.
    assert _session(user).patch(PROFILE, {}, format="json").status_code == 200

    with django_capture_on_commit_callbacks(execute=True):
        done = api.patch(PROFILE, {"stripe_connect_account_id": "acct_mine"}, format="json")
    assert done.status_code == 200 and done.json()["stripe_connect_account_id"] == "acct_mine"
    (mail,) = mailoutbox
    assert mail.to == [user.email] and mail.subject.endswith("Your payout account was changed")
    assert "from none to acct_mine" in mail.body and "reset your password" in mail.body
    with django_capture_on_commit_callbacks(execute=True):  # the same account again: nothing changed, no e-mail
        profiles.profile_update(user=user, changes=profiles.ProfileChanges(stripe_connect_account_id="acct_mine"))
    assert len(mailoutbox) == 1


def test_two_factor_is_turned_on_with_the_password_and_told_by_e_mail(mailoutbox,
                                                                       django_capture_on_commit_callbacks):
    user = UserFactory()
    with pytest.raises(two_factor.WrongPassword):  # the secret is made and shown only for the password
        two_factor.totp_enrol_start(user=user, password="not it", client_address=None)
    assert two_factor.totp_confirmed(user=user) is None and not mailoutbox

    device = two_factor.totp_enrol_start(user=user, password=PASSWORD, client_address=None)
    with django_capture_on_commit_callbacks(execute=True):
        codes = two_factor.totp_enrol_confirm(user=user, device_id=device.pk, code=f"{totp(device.bin_key):06d}",
                                              client_address=None, base_url="https://gpu.example/")
    assert two_factor.two_factor_enabled(user=user) and len(codes) == two_factor.RECOVERY_CODES
    (on,) = mailoutbox
    assert on.subject.endswith("Two-factor log-in was turned on") and "https://gpu.example/" in on.body

    with django_capture_on_commit_callbacks(execute=True):
        two_factor.two_factor_disable(user=user)
    assert not two_factor.two_factor_enabled(user=user)
    assert mailoutbox[-1].subject.endswith("Two-factor log-in was turned off") and len(mailoutbox) == 2


def test_a_renter_only_key_cannot_redirect_the_payouts_and_an_unchanged_account_is_no_change(user, client_for):
    """Payouts are the provider scope's (found by review: a renter-only key changed them); sending back the
    account as it is, with other settings, is not refused from a session either."""
    from marketplace.services.accounts import api_key_create

    _, raw = api_key_create(user=user, name="renter only", scopes=["renter"])
    renter_only = APIClient()
    renter_only.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    refused = renter_only.patch(PROFILE, {"stripe_connect_account_id": "acct_thief"}, format="json")
    assert refused.status_code == 403 and "provider scope" in refused.json()["detail"]
    assert client_for(user).get(PROFILE).json()["stripe_connect_account_id"] == ""
    same = _session(user).patch(PROFILE, {"stripe_connect_account_id": "", "auto_top_up_enabled": False},
                                format="json")
    assert same.status_code == 200, same.content


def test_a_provider_only_key_cannot_turn_on_auto_top_up_which_charges_the_card(user, client_for):
    """Auto top-up charges a saved card, the renter scope's (found by review: a provider-only key turned it on).
    Sent back unchanged, as a client that PATCHes its whole settings does, it is no change and not refused."""
    from billing.models import Card
    from marketplace.services.accounts import api_key_create

    card = Card.objects.create(user=user, stripe_payment_method_id="pm_review_1")
    _, raw = api_key_create(user=user, name="provider only", scopes=["provider"])
    provider_only = APIClient()
    provider_only.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    turn_on = {"auto_top_up_enabled": True, "auto_top_up_card": card.pk, "auto_top_up_threshold": "10.00",
               "auto_top_up_amount": "500.00"}
    refused = provider_only.patch(PROFILE, turn_on, format="json")
    assert refused.status_code == 403 and "renter scope" in refused.json()["detail"]
    assert profile_for(user=user).auto_top_up_enabled is False
    assert client_for(user).patch(PROFILE, turn_on, format="json").status_code == 200  # an all-scope key
    assert provider_only.patch(PROFILE, {**turn_on, "stripe_connect_account_id": "acct_mine"},
                               format="json").status_code == 200


def test_an_operator_sets_a_payout_account_through_the_same_rules_and_the_owner_is_told(
        admin_client, user, mailoutbox, django_capture_on_commit_callbacks):
    from django.urls import reverse

    profile = profile_for(user=user)
    url = reverse("admin:billing_billingprofile_change", args=[profile.pk])
    bad = admin_client.post(url, {"stripe_connect_account_id": "not-an-acct id"})
    assert bad.status_code == 200 and profiles.CONNECT_ACCOUNT_MESSAGE in bad.content.decode()
    with django_capture_on_commit_callbacks(execute=True):
        done = admin_client.post(url, {"stripe_connect_account_id": "acct_ops1"})
    assert done.status_code == 302
    profile.refresh_from_db()
    assert profile.stripe_connect_account_id == "acct_ops1"
    assert [m.subject.endswith("Your payout account was changed") for m in mailoutbox] == [True]


def test_the_admins_turn_off_two_factor_tells_only_those_who_had_it(admin_client, mailoutbox,
                                                                    django_capture_on_commit_callbacks):
    from django.urls import reverse

    had, never = UserFactory(), UserFactory()
    device = two_factor.totp_enrol_start(user=had, password=PASSWORD, client_address=None)
    two_factor.totp_enrol_confirm(user=had, device_id=device.pk, code=f"{totp(device.bin_key):06d}",
                                  client_address=None)
    with django_capture_on_commit_callbacks(execute=True):
        admin_client.post(reverse("admin:marketplace_user_changelist"),
                          {"action": "turn_off_two_factor", "_selected_action": [had.pk, never.pk]})
    assert not two_factor.two_factor_enabled(user=had)
    assert [m.to for m in mailoutbox] == [[had.email]]


def test_a_browser_session_alone_saves_no_ssh_key(user, api):
    """A saved key goes on every instance rented later (found by review: a copied cookie could add one)."""
    from marketplace.models import SshKey
    from tests.marketplace.renting_helpers import ed25519_key

    refused = _session(user).post("/api/v1/ssh-keys/", {"public_key": ed25519_key()}, format="json")
    assert refused.status_code == 403 and "SSH keys page" in refused.json()["detail"]
    assert not SshKey.objects.filter(user=user).exists()
    assert _session(user).get("/api/v1/ssh-keys/").status_code == 200  # listing them is not a change


def test_a_saved_ssh_key_is_told_to_the_address(user, api, mailoutbox, django_capture_on_commit_callbacks):
    """A saved key goes on the instances its owner rents later (every saved key, through the Vast API): one added
    from a copied cookie must not go unseen (found by review)."""
    from tests.marketplace.renting_helpers import ed25519_key

    with django_capture_on_commit_callbacks(execute=True):
        made = api.post("/api/v1/ssh-keys/", {"name": "laptop", "public_key": ed25519_key()}, format="json")
    assert made.status_code == 201
    (mail,) = mailoutbox
    assert mail.to == [user.email] and mail.subject.endswith("An SSH key was added to your account")
    assert made.json()["fingerprint"] in mail.body and "laptop" in mail.body


def test_a_new_api_key_is_told_to_the_address_but_not_a_log_in_replacing_its_own_key(
        user, api, mailoutbox, django_capture_on_commit_callbacks):
    """A key outlives a password change: one made from a stolen key, on the page or by a log-in under a new name
    must not go unseen, as a saved SSH key or webhook endpoint does not (review r53: the log-in's was silent). A
    log-in again under its name replaces its own key: no e-mail."""
    from django.test import Client

    with django_capture_on_commit_callbacks(execute=True):
        made = api.post(KEYS, {"name": "ci", "scopes": ["read"]}, format="json")
    assert made.status_code == 201
    (mail,) = mailoutbox
    assert mail.to == [user.email] and mail.subject.endswith("An API key was made for your account")
    assert "ci (" in mail.body and made.json()["prefix"] in mail.body and "scopes read" in mail.body
    assert made.json()["key"] not in mail.body  # the secret is in the answer only

    page = Client()
    page.force_login(user)
    with django_capture_on_commit_callbacks(execute=True):
        assert page.post("/account/api-keys/", {"name": "laptop", "scopes": ["read", "renter"],
                                                "expires_in_days": "0", "password": PASSWORD}).status_code == 200
    assert len(mailoutbox) == 2 and "laptop (" in mailoutbox[1].body

    for told in (3, 3):  # the first log-in under its name is told, the next one replaces that key quietly
        with django_capture_on_commit_callbacks(execute=True):
            logged_in = APIClient().post("/api/v1/auth/login/", {"email": user.email, "password": PASSWORD},
                                         format="json")
        assert logged_in.status_code == 200 and len(mailoutbox) == told
    assert mailoutbox[2].subject.endswith("A log-in made an API key for your account")
