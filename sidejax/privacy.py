"""Privacy accountant of CEPAM (Ling et al., "Communication-Efficient and Privacy-Adaptable Mechanism for
Federated Learning"): subsampling with replacement, group privacy, the analytic Gaussian and the Laplace
privacy profiles, and the per-round guarantees of Theorems 12 and 13.

Host-side float64 math (numpy + ``scipy.special``); nothing here is traced by jax. Every formula uses the
natural log (the paper's notation section says base 2, but its reported numbers only reproduce with ln;
docs/papers/cepam.md#s6-12). All evaluations stay in log space, so ``eps_tilde = 5000`` (the paper's Laplace
setting) works without overflow.

Notation (docs/papers/cepam.md#s2-0, docs/papers/cepam.md#s2-11). One client holds ``n_k`` records and runs
``tau`` single-sample SGD steps with indices drawn uniformly *with replacement*, i.e. a multiset of size
``tau``; ``K = num_clients``. These, with γ and the sensitivity modes, are one :class:`CepamSetting`
value, which the CEPAM functions take and which is validated once, when it is made. The base mechanism
``F`` acts on the subsample with privacy parameter ``eps_tilde`` (ε̃); the subsampled mechanism ``F∘s``
gets

    p = 1 − (1 − 1/n_k)^τ,            ε = ln(1 + p (e^ε̃ − 1))                       (Thm 7)
    δ_{F∘s}(ε) ≤ Σ_{j=1}^{τ} C(τ,j) (1/n_k)^j (1 − 1/n_k)^{τ−j} δ_{F,j}(ε̃)           (12)
    δ_{F,j}(ε̃) ≤ (e^ε̃ − 1)/(e^{ε̃/j} − 1) · δ_F(ε̃/j)                                (group privacy)

Gaussian base mechanism (Balle–Wang, Thm 8 / eq. 13) with ℓ2-sensitivity Δ2 and noise std σ̃:

    δ_F(ε) = Φ(Δ2/(2σ̃) − εσ̃/Δ2) − e^ε Φ(−Δ2/(2σ̃) − εσ̃/Δ2)

which turns (12) into eq. (14) (Lemma 9) and, with Δ2 = 2τγ/K and σ̃ = σ/√K, into eq. (16) (Thm 12).
Laplace base mechanism (Thm 10): δ_F(ε) = [1 − e^{(ε − Δ1/b)/2}]_+, and Thm 13: ε-DP once ε̃ ≥ 2τγ/b.

Corrections of the paper that this module documents and implements (docs/papers/cepam.md#s6):

* Lemma 9 states "if and only if"; amplification + group privacy only give an upper bound, so (14)/(16)
  are *sufficient* conditions ("if"), not necessary ones (docs/papers/cepam.md#s6-7).
* Δ2 = 2τγ/K multiplies by τ ("a record appears at most τ times") although the group-privacy sum over j
  already accounts for j appearances: double counting, conservative. ``clip_mode='paper'`` reproduces it;
  ``clip_mode='dp'`` uses Δ2 = 2γ/K, which is the replace-one sensitivity when each client *clips* its
  update to norm γ without rescaling at the server (docs/papers/cepam.md#s6-3, docs/papers/cepam.md#s6-4).
* Under the paper's normalise-and-rescale encoder the released noise is σ‖X^k‖/γ and ‖X^k‖ is sent in the
  clear, so the DP statement strictly covers only the normalised average (docs/papers/cepam.md#s6-3). The
  accountant is the same; only ``clip_mode='dp'`` has a proof for the released model.
* Laplace: Δ1 "almost 2τγ" uses the ℓ2 bound γ as an ℓ1 bound. For an m-vector with ‖x‖₂ = γ,
  ‖x‖₁ ≤ γ√m, so the correct value is Δ1 = 2τγ√m (``l1_mode='l2_norm'``), or clip in ℓ1 to γ
  (``l1_mode='l1_clip'``, Δ1 = 2τγ). ``l1_mode='paper'`` reproduces the paper (docs/papers/cepam.md#s6-5).
* Per-client noise levels σ_k (docs/papers/cepam.md#s2-12, a sidejax extension, not in the paper): the
  aggregate noise std per coordinate in the normalised domain is σ̃ = sqrt(Σ_k σ_k²)/K, replacing σ/√K.
* The reported Gaussian guarantee is vacuous: δ = 9.69e−3 equals δ_sat (the σ → 0 value of (16)) and
  exceeds p, while any subsampled mechanism, even without noise, is (0, p)-DP (docs/papers/cepam.md#s6-6). The
  accountant reports ``delta_sat`` and ``trivial_delta = p`` and raises :class:`VacuousPrivacyWarning`.

Beyond the paper and labelled as such: :func:`monotone_delta` (δ*(ε) = min_{ε' ≤ ε} δ(ε')),
:func:`compose_naive` (R rounds: (Rε, Rδ)), :func:`subsampled_laplace_delta` ((12) with the Laplace profile,
which yields δ > 0 below Theorem 13's threshold).

Feasibility: as σ → ∞ every term of (14) tends to 0, so the infimum of achievable δ is 0 and every
δ ∈ (0, 1) is attainable at every ε > 0 (ε̃ = ln(1 + (e^ε − 1)/p) is finite for all ε > 0). Likewise the
Laplace mechanism reaches every ε > 0 with b = Δ1/ε̃. Requests only fail when the required noise leaves the
float64 range; those raise ``ValueError`` saying which argument to change.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from scipy import optimize, special

from sidejax.utils import check_count

__all__ = [
    "VacuousPrivacyWarning",
    "CepamSetting",
    "PrivacyGuarantee",
    "subsample_probability",
    "eps_from_eps_tilde",
    "eps_tilde_from_eps",
    "group_factor",
    "analytic_gaussian_delta",
    "analytic_gaussian_sigma",
    "classic_gaussian_sigma",
    "subsampled_gaussian_delta",
    "subsampled_delta_sat",
    "cepam_gaussian_sensitivity",
    "cepam_sigma_tilde",
    "cepam_gaussian_delta",
    "cepam_gaussian_delta_sat",
    "gaussian_sigma_for",
    "laplace_delta",
    "subsampled_laplace_delta",
    "cepam_laplace_sensitivity",
    "cepam_laplace_eps_tilde_min",
    "cepam_laplace_epsilon",
    "laplace_b_for",
    "monotone_delta",
    "cepam_guarantee",
    "compose_naive",
]

ClipMode = Literal["paper", "dp"]
L1Mode = Literal["paper", "l2_norm", "l1_clip"]
_CLIP_MODES = ("paper", "dp")
_L1_MODES = ("paper", "l2_norm", "l1_clip")
_NOTE_IFF = (
    "Lemma 9 / (14) is a sufficient condition ('if'), not 'iff' as the paper states "
    "(docs/papers/cepam.md#s6-7)"
)


class VacuousPrivacyWarning(UserWarning):
    """A privacy request or guarantee that says nothing: δ ≥ p (any subsampled mechanism is (0, p)-DP),
    δ ≥ 1/n_k (one record may leak in the clear), or zero noise already meets the target."""


# ---------------------------------------------------------------------------------------------------------
# validation


def _real(x, name: str) -> np.ndarray:
    try:
        arr = np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {x!r}") from None
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite, got {x!r}")
    return arr


def _positive(x, name: str) -> np.ndarray:
    arr = _real(x, name)
    if not np.all(arr > 0):
        raise ValueError(f"{name} must be > 0, got {x!r}")
    return arr


def _nonnegative(x, name: str) -> np.ndarray:
    arr = _real(x, name)
    if not np.all(arr >= 0):
        raise ValueError(f"{name} must be >= 0, got {x!r}")
    return arr


def _delta(x, name: str = "delta") -> float:
    arr = _real(x, name)
    if arr.ndim != 0 or not 0.0 < float(arr) < 1.0:
        raise ValueError(f"{name} must be a number in (0, 1), got {x!r}")
    return float(arr)


def _prob(p) -> np.ndarray:
    arr = _real(p, "p")
    if not np.all((arr > 0) & (arr <= 1)):
        raise ValueError(f"p must lie in (0, 1], got {p!r}")
    return arr


def _scalar(name: str, x) -> float:
    arr = np.asarray(x)
    if arr.ndim != 0:
        raise ValueError(f"{name} must be a scalar, got shape {arr.shape}")
    return float(arr)


def _out(arr: np.ndarray):
    """A Python float for 0-d results, else the array."""
    return float(arr) if np.ndim(arr) == 0 else arr


def _tau_nk(tau, n_k) -> tuple[int, int]:
    return check_count(tau, "tau", 1), check_count(n_k, "n_k", 2)


# ---------------------------------------------------------------------------------------------------------
# the CEPAM setting the accountant certifies


@dataclass(frozen=True)
class CepamSetting:
    """One CEPAM deployment as the accountant sees it (docs/papers/cepam.md#s2-0, docs/papers/cepam.md#s2-11):
    what the per-round guarantees of Theorems 12/13 depend on besides the noise (σ or b) and ε̃. Taken by
    :func:`cepam_gaussian_delta`, :func:`gaussian_sigma_for`, :func:`cepam_laplace_epsilon`,
    :func:`cepam_laplace_eps_tilde_min`, :func:`laplace_b_for`, :func:`cepam_guarantee` and the two
    sensitivities :func:`cepam_gaussian_sensitivity`, :func:`cepam_laplace_sensitivity`.

    Validated once, here: a field out of range raises ``ValueError`` naming it; counts become ``int`` and γ,
    Δ2, Δ1 become ``float``.

    Attributes:
        tau: τ >= 1, local SGD steps per round, one record each drawn uniformly *with replacement*; a record
            is in the multiset of τ draws with probability ``p = 1 − (1 − 1/n_k)^τ`` (Theorem 7), and in it
            j times with the binomial weight of (12).
        n_k: n_k >= 2, the client's dataset size ``|𝒟^(k)|``.
        gamma: γ > 0, the ℓ2 norm each client's update is normalised (the paper) or clipped (``'dp'``) to;
            Δ2 and Δ1 below are multiples of γ.
        num_clients: K >= 1, clients averaged per round: the Gaussian noise std on the average is
            σ̃ = σ/√K (eq. 15) and Δ2 carries 1/K. Required by the Gaussian functions; ``None`` if only the
            Laplace ones are used (Laplace noise is per client, eq. 17, so K does not enter).
        clip_mode: Δ2 of the client average (Gaussian, :func:`cepam_gaussian_sensitivity`): ``'paper'``
            Δ2 = 2τγ/K (reproduces (16), double counts, docs/papers/cepam.md#s6-4) or ``'dp'`` Δ2 = 2γ/K
            (clip without rescale, docs/papers/cepam.md#s6-3).
        l1_mode: Δ1 of one client's update over a round (Laplace, :func:`cepam_laplace_sensitivity`):
            ``'paper'`` Δ1 = 2τγ (understated), ``'l2_norm'`` Δ1 = 2τγ√m or ``'l1_clip'`` Δ1 = 2τγ
            (docs/papers/cepam.md#s6-5).
        num_params: m >= 1, the model size, for ``'l2_norm'`` (required there unless ``l1_sensitivity`` is
            given, since ‖x‖₁ <= √m ‖x‖₂).
        l2_sensitivity: an explicit Δ2 > 0 that overrides ``clip_mode``.
        l1_sensitivity: an explicit Δ1 > 0 (total over the τ steps) that overrides ``l1_mode``.
    """

    tau: int
    n_k: int
    gamma: float
    num_clients: int | None = None
    clip_mode: ClipMode = "paper"
    l1_mode: L1Mode = "paper"
    num_params: int | None = None
    l2_sensitivity: float | None = None
    l1_sensitivity: float | None = None

    def __post_init__(self):
        tau, n_k = _tau_nk(self.tau, self.n_k)
        k = None if self.num_clients is None else check_count(self.num_clients, "num_clients", 1)
        valid = {
            "tau": tau,
            "n_k": n_k,
            "num_clients": k,
            "gamma": _scalar("gamma", _positive(self.gamma, "gamma")),
        }
        for name, modes in (("clip_mode", _CLIP_MODES), ("l1_mode", _L1_MODES)):
            if getattr(self, name) not in modes:
                raise ValueError(f"{name} must be one of {modes}, got {getattr(self, name)!r}")
        if self.num_params is not None:
            valid["num_params"] = check_count(self.num_params, "num_params", 1)
        elif self.l1_mode == "l2_norm" and self.l1_sensitivity is None:
            raise ValueError("num_params (the model size m) is required for l1_mode='l2_norm'")
        for name in ("l2_sensitivity", "l1_sensitivity"):
            if getattr(self, name) is not None:
                valid[name] = _scalar(name, _positive(getattr(self, name), name))
        for name, value in valid.items():
            object.__setattr__(self, name, value)


def _check_setting(setting) -> CepamSetting:
    if not isinstance(setting, CepamSetting):
        raise ValueError(f"setting must be a CepamSetting, got {type(setting).__name__}")
    return setting


def _num_clients(setting: CepamSetting) -> int:
    """K of a setting for the Gaussian mechanism, which needs it."""
    if setting.num_clients is None:
        raise ValueError("num_clients is required for mechanism='gaussian'")
    return setting.num_clients


# ---------------------------------------------------------------------------------------------------------
# subsampling with replacement (Theorem 7) and group privacy


def subsample_probability(n_k: int, tau: int) -> float:
    """Probability that a given record is drawn at least once in ``tau`` uniform draws with replacement.

    ``p = 1 − (1 − 1/n_k)^τ`` (Theorem 7), computed as ``−expm1(τ · log1p(−1/n_k))``.

    Args:
        n_k: local dataset size ``|𝒟^(k)|`` (>= 2).
        tau: local SGD steps per round, one sample each (>= 1).

    Returns:
        p in (0, 1).
    """
    tau, n_k = _tau_nk(tau, n_k)
    return float(-math.expm1(tau * math.log1p(-1.0 / n_k)))


def eps_from_eps_tilde(eps_tilde, p):
    """Amplified privacy parameter of the subsampled mechanism (Theorem 7).

    ``ε = ln(1 + p (e^ε̃ − 1))``, evaluated as ``log1p(p · expm1(ε̃))`` (full relative precision for tiny
    ε̃ and small p) and, where ``expm1`` overflows (ε̃ ≳ 709, e.g. the paper's 5000), as the equal
    ``ε̃ + ln(p + (1 − p)e^{−ε̃})`` of the accountant pseudocode of docs/papers/cepam.md#s2-11 (a sum of
    positive terms: no cancellation even for p ~ 1e−9).

    Args:
        eps_tilde: base-mechanism parameter ε̃ > 0 (scalar or array).
        p: subsampling probability in (0, 1] (see :func:`subsample_probability`).

    Returns:
        ε (float for scalar input, else ndarray).
    """
    et = _positive(eps_tilde, "eps_tilde")
    p = _prob(p)
    with np.errstate(over="ignore"):
        small = np.log1p(p * np.expm1(et))  # exact for ε̃ below ~700, overflows above
    large = et + np.log(p + (1.0 - p) * np.exp(-et))  # no overflow and, both terms > 0, no cancellation
    return _out(np.where(np.isfinite(small), small, large))


def eps_tilde_from_eps(eps, p):
    """Inverse of :func:`eps_from_eps_tilde`: ``ε̃ = ln(1 + (e^ε − 1)/p)``.

    Evaluated as ``log1p(expm1(ε)/p)`` and, where that overflows, as the equal
    ``ε + log1p((1 − p)(−expm1(−ε))/p)``. Finite for every ε > 0, so every ε > 0 corresponds to some ε̃.

    Args:
        eps: target ε > 0 of the subsampled mechanism (scalar or array).
        p: subsampling probability in (0, 1].

    Returns:
        ε̃ (float for scalar input, else ndarray).
    """
    e = _positive(eps, "eps")
    p = _prob(p)
    with np.errstate(over="ignore"):
        small = np.log1p(np.expm1(e) / p)
    large = e + np.log1p((1.0 - p) * -np.expm1(-e) / p)
    return _out(np.where(np.isfinite(small), small, large))


def _log_group_factor(eps_tilde: np.ndarray, j: np.ndarray) -> np.ndarray:
    # ln[(e^ε̃ − 1)/(e^{ε̃/j} − 1)] = ε̃ − ε̃/j + ln(−expm1(−ε̃)) − ln(−expm1(−ε̃/j)); exactly 0 at j = 1
    return eps_tilde - eps_tilde / j + np.log(-np.expm1(-eps_tilde)) - np.log(-np.expm1(-eps_tilde / j))


def group_factor(eps_tilde, j):
    """Group-privacy factor (Vadhan): ``δ_{F,j}(ε̃) ≤ (e^ε̃ − 1)/(e^{ε̃/j} − 1) · δ_F(ε̃/j)``.

    Evaluated as ``exp(ε̃ − ε̃/j) · (−expm1(−ε̃))/(−expm1(−ε̃/j))``. Equals 1 at j = 1 and j for ε̃ → 0;
    overflows to ``inf`` only when the factor itself exceeds float64 (e.g. ε̃ = 5000, j = 2).

    Args:
        eps_tilde: ε̃ > 0 (scalar or array).
        j: group size, integer >= 1 (scalar or array).

    Returns:
        The factor (float for scalar input, else ndarray).
    """
    et = _positive(eps_tilde, "eps_tilde")
    jj = _real(j, "j")
    if not np.all((jj >= 1) & (jj == np.round(jj))):
        raise ValueError(f"j must be an integer >= 1, got {j!r}")
    with np.errstate(over="ignore"):
        return _out(np.exp(_log_group_factor(et, jj)))


def _log_binom_weights(tau: int, n_k: int) -> tuple[np.ndarray, np.ndarray]:
    """j = 1..τ and ln[C(τ,j) (1/n_k)^j (1 − 1/n_k)^{τ−j}]."""
    j = np.arange(1, tau + 1, dtype=np.float64)
    logw = (
        special.gammaln(tau + 1.0)
        - special.gammaln(j + 1.0)
        - special.gammaln(tau - j + 1.0)
        - j * math.log(n_k)
        + (tau - j) * math.log1p(-1.0 / n_k)
    )
    return j, logw


def _logsumexp_last(x: np.ndarray) -> np.ndarray:
    """ln Σ exp(x) over the last axis; −inf where every entry is −inf (no NaN, no warning)."""
    m = np.max(x, axis=-1, keepdims=True)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        out = np.log(np.sum(np.exp(x - safe), axis=-1)) + safe[..., 0]
    return np.where(np.isneginf(m[..., 0]), -np.inf, out)


# ---------------------------------------------------------------------------------------------------------
# Gaussian mechanism


def _log_gauss_profile(eps: np.ndarray, s: np.ndarray) -> np.ndarray:
    """ln max(0, Φ(a − b) − e^ε Φ(−a − b)), a = 1/(2s), b = εs, s = σ/Δ (eq. 13 with Δ/σ = 1/s).

    In log space: ln Φ(a − b) + ln(−expm1(ε + ln Φ(−a − b) − ln Φ(a − b))); the exponent difference is
    <= 0 mathematically (the profile is a hockey-stick divergence), rounding above 0 maps to δ = 0.
    """
    a = 0.5 / s
    b = eps * s
    l_hi = special.log_ndtr(a - b)
    d = eps + special.log_ndtr(-a - b) - l_hi
    with np.errstate(divide="ignore", invalid="ignore"):
        out = l_hi + np.log(-np.expm1(np.minimum(d, 0.0)))
    return np.where(d < 0.0, out, -np.inf)


def analytic_gaussian_delta(eps, sigma, sensitivity):
    """Exact privacy profile of the Gaussian mechanism (Balle & Wang 2018; paper Theorem 8, eq. 13).

    ``F(X) = q(X) + N(0, σ² I)`` with ℓ2-sensitivity Δ is (ε, δ)-DP iff
    ``δ ≥ Φ(Δ/(2σ) − εσ/Δ) − e^ε Φ(−Δ/(2σ) − εσ/Δ)``. Computed in log space with ``log_ndtr``.

    Args:
        eps: ε >= 0 (scalar or array; ε = 0 gives the total variation distance 2Φ(Δ/(2σ)) − 1).
        sigma: noise std σ > 0 (scalar or array, broadcast against ``eps``).
        sensitivity: ℓ2-sensitivity Δ > 0.

    Returns:
        δ(ε) (float for scalar input, else ndarray).
    """
    e = _nonnegative(eps, "eps")
    s = _positive(sigma, "sigma") / _positive(sensitivity, "sensitivity")
    return _out(np.exp(_log_gauss_profile(e, s)))


def _solve_log_scale(log_gap, lo: float, hi: float, name_hint: str) -> float:
    """Root in x = ln(scale) of the decreasing function ``log_gap`` (> 0 at lo, < 0 at hi), expanding the
    bracket geometrically; ValueError (with ``name_hint``) when float64 cannot hold or resolve the root."""
    for _ in range(200):
        if log_gap(lo) > 0:
            break
        lo -= 2.0
    else:
        raise ValueError(name_hint)
    for _ in range(200):
        if log_gap(hi) < 0:
            break
        hi += 2.0
        if hi > 700.0:
            raise ValueError(name_hint)
    else:
        raise ValueError(name_hint)
    root = optimize.brentq(log_gap, lo, hi, xtol=1e-14, rtol=1e-14, maxiter=500)
    # far out (σ/Δ ≳ 1e15) the profile loses float64 resolution and jumps to 0; a root there is spurious
    if not abs(log_gap(root)) < 1e-6:
        raise ValueError(name_hint)
    return math.exp(root)


def analytic_gaussian_sigma(eps: float, delta: float, sensitivity: float) -> float:
    """Smallest σ with the Gaussian mechanism (ε, δ)-DP by Theorem 8 (eq. 13), by root finding.

    δ(σ) of eq. (13) decreases from 1 (σ → 0) to 0 (σ → ∞), so every δ ∈ (0, 1) has a unique solution;
    Brent's method on ln σ ↦ ln δ(σ) − ln δ to ~1e−14 relative.

    Args:
        eps: ε > 0.
        delta: target δ in (0, 1).
        sensitivity: ℓ2-sensitivity Δ > 0.

    Returns:
        σ > 0.
    """
    e = _scalar("eps", _positive(eps, "eps"))
    delta = _delta(delta)
    sens = _scalar("sensitivity", _positive(sensitivity, "sensitivity"))
    log_target = math.log(delta)

    def gap(x):
        return float(_log_gauss_profile(np.float64(e), np.float64(math.exp(x)))) - log_target

    msg = (
        f"no sigma within float64 range/resolution meets eps={eps!r}, delta={delta!r}: increase eps or delta"
    )
    return sens * _solve_log_scale(gap, -2.0, 2.0, msg)


def classic_gaussian_sigma(eps: float, delta: float, sensitivity: float) -> float:
    """Classic Gaussian-mechanism calibration (Dwork & Roth Thm A.1; paper §II-C).

    ``σ = Δ · sqrt(2 ln(1.25/δ)) / ε``, valid only for ε ∈ (0, 1); conservative compared to
    :func:`analytic_gaussian_sigma` there.

    Args:
        eps: ε in (0, 1).
        delta: δ in (0, 1).
        sensitivity: ℓ2-sensitivity Δ > 0.

    Returns:
        σ > 0.

    Raises:
        ValueError: for ε >= 1, where the classic rule is not a theorem.
    """
    e = _scalar("eps", _positive(eps, "eps"))
    if e >= 1.0:
        raise ValueError(
            f"eps must be < 1 for the classic Gaussian bound, got {eps!r}; use analytic_gaussian_sigma"
        )
    delta = _delta(delta)
    sens = _scalar("sensitivity", _positive(sensitivity, "sensitivity"))
    return sens * math.sqrt(2.0 * math.log(1.25 / delta)) / e


def _log_subsampled(eps_tilde: np.ndarray, log_profile_j, tau: int, n_k: int) -> np.ndarray:
    """ln of (12) + group privacy: ln Σ_j w_j · gf(ε̃, j) · δ_F(ε̃/j), vectorised over j (last axis)."""
    j, logw = _log_binom_weights(tau, n_k)
    et = eps_tilde[..., None]
    return _logsumexp_last(logw + _log_group_factor(et, j) + log_profile_j(et / j))


def subsampled_gaussian_delta(eps_tilde, sigma_tilde, sensitivity, tau: int, n_k: int):
    """δ of the subsampled Gaussian mechanism, eq. (14) (Lemma 9), generic form.

    ``δ = Σ_{j=1}^{τ} C(τ,j)(1/n_k)^j(1−1/n_k)^{τ−j} · (e^ε̃−1)/(e^{ε̃/j}−1) ·
    max(0, Φ(Δ/(2σ̃) − ε̃σ̃/(jΔ)) − e^{ε̃/j} Φ(−Δ/(2σ̃) − ε̃σ̃/(jΔ)))``,

    the bound for ε = ln(1 + p(e^ε̃ − 1)). Binomial weights, group factor and Gaussian term are summed in log
    space. The paper says (14) holds "if and only if"; it is only sufficient ("if"),
    docs/papers/cepam.md#s6-7. The value can exceed 1 (returned as is, possibly ``inf``): then the bound is
    vacuous.

    Args:
        eps_tilde: ε̃ > 0 (scalar or array).
        sigma_tilde: std σ̃ > 0 of the noise added to the query (broadcast against ``eps_tilde``).
        sensitivity: ℓ2-sensitivity Δ2 > 0 of the query on the subsample.
        tau: draws with replacement (>= 1).
        n_k: dataset size (>= 2).

    Returns:
        δ (float for scalar input, else ndarray).
    """
    et = _positive(eps_tilde, "eps_tilde")
    s = _positive(sigma_tilde, "sigma_tilde") / _positive(sensitivity, "sensitivity")
    tau, n_k = _tau_nk(tau, n_k)
    et, s = np.broadcast_arrays(et, s)
    s_j = s[..., None]
    with np.errstate(over="ignore"):
        return _out(np.exp(_log_subsampled(et, lambda e: _log_gauss_profile(e, s_j), tau, n_k)))


def subsampled_delta_sat(eps_tilde, *, tau: int, n_k: int):
    """Noise-free limit of (12) + group privacy: ``δ_sat = Σ_j C(τ,j)(1/n_k)^j(1−1/n_k)^{τ−j} gf(ε̃, j)``.

    Every base profile tends to 1 as the noise vanishes (Gaussian: the bracket of (14) → Φ(∞) = 1), so this
    is (14)/(16) at σ → 0 (docs/papers/cepam.md#s2-13 ``δ_sat``). Since gf >= 1 and Σ_j w_j = p, δ_sat >= p
    always: a saturated bound is never better than the trivial (0, p)-DP.

    Args:
        eps_tilde: ε̃ > 0 (scalar or array).
        tau: draws (>= 1).
        n_k: dataset size (>= 2).

    Returns:
        δ_sat (float for scalar input, else ndarray; ``inf`` if it exceeds float64).
    """
    et = _positive(eps_tilde, "eps_tilde")
    tau, n_k = _tau_nk(tau, n_k)
    with np.errstate(over="ignore"):
        return _out(np.exp(_log_subsampled(et, np.zeros_like, tau, n_k)))


def cepam_gaussian_sensitivity(setting: CepamSetting) -> float:
    """ℓ2-sensitivity Δ2 of the client average in one CEPAM round (Theorem 12 / docs/papers/cepam.md#s6-3,
    docs/papers/cepam.md#s6-4): ``setting.l2_sensitivity`` if given, else by ``setting.clip_mode``:

    * ``'paper'``: Δ2 = 2τγ/K (paper App. C: "a record appears at most τ times, each adding at most γ").
      Double counts: the group-privacy sum over j in (14) already accounts for repeated appearances. Kept
      for reproducing (16).
    * ``'dp'``: Δ2 = 2γ/K, the replace-one sensitivity when each client clips its update to ℓ2 norm γ with
      no rescaling at the server (the released average of clipped updates then has the noise the proof
      assumes). This is the DP-correct mode. It is still evaluated through (14), i.e. with the group
      factor; since clipping bounds the whole update, any number of appearances moves the average by at
      most 2γ/K, so a tighter accountant could drop the group factor (not done here: not in the paper).

    Args:
        setting: the :class:`CepamSetting` (τ, K, γ, ``clip_mode``; K is required).

    Returns:
        Δ2 > 0.
    """
    s = _check_setting(setting)
    k = _num_clients(s)
    if s.l2_sensitivity is not None:
        return s.l2_sensitivity
    return (2.0 * s.tau * s.gamma if s.clip_mode == "paper" else 2.0 * s.gamma) / k


def cepam_sigma_tilde(sigma, num_clients: int) -> float:
    """Std σ̃ per coordinate of the noise on the normalised client average (Theorem 12, eq. 15).

    Common σ: σ̃ = σ/√K (paper). Per-client σ_k (array of length K; sidejax extension,
    docs/papers/cepam.md#s2-12, not in the paper): σ̃ = sqrt(Σ_k σ_k²)/K, which equals σ/√K when all σ_k = σ.

    Args:
        sigma: σ > 0, or an array of K values σ_k > 0.
        num_clients: K (>= 1).

    Returns:
        σ̃ > 0.
    """
    k = check_count(num_clients, "num_clients", 1)
    s = _positive(sigma, "sigma")
    if s.ndim == 0:
        return float(s) / math.sqrt(k)
    if s.shape != (k,):
        raise ValueError(f"sigma must be a scalar or have shape (num_clients,) = ({k},), got shape {s.shape}")
    return float(np.sqrt(np.sum(s * s))) / k


def cepam_gaussian_delta(sigma, eps_tilde, setting: CepamSetting):
    """Per-round δ of CEPAM-Gaussian, Theorem 12 eq. (16), for ε = ln(1 + p(e^ε̃ − 1)).

    ``δ = Σ_{j=1}^{τ} C(τ,j)(1/n_k)^j(1−1/n_k)^{τ−j} (e^ε̃−1)/(e^{ε̃/j}−1) ·
    [Φ(τγ/(√K σ) − √K ε̃ σ/(2jτγ)) − e^{ε̃/j} Φ(−τγ/(√K σ) − √K ε̃ σ/(2jτγ))]``,

    i.e. (14) with σ̃ = σ/√K and Δ2 from :func:`cepam_gaussian_sensitivity` (``clip_mode='paper'``: 2τγ/K,
    which reproduces (16) and depends on σ, γ only through σ/γ; ``'dp'``: 2γ/K). A sufficient condition
    only (Lemma 9 is "if", not "iff"). With per-client ``sigma`` (length K) σ̃ = sqrt(Σσ_k²)/K (extension,
    docs/papers/cepam.md#s2-12).

    Args:
        sigma: CEPAM noise scale σ > 0 in the normalised domain, or an array of K per-client values.
        eps_tilde: ε̃ > 0 (scalar or array of ε̃ values).
        setting: the :class:`CepamSetting` (τ, n_k, γ, K, the Δ2 mode or an explicit Δ2; K is required).

    Returns:
        δ (float for scalar ``eps_tilde``, else ndarray). Values >= p (even > 1) are vacuous; see
        :func:`cepam_guarantee` for the flagged report.
    """
    sens = cepam_gaussian_sensitivity(setting)
    st = cepam_sigma_tilde(sigma, setting.num_clients)
    return subsampled_gaussian_delta(eps_tilde, st, sens, setting.tau, setting.n_k)


def cepam_gaussian_delta_sat(eps_tilde, *, tau: int, n_k: int):
    """δ_sat: (16) as σ → 0 (docs/papers/cepam.md#s2-13), independent of K, γ and the clip mode; see
    :func:`subsampled_delta_sat`. At ε̃ = 5.9 (n_k = 1666, τ = 15) it is the paper's δ = 9.69e−3."""
    return subsampled_delta_sat(eps_tilde, tau=tau, n_k=n_k)


def _warn_delta(delta: float, p: float, n_k: int, what: str, stacklevel: int = 3) -> list[str]:
    notes = []
    if delta >= p:
        notes.append(
            f"{what} delta={delta:.6g} >= p={p:.6g}: vacuous, any subsampled mechanism (even without noise) "
            "is (0, p)-DP by coupling"
        )
    elif delta >= 1.0 / n_k:
        notes.append(
            f"{what} delta={delta:.6g} >= 1/n_k={1.0 / n_k:.6g}: allows leaking a record in the clear"
        )
    for note in notes:
        warnings.warn(note, VacuousPrivacyWarning, stacklevel=stacklevel)
    return notes


def gaussian_sigma_for(eps: float, delta: float, setting: CepamSetting) -> float:
    """Smallest common σ for which (16) certifies (ε, δ)-DP per round (docs/papers/cepam.md#s2-11
    ``sigma_for``).

    ε̃ = ln(1 + (e^ε − 1)/p); δ(σ) of (16) decreases in σ from δ_sat (σ → 0) to 0 (σ → ∞). If
    δ_sat <= δ the request is already met without noise: returns 0.0 and warns
    (:class:`VacuousPrivacyWarning`). Otherwise Brent's method on ln σ to ~1e−14 relative. Also warns when
    δ >= p or δ >= 1/n_k (a vacuous target). Since the infimum of δ over σ is 0, every δ ∈ (0, 1) is
    reachable; only float64 overflow of σ raises.

    Args:
        eps: target ε > 0 per round.
        delta: target δ in (0, 1).
        setting: the :class:`CepamSetting` (Δ2 from :func:`cepam_gaussian_sensitivity`; K is required).

    Returns:
        σ >= 0 (the CEPAM noise scale in the normalised domain, common to all clients).
    """
    e = _scalar("eps", _positive(eps, "eps"))
    delta = _delta(delta)
    sens = cepam_gaussian_sensitivity(setting)
    tau, n_k, num_clients = setting.tau, setting.n_k, setting.num_clients
    p = subsample_probability(n_k, tau)
    et = eps_tilde_from_eps(e, p)
    _warn_delta(delta, p, n_k, "target")
    sat = subsampled_delta_sat(et, tau=tau, n_k=n_k)
    if sat <= delta:
        warnings.warn(
            f"zero noise already meets (eps={e:g}, delta={delta:g}): delta_sat={sat:.6g} <= delta; the bound "
            "(16) certifies nothing about the noise, returning sigma=0.0",
            VacuousPrivacyWarning,
            stacklevel=2,
        )
        return 0.0
    log_target = math.log(delta)
    sqrt_k = math.sqrt(num_clients)
    j, logw = _log_binom_weights(tau, n_k)
    log_gf = _log_group_factor(np.float64(et), j)

    def gap(x):  # x = ln σ; σ̃/Δ2 = σ/(√K Δ2)
        s = math.exp(x) / (sqrt_k * sens)
        return float(_logsumexp_last(logw + log_gf + _log_gauss_profile(et / j, np.float64(s)))) - log_target

    msg = (
        f"no sigma within float64 range/resolution meets eps={eps!r}, delta={delta!r} (eps_tilde={et:.6g}); "
        "increase eps or delta"
    )
    return _solve_log_scale(gap, math.log(sens * sqrt_k) - 2.0, math.log(sens * sqrt_k) + 2.0, msg)


# ---------------------------------------------------------------------------------------------------------
# Laplace mechanism


def _log_laplace_profile(eps: np.ndarray, theta) -> np.ndarray:
    # ln[1 − e^{(ε − θ)/2}]_+ , θ = Δ1/b
    x = 0.5 * (eps - theta)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log(-np.expm1(np.minimum(x, 0.0)))
    return np.where(x < 0.0, out, -np.inf)


def laplace_delta(eps, b, sensitivity):
    """Privacy profile of the Laplace mechanism (Balle et al. 2018 Thm 3; paper Theorem 10).

    ``q`` scalar with ℓ1-sensitivity Δ1, ``F = q + Lap(0, b)``: ``δ_F(ε) = [1 − e^{(ε − Δ1/b)/2}]_+``, zero
    for ε >= Δ1/b (so b >= Δ1/ε gives ε-DP). Computed as ``−expm1((ε − Δ1/b)/2)``.

    Args:
        eps: ε >= 0 (scalar or array; ε = 0 gives the total variation 1 − e^{−Δ1/(2b)}).
        b: Laplace scale > 0 (broadcast against ``eps``).
        sensitivity: ℓ1-sensitivity Δ1 > 0.

    Returns:
        δ(ε) (float for scalar input, else ndarray).
    """
    e = _nonnegative(eps, "eps")
    theta = _positive(sensitivity, "sensitivity") / _positive(b, "b")
    return _out(np.exp(_log_laplace_profile(e, theta)))


def subsampled_laplace_delta(eps_tilde, b, sensitivity, tau: int, n_k: int):
    """(12) + group privacy with the Laplace profile of Theorem 10 (beyond the paper).

    ``δ = Σ_j C(τ,j)(1/n_k)^j(1−1/n_k)^{τ−j} (e^ε̃−1)/(e^{ε̃/j}−1) [1 − e^{(ε̃/j − Δ1/b)/2}]_+`` for
    ε = ln(1 + p(e^ε̃ − 1)). Here Δ1 is the per-appearance sensitivity; the sum is 0 exactly when
    ε̃ >= τΔ1/b (all j <= τ), which is Theorem 13's condition ε̃ >= 2τγ/b with Δ1 = 2γ. Below that
    threshold it gives the (ε, δ) trade-off that Theorem 13 does not state.

    Args:
        eps_tilde: ε̃ > 0 (scalar or array).
        b: Laplace scale > 0.
        sensitivity: ℓ1-sensitivity Δ1 > 0 per appearance of a record.
        tau: draws (>= 1).
        n_k: dataset size (>= 2).

    Returns:
        δ (float for scalar input, else ndarray).
    """
    et = _positive(eps_tilde, "eps_tilde")
    theta = _scalar("b", _positive(sensitivity, "sensitivity") / _positive(b, "b"))
    tau, n_k = _tau_nk(tau, n_k)
    with np.errstate(over="ignore"):
        return _out(np.exp(_log_subsampled(et, lambda e: _log_laplace_profile(e, theta), tau, n_k)))


def cepam_laplace_sensitivity(setting: CepamSetting) -> float:
    """ℓ1-sensitivity Δ1 of one client's normalised update over a round (Theorem 13;
    docs/papers/cepam.md#s6-5): ``setting.l1_sensitivity`` if given, else by ``setting.l1_mode``:

    * ``'paper'``: Δ1 = 2τγ ("almost 2τγ"). It treats the ℓ2 norm γ as an ℓ1 bound, so it *understates*
      the sensitivity of an m-vector normalised in ℓ2 (for m > 1). Reproduction only.
    * ``'l2_norm'``: Δ1 = 2τγ√m (m = ``num_params``): correct for the paper's ℓ2 normalisation, since
      ‖x‖₁ <= √m ‖x‖₂.
    * ``'l1_clip'``: Δ1 = 2τγ, correct when clients clip/normalise the update in ℓ1 to γ instead.

    Laplace noise is added per client (eq. 17), so K does not enter.

    Args:
        setting: the :class:`CepamSetting` (τ, γ, ``l1_mode``, m).

    Returns:
        Δ1 > 0.
    """
    s = _check_setting(setting)
    if s.l1_sensitivity is not None:
        return s.l1_sensitivity
    if s.l1_mode == "l2_norm":
        return 2.0 * s.tau * s.gamma * math.sqrt(s.num_params)
    return 2.0 * s.tau * s.gamma


def cepam_laplace_eps_tilde_min(b: float, setting: CepamSetting) -> float:
    """Smallest ε̃ that Theorem 13 certifies for Laplace scale b: ``ε̃_min = Δ1/b`` (= 2τγ/b in the paper).

    Args:
        b: Laplace scale > 0 (normalised domain).
        setting: the :class:`CepamSetting` (Δ1 from :func:`cepam_laplace_sensitivity`).

    Returns:
        ε̃_min > 0.
    """
    bb = _scalar("b", _positive(b, "b"))
    return cepam_laplace_sensitivity(setting) / bb


def cepam_laplace_epsilon(b: float, eps_tilde: float, setting: CepamSetting) -> float:
    """Per-round ε of CEPAM-Laplace (Theorem 13), with δ = 0.

    ``ε = ln(1 + p(e^{ε̃'} − 1))`` with ``ε̃' = max(ε̃, Δ1/b)``: Theorem 13 needs ε̃ >= 2τγ/b, so a smaller
    requested ε̃ is raised to the threshold. Stable in log space (ε̃ = 5000 gives ε = 4995.2857 for
    n_k = 1666, τ = 15). ``l1_mode='paper'`` reproduces the paper's understated Δ1 (see
    :func:`cepam_laplace_sensitivity`).

    Args:
        b: Laplace scale > 0 (normalised domain).
        eps_tilde: requested ε̃ > 0.
        setting: the :class:`CepamSetting` (τ, n_k and Δ1 from :func:`cepam_laplace_sensitivity`).

    Returns:
        ε > 0.
    """
    et = _scalar("eps_tilde", _positive(eps_tilde, "eps_tilde"))
    et_min = cepam_laplace_eps_tilde_min(b, setting)
    return eps_from_eps_tilde(max(et, et_min), subsample_probability(setting.n_k, setting.tau))


def laplace_b_for(eps: float, setting: CepamSetting) -> float:
    """Smallest Laplace scale b for which Theorem 13 certifies ε-DP per round: ``b = Δ1/ε̃``,
    ε̃ = ln(1 + (e^ε − 1)/p).

    Args:
        eps: target ε > 0.
        setting: the :class:`CepamSetting` (τ, n_k and Δ1 from :func:`cepam_laplace_sensitivity`).

    Returns:
        b > 0.

    Raises:
        ValueError: if b overflows float64 (ε far too small): increase eps.
    """
    e = _scalar("eps", _positive(eps, "eps"))
    sens = cepam_laplace_sensitivity(setting)
    et = eps_tilde_from_eps(e, subsample_probability(setting.n_k, setting.tau))
    with np.errstate(over="ignore", divide="ignore"):
        b = sens / et if et > 0 else math.inf
    if not math.isfinite(b):
        raise ValueError(
            f"eps={eps!r} is too small: the required Laplace scale overflows float64; increase eps"
        )
    return b


# ---------------------------------------------------------------------------------------------------------
# reporting


def monotone_delta(eps, delta) -> np.ndarray:
    """Monotonised profile δ*(ε_i) = min_{i' <= i} δ(ε_{i'}) over an increasing ε grid (beyond the paper).

    (ε', δ)-DP implies (ε, δ)-DP for ε >= ε', so the running minimum is a valid (and tighter) bound. (16)
    is not monotone in ε (δ_sat grows with ε), docs/papers/cepam.md#s2-11 (extras) and
    docs/papers/cepam.md#s6-6.

    Args:
        eps: strictly increasing 1-d grid of ε values.
        delta: δ at each ε (same shape).

    Returns:
        The running minimum, ndarray of the same shape.
    """
    e = _real(eps, "eps")
    d = np.asarray(delta, dtype=np.float64)  # may hold +inf (a vacuous bound), never NaN
    if np.any(np.isnan(d)) or np.any(d < 0):
        raise ValueError(f"delta must be >= 0 and not NaN, got {delta!r}")
    if e.ndim != 1 or d.shape != e.shape:
        raise ValueError(f"eps and delta must be 1-d of equal length, got shapes {e.shape} and {d.shape}")
    if np.any(np.diff(e) <= 0):
        raise ValueError("eps must be strictly increasing")
    return np.minimum.accumulate(d)


@dataclass(frozen=True)
class PrivacyGuarantee:
    """What the accountant certifies for CEPAM (docs/papers/cepam.md#s2-13 "Privacy").

    Attributes:
        mechanism: ``'gaussian'`` (Thm 12) or ``'laplace'`` (Thm 13).
        epsilon: ε of the subsampled mechanism (per round, or total after :func:`compose_naive`).
        delta: δ certified at ``epsilon`` (0 for Laplace).
        eps_tilde: ε̃ of the base mechanism actually used (Laplace: max(requested, Δ1/b)).
        p: subsampling probability 1 − (1 − 1/n_k)^τ.
        delta_sat: the bound's value as the noise vanishes (docs/papers/cepam.md#s2-13); δ >= δ_sat means the
            noise is irrelevant to the bound.
        trivial_delta: δ that holds without any noise: p per round (coupling), 1 − (1 − p)^R after R rounds.
        vacuous: True if δ >= trivial_delta or δ >= 1/n_k (the guarantee says nothing useful).
        scale: σ (Gaussian; per-client array allowed) or b (Laplace).
        sensitivity: Δ2 (Gaussian, of the client average) or Δ1 (Laplace, per client per round).
        rounds: number of rounds covered (1 unless composed).
        notes: human-readable caveats (paper corrections, vacuity, beyond-paper labels).
    """

    mechanism: str
    epsilon: float
    delta: float
    eps_tilde: float
    p: float
    delta_sat: float
    trivial_delta: float
    vacuous: bool
    scale: float | tuple[float, ...]
    sensitivity: float
    rounds: int = 1
    notes: tuple[str, ...] = ()


def cepam_guarantee(
    mechanism: Literal["gaussian", "laplace"], scale, eps_tilde: float, setting: CepamSetting
) -> PrivacyGuarantee:
    """Per-round privacy report of CEPAM (Theorems 12/13, docs/papers/cepam.md#s2-13), with vacuity flags and
    warnings.

    Gaussian: δ from (16) (:func:`cepam_gaussian_delta`) at ε = ln(1 + p(e^ε̃ − 1)). Laplace: ε from
    :func:`cepam_laplace_epsilon`, δ = 0. Both report ε̃, p, δ_sat (:func:`subsampled_delta_sat`) and
    trivial_delta = p. Warns (:class:`VacuousPrivacyWarning`) when δ >= p or δ >= 1/n_k; the paper's own
    Gaussian setting (σ = 0.1, ε̃ = 5.9) triggers it.

    Args:
        mechanism: ``'gaussian'`` or ``'laplace'``.
        scale: σ > 0 (or K per-client σ_k) for Gaussian; b > 0 for Laplace.
        eps_tilde: ε̃ > 0.
        setting: the :class:`CepamSetting`; Gaussian: Δ2 from :func:`cepam_gaussian_sensitivity` (K is
            required), Laplace: Δ1 from :func:`cepam_laplace_sensitivity`.

    Returns:
        A :class:`PrivacyGuarantee`.
    """
    s = _check_setting(setting)
    tau, n_k = s.tau, s.n_k
    p = subsample_probability(n_k, tau)
    notes: list[str] = []
    if mechanism == "gaussian":
        num_clients = _num_clients(s)
        et = _scalar("eps_tilde", _positive(eps_tilde, "eps_tilde"))
        sens = cepam_gaussian_sensitivity(s)
        st = cepam_sigma_tilde(scale, num_clients)
        delta = subsampled_gaussian_delta(et, st, sens, tau, n_k)
        eps = eps_from_eps_tilde(et, p)
        sat = subsampled_delta_sat(et, tau=tau, n_k=n_k)
        sc = float(scale) if np.ndim(scale) == 0 else tuple(float(v) for v in np.asarray(scale))
        notes.append(_NOTE_IFF)
        if s.l2_sensitivity is None and s.clip_mode == "paper":
            notes.append(
                "Delta_2 = 2 tau gamma / K (paper): double counts repeated appearances "
                "(docs/papers/cepam.md#s6-4)"
            )
            notes.append(
                "normalise+rescale: the DP claim covers the normalised average only "
                "(docs/papers/cepam.md#s6-3)"
            )
        if np.ndim(scale) != 0:
            notes.append(
                "per-client sigmas: sigma_tilde = sqrt(sum sigma_k^2)/K (sidejax extension, "
                "docs/papers/cepam.md#s2-12)"
            )
        if delta >= sat * (1.0 - 1e-12):
            notes.append("delta equals delta_sat: the noise does not enter the bound")
    elif mechanism == "laplace":
        bb = _scalar("scale", _positive(scale, "scale"))
        et_req = _scalar("eps_tilde", _positive(eps_tilde, "eps_tilde"))
        sens = cepam_laplace_sensitivity(s)
        et = max(et_req, sens / bb)
        if et > et_req:
            notes.append(f"eps_tilde raised from {et_req:g} to Delta_1/b = {et:g} (Theorem 13 condition)")
        eps = eps_from_eps_tilde(et, p)
        delta = 0.0
        sat = subsampled_delta_sat(et, tau=tau, n_k=n_k)
        sc = bb
        if s.l1_sensitivity is None and s.l1_mode == "paper":
            notes.append(
                "Delta_1 = 2 tau gamma (paper) understates the l1 sensitivity of an l2-normalised vector "
                "(docs/papers/cepam.md#s6-5); use l1_mode='l2_norm' or 'l1_clip'"
            )
    else:
        raise ValueError(f"mechanism must be 'gaussian' or 'laplace', got {mechanism!r}")
    notes += _warn_delta(delta, p, n_k, "certified")
    vacuous = bool(delta >= p or delta >= 1.0 / n_k)
    return PrivacyGuarantee(
        mechanism=mechanism,
        epsilon=float(eps),
        delta=float(delta),
        eps_tilde=float(et),
        p=p,
        delta_sat=float(sat),
        trivial_delta=p,
        vacuous=vacuous,
        scale=sc,
        sensitivity=float(sens),
        rounds=1,
        notes=tuple(notes),
    )


def compose_naive(guarantee: PrivacyGuarantee, rounds: int) -> PrivacyGuarantee:
    """Basic composition over R rounds: (Rε, Rδ) (beyond the paper, which only states per-round guarantees;
    docs/papers/cepam.md#s6-8). Loose; an RDP/PLD accountant would be tighter.

    The trivial bound composes as 1 − (1 − p)^R (probability the record is ever drawn), δ_sat as R·δ_sat.

    Args:
        guarantee: a per-round :class:`PrivacyGuarantee` (``rounds == 1``).
        rounds: R >= 1.

    Returns:
        The composed :class:`PrivacyGuarantee`; ``vacuous`` if the per-round guarantee was, or if
        Rδ >= 1 − (1 − p)^R.
    """
    r = check_count(rounds, "rounds", 1)
    if not isinstance(guarantee, PrivacyGuarantee):
        raise ValueError(f"guarantee must be a PrivacyGuarantee, got {type(guarantee).__name__}")
    if guarantee.rounds != 1:
        raise ValueError(
            f"guarantee must be a per-round guarantee (rounds == 1), got rounds={guarantee.rounds}"
        )
    trivial = float(-math.expm1(r * math.log1p(-guarantee.p)))
    delta = r * guarantee.delta
    note = f"naive composition over {r} rounds (beyond the paper): (R eps, R delta)"
    return replace(
        guarantee,
        epsilon=r * guarantee.epsilon,
        delta=delta,
        delta_sat=r * guarantee.delta_sat,
        trivial_delta=trivial,
        vacuous=bool(guarantee.vacuous or delta >= trivial or delta >= 1.0),
        rounds=r,
        notes=guarantee.notes + (note,),
    )
