"""Shared by the billing tests: money in, instances booked and driven through their lifecycle."""
from decimal import Decimal

from django.utils import timezone

from billing.services.ledger import credit_grant, wallet_balance
from marketplace.models import Image, Instance
from marketplace.money import usd_to_micros
from marketplace.services import instances as svc
from provisioning.models import OPEN_JOB_STATUSES, Job
from tests.factories import UserFactory, make_listed_node

ED25519 = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl test"


def fund(user, usd: str | Decimal, reason: str = "test funds") -> None:
    credit_grant(user=user, amount_micros=usd_to_micros(Decimal(usd)), reason=reason)


def balance(user) -> int:
    return wallet_balance(user_id=user.pk)


def node(price: str = "1.500000", gpu_count: int = 4, provider=None, **kwargs):
    return make_listed_node(provider or UserFactory(), price=price, gpu_count=gpu_count, **kwargs)


def book(renter, on, num_gpus: int = 1) -> Instance:
    instance, created = svc.instance_create(renter=renter, node_id=on.pk, num_gpus=num_gpus,
                                            image=Image.objects.get(slug="pytorch-2-5"), ssh_public_keys=[ED25519])
    assert created
    return instance


def run(instance) -> Instance:
    """requested/starting → running, as the provisioning task would."""
    instance.refresh_from_db()
    if instance.status in ("requested", "provisioning"):
        svc.instance_mark_provisioning(instance_id=instance.pk)
    instance = svc.instance_mark_running(instance_id=instance.pk, ssh_host="10.0.0.1", ssh_port=40001,
                                         ssh_user="root")
    worker_done(instance)
    return instance


def worker_done(instance) -> None:
    """What the worker does after recording the node's answer: close the instance's open jobs (a second job of
    the same kind is refused while one is open: provisioning.models.Job's constraints)."""
    Job.objects.filter(instance_id=instance.pk, status__in=OPEN_JOB_STATUSES).update(
        status="succeeded", finished_at=timezone.now())


def stop(instance) -> Instance:
    svc.instance_stop(instance=instance)
    instance = svc.instance_mark_stopped(instance_id=instance.pk)
    worker_done(instance)
    return instance


def start(instance) -> Instance:
    svc.instance_start(instance=instance)
    return run(instance)


def running(renter, on, num_gpus: int = 1) -> Instance:
    return run(book(renter, on, num_gpus))
