"""The first run's database (SQLite, `make demo`'s default) runs the use cases, not only the migrations.

The suite runs on PostgreSQL, so raw SQL that SQLite rejects (FOR KEY SHARE, ANY(%s), ...) passes every other test
and fails every call on the demo: notify() did, until its lock was read through the ORM there. Each case here
migrates a throwaway SQLite database in a fresh interpreter with the local settings, as `make demo` runs them,
and drives the use cases that need no booking: a notice with a webhook endpoint and an e-mail address to send to,
and an operator's deactivation and reactivation of an account (a service that notifies inside its transaction).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

SCRIPT = """
import json
from marketplace.encryption import encrypt_secret
from marketplace.models import User
from marketplace.services.account_status import account_deactivate, account_reactivate
from notifications.models import Notification, WebhookDelivery, WebhookEndpoint
from notifications.services.notify import Kind, notify

user = User.objects.create_user("renter@example.com", "x" * 12)
operator = User.objects.create_user("operator@example.com", "x" * 12, is_staff=True)
WebhookEndpoint.objects.create(user=user, url="https://hooks.example.com/in", secret_hint="whsec_ab",
                               secret_encrypted=encrypt_secret(b"whsec_abc"))
low = notify(user=user, kind=Kind.LOW_BALANCE, dedupe_key="low_balance:1",
             payload={"balance": "0.50", "message": "Your balance is low."})
again = notify(user=user, kind=Kind.LOW_BALANCE, dedupe_key="low_balance:1", payload={})
off = account_deactivate(user=user, by=operator, reason="a test")
on = account_reactivate(user=user, by=operator)
print(json.dumps({"low": low is not None, "again": again is None, "off": off is not None, "on": on is not None,
                  "kinds": sorted(Notification.objects.filter(user=user).values_list("kind", flat=True)),
                  "deliveries": WebhookDelivery.objects.filter(endpoint__user=user).count()}))
"""


def _manage(args, tmp_path):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "VAR_DIR": str(tmp_path / "var"),
           "DJANGO_SETTINGS_MODULE": "config.settings.local",
           "DATABASE_URL": f"sqlite:///{tmp_path / 'first-run.sqlite3'}"}
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_notices_and_account_status_work_on_sqlite(tmp_path):
    migrate = _manage(["migrate", "--noinput"], tmp_path)
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    run = _manage(["shell", "-c", SCRIPT], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    done = json.loads(run.stdout.strip().splitlines()[-1])
    assert done == {"low": True, "again": True, "off": True, "on": True,
                    "kinds": ["account_deactivated", "account_reactivated", "low_balance"], "deliveries": 3}
