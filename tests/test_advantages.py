"""Tests for klgrad.advantages: hand-worked values, a plain-Python reference, properties, errors.

Tolerances: these checks run in float64 (u = 2^-53 ≈ 1.1e-16) on closed forms and enumerations of at most a few
thousand terms of magnitude O(1), so two correct evaluations agree to γ_n·Σ|x| ≲ 1e-12 (n ≤ 10^4: γ_n ≈ 1.1e-12,
relative to the magnitudes involved); the 1e-12 / 1e-13 / 1e-15 bounds below are that. Float32 checks carry
their own derivation beside them.
"""

from __future__ import annotations

import math
import random
import statistics
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from klgrad.advantages import ShapingStats, shape_rewards
from klgrad.choices import SHAPING_METHODS, SHAPING_PRESETS
from tests.helpers.tolerances import gamma

pytestmark = pytest.mark.numerics

F64 = torch.float64
GROUP_METHODS = ("group_baseline", "group_norm", "rloo", "grpo", "dr_grpo", "reinforce_pp_baseline")
BATCH_NORM_METHODS = ("batch_norm", "reinforce", "reinforce_pp", "reinforce_pp_baseline")
# Methods whose advantage of a constant group is its own centred value, hence exactly 0.
OWN_GROUP_METHODS = ("group_baseline", "group_norm", "rloo", "grpo", "dr_grpo")


def t64(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=F64)


def valid_methods(G: int, B: int) -> list[str]:
    return [
        m for m in SHAPING_METHODS if not (G == 1 and m in GROUP_METHODS) and not (B == 1 and m in BATCH_NORM_METHODS)
    ]


# --------------------------------------------------------------------------------------------------
# 1. Hand-worked values. r = [1, 2, 6 | 0, 0, 3], G = 3.
#   group 0: mean 3, centred [-2, -1, 3], var (4 + 1 + 9) / 2 = 7, std sqrt(7)
#   group 1: mean 1, centred [-1, -1, 2], var (1 + 1 + 4) / 2 = 3, std sqrt(3)
#   batch:   mean 12 / 6 = 2, centred [-1, 0, 4, -2, -2, 1], var (1+0+16+4+4+1) / 5 = 5.2
#   rloo:    3/2 * group-centred, e.g. r0: 1 - (2 + 6) / 2 = -3, r5: 3 - (0 + 0) / 2 = 3
#   reinforce_pp_baseline: group-centred [-2, -1, 3, -1, -1, 2] has mean 0 and
#            var (4+1+9+1+1+4) / 5 = 4, std 2 -> [-1, -0.5, 1.5, -0.5, -0.5, 1]
# --------------------------------------------------------------------------------------------------
R = [1.0, 2.0, 6.0, 0.0, 0.0, 3.0]
S7, S3, S52 = math.sqrt(7), math.sqrt(3), math.sqrt(5.2)
HAND = {
    "none": R,
    "group_baseline": [-2, -1, 3, -1, -1, 2],
    "batch_baseline": [-1, 0, 4, -2, -2, 1],
    "batch_norm": [v / S52 for v in (-1, 0, 4, -2, -2, 1)],
    "group_norm": [-2 / S7, -1 / S7, 3 / S7, -1 / S3, -1 / S3, 2 / S3],
    "rloo": [-3, -1.5, 4.5, -1.5, -1.5, 3],
    "reinforce_pp_baseline": [-1, -0.5, 1.5, -0.5, -0.5, 1],
}
HAND["reinforce"] = HAND["reinforce_pp"] = HAND["batch_norm"]
HAND["grpo"] = HAND["group_norm"]
HAND["dr_grpo"] = HAND["group_baseline"]


def test_method_names_and_presets() -> None:
    assert set(HAND) == set(SHAPING_METHODS)
    assert len(SHAPING_METHODS) == 11
    assert SHAPING_PRESETS["reinforce_pp_baseline"] == ("group_baseline", "batch_norm")
    assert set(SHAPING_PRESETS) == {"reinforce", "reinforce_pp", "grpo", "dr_grpo", "reinforce_pp_baseline"}


@pytest.mark.parametrize("method", SHAPING_METHODS)
def test_hand_worked_values(method: str) -> None:
    adv, stats = shape_rewards(t64(R), 3, method, return_stats=True)
    assert adv.shape == (6,)
    assert adv.dtype == F64
    torch.testing.assert_close(adv, t64(HAND[method]), rtol=0, atol=1e-12)
    assert stats == ShapingStats(zero_std_groups=0, num_groups=2, std_clipped=0)


def test_hand_worked_clipping() -> None:
    # std_min = 2: group 0 std sqrt(7) ~ 2.65 kept, group 1 std sqrt(3) ~ 1.73 raised to 2.
    adv, stats = shape_rewards(t64(R), 3, "group_norm", std_min=2.0, return_stats=True)
    torch.testing.assert_close(adv, t64([-2 / S7, -1 / S7, 3 / S7, -0.5, -0.5, 1.0]), rtol=0, atol=1e-12)
    assert stats.std_clipped == 1
    # std_max = 2: group 0 lowered to 2, group 1 kept.
    adv, stats = shape_rewards(t64(R), 3, "grpo", std_max=2.0, return_stats=True)
    torch.testing.assert_close(adv, t64([-1.0, -0.5, 1.5, -1 / S3, -1 / S3, 2 / S3]), rtol=0, atol=1e-12)
    assert stats.std_clipped == 1
    # batch std sqrt(5.2) ~ 2.28 raised to 4: batch-centred / 4.
    adv = shape_rewards(t64(R), 3, "reinforce", std_min=4.0)
    torch.testing.assert_close(adv, t64([-0.25, 0, 1, -0.5, -0.5, 0.25]), rtol=0, atol=1e-12)


def test_constant_groups_hand_worked() -> None:
    # Group 0 = [0.1]*3: its float mean is not exactly 0.1, yet advantages must be exactly 0.
    r = t64([0.1, 0.1, 0.1, 1.0, 0.0, 0.0])
    for method in OWN_GROUP_METHODS:
        for std_min in (None, 0.5):
            adv, stats = shape_rewards(r, 3, method, std_min=std_min, return_stats=True)
            assert torch.equal(adv[:3], torch.zeros(3, dtype=F64)), method
            assert adv[3:].abs().max() > 0
            assert stats.zero_std_groups == 1
            assert stats.num_groups == 2
            # The degenerate group's std 0 is not counted as clipped; [1, 0, 0] has std 0.577 > 0.5.
            assert stats.std_clipped == 0
    # A constant batch under batch_norm is exactly 0 as well.
    for method in ("batch_norm", "reinforce_pp", "batch_baseline", "reinforce_pp_baseline"):
        adv, stats = shape_rewards(t64([0.1] * 6), 2, method, std_min=0.3, return_stats=True)
        assert torch.equal(adv, torch.zeros(6, dtype=F64)), method
        assert stats == ShapingStats(zero_std_groups=3, num_groups=3, std_clipped=0)


# --------------------------------------------------------------------------------------------------
# 2. Paper example: near-constant but not equal groups are not degenerate.
# --------------------------------------------------------------------------------------------------
PAPER = [0.99999, 1.00001, 0.99999, 1.00001]


def test_paper_example_unclipped() -> None:
    adv, stats = shape_rewards(t64(PAPER), 4, "group_norm", return_stats=True)
    # centred = [-d, d, -d, d] with d ~ 1e-5, std = sqrt(4 d^2 / 3) = 2 d / sqrt(3) -> +-sqrt(3)/2.
    h = math.sqrt(3) / 2
    torch.testing.assert_close(adv, t64([-h, h, -h, h]), rtol=0, atol=1e-6)
    assert stats.zero_std_groups == 0


def test_paper_example_std_min() -> None:
    adv, stats = shape_rewards(t64(PAPER), 4, "grpo", std_min=0.1, return_stats=True)
    # std ~ 1.15e-5 < 0.1, so the std is 0.1: a_i = (r_i - mean) / 0.1, computed exactly with Fractions.
    exact = [Fraction(x) for x in PAPER]
    mean = sum(exact) / 4
    expected = [float((x - mean) / Fraction(0.1)) for x in exact]
    torch.testing.assert_close(adv, t64(expected), rtol=1e-9, atol=0)
    torch.testing.assert_close(adv, t64([-1e-4, 1e-4, -1e-4, 1e-4]), rtol=1e-6, atol=0)
    assert stats.std_clipped == 1


# --------------------------------------------------------------------------------------------------
# 3. Plain-Python reference (lists, statistics.stdev, leave-one-out written out).
# --------------------------------------------------------------------------------------------------
REF_CHAINS = {
    "none": (),
    "group_baseline": ("gb",),
    "dr_grpo": ("gb",),
    "batch_baseline": ("bb",),
    "batch_norm": ("bn",),
    "reinforce": ("bn",),
    "reinforce_pp": ("bn",),
    "group_norm": ("gn",),
    "grpo": ("gn",),
    "rloo": ("rloo",),
    "reinforce_pp_baseline": ("gb", "bn"),
}


def ref_shape(
    rewards: list[float], G: int, method: str, std_min: float | None, std_max: float | None
) -> tuple[list[float], int, int]:
    """Return (advantages, zero_std_groups, std_clipped) with Python loops."""

    def chunks(xs: list[float], n: int) -> list[list[float]]:
        return [xs[i : i + n] for i in range(0, len(xs), n)]

    def centre(xs: list[float]) -> list[float]:
        if max(xs) == min(xs):
            return [0.0] * len(xs)
        m = statistics.fmean(xs)
        return [x - m for x in xs]

    clipped = 0

    def norm(xs: list[float]) -> list[float]:
        nonlocal clipped
        if max(xs) == min(xs):
            return [0.0] * len(xs)
        sd = statistics.stdev(xs)
        c = sd
        if std_max is not None:
            c = min(c, std_max)
        if std_min is not None:
            c = max(c, std_min)
        clipped += c != sd
        m = statistics.fmean(xs)
        return [(x - m) / c for x in xs]

    def loo(xs: list[float]) -> list[float]:
        return [x - (sum(xs) - x) / (len(xs) - 1) for x in xs]

    zero = sum(max(g) == min(g) for g in chunks(rewards, G))
    x = list(rewards)
    for op in REF_CHAINS[method]:
        if op == "gb":
            x = [v for g in chunks(x, G) for v in centre(g)]
        elif op == "bb":
            x = centre(x)
        elif op == "gn":
            x = [v for g in chunks(x, G) for v in norm(g)]
        elif op == "bn":
            x = norm(x)
        elif op == "rloo":
            x = [v for g in chunks(x, G) for v in loo(g)]
    return x, zero, clipped


def random_case(rng: random.Random) -> tuple[list[float], int]:
    G, n = rng.randint(1, 6), rng.randint(1, 6)
    kind = rng.choice(["binary", "dyadic", "normal", "mixed"])
    groups = []
    for _ in range(n):
        if kind == "binary":
            groups.append([float(rng.random() < 0.5) for _ in range(G)])
        elif kind == "dyadic":
            groups.append([rng.randint(-8, 8) / 4 for _ in range(G)])
        elif kind == "normal":
            groups.append([rng.gauss(0.5, 2.0) for _ in range(G)])
        else:
            groups.append([rng.uniform(-3, 3)] * G if rng.random() < 0.3 else [rng.gauss(0, 1) for _ in range(G)])
    return [v for g in groups for v in g], G


@pytest.mark.parametrize("method", SHAPING_METHODS)
def test_matches_python_reference(method: str) -> None:
    rng = random.Random(SHAPING_METHODS.index(method))
    checked = 0
    for _ in range(80):
        rewards, G = random_case(rng)
        if method not in valid_methods(G, len(rewards)):
            continue
        std_min = rng.choice([None, None, 0.37, 1.3])
        std_max = rng.choice([None, None, 1.7, 2.9])
        adv, stats = shape_rewards(t64(rewards), G, method, std_min, std_max, return_stats=True)
        expected, zero, clipped = ref_shape(rewards, G, method, std_min, std_max)
        torch.testing.assert_close(adv, t64(expected), rtol=1e-9, atol=1e-12)
        assert stats == ShapingStats(zero, len(rewards) // G, clipped)
        checked += 1
    assert checked >= 30


# --------------------------------------------------------------------------------------------------
# 4. Hypothesis properties.
# --------------------------------------------------------------------------------------------------
DYADIC = st.integers(-4000, 4000).map(lambda k: k / 8)  # exact sums: order-independent means
WIDE = st.one_of(
    st.floats(-1e150, 1e150, allow_nan=False, allow_infinity=False),
    st.builds(lambda m, e: m * 10.0**e, st.floats(-10, 10), st.integers(-300, 149)),
)


@st.composite
def grouped(draw: st.DrawFn, elements: st.SearchStrategy[float] = DYADIC, min_g: int = 2) -> list[list[float]]:
    """A list of groups of equal size G >= min_g; about a quarter of them constant."""
    G = draw(st.integers(min_g, 6))
    groups = []
    for _ in range(draw(st.integers(1, 5))):
        if draw(st.integers(0, 3)) == 0:
            groups.append([draw(elements)] * G)
        else:
            groups.append(draw(st.lists(elements, min_size=G, max_size=G)))
    return groups


def flat(groups: list[list[float]]) -> torch.Tensor:
    return t64([v for g in groups for v in g])


@settings(deadline=None)
@given(groups=grouped(), data=st.data(), method=st.sampled_from(SHAPING_METHODS))
def test_permute_within_group(groups: list[list[float]], data: st.DataObject, method: str) -> None:
    G = len(groups[0])
    perms = [data.draw(st.permutations(range(G))) for _ in groups]
    index = torch.tensor([gi * G + p for gi, perm in enumerate(perms) for p in perm])
    r = flat(groups)
    adv = shape_rewards(r, G, method)
    torch.testing.assert_close(shape_rewards(r[index], G, method), adv[index], rtol=1e-10, atol=1e-12)


@settings(deadline=None)
@given(groups=grouped(), data=st.data(), method=st.sampled_from(SHAPING_METHODS))
def test_permute_groups(groups: list[list[float]], data: st.DataObject, method: str) -> None:
    G = len(groups[0])
    perm = data.draw(st.permutations(range(len(groups))))
    adv = shape_rewards(flat(groups), G, method).reshape(-1, G)
    adv_perm = shape_rewards(flat([groups[i] for i in perm]), G, method).reshape(-1, G)
    torch.testing.assert_close(adv_perm, adv[list(perm)], rtol=1e-10, atol=1e-12)


@settings(deadline=None)
@given(
    groups=grouped(),
    a=st.floats(0.1, 10),
    b=st.floats(-100, 100),
    method=st.sampled_from(["grpo", "group_norm", "batch_norm", "reinforce_pp"]),
)
def test_normalisation_affine_invariant(groups: list[list[float]], a: float, b: float, method: str) -> None:
    G = len(groups[0])
    r = flat(groups)
    adv, stats = shape_rewards(r, G, method, return_stats=True)
    adv2, stats2 = shape_rewards(a * r + b, G, method, return_stats=True)
    torch.testing.assert_close(adv2, adv, rtol=1e-9, atol=1e-9)
    assert stats2 == stats


@settings(deadline=None)
@given(
    groups=grouped(),
    exponent=st.integers(-300, 147),
    method=st.sampled_from(["grpo", "batch_norm", "reinforce_pp_baseline"]),
)
def test_normalisation_scale_invariant_at_extremes(groups: list[list[float]], exponent: int, method: str) -> None:
    # |r| ~ 1e-300: squared deviations underflow to 0; |r| ~ 1e150: still finite. Neither may matter.
    G = len(groups[0])
    r = flat(groups)
    torch.testing.assert_close(
        shape_rewards(r * 10.0**exponent, G, method), shape_rewards(r, G, method), rtol=1e-9, atol=1e-9
    )


@pytest.mark.parametrize("scale", [1e-300, 1e-200, 1e-160, 1e100, 1e150])
def test_extreme_scales_hand_worked(scale: float) -> None:
    adv = shape_rewards(t64(R) * scale, 3, "group_norm")
    torch.testing.assert_close(adv, t64(HAND["group_norm"]), rtol=0, atol=1e-12)
    adv = shape_rewards(t64(R) * scale, 3, "batch_norm")
    torch.testing.assert_close(adv, t64(HAND["batch_norm"]), rtol=0, atol=1e-12)


@settings(deadline=None)
@given(groups=grouped(st.floats(-1e6, 1e6)), method=st.sampled_from(["rloo", "group_baseline", "dr_grpo"]))
def test_group_sums_to_zero(groups: list[list[float]], method: str) -> None:
    G = len(groups[0])
    r = flat(groups)
    sums = shape_rewards(r, G, method).reshape(-1, G).sum(dim=1)
    scale = r.reshape(-1, G).abs().amax(dim=1) + 1.0
    assert (sums.abs() <= 1e-12 * G * scale).all(), sums


@settings(deadline=None, max_examples=300)
@given(
    groups=grouped(WIDE, min_g=1),
    method=st.sampled_from(SHAPING_METHODS),
    std_min=st.sampled_from([None, 1e-3, 1.0]),
    std_max=st.sampled_from([None, 1e-3, 1e3]),
)
def test_outputs_finite(groups: list[list[float]], method: str, std_min: float | None, std_max: float | None) -> None:
    G = len(groups[0])
    r = flat(groups)
    if method not in valid_methods(G, r.numel()) or (std_min and std_max and std_min > std_max):
        return
    adv = shape_rewards(r, G, method, std_min, std_max)
    assert torch.isfinite(adv).all(), (r, adv)


@settings(deadline=None)
@given(
    groups=grouped(st.one_of(DYADIC, WIDE)),
    method=st.sampled_from(SHAPING_METHODS),
    std_min=st.sampled_from([None, 0.5]),
)
def test_constant_groups_zero_and_counted(groups: list[list[float]], method: str, std_min: float | None) -> None:
    G = len(groups[0])
    adv, stats = shape_rewards(flat(groups), G, method, std_min, return_stats=True)
    const = [max(g) == min(g) for g in groups]
    assert stats.zero_std_groups == sum(const)
    assert stats.num_groups == len(groups)
    if method in OWN_GROUP_METHODS:
        for row, c in zip(adv.reshape(-1, G), const, strict=True):
            if c:
                assert torch.equal(row, torch.zeros(G, dtype=F64))
    # Every group constant: group-centred values are all exactly 0 (so also after batch_norm).
    if all(const) and method in (*OWN_GROUP_METHODS, "reinforce_pp_baseline"):
        assert torch.equal(adv, torch.zeros_like(adv))
    # The whole batch constant: batch statistics are degenerate too.
    if len({v for g in groups for v in g}) == 1 and method in ("batch_baseline", *BATCH_NORM_METHODS):
        assert torch.equal(adv, torch.zeros_like(adv))


# --------------------------------------------------------------------------------------------------
# 5. Validation.
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("rewards", "G", "method", "kwargs", "match"),
    [
        (torch.zeros(2, 3), 3, "grpo", {}, r"rewards must be 1-D"),
        (torch.zeros(0), 1, "none", {}, r"rewards must be non-empty"),
        (
            torch.tensor([1.0, float("nan"), float("inf"), 0.0]),
            2,
            "grpo",
            {},
            r"rewards contains 2 non-finite",
        ),
        (torch.zeros(4), 0, "grpo", {}, r"group_size must be >= 1, got 0"),
        (torch.zeros(5), 2, "grpo", {}, r"B=5 is not divisible by group_size G=2"),
        (torch.zeros(4), 1, "group_norm", {}, r"group_size=1"),
        (torch.zeros(4), 1, "grpo", {}, r"group_size=1"),
        (torch.zeros(4), 1, "rloo", {}, r"group_size=1"),
        (torch.zeros(4), 1, "group_baseline", {}, r"group_size=1 makes every group-baseline advantage 0"),
        (torch.zeros(4), 1, "dr_grpo", {}, r"group_size=1"),
        (torch.zeros(4), 1, "reinforce_pp_baseline", {}, r"group_size=1"),
        (torch.zeros(1), 1, "batch_norm", {}, r"B >= 2.*B=1"),
        (torch.zeros(1), 1, "reinforce_pp", {}, r"B >= 2"),
        (torch.zeros(4), 2, "ppo", {}, r"unknown method 'ppo'; allowed: none, group_baseline"),
        (torch.zeros(4), 2, "grpo", {"std_min": 0.0}, r"std_min must be > 0"),
        (torch.zeros(4), 2, "grpo", {"std_min": -1.0}, r"std_min must be > 0"),
        (torch.zeros(4), 2, "grpo", {"std_max": 0.0}, r"std_max must be > 0"),
        (torch.zeros(4), 2, "grpo", {"std_max": float("nan")}, r"std_max must be > 0"),
        (torch.zeros(4), 2, "grpo", {"std_min": 2.0, "std_max": 1.0}, r"std_min=2.0 must be <= std_max=1.0"),
    ],
)
def test_validation_errors(rewards: torch.Tensor, G: int, method: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        shape_rewards(rewards, G, method, **kwargs)


def test_group_size_type() -> None:
    with pytest.raises(TypeError, match="group_size must be an int"):
        shape_rewards(torch.zeros(4), 2.0, "grpo")  # type: ignore[arg-type]


def test_group_size_one_allowed_where_meaningful() -> None:
    r = t64([1.0, 2.0, 4.0])
    torch.testing.assert_close(shape_rewards(r, 1, "batch_baseline"), t64([-4 / 3, -1 / 3, 5 / 3]))
    torch.testing.assert_close(shape_rewards(r, 1, "none"), r)
    assert shape_rewards(r, 1, "reinforce", return_stats=True)[1].zero_std_groups == 3


# --------------------------------------------------------------------------------------------------
# 6. std_clipped counting, dtypes, purity.
# --------------------------------------------------------------------------------------------------
def test_std_clipped_counting() -> None:
    # stds: [0,1,0,1] -> 0.577 (raised to 1), [0,10,0,10] -> 5.77 (lowered to 2), [3]*4 -> degenerate.
    r = t64([0, 1, 0, 1, 0, 10, 0, 10, 3, 3, 3, 3])
    _, stats = shape_rewards(r, 4, "group_norm", std_min=1.0, std_max=2.0, return_stats=True)
    assert stats == ShapingStats(zero_std_groups=1, num_groups=3, std_clipped=2)
    _, stats = shape_rewards(r, 4, "group_norm", std_min=0.1, std_max=10.0, return_stats=True)
    assert stats.std_clipped == 0
    _, stats = shape_rewards(r, 4, "group_norm", std_min=1.0, return_stats=True)
    assert stats.std_clipped == 1
    # Batch std of r is ~3.9: one std value, lowered by std_max.
    _, stats = shape_rewards(r, 4, "batch_norm", std_max=2.0, return_stats=True)
    assert stats.std_clipped == 1
    # Methods without a normalising operator never clip.
    for method in ("none", "rloo", "group_baseline", "batch_baseline"):
        assert shape_rewards(r, 4, method, std_min=100.0, return_stats=True)[1].std_clipped == 0
    # Chains add up: group_baseline does not clip, batch_norm clips once.
    _, stats = shape_rewards(r, 4, "reinforce_pp_baseline", std_min=100.0, return_stats=True)
    assert stats.std_clipped == 1


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.float64, torch.float64),
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.int64, torch.float32),
    ],
)
def test_dtype(dtype: torch.dtype, expected: torch.dtype) -> None:
    adv = shape_rewards(t64(R).to(dtype), 3, "grpo")
    assert adv.dtype == expected
    # float32 shaping of 3 rewards (mean, std, divide: < 20 roundings of values <= ~2): <= γ_20·2 ≈ 2.4e-6;
    # the half-precision inputs here are small integers, exactly representable
    torch.testing.assert_close(adv.double(), t64(HAND["grpo"]), rtol=0, atol=2 * gamma(20) * 2)


@pytest.mark.parametrize("method", SHAPING_METHODS)
def test_pure_and_detached(method: str) -> None:
    r = t64(R).requires_grad_(True)
    before = r.detach().clone()
    adv = shape_rewards(r, 3, method)
    assert isinstance(adv, torch.Tensor)
    assert not adv.requires_grad
    assert adv.data_ptr() != r.data_ptr()
    adv.add_(1.0)
    assert torch.equal(r.detach(), before)
    assert r.grad is None
