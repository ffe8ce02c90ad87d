# The job outbox and heartbeats: whether and when a job was handed to the broker, and which execution holds it
# now with its last sign of life (provisioning/services/jobs.py, provisioning/services/runner.py).
# Open jobs from before have no sent_at: the dispatcher sends them once more (a duplicate is dropped by the claim).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('provisioning', '0002_health_samples_and_run_index'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='heartbeat_at',
            field=models.DateTimeField(blank=True, help_text='Last sign of life of the execution holding it (or when a retry is due). Stale: the dispatcher sends the job again.', null=True),
        ),
        migrations.AddField(
            model_name='job',
            name='lost_runs',
            field=models.PositiveSmallIntegerField(default=0, help_text='Executions lost with their worker.'),
        ),
        migrations.AddField(
            model_name='job',
            name='runner',
            field=models.CharField(blank=True, help_text="'<task id> <worker>:<pid>:<nonce>' of the execution holding it; empty when none does (queued, or waiting to be retried).", max_length=255),
        ),
        migrations.AddField(
            model_name='job',
            name='send_attempts',
            field=models.PositiveIntegerField(default=0, help_text='Times it was handed (or tried) to the broker.'),
        ),
        migrations.AddField(
            model_name='job',
            name='send_error',
            field=models.CharField(blank=True, help_text='Why the last hand-off failed, if it did.', max_length=500),
        ),
        migrations.AddField(
            model_name='job',
            name='sent_at',
            field=models.DateTimeField(blank=True, help_text='When it was last handed to the broker.', null=True),
        ),
    ]
