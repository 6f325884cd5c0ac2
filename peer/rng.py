"""Randomness for privacy mechanisms.

Production noise comes from a generator seeded with 128 bits from the operating system's CSPRNG
(``secrets``), fresh per release. A fixed seed is a test/simulation option; it is carried in the
``Randomness`` value so that every release record reports it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np


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

    def spawn(self) -> "Randomness":
        """An independent child stream with the same provenance (for sub-mechanisms)."""
        child = self.generator.spawn(1)[0]
        return Randomness(child, self.source, self.seed)

    def torch_generator(self) -> "torch.Generator":
        """A torch generator seeded from this stream (consumes 63 bits of it)."""
        import torch

        g = torch.Generator()
        g.manual_seed(int(self.generator.integers(0, 2**63 - 1)))
        return g


def make_randomness(seed: int | None = None) -> Randomness:
    """CSPRNG-seeded by default; a fixed, recorded seed only when one is given."""
    if seed is None:
        return Randomness(np.random.default_rng(secrets.randbits(128)), "csprng", None)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        from peer.errors import InvalidArgument

        raise InvalidArgument("seed", f"must be a non-negative integer, got {seed!r}")
    return Randomness(np.random.default_rng(int(seed)), "fixed-seed", int(seed))
