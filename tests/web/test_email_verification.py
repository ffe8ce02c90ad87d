"""E-mail verification before renting or listing, for the accounts whose address an operator typed (added in the
admin, or changed there): they log in, but renting (API, page, Vast-compatible API) and registering a server are a
403 `email_not_verified` until they follow the link that "Send the link again" e-mails; nothing is written before.
A bad, another user's or outdated link says so and changes nothing. (A sign-up proves the address by itself:
tests/web/test_signup_verification.py.)"""
import importlib
import re
import smtplib

import pytest
from django.apps import apps
from django.core.mail.backends.base import BaseEmailBackend
from django.test import Client
from rest_framework.test import APIClient

from marketplace.models import Gpu, Instance, Node, NodeState, User, Verdict, Volume
from provisioning.models import Job
from tests.factories import UserFactory, api_key_for, make_listed_node, make_node
from tests.marketplace.renting_helpers import ed25519_key
from tests.web.conftest import PASSWORD, logged_in

pytestmark = pytest.mark.django_db

RESEND = "/account/email/verify/"
API_RESEND = "/api/v1/auth/verify-email/"
CODE = "email_not_verified"


@pytest.fixture
def unverified(db):
    return UserFactory(email="typed.by.ops@example.com", email_verified_at=None)


def _api(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(user)}")
    return client


def _rent(client, node):
    return client.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "pytorch-2-5",
                                              "ssh_public_key": ed25519_key()}, format="json")


def _register(client):
    return client.post("/api/v1/nodes/", {
        "name": "box", "address": "203.0.113.9", "ssh_port": 22, "ssh_user": "gpu", "country": "DE",
        "gpu_model": "rtx-a6000", "gpu_count": 2, "price_per_gpu_hour": "0.5", "runtime": "sim"}, format="json")


def _nothing_rented(node) -> bool:
    return (not Instance.objects.exists() and not Job.objects.filter(instance__isnull=False).exists()
            and set(Gpu.objects.filter(node=node).values_list("status", flat=True)) == {"free"})


def _link(mailoutbox) -> str:
    return re.search(r"http://testserver(/accounts/verify/\S+/)", mailoutbox[-1].body).group(1)


def test_the_api_refuses_to_rent_and_to_list_naming_the_problem_and_the_fix(unverified):
    node = make_listed_node()
    client = _api(unverified)
    r = _rent(client, node)
    assert r.status_code == 403 and r.json()["code"] == CODE, r.content
    assert "Verify your e-mail address" in r.json()["detail"] and "/account/security/" in r.json()["detail"]
    assert API_RESEND in r.json()["detail"]  # the fix an API-only client can make
    assert _nothing_rented(node)
    r = _register(client)
    assert r.status_code == 403 and r.json()["code"] == CODE
    assert not Node.objects.filter(provider=unverified).exists()
    assert client.get("/api/v1/auth/me/").status_code == 200  # everything else works


def test_the_vast_compatible_api_refuses_too(unverified):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=2)
    r = _api(unverified).put(f"/compat/vast/api/v0/asks/{node.pk * 100 + 1}/", {
        "client_id": "me", "image": "cuda-12-4", "disk": 20.0, "env": {}, "runtype": "ssh", "label": None},
        format="json")
    assert r.status_code == 403 and r.json()["error"] == CODE and "Verify your e-mail" in r.json()["msg"]
    assert _nothing_rented(node)


def _unlisted_node_of_a_provider_made_unverified():
    """A verified provider's node, unlisted; then an operator changes the provider's address (UserAdmin.save_model)."""
    provider = UserFactory()
    node = make_node(provider, state=NodeState.ACTIVE, verdict=Verdict.VERIFIED, listed=False)
    User.objects.filter(pk=provider.pk).update(email_verified_at=None)
    provider.refresh_from_db()
    return provider, node


def test_an_unverified_provider_cannot_put_a_node_back_on_the_offers_by_any_path(settings):
    """Relisting is listing: the API's PATCH, `vastai list machine` and the node's settings form are refused as
    registering is, and the node stays off the offers."""
    provider, node = _unlisted_node_of_a_provider_made_unverified()
    client = _api(provider)
    r = client.patch(f"/api/v1/nodes/{node.pk}/", {"listed": True}, format="json")
    assert r.status_code == 403 and r.json()["code"] == CODE, r.content
    r = client.put("/compat/vast/api/v0/machines/create_asks/", {"machine": node.pk, "price_gpu": 1.0}, format="json")
    assert r.status_code == 403 and r.json()["error"] == CODE, r.content
    r = logged_in(provider).post(f"/nodes/{node.pk}/settings/", {"price_per_gpu_hour": "0.25", "listed": "on"})
    assert r.status_code == 400 and "Verify your e-mail address" in r.content.decode()
    node.refresh_from_db()
    assert not node.listed and node.price_per_gpu_hour_micros == 1_500_000
    # What is not listing still works: another price on the unlisted node, unlisting a listed one.
    assert client.patch(f"/api/v1/nodes/{node.pk}/", {"price_per_gpu_hour": "0.9"}, format="json").status_code == 200
    Node.objects.filter(pk=node.pk).update(listed=True)
    assert client.patch(f"/api/v1/nodes/{node.pk}/", {"listed": True}, format="json").status_code == 200
    assert client.patch(f"/api/v1/nodes/{node.pk}/", {"listed": False}, format="json").status_code == 200


def test_an_unverified_renter_cannot_create_a_volume_on_the_api_or_the_page(unverified):
    """A volume is rented storage, billed while it exists: the rule of renting an instance."""
    node = make_listed_node()
    r = _api(unverified).post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 10}, format="json")
    assert r.status_code == 403 and r.json()["code"] == CODE, r.content
    r = logged_in(unverified).post("/volumes/", {"offer": node.pk, "size_gb": 10, "label": "data"})
    assert r.status_code == 400 and "Verify your e-mail address" in r.content.decode()
    assert not Volume.objects.exists() and not Job.objects.exists()


def test_the_pages_say_it_with_the_resend_button_and_write_nothing(unverified):
    node = make_listed_node()
    web = logged_in(unverified)
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert "Verify your e-mail address first" in page and f'action="{RESEND}"' in page
    r = web.post(f"/offers/{node.pk}/rent/", {"num_gpus": 1, "image": "pytorch-2-5",
                                               "ssh_public_key": ed25519_key(), "request_token": "t1"})
    assert r.status_code == 400 and "Verify your e-mail address first" in r.content.decode()
    assert _nothing_rented(node)
    page = web.get("/nodes/new/").content.decode()
    assert "Verify your e-mail address first" in page and f'action="{RESEND}"' in page
    r = web.post("/nodes/new/", {"name": "box", "address": "203.0.113.9", "ssh_port": 22, "ssh_user": "gpu",
                                 "country": "DE", "gpu_model": "rtx-a6000", "gpu_count": 2,
                                 "price_per_gpu_hour": "0.50", "runtime": "sim"})
    assert r.status_code == 400 and "Verify your e-mail address" in r.content.decode()
    assert not Node.objects.filter(provider=unverified).exists()


def test_verified_users_see_no_notice(renter):
    node = make_listed_node()
    assert "Verify your e-mail address" not in logged_in(renter).get(f"/offers/{node.pk}/rent/").content.decode()


def test_resend_then_the_link_verifies_and_renting_works(unverified, mailoutbox):
    node = make_listed_node()
    web = logged_in(unverified)
    r = web.post(RESEND, {"next": f"/offers/{node.pk}/rent/"})
    assert r.status_code == 302 and r["Location"] == f"/offers/{node.pk}/rent/"
    assert mailoutbox[-1].to == [unverified.email] and "Verify your e-mail address" in mailoutbox[-1].subject
    page = Client().get(_link(mailoutbox))  # from the mail client, no session needed
    assert page.status_code == 200 and "is verified" in page.content.decode()
    unverified.refresh_from_db()
    assert unverified.email_verified_at is not None
    assert _rent(_api(unverified), node).status_code == 201
    assert web.post(RESEND).status_code == 302 and len(mailoutbox) == 1  # verified: nothing more to send
    assert Client().get(_link(mailoutbox)).status_code == 400  # the link has done its work


@pytest.mark.parametrize("next_url", ["ssh-key-delete", "home"])
def test_resend_with_a_next_that_is_a_bare_word_redirects_to_it_as_a_path(unverified, next_url):
    """redirect() reversed it as a URL name: NoReverseMatch, a 500."""
    r = logged_in(unverified).post(RESEND, {"next": next_url})
    assert r.status_code == 302 and r["Location"] == next_url


def test_resend_is_limited_per_hour_and_needs_a_log_in(unverified, mailoutbox, settings):
    assert Client().post(RESEND)["Location"].startswith("/accounts/login/")
    web = logged_in(unverified)
    for _ in range(settings.PASSWORD_RESET_EMAILS_PER_ADDRESS + 2):
        web.post(RESEND)
    assert len(mailoutbox) == settings.PASSWORD_RESET_EMAILS_PER_ADDRESS
    assert "No e-mail was sent" in web.get("/account/security/").content.decode()


class RefusingMailServer(BaseEmailBackend):
    def send_messages(self, email_messages):
        raise smtplib.SMTPServerDisconnected("the mail server hung up")


REFUSING = f"{__name__}.RefusingMailServer"


def test_the_api_sends_the_link_again_and_the_link_verifies(unverified, mailoutbox):
    node = make_listed_node()
    client = _api(unverified)
    assert client.get("/api/v1/auth/me/").json()["email_verified"] is False
    r = client.post(API_RESEND)
    assert r.status_code == 202 and unverified.email in r.json()["detail"], r.content
    assert mailoutbox[-1].to == [unverified.email] and "Verify your e-mail address" in mailoutbox[-1].subject
    assert Client().get(_link(mailoutbox)).status_code == 200
    assert client.get("/api/v1/auth/me/").json()["email_verified"] is True
    assert _rent(client, node).status_code == 201
    r = client.post(API_RESEND)  # verified: nothing to send
    assert r.status_code == 409 and "verified already" in r.json()["detail"] and len(mailoutbox) == 1


def test_the_api_resend_is_limited_per_hour_with_a_429(unverified, mailoutbox, settings):
    client = _api(unverified)
    answers = [client.post(API_RESEND) for _ in range(settings.PASSWORD_RESET_EMAILS_PER_ADDRESS + 1)]
    assert [a.status_code for a in answers] == [202] * settings.PASSWORD_RESET_EMAILS_PER_ADDRESS + [429]
    assert "No e-mail was sent" in answers[-1].json()["detail"]
    assert len(mailoutbox) == settings.PASSWORD_RESET_EMAILS_PER_ADDRESS
    assert APIClient().post(API_RESEND).status_code == 401


def test_a_refusing_mail_server_is_a_503_on_the_api_and_a_message_on_the_page(unverified, settings):
    settings.EMAIL_BACKEND = REFUSING
    r = _api(unverified).post(API_RESEND)
    assert r.status_code == 503 and "mail server" in r.json()["detail"], r.content
    web = logged_in(unverified)
    assert web.post(RESEND).status_code == 302
    assert "the mail server could not take it" in web.get("/account/security/").content.decode()
    unverified.refresh_from_db()
    assert unverified.email_verified_at is None


def test_a_bad_or_another_users_link_changes_nothing(unverified, mailoutbox):
    other = UserFactory(email_verified_at=None)
    logged_in(unverified).post(RESEND)
    path = _link(mailoutbox)
    _, _, _, uid, token, _ = path.split("/")
    other_uid = re.search(r"/accounts/verify/([^/]+)/", _link_for(other, mailoutbox)).group(1)
    for bad in (f"/accounts/verify/{uid}/{token[:-2]}xx/", f"/accounts/verify/{other_uid}/{token}/",
                f"/accounts/verify/!!/{token}/", f"/accounts/verify/{uid}/nope/"):
        r = Client().get(bad)
        assert r.status_code == 400 and "invalid, has expired" in r.content.decode(), bad
    assert not User.objects.filter(email_verified_at__isnull=False, pk__in=[unverified.pk, other.pk]).exists()


def _link_for(user, mailoutbox) -> str:
    logged_in(user).post(RESEND)
    return _link(mailoutbox)


def test_an_expired_link_changes_nothing(unverified, mailoutbox, settings):
    logged_in(unverified).post(RESEND)
    settings.PASSWORD_RESET_TIMEOUT = -1
    assert Client().get(_link(mailoutbox)).status_code == 400
    unverified.refresh_from_db()
    assert unverified.email_verified_at is None


def _admin_change_email(admin, user, email):
    return admin.post(f"/admin/marketplace/user/{user.pk}/change/", {
        "email": email, "is_active": "on", "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00"})


def test_an_operator_changing_the_address_makes_it_unverified(renter, operator):
    admin = logged_in(operator)
    assert _admin_change_email(admin, renter, renter.email).status_code == 302  # unchanged: still verified
    renter.refresh_from_db()
    assert renter.email_verified_at is not None
    assert _admin_change_email(admin, renter, "new.address@example.com").status_code == 302
    renter.refresh_from_db()
    assert renter.email == "new.address@example.com" and renter.email_verified_at is None
    assert _rent(_api(renter), make_listed_node()).status_code == 403


def test_an_unverified_renter_cannot_start_a_stopped_instance_again(renter):
    """Starting takes GPUs again, as booking does: refused until the changed address is proven (before, only
    booking checked; found by review)."""
    from marketplace.services import instances as svc
    from tests.marketplace.renting_helpers import book, run

    instance = run(book(renter, make_listed_node()))
    svc.instance_stop(instance=instance)
    svc.instance_mark_stopped(instance_id=instance.pk)
    User.objects.filter(pk=renter.pk).update(email_verified_at=None)
    r = _api(renter).post(f"/api/v1/instances/{instance.pk}/start/")
    assert r.status_code == 403 and r.json()["code"] == "email_not_verified", r.content
    assert Instance.objects.get(pk=instance.pk).status == "stopped"


def test_the_old_address_is_told_when_an_operator_changes_it(renter, operator, mailoutbox,
                                                             django_capture_on_commit_callbacks):
    """From then on the account's e-mails and password resets go to the new address: its owner hears of it at the
    old one (before, nothing was sent)."""
    old = renter.email
    with django_capture_on_commit_callbacks(execute=True):
        assert _admin_change_email(logged_in(operator), renter, "someone.else@example.com").status_code == 302
    told = [m for m in mailoutbox if m.to == [old]]
    assert len(told) == 1 and "someone.else@example.com" in told[0].body, [(m.to, m.subject) for m in mailoutbox]
    assert "changed your account's address" in told[0].subject


def test_an_operator_cannot_change_their_own_address_in_the_admin(operator):
    """A copied operator session would set its own address, then have the password reset sent there and keep the
    account for good; the own password is refused there the same way."""
    admin = logged_in(operator)
    before = operator.email
    _admin_change_email(admin, operator, "taken.over@example.com")
    operator.refresh_from_db()
    assert operator.email == before
    page = admin.get(f"/admin/marketplace/user/{operator.pk}/change/").content.decode()
    assert 'name="email"' not in page


def test_a_link_sent_to_the_old_address_is_void_once_it_changed(unverified, operator, mailoutbox):
    logged_in(unverified).post(RESEND)
    old_link = _link(mailoutbox)
    assert _admin_change_email(logged_in(operator), unverified, "fixed.typo@example.com").status_code == 302
    assert Client().get(old_link).status_code == 400
    unverified.refresh_from_db()
    assert unverified.email_verified_at is None


def test_a_password_reset_proves_the_address(client, unverified, mailoutbox):
    client.post("/accounts/password/reset/", {"email": unverified.email})
    link = re.search(r"http://testserver(/accounts/password/reset/\S+/)", mailoutbox[-1].body).group(1)
    form_url = client.get(link)["Location"]
    new = "a brand new passphrase 7"
    assert client.post(form_url, {"new_password1": new, "new_password2": new}).status_code == 302
    unverified.refresh_from_db()
    assert unverified.email_verified_at is not None


def test_existing_users_count_as_verified_after_the_migration(operator):
    typed = UserFactory(email_verified_at=None)
    no_password = UserFactory(email_verified_at=None)
    no_password.set_unusable_password()
    no_password.save()
    migration = importlib.import_module("marketplace.migrations.0018_user_email_verified")
    migration.existing_users_verified(apps, None)
    typed.refresh_from_db()
    no_password.refresh_from_db()
    assert typed.email_verified_at == typed.date_joined
    assert no_password.email_verified_at is None  # proves it with its first password reset


def test_accounts_made_by_the_server_s_holders_are_verified():
    assert User.objects.create_user("seed@example.com", PASSWORD).email_verified_at is not None
    assert User.objects.create_superuser("root@example.com", PASSWORD).email_verified_at is not None
