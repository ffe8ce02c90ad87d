"""`python3` on the tests' PATH, past a version manager's shim.

The tests' stand-in programs (a docker CLI written in Python, `#!/usr/bin/env python3`) and anything else they start
as `python3` find it on PATH. On this machine's kind PATH leads to pyenv's shim first: a bash script that runs
`pyenv exec`, which finds the version and then starts Python, about 90 ms of CPU a start where the interpreter itself
takes under 10 (measured here). The suite started such a process about 1,100 times a run (process accounting of a
whole run). The interpreter the shim would have started is asked for once, and its folder put first on PATH: the
same Python, without the shim."""
import os
import shutil
import subprocess


def path_past_shims(path: str) -> str:
    """`path` with the folder of the interpreter its `python3` really is put first, when that is elsewhere (a shim);
    `path` itself when python3 is missing, is the interpreter, or does not answer."""
    found = shutil.which("python3", path=path)
    if found is None:
        return path
    try:
        real = subprocess.run([found, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True,
                              timeout=60, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return path
    folder = os.path.dirname(real)
    if not real or not os.access(real, os.X_OK) or folder == os.path.dirname(found):
        return path
    return os.pathsep.join([folder, path])
