"""Binding a run's results (pydisc/driver/bind.py): the written inputs' new values reach their device
data whatever the results alias."""
import torch

from pydisc.driver.bind import bind
from pydisc.frontend.trace import LazyStorage, Trace


def _trace_of_inputs(*reals: torch.Tensor) -> Trace:
    trace = Trace(epoch=-1)
    for r in reals:
        trace.input_storages.append(LazyStorage(r.untyped_storage().nbytes(), r))
        trace.storage_inputs.append(r)
        trace.storage_versions.append(r._version)
    return trace


def test_results_that_are_other_written_inputs_data_are_read_before_any_input_is_written():
    # A step that swaps two buffers, run by torch, may give each input's old data as the other's new
    # value: written one after the other, the second would read what the first wrote.
    a, b = torch.arange(4.0), torch.arange(4.0) + 10
    trace = _trace_of_inputs(a, b)
    bind(trace, (("base", 0), ("base", 1)), [b, a], [], [], fresh_trace=False)
    assert a.tolist() == [10.0, 11.0, 12.0, 13.0]
    assert b.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert trace.storage_versions == [a._version, b._version]   # the step's own writes, not the user's


def test_a_result_that_is_its_input_written_in_place_is_not_copied():
    a = torch.arange(4.0)
    trace = _trace_of_inputs(a)
    version = a._version
    bind(trace, (("base", 0),), [a], [], [], fresh_trace=False)
    assert a._version == version and trace.storage_versions == [version]
