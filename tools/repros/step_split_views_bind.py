"""step/lazy_tensor: outputs of split_with_sizes (views of one storage) fail to bind after a compiled
step: RuntimeError: setStorage: sizes [3, 5, 5], strides [25, 5, 1], storage offset 25, ... out of
bounds for storage. Each compiled result is bound as its own small storage, while the recorded layout
keeps the view's offset into the original storage."""
import torch
import pydisc
x = torch.randn(7, 5, 5)
parts = torch.split_with_sizes(pydisc.to_lazy(x.clone()).mul(2), [1, 2, 4])   # a computed (pending) input
pydisc.mark_step()
print([p.cpu().shape for p in parts])   # eager: [(1, 5, 5), (2, 5, 5), (4, 5, 5)]
