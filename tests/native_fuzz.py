"""A property test of aqr's C kernels against the torch backend on extreme finite (and non-finite)
inputs; run by tests/test_native_fuzz.py with the normal build and, in a subprocess, with a build
under AddressSanitizer and UBSan (``python native_fuzz.py --sanitized``).

Every layer output and source is small enough that every position is sampled and the C kernels sort
the sample whole, so both backends see the same target knots: their maps then agree to float32
rounding, and p0 / p100 and the finite flag exactly. Each case also runs laid out channels-last
(strided rows: the channels the fastest axis), which must give the contiguous layout's bits.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from aqr.backends import LayerSource, NativeBackend, SubsetCache, Targets, TorchBackend
from aqr.core.qmap import TAILS

FLT_MAX = float(np.finfo(np.float32).max)
TINY = float(np.finfo(np.float32).smallest_subnormal)
SPECIAL = [FLT_MAX, -FLT_MAX, 1e38, -1e38, 2e38, -2e38, TINY, -TINY, 3 * TINY, float(np.finfo(np.float32).tiny),
           0.0, -0.0, 1.0, -1.0, 1e-30, 65504.0]
LAYOUTS = [(1, 1, 1), (7, 1, 1), (9, 3, 1), (5, 2, 3), (3, 4, 5), (2, 2, 16), (1, 3, 40), (4, 1, 23), (2, 2, 53),
           (2, 9, 5), (3, 17, 3), (1, 8, 24), (2, 33, 3)]  # the last: channels-last rows of 8+ channels
# (transposed 8 x 8) and of 32+ (mapped in tiles)


def finite_floats(special_weight: int = 1) -> st.SearchStrategy[float]:
    """float32 values: anything finite (subnormals, +-0, +-FLT_MAX included) or one of ``SPECIAL``."""
    return st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False),
                     *[st.sampled_from(SPECIAL)] * special_weight)


@st.composite
def layer_outputs(draw: st.DrawFn, nonfinite: bool = False) -> np.ndarray:
    """An ``(A, C, B)`` float32 layer output; some channels constant, tied, or spanning +-FLT_MAX."""
    a, c, b = draw(st.sampled_from(LAYOUTS))
    x = draw(arrays(np.float32, (a, c, b), elements=finite_floats(3)))
    for ch in range(c):
        shape = draw(st.sampled_from(["as drawn", "constant", "tied", "huge range", "tiny range", "normal"]))
        if shape == "constant":
            x[:, ch] = x[0, ch, 0]
        elif shape == "tied":  # 30 % of the channel at one value
            flat = x[:, ch].reshape(-1)
            flat[: max(1, flat.size * 3 // 10)] = draw(finite_floats())
            x[:, ch] = flat.reshape(a, b)
        elif shape == "huge range" and a * b >= 2:
            x[0, ch, 0], x[-1, ch, -1] = FLT_MAX, -FLT_MAX
        elif shape == "tiny range":
            x[:, ch] = np.float32(draw(st.sampled_from([0.0, 1.0, 1e30]))) + TINY * np.arange(a * b).reshape(a, b)
        elif shape == "normal":
            x[:, ch] = np.random.default_rng(draw(st.integers(0, 2**16))).normal(size=(a, b)).astype(np.float32)
    if nonfinite:
        x.reshape(-1)[draw(st.integers(0, x.size - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return x


@st.composite
def sources(draw: st.DrawFn, channels: int) -> LayerSource:
    """A layer's source side: sorted finite knots, a tail strategy and its moments, a table size."""
    k = draw(st.sampled_from([3, 4, 11, 21]))
    moderate = st.floats(-1e4, 1e4, width=32)
    knots = draw(arrays(np.float32, (channels, k), elements=st.one_of(moderate, finite_floats())))
    knots.sort(axis=1)
    loc = draw(arrays(np.float32, (channels,), elements=moderate))
    scale = np.abs(draw(arrays(np.float32, (channels,), elements=st.one_of(moderate, finite_floats()))))
    tail = draw(st.sampled_from(TAILS))
    gaussian_p = draw(st.sampled_from([1e-3, 0.01, 0.2]))
    cells = draw(st.sampled_from([1, 2, 7, 64]))
    return LayerSource.create(torch.from_numpy(knots), tail, torch.from_numpy(loc), torch.from_numpy(scale),
                              gaussian_p, cells)


@st.composite
def cases(draw: st.DrawFn) -> tuple[torch.Tensor, LayerSource, tuple[torch.Tensor, torch.Tensor] | None]:
    x = torch.from_numpy(draw(layer_outputs(nonfinite=draw(st.integers(0, 9)) == 0)))
    c = x.shape[1]
    source = draw(sources(c))
    pre = None
    if draw(st.booleans()):  # a folded BatchNorm: the map reads scale * x + shift
        values = st.one_of(st.floats(-10, 10, width=32), finite_floats())
        pre = tuple(torch.from_numpy(draw(arrays(np.float32, (c,), elements=values))) for _ in range(2))
    return x, source, pre


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Equal up to float32 rounding, NaN where NaN, +-inf where +-inf."""
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True, msg=lambda m: f"{what}: {m}")


def check_channels_last(lib: ctypes.CDLL, x: torch.Tensor, source: LayerSource,
                        pre: tuple[torch.Tensor, torch.Tensor] | None, every: SubsetCache) -> None:
    """The native backend maps ``x`` (A, C, B) laid out channels-last (as ``(A, C, B, 1)`` in
    ``torch.channels_last``: every channel's values ``C`` apart, the kernels' strided rows) to the same bits,
    and the same finite flag, as the contiguous layout, and keeps the layout."""
    native = NativeBackend(source, every, lib, TorchBackend(source, every, compile=False))
    x4 = x.unsqueeze(-1)
    strided = x4.contiguous(memory_format=torch.channels_last)
    y_want, finite_want = native.recalibrate_output(x4, 1, pre)
    y_got, finite_got = native.recalibrate_output(strided, 1, pre)
    assert bool(finite_got) == bool(finite_want), "channels-last: finite flags differ"
    if bool(finite_want):
        assert y_got.is_contiguous(memory_format=torch.channels_last), "channels-last: output not channels-last"
        assert torch.equal(y_got.contiguous().view(torch.int32), y_want.contiguous().view(torch.int32)), \
            "channels-last: another map than the contiguous layout's"


def check_against_torch(lib: ctypes.CDLL, x: torch.Tensor, source: LayerSource,
                        pre: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """The native backend equals the torch backend on ``x``: both one-pass and two-step paths; and on ``x``
    laid out channels-last, the contiguous layout's bits (:func:`check_channels_last`)."""
    every = SubsetCache(x.shape[0] * x.shape[2])  # every position sampled, below 512: sorted whole
    check_channels_last(lib, x, source, pre, every)
    reference = TorchBackend(source, every, compile=False)
    native = NativeBackend(source, every, lib, reference)
    y_ref, finite_ref = reference.recalibrate(x, pre)
    y_nat, finite_nat = native.recalibrate(x, pre)
    assert bool(finite_nat) == bool(finite_ref), "finite flags differ"
    t_ref, t_nat = reference.target_knots(x, pre), native.target_knots(x, pre)
    assert bool(t_nat.finite) == bool(t_ref.finite), "finite flags of the knots differ"
    if not bool(finite_ref):
        assert y_nat is x or torch.equal(y_nat, x)
        # the map itself still takes non-finite values, with knots from the finite ones
        clean = torch.where(torch.isfinite(x), x, torch.zeros_like(x))
        targets = reference.target_knots(clean, pre)
        if bool(targets.finite):
            _close(native.apply(x, targets, pre), reference.apply(x, targets, pre), "map of non-finite values")
        return
    _close(t_nat.knots, t_ref.knots, "target knots")
    assert torch.equal(t_nat.knots[:, [0, -1]], t_ref.knots[:, [0, -1]]), "p0/p100 differ"
    if t_ref.mean is not None:
        # float64 sums in another order: each may lose n ulps (float64) of the largest value
        values = x if pre is None else x * pre[0].view(1, -1, 1) + pre[1].view(1, -1, 1)
        bound = 8 * values[:, 0].numel() * 2.0**-53 * values.abs().amax(dim=(0, 2)).double()[:, None]
        for name, got, want in (("mean", t_nat.mean, t_ref.mean), ("std", t_nat.std, t_ref.std)):
            assert bool(((got.double() - want.double()).abs() <= bound + 1e-6 * want.double().abs()).all()), name
    targets = Targets(t_ref.knots, t_ref.mean, t_ref.std, t_ref.finite)
    _close(native.apply(x, targets, pre), reference.apply(x, targets, pre), "map")
    # the one-pass kernel: the map of its own knots and moments (which differ as above)
    _close(y_nat, reference.apply(x, t_nat, pre), "recalibrated output")
    if t_ref.mean is None:
        _close(y_nat, y_ref, "recalibrated output against the torch backend's")


def has_wide_lookup(lib: ctypes.CDLL) -> bool:
    """Whether ``lib`` can map with AVX-512's gathers on this CPU (leaving its choice as it was)."""
    chosen = lib.aqr_set_lookup(-1)
    try:
        return bool(lib.aqr_set_lookup(1))
    finally:
        lib.aqr_set_lookup(chosen)


@contextlib.contextmanager
def lookup(lib: ctypes.CDLL, wide: bool) -> Iterator[None]:
    """``lib``'s maps with AVX-512's gathers (``wide``) or the AVX2 loads inside the block, then its own
    choice again; the caller checks :func:`has_wide_lookup` first."""
    chosen = lib.aqr_set_lookup(-1)
    assert lib.aqr_set_lookup(int(wide)) == int(wide), "the lookup asked for is not available"
    try:
        yield
    finally:
        lib.aqr_set_lookup(chosen)


def fuzz(lib: ctypes.CDLL, examples: int, seed: int | None = None) -> None:
    """Run :func:`check_against_torch` on ``examples`` generated cases (raises on the first failure)."""

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck))
    @given(cases())
    def run(case: tuple) -> None:
        check_against_torch(lib, *case)

    run()


if __name__ == "__main__":  # the sanitizer run: python native_fuzz.py EXAMPLES FLAG...
    from aqr.backends import build

    examples, flags = int(sys.argv[1]), sys.argv[2:]
    for simd in (False, True):  # ASan does not see AVX2 gathers: the scalar build checks every index
        lib = build.load(build.compile_command(flags, simd=simd), name="aqr_kernels_sanitized")
        for wide in (False, True) if has_wide_lookup(lib) else (False,):
            with lookup(lib, wide):
                fuzz(lib, examples, seed=0)
    print("sanitized fuzz passed")
