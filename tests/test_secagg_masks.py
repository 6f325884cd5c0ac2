"""Pairwise masking (peer.net.secagg): masks cancel bit-exactly, a masked vector is uniform, a
coalition's view depends on the honest sites' inputs only through their sum, signed ephemeral
keys and digests are checked against pinned certificates, equivocation is caught."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats
from secagg_helpers import expired_identity, identities, make_identity, pins

from peer.base.errors import FailedPrecondition, PermissionDenied
from peer.net.secagg import (
    Ephemeral,
    MaskContext,
    SignedKey,
    aggregate,
    check_no_equivocation,
    make_ephemeral,
    masked_vector,
    pair_seed,
    pairwise_seeds,
    prg_mask,
    sign_masked,
    signed_key_payload,
    verify_masked,
    verify_signed_key,
)


def run_protocol(ids, xs, bits, attempt=0):
    """Every step of one attempt among ``ids`` with inputs ``xs``: returns (context, masked, sum)."""
    ctx = MaskContext("run-1", 3, attempt, tuple(i.name for i in ids), bits)
    pinned = pins(ids)
    eph = {i.name: make_ephemeral(i, ctx) for i in ids}
    masked = {}
    for i in ids:
        peers = {o.name: verify_signed_key(eph[o.name].signed, ctx, pinned) for o in ids if o.name != i.name}
        seeds = pairwise_seeds(ctx, i.name, eph[i.name], peers)
        masked[i.name] = masked_vector(xs[i.name], ctx, i.name, seeds)
    return ctx, masked, aggregate(masked, ctx)


@settings(max_examples=25, deadline=None)
@given(
    k=st.integers(2, 12),
    bits=st.sampled_from([1, 3, 8, 20, 31, 32, 33, 63, 64]),
    dim=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_masks_cancel_bit_exactly(k, bits, dim, seed):
    rng = np.random.default_rng(seed)
    ids = identities(12)[:k]
    xs = {i.name: rng.integers(0, 2**bits, size=dim, dtype=np.uint64, endpoint=False) for i in ids}
    _, masked, total = run_protocol(ids, xs, bits)
    exact = [sum(int(x[j]) for x in xs.values()) % (1 << bits) for j in range(dim)]
    assert total.tolist() == exact
    if dim >= 8 and bits >= 8:
        # a masked vector is not its input (the masks are really there)
        assert any(not np.array_equal(masked[n], xs[n]) for n in masked)


@pytest.mark.parametrize("bits", [3, 4, 32, 64])
def test_a_masked_vector_is_uniform_mod_2_to_the_b(bits):
    """χ² goodness of fit of one masked vector's residues (16 cells: the value for b ≤ 4, else its
    top 4 and its bottom 4 bits, each tested). Seeds are fixed bytes, so the test is
    deterministic; over the choice of seed, each χ² test fails with probability 1e-4 when the
    masks are uniform (the 1 − 1e-4 quantile of χ²(cells − 1)), at most 2e-4 per case."""
    rng = np.random.default_rng(2026)
    seeds = [rng.bytes(32) for _ in range(3)]
    ids = identities(4)
    ctx = MaskContext("run-u", 0, 0, tuple(i.name for i in ids), bits)
    own = ctx.sites[1]  # has a seed with a lower and with higher sites: both signs are used
    x = (np.arange(40_000, dtype=np.uint64) * np.uint64(7)) & ctx.mask  # a structured input
    y = masked_vector(x, ctx, own, {s: seeds[j] for j, s in enumerate(n for n in ctx.sites if n != own)})
    views = [y] if bits <= 4 else [y >> np.uint64(bits - 4), y & np.uint64(15)]
    for v in views:
        cells = 1 << min(bits, 4)
        counts = np.bincount(v.astype(np.int64), minlength=cells)
        chi2 = ((counts - y.size / cells) ** 2 / (y.size / cells)).sum()
        assert chi2 < stats.chi2.ppf(1 - 1e-4, cells - 1), (bits, counts)


def test_prg_is_deterministic_per_seed_and_differs_between_seeds():
    a, b = b"\x01" * 32, b"\x02" * 32
    assert np.array_equal(prg_mask(a, 100, 64), prg_mask(a, 100, 64))
    assert not np.array_equal(prg_mask(a, 100, 64), prg_mask(b, 100, 64))
    # fewer bits keep the low bits of the same words; a longer stream extends a shorter one
    assert np.array_equal(prg_mask(a, 100, 12), prg_mask(a, 100, 64) & np.uint64(4095))
    assert np.array_equal(prg_mask(a, 150, 64)[:100], prg_mask(a, 100, 64))


def _fixed_ephemeral(identity, ctx, raw: bytes) -> Ephemeral:
    private = X25519PrivateKey.from_private_bytes(raw)
    public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return Ephemeral(private, SignedKey(identity.name, ctx, public, b""))


def test_a_coalitions_view_depends_on_the_honest_inputs_only_through_their_sum():
    """k = 4 sites, a coalition of t = 2 (site-00, site-03) and two honest sites. The coalition
    sees its own keys and inputs, every public key, every masked vector and the sum. From its own
    seeds it can strip its masks off the honest vectors, leaving u = x_h1 ± m, x_h2 ∓ m with m the
    honest pair's mask. Two worlds with the same honest total but split differently must give
    that view the same distribution, and a simulator that knows only the honest total (u₁ uniform,
    u₂ = total − u₁) reproduces it. Key material comes from a fixed-seed generator (so the test is
    deterministic). Over the seed, each of the three χ² tests (b = 2, d = 2: 16 cells, 1500 runs per
    world) fails with probability 1e-3 when the claim holds: at most 3e-3 in all."""
    bits, runs = 2, 1500
    ids = identities(4)
    names = [i.name for i in ids]
    coalition, honest = [names[0], names[3]], [names[1], names[2]]
    worlds = {
        "a": {names[1]: np.array([0, 3], np.uint64), names[2]: np.array([3, 1], np.uint64)},
        "b": {names[1]: np.array([2, 1], np.uint64), names[2]: np.array([1, 3], np.uint64)},
    }
    coalition_inputs = {names[0]: np.array([1, 2], np.uint64), names[3]: np.array([3, 3], np.uint64)}
    honest_total = (worlds["a"][names[1]] + worlds["a"][names[2]]) & np.uint64(3)
    assert np.array_equal(honest_total, (worlds["b"][names[1]] + worlds["b"][names[2]]) & np.uint64(3))
    rng = np.random.default_rng(77)
    observed = {}
    for world, honest_inputs in worlds.items():
        xs = {**coalition_inputs, **honest_inputs}
        cells = []
        for r in range(runs):
            ctx = MaskContext("run-c", 0, r, tuple(names), bits)
            eph = {i.name: _fixed_ephemeral(i, ctx, rng.bytes(32)) for i in ids}
            public = {n: eph[n].private_key.public_key() for n in names}
            ys = {}
            for n in names:
                seeds = {o: pair_seed(ctx, n, eph[n], o, public[o]) for o in names if o != n}
                ys[n] = masked_vector(xs[n], ctx, n, seeds)
            total = aggregate(ys, ctx)
            assert np.array_equal(total, sum(xs.values()) & np.uint64(3))
            # the coalition strips its own masks off the first honest vector
            u1 = ys[honest[0]].copy()
            for c in coalition:
                m = prg_mask(pair_seed(ctx, c, eph[c], honest[0], public[honest[0]]), 2, bits)
                u1 = (u1 - m if honest[0] < c else u1 + m) & np.uint64(3)
            cells.append(int(u1[0]) * 4 + int(u1[1]))
        observed[world] = np.bincount(cells, minlength=16)
    table = np.vstack([observed["a"], observed["b"]])
    _, p_same, _, _ = stats.chi2_contingency(table)
    assert p_same > 1e-3, table
    # the simulator's u₁ is uniform: each world's view matches it
    for world in worlds:
        assert stats.chisquare(observed[world]).pvalue > 1e-3, observed[world]


def test_fresh_keys_and_masks_per_attempt():
    ids = identities(3)
    xs = {i.name: np.zeros(16, np.uint64) for i in ids}
    _, masked0, total0 = run_protocol(ids, xs, 32, attempt=0)
    _, masked1, total1 = run_protocol(ids, xs, 32, attempt=1)
    assert np.array_equal(total0, total1)
    assert all(not np.array_equal(masked0[n], masked1[n]) for n in masked0)


def test_a_rerun_after_a_dropout_uses_the_rest_and_refuses_the_first_attempts_vectors():
    ids = identities(4)
    rng = np.random.default_rng(3)
    xs = {i.name: rng.integers(0, 2**32, size=10, dtype=np.uint64) for i in ids}
    first, masked0, _ = run_protocol(ids, xs, 32, attempt=0)
    rest = ids[:3]  # the fourth site dropped: attempt 1 among the rest, fresh keys
    second, _, total1 = run_protocol(rest, xs, 32, attempt=1)
    assert total1.tolist() == [sum(int(xs[i.name][j]) for i in rest) % 2**32 for j in range(10)]
    with pytest.raises(FailedPrecondition, match="missing"):
        aggregate({n: masked0[n] for n in second.sites[:2]}, second)
    old = sign_masked(rest[0], first, masked0[rest[0].name])
    with pytest.raises(PermissionDenied, match="another step or attempt"):
        verify_masked(masked0[rest[0].name], old, second, pins(rest))


def test_an_unpinned_or_mis_signed_ephemeral_key_is_refused():
    ids = identities(3)
    ctx = MaskContext("run-k", 1, 0, tuple(i.name for i in ids), 32)
    pinned = pins(ids)
    good = make_ephemeral(ids[1], ctx).signed
    assert verify_signed_key(good, ctx, pinned)

    with pytest.raises(PermissionDenied, match="not pinned") as e:
        verify_signed_key(good, ctx, {n: p for n, p in pinned.items() if n != ids[1].name})
    assert e.value.reason == "SECAGG_UNPINNED" and e.value.metadata["site"] == ids[1].name

    impostor = make_identity(ids[1].name)  # same name, a key nobody pinned
    forged = make_ephemeral(impostor, ctx).signed
    with pytest.raises(PermissionDenied, match="does not verify") as e:
        verify_signed_key(forged, ctx, pinned)
    assert e.value.reason == "SECAGG_BAD_SIGNATURE"

    swapped = SignedKey(good.site, ctx, make_ephemeral(ids[1], ctx).signed.public_key, good.signature)
    with pytest.raises(PermissionDenied, match="does not verify"):
        verify_signed_key(swapped, ctx, pinned)

    replay = MaskContext("run-k", 1, 1, ctx.sites, 32)
    with pytest.raises(PermissionDenied, match="another step or attempt") as e:
        verify_signed_key(good, replay, pinned)
    assert e.value.reason == "SECAGG_WRONG_CONTEXT"

    outsider = make_identity("site-99")
    ctx_out = MaskContext("run-k", 1, 0, (*ctx.sites, "site-99"), 32)
    with pytest.raises(PermissionDenied, match="not one of the sites") as e:
        verify_signed_key(make_ephemeral(outsider, ctx_out).signed, ctx, {**pinned, "site-99": outsider.cert_pem})
    assert e.value.reason == "SECAGG_NOT_A_MEMBER"


def test_an_expired_pin_does_not_verify_and_a_rotating_pin_does():
    old = expired_identity("site-00")
    other = identities(2)[1]
    ctx = MaskContext("run-r", 0, 0, ("site-00", other.name), 16)
    signed = make_ephemeral(old, ctx).signed
    with pytest.raises(PermissionDenied, match="expired"):
        verify_signed_key(signed, ctx, {"site-00": old.cert_pem})
    new = make_identity("site-00")
    rotating = {"site-00": [old.cert_pem, new.cert_pem]}  # TrustStore.pins_of during a rotation
    assert verify_signed_key(make_ephemeral(new, ctx).signed, ctx, rotating)


def test_equivocation_is_detected_and_a_forged_report_refused():
    ids = identities(3)
    ctx = MaskContext("run-e", 5, 0, tuple(i.name for i in ids), 32)
    pinned = pins(ids)
    a = ids[0]
    y1 = np.arange(8, dtype=np.uint64)
    y2 = y1.copy()
    y2[3] += np.uint64(1)
    to_b, to_c = sign_masked(a, ctx, y1), sign_masked(a, ctx, y2)
    verify_masked(y1, to_b, ctx, pinned)
    verify_masked(y2, to_c, ctx, pinned)
    honest_b = sign_masked(ids[1], ctx, y1)
    assert check_no_equivocation([to_b, to_b, honest_b], ctx, pinned) == {
        a.name: to_b.digest,
        ids[1].name: honest_b.digest,
    }
    with pytest.raises(PermissionDenied, match="different masked vectors") as e:
        check_no_equivocation([to_b, honest_b, to_c], ctx, pinned)
    assert e.value.reason == "SECAGG_EQUIVOCATION" and e.value.metadata["site"] == a.name
    # a receiver cannot frame a sender: a digest it made up carries no valid signature of the sender
    framed = type(to_c)(a.name, ctx, b"\x00" * 32, to_c.signature)
    with pytest.raises(PermissionDenied, match="does not verify"):
        check_no_equivocation([to_b, framed], ctx, pinned)
    with pytest.raises(PermissionDenied, match="does not match the digest") as e:
        verify_masked(y2, to_b, ctx, pinned)
    assert e.value.reason == "SECAGG_DIGEST_MISMATCH"


def test_the_sum_needs_every_site_and_the_key_statement_binds_everything():
    ids = identities(3)
    ctx = MaskContext("run-s", 0, 0, tuple(i.name for i in ids), 8)
    xs = {i.name: np.ones(4, np.uint64) for i in ids}
    _, masked, _ = run_protocol(ids, xs, 8)
    partial = {n: masked[n] for n in list(masked)[:2]}
    with pytest.raises(FailedPrecondition, match="missing"):
        aggregate(partial, MaskContext("run-1", 3, 0, ctx.sites, 8))
    # the signed statement names the run, step, attempt, sites, bits and site
    payload = signed_key_payload(ids[0].name, ctx, b"k" * 32)
    for part in (b"run-s", b'"step":0', b'"attempt":0', b'"bits":8', ids[2].name.encode()):
        assert part in payload
