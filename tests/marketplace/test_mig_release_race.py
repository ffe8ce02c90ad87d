"""A slice let go while its card comes back (found by review): the release read the card's `lost_at` unlocked, so a
card found back meanwhile (gpu_presence.gpus_returned, which saw the allocation still live and left the slice) was
taken as lost, and the slice stayed unavailable on a card that is back, off the offers until the next check."""
import threading

import pytest
from django.db import connections, transaction
from django.utils import timezone

from marketplace.models import Gpu, Instance, MigSlice, SliceStatus
from marketplace.services.instances.mig import instance_release_slices
from provisioning.services.gpu_presence import gpus_returned
from tests.billing.helpers import fund
from tests.factories import UserFactory

from .mig_helpers import make_mig_node
from .renting_helpers import book, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_slice_let_go_while_its_card_comes_back_is_free_once_both_commit():
    renter = UserFactory()
    fund(renter, "50")
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    instance = run(book(renter, node, mig_profile="3g.40gb"))
    held = MigSlice.objects.get(allocations__instance=instance)
    gpu = Gpu.objects.get(pk=held.gpu_id)
    Gpu.objects.filter(pk=gpu.pk).update(lost_at=timezone.now())

    released, go_on, errors = threading.Event(), threading.Event(), []

    def release():
        try:
            with transaction.atomic():
                instance_release_slices(instance=Instance.objects.select_for_update().get(pk=instance.pk))
                released.set()
                go_on.wait(10)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
        finally:
            released.set()
            connections.close_all()

    worker = threading.Thread(target=release)
    worker.start()
    assert released.wait(10)
    back = threading.Thread(target=lambda: (gpus_returned(gpu_ids=[gpu.pk]), connections.close_all()))
    back.start()
    back.join(1)  # the card back at once (before), or waiting for the release's share lock on it (now)
    go_on.set()
    worker.join(10)
    back.join(10)
    assert not errors, errors
    held.refresh_from_db()
    assert Gpu.objects.get(pk=gpu.pk).lost_at is None
    assert held.status == SliceStatus.FREE, "the slice stayed unavailable on a card that is back"
