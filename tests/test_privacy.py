"""Privacy accountant (sidejax/privacy.py): the regression numbers of CEPAM
(docs/papers/cepam.md#privacy-numbers, docs/papers/cepam.md#s5 Thm 12/13), a 50-digit mpmath oracle of
eq. (16), the noise table and δ_sat list of docs/papers/cepam.md#noise-table, properties (monotone in σ, σ/γ
only, ε ↔ ε̃ round trips, τ = 1 reduction, clip modes), the analytic Gaussian against numeric hockey-stick
integrals and Google's dp-accounting, the Laplace profile against a numeric integral, warnings, argument
errors and the CepamSetting's field checks."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import dp_accounting  # noqa: F401  (dev dependency; the cross-checks below need it)
import mpmath
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld
from dp_accounting.pld import privacy_loss_mechanism as plm
from scipy import stats

from sidejax import privacy as P
from sidejax.privacy import VacuousPrivacyWarning

# the paper's setting (docs/papers/cepam.md#s3, docs/papers/cepam.md#s4): MNIST, K = 30,
# n_k = floor(50000/30), τ = 15, γ = 1; the Laplace functions do not need K
PAPER = P.CepamSetting(tau=15, n_k=1666, gamma=1.0, num_clients=30)
LAPLACE = P.CepamSetting(tau=15, n_k=1666, gamma=1.0)
# the printed values of docs/papers/cepam.md#privacy-numbers carry ~16 digits but came from the naive
# 1 − (1 − 1/n)^τ (1.7e−14 off)
REL = 1e-9


def _ignore_vacuous():
    return warnings.catch_warnings(action="ignore", category=VacuousPrivacyWarning)


# ---------------------------------------------------------------------------------------------------------
# regression values of docs/papers/cepam.md#privacy-numbers


def test_spec_regression_values():
    p = P.subsample_probability(1666, 15)
    assert p == pytest.approx(0.008965869403499527, rel=REL)
    assert P.eps_from_eps_tilde(5.9, p) == pytest.approx(1.4501871413572687, rel=REL)
    expected = {
        0.1: 0.009688739711522966,
        1.0: 0.009018037444173881,
        2.0: 0.0016004182672823808,
        5.0: 3.6741903009089357e-06,
        10.0: 3.6689816725446643e-10,
    }
    for sigma, delta in expected.items():
        assert P.cepam_gaussian_delta(sigma, 5.9, PAPER) == pytest.approx(delta, rel=REL), sigma
    # Theorem 13: ε̃ = 5000 (naive exp overflows), ε̃_min = 2τγ/b = 300 for γ = 1, b = 0.1
    assert P.cepam_laplace_epsilon(0.1, 5000.0, LAPLACE) == pytest.approx(4995.285669800896, rel=REL)
    assert P.cepam_laplace_eps_tilde_min(0.1, LAPLACE) == pytest.approx(300.0, rel=1e-15)
    # n_k = 2000 (60k/30) gives the ε = 1.3139 and Laplace ε = 4995.1036 of
    # docs/papers/cepam.md#privacy-numbers
    p2000 = P.subsample_probability(2000, 15)
    assert round(P.eps_from_eps_tilde(5.9, p2000), 4) == 1.3139
    assert round(P.cepam_laplace_epsilon(0.1, 5000.0, replace(LAPLACE, n_k=2000)), 4) == 4995.1036


def _mp_delta16(sigma, eps_tilde, tau, k, gamma, n_k):
    """Eq. (16) written out literally in 50-digit arithmetic (independent of the module's log-space code)."""
    mp = mpmath.mp
    with mpmath.workdps(50):
        sigma, et, gamma = mp.mpf(sigma), mp.mpf(eps_tilde), mp.mpf(gamma)
        q = 1 / mp.mpf(n_k)
        total = mp.mpf(0)
        for j in range(1, tau + 1):
            w = mp.binomial(tau, j) * q**j * (1 - q) ** (tau - j)
            gf = (mp.exp(et) - 1) / (mp.exp(et / j) - 1)
            a = tau * gamma / (mp.sqrt(k) * sigma)
            b = mp.sqrt(k) * et * sigma / (2 * j * tau * gamma)
            term = mp.ncdf(a - b) - mp.exp(et / j) * mp.ncdf(-a - b)
            total += w * gf * max(term, 0)
        return total


@pytest.mark.parametrize(
    "sigma,eps_tilde,tau,k,gamma,n_k",
    [(0.1, 5.9, 15, 30, 1.0, 1666), (3.0, 5.9, 15, 30, 1.0, 1666), (10.0, 5.9, 15, 30, 1.0, 1666),
     (0.7, 0.3, 4, 10, 0.5, 50), (2.5, 40.0, 15, 30, 2.0, 1666), (30.0, 12.0, 15, 30, 1.0, 1666)],
)  # fmt: skip
def test_cepam_delta_matches_mpmath_oracle(sigma, eps_tilde, tau, k, gamma, n_k):
    setting = P.CepamSetting(tau=tau, n_k=n_k, gamma=gamma, num_clients=k)
    got = P.cepam_gaussian_delta(sigma, eps_tilde, setting)
    want = _mp_delta16(sigma, eps_tilde, tau, k, gamma, n_k)
    assert want > 0
    assert got == pytest.approx(float(want), rel=1e-12)


def test_p_and_eps_match_mpmath():
    with mpmath.workdps(50):
        for n_k, tau in [(1666, 15), (2, 1), (10**9, 3), (50, 200)]:
            p_mp = 1 - (1 - mpmath.mpf(1) / n_k) ** tau
            p = P.subsample_probability(n_k, tau)
            assert p == pytest.approx(float(p_mp), rel=1e-14)
            for et in [1e-9, 0.5, 5.9, 80.0, 5000.0]:
                e_mp = mpmath.log(1 + p_mp * (mpmath.exp(et) - 1))
                assert P.eps_from_eps_tilde(et, p) == pytest.approx(float(e_mp), rel=1e-13)


def test_delta_sat_list_of_spec():
    p = P.subsample_probability(1666, 15)
    eps = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 9.9])
    sat = P.cepam_gaussian_delta_sat(P.eps_tilde_from_eps(eps, p), tau=15, n_k=1666)
    spec = [0.00949, 0.00998, 0.01072, 0.01190, 0.01385, 0.01705, 0.02233, 0.03108, 0.04558, 0.06662]
    np.testing.assert_array_equal(np.round(sat, 5), spec)
    # δ_sat is (16) as σ → 0, and >= p (gf >= 1, Σ_j w_j = p)
    et = P.eps_tilde_from_eps(eps, p)
    tiny = P.cepam_gaussian_delta(1e-6, et, PAPER)
    np.testing.assert_allclose(tiny, sat, rtol=1e-13)
    assert np.all(sat >= p)
    # the paper's δ = 9.69e−3 at σ = 0.1 is exactly δ_sat: the noise does not enter
    assert P.cepam_gaussian_delta(0.1, 5.9, PAPER) == pytest.approx(
        P.cepam_gaussian_delta_sat(5.9, tau=15, n_k=1666), rel=1e-14
    )


# docs/papers/cepam.md#noise-table: σ required by (16) for (ε, δ) with γ = 1, K = 30, τ = 15, n_k = 1666
# ("0": vacuous)
NOISE_TABLE = {
    1: (0, 0, 2.31, 4.64),
    2: (0, 0, 2.09, 4.28),
    3: (0.93, 0, 2.01, 4.05),
    5: (1.10, 0, 2.09, 3.73),
    7: (1.34, 1.13, 2.23, 3.52),
    9.9: (1.72, 1.59, 2.31, 3.40),
}


@pytest.mark.parametrize("eps", list(NOISE_TABLE))
def test_noise_table(eps):
    p = P.subsample_probability(1666, 15)
    for delta, want in zip((0.01, 0.015, 1e-3, 1e-5), NOISE_TABLE[eps], strict=True):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            sigma = P.gaussian_sigma_for(eps, delta, PAPER)
        msgs = [str(w.message) for w in rec if issubclass(w.category, VacuousPrivacyWarning)]
        assert round(sigma, 2) == want, (eps, delta, sigma)
        if want == 0:
            assert sigma == 0.0 and any("zero noise already meets" in m for m in msgs)
        else:
            got = P.cepam_gaussian_delta(sigma, P.eps_tilde_from_eps(eps, p), PAPER)
            assert got == pytest.approx(delta, rel=1e-10)
        # δ >= p = 8.97e−3 (0.01, 0.015) or δ >= 1/n_k = 6.0e−4 (1e−3) are flagged; 1e−5 is not
        assert any(">= p=" in m for m in msgs) == (delta >= p)
        assert any(">= 1/n_k=" in m for m in msgs) == (1 / 1666 <= delta < p)
        assert bool(msgs) == (delta >= 1 / 1666)


# ---------------------------------------------------------------------------------------------------------
# properties of (14)/(16)


def test_delta_decreasing_in_sigma_and_limits():
    sigmas = np.geomspace(1e-3, 1e3, 400)
    for et in (0.5, 5.9, 40.0):
        d = np.array([P.cepam_gaussian_delta(s, et, PAPER) for s in sigmas])
        assert np.all(np.diff(d) <= 0)
        inner = d[(d > 1e-300) & (d < d[0] * (1 - 1e-9))]  # off the δ_sat plateau and the underflow
        assert inner.size > 100 and np.all(np.diff(inner) < 0)
        assert d[0] == pytest.approx(P.cepam_gaussian_delta_sat(et, tau=15, n_k=1666), rel=1e-12)
        assert d[-1] < 1e-40  # the infimum over σ is 0; e^{−O(σ²)} underflows to exactly 0 further out
        assert P.cepam_gaussian_delta(1e4, et, PAPER) == 0.0


def test_depends_on_sigma_over_gamma_only():
    for c in (0.01, 0.3, 7.0, 250.0):
        kw = replace(PAPER, gamma=c)
        for sigma in (0.05, 1.0, 3.3):
            for et in (0.7, 5.9, 25.0):
                a = P.cepam_gaussian_delta(sigma * c, et, kw)
                b = P.cepam_gaussian_delta(sigma, et, PAPER)
                assert a == pytest.approx(b, rel=1e-12, abs=1e-300)


def test_eps_round_trip():
    for p in (1e-6, P.subsample_probability(1666, 15), 0.3, 1.0):
        eps = np.geomspace(1e-12, 5000.0, 200)
        back = P.eps_from_eps_tilde(P.eps_tilde_from_eps(eps, p), p)
        # ε = ε̃ + ln(p + ...) cancels ln(1/p) (<= 14 here) against ε̃ for large ε: a few ulp of ε̃
        np.testing.assert_allclose(back, eps, rtol=1e-13)
        et = np.geomspace(1e-12, 5000.0, 200)
        np.testing.assert_allclose(P.eps_tilde_from_eps(P.eps_from_eps_tilde(et, p), p), et, rtol=1e-12)
    # amplification: ε < ε̃ for p < 1; ε ≈ p ε̃ for small ε̃; ε = ε̃ + ln p + o(1) for large ε̃
    p = P.subsample_probability(1666, 15)
    assert P.eps_from_eps_tilde(1e-9, p) == pytest.approx(p * 1e-9, rel=1e-8)
    assert P.eps_from_eps_tilde(5000.0, p) == pytest.approx(5000.0 + math.log(p), rel=1e-15)


def test_group_factor():
    assert P.group_factor(5.9, 1) == 1.0
    for et in (0.1, 2.0, 30.0):
        for j in (2, 3, 15):
            assert P.group_factor(et, j) == pytest.approx(math.expm1(et) / math.expm1(et / j), rel=1e-13)
    assert P.group_factor(1e-12, 4) == pytest.approx(4.0, rel=1e-10)  # → j as ε̃ → 0
    assert P.group_factor(5000.0, 2) == math.inf  # e^{2500}: beyond float64, not NaN
    np.testing.assert_allclose(
        P.group_factor(3.0, np.array([1, 2, 3])), [1.0, np.e**1.5 + 1, np.expm1(3) / np.expm1(1)]
    )


def test_tau_one_reduces_to_scaled_gaussian_profile():
    # τ = 1: only j = 1, weight 1/n_k and group factor 1: δ = δ_F(ε̃)/n_k
    for et, st, sens in [(0.5, 0.8, 1.0), (3.0, 0.2, 0.4), (9.0, 2.0, 3.0)]:
        got = P.subsampled_gaussian_delta(et, st, sens, 1, 100)
        assert got == pytest.approx(P.analytic_gaussian_delta(et, st, sens) / 100, rel=1e-13)


def test_clip_modes_and_sensitivity_override():
    # 'dp' (Δ2 = 2γ/K) at σ equals 'paper' (Δ2 = 2τγ/K) at τσ; an explicit sensitivity overrides the mode
    assert P.cepam_gaussian_sensitivity(PAPER) == pytest.approx(1.0)
    assert P.cepam_gaussian_sensitivity(replace(PAPER, clip_mode="dp")) == pytest.approx(1 / 15)
    for sigma in (0.05, 0.2, 0.5):
        dp = P.cepam_gaussian_delta(sigma, 5.9, replace(PAPER, clip_mode="dp"))
        assert dp == pytest.approx(P.cepam_gaussian_delta(15 * sigma, 5.9, PAPER), rel=1e-13)
        assert dp <= P.cepam_gaussian_delta(sigma, 5.9, PAPER)
        over = P.cepam_gaussian_delta(sigma, 5.9, replace(PAPER, l2_sensitivity=2.0 / 30))
        assert over == pytest.approx(dp, rel=1e-13)
    # the DP-correct mode needs 15x less noise for the same target
    s_paper = P.gaussian_sigma_for(2.0, 1e-5, PAPER)
    s_dp = P.gaussian_sigma_for(2.0, 1e-5, replace(PAPER, clip_mode="dp"))
    assert s_dp == pytest.approx(s_paper / 15, rel=1e-10)


def test_per_client_sigmas():
    sig = np.linspace(0.5, 2.0, 30)
    rms = float(np.sqrt(np.mean(sig**2)))
    assert P.cepam_sigma_tilde(sig, 30) == pytest.approx(rms / math.sqrt(30), rel=1e-14)
    assert P.cepam_gaussian_delta(sig, 5.9, PAPER) == pytest.approx(
        P.cepam_gaussian_delta(rms, 5.9, PAPER), rel=1e-12
    )
    assert P.cepam_gaussian_delta(np.full(30, 1.3), 5.9, PAPER) == pytest.approx(
        P.cepam_gaussian_delta(1.3, 5.9, PAPER), rel=1e-13
    )
    with pytest.raises(ValueError, match="sigma must be a scalar or have shape"):
        P.cepam_gaussian_delta(np.ones(29), 5.9, PAPER)


def test_vectorised_over_eps_tilde_and_monotone_delta():
    p = P.subsample_probability(1666, 15)
    eps = np.linspace(0.5, 9.9, 40)
    et = P.eps_tilde_from_eps(eps, p)
    vec = P.cepam_gaussian_delta(2.0, et, PAPER)
    loop = np.array([P.cepam_gaussian_delta(2.0, float(e), PAPER) for e in et])
    np.testing.assert_array_equal(vec, loop)
    # (16) at σ = 2 is not monotone in ε (docs/papers/cepam.md#s6-6); the running minimum is, and never
    # exceeds it
    assert np.any(np.diff(vec) > 0)
    mono = P.monotone_delta(eps, vec)
    assert np.all(np.diff(mono) <= 0) and np.all(mono <= vec) and mono[0] == vec[0]
    with pytest.raises(ValueError, match="eps must be strictly increasing"):
        P.monotone_delta(eps[::-1], vec)


# ---------------------------------------------------------------------------------------------------------
# Theorem 8: analytic Gaussian


def _hockey_stick_gauss(eps, sigma, sens):
    """D_{e^ε}(N(0,σ²) || N(Δ,σ²)) = ∫ [φ(x) − e^ε φ(x − Δ)]_+ dx, by a fine trapezoid grid."""
    x = np.linspace(-40 * sigma, sens + 40 * sigma, 2_000_001)
    f = np.maximum(stats.norm.pdf(x, 0.0, sigma) - math.exp(eps) * stats.norm.pdf(x, sens, sigma), 0.0)
    return float(np.trapezoid(f, x))


@pytest.mark.parametrize(
    "eps,sigma,sens", [(0.0, 1.0, 1.0), (0.5, 1.0, 1.0), (1.0, 0.5, 1.0), (2.0, 3.0, 2.0)]
)
def test_analytic_gaussian_against_numeric_integral(eps, sigma, sens):
    got = P.analytic_gaussian_delta(eps, sigma, sens)
    assert got == pytest.approx(_hockey_stick_gauss(eps, sigma, sens), rel=1e-7)
    # closed form with scipy.stats.norm: the set {φ > e^ε φ(·−Δ)} is x < Δ/2 − εσ²/Δ
    x_star = sens / 2 - eps * sigma**2 / sens
    direct = stats.norm.cdf(x_star, 0, sigma) - math.exp(eps) * stats.norm.cdf(x_star, sens, sigma)
    assert got == pytest.approx(direct, rel=1e-12)


def test_analytic_sigma_inverts_and_classic_is_conservative():
    for eps in (0.1, 0.5, 0.9, 3.0):
        for delta in (1e-2, 1e-5, 1e-10):
            s = P.analytic_gaussian_sigma(eps, delta, 2.0)
            assert P.analytic_gaussian_delta(eps, s, 2.0) == pytest.approx(delta, rel=1e-10)
            if eps < 1:
                c = P.classic_gaussian_sigma(eps, delta, 2.0)
                assert c >= s and P.analytic_gaussian_delta(eps, c, 2.0) <= delta
    with pytest.raises(ValueError, match="eps must be < 1"):
        P.classic_gaussian_sigma(1.5, 1e-5, 1.0)


# dp-accounting: its closed-form Gaussian privacy loss, and PLD bounds. A pessimistic PLD rounds every privacy
# loss up by at most the discretisation interval h, an optimistic one down by at most h; since the
# hockey-stick δ(ε) = E[(1 − e^{ε − L})_+] is monotone in L, δ(ε + h) <= δ_opt(ε) <= δ(ε) <= δ_pess(ε) <=
# δ(ε − h), up to the truncated tail mass e^{−50} (log_mass_truncation_bound) and float rounding (1e−12 rel.).
DP_POINTS = [(0.5, 1.0, 1.0), (1.0, 2.0, 1.0), (3.0, 1.0, 1.0), (0.2, 4.0, 1.0), (1.0, 1.5, 0.7)]


@pytest.mark.parametrize("eps,sigma,sens", DP_POINTS)
def test_analytic_gaussian_matches_dp_accounting_closed_form(eps, sigma, sens):
    ref = plm.GaussianPrivacyLoss(standard_deviation=sigma, sensitivity=sens).get_delta_for_epsilon(eps)
    assert P.analytic_gaussian_delta(eps, sigma, sens) == pytest.approx(ref, rel=1e-12)


@pytest.mark.parametrize("eps,sigma,sens", DP_POINTS[:3])
def test_analytic_gaussian_within_dp_accounting_pld_bounds(eps, sigma, sens):
    h = 1e-3
    kw = dict(sensitivity=sens, value_discretization_interval=h)
    hi = pld.from_gaussian_mechanism(sigma, pessimistic_estimate=True, **kw).get_delta_for_epsilon(eps)
    lo = pld.from_gaussian_mechanism(
        sigma, pessimistic_estimate=False, use_connect_dots=False, **kw
    ).get_delta_for_epsilon(eps)
    ours = P.analytic_gaussian_delta(eps, sigma, sens)
    slack = 1e-12 * ours + math.exp(-50)
    assert P.analytic_gaussian_delta(eps + h, sigma, sens) - slack <= lo <= ours + slack
    assert ours - slack <= hi <= P.analytic_gaussian_delta(eps - h, sigma, sens) + slack


# ---------------------------------------------------------------------------------------------------------
# Theorems 10 and 13: Laplace


def _hockey_stick_laplace(eps, b, sens):
    x = np.linspace(-60 * b, sens + 60 * b, 2_000_001)
    f = np.maximum(stats.laplace.pdf(x, 0.0, b) - math.exp(eps) * stats.laplace.pdf(x, sens, b), 0.0)
    return float(np.trapezoid(f, x))


@pytest.mark.parametrize("eps,b,sens", [(0.0, 1.0, 1.0), (0.3, 1.0, 1.0), (1.0, 0.5, 1.0), (2.5, 2.0, 6.0)])
def test_laplace_profile_against_numeric_integral(eps, b, sens):
    got = P.laplace_delta(eps, b, sens)
    assert got > 0
    assert got == pytest.approx(_hockey_stick_laplace(eps, b, sens), rel=1e-6)


def test_laplace_profile_zero_beyond_threshold():
    assert P.laplace_delta(2.0, 0.5, 1.0) == 0.0  # ε = Δ1/b
    assert P.laplace_delta(5.0, 0.5, 1.0) == 0.0
    assert P.laplace_delta(2.0 - 1e-9, 0.5, 1.0) == pytest.approx(0.5e-9, rel=1e-6)
    assert _hockey_stick_laplace(2.5, 0.5, 1.0) < 1e-9


def test_subsampled_laplace_zero_iff_theorem13_condition():
    # per-appearance Δ1 = 2γ: (12) + group privacy vanishes iff ε̃ >= τΔ1/b = 2τγ/b (Theorem 13)
    et = np.array([100.0, 299.0, 300.0, 300.5, 5000.0])
    d = P.subsampled_laplace_delta(et, 0.1, 2.0, 15, 1666)
    assert np.all(d[:2] > 0) and np.all(d[2:] == 0)
    # τ = 1 reduction
    assert P.subsampled_laplace_delta(0.7, 1.0, 1.0, 1, 40) == pytest.approx(
        P.laplace_delta(0.7, 1.0, 1.0) / 40
    )


def test_cepam_laplace_modes_and_b_for():
    p = P.subsample_probability(1666, 15)
    # ε̃ below the threshold is raised to 2τγ/b
    assert P.cepam_laplace_epsilon(0.1, 10.0, LAPLACE) == pytest.approx(
        P.eps_from_eps_tilde(300.0, p), rel=1e-15
    )
    # corrected ℓ1 sensitivity for an ℓ2-normalised m-vector: Δ1 = 2τγ√m
    m = 6422
    l2_norm = replace(LAPLACE, l1_mode="l2_norm", num_params=m)
    assert P.cepam_laplace_sensitivity(l2_norm) == pytest.approx(30.0 * math.sqrt(m))
    assert P.cepam_laplace_eps_tilde_min(0.1, l2_norm) == pytest.approx(300.0 * math.sqrt(m))
    assert P.cepam_laplace_sensitivity(replace(LAPLACE, l1_mode="l1_clip")) == 30.0
    # an explicit Δ1 overrides the mode (and makes m unnecessary for 'l2_norm')
    explicit = replace(LAPLACE, l1_mode="l2_norm", l1_sensitivity=30.0 * math.sqrt(m))
    assert P.cepam_laplace_epsilon(0.1, 10.0, explicit) == P.cepam_laplace_epsilon(0.1, 10.0, l2_norm)
    for eps in (0.5, 1.45, 20.0):
        for setting in (replace(LAPLACE, num_params=m), l2_norm):
            b = P.laplace_b_for(eps, setting)
            assert P.cepam_laplace_epsilon(b, 1e-3, setting) == pytest.approx(eps, rel=1e-12)
    with pytest.raises(
        ValueError, match=r"^num_params \(the model size m\) is required for l1_mode='l2_norm'"
    ):
        replace(LAPLACE, l1_mode="l2_norm")
    with pytest.raises(ValueError, match="eps=1e-320 is too small"):
        P.laplace_b_for(1e-320, LAPLACE)


# ---------------------------------------------------------------------------------------------------------
# guarantees and warnings


def test_paper_gaussian_guarantee_is_flagged_vacuous():
    with pytest.warns(VacuousPrivacyWarning, match=r">= p="):
        g = P.cepam_guarantee("gaussian", 0.1, 5.9, PAPER)
    assert g.epsilon == pytest.approx(1.4501871413572687, rel=REL)
    assert g.delta == pytest.approx(0.009688739711522966, rel=REL)
    assert g.p == g.trivial_delta == pytest.approx(0.008965869403499527, rel=REL)
    assert g.delta_sat == pytest.approx(g.delta, rel=1e-14)
    assert g.vacuous and g.rounds == 1 and g.sensitivity == pytest.approx(1.0) and g.scale == 0.1
    assert any("double counts" in n for n in g.notes) and any("'iff'" in n for n in g.notes)
    assert any("delta_sat" in n for n in g.notes)
    g5 = P.compose_naive(g, 80)
    assert (g5.epsilon, g5.delta, g5.rounds) == pytest.approx((80 * g.epsilon, 80 * g.delta, 80))
    assert g5.trivial_delta == pytest.approx(1 - (1 - g.p) ** 80, rel=1e-12) and g5.vacuous
    assert "beyond the paper" in g5.notes[-1]
    with pytest.raises(ValueError, match="rounds == 1"):
        P.compose_naive(g5, 2)


def test_meaningful_gaussian_guarantee_does_not_warn():
    p = P.subsample_probability(1666, 15)
    sigma = P.gaussian_sigma_for(2.0, 1e-5, replace(PAPER, clip_mode="dp"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = P.cepam_guarantee("gaussian", sigma, P.eps_tilde_from_eps(2.0, p), replace(PAPER, clip_mode="dp"))
    assert not g.vacuous and g.delta == pytest.approx(1e-5, rel=1e-9) and g.epsilon == pytest.approx(2.0)
    assert g.delta_sat > p > g.delta
    gk = P.cepam_guarantee("gaussian", np.full(30, sigma), g.eps_tilde, replace(PAPER, clip_mode="dp"))
    assert gk.delta == pytest.approx(g.delta, rel=1e-12) and any("sidejax extension" in n for n in gk.notes)


def test_laplace_guarantee():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g = P.cepam_guarantee("laplace", 0.1, 5000.0, LAPLACE)
    assert g.epsilon == pytest.approx(4995.285669800896, rel=REL) and g.delta == 0.0 and not g.vacuous
    assert g.eps_tilde == 5000.0 and g.sensitivity == 30.0 and any("understates" in n for n in g.notes)
    low = P.cepam_guarantee("laplace", 0.1, 10.0, replace(LAPLACE, l1_mode="l1_clip"))
    assert low.eps_tilde == pytest.approx(300.0) and any("raised" in n for n in low.notes)


def _vacuous_messages(fn):
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in rec if issubclass(w.category, VacuousPrivacyWarning)]


def test_warnings_fire():
    _, msgs = _vacuous_messages(lambda: P.gaussian_sigma_for(2.0, 1e-3, PAPER))
    assert len(msgs) == 1 and ">= 1/n_k=" in msgs[0]
    sigma, msgs = _vacuous_messages(lambda: P.gaussian_sigma_for(1.0, 0.5, PAPER))
    assert sigma == 0.0 and len(msgs) == 2
    assert ">= p=" in msgs[0] and "(0, p)-DP" in msgs[0] and "zero noise already meets" in msgs[1]
    g, msgs = _vacuous_messages(lambda: P.cepam_guarantee("gaussian", 2.05, 5.9, PAPER))
    assert len(msgs) == 1 and ">= 1/n_k=" in msgs[0] and g.vacuous and msgs[0] in g.notes
    _, msgs = _vacuous_messages(lambda: P.gaussian_sigma_for(2.0, 1e-5, PAPER))
    assert msgs == []


@pytest.mark.parametrize(
    "field,value,rule",
    [
        ("tau", 0, "must be an integer >= 1"),
        ("tau", 1.5, "must be an integer >= 1"),
        ("n_k", 1, "must be an integer >= 2"),
        ("num_clients", 0, "must be an integer >= 1"),
        ("gamma", 0.0, "must be > 0"),
        ("gamma", math.nan, "must be finite"),
        ("gamma", [1.0, 2.0], "must be a scalar"),
        ("clip_mode", "clip", "must be one of"),
        ("l1_mode", "x", "must be one of"),
        ("num_params", 0, "must be an integer >= 1"),
        ("l2_sensitivity", -1.0, "must be > 0"),
        ("l1_sensitivity", math.inf, "must be finite"),
    ],
)
def test_setting_errors_name_the_field(field, value, rule):
    # the message starts with the field's name; 'l2_norm' without m is in test_cepam_laplace_modes_and_b_for
    with pytest.raises(ValueError, match=f"^{field} {rule}"):
        replace(PAPER, **{field: value})


def test_setting_normalises_and_is_required_where_used():
    s = P.CepamSetting(tau=np.int64(15), n_k=1666, gamma=np.float32(0.5), l2_sensitivity=1)
    assert type(s.tau) is int and type(s.gamma) is float and type(s.l2_sensitivity) is float
    assert s == P.CepamSetting(tau=15, n_k=1666, gamma=0.5, l2_sensitivity=1.0)
    gaussian = [
        lambda s: P.cepam_gaussian_delta(1.0, 5.9, s),
        lambda s: P.gaussian_sigma_for(2.0, 1e-5, s),
        lambda s: P.cepam_guarantee("gaussian", 1.0, 5.9, s),
        P.cepam_gaussian_sensitivity,
    ]
    for call in gaussian:
        with pytest.raises(ValueError, match="num_clients is required for mechanism='gaussian'"):
            call(LAPLACE)
    dict_setting = dict(tau=15, n_k=1666, gamma=1.0, num_clients=30)
    for call in gaussian + [
        lambda s: P.cepam_laplace_epsilon(0.1, 5.9, s),
        lambda s: P.cepam_laplace_eps_tilde_min(0.1, s),
        lambda s: P.laplace_b_for(1.0, s),
        P.cepam_laplace_sensitivity,
    ]:
        with pytest.raises(ValueError, match="setting must be a CepamSetting, got dict"):
            call(dict_setting)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: P.cepam_gaussian_delta(0.0, 5.9, PAPER), "sigma must be > 0"),
        (lambda: P.cepam_gaussian_delta(-1.0, 5.9, PAPER), "sigma must be > 0"),
        (lambda: P.cepam_gaussian_delta(math.inf, 5.9, PAPER), "sigma must be finite"),
        (lambda: P.cepam_gaussian_delta(math.nan, 5.9, PAPER), "sigma must be finite"),
        (lambda: P.cepam_gaussian_delta(1.0, 0.0, PAPER), "eps_tilde must be > 0"),
        (lambda: P.gaussian_sigma_for(0.0, 1e-5, PAPER), "eps must be > 0"),
        (lambda: P.gaussian_sigma_for(1.0, 0.0, PAPER), r"delta must be a number in \(0, 1\)"),
        (lambda: P.gaussian_sigma_for(1.0, 1.0, PAPER), r"delta must be a number in \(0, 1\)"),
        (
            lambda: P.gaussian_sigma_for(1e-306, 1e-300, PAPER),
            "no sigma within float64.*increase eps or delta",
        ),
        (lambda: P.analytic_gaussian_sigma(-1.0, 1e-5, 1.0), "eps must be > 0"),
        (lambda: P.analytic_gaussian_sigma(1e-306, 1e-300, 1.0), "no sigma within float64"),
        (lambda: P.analytic_gaussian_delta(1.0, 0.0, 1.0), "sigma must be > 0"),
        (lambda: P.analytic_gaussian_delta(-0.1, 1.0, 1.0), "eps must be >= 0"),
        (lambda: P.laplace_delta(1.0, 0.0, 1.0), "b must be > 0"),
        (lambda: P.laplace_delta(1.0, math.inf, 1.0), "b must be finite"),
        (lambda: P.cepam_laplace_epsilon(-0.1, 5000.0, LAPLACE), "b must be > 0"),
        (lambda: P.cepam_laplace_epsilon(0.1, 0.0, LAPLACE), "eps_tilde must be > 0"),
        (lambda: P.laplace_b_for(0.0, LAPLACE), "eps must be > 0"),
        (lambda: P.eps_tilde_from_eps(1.0, 0.0), r"p must lie in \(0, 1\]"),
        (lambda: P.eps_from_eps_tilde(-1.0, 0.5), "eps_tilde must be > 0"),
        (lambda: P.group_factor(1.0, 0), "j must be an integer >= 1"),
        (lambda: P.subsample_probability(1666, 0), "tau must be an integer >= 1"),
        (lambda: P.cepam_guarantee("uniform", 0.1, 5.9, PAPER), "mechanism must be"),
        (lambda: P.cepam_guarantee("laplace", 0.0, 5.9, LAPLACE), "scale must be > 0"),
    ],
)
def test_value_errors_name_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
