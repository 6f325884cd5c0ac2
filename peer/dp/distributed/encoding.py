"""Integer encoding of a site's contribution for secure aggregation mod 2^b, and its decoding.

A site's contribution to one step is the sum of its sampled records' clipped gradients. Secure
aggregation adds integers mod 2^b, so each record's gradient is turned into an integer vector
first (Kairouz, Liu & Steinke, "The Distributed Discrete Gaussian Mechanism for Federated
Learning with Secure Aggregation", ICML 2021, §4 and Algorithm 1), and the site sends the sum
of those integer vectors plus its noise share (``peer.dp.distributed.skellam``):

1. clip the record's gradient g to L2 norm C (enforced here, not assumed);
2. optional flattening by a randomized rotation x ↦ H·D·x/√d′: D a diagonal of random signs
   from a *public* seed shared by every site of a run, H the Walsh–Hadamard matrix, d′ the
   dimension padded to a power of two. It is an isometry (the norm stays ≤ C), chosen only for
   utility: it spreads a vector's mass over all coordinates, so every coordinate of the sum is
   small and fewer bits avoid wrap-around;
3. scale by γ (integer units per unit of gradient), then re-clip to γC (absorbs float error);
4. conditional randomized rounding (the rounding step of KLS's client encoding): round each
   coordinate independently up with probability its fractional part, down otherwise; accept the rounded
   vector only if its squared norm is ≤ ⌊B²⌋, else round afresh. B is the public bound of KLS's
   analysis of randomized rounding (the one TensorFlow Federated's ``distributed_dp`` accounting
   uses, ``rounded_l2_norm_bound``; here ``rounded_l2_bound``): for ‖x‖₂ ≤ c = γC in d′ dimensions,

       ‖round(x)‖₂² ≤ c² + d′/4 + sqrt(2·ln(1/β))·(c + √d′/2)  with probability ≥ 1 − β,

   and always ‖round(x)‖₂ ≤ c + √d′ (every coordinate moves by < 1). So B = min of the two, a
   try is accepted with probability ≥ 1 − β, and β = 0 means unconditional rounding with the
   deterministic bound c + √d′.

Unit and sensitivity. The unit of privacy is **one record at one site** (add/remove: the record
is in the site's training set or not). Each record is rounded on its own, so the site's integer
sum with the record differs from the sum without it by exactly that record's rounded vector r
(the other records' roundings are independent of it); the vector r is a random function of the
record, and for *every* outcome ‖r‖₂ ≤ Δ₂ := sqrt(⌊B²⌋) and, r being an integer vector,
‖r‖₁ ≤ Δ₁ := min(Δ₂², √d′·Δ₂) (|r_i| ≤ r_i² for integers). By convexity of the Rényi
divergence's exponential in each argument (mixtures over r and over the other records'
roundings), the noisy integer sum is as private as the Skellam mechanism with integer
sensitivities Δ₁, Δ₂ (``peer.dp.accounting.skellam``). This is why, with conditional rounding, the
*records* are rounded, not the site's float sum: a conditional rounding of the sum has no
record-level bound (whether it is accepted depends on the whole sum).

Rounding the sum once (``encode_sum``, unconditional rounding only, β = 0). Randomized rounding
of y has the law of ⌊y + u⌋ with u uniform on [0, 1)^d′. For neighbours y, y′ (‖y − y′‖₂ ≤ γC)
and the *same* u, every coordinate of ⌊y + u⌋ − ⌊y′ + u⌋ is ⌊δ_i⌋ or ⌈δ_i⌉ for δ = y − y′, so
its L2 norm is < γC + √d′ = B (the β = 0 bound) and it is an integer vector. The output's law is
the mixture over u of Skellam mechanisms shifted by such vectors, and by joint convexity of
exp((α−1)·D_α) under a common mixing law, D_α ≤ sup over u: the same Δ₁, Δ₂ as per-record
rounding with β = 0, for one rotation and one rounding per step instead of one per record. It
costs sensitivity (γC + √d′ instead of about γC + d′/(8γC)); a larger γ (a few more bits) makes
that small.

Modulus. The masked vectors and the revealed sum live in Z_{2^b}. Reducing the noisy integer
sum mod 2^b is post-processing of it, so the modulus never changes privacy; it only affects
utility, when a coordinate of the true noisy sum falls outside [−2^{b−1}, 2^{b−1}) and wraps
around. ``modular_overflow_probability`` bounds the chance of that (a union bound over
coordinates with a Chernoff tail for the Skellam noise and, with the rotation, Hoeffding's bound
over the public random signs); ``smallest_bits`` picks the least b that keeps it below a stated
target. The decoder lifts each coordinate to the centred range, divides by γ and undoes the
rotation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from peer.base.errors import InvalidArgument

MAX_BITS = 64
#: conditional rounding gives up after this many tries of one record (each fails w.p. ≤ β)
MAX_ROUNDING_TRIES = 200
#: squared norms are summed in float64: keep them exact integers
_MAX_SQUARED_BOUND = float(2**50)
#: rows of records processed at once (bounds the float64 scratch memory at ~32 MiB)
_CHUNK_ELEMENTS = 1 << 22


def rounded_l2_bound(norm_bound: float, dim: int, beta: float) -> float:
    """B of KLS's randomized-rounding bound (module docstring): the L2 norm a conditionally
    rounded vector of norm ≤ ``norm_bound`` in ``dim`` dimensions is accepted at (β = 0: the
    deterministic c + √d)."""
    c, d = float(norm_bound), int(dim)
    deterministic = c + math.sqrt(d)
    if beta == 0:
        return deterministic
    conditional = math.sqrt(c * c + d / 4.0 + math.sqrt(2.0 * math.log(1.0 / beta)) * (c + math.sqrt(d) / 2.0))
    return min(deterministic, conditional)


def rounded_l1_bound(l2_bound: float, dim: int) -> float:
    """The L1 norm of an integer vector of L2 norm ≤ ``l2_bound``: ≤ min(Δ₂², √d·Δ₂)."""
    return min(l2_bound * l2_bound, math.sqrt(dim) * l2_bound)


def _power_of_two_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_positive(name: str, value, integer: bool = False):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgument(name, f"must be a number, got {value!r}")
    if integer and int(value) != value:
        raise InvalidArgument(name, f"must be an integer, got {value!r}")
    if not (0 < value < math.inf):
        raise InvalidArgument(name, f"must be a finite number > 0, got {value!r}")
    return int(value) if integer else float(value)


@dataclass(frozen=True)
class Encoding:
    """The public parameters of the integer encoding, shared by every site of a run.

    ``dim``: the length of a gradient; ``clip_norm``: C, each record's L2 bound (before
    scaling); ``scale``: γ; ``bits``: b, the modulus is 2^b (2 ≤ b ≤ 64); ``beta``: the
    conditional rounding's per-try failure bound (0 = unconditional rounding, bound c + √d);
    ``rotation_seed``: the public seed of the random signs of the flattening rotation (None =
    no rotation). Everything here is public and belongs in the step's release record.
    """

    dim: int
    clip_norm: float
    scale: float
    bits: int
    beta: float = math.exp(-0.5)
    rotation_seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dim", _check_positive("dim", self.dim, integer=True))
        object.__setattr__(self, "clip_norm", _check_positive("clip_norm", self.clip_norm))
        object.__setattr__(self, "scale", _check_positive("scale", self.scale))
        if (
            isinstance(self.bits, bool)
            or not isinstance(self.bits, (int, np.integer))
            or not 2 <= self.bits <= MAX_BITS
        ):
            raise InvalidArgument("bits", f"must be an integer in [2, {MAX_BITS}], got {self.bits!r}")
        object.__setattr__(self, "bits", int(self.bits))
        b = self.beta
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < 1:
            raise InvalidArgument("beta", f"must be a number in [0, 1), got {b!r}")
        object.__setattr__(self, "beta", float(b))
        s = self.rotation_seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0):
            raise InvalidArgument("rotation_seed", f"must be a non-negative integer or None, got {s!r}")
        if self.squared_bound > _MAX_SQUARED_BOUND:
            raise InvalidArgument(
                "scale",
                f"gives a rounded norm bound of {math.sqrt(self.squared_bound):.4g}; it must stay below 2^25 "
                "(squared norms are summed exactly in float64): lower the scale or the clip norm",
            )

    @property
    def padded_dim(self) -> int:
        """d′: ``dim`` padded to a power of two when rotating, else ``dim``."""
        return _power_of_two_at_least(self.dim) if self.rotation_seed is not None else self.dim

    @property
    def squared_bound(self) -> int:
        """⌊B²⌋: a rounded record is accepted when its (integer) squared norm is at most this."""
        b = rounded_l2_bound(self.scale * self.clip_norm, self.padded_dim, self.beta)
        return math.floor(b * b)

    @property
    def l2_sensitivity(self) -> float:
        """Δ₂ in integer units: every accepted rounded record has L2 norm ≤ this."""
        return math.sqrt(self.squared_bound)

    @property
    def l1_sensitivity(self) -> float:
        """Δ₁ in integer units: every accepted rounded record has L1 norm ≤ this."""
        return rounded_l1_bound(self.l2_sensitivity, self.padded_dim)

    @property
    def coordinate_bound(self) -> int:
        """Every coordinate of an accepted rounded record has magnitude ≤ this."""
        return min(math.floor(self.l2_sensitivity), math.floor(self.scale * self.clip_norm) + 1)

    def record_fields(self) -> dict:
        """The public parameters a release record of a step carries about the encoding."""
        return {
            "dim": self.dim,
            "padded_dim": self.padded_dim,
            "clip_norm": self.clip_norm,
            "scale": self.scale,
            "modulus_bits": self.bits,
            "rounding": "conditional" if self.beta > 0 else "unconditional",
            "rounding_beta": self.beta,
            "rotation": "walsh-hadamard" if self.rotation_seed is not None else "none",
            "rotation_seed": self.rotation_seed,
            "l2_sensitivity": self.l2_sensitivity,
            "l1_sensitivity": self.l1_sensitivity,
        }


def _signs(encoding: Encoding) -> np.ndarray:
    rng = np.random.default_rng(encoding.rotation_seed)  # public: the same at every site of the run
    return rng.integers(0, 2, size=encoding.padded_dim, dtype=np.int8).astype(np.float64) * 2.0 - 1.0


_DENSE_BLOCK = 64


def _sylvester(n: int) -> np.ndarray:
    """The n × n Sylvester–Hadamard matrix (±1, unnormalised), n a power of two."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def fwht(x: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh–Hadamard transform along the last axis (length a power of two):
    H/√n, symmetric and its own inverse."""
    x = np.asarray(x, dtype=np.float64)
    m, n = x.reshape(-1, x.shape[-1]).shape
    if n & (n - 1):
        raise InvalidArgument("x", f"the Walsh–Hadamard transform needs a power-of-two length, got {n}")
    # The first log2(B) levels act within contiguous blocks of B: one product with the dense
    # Sylvester matrix H_B (BLAS); the rest as in-place butterflies (a, b) ← (a + b, a − b).
    block = min(n, _DENSE_BLOCK)
    y = (x.reshape(m * n // block, block) @ _sylvester(block)).reshape(m, n)
    h = block
    while h < n:
        v = y.reshape(m, n // (2 * h), 2, h)
        a = v[:, :, 0, :].copy()
        b = v[:, :, 1, :]
        v[:, :, 0, :] += b
        np.subtract(a, b, out=b)
        h *= 2
    return (y.reshape(x.shape) / math.sqrt(n)) if n > 1 else y.reshape(x.shape)


def _check_records(records: np.ndarray, encoding: Encoding) -> np.ndarray:
    arr = np.asarray(records)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] != encoding.dim:
        raise InvalidArgument("records", f"must have shape (records, {encoding.dim}), got {np.shape(records)}")
    if not np.issubdtype(arr.dtype, np.floating) and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument("records", f"must be numbers, got dtype {arr.dtype}")
    if not np.all(np.isfinite(arr)):
        raise InvalidArgument("records", "must be finite (NaN or infinity found)")
    return arr


def _clip_rows(x: np.ndarray, bound: float) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1)
    factor = np.minimum(1.0, bound / np.maximum(norms, np.finfo(float).tiny))
    return x * factor[:, None]


def _round_conditionally(x: np.ndarray, squared_bound: int, generator: np.random.Generator) -> np.ndarray:
    """Each row rounded randomly (up w.p. its fractional part), re-drawn until its integer
    squared norm is ≤ ``squared_bound``."""
    low = np.floor(x)
    frac = x - low
    out = np.empty(x.shape, dtype=np.int64)
    pending = np.arange(x.shape[0])
    for _ in range(MAX_ROUNDING_TRIES):
        r = low[pending] + (generator.random(frac[pending].shape) < frac[pending])
        ok = np.einsum("ij,ij->i", r, r) <= squared_bound
        out[pending[ok]] = r[ok].astype(np.int64)
        pending = pending[~ok]
        if pending.size == 0:
            return out
    raise ArithmeticError(
        f"conditional rounding failed {MAX_ROUNDING_TRIES} times for {pending.size} record(s): "
        "beta is too small for the dimension or the clip norm was not enforced"
    )


def _rounded_chunks(records: np.ndarray, encoding: Encoding, generator: np.random.Generator):
    x = _check_records(records, encoding)
    d, dp = encoding.dim, encoding.padded_dim
    signs = _signs(encoding) if encoding.rotation_seed is not None else None
    rows = max(1, _CHUNK_ELEMENTS // dp)
    for start in range(0, x.shape[0], rows):
        chunk = _clip_rows(np.asarray(x[start : start + rows], dtype=np.float64), encoding.clip_norm)
        if signs is not None:
            padded = np.zeros((chunk.shape[0], dp))
            padded[:, :d] = chunk
            chunk = fwht(padded * signs)
        chunk = _clip_rows(chunk * encoding.scale, encoding.scale * encoding.clip_norm)
        yield _round_conditionally(chunk, encoding.squared_bound, generator)


def round_records(records: np.ndarray, encoding: Encoding, generator: np.random.Generator) -> np.ndarray:
    """Each record's integer vector round(γ·rotate(clip(g))), shape (n, ``padded_dim``), int64:
    steps 1–4 of the module docstring. Every row has squared norm ≤ ``encoding.squared_bound``."""
    chunks = list(_rounded_chunks(records, encoding, generator))
    return np.concatenate(chunks, axis=0) if chunks else np.zeros((0, encoding.padded_dim), dtype=np.int64)


def encode_records(records: np.ndarray, encoding: Encoding, generator: np.random.Generator) -> np.ndarray:
    """A site's contribution as integers: Σ over its records of round(γ·rotate(clip(g))).

    ``records``: (n, dim) per-record gradients (or one vector). Returns the int64 vector of
    length ``encoding.padded_dim`` (not reduced mod 2^b: add the noise share, then
    ``to_modular``). ``generator``: the site's private CSPRNG-seeded generator (the rounding is
    part of the mechanism's randomness). See the module docstring for the sensitivity.
    """
    total = np.zeros(encoding.padded_dim, dtype=np.int64)
    for chunk in _rounded_chunks(records, encoding, generator):
        total += chunk.sum(axis=0)
    return total


def encode_sum(records: np.ndarray, encoding: Encoding, generator: np.random.Generator) -> np.ndarray:
    """A site's contribution as integers, rounded once: round(γ·rotate(Σ clip(g))).

    Same input and output as ``encode_records``; each record is still clipped here (the bound
    is enforced, not assumed), then the float sum is rotated, scaled and rounded once,
    unconditionally. Only for ``encoding.beta == 0``, whose sensitivities (B = γC + √d′) the
    module docstring proves for this rounding.
    """
    if encoding.beta != 0:
        raise InvalidArgument(
            "beta",
            "rounding the sum once is analysed for unconditional rounding only: use beta = 0 (or encode_records)",
        )
    x = _check_records(records, encoding)
    d, dp = encoding.dim, encoding.padded_dim
    total = np.zeros(d)
    rows = max(1, _CHUNK_ELEMENTS // d)
    for start in range(0, x.shape[0], rows):
        total += _clip_rows(np.asarray(x[start : start + rows], dtype=np.float64), encoding.clip_norm).sum(axis=0)
    y = np.zeros(dp)
    y[:d] = total
    if encoding.rotation_seed is not None:
        y = fwht((y * _signs(encoding))[None, :])[0]
    y *= encoding.scale
    low = np.floor(y)
    return (low + (generator.random(dp) < (y - low))).astype(np.int64)


def to_modular(values: np.ndarray, bits: int) -> np.ndarray:
    """Integers → their residues mod 2^bits as uint64 (two's complement wrap, then a mask)."""
    v = np.asarray(values)
    if not np.issubdtype(v.dtype, np.integer):
        raise InvalidArgument("values", f"must be integers, got dtype {v.dtype}")
    out = v.astype(np.int64).view(np.uint64) if v.dtype != np.uint64 else v.copy()
    if bits < 64:
        out &= np.uint64((1 << bits) - 1)
    return out


def centred(values: np.ndarray, bits: int) -> np.ndarray:
    """Residues mod 2^bits (uint64) → the representatives in [−2^{bits−1}, 2^{bits−1}) (int64)."""
    v = np.asarray(values, dtype=np.uint64)
    if bits == 64:
        return v.view(np.int64).copy()
    s = v.astype(np.int64)
    return np.where(s >= (1 << (bits - 1)), s - (1 << bits), s)


def decode_sum(total: np.ndarray, encoding: Encoding) -> np.ndarray:
    """The revealed sum (uint64 residues mod 2^b, length ``padded_dim``) → the float sum of
    the records' clipped gradients plus noise/γ: centred lift, ÷γ, inverse rotation, cut to
    ``dim``. Post-processing of the revealed sum only."""
    t = np.asarray(total)
    if t.shape != (encoding.padded_dim,):
        raise InvalidArgument("total", f"must have shape ({encoding.padded_dim},), got {t.shape}")
    y = centred(t, encoding.bits).astype(np.float64) / encoding.scale
    if encoding.rotation_seed is not None:
        y = fwht(y[None, :])[0] * _signs(encoding)
    return y[: encoding.dim]


def skellam_upper_tail_log(threshold: float, variance: float) -> float:
    """log of a Chernoff bound on P(Z ≥ threshold) for Z symmetric Skellam of variance V:
    E e^{sZ} = exp(V(cosh s − 1)), optimised at s = asinh(t/V):
    log P ≤ V(sqrt(1 + (t/V)²) − 1) − t·asinh(t/V). 0 for t ≤ 0."""
    t, v = float(threshold), float(variance)
    if t <= 0:
        return 0.0
    if v == 0:
        return -math.inf
    r = t / v
    return v * (math.sqrt(1.0 + r * r) - 1.0) - t * math.asinh(r)


def modular_overflow_probability(encoding: Encoding, max_records: int, noise_variance: float) -> float:
    """An upper bound on the probability that some coordinate of one step's noisy integer sum
    falls outside [−2^{b−1}, 2^{b−1}) and wraps around (utility only: see the module docstring).

    ``max_records``: a public bound on the number of records summed in the step over *all*
    sites (with Poisson sampling, pick one that holds with high probability and add its failure
    probability to the target); ``noise_variance``: the total Skellam variance per coordinate
    added by all sites. Per coordinate, the records' part is at most n·(coordinate bound)
    deterministically; with the rotation also at most s + n except with probability
    2·exp(−s²d′/(2(nγC)²)) over the public signs (Hoeffding; assumes the records do not depend
    on the signs), for the best s on a grid. The noise's part has the Chernoff tail
    ``skellam_upper_tail_log`` on both sides. Union bound over the d′ coordinates.
    """
    n = _check_positive("max_records", max_records, integer=True)
    v = float(noise_variance)
    if not (0 <= v < math.inf):
        raise InvalidArgument("noise_variance", f"must be a finite number >= 0, got {noise_variance!r}")
    half = float(2 ** (encoding.bits - 1))
    dp = encoding.padded_dim
    log_dp = math.log(dp)

    def noise_log_tail(room: float) -> float:
        return math.log(2.0) + skellam_upper_tail_log(room, v) if room > 0 else 0.0

    best = log_dp + noise_log_tail(half - n * encoding.coordinate_bound)
    if encoding.rotation_seed is not None:
        spread = n * encoding.scale * encoding.clip_norm
        for s in np.linspace(0.0, half - n, 257)[1:-1]:
            hoeffding = math.log(2.0) - s * s * dp / (2.0 * spread * spread)
            both = np.logaddexp(hoeffding, noise_log_tail(half - n - s))
            best = min(best, log_dp + float(both))
    return min(1.0, math.exp(best))


def smallest_bits(encoding: Encoding, max_records: int, noise_variance: float, target: float) -> int:
    """The least b ≤ 64 whose overflow probability (``modular_overflow_probability`` with this
    encoding's other parameters) is ≤ ``target``; refuses when even b = 64 is not enough."""
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < 1:
        raise InvalidArgument("target", f"must be a probability in (0, 1), got {target!r}")
    for b in range(2, MAX_BITS + 1):
        trial = Encoding(encoding.dim, encoding.clip_norm, encoding.scale, b, encoding.beta, encoding.rotation_seed)
        if modular_overflow_probability(trial, max_records, noise_variance) <= target:
            return b
    raise InvalidArgument(
        "bits", f"even 2^64 leaves an overflow probability above {target:g}: lower the scale or the noise"
    )


__all__ = [
    "MAX_BITS",
    "Encoding",
    "centred",
    "decode_sum",
    "encode_records",
    "encode_sum",
    "fwht",
    "modular_overflow_probability",
    "round_records",
    "rounded_l1_bound",
    "rounded_l2_bound",
    "skellam_upper_tail_log",
    "smallest_bits",
    "to_modular",
]
