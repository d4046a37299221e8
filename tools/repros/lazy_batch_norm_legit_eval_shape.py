"""lazy_tensor: recorded metadata of _native_batch_norm_legit(training=False) differs from eager on CPU:
save_mean/save_rstd are [C] (the meta kernel's non-CPU branch) instead of [0]; the step then fails with
"shape '[2]' is invalid for input of size 0" (step.py) or returns a wrong shape."""
import torch
import pydisc
aten = torch.ops.aten
x, rm, rv = torch.randn(3, 2, 4), torch.zeros(2), torch.ones(2)
eager = aten._native_batch_norm_legit(x, None, None, rm.clone(), rv.clone(), False, 0.1, 1e-5)
lazy = aten._native_batch_norm_legit(pydisc.to_lazy(x.clone()), None, None, pydisc.to_lazy(rm.clone()),
                                     pydisc.to_lazy(rv.clone()), False, 0.1, 1e-5)
print("eager", [tuple(t.shape) for t in eager], "lazy", [tuple(t.shape) for t in lazy])
pydisc.mark_step()
print([t.cpu().shape for t in lazy])
