"""The platform's "image_env" as a sim node shows it: the command of a renter's own image gets the renter's env, a
catalogue image's does not (510e84f: create_request says "image_env": true for an own image only, and the docker
runtime's entry wrapper exports the env in the command's subshell only then, dockerbox.py).

A sim VM runs no image, so no command; it did not mirror image_env at all, and a platform that stopped sending the
word for own images (or sent it for catalogue ones) passed every sim-based test: only the docker tests, which need
a docker engine, would see it. Now the sim VM's log says, at each start, whether the image's command would get the
renter's env (runtimes/sim.py: image_command_line), and these tests read it the way the renter's logs are read.

Real parts: a simulated server over SSH with the real agent (tests/marketplace/sim_renting.py), PostgreSQL; the
booking goes through the booking service and its provisioning job runs in this process as a worker's delivery
runs it, so the request is the platform's own create_request; the log is read over the platform's SSH as the
instance logs endpoint reads it (vms.vm_logs)."""
import pytest

from marketplace.models import InstanceStatus
from marketplace.services.instances.options import InstanceOptions
from provisioning import tasks
from provisioning.models import JobKind
from provisioning.services import vms
from tests.factories import UserFactory
from tests.marketplace.renting_helpers import book
from tests.marketplace.sim_renting import (  # noqa: F401 (fixtures)
    deliver_until_closed,
    job_of,
    node_agent,
    sent_jobs_fixture,
    sim_node_fixture,
    simbase_fixture,
    simnode_fixture,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

ENV = {"MODEL_ID": "meta-llama/Llama-3.1-8B", "HF_TOKEN": "hf_secret_value_1"}
GETS = "the image's command (sim: none is run) would get the renter's env: HF_TOKEN, MODEL_ID (the renter's own image)"
WITHOUT = ("the image's command (sim: none is run) would run without the renter's env, which onstart and SSH sessions "
           "get (not the renter's own image)")


def provisioned(node, **kwargs):
    instance = book(UserFactory(), node, options=InstanceOptions(env=dict(ENV)), **kwargs)
    deliver_until_closed(tasks.instance_provision, job_of(instance, JobKind.INSTANCE_PROVISION))
    instance.refresh_from_db()
    assert instance.status == InstanceStatus.RUNNING, instance.status_message
    return instance


def command_lines(instance):
    lines = vms.vm_logs(instance=instance, tail=200)
    assert not any(value in line for line in lines for value in ENV.values()), lines  # names only, never values
    return [line.split("[gpumarket] ", 1)[1] for line in lines if "the image's command" in line]


def test_the_command_of_a_renters_own_image_gets_the_env_and_a_catalogue_images_does_not(sim_node):
    own = provisioned(sim_node, image="ghcr.io/acme/vllm:0.6")
    catalogue = provisioned(sim_node)  # pytorch-2-5, with the same env
    assert command_lines(own) == [GETS]
    assert command_lines(catalogue) == [WITHOUT]
    # the node's record keeps the word: a start (the container's command runs again) says the same
    for instance, line in ((own, GETS), (catalogue, WITHOUT)):
        assert node_agent(instance, "stop")["state"] == "stopped"
        assert node_agent(instance, "start")["state"] == "running"
        assert command_lines(instance) == [line, line]
