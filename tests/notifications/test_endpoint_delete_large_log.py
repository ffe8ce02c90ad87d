"""Deleting a webhook endpoint with a long delivery log is a handful of statements, whatever its length: its
deliveries are locked in the database and deleted with their attempts by their endpoint. Before, every delivery's id
came back to Python, twice (the lock, then Django's collector cascading to the attempts), and the attempts were
deleted by a list of every id: 28 s for 300,000 deliveries, past gunicorn's timeout beyond ~640,000, and the endpoint
kept receiving events (found by review). Asserted by the statements' shape and the rows they return, not by time."""
import pytest
from django.db import connection

from notifications.models import WebhookAttempt, WebhookDelivery, WebhookEndpoint
from notifications.services import webhooks

pytestmark = pytest.mark.django_db

DELIVERIES = 50_000


def _fill(endpoint: WebhookEndpoint, count: int, salt: str) -> None:
    deliveries, attempts = WebhookDelivery._meta.db_table, WebhookAttempt._meta.db_table
    with connection.cursor() as c:
        c.execute(f"""INSERT INTO {deliveries} (endpoint_id, event_id, kind, body, status, attempts, last_error,
                      created_at)
                      SELECT %s, md5(%s || g::text)::uuid, 'instance_running', '{{}}', 'succeeded', 1, '',
                             now() - (g || ' seconds')::interval FROM generate_series(1, %s) g""",  # noqa: S608
                  [endpoint.pk, salt, count])
        c.execute(f"""INSERT INTO {attempts} (delivery_id, number, status_code, error, duration_ms, at)
                      SELECT id, 1, 200, '', 5, created_at FROM {deliveries} WHERE endpoint_id = %s""",  # noqa: S608
                  [endpoint.pk])


def test_an_endpoint_with_a_long_log_is_deleted_in_a_few_set_wise_statements(owner, other_api, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    theirs, _ = webhooks.endpoint_create(user=other_api.user, url=receiver.url)
    _fill(endpoint, DELIVERIES, "mine")
    _fill(theirs, 10, "theirs")
    statements: list[tuple[str, int]] = []

    def record(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        statements.append((sql, context["cursor"].rowcount))
        return result

    with connection.execute_wrapper(record):
        webhooks.endpoint_delete(endpoint=WebhookEndpoint.objects.get(pk=endpoint.pk))

    assert not WebhookEndpoint.objects.filter(pk=endpoint.pk).exists()
    assert not WebhookDelivery.objects.filter(endpoint_id=endpoint.pk).exists()
    assert WebhookAttempt.objects.count() == WebhookDelivery.objects.count() == 10  # the other user's stay
    assert len(statements) <= 10, [sql for sql, _ in statements]
    for sql, rows in statements:
        assert len(sql) < 1000, sql[:300]  # no list of ids in a statement
        if sql.lstrip().upper().startswith("SELECT"):
            assert rows <= 1, (sql, rows)  # no row per delivery comes back
    deleted = {rows for sql, rows in statements if sql.lstrip().upper().startswith("DELETE")}
    assert DELIVERIES in deleted  # the attempts, then the deliveries, each in one statement


def test_a_delete_of_an_endpoint_without_deliveries(owner, receiver):
    endpoint, _ = webhooks.endpoint_create(user=owner, url=receiver.url)
    webhooks.endpoint_delete(endpoint=endpoint)
    webhooks.endpoint_delete(endpoint=endpoint)  # gone already: nothing to do
    assert not WebhookEndpoint.objects.exists()
