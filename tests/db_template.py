"""Test databases copied from a migrated template instead of migrated one by one.

`make test` runs seven xdist workers, and each used to create its test database by running every migration: ~10 s
of CPU each, 50 s in all for five on a two-core machine. Now the first worker to take a PostgreSQL advisory lock
migrates one template database (`test_<name>_tpl_<digest>`) and every worker, single-process runs too, creates its
own test database with `CREATE DATABASE ... TEMPLATE`, a file copy.

The digest covers what a fresh migrate's result depends on (inputs()): every migration file of every installed app,
the project modules they import (transitively) and the data files those read, and the versions of Django and of the
packages whose migrations or modules they use. Another digest is another template: a changed migration gets a new
one, and templates of other digests are dropped. While the template is built, the files the build opens are
watched: a project file outside the digest (a migration newly reading a data file) fails the build by name, since
a change to it would not rebuild the template.

The template is built under a temporary name and renamed when complete, and no session may connect to it
(ALLOW_CONNECTIONS false): a copy never starts from a half-built template, nor fails because someone is connected.
"""
from __future__ import annotations

import ast
import hashlib
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import lru_cache
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Files the migrations read that are not Python modules (checked at each build: see _reads_watched).
DATA_FILES = ("marketplace/data/gpu_models.json",)
BUILDING_SUFFIX = "_building"


def _project_module_file(name: str) -> Path | None:
    """The file of a module of this repository (not of the virtualenv or the standard library), or None."""
    parts = name.split(".")
    if not parts[0] or not (ROOT / parts[0] / "__init__.py").is_file():
        return None
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).parts[:-1])


def _imported_names(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (a RunPython function's imports too), as dotted names;
    `from a import b` gives both a and a.b (b may be a submodule)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(path).split(".")
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name}


def _migration_modules() -> dict[str, Path]:
    """Every migration of every installed app: module name -> file."""
    from django.db.migrations.loader import MigrationLoader

    loader = MigrationLoader(None, ignore_no_migrations=True)
    modules = {type(migration).__module__ for migration in loader.disk_migrations.values()}
    return {name: Path(sys.modules[name].__file__ or "").resolve() for name in modules}


def _distribution_versions(top_level: Iterable[str]) -> list[str]:
    owners = metadata.packages_distributions()
    dists = {dist for name in top_level for dist in owners.get(name, ())}
    return sorted(f"{dist}=={metadata.version(dist)}" for dist in dists | {"Django"})


@lru_cache(maxsize=1)
def inputs() -> tuple[dict[str, Path], list[str]]:
    """What a fresh migrate's result depends on: ({a name: a file it reads}, [the installed versions it uses]).
    Files are named by module (or by path in the repository) so that two clones name them alike. Once a process:
    the files are read again for each digest."""
    files: dict[str, Path] = {}
    third_party: set[str] = set()
    todo: list[Path] = []
    for module, path in sorted(_migration_modules().items()):
        if _project_module_file(module) == path:
            files[str(path.relative_to(ROOT))] = path
            todo.append(path)
        else:
            files[module] = path  # an installed package's migration: its version stands for what it imports
            third_party.add(module.split(".")[0])
    seen = set(todo)
    while todo:
        for name in _imported_names(todo.pop()):
            found = _project_module_file(name)
            if found is None:
                if name.split(".")[0] not in sys.stdlib_module_names:
                    third_party.add(name.split(".")[0])
            elif found not in seen:
                seen.add(found)
                files[str(found.relative_to(ROOT))] = found
                todo.append(found)
    files.update({name: ROOT / name for name in DATA_FILES})  # paths in the repository
    return files, _distribution_versions(third_party)


def digest(files: dict[str, Path], versions: Iterable[str]) -> str:
    h = hashlib.sha256()
    for name, path in sorted(files.items()):
        content = path.read_bytes()
        h.update(f"{name}\0{len(content)}\0".encode())
        h.update(content)
    for version in versions:
        h.update(f"{version}\0".encode())
    return h.hexdigest()[:16]


def template_name(database_name: str, digest_: str) -> str:
    """`test_<name>_tpl_<digest>`: Django's test database name with the digest (PostgreSQL names: 63 bytes)."""
    name = f"test_{database_name}_tpl_{digest_}"
    if len(name.encode()) + len(BUILDING_SUFFIX) > 63:
        raise ValueError(f"the database name {database_name!r} is too long for a template name ({name})")
    return name


def _lock_key(prefix: str) -> int:
    return int.from_bytes(hashlib.sha256(prefix.encode()).digest()[:8], "big", signed=True)


# --- watching the build's reads ----------------------------------------------------------------------------------

_watched: set[Path] | None = None


def _audit(event: str, args: tuple) -> None:
    if _watched is not None and event == "open" and isinstance(args[0], str | bytes | Path):
        _watched.add(Path(args[0] if not isinstance(args[0], bytes) else args[0].decode(errors="replace")))


_hook_added = False


@contextmanager
def _reads_watched() -> Iterator[set[Path]]:
    """The files opened while inside (audit hooks cannot be removed: the one hook records only meanwhile)."""
    global _watched, _hook_added
    if not _hook_added:
        sys.addaudithook(_audit)
        _hook_added = True
    _watched = set()
    try:
        yield _watched
    finally:
        _watched = None


def unhashed_project_files(opened: Iterable[Path], hashed: Iterable[Path]) -> list[str]:
    """The repository's non-empty files among `opened` that the digest does not cover (bytecode stands for its
    source)."""
    known = {path.resolve() for path in hashed}
    missing = set()
    for path in opened:
        path = (ROOT / path).resolve() if not path.is_absolute() else path.resolve()
        if not path.is_relative_to(ROOT) or path.is_relative_to(ROOT / ".venv") or path.is_relative_to(ROOT / "var"):
            continue
        if path.parent.name == "__pycache__":
            path = path.parent.parent / (path.name.split(".")[0] + ".py")
        # An empty file carries nothing: the package markers that imports and command discovery open.
        if path.is_file() and path not in known and path.stat().st_size:
            missing.add(str(path.relative_to(ROOT)))
    return sorted(missing)


# --- the template and the copies --------------------------------------------------------------------------------

def ensure_template(connection, migrate: Callable[[], None], *, say: Callable[[str], None]) -> str:
    """The name of the template for the current migrations, built with `migrate()` (which must create and migrate
    the database the connection's TEST NAME names) if no run built it yet; stale templates dropped."""
    files, versions = inputs()
    name = template_name(connection.settings_dict["NAME"], digest(files, versions))
    prefix = name.rpartition("_")[0] + "_"
    quote = connection.ops.quote_name
    with connection.creation._nodb_cursor() as cursor:
        cursor.execute("SELECT pg_advisory_lock(%s)", [_lock_key(prefix)])
        try:
            cursor.execute("SELECT datname FROM pg_database WHERE starts_with(datname, %s)", [prefix])
            existing = {row[0] for row in cursor.fetchall()}
            for stale in sorted(existing - {name}):  # other migrations' templates, or a build that died
                say(f"dropping the stale test template database {stale}")
                cursor.execute(f"DROP DATABASE {quote(stale)}")
            if name not in existing:
                say(f"migrating the test template database {name}")
                _build(connection, name + BUILDING_SUFFIX, migrate, list(files.values()))
                cursor.execute(f"ALTER DATABASE {quote(name + BUILDING_SUFFIX)} RENAME TO {quote(name)}")
                cursor.execute(f"ALTER DATABASE {quote(name)} WITH ALLOW_CONNECTIONS false")
        finally:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [_lock_key(prefix)])
    return name


def _build(connection, building: str, migrate: Callable[[], None], hashed: list[Path]) -> None:
    from django.conf import settings

    test_settings = connection.settings_dict["TEST"]
    saved_name, saved_test_name = connection.settings_dict["NAME"], test_settings.get("NAME")
    test_settings["NAME"] = building
    try:
        with _reads_watched() as opened:
            migrate()
    finally:
        connection.close()  # CREATE DATABASE ... TEMPLATE refuses a database anyone is connected to
        settings.DATABASES[connection.alias]["NAME"] = connection.settings_dict["NAME"] = saved_name
        test_settings["NAME"] = saved_test_name
    missing = unhashed_project_files(opened, hashed)
    if missing:
        raise RuntimeError(f"the migrations read {missing}, which tests/db_template.py's digest does not cover: a "
                           "change to them would not rebuild the test template. Add them to DATA_FILES there.")


copied_from: dict[str, str] = {}  # alias -> the template its test database was copied from, in this process


@contextmanager
def test_databases_from_template(connections, *, enabled: bool, say: Callable[[str], None]) -> Iterator[None]:
    """Inside, Django's create_test_db (setup_databases) copies each PostgreSQL test database from the template
    instead of migrating it. Not for --reuse-db (keepdb: that database is migrated in place, as before)."""
    originals = {}
    for connection in connections.all(initialized_only=False) if enabled else ():
        if connection.vendor != "postgresql" or connection.settings_dict["TEST"].get("MIGRATE") is False:
            continue
        creation = connection.creation
        originals[connection.alias] = creation.create_test_db
        creation.create_test_db = _from_template(connection, creation.create_test_db, say)
    try:
        yield
    finally:
        for alias, original in originals.items():
            connections[alias].creation.create_test_db = original


def _from_template(connection, create_test_db, say):
    def create(verbosity=1, autoclobber=False, serialize=True, keepdb=False):
        if keepdb:
            return create_test_db(verbosity, autoclobber, serialize, keepdb)
        from django.conf import settings
        from django.core.management import call_command

        template = ensure_template(
            connection, lambda: create_test_db(verbosity, autoclobber=True, serialize=False, keepdb=False), say=say)
        creation = connection.creation
        name = creation._get_test_db_name()
        test_settings = connection.settings_dict["TEST"]
        saved = test_settings.get("TEMPLATE")
        test_settings["TEMPLATE"] = template
        try:
            creation._create_test_db(verbosity, autoclobber, keepdb)  # an old copy is dropped, as Django does
        finally:
            test_settings["TEMPLATE"] = saved
        copied_from[connection.alias] = template
        # The rest of Django's create_test_db, without the migrate.
        connection.close()
        settings.DATABASES[connection.alias]["NAME"] = connection.settings_dict["NAME"] = name
        if serialize:
            connection._test_serialized_contents = creation.serialize_db_to_string()
        call_command("createcachetable", database=connection.alias)
        connection.ensure_connection()
        return name

    return create
