"""The application's PostgreSQL sessions run without JIT (config/settings/base.py): with it, the offers query spent
~25 ms compiling on every request (docs/BENCHMARKS.md, offers, 2026-12-01)."""
from django.db import connection


def test_the_applications_sessions_have_jit_off(db):
    with connection.cursor() as cursor:
        cursor.execute("SHOW jit")
        assert cursor.fetchone()[0] == "off"
