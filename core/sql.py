"""Hot-path SQL on PostgreSQL: statements prepared once per connection, and a model's INSERT without the ORM's
compiler. For the few statements a path runs very often (a booking's: bench/booking.py), where compiling the
statement in Python and planning it in PostgreSQL cost more than running it.

- `prepared_cursor()`: Django's own cursors bind parameters client-side (psycopg's ClientCursor) and never prepare;
  this one binds them server-side and asks psycopg to prepare each statement, so that PostgreSQL parses and plans
  it once per connection and then only executes it. It goes through Django's cursor wrapper: the queries are logged
  under DEBUG and counted by CaptureQueriesContext like any other. DATABASE_PREPARED_STATEMENTS=0 turns the
  preparing off (a transaction-pooling PgBouncer older than 1.21 cannot keep prepared statements).
- `ModelInsert`: a model's `INSERT ... RETURNING id` written once, and the values of an unsaved instance computed by
  the same field methods `Model.save()` uses (defaults, auto_now, JSON and encrypted fields alike).
- `constraint_violated(exc)`: the name of the constraint an IntegrityError broke, from PostgreSQL's diagnostics.
"""
import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connection, connections, models
from django.db.backends.utils import CursorDebugWrapper, CursorWrapper


def _cursor_class() -> type:
    from django.db.backends.postgresql.base import ServerBindingCursor  # psycopg 3 only
    from psycopg.raw_cursor import PostgresRawQuery

    class PreparingCursor(ServerBindingCursor):
        # The statement reaches psycopg already numbered ($1, $2, ...: _numbered, once per text): psycopg converts
        # %s itself on every execution when a statement is over 4 KiB or 50 parameters (a booking's is both).
        _query_cls = PostgresRawQuery

        def execute(self, query, params=None, *, prepare=None, binary=None):  # type: ignore[no-untyped-def]
            prepare = settings.DATABASE_PREPARED_STATEMENTS if prepare is None else prepare
            if params is not None:
                query = _numbered(query)
            return super().execute(query, params, prepare=prepare or None, binary=binary)  # type: ignore[misc]

    return PreparingCursor


@functools.lru_cache(maxsize=512)
def _numbered(query: str) -> str:
    """`%s` placeholders as PostgreSQL's `$1, $2, ...` (and `%%` as `%`); anything else after a `%` is refused."""
    count = 0

    def one(match: re.Match[str]) -> str:
        nonlocal count
        if match.group(1) == "%":
            return "%"
        if match.group(1) != "s":
            raise ValueError(f"prepared_cursor takes %s placeholders only, not %{match.group(1)}: {query[:80]}")
        count += 1
        return f"${count}"

    return re.sub(r"%(.)", one, query, flags=re.DOTALL)


_PREPARING_CURSOR: type | None = None


class _PreparedDebugWrapper(CursorDebugWrapper):
    """Django's debug wrapper logs the text psycopg last sent, and a prepared statement's execution sends none: log
    the statement with its parameters composed in, as Django does for server-side binding."""

    def execute(self, sql, params=None):  # type: ignore[no-untyped-def]
        try:
            text = self.db.ops.compose_sql(sql, params)  # PostgreSQL's ops
        except Exception:  # noqa: BLE001 (only the log's text)
            text = sql
        with self.debug_sql(text, params):
            return CursorWrapper.execute(self, sql, params)


@contextmanager
def prepared_cursor() -> Iterator[Any]:
    """A cursor on Django's connection (and in its transaction) whose statements PostgreSQL prepares. Parameters
    are `%s` placeholders as usual; they are typed by their Python values (an int, a list → an array, ...)."""
    global _PREPARING_CURSOR
    db = connections[DEFAULT_DB_ALIAS]  # the wrapper itself: each attribute of the proxy is an asgiref lookup
    if db.vendor != "postgresql":
        with db.cursor() as cursor:
            yield cursor
        return
    if _PREPARING_CURSOR is None:
        _PREPARING_CURSOR = _cursor_class()
    db.ensure_connection()
    if settings.DATABASE_PREPARED_STATEMENTS and db.connection.prepare_threshold is None:
        # Django turns psycopg's preparing off (None), which also ignores prepare=True: only the statements asked
        # for here are prepared, never automatically (Django's own cursors bind client-side and cannot be).
        db.connection.prepare_threshold = 2**31 - 1
    raw = _PREPARING_CURSOR(db.connection)
    cursor = _PreparedDebugWrapper(raw, db) if db.queries_logged else db.make_cursor(raw)
    try:
        yield cursor
    finally:
        raw.close()


class ModelInsert:
    """`INSERT INTO <table> (<every concrete column but the id>) VALUES (...) RETURNING id` for one model.

    The statement is built once per model; `insert(cursor, obj)` fills it from an unsaved instance with each
    field's `pre_save` and `get_db_prep_save` (what `Model.save()` calls), sets the id and marks the instance
    saved. No signals are sent (the models it is used for have no receivers)."""

    def __init__(self, model: type[models.Model]):
        meta = model._meta
        self.model = model
        self.fields = [f for f in meta.concrete_fields if not f.primary_key]
        quote = connection.ops.quote_name
        columns = ", ".join(quote(str(f.column)) for f in self.fields)
        table, pk = str(meta.db_table), str(meta.pk.column if meta.pk else "id")
        self.pk_column = quote(pk)
        self.sql = (f"INSERT INTO {quote(table)} ({columns}) "  # noqa: S608 (names from the model)
                    f"VALUES ({', '.join(['%s'] * len(self.fields))}) RETURNING {self.pk_column}")

    def values(self, obj: models.Model, *, skip: frozenset[str] = frozenset()) -> list[Any]:
        """The parameters of `sql` (or of `sql_with(...)`, whose columns in `skip` take no parameter)."""
        db = connections[DEFAULT_DB_ALIAS]  # not the proxy: fields read it dozens of times (asgiref locals)
        return [f.get_db_prep_save(f.pre_save(obj, True), db) for f in self.fields if f.column not in skip]

    def sql_with(self, **expressions: str) -> str:
        """The INSERT with SQL expressions in place of some columns' parameters (column=expression): for a CTE
        that inserts a row referring to a row another CTE of the same statement inserts, e.g.
        `instance_id="(SELECT id FROM inst)"`. Fill it with `values(obj, skip=frozenset(expressions))`."""
        unknown = set(expressions) - {str(f.column) for f in self.fields}
        if unknown:
            raise ValueError(f"{self.model.__name__} has no column {', '.join(sorted(unknown))}")
        slots = ", ".join(expressions.get(str(f.column), "%s") for f in self.fields)
        return f"{self.sql.split(' VALUES ', 1)[0]} VALUES ({slots}) RETURNING {self.pk_column}"

    def insert(self, cursor: Any, obj: models.Model) -> models.Model:
        cursor.execute(self.sql, self.values(obj))
        obj.pk = cursor.fetchone()[0]
        obj._state.adding = False
        obj._state.db = DEFAULT_DB_ALIAS
        return obj


def constraint_violated(exc: BaseException) -> str:
    """The name of the constraint (or unique index) a database error broke, as PostgreSQL reports it in the
    error's diagnostics; "" where it does not say (SQLite names the columns only; an error built by hand).

    Never look for a name in `str(exc)`: PostgreSQL's message carries a DETAIL line with the offending values (the
    key's columns, or the whole failing row for a CHECK or NOT NULL violation), anyone's input among them, so a
    value that spells another constraint's name is taken for that constraint; and one name may contain another."""
    diag = getattr(exc, "diag", None) or getattr(exc.__cause__, "diag", None)  # psycopg's, or under Django's
    return getattr(diag, "constraint_name", None) or ""
