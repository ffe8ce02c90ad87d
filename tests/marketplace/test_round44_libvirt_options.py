"""A libvirt node's agent refuses env, onstart, ports and volumes (runtimes/libvirt.py check_spec); the platform
booked them there all the same (201, the instance failing on the node minutes later, its GPUs held meanwhile), and
created volumes there, billed per GB-month, that no instance could ever mount (found by review). Every path is
refused now, before anything is written: the API, the rent page, the Vast-compatible create, the volumes API and
page; and the platform's list is held equal to what the agent refuses."""
import re

import pytest

from marketplace.models import Gpu, Instance, Node, Volume, VolumeState
from marketplace.models.nodes import MIG_RUNTIMES, Runtime
from marketplace.services import volumes as volume_svc
from marketplace.services.instances import booking
from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.validation import CREATE_FIELDS
from provisioning.models import Job
from provisioning.services.vms import create_request
from tests.billing.helpers import fund
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import add_key, ed25519_key, sent_jobs_fixture  # noqa: F401
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

V0 = "/compat/vast/api/v0"


def _agent_refusal(instance):
    """What the libvirt node's agent answers to the platform's `vm create` for this instance."""
    req = create_request(instance)
    rt = agent.LibvirtRuntime(agent.Config({"GPUMARKET_RUNTIME": "libvirt"}))
    _, spec = agent.validate_create(req, "libvirt", [0, 1, 2, 3])
    with pytest.raises(agent.AgentError) as exc:
        rt.check_spec(spec)
    return exc.value.code, exc.value.field


def _nothing_written(node):
    assert not Instance.objects.filter(node=node).exists()
    assert not Volume.objects.filter(node=node).exists()
    assert not Job.objects.filter(node=node).exists()
    assert not Gpu.objects.filter(node=node).exclude(status="free").exists()


@pytest.mark.parametrize("extra", [{"ports": [8888]}, {"env": {"MODE": "train"}}, {"onstart": "echo hi"}])
def test_options_a_libvirt_node_cannot_honour_are_refused_at_booking(api, extra):
    node = make_listed_node(gpu_count=4, runtime="libvirt")
    r = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                        "ssh_public_key": ed25519_key(), **extra}, format="json")
    field = next(iter(extra))
    if r.status_code == 201:
        # what the node then answers: the instance fails minutes after the 201
        assert _agent_refusal(Instance.objects.get(pk=r.json()["id"])) == ("invalid_request", field)
    assert r.status_code == 400, (r.status_code, r.content)
    assert list(r.json()) == [field] and "libvirt" in r.json()[field][0], r.json()
    _nothing_written(node)
    # The same booking without the option is taken (catalogue image, whole GPUs).
    r = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                        "ssh_public_key": ed25519_key()}, format="json")
    assert r.status_code == 201, r.content


def test_every_refused_option_is_named_at_once(api):
    node = make_listed_node(gpu_count=4, runtime="libvirt")
    r = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                        "ssh_public_key": ed25519_key(), "env": {"A": "1"}, "onstart": "true",
                                        "ports": [8888]}, format="json")
    assert r.status_code == 400 and set(r.json()) == {"env", "onstart", "ports"}, r.content
    _nothing_written(node)


def test_a_volume_on_a_libvirt_node_can_never_be_mounted(api, user):
    node = make_listed_node(gpu_count=4, runtime="libvirt")
    r = api.post("/api/v1/volumes/", {"offer": node.pk, "size_gb": 50}, format="json")
    assert r.status_code in (201, 400, 409), r.content
    if r.status_code == 201:
        volume = volume_svc.volume_mark_available(volume_id=r.json()["id"])  # billed from here on
        b = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                            "ssh_public_key": ed25519_key(),
                                            "volumes": [{"volume": volume.pk, "mount": "/data"}]}, format="json")
        assert b.status_code == 201, b.content
        assert _agent_refusal(Instance.objects.get(pk=b.json()["id"])) == ("invalid_request", "volumes")
    assert r.status_code != 201, "a volume was created (and billed) on a server whose VMs cannot mount it"
    assert r.status_code == 400 and "cannot mount volumes" in r.json()["offer"][0], r.content
    _nothing_written(node)


def test_a_volume_left_on_a_libvirt_node_from_before_is_refused_at_booking(api, user):
    """One created before the volume service refused libvirt nodes: the booking names `volumes`, nothing booked."""
    node = make_listed_node(gpu_count=4, runtime="libvirt")
    volume = Volume.objects.create(owner=user, node=node, size_gb=5, state=VolumeState.AVAILABLE,
                                   price_per_gb_month_micros=node.disk_price_per_gb_month_micros)
    r = api.post("/api/v1/instances/", {"offer": node.pk, "num_gpus": 1, "image": "cuda-12-4",
                                        "ssh_public_key": ed25519_key(),
                                        "volumes": [{"volume": volume.pk, "mount": "/data"}]}, format="json")
    assert r.status_code == 400 and list(r.json()) == ["volumes"], r.content
    assert "cannot mount volumes" in r.json()["volumes"][0]
    assert not Instance.objects.filter(node=node).exists() and not volume.mounts.exists()


def _refused_by_agent(runtime: str) -> set[str]:
    """The `vm create` fields the agent's check_spec refuses for this runtime, each probed on its own."""
    config = agent.Config({"GPUMARKET_RUNTIME": runtime, "GPUMARKET_SIM_PROFILE": "rtx-a4000-x2",
                           "GPUMARKET_SIM_ROOT": "/nonexistent"})  # sim's two settings: read, not used here
    rt = agent.RUNTIME_CLASSES[runtime](config)
    refused = set()
    for option in CREATE_FIELDS:
        try:
            rt.check_spec({option: ["x"]})
        except agent.AgentError as exc:
            assert exc.field == option, (runtime, option, exc.field)
            refused.add(option)
    return refused


@pytest.mark.parametrize("runtime", list(Runtime.values))
def test_the_platforms_list_is_what_the_agent_refuses(runtime):
    assert set(Runtime.values) == set(agent.RUNTIMES)
    expected = set(booking.RUNTIME_REFUSED_OPTIONS.get(runtime, ()))
    if runtime not in MIG_RUNTIMES:  # the booking's mig_profile: refused by booking._slice_price
        expected.add("mig_uuids")
    assert _refused_by_agent(runtime) == expected
    # A volume can be created where the booking lets it be mounted, and only there.
    assert ("volumes" in expected) == (runtime in volume_svc.VOLUMELESS_RUNTIMES)


# ------------------------------------------------------------------------------------------------ the pages


def _tag(page: str, name: str) -> str:
    found = re.search(rf'<(?:input|textarea)[^>]*name="{name}"[^>]*>', page)
    assert found, name
    return found.group(0)


def test_the_rent_page_of_a_libvirt_server_offers_none_of_them(user):
    fund(user, 100)
    node = make_listed_node(gpu_count=4, runtime="libvirt")
    docker = make_listed_node(gpu_count=4)
    web = logged_in(user)
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    for name in ("env", "onstart", "ports"):
        assert " disabled" in _tag(page, name), _tag(page, name)
    assert "cannot mount volumes" in page and "Make a volume on this server" not in page
    page = web.get(f"/offers/{docker.pk}/rent/").content.decode()
    assert not any(" disabled" in _tag(page, name) for name in ("env", "onstart", "ports"))
    assert "Make a volume on this server" in page
    # Sent anyway (a tampered form): the booking's refusal, next to the field; nothing booked.
    r = web.post(f"/offers/{node.pk}/rent/", {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(),
                                              "request_token": "t", "ports": "8888"})
    assert r.status_code == 400 and "which take no exposed ports yet" in r.content.decode()
    _nothing_written(node)


def test_the_volumes_page_lists_no_libvirt_server(user):
    node = make_listed_node(gpu_count=4, runtime="libvirt")
    docker = make_listed_node(gpu_count=4)
    web = logged_in(user)
    page = web.get("/volumes/").content.decode()
    assert f'<option value="{docker.pk}"' in page and f'<option value="{node.pk}"' not in page
    r = web.post("/volumes/", {"offer": str(node.pk), "size_gb": "10", "request_token": "t"})
    assert r.status_code == 400
    _nothing_written(node)


# ------------------------------------------------------------------------------------------ the Vast-compatible API


@pytest.mark.parametrize(("body", "words"), [
    ({"env": {"-p 8888:8888": "1"}}, "leave out the -p ports"),
    ({"env": {"MODE": "train"}}, "leave out the -e variables"),
    ({"env": {"MODE": "train", "-p 8888:8888": "1"}}, "leave out the -e variables and the -p ports"),
    ({"onstart": "echo hi"}, "leave out --onstart"),
])
def test_the_vast_create_says_which_of_its_options_the_machine_refuses(api, body, words):
    node = make_listed_node(gpu_count=2, runtime="libvirt")
    add_key(api.user)
    r = api.put(f"{V0}/asks/{node.pk * 100 + 1}/", {"client_id": "me", "image": "cuda-12-4", "disk": 20.0,
                                                     "env": {}, "runtype": "ssh", "label": None, **body},
                format="json")
    assert r.status_code == 400, r.content
    text = r.json()["msg"]
    assert f"Offer {node.pk * 100 + 1}'s machine runs virtual machines" in text and words in text, text
    assert Node.objects.get(pk=node.pk).runtime == "libvirt"
    _nothing_written(node)
