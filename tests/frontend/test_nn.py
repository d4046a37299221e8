"""Convolution and pooling rules (forward and backward) and whole training steps, against eager torch."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from conftest import check


def test_convolutions_forward_and_backward() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, wg: torch.Tensor, wt: torch.Tensor) -> list[torch.Tensor]:
        def loss(x, w, b, wg):  # noqa: ANN001, ANN202
            y = F.conv2d(x, w, b, stride=2, padding=1)
            z = F.conv2d(x, wg, None, padding=2, dilation=2, groups=2)
            return (y.square().sum() + z.sin().sum(), (y, z))

        _, (y, z) = loss(x, w, b, wg)
        grads = torch.func.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2, 3))(x, w, b, wg)
        t = F.conv_transpose2d(x, wt, stride=2, padding=1, output_padding=1)
        c1 = F.conv1d(x[:, :, 0], w[:, :, 0], b)
        return [y, z, *grads, t, c1]

    x = torch.randn(2, 4, 9, 9)
    check(fn, x, torch.randn(3, 4, 3, 3), torch.randn(3), torch.randn(6, 2, 3, 3), torch.randn(4, 2, 3, 3),
          atol=1e-4, rtol=1e-4)


def test_pooling_forward_and_backward() -> None:
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        def loss(x):  # noqa: ANN001, ANN202
            a = F.max_pool2d(x, 2)
            b = F.max_pool2d(x, 3, stride=2, padding=1)
            c = F.max_pool2d(x, 2, stride=2, ceil_mode=True)
            return (a.square().sum() + b.sum() + c.exp().sum())

        out, idx = F.max_pool2d(x, 3, stride=2, padding=1, return_indices=True)
        return [out, idx, torch.func.grad(loss)(x), F.avg_pool2d(x, 2), F.avg_pool2d(x, 3, 2, 1),
                F.avg_pool2d(x, 3, 2, 1, count_include_pad=False), F.adaptive_avg_pool2d(x, 1)]

    check(fn, torch.randn(2, 3, 7, 7))


class _Log(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self.calls.append((func, args, kwargs or {}, out))
        return out


def _replayed_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """Record one eager train step at the ATen level (as pydisc does), replay that trace as one cluster,
    and compare the updated state with eager's."""
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()  # creates the optimizer state
    state = [*model.parameters(), *model.buffers(), *(p.grad for p in model.parameters()),
             *(t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)), x, y]
    before = [t.detach().clone() for t in state]
    with _Log() as log:
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    calls = [c for c in log.calls if c[0].namespace == "aten"]
    after = [t.detach().clone() for t in state]
    known = {id(t) for t in state}
    for _, args, kwargs, out in calls:  # tensors made outside the step (constants) become inputs too
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor) and id(a) not in known:
                state.append(a)
                before.append(a.detach().clone())
                known.add(id(a))
        known.update(id(o) for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))
    count = len(after)

    def replay(*inputs: torch.Tensor) -> list[torch.Tensor]:
        env = {id(t): i.clone() for t, i in zip(state, inputs)}
        for func, args, kwargs, out in calls:
            res = func(*tree_map(lambda a: env.get(id(a), a), (args, kwargs))[0],
                       **tree_map(lambda a: env.get(id(a), a), kwargs))
            for o, r in zip(tree_flatten(out)[0], tree_flatten(res)[0]):
                if isinstance(o, torch.Tensor):
                    env[id(o)] = r
        return [env[id(t)] for t in state[:count]]

    cluster = check(replay, *before, atol=1e-4, rtol=1e-4)
    # check() compares with replay() run eagerly; make sure that is the real step too.
    torch.testing.assert_close(replay(*before), after)
    assert "aten.convolution_backward.default" in cluster.ops or isinstance(model[0], nn.Linear)


def test_mlp_train_step_sgd_momentum() -> None:
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _replayed_step(model, opt, torch.randn(8, 20), torch.randint(0, 10, (8,)))


def test_cnn_train_step_batchnorm() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _replayed_step(model, opt, torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,)))


def test_adam_foreach_update() -> None:
    def fn(p: torch.Tensor, q: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        params, grads, ms, vs = [p.clone(), q.clone()], [g, g * 2], [m.clone(), m.clone()], [v.clone(), v.clone()]
        torch._foreach_lerp_(ms, grads, 0.1)
        torch._foreach_mul_(vs, 0.999)
        torch._foreach_addcmul_(vs, grads, grads, 0.001)
        denom = torch._foreach_sqrt(vs)
        torch._foreach_div_(denom, [0.5, 0.25])
        torch._foreach_add_(denom, 1e-8)
        torch._foreach_addcdiv_(params, ms, denom, [-0.01, -0.02])
        return [*params, *ms, *vs]

    check(fn, torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4), torch.rand(3, 4))


def test_adam_lerp_of_a_gradient_with_other_strides_compiles() -> None:
    """A depthwise convolution's weight [C, 1, k, k] and a gradient whose size-1 dim has another stride
    (HF ConvNeXt's, from the convolution's backward): torch's lerp decomposition gives the result the
    strides eager's has with `prims.copy_strided`, a copy of the values, which had no rule and ran eagerly."""
    def fn(m: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        ms = [m.clone()]
        torch._foreach_lerp_(ms, [g], 0.1)
        return ms

    g = torch.randn(8, 7, 7, 1).permute(0, 3, 1, 2)     # [8, 1, 7, 7], strides (49, 1, 7, 1)
    cluster = check(fn, torch.randn(8, 1, 7, 7), g)
    assert "prims.copy_strided.default" in cluster.ops, cluster.ops


def test_cnn_train_step_weight_norm() -> None:
    """Weight-normalised convolutions (wav2vec2's and HuBERT's positional embedding), over the weight's
    first dim and its last: the backward of `_weight_norm_interface` had no rule and ran eagerly."""
    model = nn.Sequential(
        nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 6, 3, padding=1)), nn.Flatten(),
        nn.utils.parametrizations.weight_norm(nn.Linear(6 * 5, 10), dim=1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _replayed_step(model, opt, torch.randn(2, 4, 5), torch.randint(0, 10, (2,)))


def test_upsample_and_pad_backward() -> None:
    """The backwards of nearest upsampling and replication padding (no torch decomposition: a scatter-add
    of the output gradient to the positions the forward reads) and of reflection padding."""
    def fn(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
        def loss(x, y):  # noqa: ANN001, ANN202
            return ((F.interpolate(x, size=7, mode="nearest") * w).sum()
                    + F.interpolate(y, scale_factor=2, mode="nearest").square().sum()
                    + (F.pad(x, (2, 3), mode="replicate") * w[..., :1]).exp().sum()
                    + F.pad(y, (1, 1, 2, 0), mode="replicate").sin().sum()
                    + F.pad(y, (1, 2, 2, 1), mode="reflect").square().sum())

        gx, gy = torch.func.grad(loss, argnums=(0, 1))(x, y)
        return [gx, gy, F.interpolate(y, size=(5, 3), mode="nearest"), F.pad(y, (1, 2, 0, 1), mode="replicate")]

    check(fn, torch.randn(2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(2, 3, 7))


def test_avg_pool_ceil_mode_and_3d() -> None:
    """avg_pool1d/2d/3d with ceil_mode (last windows past the padded input), count_include_pad off and
    divisor_override, forward and backward: torch's divisor per position."""
    def fn(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        def loss(x, y):  # noqa: ANN001, ANN202
            return (F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False).square().sum()
                    + F.avg_pool2d(x, 2, 3, 0, ceil_mode=True).exp().sum()
                    + F.avg_pool3d(y, 2, 1, 1, ceil_mode=True, divisor_override=3).square().sum()
                    + F.avg_pool3d(y, 3, 2, 1, count_include_pad=False).sum()
                    + F.avg_pool1d(x[0], 3, 2, 1, ceil_mode=True).square().sum())

        gx, gy = torch.func.grad(loss, argnums=(0, 1))(x, y)
        return [gx, gy, F.avg_pool3d(y, 3, 2, 1, ceil_mode=True, count_include_pad=True),
                F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=True)]

    check(fn, torch.randn(2, 3, 7, 6), torch.randn(1, 2, 5, 4, 6))
    # windows that leave the last input rows unread (IREE rejected such a reduce_window: rows cut first)
    check(lambda z: [F.avg_pool3d(z, 2), torch.func.grad(lambda z: F.avg_pool3d(z, 2).square().sum())(z)],
          torch.randn(2, 3, 3, 4, 5))


def test_avg_pool_with_a_kernel_longer_than_its_input() -> None:
    """HF EfficientNet pools its last 7x7 map with `AvgPool2d(1280, ceil_mode=True)`: the backward was
    emitted as one pad per window offset, 1.6 million of them (a tiny model's step compiled for over ten
    minutes). Offsets past the input reach none of it, and the forward's window need not reach past it."""
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        def loss(x):  # noqa: ANN001, ANN202
            return F.avg_pool2d(x, 24, ceil_mode=True).square().sum() + \
                F.avg_pool2d(x, (3, 24), (2, 24), (1, 0), ceil_mode=True).exp().sum()
        return [F.avg_pool2d(x, 24, ceil_mode=True), torch.func.grad(loss)(x)]

    cluster = check(fn, torch.randn(2, 3, 3, 2))
    assert cluster.text.count("stablehlo.pad") <= 3 * 4 + 4 * 3, cluster.text.count("stablehlo.pad")


def test_max_pool3d_forward_and_backward() -> None:
    """max_pool3d through torch's decomposition; its backward a scatter-add at the flat indices."""
    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        def loss(x):  # noqa: ANN001, ANN202
            return F.max_pool3d(x, 2).square().sum() + F.max_pool3d(x, 3, 2, 1, ceil_mode=True).exp().sum()

        out, idx = F.max_pool3d(x, 3, 2, 1, return_indices=True)
        return [out, idx, torch.func.grad(loss)(x), F.max_pool3d(x, 2, 1, 1, dilation=2)]

    check(fn, torch.randn(2, 3, 5, 6, 4))


def test_adaptive_avg_pool_backward_and_3d() -> None:
    """Adaptive average pooling's backwards (and the 3d forward): per dim, a matmul with the windows'
    averaging weights, uneven windows included."""
    def fn(x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        def loss(x, y):  # noqa: ANN001, ANN202
            return (F.adaptive_avg_pool2d(x, (3, 2)).square().sum() + F.adaptive_avg_pool1d(x[0], 4).exp().sum()
                    + F.adaptive_avg_pool3d(y, (2, 3, 3)).square().sum())

        return list(torch.func.grad(loss, argnums=(0, 1))(x, y)) + [F.adaptive_avg_pool3d(y, 1),
                                                                    F.adaptive_avg_pool3d(y, (3, 2, 4))]

    check(fn, torch.randn(2, 3, 7, 5), torch.randn(2, 3, 5, 7, 4), atol=1e-5, rtol=1e-5)


def test_linear_upsampling_backward() -> None:
    """Backwards of linear/bilinear/trilinear upsampling (no torch decomposition): per dim, a matmul with
    the interpolation weights, taken from the forward run on the identity."""
    def fn(x: torch.Tensor, y: torch.Tensor, z: torch.Tensor) -> list[torch.Tensor]:
        def loss(x, y, z):  # noqa: ANN001, ANN202
            return (F.interpolate(x, size=(7, 3), mode="bilinear").square().sum()
                    + F.interpolate(x, scale_factor=1.7, mode="bilinear", align_corners=True).exp().sum()
                    + F.interpolate(y, size=9, mode="linear").square().sum()
                    + F.interpolate(z, scale_factor=(2, 1.5, 0.6), mode="trilinear").square().sum())

        return list(torch.func.grad(loss, argnums=(0, 1, 2))(x, y, z))

    check(fn, torch.randn(2, 3, 4, 5), torch.randn(2, 3, 6), torch.randn(1, 2, 3, 4, 5), atol=1e-5, rtol=1e-5)
