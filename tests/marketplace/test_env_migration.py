"""Migration 0019 encrypts the env of instances booked before it (and its reverse gives it back): the rows are
written in the old shape, at 0018, and read raw after migrating forward (to the latest migrations: the tests after
this one need every column)."""
import json

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

from marketplace.encryption import decrypt_secret
from marketplace.models import Instance
from marketplace.services import instances as svc
from tests import migration_steps
from tests.factories import make_listed_node

from .test_instance_options import body as make_body

BEFORE = [("marketplace", "0018_user_email_verified")]
SECRET = "sk-old-row-7d2e91"


def _migrate(targets=None):
    """To `targets`, or (None) to the latest migration of every app (tests/migration_steps.py)."""
    migration_steps.migrate(MigrationExecutor(connection), targets)


def _raw(instance_id: int) -> tuple[bytes | None, list[str]]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT env_encrypted, env_names FROM marketplace_instance WHERE id = %s", [instance_id])
        token, names = cursor.fetchone()
    return (None if token is None else bytes(token)), (json.loads(names) if isinstance(names, str) else names)


@pytest.mark.django_db(transaction=True)
def test_existing_plaintext_env_is_encrypted_by_the_migration_and_given_back_by_its_reverse(api):
    node = make_listed_node(gpu_count=4)
    live = api.post("/api/v1/instances/", make_body(node, env={"API_KEY": SECRET, "MODE": "x"}), format="json")
    done = api.post("/api/v1/instances/", make_body(node, env={"API_KEY": SECRET}), format="json")
    plain = api.post("/api/v1/instances/", make_body(node), format="json")
    assert {live.status_code, done.status_code, plain.status_code} == {201}, (live.content, done.content)
    svc.instance_mark_failed(instance_id=done.json()["id"], message="failed")
    try:
        _migrate(BEFORE)  # the reverse step: values back in the plaintext column (a failed row's are gone)
        with connection.cursor() as cursor:
            cursor.execute("SELECT id, env FROM marketplace_instance ORDER BY id")
            old = {row[0]: (json.loads(row[1]) if isinstance(row[1], str) else row[1]) for row in cursor.fetchall()}
        assert old[live.json()["id"]] == {"API_KEY": SECRET, "MODE": "x"}
        assert old[done.json()["id"]] == {"API_KEY": ""} and old[plain.json()["id"]] == {}
        with connection.cursor() as cursor:  # a row as it was before: plaintext values
            cursor.execute("UPDATE marketplace_instance SET env = %s WHERE id = %s",
                           [json.dumps({"API_KEY": SECRET}), done.json()["id"]])
    finally:
        _migrate()
    token, names = _raw(live.json()["id"])
    assert token and SECRET.encode() not in token and sorted(names) == ["API_KEY", "MODE"]  # jsonb kept no order
    assert json.loads(decrypt_secret(token)) == {"API_KEY": SECRET, "MODE": "x"}
    assert _raw(done.json()["id"]) == (None, ["API_KEY"])  # failed: nothing will read the value again
    assert _raw(plain.json()["id"]) == (None, [])
    assert svc.instance_env(instance=Instance.objects.get(pk=live.json()["id"])) == {"API_KEY": SECRET, "MODE": "x"}
    assert api.get(f"/api/v1/instances/{live.json()['id']}/").json()["env"] == {"API_KEY": "********",
                                                                                  "MODE": "********"}
