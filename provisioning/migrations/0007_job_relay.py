"""The job relay (issue 14): an index of the jobs never handed to the broker, and a trigger that wakes the relays
(LISTEN job_outbox) when a transaction that inserted jobs commits. PostgreSQL only: elsewhere there is no relay
(the on-commit send and the dispatcher send the jobs)."""
from django.db import migrations, models

NOTIFY_FUNCTION = """
CREATE OR REPLACE FUNCTION provisioning_job_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- One notification per transaction at most: PostgreSQL folds identical ones, and delivers them at commit.
    PERFORM pg_notify('job_outbox', '');
    RETURN NULL;
END $$;
CREATE TRIGGER provisioning_job_outbox_notify AFTER INSERT ON provisioning_job
    FOR EACH STATEMENT EXECUTE FUNCTION provisioning_job_outbox_notify();
"""
DROP = """
DROP TRIGGER IF EXISTS provisioning_job_outbox_notify ON provisioning_job;
DROP FUNCTION IF EXISTS provisioning_job_outbox_notify();
"""


def on_postgresql(sql):
    def run(apps, schema_editor):
        if schema_editor.connection.vendor == "postgresql":
            schema_editor.execute(sql)
    return run


class Migration(migrations.Migration):

    dependencies = [
        ('provisioning', '0006_volume_jobs'),
    ]

    operations = [
        migrations.AddIndex(
            model_name='job',
            index=models.Index(condition=models.Q(('send_attempts', 0), ('sent_at__isnull', True), ('status', 'queued')), fields=['id'], name='job_relay_unsent_idx'),
        ),
        migrations.RunPython(on_postgresql(NOTIFY_FUNCTION), on_postgresql(DROP)),
    ]
