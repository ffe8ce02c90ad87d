"""An operator revoking a customer's API key tells the owner (review r53 #7): their automation started getting 401s
with no word, while every other operator security change (password, address, two-factor, deactivation) is told."""
import pytest

from marketplace.models import ApiKey
from marketplace.services.accounts import api_key_create, api_key_revoke
from tests.factories import UserFactory
from tests.web.conftest import logged_in
from tests.web.test_admin_permissions import act, staff

pytestmark = pytest.mark.django_db


def test_the_owner_is_told_once_of_the_keys_an_operator_revoked(operator, mailoutbox,
                                                                 django_capture_on_commit_callbacks):
    owner, other = UserFactory(), UserFactory()
    ci, _ = api_key_create(user=owner, name="ci")
    laptop, _ = api_key_create(user=owner, name="laptop")
    gone, _ = api_key_create(user=owner, name="old")
    api_key_revoke(api_key=gone)  # its owner's own revocation: not the operator's, not told again
    theirs, _ = api_key_create(user=other, name="bot")
    mailoutbox.clear()
    with django_capture_on_commit_callbacks(execute=True):
        act(logged_in(operator), "marketplace/apikey", "revoke", ci.pk, laptop.pk, gone.pk, theirs.pk, index=0)
    assert not ApiKey.objects.filter(pk__in=[ci.pk, laptop.pk, theirs.pk], revoked_at__isnull=True).exists()
    assert sorted(m.to[0] for m in mailoutbox) == sorted([owner.email, other.email])  # one e-mail per owner
    mail = next(m for m in mailoutbox if m.to == [owner.email])
    assert "operator" in mail.subject.lower() and "revoked" in mail.subject
    assert f"ci ({ci.prefix}…)" in mail.body and f"laptop ({laptop.prefix}…)" in mail.body
    assert gone.prefix not in mail.body  # the key its owner revoked is not named


def test_nobody_is_told_of_a_key_left_as_it_is(mailoutbox, django_capture_on_commit_callbacks):
    boss = UserFactory(is_staff=True, is_superuser=True)
    key, _ = api_key_create(user=boss, name="boss")
    mailoutbox.clear()
    with django_capture_on_commit_callbacks(execute=True):  # a staff account's key: a superuser's to revoke
        act(logged_in(staff("marketplace.change_apikey", "marketplace.view_apikey")), "marketplace/apikey",
            "revoke", key.pk, index=0)
    assert ApiKey.objects.get(pk=key.pk).revoked_at is None and not mailoutbox
