"""Host cost of one CompiledModule.run, per CPU driver (not a test: `PYTHONPATH=. python tests/exec/bench_call_overhead.py`).

Compares local-sync (pydisc's choice, see pydisc/exec/target.py) with local-task on a tiny add and on a
medium matmul + bias + relu + tanh function, and prints torch eager for the same work.
"""
from __future__ import annotations

import dataclasses
import sys
import time

import iree.runtime as ireert
import torch

from pydisc.exec import CompiledModule, compile_module
from pydisc.exec.session import DeviceSession, vm_instance, session_for

TINY = """func.func @main(%a: tensor<4xf32>, %b: tensor<4xf32>, %o: tensor<4xf32> {iree.abi.output = 0 : index}) -> tensor<4xf32> {
  %r = stablehlo.add %a, %b : tensor<4xf32>
  return %r : tensor<4xf32>
}"""


def medium(n: int) -> str:
    t = f"tensor<{n}x{n}xf32>"
    return f"""func.func @main(%a: {t}, %w: {t}, %bias: tensor<{n}xf32>, %o: {t} {{iree.abi.output = 0 : index}}) -> {t} {{
  %m = stablehlo.dot_general %a, %w, contracting_dims = [1] x [0] : ({t}, {t}) -> {t}
  %b = stablehlo.broadcast_in_dim %bias, dims = [1] : (tensor<{n}xf32>) -> {t}
  %s = stablehlo.add %m, %b : {t}
  %z = stablehlo.constant dense<0.0> : {t}
  %r = stablehlo.maximum %s, %z : {t}
  %y = stablehlo.tanh %r : {t}
  return %y : {t}
}}"""


def session_with_driver(driver: str) -> DeviceSession:
    base = session_for("cpu")
    if ireert.get_driver(driver) is None:
        raise SystemExit(f"driver {driver} missing")
    hal_device = ireert.get_driver(driver).create_default_device()
    return dataclasses.replace(base, hal_device=hal_device,
                               hal_module=ireert.create_hal_module(vm_instance(), hal_device))


def per_call_us(fn, iters: int) -> float:
    for _ in range(min(iters, 50)):
        fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - t0) / iters * 1e6)
    return best


def main_cuda() -> None:
    device = torch.device("cuda", 0)
    module = compile_module(TINY, device)
    ins, outs = [torch.randn(4, device=device), torch.randn(4, device=device)], [torch.empty(4, device=device)]
    run_us = per_call_us(lambda: module.run(ins, outs), 5000)
    eager_us = per_call_us(lambda: torch.add(*ins, out=outs[0]), 5000)
    print(f"cuda tiny add: run {run_us:.1f} us, torch eager {eager_us:.1f} us")


def main() -> None:
    if sys.argv[1:] == ["cuda"]:
        return main_cuda()
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 256
    cases = {
        "tiny add (3 tensors of 4 f32)": (TINY, [torch.randn(4), torch.randn(4)], [torch.empty(4)], 20000,
                                          lambda a, b: a + b),
        f"matmul+bias+relu+tanh {n}x{n}": (medium(n), [torch.randn(n, n), torch.randn(n, n), torch.randn(n)],
                                          [torch.empty(n, n)], 200,
                                          lambda a, w, b: torch.tanh(torch.relu(a @ w + b))),
    }
    print(f"torch threads: {torch.get_num_threads()}")
    for name, (text, ins, outs, iters, eager) in cases.items():
        default = compile_module(text, "cpu")
        row = {}
        for driver in ("local-sync", "local-task"):
            module = CompiledModule(default.vmfb, session_with_driver(driver), default.name)
            row[driver] = per_call_us(lambda: module.run(ins, outs), iters)
        row["torch eager"] = per_call_us(lambda: eager(*ins), iters)
        print(f"{name}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items()))


if __name__ == "__main__":
    main()
