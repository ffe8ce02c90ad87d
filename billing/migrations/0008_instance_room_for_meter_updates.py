"""Room on each page of marketplace_instance for the metering tick's update of every running instance.

The tick rewrites each running instance's billed_until / billed_seconds / cost_micros every minute. None of
those columns is indexed, so PostgreSQL can write the new row version beside the old one without touching the
table's seven indexes (a HOT update), but only if the page has room for it. Tightly packed pages (the default
fillfactor, 100) left 0.3 % of the tick's 50,000 updates HOT; each of the others wrote seven index entries.
With pages half filled by inserts, 94 % are HOT (docs/BENCHMARKS.md, "Metering"). The table is small (a row per
instance), so doubling its pages costs little.

It applies to pages written from now on: rows move to roomier pages as they are updated; `VACUUM FULL
marketplace_instance` applies it at once (it locks the table: a maintenance window). PostgreSQL only.
"""
from django.db import migrations


def _run(schema_editor, sql):
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(sql)


def forwards(apps, schema_editor):
    _run(schema_editor, "ALTER TABLE marketplace_instance SET (fillfactor = 50)")


def backwards(apps, schema_editor):
    _run(schema_editor, "ALTER TABLE marketplace_instance RESET (fillfactor)")


class Migration(migrations.Migration):
    dependencies = [("billing", "0007_set_based_ledger_checks"), ("marketplace", "0015_volumes_and_host_facts")]

    operations = [migrations.RunPython(forwards, backwards, elidable=False)]
