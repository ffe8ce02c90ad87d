"""tests/db_template.py: test databases copied from one migrated template, rebuilt when what migrates changes."""
import threading
import time

import pytest
from django.db import connection, connections

from tests import db_template
from tests.db_template import ROOT


@pytest.fixture(scope="module")
def inputs():
    return db_template.inputs()


@pytest.mark.django_db
def test_the_test_database_is_a_copy_of_the_current_template_at_the_latest_migrations(inputs):
    from django.db.migrations import executor as migrations  # not a module name: conftest's backwards-migration check

    files, versions = inputs
    template = db_template.copied_from["default"]
    assert template.endswith("_tpl_" + db_template.digest(files, versions))
    with connection.cursor() as cursor:
        cursor.execute("SELECT datallowconn FROM pg_database WHERE datname = %s", [template])
        assert cursor.fetchall() == [(False,)], f"no template {template} (or one anyone may connect to)"
    executor = migrations.MigrationExecutor(connection)
    assert executor.migration_plan(executor.loader.graph.leaf_nodes()) == []


def test_the_digest_covers_every_migration_and_what_they_read(inputs):
    files, versions = inputs
    for path in ROOT.glob("*/migrations/0*.py"):
        assert str(path.relative_to(ROOT)) in files
    assert "marketplace/catalogue_data.py" in files  # a data migration's loader, and the file it reads
    assert "marketplace/data/gpu_models.json" in files
    assert "core/migration_ops.py" in files
    assert "django.contrib.auth.migrations.0001_initial" in files  # installed apps' migrations too
    assert any(version.startswith("Django==") for version in versions)


@pytest.mark.parametrize("name", ["marketplace/migrations/0001_initial.py", "marketplace/data/gpu_models.json",
                                  "marketplace/catalogue_data.py"])
def test_a_changed_migration_or_migration_input_gets_another_template(inputs, tmp_path, name):
    files, versions = inputs
    same, changed = tmp_path / "same", tmp_path / "changed"
    same.write_bytes(files[name].read_bytes())
    changed.write_bytes(files[name].read_bytes() + b"\n")
    assert db_template.digest({**files, name: same}, versions) == db_template.digest(files, versions)
    assert db_template.digest({**files, name: changed}, versions) != db_template.digest(files, versions)
    assert db_template.digest(files, [*versions, "django-otp==99"]) != db_template.digest(files, versions)


def test_a_project_file_the_build_read_outside_the_digest_is_named(inputs, tmp_path):
    files, _ = inputs
    opened = [ROOT / "marketplace/data/gpu_models.json", ROOT / "README.md", tmp_path / "elsewhere",
              ROOT / "marketplace/__pycache__/catalogue_data.cpython-311.pyc", ROOT / "marketplace/api/offers.py",
              ROOT / "marketplace/migrations/__init__.py"]  # empty: a package marker
    assert db_template.unhashed_project_files(opened, files.values()) == ["README.md", "marketplace/api/offers.py"]


def _drop(names):
    with connection.creation._nodb_cursor() as cursor:
        for name in names:
            cursor.execute(f"DROP DATABASE IF EXISTS {connection.ops.quote_name(name)}")


@pytest.mark.django_db  # the test database set up, whose name the databases here take
def test_one_of_several_workers_builds_the_template_the_others_wait_and_stale_ones_are_dropped(
        inputs, django_db_blocker):
    """Two threads (each its own connection, as two xdist workers) ask at once: one migrates, the other waits for
    it and finds the template complete; a template of other migrations is dropped. The databases here are named
    after the test database (test_test_...), apart from the suite's own template."""
    files, versions = inputs
    assert connection.settings_dict["NAME"].startswith("test_")  # never the suite's own template (test_<name>_tpl_)
    name = db_template.template_name(connection.settings_dict["NAME"], db_template.digest(files, versions))
    stale = name.rpartition("_")[0] + "_0123456789abcdef"
    builds, results, errors = [], [], []

    def migrate():  # stands for create_test_db: creates the database TEST NAME names
        builds.append(connection.settings_dict["TEST"]["NAME"])
        with connection.creation._nodb_cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {connection.ops.quote_name(connection.settings_dict['TEST']['NAME'])}")
        time.sleep(1)

    def worker():
        try:
            with django_db_blocker.unblock():
                results.append(db_template.ensure_template(connection, migrate, say=lambda line: None))
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
        finally:
            connections.close_all()

    with django_db_blocker.unblock():
        _drop([name, name + db_template.BUILDING_SUFFIX, stale])
        with connection.creation._nodb_cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {connection.ops.quote_name(stale)}")
    try:
        threads = [threading.Thread(target=worker) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors
        assert results == [name, name]
        assert builds == [name + db_template.BUILDING_SUFFIX]
        with django_db_blocker.unblock(), connection.creation._nodb_cursor() as cursor:
            cursor.execute("SELECT datname, datallowconn FROM pg_database WHERE starts_with(datname, %s)",
                           [name.rpartition("_")[0]])
            assert cursor.fetchall() == [(name, False)]
    finally:
        with django_db_blocker.unblock():
            _drop([name, name + db_template.BUILDING_SUFFIX, stale])
