from django.db import migrations, models

from marketplace.catalogue_data import load_gpu_models


def forwards(apps, schema_editor):
    load_gpu_models(apps.get_model("marketplace", "GpuModel"))


class Migration(migrations.Migration):
    """memory.total with ECC on and off, per model (issue 11): the acceptance policy compares the size a node
    reports with the one its ECC mode gives. Filled from marketplace/data/gpu_models.json."""

    dependencies = [("marketplace", "0010_declared_states")]
    operations = [
        migrations.AddField(model_name="gpumodel", name="memory_mib_ecc_off",
                            field=models.PositiveIntegerField(default=0, help_text="memory.total with ECC off (MiB).")),
        migrations.AddField(model_name="gpumodel", name="memory_mib_ecc_on",
                            field=models.PositiveIntegerField(default=0, help_text="memory.total with ECC on (MiB).")),
        migrations.RunPython(forwards, migrations.RunPython.noop),
        migrations.AlterField(model_name="gpumodel", name="memory_mib_ecc_off",
                              field=models.PositiveIntegerField(help_text="memory.total with ECC off (MiB).")),
        migrations.AlterField(model_name="gpumodel", name="memory_mib_ecc_on",
                              field=models.PositiveIntegerField(help_text="memory.total with ECC on (MiB).")),
    ]
