"""The agent is uploaded as one zipapp of its package and run by whatever python3 the node has: stdlib only,
Python 3.8+."""
import ast
import glob
import io
import json
import os
import subprocess
import sys
import zipfile

import pytest

from provisioning.agent import gpumarket_agent as agent
from provisioning.agent.gpumarket_agent.bundle import checked_pyc
from provisioning.ssh import agent_bundle
from tests.provisioning.sshkit import AGENT_DIR, write_agent

AGENT_FILES = sorted(AGENT_DIR.rglob("*.py"))


def test_agent_parses_as_python_3_8():
    assert len(AGENT_FILES) > 10
    for path in AGENT_FILES:
        ast.parse(path.read_text(), filename=str(path), feature_version=(3, 8))


def _imports(tree):
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:  # relative imports stay inside the package
            imported.add((node.module or "").split(".")[0])
    return imported


def test_agent_imports_only_the_standard_library():
    """Only the benchmark needs more: PyTorch, imported in import_torch() when a benchmark runs."""
    lazy, imported = {}, set()
    for path in AGENT_FILES:
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, ast.FunctionDef) and _imports(fn) - sys.stdlib_module_names:
                lazy[fn.name] = _imports(fn) - sys.stdlib_module_names
        imported |= _imports(tree) - {"torch"}
    assert lazy == {"import_torch": {"torch"}}
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names


def test_agent_is_versioned():
    assert agent.AGENT_VERSION.count(".") == 2


def test_the_zipapp_is_deterministic_and_holds_the_whole_package():
    data, remote = agent_bundle()
    assert agent.build_zipapp() == data  # same sources, same bytes: its hash names it
    assert remote.startswith(".gpumarket/agent/gpumarket_agent-") and remote.endswith(".pyz")
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert names == sorted(names) and names[0] == "__main__.py"
    sources = {str(p.relative_to(AGENT_DIR)) for p in AGENT_FILES}
    assert {n.split("/", 1)[1] for n in names[1:]} == sources | {s + "c" for s in sources}


def _import_from(archive, python=sys.executable):
    """Import the agent's cli from `archive` in a fresh interpreter; the file each of its modules came from."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import gpumarket_agent.cli; "
            "print(json.dumps({n: m.__file__ for n, m in sys.modules.items() if n.startswith('gpumarket_agent')}))")
    proc = subprocess.run([python, "-c", code, str(archive)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_the_zipapp_runs_its_bytecode_not_its_source(tmp_path):
    """A zipapp holds no __pycache__: with sources alone, every command on a node compiled the whole agent again
    (0.13 s of CPU a command here). Each module's checked .pyc sits beside its source, where zipimport finds it."""
    loaded = _import_from(write_agent(tmp_path))
    assert len(loaded) > 10
    assert all(f.endswith(".pyc") for f in loaded.values()), loaded


def test_a_pyc_that_does_not_match_its_source_is_not_run(tmp_path):
    """The .pyc files are hash-checked: one built from other source (a stale build) is ignored for the source."""
    archive = tmp_path / "agent.pyz"
    with zipfile.ZipFile(io.BytesIO(agent_bundle()[0])) as src, zipfile.ZipFile(archive, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "gpumarket_agent/core.pyc":  # bytecode of another core.py
                other = src.read("gpumarket_agent/core.py").replace(agent.AGENT_VERSION.encode(), b"9.9.9")
                data = checked_pyc(other, "gpumarket_agent/core.py")
            out.writestr(info, data)
    loaded = _import_from(archive)
    assert loaded["gpumarket_agent.core"].endswith("core.py") and loaded["gpumarket_agent.cli"].endswith("cli.pyc")
    answer = subprocess.run([sys.executable, str(archive), "no-such-command"], input="{}", capture_output=True,
                            text=True, timeout=60)
    assert json.loads(answer.stdout)["agent_version"] == agent.AGENT_VERSION


# A real interpreter, not pyenv's shim (which refuses versions not selected).
OLDEST_PYTHON = next(iter(sorted(glob.glob("/root/.pyenv/versions/3.8*/bin/python3.8")) + ["/usr/bin/python3.8"]), None)
OLDEST_PYTHON = OLDEST_PYTHON if OLDEST_PYTHON and os.path.exists(OLDEST_PYTHON) else None


@pytest.mark.skipif(OLDEST_PYTHON is None, reason="no Python 3.8 on this machine")
def test_a_node_with_another_python_compiles_the_source(tmp_path):
    """The bytecode is the platform's Python's; a node's python3 of another version (another magic number) ignores
    it and runs the source, as before."""
    loaded = _import_from(write_agent(tmp_path), python=OLDEST_PYTHON)
    assert all(f.endswith(".py") for f in loaded.values()), loaded


def test_a_health_check_loads_only_what_it_uses(tmp_path):
    """The package re-exports every module lazily and the command line imports per command: a health check on a sim
    node (every interval, every node) loads no benchmark, challenge, docker, libvirt or zipapp code (27 % of its
    CPU here before)."""
    archive, node = write_agent(tmp_path), tmp_path / "node"
    node.mkdir()
    (node / "profile.json").write_text((AGENT_DIR.parent / "profiles" / "a10-x2.json").read_text())
    env = {"PATH": "/usr/bin:/bin", "GPUMARKET_RUNTIME": "sim", "GPUMARKET_SIM_PROFILE": str(node / "profile.json"),
           "GPUMARKET_SIM_ROOT": str(node)}
    # The archive run as python3 runs it, the modules loaded written out at exit (-X importtime misses
    # importlib.import_module's imports).
    driver = ("import atexit, json, runpy, sys; "
              "atexit.register(lambda: sys.stderr.write(json.dumps(sorted(sys.modules)))); "
              "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", driver, str(archive), "health"], input="{}", env=env,
                          capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout)["ok"] is True, done.stdout
    loaded = set(json.loads(done.stderr))
    assert "gpumarket_agent.smi" in loaded and "gpumarket_agent.runtimes.sim" in loaded
    never = {"gpumarket_agent.benchmark", "gpumarket_agent.measurements", "gpumarket_agent.challenge",
             "gpumarket_agent.memproof", "gpumarket_agent.runtimes.docker", "gpumarket_agent.runtimes.libvirt",
             "gpumarket_agent.bundle", "gpumarket_agent.vm", "zipfile", "statistics"}
    assert not loaded & never, sorted(loaded & never)
