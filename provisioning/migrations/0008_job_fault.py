"""Job.fault: whose failure a failed job is (node, platform, renter); only the node's count against its reliability.
Jobs that failed before it was recorded keep today's meaning: the node's."""
from django.db import migrations, models


def failed_jobs_were_the_nodes(apps, schema_editor):
    apps.get_model("provisioning", "Job").objects.filter(status="failed").update(fault="node")


class Migration(migrations.Migration):

    dependencies = [
        ('provisioning', '0007_job_relay'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='fault',
            field=models.CharField(blank=True, choices=[('node', "The node's"), ('platform', "The platform's"), ('renter', "The renter's")], default='', help_text="Whose failure it is (failed jobs only); only the node's count against its reliability.", max_length=8),
        ),
        migrations.AddConstraint(
            model_name='job',
            constraint=models.CheckConstraint(condition=models.Q(('fault', ''), models.Q(('fault__in', ['node', 'platform', 'renter']), ('status', 'failed')), _connector='OR'), name='job_fault_of_a_failed_job'),
        ),
        # After the ALTERs: rows updated first would leave trigger events pending in the same transaction.
        migrations.RunPython(failed_jobs_were_the_nodes, migrations.RunPython.noop, elidable=True),
    ]
