"""Direct kernel launch vs IREE's runtime vs eager PyTorch, on one GPU.

    python bench/direct_launch.py [--repeats 200]

Prints two tables, every row measured side by side in this run:
1. host cost per call of a tiny op: an eager torch op, a compiled cluster called through IREE's runtime
   (`PYDISC_GPU_EXECUTOR=iree`), the same cluster launched directly on torch's stream (the default);
2. the loop [matmul -> fused region -> matmul] (the shape of a transformer FFN: cuBLAS matmuls in torch,
   the memory-bound ops between them fused by IREE), median over repeats, CUDA-synchronised once per
   repeat of 20 iterations, for several M.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from pydisc.config import CONFIG
from pydisc.exec import clear_cache, compile_module
from pydisc.frontend.decompositions import DECOMPOSITIONS
from pydisc.frontend.emit import emit_cluster


def module_for(fn, args, executor: str):
    CONFIG.gpu_executor = executor
    gm = make_fx(torch.func.functionalize(fn), decomposition_table=DECOMPOSITIONS, tracing_mode="fake")(
        *[a.cpu() for a in args])
    emitted = emit_cluster(gm)
    module = compile_module(emitted.text, args[0].device)
    outs = [torch.empty(s.shape, dtype=s.dtype, device=args[0].device) for s in emitted.outputs]
    return module, outs


def per_call(fn, repeats: int) -> float:
    """Host microseconds per call, over `repeats` calls queued back to back (then one sync)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / repeats * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    dev = torch.device("cuda", 0)
    torch.manual_seed(0)

    x = torch.randn(8, device=dev)
    tiny = lambda a: a + 1.0  # noqa: E731
    rows = [("eager torch op (a + 1)", per_call(lambda: tiny(x), args.repeats))]
    for executor, label in (("iree", "IREE runtime call"), ("direct", "direct launch (pydisc)")):
        clear_cache()
        module, outs = module_for(tiny, [x], executor)
        rows.append(("%s, %s" % (label, type(module).__name__), per_call(lambda: module.run([x], outs), args.repeats)))
    print("\n## Host cost per call, tiny elementwise op (%s, torch %s)\n" % (torch.cuda.get_device_name(dev), torch.__version__))
    print("| path | us/call |")
    print("| --- | ---: |")
    for label, us in rows:
        print("| %s | %.1f |" % (label, us))

    print("\n## [matmul -> bias+GELU+scale region -> matmul], K=768, N=3072 then 768, fp32 (TF32 off), "
          "20 iterations per sample\n")
    print("| M | eager us/iter | IREE runtime us/iter | direct us/iter | direct/eager | direct/IREE runtime |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    region = lambda h, b: F.gelu(h + b) * 0.5  # noqa: E731
    for m in (4096, 64, 8):
        a = torch.randn(m, 768, device=dev)
        w1 = torch.randn(768, 3072, device=dev) / 30
        b1 = torch.randn(3072, device=dev)
        w2 = torch.randn(3072, 768, device=dev) / 60
        h = a @ w1

        def eager():
            y = a
            for _ in range(20):
                y = region(y @ w1, b1) @ w2
            return y

        results = {"eager": per_call(eager, max(1, args.repeats // 20)) / 20}
        outputs = {"eager": eager()}
        for executor in ("iree", "direct"):
            clear_cache()
            module, outs = module_for(region, [h, b1], executor)

            def compiled(module=module):
                y = a
                for _ in range(20):
                    t = torch.empty(m, 3072, device=dev)
                    module.run([y @ w1, b1], [t])
                    y = t @ w2
                return y

            results[executor] = per_call(compiled, max(1, args.repeats // 20)) / 20
            outputs[executor] = compiled()
        for executor in ("iree", "direct"):
            torch.testing.assert_close(outputs[executor], outputs["eager"], rtol=1e-3, atol=1e-3)
        print("| %d | %.1f | %.1f | %.1f | %.2f | %.2f |" % (
            m, results["eager"], results["iree"], results["direct"], results["direct"] / results["eager"],
            results["direct"] / results["iree"]))


if __name__ == "__main__":
    main()
