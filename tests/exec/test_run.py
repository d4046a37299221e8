"""Running compiled modules on torch tensors: values, dtypes, zero-copy outputs, odd layouts, errors."""
import inspect

import pytest
import torch

from pydisc.exec import ExecutionError, compile_module
from pydisc.exec.compiled import CompiledModule
from pydisc.exec.direct.launcher import DirectModule
from pydisc.exec.session import session_for

MLIR_TYPES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "ui8", torch.bool: "i1",
}


def tensor_type(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"tensor<{''.join(f'{d}x' for d in shape)}{MLIR_TYPES[dtype]}>"


def binary(op: str, shape: tuple[int, ...], dtype: torch.dtype) -> str:
    t = tensor_type(shape, dtype)
    return f"""func.func @main(%a: {t}, %b: {t}, %o: {t} {{iree.abi.output = 0 : index}}) -> {t} {{
  %r = stablehlo.{op} %a, %b : {t}
  return %r : {t}
}}"""


def sample(shape, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return (torch.rand(shape, generator=g) > 0.5).to(device)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype).to(device)
    return torch.randint(-50 if dtype.is_signed else 0, 50, shape, generator=g).to(dtype).to(device)


@pytest.mark.parametrize("dtype", list(MLIR_TYPES), ids=str)
def test_dtype_round_trip(device, dtype, metrics):
    op, expected_fn = ("xor", torch.logical_xor) if dtype == torch.bool else ("add", torch.add)
    module = compile_module(binary(op, (3, 5), dtype), device)
    a, b = sample((3, 5), dtype, device, 1), sample((3, 5), dtype, device, 2)
    a0, b0 = a.clone(), b.clone()
    out = torch.empty(3, 5, dtype=dtype, device=device)
    ptr = out.data_ptr()
    module.run([a, b], [out])
    assert out.data_ptr() == ptr
    assert torch.equal(out, expected_fn(a, b)), (out, expected_fn(a, b))
    assert torch.equal(a, a0) and torch.equal(b, b0)  # inputs never written
    assert metrics.executions == 1


def test_bool_in_and_out(device):
    """i1 results are stored one byte per element, 0 or 1, exactly as torch.bool."""
    n = 1000
    text = f"""func.func @main(%a: tensor<{n}xf32>, %m: tensor<{n}xi1>, %c: tensor<{n}xi1> {{iree.abi.output = 0 : index}}, %s: tensor<{n}xf32> {{iree.abi.output = 1 : index}}) -> (tensor<{n}xi1>, tensor<{n}xf32>) {{
  %z = stablehlo.constant dense<0.0> : tensor<{n}xf32>
  %gt = stablehlo.compare GT, %a, %z : (tensor<{n}xf32>, tensor<{n}xf32>) -> tensor<{n}xi1>
  %sel = stablehlo.select %m, %a, %z : tensor<{n}xi1>, tensor<{n}xf32>
  return %gt, %sel : tensor<{n}xi1>, tensor<{n}xf32>
}}"""
    a = torch.randn(n, device=device)
    m = torch.rand(n, device=device) > 0.5
    c = torch.full((n,), True, device=device)
    s = torch.empty(n, device=device)
    compile_module(text, device).run([a, m], [c, s])
    assert torch.equal(c, a > 0)
    assert c.view(torch.uint8).max().item() <= 1
    assert torch.equal(s, torch.where(m, a, 0.0))


def test_zero_d(device):
    module = compile_module(binary("add", (), torch.float32), device)
    out = torch.empty((), device=device)
    module.run([torch.tensor(1.5, device=device), torch.tensor(2.25, device=device)], [out])
    assert out.item() == 3.75


def test_zero_size(device):
    module = compile_module(binary("add", (0, 4), torch.float32), device)
    out = torch.empty(0, 4, device=device)
    module.run([torch.empty(0, 4, device=device), torch.empty(0, 4, device=device)], [out])
    assert out.shape == (0, 4)


MATMUL = """func.func @main(%a: tensor<4x3xf32>, %b: tensor<3x5xf32>, %o: tensor<4x5xf32> {iree.abi.output = 0 : index}) -> tensor<4x5xf32> {
  %r = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0] : (tensor<4x3xf32>, tensor<3x5xf32>) -> tensor<4x5xf32>
  return %r : tensor<4x5xf32>
}"""


def test_non_dense_inputs_are_copied(device):
    module = compile_module(MATMUL, device)
    base = torch.randn(64, device=device)
    transposed = torch.randn(3, 4, device=device).t()           # non-contiguous
    offset = base[3:18].view(3, 5)                              # contiguous, storage offset 3
    out = torch.empty(4, 5, device=device)
    before = (transposed.clone(), base.clone())
    module.run([transposed, offset], [out])
    torch.testing.assert_close(out, transposed @ offset)
    assert torch.equal(transposed, before[0]) and torch.equal(base, before[1])


def test_misaligned_input_is_copied():
    raw = bytearray(4 * 64 + 4)
    a = torch.frombuffer(memoryview(raw)[4:4 + 48], dtype=torch.float32).view(4, 3)  # offset 0, misaligned
    assert a.storage_offset() == 0 and a.data_ptr() % 64 != 0
    a.copy_(torch.randn(4, 3))
    b = torch.randn(3, 5)
    out = torch.empty(4, 5)
    compile_module(MATMUL, "cpu").run([a, b], [out])
    torch.testing.assert_close(out, a @ b)


def test_non_dense_output_is_filled(device):
    module = compile_module(binary("add", (3, 5), torch.float32), device)
    a, b = torch.randn(3, 5, device=device), torch.randn(3, 5, device=device)
    holder = torch.zeros(5, 3, device=device)
    out = holder.t()  # non-contiguous view
    module.run([a, b], [out])
    torch.testing.assert_close(holder.t(), a + b)


def test_output_aliasing_input_leaves_input_semantics(device):
    """An in-place style call (output is an input's memory) reads the input's old value."""
    module = compile_module(MATMUL.replace("4x3", "4x4").replace("3x5", "4x4").replace("4x5", "4x4"), device)
    a, b = torch.randn(4, 4, device=device), torch.randn(4, 4, device=device)
    expected = a @ b
    module.run([a, b], [a])
    torch.testing.assert_close(a, expected)


_IDENTITY_CONSTANT_PRODUCT = """func.func @main(%a: tensor<4xf32>, %o: tensor<4xf32> {iree.abi.output = 0 : index}, %p: tensor<4xf32> {iree.abi.output = 1 : index}, %q: tensor<4xf32> {iree.abi.output = 2 : index}) -> (tensor<4xf32>, tensor<4xf32>, tensor<4xf32>) {
  %c = stablehlo.constant dense<7.0> : tensor<4xf32>
  %d = stablehlo.multiply %a, %a : tensor<4xf32>
  return %a, %c, %d : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>
}"""


def _check_identity_constant_product(module, device):
    for _ in range(2):
        a = torch.randn(4, device=device)
        o, p, q = (torch.zeros(4, device=device) for _ in range(3))
        module.run([a], [o, p, q])
        assert torch.equal(o, a) and torch.equal(p, torch.full((4,), 7.0, device=device))
        assert torch.equal(q, a * a)


def test_identity_and_constant_results(device):
    """Results that are inputs or constants make IREE copy/fill into outputs instead of dispatching,
    which a DLPack import does not allow on the CPU: there the outputs are then imported as host
    allocations (zero-copy); CUDA imports allow it."""
    module = compile_module(_IDENTITY_CONSTANT_PRODUCT, device)
    _check_identity_constant_product(module, device)
    assert module.staged_outputs == (device.type == "cpu")


def test_outputs_iree_cannot_write_in_place_are_staged():
    """Without the host-allocation import, the outputs go through IREE-allocated buffers and are
    copied back."""
    cpu = torch.device("cpu")
    # a module of its own: the cached one is shared with other tests
    module = CompiledModule(compile_module(_IDENTITY_CONSTANT_PRODUCT, cpu).vmfb, session_for(cpu), name="staged")
    module._import_output = None
    assert not module.staged_outputs
    _check_identity_constant_product(module, cpu)
    assert module.staged_outputs


def test_zero_copy_output_is_written_in_place(device):
    module = compile_module(binary("multiply", (256,), torch.float32), device)
    a, b = torch.randn(256, device=device), torch.randn(256, device=device)
    out = torch.empty(256, device=device)
    view_of_out = out.view(16, 16)  # shares memory: sees IREE's writes only if no copy happened
    module.run([a, b], [out])
    assert torch.equal(view_of_out.reshape(-1), a * b)
    assert not module.staged_outputs


def test_wrong_shape_raises_execution_error(device):
    module = compile_module(binary("add", (3, 5), torch.float32), device)
    with pytest.raises(ExecutionError, match="main") as info:
        module.run([torch.randn(2, 5, device=device), torch.randn(2, 5, device=device)],
                   [torch.empty(2, 5, device=device)])
    assert "signature" in str(info.value)


def test_wrong_arity_raises_execution_error(device):
    module = compile_module(binary("add", (3, 5), torch.float32), device)
    with pytest.raises(ExecutionError):
        module.run([torch.randn(3, 5, device=device)], [torch.empty(3, 5, device=device)])


def test_many_calls_reuse_context(device, metrics):
    module = compile_module(binary("add", (8,), torch.float32), device)
    a, b, out = torch.ones(8, device=device), torch.ones(8, device=device), torch.empty(8, device=device)
    for i in range(50):
        module.run([a, b * i], [out])
        assert torch.equal(out, torch.full((8,), 1.0 + i, device=device))
    assert metrics.executions == 50


def test_inputs_at_an_address_seen_before_are_read_as_they_are_now(device):
    """On the CPU a module keeps the imports of the memory each input position was last given, by address
    (a parameter's memory alternates between two blocks from step to step): a tensor at such an address is
    read with its own values and sizes (a shorter view of the same memory is not the longer one)."""
    t = "tensor<?xf32>"
    module = compile_module(f"""func.func @main(%a: {t}, %b: {t}, %o: {t} {{iree.abi.output = 0 : index}}) -> {t} {{
  %r = stablehlo.add %a, %b : {t}
  return %r : {t}
}}""", device)
    memory, other = torch.arange(8.0, device=device), torch.ones(8, device=device)
    for n, fill in ((8, None), (8, 5.0), (4, None), (8, -1.0), (3, 2.0)):
        if fill is not None:
            memory.fill_(fill)      # new values in the same memory
        a, b = memory[:n], other[:n]
        out = torch.empty(n, device=device)
        module.run([a, b], [out])
        assert a.data_ptr() == memory.data_ptr()
        assert torch.equal(out, a + b), (n, out, a + b)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_each_gpu_gets_its_own_device(metrics):
    text = binary("add", (64,), torch.float32)
    for index in (0, 1):
        device = torch.device("cuda", index)
        a, b, out = (torch.randn(64, device=device) for _ in range(3))
        compile_module(text, device).run([a, b], [out])
        torch.testing.assert_close(out, a + b)
    assert metrics.compiles == 1 and metrics.cache_hits == 1  # bytes shared, module loaded per device
    assert torch.cuda.current_device() == 0  # IREE's context switch to cuda:1 is not leaked to torch
    # A module loaded after cuda:1 was used still runs on cuda:0 (executables load into the right context).
    device = torch.device("cuda", 0)
    a, out = torch.randn(64, device=device), torch.empty(64, device=device)
    compile_module(binary("multiply", (64,), torch.float32), device).run([a, a], [out])
    torch.testing.assert_close(out, a * a)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_reads_pending_torch_writes():
    """IREE's stream does not wait on torch's: run() must see the result of queued torch kernels."""
    device = torch.device("cuda", 0)
    module = compile_module(binary("add", (1 << 20,), torch.float32), device)
    big = torch.randn(2048, 2048, device=device)
    for _ in range(5):
        a = torch.ones(1 << 20, device=device)
        for _ in range(4):
            big = big @ big * 1e-3  # keep torch's stream busy
        a.mul_(3.0)
        out = torch.empty_like(a)
        module.run([a, a], [out])
        assert torch.all(out == 6.0)



def test_every_module_a_cluster_holds_runs_with_the_same_arguments():
    """A cluster calls `run` on whichever module it holds: IREE's runtime (`CompiledModule`) or, on CUDA,
    the direct launcher (`DirectModule`). Both take the same arguments: a keyword argument added to one
    alone made every CUDA step fall back to eager, which no CPU test ran into."""
    assert list(inspect.signature(DirectModule.run).parameters) == list(inspect.signature(CompiledModule.run).parameters)
