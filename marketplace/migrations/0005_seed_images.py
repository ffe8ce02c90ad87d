"""The images renters start from: CUDA base, PyTorch, TensorFlow.

Docker names are the platform's derived images (the official ones plus sshd), built from
provisioning/images/Dockerfile; libvirt names are cloud images the node keeps as
<GPUMARKET_LIBVIRT_IMAGES>/<name>.qcow2 (the agent adds the suffix). See provisioning/images/README.md.
"""
from django.db import migrations

IMAGES = [
    {
        "slug": "cuda-12-4",
        "name": "CUDA 12.4 (Ubuntu 22.04)",
        "description": "NVIDIA CUDA 12.4.1 runtime with cuDNN on Ubuntu 22.04: bring your own framework. "
                       "Built on nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04.",
        "docker_image": "gpumarket/cuda:12.4.1-cudnn-runtime-ubuntu22.04",
        "libvirt_image": "ubuntu-22.04-cuda-12.4",
        "min_disk_gb": 20,
    },
    {
        "slug": "pytorch-2-5",
        "name": "PyTorch 2.5.1 (CUDA 12.4, cuDNN 9)",
        "description": "PyTorch 2.5.1 with CUDA 12.4 and cuDNN 9 on Ubuntu 22.04. "
                       "Built on pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime.",
        "docker_image": "gpumarket/pytorch:2.5.1-cuda12.4-cudnn9",
        "libvirt_image": "ubuntu-22.04-cuda-12.4-pytorch-2.5.1",
        "min_disk_gb": 40,
    },
    {
        "slug": "tensorflow-2-17",
        "name": "TensorFlow 2.17.0 (GPU)",
        "description": "TensorFlow 2.17.0 with GPU support on Ubuntu 22.04. "
                       "Built on tensorflow/tensorflow:2.17.0-gpu.",
        "docker_image": "gpumarket/tensorflow:2.17.0-gpu",
        "libvirt_image": "ubuntu-22.04-tensorflow-2.17.0",
        "min_disk_gb": 40,
    },
]


def forwards(apps, schema_editor):
    Image = apps.get_model("marketplace", "Image")
    for fields in IMAGES:
        Image.objects.update_or_create(slug=fields["slug"], defaults={k: v for k, v in fields.items() if k != "slug"})


class Migration(migrations.Migration):
    dependencies = [("marketplace", "0004_offers_search_indexes")]
    operations = [migrations.RunPython(forwards, migrations.RunPython.noop)]
