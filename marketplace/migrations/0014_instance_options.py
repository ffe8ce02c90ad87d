"""Instance options (issue 12): the renter's own image and registry login, env, onstart, ports, minimum CUDA
version; what the node reports (mapped ports, OS). And the stock images say what they really contain: a
simulated (demo) server's instance is a shell on the demo host, with none of the image's software."""

import django.db.models.deletion
from django.db import migrations, models

SIM_NOTE = (" On a simulated (demo) server none of this is installed: its instance is a shell on the demo host "
            "with a simulated nvidia-smi; the instance page shows the OS it really runs.")
DESCRIPTIONS = {
    "cuda-12-4": "NVIDIA CUDA 12.4.1 runtime libraries with cuDNN on Ubuntu 22.04, plus an SSH server; no "
                 "framework (bring your own). Docker: built on nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04.",
    "pytorch-2-5": "PyTorch 2.5.1 (Python 3) with CUDA 12.4 and cuDNN 9 on Ubuntu 22.04, plus an SSH server. "
                   "Docker: built on pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime.",
    "tensorflow-2-17": "TensorFlow 2.17.0 (Python 3) with GPU support on Ubuntu 22.04, plus an SSH server. "
                       "Docker: built on tensorflow/tensorflow:2.17.0-gpu.",
}


def describe_images(apps, schema_editor):
    Image = apps.get_model("marketplace", "Image")
    for slug, text in DESCRIPTIONS.items():
        Image.objects.filter(slug=slug).update(description=text + SIM_NOTE)


class Migration(migrations.Migration):

    dependencies = [
        ('marketplace', '0013_api_key_scopes_and_expiry'),
    ]

    operations = [
        migrations.AddField(
            model_name='instance',
            name='env',
            field=models.JSONField(blank=True, default=dict, help_text='Environment variables set in the instance.'),
        ),
        migrations.AddField(
            model_name='instance',
            name='image_ref',
            field=models.CharField(blank=True, help_text="The renter's own image: an OCI reference (when `image` is empty).", max_length=512),
        ),
        migrations.AddField(
            model_name='instance',
            name='min_cuda_version',
            field=models.CharField(blank=True, help_text="The renter's minimum, e.g. 12.2.", max_length=8),
        ),
        migrations.AddField(
            model_name='instance',
            name='onstart',
            field=models.TextField(blank=True, help_text='Script run once at the first boot, inside the instance.'),
        ),
        migrations.AddField(
            model_name='instance',
            name='os',
            field=models.CharField(blank=True, help_text="The instance's OS as its node read it (PRETTY_NAME).", max_length=200),
        ),
        migrations.AddField(
            model_name='instance',
            name='ports',
            field=models.JSONField(blank=True, default=dict, help_text='Where they are reachable, as the node mapped them: {"8888/tcp": {...}}.'),
        ),
        migrations.AddField(
            model_name='instance',
            name='ports_requested',
            field=models.JSONField(blank=True, default=list, help_text='Container TCP ports to expose.'),
        ),
        migrations.AddField(
            model_name='instance',
            name='registry_auth',
            field=models.BooleanField(default=False, help_text='Whether a registry login was given.'),
        ),
        migrations.AddField(
            model_name='instance',
            name='registry_auth_encrypted',
            field=models.BinaryField(blank=True, help_text='Fernet token; never shown.', null=True),
        ),
        migrations.AlterField(
            model_name='instance',
            name='image',
            field=models.ForeignKey(blank=True, null=True, on_delete=django.db.models.deletion.PROTECT, related_name='instances', to='marketplace.image'),
        ),
        migrations.AddConstraint(
            model_name='instance',
            constraint=models.CheckConstraint(condition=models.Q(models.Q(('image__isnull', False), ('image_ref', '')), models.Q(('image__isnull', True), models.Q(('image_ref', ''), _negated=True)), _connector='OR'), name='instance_image_xor_reference'),
        ),
            migrations.RunPython(describe_images, migrations.RunPython.noop),
    ]
