"""Planning (pydisc/driver/planning.py): what tells one step's graph from another's."""
from pydisc.driver.planning import _model_of
from pydisc.frontend.trace import LazyStorage, Trace


def _model_key() -> tuple:
    """The model key of a step that reads one parameter storage, which dies with the call."""
    trace = Trace(epoch=-1)
    trace.input_storages.append(LazyStorage(64))
    return _model_of(trace)


def test_models_whose_parameters_died_are_not_the_next_ones():
    """A second model of one architecture (a sweep over widths) is told from the first by its parameters'
    storages. Keyed by `id()`, a storage made after the first model's died could take its id (CPython
    gives freed memory to the next object of its size), and the second model's first steps looked like
    the first's with changed sizes: dims made dynamic and pinned
    (`test_a_second_model_of_the_same_architecture_is_not_the_first_with_changed_sizes` failed in CI)."""
    keys = [_model_key() for _ in range(1000)]
    assert len(set(keys)) == len(keys)
