"""No volume goes over a system folder that the instance's SSH server or the platform's entry wrapper needs (found by
review): a volume over /etc/ssh (its content the renter's) kept sshd from starting, so a catalogue image's silent SSH
server with any volume was judged the renter's doing, and a node's own fault went uncounted. The booking refuses
one with a 400 naming `volumes` and the path, through the API and the rent page alike, with nothing written; a path
is judged as the folder it names (/usr/../etc is /etc). The node agent refuses the same
(tests/provisioning/test_vm_entry_hardening.py)."""
import pytest

from marketplace.models import Instance
from marketplace.services import volumes as volume_svc
from provisioning.agent.gpumarket_agent import options
from tests.factories import UserFactory, make_listed_node
from tests.marketplace.test_volumes import available, book, snap
from tests.web.conftest import fund, logged_in

from .renting_helpers import ed25519_key, sent_jobs_fixture  # noqa: F401 - the autouse fixture

pytestmark = pytest.mark.django_db

REFUSED = [
    ("/etc/ssh", "/etc"),
    ("/usr/../etc", "/etc"),  # the folder it names
    ("//etc/ssh", "/etc"),
    ("/etc/", "/etc"),
    ("/etc/ssh/", "/etc"),
    ("/data/../../usr/sbin", "/usr"),
    ("/usr/sbin", "/usr"),
    ("/bin", "/bin"),
    ("/sbin", "/sbin"),
    ("/lib64", "/lib64"),
    ("/run/sshd", "/run"),
    ("/var/run", "/var/run"),
    ("/var", "/var/empty"),  # above one: /var holds /var/run and /var/empty
    ("/boot", "/boot"),
]


@pytest.mark.parametrize(("mount", "folder"), REFUSED)
def test_a_volume_over_a_system_folder_is_a_400_naming_volumes_and_the_path_with_nothing_written(api, mount, folder):
    node = make_listed_node()
    volume = available(api, node)
    before = snap()
    r = book(api, node, [{"volume": volume.pk, "mount": mount}])
    assert r.status_code == 400, r.content
    (message,) = r.json()["volumes"]
    assert message.startswith(f"volumes[0].mount {mount} "), message
    assert folder in message and "system folder" in message, message
    assert snap() == before
    assert not Instance.objects.exists()


def test_a_path_through_dot_dot_names_the_folder_it_is():
    assert volume_svc._mount_problem("/usr/../etc") == (
        "/usr/../etc (that is /etc) cannot be /etc or under it: a system folder the instance's SSH server needs")


@pytest.mark.parametrize("mount", ["/data", "/workspace/cache", "/var/lib/data", "/opt/models", "/srv/data",
                                   "/home/me", "/tmp/scratch", "/root/.cache", "/etcetera", "/usrdata", "/runs",
                                   "/library", "/binaries"])
def test_folders_beside_the_system_ones_are_taken(mount):
    assert volume_svc._mount_problem(mount) == ""
    assert options.validate_mount(mount) == mount  # and by the node's agent


def test_the_rent_page_refuses_a_volume_over_etc_ssh_with_the_apis_words_and_nothing_booked():
    node = make_listed_node(gpu_model="rtx-a6000", gpu_count=4)
    renter = UserFactory(email="renter@example.com")
    fund(renter)
    volume = volume_svc.volume_mark_available(
        volume_id=volume_svc.volume_create(owner=renter, node_id=node.pk, size_gb=5).pk)
    before = snap()
    r = logged_in(renter).post(f"/offers/{node.pk}/rent/", {
        "image": "pytorch-2-5", "num_gpus": "1", "ssh_public_key": ed25519_key(), "request_token": "t",
        "volumes": [str(volume.pk)], f"mount_{volume.pk}": "/usr/../etc"})
    page = r.content.decode()
    assert r.status_code == 400 and 'id="id_volumes_errors"' in page, page[:3000]
    assert "volumes[0].mount /usr/../etc (that is /etc) cannot be /etc or under it" in page, page[:3000]
    assert snap() == before
    assert not Instance.objects.exists()
