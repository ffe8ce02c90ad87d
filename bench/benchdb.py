"""A benchmark's own PostgreSQL database: created fresh on the configured server, dropped afterwards.

Call point_django_at_bench_db before django.setup(); it never touches the configured database."""
import sys

import psycopg
from django.conf import settings


def point_django_at_bench_db(name: str) -> dict:
    """Create database `name` on the configured PostgreSQL server and point settings at it.

    Returns the server's connection parameters, for drop_bench_db."""
    db = settings.DATABASES["default"]  # loads the settings module; Django is not set up yet
    if db["ENGINE"] != "django.db.backends.postgresql":
        sys.exit(f"bench: needs PostgreSQL (DATABASE_URL); the settings give {db['ENGINE']}")
    if name == db["NAME"]:
        sys.exit(f"bench: refusing to use the configured database {db['NAME']!r}; pick another --db-name")
    server = {"host": db.get("HOST") or "127.0.0.1", "port": db.get("PORT") or 5432,
              "user": db.get("USER") or "postgres", "password": db.get("PASSWORD") or None}
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    db["NAME"] = name
    db["TEST"] = {"NAME": name}
    return server


def drop_bench_db(server: dict, name: str) -> None:
    from django.db import connections

    connections.close_all()
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
