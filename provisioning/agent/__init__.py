"""The node agent. The package `gpumarket_agent/` is uploaded to nodes as one stdlib-only zipapp
(`gpumarket_agent/bundle.py`); this package only lets the platform and the tests import it."""
