"""Recompute or fetch: decide per request whether loading a stored prefix beats prefill.

Two measured models feed one comparison:

* :class:`TransferModel`, one per tier ("dram", "flash"): the wall time of a whole get
  (Acquire, promotion, transport, copy into the engine's buffers) as
  ``latency_s + nbytes / bandwidth_Bps``. The shim reports every get it makes
  (:meth:`CostModel.observe_transfer`); the two parameters are an exponentially
  weighted least-squares fit over those observations, so they follow a link that gets
  busy or a tier that slows down (the EWMA), and separate per-call latency from
  bandwidth as soon as requests of different sizes have been seen. Per-tier priors
  stand in only until the first get from that tier.
* :class:`PrefillModel`: the engine's time to compute ``n`` new tokens after ``s``
  cached ones, ``c0 + c1 * n + c2 * (n * s + n * (n + 1) / 2)`` -- a per-call
  overhead, a per-token term (the GEMMs) and an attention term proportional to the
  number of (query, key) pairs. The coefficients are a non-negative least-squares fit
  over measured prefill times (:meth:`CostModel.observe_prefill`, :func:`calibrate`).

For a hit of ``h`` tokens the engine either loads them (``est_load_s``) or recomputes
them (``est_recompute_s = c1 * h + c2 * h * (h + 1) / 2``; the overhead ``c0`` and the
tokens after the hit cost the same either way). Loading part of the hit is never
better than one of the two ends: load time is linear in the tokens while prefill time
is convex, so their difference is concave and its minimum lies at an end point.

The module is pure Python + numpy (no torch), thread-safe, and keeps counters of its
decisions for metrics (:meth:`CostModel.snapshot`).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_TIER_PRIORS",
    "CostModel",
    "Decision",
    "PrefillModel",
    "TierPrior",
    "TransferModel",
    "calibrate",
]

MiB = 1024 * 1024


@dataclass(frozen=True)
class TierPrior:
    """Starting point for a tier before anything has been measured."""

    latency_s: float
    bandwidth_Bps: float


# Deliberately modest: replaced by measurements after the first few gets.
DEFAULT_TIER_PRIORS: dict[str, TierPrior] = {
    "dram": TierPrior(latency_s=300e-6, bandwidth_Bps=4e9),
    "flash": TierPrior(latency_s=1e-3, bandwidth_Bps=1e9),
    # Held by another node of the pod (docs/pod.md): a peer fetch, then a local get.
    "remote": TierPrior(latency_s=2e-3, bandwidth_Bps=8e8),
}
_UNKNOWN_TIER_PRIOR = TierPrior(latency_s=5e-3, bandwidth_Bps=200e6)


@dataclass(frozen=True)
class Decision:
    """The outcome of :meth:`CostModel.decide` for one request's hit."""

    load: bool
    est_load_s: float
    est_recompute_s: float
    reason: str
    num_tokens: int = 0
    nbytes: int = 0
    tier: str = ""

    @property
    def est_saved_s(self) -> float:
        """Estimated seconds saved by the chosen option over the other one."""
        if self.load:
            return max(0.0, self.est_recompute_s - self.est_load_s)
        return max(0.0, self.est_load_s - self.est_recompute_s)


class TransferModel:
    """``seconds = latency_s + nbytes / bandwidth_Bps``, an exponentially weighted fit.

    Sufficient statistics of a weighted least-squares line (x in MiB, y in seconds) are
    decayed by ``1 - alpha`` per observation, so recent gets dominate (an EWMA of the
    line). While the observations span too narrow a range of sizes to separate the two
    parameters (every request the same size), the line goes through their weighted mean
    with the prior's bandwidth; with no observation at all, the prior is the answer.
    """

    def __init__(self, prior: TierPrior, *, alpha: float = 0.2, min_spread: float = 0.1) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.prior = prior
        self.alpha = alpha
        self.min_spread = min_spread  # coefficient of variation of sizes needed for a slope
        self._s: np.ndarray[Any, Any] = np.zeros(5)  # sum w, w x, w y, w x^2, w x y
        self.samples = 0
        self.last_seconds: float | None = None
        self.last_nbytes: int | None = None

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes < 0 or not math.isfinite(seconds) or seconds < 0:
            return
        x = nbytes / MiB
        obs = np.array([1.0, x, seconds, x * x, x * seconds])
        if self.samples == 0:
            self._s = obs
        else:
            self._s = self._s * (1.0 - self.alpha) + self.alpha * obs
        self.samples += 1
        self.last_seconds, self.last_nbytes = seconds, nbytes

    def params(self) -> tuple[float, float]:
        """``(latency_s, bandwidth_Bps)`` of the current fit."""
        prior_slope = MiB / self.prior.bandwidth_Bps  # seconds per MiB
        if self.samples == 0:
            return self.prior.latency_s, self.prior.bandwidth_Bps
        s0, sx, sy, sxx, sxy = (float(v) for v in self._s)
        mean_x, mean_y = sx / s0, sy / s0
        var_x = max(0.0, sxx / s0 - mean_x * mean_x)
        slope = prior_slope
        if var_x > 0.0 and var_x > (self.min_spread * mean_x) ** 2:
            fitted = (sxy / s0 - mean_x * mean_y) / var_x
            if fitted > 0.0:  # else noise: no size dependence measured, keep the prior's
                slope = fitted
        intercept = mean_y - slope * mean_x
        if intercept < 0.0:  # the line through the origin and the measurements instead
            intercept = 0.0
            slope = sxy / sxx if sxx > 0 else prior_slope
        return float(intercept), float(MiB / slope)

    def estimate(self, nbytes: int) -> float:
        latency, bandwidth = self.params()
        return latency + nbytes / bandwidth


def _attention_pairs(num_tokens: float, context: float) -> float:
    """(query, key) pairs of causal attention for ``num_tokens`` after ``context``."""
    return num_tokens * context + num_tokens * (num_tokens + 1) / 2.0


class PrefillModel:
    """``seconds = c0 + c1 * n + c2 * pairs(n, s)``: fit from measured prefill times.

    Keeps the last ``max_samples`` samples and refits with non-negative least squares
    (exact: every subset of the columns that keeps the per-token term is tried; the
    per-token coefficient is always positive) on each new sample, weighting relative
    errors.
    """

    def __init__(
        self,
        *,
        coefficients: tuple[float, float, float] | None = None,
        max_samples: int = 128,
    ) -> None:
        self._samples: deque[tuple[float, float, float]] = deque(maxlen=max_samples)
        self._prior = coefficients
        self._coef: tuple[float, float, float] | None = coefficients

    @property
    def samples(self) -> int:
        return len(self._samples)

    @property
    def calibrated(self) -> bool:
        return self._coef is not None

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        return self._coef

    def observe(self, num_tokens: int, seconds: float, context_tokens: int = 0) -> None:
        if num_tokens <= 0 or not math.isfinite(seconds) or seconds <= 0:
            return
        self._samples.append((float(num_tokens), float(context_tokens), float(seconds)))
        self._refit()

    def _refit(self) -> None:
        if len(self._samples) < 2 and self._prior is not None:
            return
        data = np.array(self._samples)
        n, s, y = data[:, 0], data[:, 1], data[:, 2]
        pairs = n * s + n * (n + 1) / 2.0  # _attention_pairs, vectorised
        features = np.stack([np.ones_like(n), n, pairs], axis=1)
        # relative errors matter: weight each sample by 1 / y
        weights = 1.0 / y
        a = features * weights[:, None]
        b = y * weights
        scale = np.abs(a).max(axis=0)
        scale[scale == 0] = 1.0
        a = a / scale
        best: tuple[float, np.ndarray] | None = None
        # Every token costs something, so the per-token column is always in the fit: a
        # fit that explains the samples with overhead alone (short, noisy prompts) would
        # make recomputing any prefix look free.
        for cols in ((0, 1, 2), (0, 1), (1, 2), (1,)):
            idx = list(cols)
            sol, *_ = np.linalg.lstsq(a[:, idx], b, rcond=None)
            if np.any(sol < 0) or sol[idx.index(1)] <= 0:
                continue
            coef = np.zeros(3)
            coef[idx] = sol
            resid = float(np.sum((a @ coef - b) ** 2))
            if best is None or resid < best[0] - 1e-15:
                best = (resid, coef)
        if best is None:
            return
        c = best[1] / scale
        self._coef = (float(c[0]), float(c[1]), float(c[2]))

    def predict(self, num_tokens: int, context_tokens: int = 0) -> float:
        """Seconds to prefill ``num_tokens`` after ``context_tokens`` cached ones."""
        if self._coef is None:
            raise RuntimeError("prefill model not calibrated")
        c0, c1, c2 = self._coef
        return c0 + c1 * num_tokens + c2 * _attention_pairs(num_tokens, context_tokens)

    def marginal(self, num_tokens: int) -> float:
        """Seconds that recomputing a ``num_tokens`` prefix adds to a request."""
        if self._coef is None:
            raise RuntimeError("prefill model not calibrated")
        _, c1, c2 = self._coef
        return c1 * num_tokens + c2 * _attention_pairs(num_tokens, 0)


def _tier_bytes(tier: str | Sequence[str], nbytes: int) -> dict[str, int]:
    if isinstance(tier, str):
        return {tier: nbytes}
    counts = Counter(tier)
    total = sum(counts.values())
    if total == 0:
        return {}
    return {t: nbytes * c // total for t, c in counts.items()}


_TIER_ORDER = {"dram": 0, "flash": 1, "remote": 2}


def _slowest(tiers: Iterable[str]) -> str:
    return max(tiers, key=lambda t: _TIER_ORDER.get(t, 99))


@dataclass
class _Counters:
    decisions: int = 0
    load: int = 0
    recompute: int = 0
    tokens_loaded: int = 0
    tokens_recomputed: int = 0
    bytes_loaded: int = 0
    est_saved_s: float = 0.0
    by_reason: Counter[str] = field(default_factory=Counter)
    by_tier: Counter[str] = field(default_factory=Counter)


class CostModel:
    """Per-request load-vs-recompute decisions from measured transfer and prefill costs.

    ``load_factor`` biases the choice: load when ``est_load_s <= load_factor *
    est_recompute_s`` (1.0: pure latency; above 1 favours loading to save accelerator
    time for other requests). ``min_tokens``: hits shorter than this are recomputed
    without asking the models (0 disables). Until a prefill sample or prior exists the
    model loads every hit (``reason="prefill uncalibrated"``): a hit is assumed worth
    loading rather than assuming a number for the engine's speed.
    """

    def __init__(
        self,
        *,
        tier_priors: Mapping[str, TierPrior] | None = None,
        alpha: float = 0.2,
        prefill: PrefillModel | None = None,
        load_factor: float = 1.0,
        min_tokens: int = 0,
    ) -> None:
        self._lock = threading.Lock()
        self._priors = dict(DEFAULT_TIER_PRIORS if tier_priors is None else tier_priors)
        self._alpha = alpha
        self._tiers: dict[str, TransferModel] = {}
        self.prefill = prefill if prefill is not None else PrefillModel()
        self.load_factor = load_factor
        self.min_tokens = min_tokens
        self._c = _Counters()

    # ---------------------------------------------------------------- measurements

    def _tier(self, tier: str) -> TransferModel:
        model = self._tiers.get(tier)
        if model is None:
            prior = self._priors.get(tier, _UNKNOWN_TIER_PRIOR)
            model = self._tiers[tier] = TransferModel(prior, alpha=self._alpha)
        return model

    def observe_transfer(self, tier: str | Sequence[str], nbytes: int, seconds: float) -> None:
        """Record one get: ``nbytes`` from ``tier`` (or per-block tiers) in ``seconds``.

        A get that mixed tiers is attributed to its slowest tier.
        """
        tiers = [tier] if isinstance(tier, str) else list(tier)
        if not tiers:
            return
        with self._lock:
            self._tier(_slowest(tiers)).observe(nbytes, seconds)

    def observe_prefill(self, num_tokens: int, seconds: float, context_tokens: int = 0) -> None:
        """Record one measured prefill of ``num_tokens`` after ``context_tokens`` cached."""
        with self._lock:
            self.prefill.observe(num_tokens, seconds, context_tokens)

    # ---------------------------------------------------------------- estimates

    def estimate_load_s(self, nbytes: int, tier: str | Sequence[str]) -> float:
        with self._lock:
            return self._estimate_load(nbytes, tier)

    def _estimate_load(self, nbytes: int, tier: str | Sequence[str]) -> float:
        parts = _tier_bytes(tier, nbytes)
        if not parts:
            return 0.0
        latency = 0.0
        seconds = 0.0
        for name, part in parts.items():
            lat, bw = self._tier(name).params()
            latency = max(latency, lat)
            seconds += part / bw
        return latency + seconds

    def estimate_recompute_s(self, num_tokens: int) -> float | None:
        with self._lock:
            return self.prefill.marginal(num_tokens) if self.prefill.calibrated else None

    # ---------------------------------------------------------------- decisions

    def decide(
        self, num_tokens_hit: int, bytes_to_load: int, tier: str | Sequence[str]
    ) -> Decision:
        """Load the ``num_tokens_hit`` stored tokens (``bytes_to_load`` from ``tier``)?

        ``tier`` is one tier name or the per-block tiers Lookup returned.
        """
        tier_name = tier if isinstance(tier, str) else (_slowest(tier) if tier else "")
        with self._lock:
            if num_tokens_hit <= 0 or bytes_to_load <= 0:
                decision = Decision(
                    False, 0.0, 0.0, "no hit", num_tokens_hit, bytes_to_load, tier_name
                )
                self._count(decision)
                return decision
            est_load = self._estimate_load(bytes_to_load, tier)
            if not self.prefill.calibrated:
                decision = Decision(
                    True,
                    est_load,
                    math.nan,
                    "prefill uncalibrated",
                    num_tokens_hit,
                    bytes_to_load,
                    tier_name,
                )
            else:
                est_rec = self.prefill.marginal(num_tokens_hit)
                if num_tokens_hit < self.min_tokens:
                    load, reason = False, f"hit shorter than min_tokens={self.min_tokens}"
                elif est_load <= self.load_factor * est_rec:
                    load, reason = True, "load faster"
                else:
                    load, reason = False, "recompute faster"
                decision = Decision(
                    load, est_load, est_rec, reason, num_tokens_hit, bytes_to_load, tier_name
                )
            self._count(decision)
            return decision

    def _count(self, d: Decision) -> None:
        c = self._c
        c.decisions += 1
        c.by_reason[d.reason] += 1
        if d.load:
            c.load += 1
            c.tokens_loaded += d.num_tokens
            c.bytes_loaded += d.nbytes
            c.by_tier[d.tier] += 1
            if math.isfinite(d.est_recompute_s):
                c.est_saved_s += d.est_saved_s
        elif d.reason != "no hit":
            c.recompute += 1
            c.tokens_recomputed += d.num_tokens
            c.est_saved_s += d.est_saved_s

    # ---------------------------------------------------------------- metrics

    def snapshot(self) -> dict[str, Any]:
        """Counters and current estimates, JSON-serialisable, for metrics."""
        with self._lock:
            c = self._c
            tiers: dict[str, Any] = {}
            for name, model in sorted(self._tiers.items()):
                latency, bandwidth = model.params()
                tiers[name] = {
                    "latency_s": latency,
                    "bandwidth_Bps": bandwidth,
                    "samples": model.samples,
                }
            coef = self.prefill.coefficients
            return {
                "decisions_total": c.decisions,
                "decisions_load": c.load,
                "decisions_recompute": c.recompute,
                "tokens_loaded": c.tokens_loaded,
                "tokens_recomputed": c.tokens_recomputed,
                "bytes_loaded": c.bytes_loaded,
                "est_saved_s": c.est_saved_s,
                "by_reason": dict(c.by_reason),
                "loads_by_tier": dict(c.by_tier),
                "tiers": tiers,
                "prefill": {
                    "calibrated": coef is not None,
                    "samples": self.prefill.samples,
                    "overhead_s": coef[0] if coef else None,
                    "per_token_s": coef[1] if coef else None,
                    "per_attention_pair_s": coef[2] if coef else None,
                },
            }


def calibrate(
    model: CostModel | PrefillModel,
    run_prefill: Callable[[int, int], object],
    lengths: Iterable[int],
    *,
    context_tokens: int = 0,
    repeats: int = 1,
    warmup: bool = True,
) -> list[tuple[int, float]]:
    """Time ``run_prefill(num_tokens, context_tokens)`` per length and feed the model.

    ``run_prefill`` must block until the prefill is complete (synchronise a GPU
    inside it). The lengths are timed in ``repeats`` interleaved rounds and the fastest
    time per length is recorded, so a burst of load from other processes spoils one
    round of every length rather than every sample of one. Returns ``(length, seconds)``.
    """
    lengths = list(lengths)
    if warmup and lengths:
        run_prefill(min(lengths), context_tokens)
    best = dict.fromkeys(lengths, math.inf)
    for _ in range(max(1, repeats)):
        for n in lengths:
            t0 = time.perf_counter()
            run_prefill(n, context_tokens)
            best[n] = min(best[n], time.perf_counter() - t0)
    samples = [(n, best[n]) for n in lengths]
    for n, seconds in samples:
        if isinstance(model, CostModel):
            model.observe_prefill(n, seconds, context_tokens)
        else:
            model.observe(n, seconds, context_tokens)
    return samples
