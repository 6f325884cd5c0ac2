"""Pairwise masking for secure aggregation among the sites of a run, with no coordinator.

Pure (no gRPC, no protobuf, no I/O): values in, values out; the daemons move the bytes. The
protocol for one (run, step, attempt) among sites S (sorted by name; i < j by that order):

1. **Ephemeral keys.** Each site makes a fresh X25519 key pair (``make_ephemeral``) and signs a
   statement binding its public key to the context — domain tag, run id, step, attempt, the
   sorted site list, the modulus bits, its own name — with its pinned identity key (ECDSA P-256
   / SHA-256, ``peer.net.identity``). A re-run after a dropout is a new attempt: new keys, new
   seeds, new masks.
2. **Verification.** A peer's signed key is accepted only if the peer is in the context's site
   list, is pinned (its certificate in the trust store, current or rotating-to), the
   certificate is valid now, the statement's context is this one, and the signature verifies
   (``verify_signed_key``); anything else is refused with PERMISSION_DENIED naming the site and
   the rule. No private value is in any message.
3. **Pairwise seeds.** s_ij = HKDF-SHA256(X25519(sk_i, pk_j), salt = SHA-256(context),
   info = ordered pair of names and both public keys), 32 bytes (RFC 5869 via ``cryptography``;
   the X25519 output is a shared group element, HKDF extracts a uniform key from it).
4. **Masks.** PRG(s) = the ChaCha20 keystream under key s (zero nonce: every key is used for
   one stream only), read as little-endian uint64 words, each reduced mod 2^b by keeping its low
   b bits — exact uniformity on Z_{2^b} for every b ≤ 64, since 2^b divides 2^64 (no rejection
   needed). Site i sends y_i = x_i + Σ_{j>i} PRG(s_ij) − Σ_{j<i} PRG(s_ji) mod 2^b
   (``masked_vector``; uint64 arithmetic wraps mod 2^64, then the low b bits are kept).
5. **Consistency.** Site i signs a digest of the exact y_i it sends (SHA-256 over the context,
   its name and the bytes, ``sign_masked``). Every receiver forwards the signed digest it got;
   two valid signatures by i over different digests for one context prove that i equivocated
   (``check_no_equivocation``), and the step is refused.
6. **Sum.** Σ_i y_i mod 2^b = Σ_i x_i mod 2^b: every mask appears once with + and once with −
   (``aggregate`` refuses a set that is not exactly the context's sites).

What it protects: to a coalition of up to t honest-but-curious sites, the honest sites' y_i are
uniform and independent given the coalition's own keys, except for their sum (each honest
pair's seed is unknown to the coalition), so their view is a function of their own inputs and
the revealed sum. It gives no integrity: a site can send any vector it likes (garbage in the
sum is not detected), only the *same* vector to everyone.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from peer.base.errors import FailedPrecondition, InvalidArgument, PermissionDenied
from peer.net.identity import (
    Identity,
    certificate_name,
    check_site_name,
    check_validity,
    load_certificate,
    verify_signature,
)

DOMAIN = "privfusion-secagg-v1"
SEED_BYTES = 32
PUBLIC_KEY_BYTES = 32
MAX_BITS = 64


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgument(name, f"must be an integer >= {low}, got {value!r}")
    if high is not None and value > high:
        raise InvalidArgument(name, f"must be an integer <= {high}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class MaskContext:
    """One (run, step, attempt) of secure aggregation: who takes part and the modulus 2^bits.

    ``sites`` are sorted and unique; they are the ones whose vectors the sum covers.
    """

    run_id: str
    step: int
    attempt: int
    sites: tuple[str, ...]
    bits: int

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id or len(self.run_id) > 256:
            raise InvalidArgument(
                "run_id", f"must be a non-empty string of at most 256 characters, got {self.run_id!r}"
            )
        object.__setattr__(self, "step", _check_int("step", self.step, 0))
        object.__setattr__(self, "attempt", _check_int("attempt", self.attempt, 0))
        object.__setattr__(self, "bits", _check_int("bits", self.bits, 1, MAX_BITS))
        names = tuple(self.sites)
        for n in names:
            check_site_name(n, "sites")
        if len(set(names)) != len(names):
            raise InvalidArgument("sites", f"must be unique, got {list(names)}")
        if len(names) < 2:
            raise InvalidArgument("sites", f"secure aggregation needs at least 2 sites, got {len(names)}")
        object.__setattr__(self, "sites", tuple(sorted(names)))

    def canonical(self) -> bytes:
        """Deterministic bytes of the context (what every signature and the HKDF salt bind)."""
        return json.dumps(
            {
                "domain": DOMAIN,
                "run_id": self.run_id,
                "step": self.step,
                "attempt": self.attempt,
                "sites": list(self.sites),
                "bits": self.bits,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()

    @property
    def mask(self) -> np.uint64:
        return np.uint64((1 << self.bits) - 1) if self.bits < 64 else np.uint64(0xFFFFFFFFFFFFFFFF)

    def check_member(self, site: str, field: str = "site") -> str:
        if site not in self.sites:
            raise PermissionDenied(
                f"{field}: {site!r} is not one of the sites of run {self.run_id!r} step {self.step} "
                f"attempt {self.attempt} ({', '.join(self.sites)})",
                reason="SECAGG_NOT_A_MEMBER",
                metadata={"site": site},
            )
        return site


@dataclass(frozen=True)
class SignedKey:
    """A site's ephemeral X25519 public key for one context, signed by its identity."""

    site: str
    context: MaskContext
    public_key: bytes
    signature: bytes

    def payload(self) -> bytes:
        return signed_key_payload(self.site, self.context, self.public_key)


def signed_key_payload(site: str, context: MaskContext, public_key: bytes) -> bytes:
    return b"%s|key|%s|%s|" % (DOMAIN.encode(), context.canonical(), site.encode()) + public_key


@dataclass(frozen=True)
class Ephemeral:
    """A site's ephemeral key pair for one context: the private half never leaves the site."""

    private_key: X25519PrivateKey
    signed: SignedKey


def make_ephemeral(identity: Identity, context: MaskContext) -> Ephemeral:
    """A fresh X25519 key pair for ``context`` and its public key signed by ``identity``."""
    context.check_member(identity.name, "identity")
    private = X25519PrivateKey.generate()
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    signature = identity.sign(signed_key_payload(identity.name, context, public))
    return Ephemeral(private, SignedKey(identity.name, context, public, signature))


def _pins(pinned: Mapping[str, bytes | Sequence[bytes]], site: str) -> list[bytes]:
    pems = pinned.get(site)
    if pems is None:
        return []
    return [pems] if isinstance(pems, bytes) else list(pems)


def _verified_by_pin(
    site: str, payload: bytes, signature: bytes, pinned: Mapping[str, bytes | Sequence[bytes]], what: str, now
) -> None:
    pems = _pins(pinned, site)
    if not pems:
        raise PermissionDenied(
            f"{what}: site {site!r} is not pinned; refusing its signed {what}",
            reason="SECAGG_UNPINNED",
            metadata={"site": site},
        )
    problems = []
    for pem in pems:
        cert = load_certificate(pem, f"pinned certificate of {site!r}")
        if certificate_name(cert) != site:
            problems.append("pinned certificate is for another name")
            continue
        try:
            check_validity(cert, f"pinned certificate of {site!r}", now)
            verify_signature(pem, payload, signature)
            return
        except (InvalidArgument, FailedPrecondition) as e:
            problems.append(str(e))
    raise PermissionDenied(
        f"{what}: the signature of {site!r} does not verify against its pinned certificate ({'; '.join(problems)})",
        reason="SECAGG_BAD_SIGNATURE",
        metadata={"site": site},
    )


def verify_signed_key(
    signed: SignedKey,
    context: MaskContext,
    pinned: Mapping[str, bytes | Sequence[bytes]],
    now: _dt.datetime | None = None,
) -> X25519PublicKey:
    """A peer's ephemeral public key, once proven to be its, for this context.

    ``pinned``: site name → its pinned certificate PEM(s) (current, and during a rotation the
    next one: ``TrustStore.pins_of``). Refuses (PERMISSION_DENIED) a site outside the context,
    an unpinned site, a statement for another context, and a signature that does not verify.
    """
    context.check_member(signed.site, "signed_key.site")
    if signed.context != context:
        raise PermissionDenied(
            f"signed_key: {signed.site!r} signed a key for another step or attempt "
            f"(run {signed.context.run_id!r} step {signed.context.step} attempt {signed.context.attempt}); "
            f"this is run {context.run_id!r} step {context.step} attempt {context.attempt}",
            reason="SECAGG_WRONG_CONTEXT",
            metadata={"site": signed.site},
        )
    if not isinstance(signed.public_key, bytes) or len(signed.public_key) != PUBLIC_KEY_BYTES:
        raise InvalidArgument("signed_key.public_key", f"must be {PUBLIC_KEY_BYTES} raw X25519 bytes")
    _verified_by_pin(signed.site, signed.payload(), signed.signature, pinned, "ephemeral key", now)
    return X25519PublicKey.from_public_bytes(signed.public_key)


def pair_seed(context: MaskContext, own: str, own_key: Ephemeral, other: str, other_public: X25519PublicKey) -> bytes:
    """s_{ij} for the unordered pair {own, other}: HKDF-SHA256 of the X25519 shared secret,
    salted with the context's hash, bound to the ordered names and both public keys."""
    context.check_member(own, "own")
    context.check_member(other, "other")
    if own == other:
        raise InvalidArgument("other", "a site has no seed with itself")
    shared = own_key.private_key.exchange(other_public)
    own_pk = own_key.signed.public_key
    other_pk = other_public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    (lo, lo_pk), (hi, hi_pk) = sorted([(own, own_pk), (other, other_pk)])
    info = b"%s|pair|%s|%s|" % (DOMAIN.encode(), lo.encode(), hi.encode()) + lo_pk + hi_pk
    return HKDF(
        algorithm=hashes.SHA256(), length=SEED_BYTES, salt=hashlib.sha256(context.canonical()).digest(), info=info
    ).derive(shared)


def pairwise_seeds(
    context: MaskContext, own: str, own_key: Ephemeral, peers: Mapping[str, X25519PublicKey]
) -> dict[str, bytes]:
    """Seeds with every other site of the context (``peers``: their verified public keys)."""
    others = [s for s in context.sites if s != own]
    missing = sorted(set(others) - set(peers))
    extra = sorted(set(peers) - set(others))
    if missing or extra:
        raise FailedPrecondition(
            f"pairwise seeds need exactly the other sites' keys: missing {missing}, unexpected {extra}"
        )
    return {s: pair_seed(context, own, own_key, s, peers[s]) for s in others}


def prg_mask(seed: bytes, length: int, bits: int) -> np.ndarray:
    """PRG(seed): ``length`` uniform residues mod 2^bits (uint64) from the ChaCha20 keystream."""
    if not isinstance(seed, bytes) or len(seed) != SEED_BYTES:
        raise InvalidArgument("seed", f"must be {SEED_BYTES} bytes")
    n = _check_int("length", length, 0)
    b = _check_int("bits", bits, 1, MAX_BITS)
    encryptor = Cipher(algorithms.ChaCha20(seed, b"\x00" * 16), mode=None).encryptor()
    words = np.frombuffer(encryptor.update(bytes(8 * n)), dtype="<u8").astype(np.uint64)
    if b < 64:
        words &= np.uint64((1 << b) - 1)
    return words


def _check_vector(x: np.ndarray, context: MaskContext, field: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.dtype != np.uint64:
        raise InvalidArgument(field, f"must be a 1-D uint64 vector of residues, got {arr.dtype} {arr.shape}")
    if context.bits < 64 and np.any(arr > context.mask):
        raise InvalidArgument(field, f"must hold residues mod 2^{context.bits} (values < 2^{context.bits})")
    return arr


def masked_vector(x: np.ndarray, context: MaskContext, own: str, seeds: Mapping[str, bytes]) -> np.ndarray:
    """y = x + Σ_{j>own} PRG(s) − Σ_{j<own} PRG(s) mod 2^bits (sites ordered by name)."""
    context.check_member(own, "own")
    x = _check_vector(x, context, "x")
    others = [s for s in context.sites if s != own]
    if sorted(seeds) != others:
        raise FailedPrecondition(f"masking needs a seed with every other site ({others}), got {sorted(seeds)}")
    y = x.copy()
    for other in others:
        m = prg_mask(seeds[other], x.size, context.bits)
        if own < other:
            y += m
        else:
            y -= m
    if context.bits < 64:
        y &= context.mask
    return y


@dataclass(frozen=True)
class SignedDigest:
    """Site ``site``'s signature over the SHA-256 digest of the masked vector it sent."""

    site: str
    context: MaskContext
    digest: bytes
    signature: bytes

    def payload(self) -> bytes:
        return digest_payload(self.site, self.context, self.digest)


@dataclass(frozen=True)
class MaskedShare:
    """What a site sends every peer in one context: its masked vector ``y``, its ``signed``
    digest, and ``release_id``, the ledger charge of this step at the sender (public)."""

    y: np.ndarray
    signed: SignedDigest
    release_id: str


def digest_payload(site: str, context: MaskContext, digest: bytes) -> bytes:
    return b"%s|vector|%s|%s|" % (DOMAIN.encode(), context.canonical(), site.encode()) + digest


def vector_digest(y: np.ndarray, context: MaskContext, site: str) -> bytes:
    """SHA-256 over the context, the sender and the vector's little-endian bytes."""
    y = _check_vector(y, context, "y")
    h = hashlib.sha256()
    h.update(context.canonical())
    h.update(site.encode() + b"|")
    h.update(np.ascontiguousarray(y, dtype="<u8").tobytes())
    return h.digest()


def sign_masked(identity: Identity, context: MaskContext, y: np.ndarray) -> SignedDigest:
    """The signed digest that goes with the masked vector ``y`` to every peer."""
    context.check_member(identity.name, "identity")
    digest = vector_digest(y, context, identity.name)
    return SignedDigest(identity.name, context, digest, identity.sign(digest_payload(identity.name, context, digest)))


def verify_masked(
    y: np.ndarray,
    signed: SignedDigest,
    context: MaskContext,
    pinned: Mapping[str, bytes | Sequence[bytes]],
    now: _dt.datetime | None = None,
) -> None:
    """Check that ``y`` is the vector ``signed.site`` signed for this context."""
    context.check_member(signed.site, "signed_digest.site")
    if signed.context != context:
        raise PermissionDenied(
            f"signed_digest: {signed.site!r} signed a vector of another step or attempt",
            reason="SECAGG_WRONG_CONTEXT",
            metadata={"site": signed.site},
        )
    _verified_by_pin(signed.site, signed.payload(), signed.signature, pinned, "masked vector digest", now)
    if vector_digest(y, context, signed.site) != signed.digest:
        raise PermissionDenied(
            f"masked vector: what {signed.site!r} sent does not match the digest it signed",
            reason="SECAGG_DIGEST_MISMATCH",
            metadata={"site": signed.site},
        )


def check_no_equivocation(
    reports: Iterable[SignedDigest],
    context: MaskContext,
    pinned: Mapping[str, bytes | Sequence[bytes]],
    now: _dt.datetime | None = None,
) -> dict[str, bytes]:
    """Compare the signed digests every receiver got: one digest per sender, or refuse.

    ``reports``: the signed digests forwarded by all receivers (each verified here; a report
    whose signature fails is refused as forged, so a receiver cannot frame a sender). Two valid
    signatures by one site over different digests prove it sent different vectors to different
    peers: PERMISSION_DENIED naming it (reason SECAGG_EQUIVOCATION). Returns site → digest.
    """
    seen: dict[str, bytes] = {}
    for r in reports:
        context.check_member(r.site, "report.site")
        if r.context != context:
            raise PermissionDenied(
                f"report: a digest of {r.site!r} for another step or attempt was forwarded",
                reason="SECAGG_WRONG_CONTEXT",
                metadata={"site": r.site},
            )
        _verified_by_pin(r.site, r.payload(), r.signature, pinned, "masked vector digest", now)
        prior = seen.setdefault(r.site, r.digest)
        if prior != r.digest:
            raise PermissionDenied(
                f"site {r.site!r} sent different masked vectors to different peers in run {context.run_id!r} "
                f"step {context.step} attempt {context.attempt} (two digests, both signed by it): step refused",
                reason="SECAGG_EQUIVOCATION",
                metadata={"site": r.site},
            )
    return seen


def aggregate(vectors: Mapping[str, np.ndarray], context: MaskContext) -> np.ndarray:
    """Σ y_i mod 2^bits over exactly the context's sites: the masks cancel, the sum of the x_i
    remains. Refuses a missing or extra site (a partial sum is still masked)."""
    missing = sorted(set(context.sites) - set(vectors))
    extra = sorted(set(vectors) - set(context.sites))
    if missing or extra:
        raise FailedPrecondition(
            f"the sum needs every site's masked vector: missing {missing}, unexpected {extra} "
            "(a site that dropped: abort the attempt and re-run among the rest)"
        )
    arrays = [_check_vector(vectors[s], context, f"vectors[{s!r}]") for s in context.sites]
    if len({a.size for a in arrays}) != 1:
        raise InvalidArgument("vectors", f"must all have one length, got {[a.size for a in arrays]}")
    total = arrays[0].copy()
    for a in arrays[1:]:
        total += a
    if context.bits < 64:
        total &= context.mask
    return total


def pinned_certificates(trust, sites: Iterable[str]) -> dict[str, list[bytes]]:
    """site → its pinned certificate PEMs from a ``peer.net.trust.TrustStore`` (current first,
    then the one it is rotating to); unpinned sites are left out (and refused on use)."""
    return {s: [p.cert_pem for p in trust.pins_of(s)] for s in sites if trust.pins_of(s)}


__all__ = [
    "DOMAIN",
    "Ephemeral",
    "MaskContext",
    "MaskedShare",
    "SignedDigest",
    "SignedKey",
    "aggregate",
    "check_no_equivocation",
    "make_ephemeral",
    "masked_vector",
    "pair_seed",
    "pairwise_seeds",
    "pinned_certificates",
    "prg_mask",
    "sign_masked",
    "vector_digest",
    "verify_masked",
    "verify_signed_key",
]
