"""tests/schemathesis_lazy.py: the schemathesis tests are built when run, and are the tests schemathesis builds."""
import inspect

import schemathesis.pytest.plugin
from schemathesis.pytest import _test_builder

from tests import schemathesis_lazy


def test_the_plugin_still_builds_through_the_replaced_function():
    # The plugin imports build_operation_test by name when it collects: a rename in a new schemathesis would
    # silently build at collection again (slow, not wrong), or fail here first.
    schemathesis_lazy.build_when_run()  # as tests/test_schema.py does when imported
    source = inspect.getsource(schemathesis.pytest.plugin.SchemathesisCase._gen_items)
    assert "from schemathesis.pytest._test_builder import build_operation_test" in source
    assert _test_builder.build_operation_test is schemathesis_lazy._lazy_build_operation_test


def test_the_lazy_test_asks_for_the_fixtures_and_runs_what_the_builder_built(monkeypatch):
    built_with = []

    def builder(**kwargs):
        built_with.append(kwargs)

        def built(**fixtures):
            return ("ran", fixtures)

        built.marked = "by the builder"
        return built

    def test_func(case, data, db, world):
        raise AssertionError("the built test runs, not this one")

    monkeypatch.setattr(schemathesis_lazy, "_build_now", builder)
    lazy = schemathesis_lazy._lazy_build_operation_test(test_func=test_func, given_kwargs={"data": object()},
                                                         config="config", operation="op")
    assert list(inspect.signature(lazy).parameters) == ["db", "world"]  # pytest's fixtures, as hypothesis shows
    assert lazy.__name__ == "test_func" and not built_with  # nothing built at collection
    assert lazy(db=1, world=2) == ("ran", {"db": 1, "world": 2})
    assert lazy(db=3, world=4) == ("ran", {"db": 3, "world": 4})
    assert len(built_with) == 1 and built_with[0]["operation"] == "op"  # built once, with what collection had
    assert lazy.marked == "by the builder"  # what schemathesis reads off the item's function on a failure
