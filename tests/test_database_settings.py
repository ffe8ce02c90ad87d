"""The application's PostgreSQL sessions run without JIT (config/settings/base.py): with it, the offers query spent
~25 ms compiling on every request (docs/BENCHMARKS.md, offers, 2026-12-01)."""
import json

from django.db import connection

from tests.test_settings import run_python


def test_the_applications_sessions_have_jit_off(db):
    with connection.cursor() as cursor:
        cursor.execute("SHOW jit")
        assert cursor.fetchone()[0] == "off"


def test_the_session_options_can_be_left_to_the_server_behind_a_pooler(tmp_path):
    """DATABASE_SESSION_OPTIONS= sends no `options` (PgBouncer refuses it unless told to ignore it); other settings
    can be given. In a fresh interpreter, as a server process reads them."""
    show = ["-c", "import json, config.settings.base as b; "
                  "print(json.dumps(b.DATABASES['default'].get('OPTIONS', {})))"]
    url = {"DATABASE_URL": "postgres://app@127.0.0.1:6432/gpumarket"}
    for given, expected in ((None, "-c jit=off"), ("", None), ("-c jit=off -c statement_timeout=5000",
                                                                 "-c jit=off -c statement_timeout=5000")):
        env = {**url, **({} if given is None else {"DATABASE_SESSION_OPTIONS": given})}
        out = run_python(show, env, tmp_path)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout).get("options") == expected, (given, out.stdout)
