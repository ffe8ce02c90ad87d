from django.db import migrations

from marketplace.catalogue_data import load_gpu_models


def forwards(apps, schema_editor):
    load_gpu_models(apps.get_model("marketplace", "GpuModel"))


class Migration(migrations.Migration):
    dependencies = [("marketplace", "0001_initial")]
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
