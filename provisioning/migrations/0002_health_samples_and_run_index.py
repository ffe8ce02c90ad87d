# Health samples per node and day (reliability), and an index for a node's verification history.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('marketplace', '0003_renting_and_node_health'),
        ('provisioning', '0001_initial'),
    ]

    operations = [
        migrations.CreateModel(
            name='HealthSample',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('day', models.DateField()),
                ('ok', models.PositiveIntegerField(default=0)),
                ('failed', models.PositiveIntegerField(default=0)),
            ],
            options={
                'ordering': ['node_id', '-day'],
            },
        ),
        migrations.AddIndex(
            model_name='verificationrun',
            index=models.Index(fields=['node', '-created_at'], name='verification_node_recent_idx'),
        ),
        migrations.AddField(
            model_name='healthsample',
            name='node',
            field=models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='health_samples', to='marketplace.node'),
        ),
        migrations.AddConstraint(
            model_name='healthsample',
            constraint=models.UniqueConstraint(fields=('node', 'day'), name='health_sample_one_per_node_day'),
        ),
    ]
