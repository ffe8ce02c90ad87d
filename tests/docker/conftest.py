"""Session fixtures: one real Docker engine and one registry for all of tests/docker/, stopped at the end.

These tests skip only when the machine cannot run dockerd at all (not root, no namespaces/cgroups); any other
failure to set the engine up is an error, never a silent skip."""
import fcntl
import os

import pytest

from tests.docker.engine import CACHE, Engine, Registry, cannot_run_dockerd, setup_machine


def pytest_collection_modifyitems(items):
    reason = cannot_run_dockerd()
    for item in items:
        if "tests/docker/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.docker)
            # One engine per machine (engine.lock) and fixed published ports: under pytest-xdist all of these run
            # on one worker (`--dist loadgroup`), which starts the engine once.
            item.add_marker(pytest.mark.xdist_group("docker"))
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True)
def _local_registry_allowed(settings):
    """The session's registry is on 127.0.0.1, which a renter's own image may not name on a real platform
    (options.clean_own_image_reference): allowed here, as an operator would list an internal registry."""
    settings.RENTER_INTERNAL_REGISTRIES = ["127.0.0.1"]


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory):
    CACHE.mkdir(parents=True, exist_ok=True)
    # One engine at a time on this machine: the engines share the host's default bridge (docker0). Taken before the
    # set-up, so that two checkouts never build the cached root file system at once.
    lock = open(CACHE / "engine.lock", "w")  # noqa: SIM115 - held for the whole session
    fcntl.flock(lock, fcntl.LOCK_EX)
    rootfs = setup_machine()
    engine = Engine(tmp_path_factory.mktemp("dockerd"))
    registry = Registry(tmp_path_factory.mktemp("registry"))
    try:
        engine.start()
        registry.start()
        engine.image = engine.import_image(rootfs)
        engine.registry = registry
        engine.remote_image = registry.push(engine, engine.image, "team/debian-sshd:1")
        yield engine
    finally:
        registry.stop()
        engine.stop()
        lock.close()
