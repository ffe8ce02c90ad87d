"""What `make demo` and the Docker image install, checked without installing anything (scripts/demo-smoke,
run by CI, installs it for real in a fresh virtual environment and runs the demo on it)."""
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _text(name):
    return (ROOT / name).read_text()


def _pip_files(words):
    """The requirement (-r) and constraint (-c) files named by one `pip install` command line."""
    files = {"-r": [], "-c": []}
    for flag, value in zip(words, words[1:], strict=False):
        if flag in files:
            files[flag].append(value)
    return files


def _makefile_recipe(target):
    match = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", _text("Makefile"), re.M)
    assert match, f"the Makefile has no target {target}"
    return [line.strip() for line in match.group(1).splitlines()]


def _requirements(name):
    """The requirement names of one requirements file (without -r includes, extras or versions)."""
    names = []
    for line in _text(name).splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            names.append(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line).group(0))
    return names


def _norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(name="constraints.txt"):
    lines = [line for line in _text(name).splitlines() if line and not line.startswith("#")]
    return lines, {_norm(line.split("==")[0]): line.split("==")[1] for line in lines}


# The `vastai` CLI's own venv (.venv-vastai): it pins a cryptography the platform does not run, so its
# requirements have constraints of their own.
OWN_CONSTRAINTS = {"requirements-vastai.txt": "constraints-vastai.txt"}


def test_the_docker_image_installs_what_make_demo_runs_the_platform_with():
    docker_runs = [line for line in _text("Dockerfile").splitlines() if re.match(r"RUN\s+pip\s+install\b", line)]
    assert len(docker_runs) == 1, "the Dockerfile should install its Python packages in one `pip install`"
    docker = _pip_files(shlex.split(docker_runs[0]))
    demo_runtime = [line for line in _makefile_recipe("$(VENV)/.installed") if "install" in line]
    assert len(demo_runtime) == 1
    assert docker == _pip_files(shlex.split(demo_runtime[0])), (
        "the Dockerfile and `make demo` must install the platform from the same requirement and constraint files")
    copied = set()
    for line in _text("Dockerfile").splitlines():
        if line == docker_runs[0]:
            break
        if line.startswith("COPY "):
            copied.update(shlex.split(line)[1:-1])
    assert set(docker["-r"] + docker["-c"]) <= copied, "the Dockerfile must COPY the files before installing them"


def test_make_demo_adds_only_the_programs_it_runs_beside_the_platform():
    # The demo installs requirements-demo.txt on top of the runtime files; the image does not. Anything the
    # platform imports must therefore be in requirements.txt, never only in requirements-demo.txt.
    demo = [line for line in _makefile_recipe("$(VENV)/.installed-demo") if "install" in line]
    assert demo and _pip_files(shlex.split(demo[0])) == {"-r": ["requirements-demo.txt"], "-c": ["constraints.txt"]}
    assert _requirements("requirements-demo.txt") == ["localstripe"]
    assert "-r" not in _text("requirements.txt").split(), "requirements.txt is the whole runtime set on its own"


def test_the_redis_broker_transport_is_a_runtime_requirement():
    # Production and the README's `make demo` line use a redis:// broker; kombu's Redis transport imports
    # packages (redis-py, packaging) that only the extra brings in.
    lines = [line.split("#", 1)[0].strip().replace(" ", "") for line in _text("requirements.txt").splitlines()]
    assert "celery[redis]" in lines or "kombu[redis]" in lines


@pytest.mark.parametrize("constraints", ["constraints.txt", *OWN_CONSTRAINTS.values()])
def test_constraints_files_are_sorted_exact_pins(constraints):
    lines, pins = _pins(constraints)
    assert lines == sorted(lines), f"{constraints} is sorted (as `make lock` writes it)"
    assert all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==\S+", line) for line in lines)
    assert len(pins) == len(lines), "a package is pinned twice"


def test_every_requirement_is_pinned_in_its_constraints_file():
    for name in sorted(p.name for p in ROOT.glob("requirements*.txt")):
        constraints = OWN_CONSTRAINTS.get(name, "constraints.txt")
        pins = _pins(constraints)[1]
        missing = [req for req in _requirements(name) if _norm(req) not in pins]
        assert not missing, f"{name}: not pinned in {constraints}: {missing}"


def test_the_demo_sets_its_clean_up_trap_before_it_starts_anything():
    # The script's own steps, not the bodies of its functions (stop() runs `manage.py simnodes down`).
    lines, in_function = [], False
    for line in _text("scripts/demo").splitlines():
        in_function = in_function or bool(re.match(r"[\w-]+\(\) \{\s*(#.*)?$", line))
        lines.append("" if in_function else line.strip())
        in_function = in_function and line != "}"
    trap = next(i for i, line in enumerate(lines) if re.match(r"trap .*\bEXIT\b", line))
    starts = [i for i, line in enumerate(lines) if re.match(r"(scripts/|python manage\.py|localstripe|TMPDIR=)", line)]
    assert starts and trap < min(starts), "scripts/demo starts something before its clean-up trap is set"


def test_ci_runs_the_demo_smoke_after_the_suite():
    ci = [line.strip() for line in _text(".ci/run").splitlines()]
    assert ci.index("make demo-smoke") > ci.index("make test")
    assert "scripts/demo-smoke" in _makefile_recipe("demo-smoke")
    assert (ROOT / "scripts" / "demo-smoke").stat().st_mode & 0o111
