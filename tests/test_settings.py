"""Settings from the environment: production refuses unsafe defaults; a first run needs nothing.

Each case imports the settings in a fresh interpreter with a controlled environment,
as a server process would.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.fernet import Fernet

ROOT = Path(__file__).resolve().parent.parent


def run_python(args, env, tmp_path, timeout=120):
    """Run the venv's Python in the repository with only `env` (plus PATH) as its environment."""
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "VAR_DIR": str(tmp_path / "var"), **env}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=clean, capture_output=True, text=True,
                          timeout=timeout)


def production_env(**overrides):
    env = {
        "SECRET_KEY": "s3cret-" + "x" * 40,
        "DEBUG": "false",
        "FIELD_ENCRYPTION_KEYS": Fernet.generate_key().decode(),
        "DATABASE_URL": "postgres://gpumarket@db.internal:5432/gpumarket",
        "CELERY_BROKER_URL": "redis://redis.internal:6379/0",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v is not None}


IMPORT_PRODUCTION = ["-c", "import config.settings.production"]


def test_production_starts_with_proper_values(tmp_path):
    result = run_python(IMPORT_PRODUCTION, production_env(), tmp_path)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"SECRET_KEY": None}, "SECRET_KEY is the development default"),
        ({"SECRET_KEY": "short"}, "SECRET_KEY is the development default or shorter than 32"),
        ({"DEBUG": "true"}, "DEBUG is on"),
        ({"FIELD_ENCRYPTION_KEYS": None}, "FIELD_ENCRYPTION_KEYS contains the development default key"),
        ({"DATABASE_URL": None}, "DATABASE_URL is not set"),
        ({"DATABASE_URL": "sqlite:////tmp/prod.sqlite3"}, "SQLite is for a first run only"),
        ({"ALLOWED_HOSTS": "gpus.example.com,*"}, "ALLOWED_HOSTS accepts any host (*)"),
        ({"ALLOWED_HOSTS": ".com"}, "ALLOWED_HOSTS accepts any host (*)"),
    ],
    ids=["default-secret", "short-secret", "debug-on", "default-encryption-key", "no-database-url", "sqlite",
         "any-host", "any-subdomain-of-a-tld"],
)
def test_production_refuses_unsafe_defaults(tmp_path, overrides, message):
    result = run_python(IMPORT_PRODUCTION, production_env(**overrides), tmp_path)
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert message in result.stderr


def test_production_names_every_problem_at_once(tmp_path):
    result = run_python(IMPORT_PRODUCTION, {"DEBUG": "true"}, tmp_path)
    assert result.returncode != 0
    for problem in ("DEBUG is on", "SECRET_KEY", "FIELD_ENCRYPTION_KEYS", "DATABASE_URL"):
        assert problem in result.stderr


def test_a_malformed_variable_is_named(tmp_path):
    result = run_python(IMPORT_PRODUCTION, production_env(DEBUG="maybe"), tmp_path)
    assert result.returncode != 0
    assert "DEBUG must be true or false" in result.stderr


def test_local_settings_need_nothing_but_python(tmp_path):
    """No variables at all: SQLite and Celery's filesystem transport under VAR_DIR; it migrates and checks clean."""
    env = {"DJANGO_SETTINGS_MODULE": "config.settings.local"}
    migrate = run_python(["manage.py", "migrate", "--noinput"], env, tmp_path)
    assert migrate.returncode == 0, migrate.stderr
    check = run_python(["manage.py", "check", "--fail-level", "WARNING"], env, tmp_path)
    assert check.returncode == 0, check.stderr

    show = run_python(["-c", (
        "import json, django; django.setup(); from django.conf import settings as s; "
        "print(json.dumps({'engine': s.DATABASES['default']['ENGINE'], 'name': str(s.DATABASES['default']['NAME']),"
        " 'broker': s.CELERY_BROKER_URL, 'debug': s.DEBUG}))"
    )], env, tmp_path)
    assert show.returncode == 0, show.stderr
    settings = json.loads(show.stdout.strip().splitlines()[-1])
    assert settings["engine"] == "django.db.backends.sqlite3"
    assert settings["name"].startswith(str(tmp_path / "var"))
    assert settings["broker"] == "filesystem://"
    assert settings["debug"] is True
