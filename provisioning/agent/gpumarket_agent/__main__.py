"""`python3 -m gpumarket_agent <command>`; the zipapp has its own __main__.py at its root (see bundle.py)."""
import sys

from .cli import main

sys.exit(main())
