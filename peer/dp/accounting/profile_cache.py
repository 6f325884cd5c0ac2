"""Models' PLDs kept on disk, so a restarted daemon does not compose T-step PLDs again.

A T = 10,000-step Poisson-subsampled DP-SGD model's PLD takes a few hundred milliseconds to
build (FFT self-composition of the per-step PLD); a pool's profiles are fixed while the pool is,
so they are built once and stored in a directory beside the pool (``peer.dp.pools``).

An entry is keyed by ``profile_key``: SHA-256 of the canonical JSON of the model's training
record (``TrainingRecord.to_dict`` / ``ApproxDP.to_dict``), the adjacency, the RDP orders, the
PLD's value discretisation interval, this format's version and dp-accounting's version. It is two
files, ``KEY.npz`` (the arrays of each direction's dense PMF: probabilities, lower loss index,
+∞ mass, interval, pessimistic flag) and ``KEY.json`` (the key's inputs, a SHA-256 of the
arrays, and each direction's δ at ``CHECK_EPSILONS`` read from the PLD when it was built). The
RDP curve at the orders is stored beside the PMFs (a subsampled Gaussian's RDP costs tens of
milliseconds per model). Nothing is pickled: the PLD object is rebuilt from the arrays.

A wrong PLD would under-state the published ε (and move π), so an entry is never trusted
blindly. It is used only when

1. it is consistent with itself: its JSON names the same key inputs, the arrays hash to the
   stored digest, every array has the shape and range a PMF must (finite, non-negative
   probabilities up to FFT noise; total mass at least 1 − ``MASS_TOLERANCE``; the requested
   interval; pessimistic; one non-negative RDP value per order), and the rebuilt PLD gives the
   stored δ at ``CHECK_EPSILONS`` (one dot product per ε; equal up to ``CHECK_RTOL``, the
   rounding of a sum in another order, as another BLAS thread count gives); and
2. it matches what its training record determines (``fingerprint_problem``) — the checks above
   alone accept any self-consistent entry, e.g. a far more private model's PLD written in with
   its own digest:
   - the RDP curve is recomputed from the record (tens of milliseconds for a subsampled
     Gaussian, against hundreds for the PLD) and must equal the stored one; the profile uses the
     recomputed curve;
   - a full-batch record is a Gaussian mechanism of μ known in closed form: the stored PLD's
     δ(ε), each direction, must be at least the exact μ-GDP δ(ε) at every point of an ε grid
     (``FINGERPRINT_POINTS`` points from 0 to the ε where δ = 1e-14; a pessimistic PLD is an
     upper bound). δ(ε) is non-increasing, so an accepted entry under-states ε(δ) by at most one
     grid step for every δ ≥ 1e-14;
   - a record with subsampled steps: the stored PMF's order-2 Rényi divergence (the larger
     direction, from its finite losses) must reach the record's RDP at order 2 (exact for the
     subsampled Gaussian) within ``FINGERPRINT_RTOL``. This pins one moment of the loss
     distribution, not the whole curve: it refuses the issue's forgery (another model's PLD) and
     anything more private in that moment, not a PLD crafted to match the moment exactly;
   - a model known by (ε, δ) only, or one that is not private (σ = 0): its PLD costs nothing to
     build, so the stored PMF must equal a rebuilt one.
   When an honest entry's truncated tail makes its order-2 moment fall short (very weak models),
   it is rebuilt every time: slower, never wrong.

Anything else (missing, corrupt, tampered, another version) is ignored, rebuilt from the record
and written again; an entry that exists but fails a check is named in a warning (the
``peer.dp.accounting.profile_cache`` logger) with the check it failed.

What is stored is public: a model's PLD is a function of its public training record only.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import math
import os
import tempfile
import zipfile
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

import numpy as np

from peer.base.extras import LazyModule
from peer.dp.accounting import pld as pldm
from peer.dp.accounting import profiles
from peer.dp.accounting.accountant import DEFAULT_ACCOUNTANT, Accountant
from peer.dp.accounting.conversions import gdp_delta, gdp_epsilon
from peer.dp.accounting.training_records import ApproxDP, TrainingRecord, check_adjacency

pld_pmf = LazyModule("dp_accounting.pld.pld_pmf")  # imported where a profile is rebuilt (slow to import)

FORMAT = "privfusion-pld-cache/1"
# the fixed ε at which an entry's δ (each direction) is recorded at build time and checked at load
CHECK_EPSILONS = (0.5, 2.0, 8.0)
# a PMF's probabilities plus its +∞ mass sum to at least 1 up to floating-point error of the FFT
# (pessimistic rounding only ever adds mass: dp-accounting's ADD direction of a subsampled
# Gaussian holds up to ~2e-4 extra at T = 10k), and at most 1 + MASS_EXCESS; FFT noise leaves
# probabilities as low as about -1e-17, so down to -NEGATIVE_NOISE is accepted
MASS_TOLERANCE = 1e-6
MASS_EXCESS = 0.05
NEGATIVE_NOISE = 1e-12
# the δ recomputed at load may differ from the recorded ones in their last bits: each is a dot
# product over the PMF, and BLAS splits a long dot among its threads, so a process with another
# thread count (a daemon runs with OMP_NUM_THREADS=1) sums in another order (relative error at
# most n·2⁻⁵³ ≈ 1e-10 at n = 10⁶ probabilities); 1e-9 relative is above that rounding and far
# below any change of the arrays that would matter (those are hashed besides)
CHECK_RTOL = 1e-9
_DIRECTIONS = ("remove", "add")
# the fingerprint of an entry against its training record (module docstring): the ε grid on
# which a stored δ(ε) is compared with the record's, and how far below the record's order-2 RDP
# the stored PMF's order-2 Rényi divergence may fall (honest entries: within 2e-5 relative, the
# pessimistic rounding and the truncated tail; measured at T = 500..10,000 Poisson steps)
FINGERPRINT_POINTS = 400
FINGERPRINT_DELTA = 1e-14
FINGERPRINT_RTOL = 1e-3
log = logging.getLogger("peer.dp.accounting.profile_cache")


def _dp_accounting_version() -> str:
    try:
        return metadata.version("dp-accounting")
    except metadata.PackageNotFoundError:  # pragma: no cover - installed without metadata
        return "unknown"


def key_inputs(model: TrainingRecord | ApproxDP, adjacency: str, accountant: Accountant) -> dict:
    """Everything the PLD of ``model`` depends on, as canonical JSON-able data (the accountant
    enters by its orders and its discretisation)."""
    orders, interval = accountant.orders, accountant.value_discretization_interval
    return {
        "format": FORMAT,
        "dp_accounting": _dp_accounting_version(),
        "model": {"kind": type(model).__name__, **model.to_dict()},
        "adjacency": adjacency,
        "orders": [float(a) for a in orders],
        "value_discretization_interval": float(interval),
    }


def profile_key(model: TrainingRecord | ApproxDP, adjacency: str, accountant: Accountant) -> str:
    canonical = json.dumps(key_inputs(model, adjacency, accountant), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _arrays(pld: pldm.PLD) -> dict[str, np.ndarray]:
    remove, add = pldm.directions(pld)
    out = {}
    for name, pmf in zip(_DIRECTIONS, (remove, add) if add is not remove else (remove,), strict=False):
        dense = pmf.to_dense_pmf()
        out[f"{name}_probs"] = np.ascontiguousarray(dense._probs, dtype=np.float64)
        out[f"{name}_meta"] = np.array(
            [float(dense._lower_loss), float(dense._infinity_mass), float(dense._discretization),
             1.0 if dense._pessimistic_estimate else 0.0],
            dtype=np.float64,
        )  # fmt: skip
    return out


def _digest(arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_deltas(pld: pldm.PLD) -> list[list[float]]:
    return [[float(v) for v in d] for d in pldm.directional_deltas(pld, CHECK_EPSILONS)]


def save_entry(
    directory: str | os.PathLike, model, adjacency: str, accountant: Accountant, pld: pldm.PLD, rdp: np.ndarray
) -> Path:
    """Write ``pld`` as the entry of (model, adjacency, accountant); returns the JSON path.
    The arrays are written first and the JSON last (each atomically), so a crash leaves no JSON
    that names arrays which are not there."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    key = profile_key(model, adjacency, accountant)
    arrays = {**_arrays(pld), "rdp": np.asarray(rdp, dtype=np.float64)}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    _atomic_write(d / f"{key}.npz", buf.getvalue())
    entry = {
        "key": key,
        "inputs": key_inputs(model, adjacency, accountant),
        "arrays_sha256": _digest(arrays),
        "check_epsilons": list(CHECK_EPSILONS),
        "deltas_at_check_epsilons": _check_deltas(pld),
    }
    _atomic_write(d / f"{key}.json", json.dumps(entry, sort_keys=True, indent=1).encode())
    return d / f"{key}.json"


def _pmf_from(arrays, name: str, interval: float):
    probs, meta = arrays[f"{name}_probs"], arrays[f"{name}_meta"]
    if probs.dtype != np.float64 or probs.ndim != 1 or meta.shape != (4,) or meta.dtype != np.float64:
        return None
    lower, inf_mass, h, pessimistic = (float(v) for v in meta)
    if not (np.all(np.isfinite(probs)) and math.isfinite(lower) and lower == int(lower)):
        return None
    if h != interval or pessimistic != 1.0 or not 0.0 <= inf_mass <= 1.0 or np.any(probs < -NEGATIVE_NOISE):
        return None
    if not 1.0 - MASS_TOLERANCE <= float(probs.sum()) + inf_mass <= 1.0 + MASS_EXCESS:
        return None
    return pld_pmf.DensePLDPmf(h, int(lower), probs, inf_mass, True)


def _renyi2(pmf) -> float:
    """D_2 of one direction from its finite losses: log Σ_l p_l e^l (order 2, (α − 1) = 1)."""
    dense = pmf.to_dense_pmf()
    probs = np.clip(np.asarray(dense._probs), 0.0, None)
    if not probs.any():
        return -math.inf
    losses = (dense._lower_loss + np.arange(probs.size)) * dense._discretization
    top = float(losses[probs > 0][-1])
    return top + math.log(float(np.dot(probs, np.exp(losses - top))))


def _grid_deltas(pld: pldm.PLD, grid: np.ndarray) -> np.ndarray:
    return np.vstack(pldm.directional_deltas(pld, grid))


def fingerprint_problem(model, adjacency: str, accountant: Accountant, pld: pldm.PLD, rdp: np.ndarray) -> str | None:
    """Why a stored (PLD, RDP) does not match what ``model``'s training record determines, or None
    when it does (module docstring, check 2). Public: reads the record and the stored arrays."""
    orders, interval = accountant.orders, accountant.value_discretization_interval
    expected_rdp = profiles.model_rdp(model, adjacency, accountant=accountant)
    same = (np.isinf(expected_rdp) == np.isinf(rdp)) & np.isclose(
        np.where(np.isinf(rdp), 0.0, rdp), np.where(np.isinf(expected_rdp), 0.0, expected_rdp), rtol=CHECK_RTOL, atol=0
    )
    if not np.all(same):
        return "its RDP curve is not the one its training record gives"
    exact = None
    # built without being remembered: what is remembered is the profile this entry gives
    rebuild = profiles._derived_profile.__wrapped__
    if isinstance(model, ApproxDP):
        exact = rebuild(model, adjacency, tuple(float(a) for a in orders), interval)
    else:
        groups = profiles._step_groups(model)
        if any(sigma == 0 for sigma, _ in groups):
            exact = rebuild(model, adjacency, tuple(float(a) for a in orders), interval)
        elif all(q == 1.0 for _, q in groups):
            mu = profiles._full_batch_mu(groups, adjacency)
            grid = np.linspace(0.0, gdp_epsilon(mu, FINGERPRINT_DELTA), FINGERPRINT_POINTS)
            want = np.array([gdp_delta(mu, float(e)) for e in grid])
            got = _grid_deltas(pld, grid)
            if np.any(got < want * (1 - 1e-9) - 1e-15):
                return f"its delta(epsilon) is below the exact one of the record's Gaussian mechanism (mu = {mu:.6g})"
            return None
    if exact is not None:
        mine, theirs = _arrays(pld), _arrays(exact.pld)
        if set(mine) != set(theirs) or any(
            mine[k].shape != theirs[k].shape or not np.allclose(mine[k], theirs[k], rtol=1e-12, atol=0) for k in mine
        ):
            return "its PMF is not the one its record's PLD has"
        return None
    grid_orders = [float(a) for a in orders]
    rdp2 = (
        float(expected_rdp[grid_orders.index(2.0)])
        if 2.0 in grid_orders
        else float(profiles.model_rdp(model, adjacency, accountant=accountant.with_orders([2.0]))[0])
    )
    remove, add = pldm.directions(pld)
    got2 = max(_renyi2(remove), _renyi2(add))
    if not got2 >= rdp2 * (1 - FINGERPRINT_RTOL):
        return f"its order-2 Renyi divergence {got2:.6g} falls short of the record's {rdp2:.6g}"
    return None


def _reject(path: Path, why: str) -> None:
    log.warning(
        json.dumps({"event": "profile-cache-entry-rejected", "path": str(path), "reason": why, "action": "rebuilt"})
    )


def load_entry(
    directory: str | os.PathLike, model, adjacency: str, accountant: Accountant
) -> tuple[pldm.PLD, np.ndarray] | None:
    """The stored (PLD, RDP curve) of (model, adjacency, accountant), or None when there is no
    entry or the entry fails any check (module docstring; a failing entry is named in a warning):
    the caller then builds it anew."""
    d = Path(directory)
    orders, interval = accountant.orders, accountant.value_discretization_interval
    key = profile_key(model, adjacency, accountant)
    path = d / f"{key}.json"
    try:
        text = path.read_text()
    except OSError:  # no entry: nothing to say
        return None
    try:
        why = None
        entry = json.loads(text)
        if (
            not isinstance(entry, dict)
            or entry.get("key") != key
            or entry.get("inputs") != key_inputs(model, adjacency, accountant)
            or entry.get("check_epsilons") != list(CHECK_EPSILONS)
        ):
            why = "its key inputs are not this model's"
        else:
            with np.load(d / f"{key}.npz", allow_pickle=False) as z:
                arrays = {name: z[name] for name in z.files}
            expected = {f"{n}_{p}" for n in _DIRECTIONS[: 2 if "add_probs" in arrays else 1] for p in ("probs", "meta")}
            expected.add("rdp")
            remove = add = None
            if set(arrays) != expected or _digest(arrays) != entry.get("arrays_sha256"):
                why = "its arrays do not hash to its digest"
            else:
                remove = _pmf_from(arrays, "remove", interval)
                add = _pmf_from(arrays, "add", interval) if "add_probs" in arrays else None
                rdp = arrays["rdp"]
                if remove is None or ("add_probs" in arrays and add is None):
                    why = "its arrays are not a pessimistic PMF at this interval"
                elif rdp.dtype != np.float64 or rdp.shape != (len(orders),) or np.any(np.isnan(rdp)) or np.any(rdp < 0):
                    why = "its RDP curve is malformed"
            if why is None:
                pld = pldm.PLD(remove, add)
                stored = np.asarray(entry.get("deltas_at_check_epsilons"), dtype=np.float64)
                got = np.asarray(_check_deltas(pld))
                if stored.shape != got.shape or not np.allclose(got, stored, rtol=CHECK_RTOL, atol=0.0):
                    why = "its PMF does not give its recorded deltas"
                else:
                    why = fingerprint_problem(model, adjacency, accountant, pld, rdp)
        if why is not None:
            _reject(path, why)
            return None
        rdp = np.array(profiles.model_rdp(model, adjacency, accountant=accountant), dtype=np.float64)
        rdp.flags.writeable = False
        return pld, rdp
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:  # corrupt
        _reject(path, f"it does not read ({type(e).__name__})")
        return None


def cached_profile(
    model: TrainingRecord | ApproxDP | profiles.PrivacyProfile,
    directory: str | os.PathLike,
    adjacency: str | None = None,
    *,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> profiles.PrivacyProfile:
    """``profiles.privacy_profile`` of ``model``, read from ``directory`` when a valid entry is
    there (else built and written there), and kept in memory for later ``privacy_profile`` calls.
    A ``PrivacyProfile`` passes through untouched."""
    if isinstance(model, profiles.PrivacyProfile):
        return profiles.privacy_profile(model, adjacency, accountant=accountant)
    adjacency = check_adjacency(profiles.model_adjacency(model) if adjacency is None else adjacency)
    known = profiles.remembered_profile(model, adjacency, accountant)
    if known is not None:
        # seen in this process (e.g. another pool trained with the same record): the entry is
        # still written beside this pool when it has none, so its own daemon finds it there
        if not (Path(directory) / f"{profile_key(model, adjacency, accountant)}.json").exists():
            with contextlib.suppress(OSError):
                save_entry(directory, model, adjacency, accountant, known.pld, known.rdp)
        return known
    stored = load_entry(directory, model, adjacency, accountant)
    if stored is None:
        profile = profiles.privacy_profile(model, adjacency, accountant=accountant)
        # a read-only site still serves; the next start builds the profile again
        with contextlib.suppress(OSError):
            save_entry(directory, model, adjacency, accountant, profile.pld, profile.rdp)
    else:
        profile = profiles.profile_from_pld(model, adjacency, accountant, *stored)
    profiles.remember_profile(model, adjacency, accountant, profile)
    return profile


def cached_profiles(
    models: Sequence,
    directory: str | os.PathLike,
    adjacency: str | None = None,
    *,
    accountant: Accountant = DEFAULT_ACCOUNTANT,
) -> list[profiles.PrivacyProfile]:
    """``cached_profile`` of each model under one adjacency (``profiles.resolve_adjacency``)."""
    adjacency = profiles.resolve_adjacency(models, adjacency)
    first: dict = {}
    for m in models:
        first.setdefault(m, m)
    built = profiles.parallel_map(
        lambda m: cached_profile(m, directory, adjacency, accountant=accountant),
        list(first),
    )
    got = dict(zip(first, built, strict=True))
    return [got[m] for m in models]


__all__ = [
    "CHECK_EPSILONS",
    "cached_profile",
    "cached_profiles",
    "fingerprint_problem",
    "load_entry",
    "profile_key",
    "save_entry",
]
