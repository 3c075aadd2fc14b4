r"""Low-precision arithmetic that is the same on every CPU: each operation correctly rounded to its dtype.

torch computes ``exp``, ``log``, ``expm1`` and their kind with the kernels the CPU picks (SLEEF's vectorised AVX2
or AVX-512 code, or the C library's scalar functions, which themselves dispatch on the CPU): each within about an
ulp of the true value, but not alike, so the float32 or bfloat16 result of a KL term differs in its last bit from
one machine to another, and a count such as "the gradient is exactly 0 at 94 of the points" with it.
:func:`correctly_rounded` evaluates every aten operation whose floating inputs are float32, bfloat16 or float16
in float64 instead and rounds each result to the dtype the operation would have returned. That is IEEE
arithmetic's rule for + − × ÷ and √ (already exact-rounded in every kernel), extended to the transcendental
functions: the result a correctly rounded libm would give, up to double rounding, which changes a result only when
the float64 value lies within half a float64 ulp (a relative 2^-53) of a midpoint between two numbers of the
dtype: for a float32 result a chance of about 2^-29 per operation, for bfloat16 2^-45. What is computed is the
term's formula, operation by operation, in ideal arithmetic of its dtype; a machine's own kernels are within an
ulp of it per operation (``klgrad audit --dtype D`` without this mode reports those).

Operations that move or view data (copies, casts, views) run as they are: a cast is IEEE-rounded everywhere, and
an in-place operation keeps its own kernel (none of the audited KL terms computes a transcendental in place).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

LOW: frozenset[torch.dtype] = frozenset({torch.float32, torch.bfloat16, torch.float16})
"""The dtypes whose operations are evaluated in float64 and rounded back."""


def _low(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype in LOW


class _CorrectlyRounded(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        if func._schema.is_mutable or not any(_low(x) for x in flat) or torch.Tag.view_copy in func.tags:
            return func(*args, **kwargs)
        native = func(*args, **kwargs)  # only for the dtypes (and shapes) the operation returns
        out_flat, _ = tree_flatten(native)
        if not any(_low(x) for x in out_flat) or func in _PASSTHROUGH:
            return native
        up = tree_map(lambda x: x.double() if _low(x) else x, (args, kwargs))
        wide = func(*up[0], **up[1])
        return _round_like(wide, native)


def _round_like(wide, native):
    if isinstance(native, torch.Tensor):
        return wide.to(native.dtype) if native.dtype in LOW else native
    if isinstance(native, (tuple, list)):
        return type(native)(_round_like(w, n) for w, n in zip(wide, native, strict=True))
    return native


_PASSTHROUGH = {
    torch.ops.aten._to_copy.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.expand.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.select.int,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.lift_fresh.default,
    torch.ops.aten.zeros_like.default,
    torch.ops.aten.ones_like.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.full_like.default,
}
"""Data movement and constructors: their result does not depend on a kernel's arithmetic."""


@contextmanager
def correctly_rounded() -> Iterator[None]:
    """Within the block, every low-precision aten operation is computed in float64 and rounded to its dtype."""
    with _CorrectlyRounded():
        yield
