"""The agent as the one file uploaded to nodes: a zipapp of this package, built in memory, byte for byte the
same for the same sources and Python (fixed timestamps and modes, sorted entries, stored uncompressed), so its hash
names it.

    python3 gpumarket_agent-<hash>.pyz <command> [<subcommand>]  < request.json

Each module's bytecode sits beside its source (`x.pyc` next to `x.py`, where zipimport looks): a zipapp can hold no
__pycache__, so without it every command the platform runs on a node compiled the whole agent again (5,500 lines:
0.13 s of the node's CPU a command, more than the command's own work for most of them). The .pyc files are
hash-checked against their source, so a stale one is never run; a node whose python3 is another version than the
platform's ignores them (another magic number) and compiles the source as before.
"""
import importlib.util
import io
import marshal
import os
import shutil
import zipfile

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_PACKAGE = "gpumarket_agent"
# At the root of the archive: what python3 runs. The package itself sits beside it, under _PACKAGE/.
_MAIN = "import sys\n\nfrom gpumarket_agent.cli import main\n\nsys.exit(main())\n"
_EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest time a zip entry can carry


def package_files(package_dir=PACKAGE_DIR):
    """The package's .py files as sorted archive names (_PACKAGE/...), with their paths on disk."""
    found = []
    for root, dirs, files in os.walk(package_dir):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, package_dir).replace(os.sep, "/")
                found.append((_PACKAGE + "/" + rel, path))
    return sorted(found)


def _entry(name):
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = 3  # unix, so external_attr holds the mode
    info.external_attr = 0o644 << 16
    return info


def checked_pyc(source, name):
    """A .pyc of `source` as py_compile's CHECKED_HASH mode writes it: the interpreter's magic number, flags 0b11
    (hash-based, check the source), the source's hash, then the code. No timestamp, so the same source gives the
    same bytes."""
    code = compile(source, name, "exec", dont_inherit=True)
    flags = (0b11).to_bytes(4, "little")
    return importlib.util.MAGIC_NUMBER + flags + importlib.util.source_hash(source) + marshal.dumps(code)


def build_zipapp(package_dir=PACKAGE_DIR):
    """The zipapp's bytes: __main__.py at the root, then the package's sources and their bytecode, in a fixed
    order."""
    entries = [("__main__.py", _MAIN.encode())]
    for name, path in package_files(package_dir):
        with open(path, "rb") as f:
            source = f.read()
        entries += [(name, source), (name + "c", checked_pyc(source, name))]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for name, data in sorted(entries):
            archive.writestr(_entry(name), data)
    return buf.getvalue()


def running_archive():
    """The .pyz this package was imported from; None when it runs from a source tree."""
    archive = os.path.dirname(PACKAGE_DIR)
    return archive if os.path.isfile(archive) else None


def copy_agent(dest):
    """Write a runnable copy of the agent to dest: the running archive itself, or one built from the sources."""
    archive = running_archive()
    if archive:
        shutil.copyfile(archive, dest)
        return dest
    tmp = dest + ".tmp"
    with open(tmp, "wb") as f:
        f.write(build_zipapp())
    os.replace(tmp, dest)
    return dest

