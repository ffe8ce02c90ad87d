"""The agent is uploaded as one zipapp of its package and run by whatever python3 the node has: stdlib only,
Python 3.8+."""
import ast
import io
import sys
import zipfile

from provisioning.agent import gpumarket_agent as agent
from provisioning.ssh import agent_bundle
from tests.provisioning.sshkit import AGENT_DIR

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
    assert {n.split("/", 1)[1] for n in names[1:]} == {str(p.relative_to(AGENT_DIR)) for p in AGENT_FILES}
