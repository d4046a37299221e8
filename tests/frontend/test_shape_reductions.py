"""Shape, indexing, creation and reduction rules against eager torch."""
from __future__ import annotations

import pytest
import torch

from conftest import check


def test_shape_ops() -> None:
    def fn(x: torch.Tensor, v: torch.Tensor, s: torch.Tensor) -> list[torch.Tensor]:
        a, b_, c = torch.split(x, [1, 2, 1], dim=1)
        return [
            x.view(4, 12), x.reshape(-1), x.permute(2, 0, 1), x.transpose(0, -1), x.t() if x.dim() == 2 else x.mT,
            v.expand(3, 6), x.unsqueeze(1), x[:, :1].squeeze(1), x[1:3], x[::2, 1:], x[:, -3:-1], x[..., ::3],
            x[:, 10:], x[-100:2], x[1], x[:, -1], torch.cat([x, x * 2], dim=-1), torch.stack([v, v]), a, b_ + 1, c,
            torch.nn.functional.pad(x, (1, 2, 0, 1), value=-1.0), torch.nn.functional.pad(x, (-1, 1)),
            x.flip(0, 2), x.clone(), s.reshape(1, 1), x.flatten(1), torch.roll(v, 2), v.repeat(2, 3),
            torch.tril(x[0]), torch.cat([v, torch.empty(0)]), x.narrow(2, 1, 2), x.unbind(0)[2],
        ]

    check(fn, torch.randn(4, 4, 3), torch.randn(6), torch.tensor(3.0))


def test_indexing_ops() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        return [
            torch.index_select(x, 0, idx.abs()), torch.index_select(x, 1, idx[:2]), torch.gather(x, 1, g),
            torch.nn.functional.embedding(idx.view(2, 2).abs(), w), x[idx], x[idx, idx],
            torch.zeros(4, 5).scatter(1, g, 1.5), torch.zeros(4, 5).scatter(1, g, x[:, :3]),
            torch.zeros(4, 5).scatter_add(1, g, torch.ones(4, 3)), torch.nn.functional.one_hot(idx.abs(), 6),
            x.view(-1).as_strided((3, 2), (2, 5), 1),
        ]

    idx = torch.tensor([3, 0, -1, 1])
    check(fn, torch.randn(4, 5), torch.randn(6, 3), idx, torch.randint(0, 5, (4, 3)))


def test_creation_ops() -> None:
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        return [
            torch.zeros(2, 3), torch.ones(3, dtype=torch.int64), torch.full((2,), 7.5), torch.full_like(x, -2),
            torch.zeros_like(x, dtype=torch.bool), x.new_ones(2), x.new_full((3,), 4.0), torch.arange(5),
            torch.arange(1, 10, 3), torch.arange(0.0, 2.0, 0.25), torch.arange(6, dtype=torch.float16),
            torch.empty(2, 2).fill_(3.0), torch.scalar_tensor(2.5), x.new_zeros(0) + 1,
        ]

    check(fn, torch.randn(3, 2))


def test_reductions() -> None:
    def fn(x: torch.Tensor, i: torch.Tensor, b: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
        values, indices = x.max(dim=1)
        mvalues, mindices = x.min(dim=0, keepdim=True)
        return [
            x.sum(), x.sum(0), x.sum((0, -1), keepdim=True), x.mean(), x.mean(1, keepdim=True), x.amax(1),
            x.amin((0, 2)), x.prod(1), x.argmax(), x.argmax(2), x.argmin(1, keepdim=True), values, indices,
            mvalues, mindices, i.sum(), i.sum(1), b.any(), b.all(1), b.sum(), x.var(1), x.var((0, 2), correction=0),
            x.std(), torch.var_mean(x, 1)[0], torch.var_mean(x, 1)[1], h.sum(1), h.mean(), i.max(), x.sum(1, dtype=torch.float64),
            torch.logsumexp(x, 1), torch.linalg.vector_norm(x, dim=1), i.amax(0), x.max(), b.float().mean(),
        ]

    x = torch.randn(3, 4, 5)
    x[0, 1, 2] = x[0, 1, 3]  # a tie: the first index wins
    check(
        fn, x, torch.randint(-5, 5, (3, 4)), torch.rand(3, 4) > 0.3, torch.randn(4, 6, dtype=torch.bfloat16),
        atol=2e-2, rtol=2e-2,
    )


def test_argmax_nan() -> None:
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        return [x.argmax(1), x.argmin(1), x.amax(1), x.max(1)[1]]

    x = torch.tensor([[1.0, float("nan"), 3.0], [2.0, 5.0, 5.0]])
    check(fn, x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linalg(dtype: torch.dtype) -> None:
    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor) -> list[torch.Tensor]:
        return [a @ b, torch.bmm(c, c.transpose(1, 2)), torch.addmm(bias, a, b, beta=0.5, alpha=2), a @ b[:, 0],
                torch.nn.functional.linear(a, b.t(), bias), torch.einsum("bij,bkj->bik", c, c), b[:, 0] @ b[:, 1]]

    tol = 5e-2 if dtype == torch.bfloat16 else None
    check(fn, torch.randn(4, 6, dtype=dtype), torch.randn(6, 5, dtype=dtype), torch.randn(2, 3, 4, dtype=dtype),
          torch.randn(5, dtype=dtype), atol=tol, rtol=tol)


def test_index_and_index_put_with_slices() -> None:
    """x[:, i], x[i, :, j] and their index_put forms: None entries are full slices; the batch dims of the
    result sit where the indexed dims were when these are adjacent, in front otherwise."""
    aten = torch.ops.aten

    def fn(x: torch.Tensor, i: torch.Tensor, j: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        return [
            x[:, i], x[:, :, i, j], x[i, :, j], x[:, i, :, j], x[..., j],
            aten.index_put(x, [None, i], v.expand(3, 2, 2, 5, 6)),
            aten.index_put(x, [None, None, i, j], v[0, 0, 0, 0, :2], True),
            aten.index_put(x, [i, None, j], v[0, 0, 0, 0, :4].reshape(2, 2, 1, 1), True),
            aten.index_put(x, [None, i, None, j], v[0, 0, 0, :, 0], True),
        ]

    i = torch.tensor([[0, 2], [1, -1]])
    check(fn, torch.randn(3, 4, 5, 6), i, torch.tensor([1, 0]), torch.randn(1, 1, 1, 5, 6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_scatter_reduce(dtype: torch.dtype) -> None:
    """Every reduction, with and without the input's own values; integer mean divides with floor."""
    def fn(x: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> list[torch.Tensor]:
        reductions = ("sum", "prod", "amax", "amin") + (() if dtype == torch.bool else ("mean",))
        return [x.scatter_reduce(1, index, src, r, include_self=s) for r in reductions for s in (True, False)] + \
            [x[0, 0].scatter_reduce(0, index[0, :1] * 0, src[0, 0], "sum")]

    x, src = (torch.randn(4, 5) * 5).to(dtype), (torch.randn(4, 6) * 5).to(dtype)
    check(fn, x, torch.randint(0, 5, (4, 3)), src)


def test_as_strided_scatter_and_prod_backward() -> None:
    """as_strided's backward (as_strided_scatter) and prod's (cumprod, through prims.prod)."""
    def fn(x: torch.Tensor, p: torch.Tensor) -> list[torch.Tensor]:
        def loss(x, p):  # noqa: ANN001, ANN202
            return (x.as_strided((3, 2), (2, 5), 1).square().sum() + x.as_strided((2, 2), (1, 1)).exp().sum()
                    + p.prod(1).sum() + p.prod())

        return list(torch.func.grad(loss, argnums=(0, 1))(x, p)) + [torch.cumprod(p, 0)]

    check(fn, torch.randn(4, 5), torch.rand(3, 4) + 0.5)


def test_masked_scatter_forward_and_backward() -> None:
    """masked_scatter without a data-dependent shape: the k-th True position takes source's k-th element
    (a gather at the running count of True's); the source's gradient is the transpose (a scatter-add)."""
    def fn(x: torch.Tensor, mask: torch.Tensor, row: torch.Tensor, src: torch.Tensor) -> list[torch.Tensor]:
        def loss(x, src):  # noqa: ANN001, ANN202
            return x.masked_scatter(mask, src).square().sum() + x.masked_scatter(row, src).exp().sum()

        return [x.masked_scatter(mask, src), x.masked_scatter(row, src),
                (x > 0).masked_scatter(mask, src > 0), *torch.func.grad(loss, argnums=(0, 1))(x, src)]

    check(fn, torch.randn(3, 4), torch.rand(3, 4) > 0.5, torch.tensor([True, False, True, True]), torch.randn(15))


def test_diagonal_scatter_and_diagonal_backward() -> None:
    """diagonal_scatter as a select (torch's decomposition writes with copy_ into a view)."""
    aten = torch.ops.aten

    def fn(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        return [aten.diagonal_backward(x[0, :3], [4, 5], 2, 0, 1), aten.diagonal_backward(y[0, :3, :1], [2, 3, 4], -1, 2, 0),
                torch.diagonal_scatter(x, x[0, :3] * 2, -1), torch.diagonal_scatter(y, y[0, :3, :1], 1, 2, 0)]

    check(fn, torch.randn(4, 5), torch.randn(2, 3, 4))


def test_large_reductions_over_leading_dims_split_in_two_stages() -> None:
    # IREE's GPU code loops over all reduced elements in one thread per result (a bias gradient) or one
    # thread in all (a scalar): from SPLIT_REDUCTION_MIN elements on, the emitter reduces in two stages
    def fn(x: torch.Tensor, y: torch.Tensor, h: torch.Tensor) -> list[torch.Tensor]:
        return [x.sum(0), (x * 2).sum(), x.amax(0), y.sum((0, 1)), y.mean(), h.sum(0), h.sum(), x.sum(1), (x > 0).sum()]

    cluster = check(fn, torch.randn(8192, 24), torch.randn(64, 96, 8), torch.randn(4096, 3).to(torch.bfloat16),
                    rtol=1e-4, atol=1e-3)
    reduces = cluster.text.count('"stablehlo.reduce"')
    assert reduces >= 2 * 8 + 1, reduces        # the row sum x.sum(1) is not split


def test_sums_of_products_with_a_broadcast_operand_compile() -> None:
    # IREE 3.13's CPU code rejects a sum over the innermost dim and a dim that a product's operand is
    # broadcast along ("'vector.contract' op invalid accumulator/result vector shape"): a weighted loss
    # `(out * w).sum()` compiled nothing and its whole step ran eagerly. Reduced in two by the emitter.
    def fn(x: torch.Tensor, w: torch.Tensor, v: torch.Tensor, y: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
        return [(x * w).sum(), (x * w).mean(), (x * w).sum((1, 2)), (x * v).sum(), (y * w[:8]).sum(),
                (x * c[:, None, :]).sum(), (x * w).amax((0, 2)), (x * w).sum(-1), (x * w).sum((0, 1))]

    x, w = torch.randn(4, 8, 16), torch.randn(16)
    check(fn, x, w, torch.randn(8, 16), torch.randn(4, 8), torch.randn(4, 16), rtol=1e-5, atol=1e-5)


def test_split_choice() -> None:
    from pydisc.frontend.lowering import reductions
    from pydisc.frontend.lowering.values import TensorSpec, Value

    def split(shape, dims):
        return reductions._split(Value("%x", TensorSpec(shape, torch.float32)), dims)

    assert split((32768, 768), [0]) == (256, 128, (768,))       # k near sqrt(R): both stages loop ~the same
    assert split((64, 512, 768), [0, 1]) == (256, 128, (768,))
    assert split((16384, 4096), [0, 1]) == (65536, 1024, ())    # to a scalar: contiguous rows of 1024
    assert split((4095, 8), [0]) is None                         # too few elements to pay
    assert split((8192, 24), [1]) is None                        # an inner reduction is parallel already
    assert split((8191 * 2, 4), [0]) is None                     # no power-of-two factor to split by


def test_as_strided_scatter_marks_non_overlapping_views_unique() -> None:
    from pydisc.frontend.lowering.indexing import _non_overlapping

    assert _non_overlapping((3, 2), (2, 1)) and _non_overlapping((2, 3), (1, 2)) and _non_overlapping((4,), (3,))
    assert not _non_overlapping((3, 2), (1, 1)) and not _non_overlapping((2, 5), (0, 1))
    assert _non_overlapping((1, 5), (0, 1))     # a dim of size 1 never repeats a position

    def fn(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        return torch.as_strided_scatter(x, src, (3, 2), (2, 1), 1)

    cluster = check(fn, torch.randn(8), torch.randn(3, 2))
    assert "unique_indices = true" in cluster.text
