"""The rows the migrations load (the GPU catalogue, the stock images as later migrations reworded them, anything a
future data migration adds), kept as the freshly migrated test database held them and put back after a
transactional test's flush empties their tables.

Replaying chosen migration functions instead once put back the images as 0005 wrote them, not as 0014 reworded
them: a later test then failed or passed by which tests its xdist worker had run before it. A snapshot has no such
list to keep up to date."""
from django.apps import apps
from django.core import serializers
from django.db import connection

_snapshot: dict[str, str] | None = None


def take_snapshot() -> None:
    """Once per test process, before any test has flushed: every table the migrations left with rows."""
    global _snapshot
    if _snapshot is None:
        _snapshot = {model._meta.label: serializers.serialize("json", model._base_manager.order_by("pk"))
                     for model in apps.get_models() if model._base_manager.exists()}


def restore() -> None:
    """Put back each snapshot table that is now empty, row for row (same primary keys)."""
    if _snapshot is None:
        raise RuntimeError("take_snapshot() first, on the freshly migrated database")
    # Every test that uses the database asks: one round trip for all the tables, not one each.
    tables = [connection.ops.quote_name(apps.get_model(label)._meta.db_table) for label in _snapshot]
    with connection.cursor() as cursor:
        cursor.execute("SELECT " + ", ".join(f"EXISTS (SELECT 1 FROM {table})" for table in tables))  # noqa: S608
        present = cursor.fetchone()
    for rows, there in zip(_snapshot.values(), present, strict=True):
        if not there:
            for obj in serializers.deserialize("json", rows):
                obj.save()


def snapshot_labels() -> list[str]:
    return sorted(_snapshot or ())
