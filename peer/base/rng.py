"""Randomness for privacy mechanisms.

All DP noise — Laplace, multi-bit, the Gaussian unit, DP-SGD's noise and Poisson batches, RS's
draw — comes from one kind of generator: NumPy's PCG64 (``np.random.default_rng``) seeded with
128 bits from the operating system's CSPRNG (``secrets.randbits(128)``), fresh per release.
PCG64 itself is a statistical generator, not a cryptographic one: the 128-bit OS seed is what
makes the stream unpredictable. A fixed seed is a test/simulation option; it is carried in the
``Randomness`` value so that every release record reports it ("fixed seed: not private").
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

__all__ = ["Randomness", "make_randomness"]


@dataclass(frozen=True)
class Randomness:
    """A noise generator and how it was seeded.

    ``source`` is ``"csprng"`` (seeded from ``secrets``; the seed is never stored or logged) or
    ``"fixed-seed"`` (``seed`` is reported in release records).
    """

    generator: np.random.Generator
    source: str
    seed: int | None

    def record_fields(self) -> dict:
        """The fields a release record carries about this randomness."""
        return {"randomness": self.source, "seed": self.seed}

    def spawn(self) -> Randomness:
        """An independent child stream with the same provenance (for sub-mechanisms)."""
        child = self.generator.spawn(1)[0]
        return Randomness(child, self.source, self.seed)


def make_randomness(seed: int | None = None) -> Randomness:
    """CSPRNG-seeded by default; a fixed, recorded seed only when one is given."""
    if seed is None:
        return Randomness(np.random.default_rng(secrets.randbits(128)), "csprng", None)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        from peer.base.errors import InvalidArgument

        raise InvalidArgument("seed", f"must be a non-negative integer, got {seed!r}")
    return Randomness(np.random.default_rng(int(seed)), "fixed-seed", int(seed))
