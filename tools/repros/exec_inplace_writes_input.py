"""pydisc.exec: a compiled scatter writes into its *input* tensor (zero-copy import), and every call
adds the updates again. IREE runs in-place ops (scatter, sort) on the argument's buffer; the output
import fails with DISCARD_WRITE, exec retries with staged outputs, and the input has been modified.
The lowering now copies scatter/sort operands first (FunctionBuilder.fresh_copy), but exec should
import inputs so that IREE cannot write them (or copy them when a module ties a result to one)."""
import torch
from pydisc.exec import compile_module

text = """module {
  func.func @main(%x: tensor<4xf32>, %i: tensor<6x1xi64>, %u: tensor<6xf32>, %out0: tensor<4xf32> {iree.abi.output = 0 : index}) -> tensor<4xf32> {
    %r = "stablehlo.scatter"(%x, %i, %u) ({
      ^bb0(%a: tensor<f32>, %b: tensor<f32>):
        %s = stablehlo.add %a, %b : tensor<f32>
        stablehlo.return %s : tensor<f32>
    }) {scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, indices_are_sorted = false, unique_indices = false} : (tensor<4xf32>, tensor<6x1xi64>, tensor<6xf32>) -> tensor<4xf32>
    return %r : tensor<4xf32>
  }
}"""
m = compile_module(text, torch.device("cpu"))
x = torch.zeros(4); idx = torch.tensor([[0], [0], [1], [1], [1], [3]]); src = torch.ones(6)
for call in range(3):
    out = torch.empty(4)
    m.run([x, idx, src], [out])
    print(call, "out", out.tolist(), "input x", x.tolist())  # expected: out [2, 3, 0, 1], x stays zeros
