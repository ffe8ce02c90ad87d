"""A check's conclusion and a destroy's or stop's confirmation on the same node take their rows in one order (found by
review): the confirmation locks its instance, then its GPUs (a MIG release holds the slices' cards under a share
lock, a whole GPU's release updates its row); the conclusion locked the node's GPUs (node_apply_mig_slices) and then
its instances (a price cut, a raise back, a renter told): "deadlock detected", the confirmation or the whole verdict
rolled back. The conclusion now locks the node's instances before any GPU row."""
import threading
import time
from datetime import timedelta

import pytest
from django.db import connection, connections, transaction

from marketplace.models import Instance, MigSlice
from marketplace.services.instances.mig import instance_release_slices
from provisioning.models import Job, JobKind, VerificationRun
from provisioning.services.verification import node_verify_conclude
from tests.billing.helpers import fund
from tests.factories import UserFactory
from tests.marketplace.mig_helpers import make_mig_node
from tests.marketplace.renting_helpers import book, run, sent_jobs_fixture  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)


def _waits_on_a_lock(pid: int) -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row) and row[0] == "Lock"


def test_a_slice_release_and_a_checks_conclusion_on_the_same_node_both_commit():
    renter = UserFactory()
    fund(renter, "50")
    node = make_mig_node({0: ["3g.40gb", "3g.40gb"]}, gpu_count=1)
    instance = run(book(renter, node, mig_profile="3g.40gb"))
    slices = [{"gpu": s.gpu.index, "device": s.device, "profile": s.profile, "uuid": s.uuid,
               "memory_mib": s.memory_mib, "proven": True} for s in MigSlice.objects.filter(node=node)]
    job = Job.objects.create(kind=JobKind.NODE_VERIFY, node=node, status="running",
                             deadline=node.created_at + timedelta(days=1))
    locked, conclusion_pid, errors = threading.Event(), [], []

    def release():  # a destroy's confirmation: its instance, then (the release) its slices' cards
        try:
            with transaction.atomic():
                held = Instance.objects.select_for_update().get(pk=instance.pk)
                locked.set()
                for _ in range(200):  # until the conclusion waits on a lock (on this instance, or after its GPUs)
                    if conclusion_pid and _waits_on_a_lock(conclusion_pid[0]):
                        break
                    time.sleep(0.025)
                instance_release_slices(instance=held)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(("release", exc))
        finally:
            connections.close_all()

    def conclude():  # a check that scores the node lower, its slices proven again: a price cut for its renter
        try:
            locked.wait(5)
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_backend_pid()")
                conclusion_pid.append(cursor.fetchone()[0])
            node_verify_conclude(job=Job.objects.get(pk=job.pk), verdict="degraded", score=node.score / 2,
                                 inventory={}, figures={"mig_slices": slices},
                                 findings=[{"severity": "degrade", "code": "bf16_slow", "message": "slow",
                                            "gpu_index": 0}])
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(("conclude", exc))
        finally:
            connections.close_all()

    threads = [threading.Thread(target=release), threading.Thread(target=conclude)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert errors == []
    assert VerificationRun.objects.filter(node=node, verdict="degraded").exists()
