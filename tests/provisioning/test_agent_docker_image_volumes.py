"""Review r53 #1: a VOLUME the image declares gets an anonymous docker volume, which `--storage-opt size` (the
writable layer's limit) does not bound. The VM answered "disk_limit": "enforced" all the same, so a renter's image
with VOLUME /data could fill the node's docker data root. Now such a VM answers "not_enforced" and its log names the
unbounded paths; a VOLUME path the renter mounts one of their volumes on is no anonymous volume and does not count.
Against the stand-in docker CLI of test_agent_docker.py."""
import json

from provisioning.agent.gpumarket_agent.runtimes.dockerlimits import disk_limit_answer
from provisioning.agent.gpumarket_agent.runtimes.dockerpull import image_volumes
from tests.provisioning.test_agent_docker import FAKE_DOCKER, node  # noqa: F401 (fixture)

IMAGE_CONFIG = 'print(json.dumps({"Cmd": ["/usr/sbin/sshd", "-D"]}))'


def image_declares(tmp_path, volumes):
    config = json.dumps({"Cmd": ["/usr/sbin/sshd", "-D"], "Volumes": volumes})
    fake = FAKE_DOCKER.replace(IMAGE_CONFIG, f"print({config!r})")
    assert fake != FAKE_DOCKER
    (tmp_path / "bin" / "docker").write_text(fake)


def vm_log(tmp_path, vm_id):
    return (tmp_path / "state" / "vms" / vm_id / "vm.log").read_text()


def test_an_image_volume_makes_the_disk_limit_not_enforced(node, tmp_path):  # noqa: F811
    image_declares(tmp_path, {"/data": {}, "/var/lib/postgresql/data/": {}})
    vm = node.create("inst-9", [0], image="ghcr.io/renter/app:1", disk_gb=10, image_env=True)
    assert vm["ok"], vm
    create = node.creates()[-1]
    assert "size=10G" in create  # the writable layer stays bounded ...
    assert vm["disk_limit"] == "not_enforced"  # ... but the image's volumes are not: the answer says so
    listed = {v["vm_id"]: v for v in node.call("vm list", {})["vms"]}
    assert listed["inst-9"]["disk_limit"] == "not_enforced"
    log = vm_log(tmp_path, "inst-9")
    assert "NOT enforced" in log and "/data, /var/lib/postgresql/data" in log, log


def test_an_image_volume_the_renter_mounts_a_volume_on_is_covered(node, tmp_path):  # noqa: F811
    image_declares(tmp_path, {"/data": {}})
    assert node.call("volume create", {"name": "vol-abcdefgh", "size_gb": 5})["ok"]
    vm = node.create("inst-8", [0], disk_gb=10, volumes=[{"name": "vol-abcdefgh", "mount": "/data"}])
    assert vm["ok"], vm
    assert vm["disk_limit"] == "enforced"


def test_an_image_without_volumes_keeps_its_enforced_limit(node, tmp_path):  # noqa: F811
    vm = node.create("inst-7", [0], disk_gb=10, image_env=True)
    assert vm["ok"] and vm["disk_limit"] == "enforced", vm
    assert "NOT enforced" not in vm_log(tmp_path, "inst-7")


def test_what_the_image_says_is_read_defensively(node, tmp_path):  # noqa: F811
    for volumes, expected in (({"/a//b/": {}, "/a/b": {}, "rel": {}}, ["/a/b"]), (["/x"], []), (None, []),
                              ({"//c/../d": {}}, ["/d"])):
        image_declares(tmp_path, volumes)
        assert image_volumes("ghcr.io/x/app:1") == expected
    assert disk_limit_answer({"disk_limit": "enforced"}) == "enforced"
    assert disk_limit_answer({"disk_limit": "not_enforced"}) == "not_enforced"  # docker refused the size option
    assert disk_limit_answer({}) == "not_enforced"  # a record from before the limits
