import torch
import pydisc
import torch.nn as nn
import torch.nn.functional as F
import time
torch.backends.cudnn.allow_tf32 = False; torch.backends.cuda.matmul.allow_tf32 = False
def make():
    torch.manual_seed(0); return nn.Sequential(nn.Linear(784,256), nn.ReLU(), nn.Linear(256,128), nn.ReLU(), nn.Linear(128,10))
ref = make().cuda(); m = pydisc.lazy(make(), device="cuda")
oref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9); om = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(0)
data = [(torch.randn(128,784,generator=g).cuda(), torch.randint(0,10,(128,),generator=g).cuda()) for _ in range(40)]
te = tl = 0
for step, (x, y) in enumerate(data):
    torch.cuda.synchronize(); t0 = time.perf_counter()
    l1 = F.cross_entropy(ref(x), y); l1.backward(); oref.step(); oref.zero_grad()
    torch.cuda.synchronize(); t1 = time.perf_counter()
    l2 = F.cross_entropy(m(x), y); l2.backward(); om.step(); om.zero_grad(); pydisc.mark_step()
    torch.cuda.synchronize(); t2 = time.perf_counter()
    if step >= 5: te += t1 - t0; tl += t2 - t1
    if step % 10 == 0 or step == 39: print(step, l1.item(), l2.item(), "first step %.2fs" % (t2 - t1) if step == 0 else "")
print("eager %.0f us/step, pydisc %.0f us/step" % (te / 35 * 1e6, tl / 35 * 1e6))
print("max param diff", max((a - b.cpu().cuda()).abs().max().item() for a, b in zip(ref.parameters(), m.parameters())))
print(pydisc.metrics_report())
