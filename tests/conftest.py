import os
import sys

import pytest
from _pytest.nodeid import coerce_node_id
from rest_framework.test import APIClient

from tests import db_template, python_on_path, run_lock
from tests.factories import UserFactory, api_key_for
from tests.live import celery_worker, sim_node_factory, simnodes_dir, worker  # noqa: F401 (fixtures for e2e and web)
from tests.localstripe import (  # noqa: F401 (fixtures: billing, schema and web tests)
    localstripe,
    localstripe_server,
    stripe_webhooks,
)


def _flush_deletes_rows_not_files() -> None:
    """A transactional test's teardown empties every table (Django's flush). PostgreSQL's TRUNCATE of all of
    them makes new files for each of the ~330 tables and indexes: 0.35 s a test, paid by every transactional test
    of the suite. Here the same tables are locked as TRUNCATE locks them (a task still writing is waited for, as
    before) and their rows deleted, with triggers off for that transaction only as TRUNCATE has none (the
    ledger's append-only triggers, the foreign keys): 0.01 s. Every table still ends empty; sequences are not
    reset by either. A flush that resets sequences, or a role that may not turn triggers off, keeps Django's."""
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if not tables or reset_sequences or allow_cascade or not _may_turn_triggers_off(self.connection):
            return truncate(self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        names = [self.quote_name(table) for table in tables]
        # One statement (no parameters: psycopg sends it as one query) rather than ~170 round trips a flush.
        return ["; ".join(["SET LOCAL session_replication_role = replica",
                           f"LOCK TABLE {', '.join(names)} IN ACCESS EXCLUSIVE MODE",
                           *(f"DELETE FROM {name}" for name in names),  # noqa: S608 (quoted names of tables)
                           "SET LOCAL session_replication_role = DEFAULT"])]  # triggers back on in a longer one

    DatabaseOperations.sql_flush = sql_flush


def _may_turn_triggers_off(connection) -> bool:
    """Superusers may set session_replication_role (the suite's postgres user is one)."""
    connection.ensure_connection()
    with connection.connection.cursor() as cursor:  # the driver's own cursor: no test's captured queries count it
        cursor.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        row = cursor.fetchone()
    return bool(row and row[0])


_flush_deletes_rows_not_files()


@pytest.fixture(scope="session")
def django_db_setup(request, django_test_environment, django_db_blocker, django_db_use_migrations, django_db_keepdb,
                    django_db_createdb, django_db_modify_db_settings):
    """pytest-django's, except that each test database is copied from a template migrated once for all xdist
    workers (tests/db_template.py) instead of being migrated in each of them. --reuse-db and --no-migrations are
    pytest-django's own."""
    from django.db import connections
    from django.test.utils import setup_databases, teardown_databases
    from pytest_django.fixtures import _disable_migrations, _get_databases_for_setup

    if not django_db_use_migrations:
        _disable_migrations()
    keepdb = django_db_keepdb and not django_db_createdb
    aliases, serialized_aliases = _get_databases_for_setup(request.session.items)
    verbosity = request.config.option.verbose
    with django_db_blocker.unblock():
        with db_template.test_databases_from_template(connections, enabled=django_db_use_migrations,
                                                      say=lambda line: print(line, file=sys.stderr, flush=True)):
            db_cfg = setup_databases(verbosity=verbosity, interactive=False, aliases=aliases,
                                     serialized_aliases=serialized_aliases, keepdb=keepdb)
    yield
    if not django_db_keepdb:
        with django_db_blocker.unblock():
            try:
                teardown_databases(db_cfg, verbosity=verbosity)
            except Exception as exc:  # noqa: BLE001 (pytest-django's: a warning, not a failed run)
                request.node.warn(pytest.PytestWarning(f"Error when trying to teardown test databases: {exc!r}"))


def pytest_configure(config):
    """One run at a time on the same PostgreSQL and Redis (tests/run_lock.py): taken by the run itself, not by its
    xdist workers, before any test database exists. And `python3` on PATH past a version manager's shim
    (tests/python_on_path.py), for the run and the workers it starts."""
    if hasattr(config, "workerinput"):
        return  # the workers start with the environment set below
    os.environ["PATH"] = python_on_path.path_past_shims(os.environ.get("PATH", ""))
    if config.option.collectonly:
        return  # collecting creates nothing on the servers (`make test` collects beside mypy to warm the caches)
    from django.conf import settings

    try:
        config._test_run_lock = run_lock.acquire(
            run_lock.lock_path(settings.DATABASES["default"], settings.CELERY_BROKER_URL),
            wait_s=run_lock.wait_s_from_environment(), say=lambda line: print(line, file=sys.stderr, flush=True))
    except run_lock.RunLockTimeout as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_unconfigure(config):
    lock = getattr(config, "_test_run_lock", None)
    if lock is not None:
        lock.close()


def pytest_collection_modifyitems(config, items):
    """Every test has its own id. schemathesis names its cases `test[GET /path]` but gives them all the function's
    id: pytest-xdist's --dist loadgroup (make test) keys tests by id and would run one of them, silently.

    And under --dist loadgroup a test's xdist_group ends its id (`...@docker`): pytest-xdist 3.8 writes that to
    `_nodeid`, which pytest 9 no longer reads (`_id`), so without this a group's tests would spread over workers."""
    for item in items:
        if "[" in item.name and not item.nodeid.endswith("]"):
            item._id = item.parent.id.child(item.name)  # the id pytest gives a node (_pytest/nodes.py, pytest 9)
        groups = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                         for mark in item.iter_markers("xdist_group")})
        if groups and getattr(config.option, "loadgroup", False) and "@" not in item.nodeid.rpartition("]")[2]:
            item._id = coerce_node_id(f"{item.nodeid}@{'_'.join(groups)}")
    seen: set[str] = set()
    twice = sorted({item.nodeid for item in items if item.nodeid in seen or seen.add(item.nodeid)})
    if twice:
        raise pytest.UsageError(f"tests with the same id (pytest-xdist would run only one): {twice[:5]}")


@pytest.fixture(autouse=True)
def _celery_current_app_stays_the_projects():
    """Services queue through `celery.current_app` (core.dispatch, the fleet fan-out). A test that makes another
    Celery app current (Celery(...) without set_as_current=False) silently sends every later test's tasks to a
    queue with no routes, which the suite's worker never reads: fail that test by name, and put the app back."""
    from celery import current_app

    from config.celery import app as project_app

    yield
    current = current_app._get_current_object()
    if current is not project_app:
        project_app.set_current()
        pytest.fail(f"this test left the Celery app {current.main!r} current, not the project's; create test apps "
                    "with set_as_current=False", pytrace=False)


@pytest.fixture(autouse=True)
def _migrations_left_at_the_latest(request):
    """A test that migrates the database backwards (a data migration's test) must leave it at the latest
    migrations: else every later test in the session runs against an old schema (a column missing)."""
    yield
    if "MigrationExecutor" not in vars(request.module):
        return
    from django.db import connection
    from django.db.migrations.executor import MigrationExecutor

    with request.getfixturevalue("django_db_blocker").unblock():
        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
        if plan:
            executor.migrate(executor.loader.graph.leaf_nodes())
            pytest.fail(f"this test left the database before {[m.name for m, _ in plan][:3]}; migrate back to the "
                        "latest migrations when done", pytrace=False)


def _uses_db(request) -> bool:
    return bool(
        request.node.get_closest_marker("django_db")
        or {"db", "transactional_db", "django_db_reset_sequences"} & set(request.fixturenames)
    )


@pytest.fixture(autouse=True)
def _reference_data(request):
    """Transactional tests flush every table, including the rows the data migrations load (the GPU catalogue, the
    images): put them back, as migrated, for the tests that come after (tests/reference_data.py)."""
    if not _uses_db(request):
        return
    request.getfixturevalue("django_db_setup")
    from tests import reference_data

    with request.getfixturevalue("django_db_blocker").unblock():
        reference_data.take_snapshot()
        reference_data.restore()


@pytest.fixture(autouse=True)
def _tasks_run_only_for_tests_with_the_worker(request):
    """tests/live.py (session_worker_for): the suite's worker takes tasks only during the tests that ask for it;
    what another test queued is dropped before the worker takes tasks again."""
    from tests.live import session_worker_for

    session_worker_for(request)


@pytest.fixture(autouse=True)
def _clear_cache():
    # Throttle counters live in the shared cache (Redis); every test starts fresh.
    from django.core.cache import cache

    cache.clear()
    yield


@pytest.fixture
def anon():
    return APIClient()


def _client_for(user):
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_key_for(user)}")
    client.user = user
    return client


@pytest.fixture
def user(db):
    return UserFactory()


@pytest.fixture
def client_for(db):
    return _client_for


@pytest.fixture
def api(user):
    """An API client authenticated with an API key of `user`."""
    return _client_for(user)


@pytest.fixture
def other_api(db):
    return _client_for(UserFactory())


@pytest.fixture
def operator_api(db):
    """A staff account allowed to view and change nodes and to view their checks (as the admin asks): it sees every
    live node and its runs, and may ask for a re-check. Other permissions (refunds, ...) are added by the tests
    that need them."""
    from django.contrib.auth.models import Permission

    operator = UserFactory(is_staff=True)
    operator.user_permissions.add(*Permission.objects.filter(content_type__app_label="marketplace",
                                                             codename__in=("view_node", "change_node")),
                                  Permission.objects.get(content_type__app_label="provisioning",
                                                         codename="view_verificationrun"))
    return _client_for(operator)
