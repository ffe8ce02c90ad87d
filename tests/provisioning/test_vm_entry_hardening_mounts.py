"""The node agent refuses a volume over a system folder that the VM's SSH server or the entry wrapper needs, as the
platform does first (tests/marketplace/test_vm_entry_hardening_volumes.py), with its invalid_request naming `volumes`
and the path, before anything is made or recorded: a volume over /etc/ssh (its content the renter's) kept sshd from
starting, and a catalogue image's silent SSH server with any volume was judged the renter's doing (found by review).
A path is judged as the folder it names (/usr/../etc is /etc)."""
import pytest

from tests.provisioning.test_agent_docker import node  # noqa: F401 - the fixture


@pytest.mark.parametrize(("mount", "folder"), [
    ("/etc/ssh", "/etc"), ("/usr/../etc", "/etc"), ("//etc/ssh", "/etc"), ("/etc/", "/etc"),
    ("/usr/sbin", "/usr"), ("/usr/lib/x86_64-linux-gnu", "/usr"), ("/lib", "/lib"), ("/bin", "/bin"),
    ("/run/sshd", "/run"), ("/var/run", "/var/run"), ("/var/empty/sshd", "/var/empty"), ("/var", "/var/empty"),
    ("/boot", "/boot"),
])
def test_the_agent_refuses_a_volume_over_a_system_folder_before_anything_is_made(node, mount, folder):  # noqa: F811
    assert node.call("volume create", {"name": "vol-abcdefgh", "size_gb": 1})["ok"]
    answer = node.create("inst-1", [0], volumes=[{"name": "vol-abcdefgh", "mount": mount}])
    assert not answer["ok"], answer
    error = answer["error"]
    assert (error["code"], error.get("field")) == ("invalid_request", "volumes"), error
    assert error["message"].startswith(f"volume 0 mount {mount} ") and folder in error["message"], error
    assert "system folder" in error["message"], error
    assert node.creates() == [] and node.states() == {}  # nothing made, nothing recorded


def test_the_agent_still_takes_a_volume_beside_them(node):  # noqa: F811
    assert node.call("volume create", {"name": "vol-abcdefgh", "size_gb": 1})["ok"]
    assert node.create("inst-1", [0], volumes=[{"name": "vol-abcdefgh", "mount": "/var/lib/data"}])["ok"]
    (argv,) = node.creates()
    assert "type=volume,src=vol-abcdefgh,dst=/var/lib/data" in argv
