"""lazy_tensor: the backward of native_group_norm's mean/rstd outputs runs `unsqueeze_` (an in-place
metadata change) on lazy tensors; the lazy tensor keeps its old shape, the next op sees (1, 2, 3) where
eager has (1, 2, 3, 1), and pydisc raises where eager does not:
RuntimeError: The size of tensor a (2) must match the size of tensor b (3) at non-singleton dimension 2"""
import torch
import pydisc
aten = torch.ops.aten
x, w, b = torch.randn(1, 6, 3), torch.randn(6), torch.randn(6)
eager = aten.native_group_norm(x, w, b, 1, 6, 3, 2, 0.5)
lazy = aten.native_group_norm(*(pydisc.to_lazy(t.clone()) for t in (x, w, b)), 1, 6, 3, 2, 0.5)
print("eager", [(tuple(t.shape), t.stride()) for t in eager])
print("lazy ", [(tuple(t.shape), t.stride()) for t in lazy])
xl, wl, bl = (pydisc.to_lazy(t.clone()).requires_grad_() for t in (x, w, b))
out = aten.native_group_norm(xl, wl, bl, 1, 6, 3, 2, 0.5)
torch.autograd.grad(out[0].sum() + out[1].sum() + out[2].sum(), [xl, wl, bl])  # raises; eager does not
