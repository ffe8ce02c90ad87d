"""tests/python_on_path.py: `python3` past a shim, the same interpreter."""
import os
import shutil
import sys

from tests.python_on_path import path_past_shims


def _program(folder, name, text):
    folder.mkdir(exist_ok=True)
    (folder / name).write_text(text)
    (folder / name).chmod(0o755)
    return folder


def test_a_shims_python3_is_replaced_by_the_interpreter_it_starts(tmp_path):
    shims = _program(tmp_path / "shims", "python3", f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    path = os.pathsep.join([str(shims), "/usr/bin", "/bin"])
    assert path_past_shims(path) == os.pathsep.join([os.path.dirname(sys.executable), path])


def test_an_interpreter_on_path_is_left_as_it_is(tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "python3").symlink_to(sys.executable)  # as a venv's: it answers with its own path
    path = os.pathsep.join([str(folder), "/usr/bin", "/bin"])
    assert path_past_shims(path) == path


def test_no_python3_or_one_that_fails_leaves_path_alone(tmp_path):
    assert path_past_shims(str(tmp_path)) == str(tmp_path)
    broken = _program(tmp_path / "broken", "python3", "#!/bin/sh\nexit 3\n")
    assert path_past_shims(str(broken)) == str(broken)


def test_the_suite_runs_with_python3_past_the_shim():
    found = os.path.realpath(shutil.which("python3"))
    assert "/shims/" not in found, os.environ["PATH"]
