import os
import shutil
import tempfile

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--long", action="store_true", default=False,
                     help="also run the long tests (marked `long`: minutes each); PYDISC_LONG=1 does the same")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped when none is available")
    config.addinivalue_line("markers", "long: a long run (minutes), opt-in with --long or PYDISC_LONG=1")
    _use_session_compile_cache()
    _no_measured_choice()


def _no_measured_choice() -> None:
    """Tests compare compiled clusters with eager and count executions; a cluster that the measured
    choice (PYDISC_MEASURE, on CUDA by default) sends to eager, or whole steps the step choice
    (PYDISC_STEP_CHOICE) runs eagerly, or a new graph's first run left eager (PYDISC_COMPILE_AFTER), would
    make them compare eager with eager.
    tests/cluster/test_measure.py turns them on where they are the subject."""
    from pydisc.config import CONFIG

    if "PYDISC_MEASURE" not in os.environ:
        os.environ["PYDISC_MEASURE"] = "off"
        CONFIG.measure = "off"
    if "PYDISC_COMPILE_AFTER" not in os.environ:     # a new graph compiles at once: tests check its first run
        os.environ["PYDISC_COMPILE_AFTER"] = "1"
        CONFIG.compile_after = 1
    if "PYDISC_BACKGROUND_COMPILE" not in os.environ:   # plans built before the step runs: tests count them
        os.environ["PYDISC_BACKGROUND_COMPILE"] = "off"
        CONFIG.background_compile = "off"
    if "PYDISC_STEP_CHOICE" not in os.environ:
        os.environ["PYDISC_STEP_CHOICE"] = "off"
        CONFIG.step_choice = "off"


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    import torch

    skips = {}
    if not torch.cuda.is_available():
        skips["cuda"] = pytest.mark.skip(reason="no CUDA GPU")
    if not (config.getoption("--long") or os.environ.get("PYDISC_LONG") == "1"):
        skips["long"] = pytest.mark.skip(reason="long run: opt-in with --long or PYDISC_LONG=1")
    for item in items:
        for marker, skip in skips.items():
            if item.get_closest_marker(marker) is not None:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_dynamic_dims_of_another_test():
    """Each test starts with no dims flagged dynamic, none pinned, no templates: those are keyed by a step
    input's ordinal, so another test's (input #0 dim 0 pinned by a size compared with a number) would
    change how this test's steps are recorded, depending on which tests ran before in the process."""
    from pydisc.driver import dynamic

    dynamic.clear()
    yield


@pytest.fixture
def fresh_plans():
    """A test that asserts plan-cache counters (hits, plans compiled) plans its steps anew: no plan,
    sighting or dynamic-shape template of an earlier test in the process serves them (a model of the
    same shapes trained by another test would)."""
    from pydisc.driver.step import clear_plans

    clear_plans()
    yield
    clear_plans()


@pytest.fixture(autouse=True)
def _warnings_not_yet_given(monkeypatch):
    """pydisc warns once per process about each thing (`diagnostics.warn_once`): each test starts as if
    none had been given, so a test that expects a warning does not depend on whether a test before it in
    the same process met the same thing (an LSTM made lazy warns about its parameters)."""
    from pydisc import diagnostics

    monkeypatch.setattr(diagnostics, "_WARNED", set())


@pytest.fixture(autouse=True)
def _no_step_outlives_its_test():
    """A step a test left running on the worker thread (PYDISC_ASYNC) finishes within that test."""
    yield
    import pydisc

    pydisc.synchronize()


@pytest.fixture(autouse=True)
def _no_symbolic_state_outlives_its_step():
    """Between steps pydisc leaves torch's global dispatch state as it found it: a symbolic step's Python
    dispatcher and hidden Python kernels end with the step (one left on once made later tests trace
    other ops, far from the test that leaked it)."""
    yield
    import torch
    from pydisc.frontend.lazy_tensor import RECORDER

    if RECORDER.symbolic is None:
        assert not torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher), \
            "the Python dispatcher outlived the symbolic step that enabled it"
        assert torch._C.DispatchKey.CompositeImplicitAutograd in torch.ops.aten.dropout.default.py_kernels


# The on-disk compile cache (docs/cache.md) of a test run lives in a temp folder made for the session,
# unless PYDISC_CACHE_DIR is already set: CI stays hermetic and never touches ~/.cache/pydisc, while
# compiled modules are still shared by the tests (and the subprocesses they start) of one session.
_SESSION_CACHE_DIR: str | None = None


def _use_session_compile_cache() -> None:
    global _SESSION_CACHE_DIR
    if "PYDISC_CACHE_DIR" in os.environ:
        return
    _SESSION_CACHE_DIR = tempfile.mkdtemp(prefix="pydisc-test-cache-")  # mode 0700, as pydisc requires
    os.environ["PYDISC_CACHE_DIR"] = _SESSION_CACHE_DIR
    # pydisc may be imported already (a sub-folder's conftest.py loaded before this hook), and its
    # CONFIG reads the environment at import.
    from pydisc.config import CONFIG

    CONFIG.cache_dir = _SESSION_CACHE_DIR


def pytest_unconfigure(config: pytest.Config) -> None:
    if _SESSION_CACHE_DIR is not None:
        if os.environ.get("PYDISC_CACHE_DIR") == _SESSION_CACHE_DIR:
            del os.environ["PYDISC_CACHE_DIR"]
        shutil.rmtree(_SESSION_CACHE_DIR, ignore_errors=True)
