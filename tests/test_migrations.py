from io import StringIO

import pytest
from django.core.management import call_command


@pytest.mark.django_db
def test_migrations_are_complete():
    out = StringIO()
    try:
        call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)
    except SystemExit as exc:  # makemigrations --check exits 1 when a model change has no migration
        raise AssertionError(f"models changed without a migration:\n{out.getvalue()}") from exc
