"""Room on each page for the metering tick's updates: of every running instance, and of the accounts it posts to.

Each tick rewrites every running instance's billed_until / billed_seconds / cost_micros, and each of its
batches the cached balance of every account it touches (5,501 accounts, five times a tick at 50,000
instances). None of those columns is indexed, so PostgreSQL can write the new row version beside the old one
without touching the table's indexes (a HOT update: seven index entries saved per instance row, four per
account), but only if the page has room for it. On tightly packed pages (the default fillfactor, 100) 0.3 % of
the instance updates and a third of the account updates were HOT; with pages half filled by inserts, 99.6 %
and 100 % (docs/BENCHMARKS.md, "Metering"). Both tables are small (a row per instance, two per user).

It applies to pages written from now on: rows move to roomier pages as they are updated; `VACUUM FULL` of the
table applies it at once (it locks the table: a maintenance window). PostgreSQL only.
"""
from django.db import migrations

TABLES = ("marketplace_instance", "billing_account")


def _run(schema_editor, sql):
    if schema_editor.connection.vendor == "postgresql":
        for table in TABLES:
            schema_editor.execute(sql.format(table=table))


def forwards(apps, schema_editor):
    _run(schema_editor, "ALTER TABLE {table} SET (fillfactor = 50)")


def backwards(apps, schema_editor):
    _run(schema_editor, "ALTER TABLE {table} RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [("billing", "0007_set_based_ledger_checks"), ("marketplace", "0015_volumes_and_host_facts")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
