"""The step driver: what happens at `mark_step()`, between recording and the compiled kernels.

`step.run_pending` takes the recorded trace, finds its plan or has `planning` make one (`plan.build_plan`:
functional graph -> partition -> emit -> compile), binds the step's inputs and runs it; `dynamic` matches steps
against symbolic templates, `step_choice` measures whole steps compiled against eager, `background`
builds plans in a thread, `optimizer_state` rolls back eager optimizer counters of an abandoned step,
`step_check` compares steps with eager under PYDISC_CHECK, `shape_log` logs compiled clusters. The
per-process state of all of them is owned by `engine.ENGINE` (docs/architecture.md).
"""
from ..frontend.lazy_tensor import install_driver
from . import dynamic, step

install_driver(run=lambda t, reason: step.run_pending(t, reason), prune=step.prune_pending,
               dims_of=dynamic.dims_of)
