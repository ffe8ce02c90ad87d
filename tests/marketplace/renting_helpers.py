"""Shared by the tests/marketplace/test_renting_*.py modules: keys, instances, state snapshots."""
import functools

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa

from marketplace.models import Gpu, GpuAllocation, Image, Instance, SshKey, User
from marketplace.services import instances as svc
from marketplace.services.ssh_keys import ssh_key_create
from provisioning.models import Job


def _openssh(public_key) -> str:
    return public_key.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH).decode()


def ed25519_key(comment: str = "") -> str:
    line = _openssh(ed25519.Ed25519PrivateKey.generate().public_key())
    return f"{line} {comment}" if comment else line


def ecdsa_key(curve=ec.SECP256R1, comment: str = "") -> str:
    line = _openssh(ec.generate_private_key(curve()).public_key())
    return f"{line} {comment}" if comment else line


@functools.cache
def rsa_key(bits: int = 2048) -> str:
    return _openssh(rsa.generate_private_key(public_exponent=65537, key_size=bits).public_key())


def add_key(user: User, name: str = "") -> SshKey:
    return ssh_key_create(user=user, public_key=ed25519_key(), name=name)


def image(slug: str = "pytorch-2-5") -> Image:
    return Image.objects.get(slug=slug)


def book(renter: User, node, num_gpus: int = 1, **kwargs) -> svc.Instance:
    """An instance created through the service (status requested)."""
    kwargs.setdefault("image", image())
    kwargs.setdefault("ssh_public_keys", [ed25519_key()])
    instance, created = svc.instance_create(renter=renter, node_id=node.pk, num_gpus=num_gpus, **kwargs)
    assert created
    return instance


def run(instance, host: str = "10.0.0.1", port: int = 40001, user: str = "root") -> Instance:
    """Drive a requested (or starting) instance to running as the provisioning task would."""
    if instance.status in ("requested", "provisioning"):
        svc.instance_mark_provisioning(instance_id=instance.pk)
    return svc.instance_mark_running(instance_id=instance.pk, ssh_host=host, ssh_port=port, ssh_user=user)


def gpu_indices(instance) -> list[int]:
    return svc.instance_gpu_indices(instance=instance)


def snapshot(node=None) -> dict:
    """Everything a refused request must leave as it was."""
    gpus = Gpu.objects.filter(node=node) if node is not None else Gpu.objects.all()
    return {
        "gpus": list(gpus.order_by("node_id", "index").values_list("node_id", "index", "status")),
        "allocations": list(GpuAllocation.objects.order_by("pk").values_list("pk", "instance_id", "gpu_id",
                                                                           "released_at")),
        "instances": list(Instance.objects.order_by("pk").values_list("pk", "status", "status_message")),
        "jobs": list(Job.objects.order_by("pk").values_list("pk", "kind")),
        "ssh_keys": list(SshKey.objects.order_by("pk").values_list("pk", "fingerprint")),
    }


@pytest.fixture(autouse=True, name="sent_jobs")
def sent_jobs_fixture(monkeypatch):
    """Jobs handed to Celery on commit; recorded instead of sent (no worker runs in these tests)."""
    sent = []
    monkeypatch.setattr("provisioning.services.jobs._send", lambda job_id, kind: sent.append((job_id, kind)))
    return sent
