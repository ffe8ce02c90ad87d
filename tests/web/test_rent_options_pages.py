"""The rent page's Advanced options and what the instance page shows of them (issue 12), with Django's test client:
the same rules as the API, errors next to the field with nothing booked, the registry password never shown."""
import pytest

from marketplace.models import Instance, Node
from marketplace.models.renting import Image
from marketplace.services import instances as svc
from marketplace.services.instances.options import InstanceOptions
from tests.factories import make_listed_node
from tests.marketplace.renting_helpers import ed25519_key, run
from tests.web.conftest import logged_in

pytestmark = pytest.mark.django_db

PASSWORD = "web-Registry-s3cret-91"  # noqa: S105 (a test value, looked for where it must not be)


@pytest.fixture
def node(db):
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=4)
    Node.objects.filter(pk=node.pk).update(inventory={"cuda_version": "12.4"})
    return Node.objects.get(pk=node.pk)


def _form(**advanced):
    return {"image": "cuda-12-4", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "t", **advanced}


def test_the_rent_page_has_a_closed_advanced_section(web, funded_renter, node):
    page = web.get(f"/offers/{node.pk}/rent/").content.decode()
    assert '<details id="advanced">' in page
    for name in ("own_image", "registry_username", "registry_password", "env", "onstart", "ports",
                 "min_cuda_version"):
        assert f'name="{name}"' in page


def test_rent_with_every_option(web, funded_renter, node):
    r = web.post(f"/offers/{node.pk}/rent/", _form(
        own_image="registry.example.com/team/app:2", registry_username="robot", registry_password=PASSWORD,
        env="API_KEY=abc=def\r\n\r\nMODE= train \r\n", onstart="echo hi\r\npython3 serve.py\r\n",
        ports="8888, 6006", min_cuda_version="12.2"))
    assert r.status_code == 302, r.content.decode()[:2000]
    instance = Instance.objects.get(renter=funded_renter)
    assert (instance.image, instance.image_ref) == (None, "registry.example.com/team/app:2")
    assert svc.instance_env(instance=instance) == {"API_KEY": "abc=def", "MODE": " train "}
    assert instance.onstart == "echo hi\npython3 serve.py\n" and instance.ports_requested == [8888, 6006]
    assert instance.min_cuda_version == "12.2" and instance.registry_auth is True
    assert PASSWORD.encode() not in bytes(instance.registry_auth_encrypted)
    assert PASSWORD not in instance.request_fingerprint

    page = web.get(f"/instances/{instance.pk}/").content.decode()
    assert "<code>registry.example.com/team/app:2</code> (your own)" in page and "registry login given" in page
    assert "<code>API_KEY</code>" in page and "abc=def" not in page  # names only on the page
    assert "8888, 6006 (TCP)" in page and "python3 serve.py" in page and PASSWORD not in page
    assert "not known yet" in page  # the OS, until its server reads it


@pytest.mark.parametrize(("advanced", "field"), [
    ({"own_image": "Bad::ref"}, "own_image"),
    ({"own_image": "app@sha256:1234"}, "own_image"),
    ({"env": "lower=x"}, "env"),
    ({"env": "NO_EQUALS_SIGN"}, "env"),
    ({"env": "A=1\nA=2"}, "env"),
    ({"env": "A=" + "x" * 4097}, "env"),
    ({"env": "NVIDIA_VISIBLE_DEVICES=all"}, "env"),  # the node's agent refuses it (found by review)
    ({"own_image": "r.example.com/app:1", "registry_username": "robot:ci", "registry_password": PASSWORD},
     "registry_username"),  # the agent refuses ':' in the user name: said under the user name
    ({"onstart": "x" * 16385}, "onstart"),
    ({"ports": "22"}, "ports"),
    ({"ports": "8888 8888"}, "ports"),
    ({"ports": "http"}, "ports"),
    ({"ports": "70000"}, "ports"),
    ({"ports": " ".join(str(p) for p in range(8000, 8017))}, "ports"),
    ({"min_cuda_version": "12"}, "min_cuda_version"),
    ({"min_cuda_version": "12.8"}, "min_cuda_version"),  # the node's driver has 12.4
    ({"registry_username": "robot", "registry_password": PASSWORD}, "registry_username"),  # no own image
    ({"own_image": "r.example.com/app:1", "registry_username": "robot"}, "registry_password"),
    ({"own_image": "r.example.com/app:1", "registry_password": PASSWORD}, "registry_username"),
])
def test_a_bad_option_is_shown_next_to_its_field_with_the_section_open_and_nothing_booked(
        web, funded_renter, node, advanced, field):
    r = web.post(f"/offers/{node.pk}/rent/", _form(**advanced))
    page = r.content.decode()
    assert r.status_code == 400
    assert f'id="id_{field}_errors"' in page or (field == "min_cuda_version" and "12.4" in page), page[:3000]
    assert '<details id="advanced" open>' in page
    assert PASSWORD not in page  # never rendered back
    assert not Instance.objects.exists()


def test_an_own_image_is_refused_on_a_vm_server(web, funded_renter):
    vm_node = make_listed_node(gpu_model="rtx-a6000", gpu_count=2, runtime="libvirt")
    r = web.post(f"/offers/{vm_node.pk}/rent/", _form(own_image="ghcr.io/acme/app:1", disk_gb="40"))
    assert r.status_code == 400 and "cannot run a container image of your own" in r.content.decode()
    assert not Instance.objects.exists()


def test_the_instance_page_shows_os_ports_and_the_logs_on_request(web, stranger, funded_renter, node):
    instance = svc.instance_create(renter=funded_renter, node_id=node.pk, num_gpus=1,
                                   image=Image.objects.get(slug="cuda-12-4"), ssh_public_keys=[ed25519_key()],
                                   options=InstanceOptions(ports=[8888]))[0]
    run(instance, host="127.0.0.1", port=40022)
    svc.instance_mark_running(instance_id=instance.pk, ssh_host="127.0.0.1", ssh_port=40022, ssh_user="root",
                              vm={"ports": {"8888/tcp": {"host": "127.0.0.1", "port": 40123}},
                                  "os": "Debian GNU/Linux 13 (trixie)", "disk_gb": 20})
    page = web.get(f"/instances/{instance.pk}/").content.decode()
    assert "Debian GNU/Linux 13 (trixie)" in page and "<code>8888/tcp</code> → <code>127.0.0.1:40123</code>" in page
    assert 'href="?tail=100#logs"' in page and 'id="log-lines"' not in page  # read only when asked
    # Asked, from a node that does not answer: said in words, the page still works.
    Node.objects.filter(pk=node.pk).update(address="127.0.0.1", ssh_port=1)
    r = web.get(f"/instances/{instance.pk}/", {"tail": "100"})
    assert r.status_code == 200 and 'id="logs-error"' in r.content.decode()
    assert "did not answer" in r.content.decode()
    r = web.get(f"/instances/{instance.pk}/", {"tail": "0"})
    assert "from 1 to 5000" in r.content.decode()
    assert web.get(f"/instances/{instance.pk}/live/").content.decode().count("40123") == 1
    assert logged_in(stranger).get(f"/instances/{instance.pk}/", {"tail": "100"}).status_code == 404


def test_stock_images_say_what_they_contain_and_that_sim_servers_have_none_of_it(db):
    for image in Image.objects.filter(slug__in=["cuda-12-4", "pytorch-2-5", "tensorflow-2-17"]):
        assert "SSH server" in image.description
        assert "simulated (demo) server none of this is installed" in image.description
    assert "no framework" in Image.objects.get(slug="cuda-12-4").description
