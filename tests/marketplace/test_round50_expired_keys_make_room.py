"""Expired API keys work no more, yet counted toward API_KEYS_PER_USER_MAX until revoked by hand (found by review): an
account whose keys had all expired was refused every new key, and the API log-in, with a 409. At the cap, its expired
keys are now revoked to make room; keys that still work keep counting, and their owner still gets the 409."""
from datetime import timedelta

import pytest
from django.utils import timezone

from marketplace.models import ApiKey
from tests.marketplace.test_api_accounts import KEYS, LOGIN, PASSWORD

pytestmark = pytest.mark.django_db


def test_expired_keys_make_room_at_the_cap(anon, api, user, settings):
    settings.API_KEYS_PER_USER_MAX = 3  # the key `api` is authenticated with is one of them
    assert [api.post(KEYS, {"name": f"k{i}"}).status_code for i in range(2)] == [201, 201]
    assert api.post(KEYS, {"name": "one too many"}).status_code == 409  # three keys that work
    ApiKey.objects.filter(user=user, name__in=["k0", "k1"]).update(expires_at=timezone.now() - timedelta(seconds=1))
    made = api.post(KEYS, {"name": "room"})
    assert made.status_code == 201, made.content
    assert not ApiKey.objects.filter(user=user, name__in=["k0", "k1"], revoked_at__isnull=True).exists()
    assert user.api_keys.active().count() == 2  # the one in use and the new one
    # the API log-in makes its key the same way
    assert anon.post(LOGIN, {"email": user.email, "password": PASSWORD, "key_name": "laptop"}).status_code == 200
    assert anon.post(LOGIN, {"email": user.email, "password": PASSWORD, "key_name": "phone"}).status_code == 409
