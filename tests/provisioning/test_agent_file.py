"""The agent is uploaded as one file and run by whatever python3 the node has: stdlib only, Python 3.8+."""
import ast
import sys

from provisioning.agent import gpumarket_agent as agent
from tests.provisioning.sshkit import AGENT_FILE


def test_agent_parses_as_python_3_8():
    ast.parse(AGENT_FILE.read_text(), feature_version=(3, 8))


def test_agent_imports_only_the_standard_library():
    imported = set()
    for node in ast.walk(ast.parse(AGENT_FILE.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names


def test_agent_is_versioned():
    assert agent.AGENT_VERSION.count(".") == 2
