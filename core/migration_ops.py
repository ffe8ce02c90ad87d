"""Migration operations of this project's own."""
from typing import Any

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations


class AddIndexConcurrentlyWherePossible(AddIndexConcurrently):
    """CREATE INDEX CONCURRENTLY on PostgreSQL (a large table's writers are not blocked while it is built); a plain
    AddIndex on another database (SQLite's first run and demo), which has no CONCURRENTLY and where
    AddIndexConcurrently fails the migrate. The migration using it must set `atomic = False`."""

    def database_forwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            return super().database_forwards(app_label, schema_editor, from_state, to_state)
        return migrations.AddIndex.database_forwards(self, app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label: str, schema_editor: Any, from_state: Any, to_state: Any) -> None:
        if schema_editor.connection.vendor == "postgresql":
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        return migrations.AddIndex.database_backwards(self, app_label, schema_editor, from_state, to_state)
