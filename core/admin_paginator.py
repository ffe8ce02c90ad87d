"""A paginator for the admin's lists of the very large tables (usage intervals, ledger transactions).

The admin counts its list to number the pages; on a table of millions of rows COUNT(*) reads all of it on every
page, and grows with the table. The unfiltered list's count is PostgreSQL's own estimate instead
(pg_class.reltuples, kept by ANALYZE and autovacuum) when the estimate is large: the page numbers are about right,
the rows shown exact. A filtered or searched list, a small table, a table never analysed, or another database count
exactly. Give the model admin `show_full_result_count = False` too (the "N total" count is a second COUNT(*)).
"""
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import QuerySet
from django.utils.functional import cached_property

ESTIMATE_ABOVE = 100_000  # rows: an exact count of fewer is cheap enough


class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]  # generic in the stubs only
    estimate_above = ESTIMATE_ABOVE

    @cached_property
    def count(self) -> int:
        estimate = self.estimate()
        if estimate is not None and estimate > self.estimate_above:
            return estimate
        rows = self.object_list
        return rows.count() if isinstance(rows, QuerySet) else len(rows)

    def estimate(self) -> int | None:
        """PostgreSQL's estimate of the table's rows when the list is the whole table, else None."""
        rows = self.object_list
        if not isinstance(rows, QuerySet):
            return None
        query = rows.query
        if query.where or query.is_sliced or query.distinct or query.combinator or query.group_by is not None:
            return None
        connection = connections[rows.db]
        if connection.vendor != "postgresql":
            return None
        with connection.cursor() as cursor:
            cursor.execute("SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)",
                           [connection.ops.quote_name(rows.model._meta.db_table)])
            row = cursor.fetchone()
        # -1: never analysed (PostgreSQL 14 on); none: no such table (a view, another schema)
        return int(row[0]) if row is not None and row[0] is not None and row[0] >= 0 else None
