"""The node agent. `gpumarket_agent.py` is uploaded to nodes as one stdlib-only file; this package only lets
the platform and the tests import it."""
