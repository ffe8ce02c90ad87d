"""Schemathesis builds each operation's test (its coverage cases and the schema's examples) when pytest collects
it, and every pytest-xdist worker collects the whole suite: `make test`'s five workers each built all 150 of them
(16 s of CPU a worker, about 80 s a run) to run a fifth each. `build_when_run()` makes the building wait for the
test's first call, in the worker that runs it. What runs is the same test: schemathesis' own builder, with the
same config, seed and fixtures; an operation the builder refuses (InvalidSchema) fails its test when run instead of
at collection.

It replaces `schemathesis.pytest._test_builder.build_operation_test`, which the plugin imports by name each time it
collects (schemathesis 4.32, pinned in constraints.txt); tests/test_schemathesis_lazy.py checks that it is still
what the plugin calls."""
import inspect

from schemathesis.pytest import _test_builder

_build_now = _test_builder.build_operation_test


def _lazy_build_operation_test(*, test_func, given_kwargs, **kwargs):
    built = None

    def run_the_built_test(*args, **fixtures):
        nonlocal built
        if built is None:
            built = _build_now(test_func=test_func, given_kwargs=given_kwargs, **kwargs)
            # What the builder marks on its test (an unsatisfiable example, the operation) is read off the item's
            # function when the run fails (schemathesis' pytest_pyfunc_call): this one.
            vars(run_the_built_test).update(vars(built))
        return built(*args, **fixtures)

    # pytest asks the test's signature for its fixtures: the test function's, less what schemathesis and
    # hypothesis give it (`case`, and a `given` argument such as `data`), as hypothesis' own wrapper shows it.
    given = {"case", *given_kwargs}
    signature = inspect.signature(test_func)
    run_the_built_test.__signature__ = signature.replace(
        parameters=[p for name, p in signature.parameters.items() if name not in given])
    run_the_built_test.__name__ = test_func.__name__
    run_the_built_test.__qualname__ = test_func.__qualname__
    run_the_built_test.__module__ = test_func.__module__
    run_the_built_test.__doc__ = test_func.__doc__
    if hasattr(test_func, "pytestmark"):  # its marks (not its hypothesis settings: a test without @given has none)
        run_the_built_test.pytestmark = test_func.pytestmark
    run_the_built_test.built_when_run = True  # tests/test_schemathesis_lazy.py
    return run_the_built_test


def build_when_run() -> None:
    _test_builder.build_operation_test = _lazy_build_operation_test
