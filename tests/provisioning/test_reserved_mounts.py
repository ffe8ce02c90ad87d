"""What the agent mounts into a renter's container, the platform refuses as a volume's mount point, and so does the
agent: a volume at /root/.ssh/authorized_keys was taken by both, then docker refused the create ("Duplicate mount
point") and the node was counted as failing (found by review)."""
import pytest

from marketplace.services import volumes as volume_svc
from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent import options
from tests.factories import make_listed_node
from tests.marketplace.test_volumes import available, book, snap


def container_mount_targets(argv):
    """The container paths of every -v and --mount of a `docker create` argv."""
    targets = []
    for flag, value in zip(argv, argv[1:]):  # noqa: B905
        if flag == "-v":
            targets.append(value.split(":")[1])
        elif flag == "--mount":
            targets.append(dict(kv.split("=", 1) for kv in value.split(","))["dst"])
    return targets


def test_the_platform_refuses_every_mount_point_the_agent_refuses():
    assert volume_svc._AGENT_MOUNTS == options.RESERVED_MOUNTS
    assert volume_svc._SYSTEM_MOUNT_ROOTS == options.FORBIDDEN_MOUNTS
    assert volume_svc._FORBIDDEN_MOUNT_ROOTS == options.FORBIDDEN_MOUNTS + options.RESERVED_MOUNTS


def test_every_mount_the_agent_makes_in_a_container_is_reserved():
    argv = agent.docker_run_argv("a", [0], "ubuntu", 40000, "/s/vms/a/authorized_keys", box="/s/vms/a",
                                 volumes=[{"name": "vol-abcdefgh", "mount": "/data"}])
    ours = [t for t in container_mount_targets(argv) if t != "/data"]
    assert ours == ["/root/.ssh/authorized_keys", "/.gpumarket"]
    assert set(ours) <= set(options.RESERVED_MOUNTS)


@pytest.mark.parametrize("mount", ["/root/.ssh/authorized_keys", "/.gpumarket", "/.gpumarket-state/x"])
def test_the_agent_refuses_a_volume_on_its_own_mounts(mount):
    with pytest.raises(ValueError, match="cannot be under"):
        options.validate_mount(mount)


@pytest.mark.parametrize("mount", ["/root/.ssh", "/root/.ssh/authorized_keys2", "/root/data"])
def test_beside_the_keys_a_volume_is_taken(mount):
    assert volume_svc._mount_problem(mount) == ""
    assert options.validate_mount(mount) == mount


@pytest.mark.django_db
def test_a_booking_with_a_volume_on_the_ssh_keys_is_a_400_naming_the_path(api):
    node = make_listed_node()
    volume = available(api, node)
    before = snap()
    r = book(api, node, [{"volume": volume.pk, "mount": "/root/.ssh/authorized_keys"}])
    assert r.status_code == 400, r.content
    assert "/root/.ssh/authorized_keys" in str(r.json()["volumes"]), r.json()
    assert snap() == before


def test_the_apis_help_names_every_place_a_volume_cannot_be_mounted():
    from marketplace.api.instance_serializers import VolumeAttachSerializer
    from marketplace.services.volumes import _FORBIDDEN_MOUNT_ROOTS

    help_text = str(VolumeAttachSerializer().fields["mount"].help_text)
    assert all(root in help_text for root in _FORBIDDEN_MOUNT_ROOTS), help_text
