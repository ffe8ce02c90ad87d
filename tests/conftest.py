import pytest
from rest_framework.test import APIClient

from tests.factories import UserFactory, api_key_for


@pytest.fixture(autouse=True)
def _clear_cache():
    # Throttle counters live in the shared cache (Redis); every test starts fresh.
    from django.core.cache import cache

    cache.clear()
    yield


@pytest.fixture
def anon():
    return APIClient()


def _client_for(user):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(user)}")
    client.user = user
    return client


@pytest.fixture
def user(db):
    return UserFactory()


@pytest.fixture
def client_for(db):
    return _client_for


@pytest.fixture
def api(user):
    """An API client authenticated with an API key of `user`."""
    return _client_for(user)


@pytest.fixture
def other_api(db):
    return _client_for(UserFactory())


@pytest.fixture
def operator_api(db):
    return _client_for(UserFactory(is_staff=True))
