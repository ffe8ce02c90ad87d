"""SQL queries per request of every API list endpoint and every admin change list, against baselines in
tests/query_counts.json, measured with N=3 and N=10 rows of everything: a count above its baseline fails,
and a count that grows with N is an N+1.

After an intended change, rewrite the baselines: QUERY_COUNTS_UPDATE=1 pytest tests/test_query_counts.py
(NetBox's utilities/testing/query_counts.py does the same per app.)
"""
import json
import os
from pathlib import Path

import pytest
from django.contrib import admin
from django.db import connection, transaction
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone
from rest_framework.test import APIClient

from marketplace.models import Node
from tests import reference_data
from tests.api_contract import world
from tests.api_contract.table import CALLS
from tests.factories import UserFactory, api_key_for

BASELINES = Path(__file__).with_name("query_counts.json")
UPDATE = os.environ.get("QUERY_COUNTS_UPDATE") == "1"
SIZES = (3, 10)
# The mark makes pytest-django set the test database up; the counts are taken once, by `measured`. One xdist
# worker runs the module (`make test`'s --dist loadgroup): spread over three, each measured it again (6 s each).
pytestmark = [pytest.mark.django_db, pytest.mark.xdist_group("query_counts")]

# GET collections, and the two reads whose size follows N under one object: a node's benchmarks, a month.
API_LISTS = [c.path for c in CALLS if c.method == "get" and "{" not in c.path] + [
    "/api/v1/nodes/{id}/benchmarks/", "/api/v1/billing/statements/{month}/"]
ADMIN_LISTS = sorted(model._meta.label_lower for model in admin.site._registry)
KEYS = [f"GET {path}" for path in API_LISTS] + [f"admin {label}" for label in ADMIN_LISTS]


def _queries(client, url: str) -> int:
    client.get(url)  # once first: a key's last use, rows made on first sight, caches
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200, (url, response.status_code, response.content[:500])
    return len(captured.captured_queries)


@pytest.fixture(scope="module")
def measured(django_db_setup, django_db_blocker) -> dict[str, dict[str, int]]:
    """{key: {"3": queries, "10": queries}}, measured in one transaction rolled back at the end."""
    counts: dict[str, dict[str, int]] = {}
    with django_db_blocker.unblock(), override_settings(STRIPE_API_BASE="http://127.0.0.1:9"), transaction.atomic():
        reference_data.take_snapshot()  # the catalogue and images, which a transactional test may have flushed
        reference_data.restore()
        owner = UserFactory()
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(owner)}")
        operator = Client()
        operator.force_login(UserFactory(is_staff=True, is_superuser=True))
        made = 0
        for n in SIZES:
            world.populate(owner, n - made)
            made = n
            first_node = Node.objects.filter(provider=owner).order_by("pk").first()
            params = {"id": first_node.pk, "month": f"{timezone.now():%Y-%m}"}
            for path in API_LISTS:
                url = path.format(**params)
                counts.setdefault(f"GET {path}", {})[str(n)] = _queries(api, url)
            for label in ADMIN_LISTS:
                url = reverse(f"admin:{label.replace('.', '_')}_changelist")
                counts.setdefault(f"admin {label}", {})[str(n)] = _queries(operator, url)
        transaction.set_rollback(True)
    if UPDATE:
        BASELINES.write_text(json.dumps(counts, indent=2, sort_keys=True) + "\n")
    return counts


def _baselines() -> dict:
    return json.loads(BASELINES.read_text()) if BASELINES.exists() else {}


@pytest.mark.parametrize("key", KEYS)
def test_queries_do_not_rise_above_the_baseline(key, measured):
    counts, baseline = measured[key], _baselines().get(key)
    assert baseline is not None, f"{key}: no baseline in {BASELINES.name}; record it with QUERY_COUNTS_UPDATE=1"
    rises = [f"N={n}: {counts[n]} queries, {counts[n] - baseline[n]} more than the baseline {baseline[n]}"
             for n in counts if counts[n] > baseline.get(n, 0)]
    growth = counts[str(SIZES[-1])] - counts[str(SIZES[0])]
    if growth > 0:
        rises.append(f"it grows with N by {growth} (an N+1)")
    assert not rises, f"{key}: " + "; ".join(rises) + ". If intended: QUERY_COUNTS_UPDATE=1 (tests/query_counts.json)."


def test_the_baselines_name_only_what_is_measured():
    stale = set(_baselines()) - set(KEYS)
    assert UPDATE or not stale, f"baselines of nothing measured now (remove them, or QUERY_COUNTS_UPDATE=1): {stale}"
