"""Job.fault host_key: a job that met the changed SSH host key its node is quarantined for already
(provisioning.services.nodes.HostKeyStillChanged). Counted once by the quarantine, not again, and not the platform's
either: such jobs were recorded fault=platform, in the operators' count of the platform's own failures. The jobs
recorded so (their error says "The node is quarantined for this key already.") are given the new value, their
error's closing sentence with it. Choices and a check constraint only: works on SQLite too."""
from django.db import migrations, models

STILL_CHANGED = "The node is quarantined for this key already."
PLATFORM_SAID = "This was the platform's failure, not the node's: it does not count against the node."
HOST_KEY_SAID = ("The node's host key change was counted once, by its quarantine: this does not count against the "
                 "node again.")


def reclassify(apps, schema_editor):
    Job = apps.get_model("provisioning", "Job")
    for job in Job.objects.filter(status="failed", fault="platform", error__contains=STILL_CHANGED).only("error"):
        job.fault = "host_key"
        job.error = job.error.replace(PLATFORM_SAID, HOST_KEY_SAID)
        job.save(update_fields=["fault", "error"])


def back_to_platform(apps, schema_editor):
    Job = apps.get_model("provisioning", "Job")
    for job in Job.objects.filter(fault="host_key").only("error"):
        job.fault = "platform"
        job.error = job.error.replace(HOST_KEY_SAID, PLATFORM_SAID)
        job.save(update_fields=["fault", "error"])


class Migration(migrations.Migration):

    dependencies = [
        ('provisioning', '0008_job_fault'),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='job',
            name='job_fault_of_a_failed_job',
        ),
        migrations.AlterField(
            model_name='job',
            name='fault',
            field=models.CharField(blank=True, choices=[('node', "The node's"), ('platform', "The platform's"), ('renter', "The renter's"), ('host_key', "The node's changed host key (counted once, by its quarantine)")], default='', help_text="Whose failure it is (failed jobs only); only the node's count against its reliability.", max_length=8),
        ),
        migrations.AddConstraint(
            model_name='job',
            constraint=models.CheckConstraint(condition=models.Q(('fault', ''), models.Q(('fault__in', ['node', 'platform', 'renter', 'host_key']), ('status', 'failed')), _connector='OR'), name='job_fault_of_a_failed_job'),
        ),
        # After the ALTERs: rows updated first would leave trigger events pending in the same transaction.
        migrations.RunPython(reclassify, back_to_platform, elidable=True),
    ]
