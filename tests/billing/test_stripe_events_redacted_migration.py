"""Migration 0019 redacts the Stripe events stored before webhook_receive redacted them (found by review: their
client_secrets stayed in the rows, and a list lookup read one back). The rows are stored as the code before redaction
stored them, the database taken back to 0018 and forward again (to the latest migrations: the tests after this one
need every column)."""
import importlib

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from billing.models import StripeEvent
from billing.services.webhooks import REDACTED
from tests import migration_steps

BEFORE = [("billing", "0018_follow_up_least_recently_tried_first")]
MIGRATION = importlib.import_module("billing.migrations.0019_stripe_events_redacted")


def _migrate(targets=None):
    """To `targets`, or (None) to the latest migration of every app (tests/migration_steps.py)."""
    migration_steps.migrate(MigrationExecutor(connection), targets)


def _intent(n: int, **more) -> dict:
    return {"id": f"evt_{n}", "type": "payment_intent.succeeded",
            "data": {"object": {"id": f"pi_{n}", "client_secret": f"pi_{n}_secret_abc", "amount": 100, **more}}}


@pytest.mark.django_db(transaction=True)
def test_events_stored_before_redaction_lose_their_secrets_and_keep_the_rest(monkeypatch):
    monkeypatch.setattr(MIGRATION, "BATCH", 2)  # several batches
    payloads = {
        "evt_1": _intent(1),
        "evt_2": _intent(2, charges={"data": [{"id": "ch_2", "payment_intent_secret": "x"}]}, secret="s"),
        "evt_3": _intent(3, client_secret=None),  # nothing to hide
        "evt_4": {"id": "evt_4", "type": "ping"},  # no data
        "evt_5": {"id": "evt_5", "type": "x", "data": {}},  # no object
        "evt_6": {"id": "evt_6", "type": "x", "data": {"object": "a string"}, "note": 'says "my_secret"'},
        "evt_7": _intent(7),
        "evt_8": {"id": "evt_8", "type": "setup_intent.succeeded", "data": {"object": [{"client_secret": "seti_s"}]}},
    }
    for event_id, payload in payloads.items():
        StripeEvent.objects.create(event_id=event_id, type=payload["type"], payload=payload)
    try:
        _migrate(BEFORE)
    finally:
        _migrate()
    stored = dict(StripeEvent.objects.values_list("event_id", "payload"))
    for n in (1, 7):
        assert stored[f"evt_{n}"] == {**payloads[f"evt_{n}"], "data": {"object": {
            "id": f"pi_{n}", "client_secret": REDACTED, "amount": 100}}}
    assert stored["evt_2"]["data"]["object"] == {
        "id": "pi_2", "client_secret": REDACTED, "amount": 100, "secret": REDACTED,
        "charges": {"data": [{"id": "ch_2", "payment_intent_secret": REDACTED}]}}
    assert stored["evt_8"]["data"]["object"] == [{"client_secret": REDACTED}]
    for event_id in ("evt_3", "evt_4", "evt_5", "evt_6"):
        assert stored[event_id] == payloads[event_id]
    assert "_secret_abc" not in str(stored)
