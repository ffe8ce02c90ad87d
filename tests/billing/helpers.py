"""Shared by the billing tests: money in, instances booked and driven through their lifecycle."""
from decimal import Decimal

from billing.services.ledger import credit_grant, wallet_balance
from marketplace.models import Image, Instance
from marketplace.money import usd_to_micros
from marketplace.services import instances as svc
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
    return svc.instance_mark_running(instance_id=instance.pk, ssh_host="10.0.0.1", ssh_port=40001, ssh_user="root")


def stop(instance) -> Instance:
    svc.instance_stop(instance=instance)
    return svc.instance_mark_stopped(instance_id=instance.pk)


def start(instance) -> Instance:
    svc.instance_start(instance=instance)
    return run(instance)


def running(renter, on, num_gpus: int = 1) -> Instance:
    return run(book(renter, on, num_gpus))
