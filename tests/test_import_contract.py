"""No import circles: none between modules of different apps, none inside an app's services. Function-local
imports count (grimp reads them like any other), so a circle cannot hide behind a deferred import. The layers
themselves are .importlinter's contracts (`lint-imports`, run by `make test`)."""
import grimp
import pytest

from config.celery import app as current_app  # the project's app, whatever another test made current
from core import dispatch

PACKAGES = ("core", "marketplace", "billing", "provisioning", "notifications", "operations", "compat", "config")


def import_cycles(packages=PACKAGES) -> list[list[str]]:
    """The strongly connected components (two modules or more) of the project's import graph."""
    graph = grimp.build_graph(*packages, include_external_packages=False, cache_dir=None)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in sorted(graph.modules)}
    return strongly_connected(edges)


def strongly_connected(edges: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (an import chain can be deeper than Python's recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges.get(child, ()))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_and_nothing_else():
    edges = {"a.x": ["b.y"], "b.y": ["a.z"], "a.z": ["a.x"], "c": ["a.x"], "d": []}
    assert strongly_connected(edges) == [["a.x", "a.z", "b.y"]]


@pytest.fixture(scope="module")
def cycles() -> list[list[str]]:
    return import_cycles()


def test_no_import_circle_between_apps(cycles):
    between = [c for c in cycles if len({m.split(".")[0] for m in c}) > 1]
    assert not between, f"import circles between apps (function-local imports count): {between}"


def test_no_import_circle_inside_an_apps_services(cycles):
    inside = [c for c in cycles if any(m.split(".")[1:2] == ["services"] for m in c)]
    assert not inside, f"import circles in services (function-local imports count): {inside}"


def test_every_task_a_service_queues_by_name_is_registered_under_that_name():
    current_app.loader.import_default_modules()  # the apps' tasks modules, which import the services
    assert dispatch.declared_names(), "no service declared a task name"
    missing = sorted(name for name in dispatch.declared_names() if name not in current_app.tasks)
    assert not missing, f"queued by name but registered by no task: {missing}"

