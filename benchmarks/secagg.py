"""Secure aggregation's core, per site and per step, for a 1M-entry vector at k = 4 and k = 12.

    .venv/bin/python benchmarks/secagg.py                    # d = 1,000,000, k = 4 and 12, 3 rounds
    .venv/bin/python benchmarks/secagg.py --dim 100000 --sites 4 --rounds 1

What one site does in one step (all in this process, the real code of ``peer.dp.distributed``
and ``peer.net.secagg``; no daemons, no network — the wire time is the transfer benchmark's):

- **encode** a batch of --batch records, in the two ways the encoding offers
  (docs/secure_aggregation.md): *per-record* (clip, rotate by random signs + Walsh–Hadamard with d
  padded to 2^20, scale, conditional randomized rounding, each record; β = e^{−1/2}, γC = 4096) and
  *summed* (clip each record, sum, rotate, scale and round once, unconditionally; β = 0,
  γC = 65536, which keeps the sensitivity within 1.6% of γC);
- **noise**: the site's Skellam share;
- **keys**: one ephemeral X25519 key pair signed by the site's ECDSA identity, k − 1 peers' signed
  keys verified against their pinned certificates, k − 1 pairwise seeds (X25519 + HKDF);
- **mask**: k − 1 ChaCha20 mask streams of d′ uint64 words, added or subtracted mod 2^b;
- **digest**: SHA-256 of the masked vector and its ECDSA signature;
- **sum**: the k masked vectors added mod 2^b (what every site computes from what it received);
- **decode**: centred lift, ÷γ, inverse rotation.

Floors of this machine, for scale: one numpy addition of two d′-word uint64 vectors, one
ChaCha20 keystream of d′ words, one Walsh–Hadamard transform of length d′, one SHA-256 of the
vector. Bytes per site: what it sends, (k − 1) × (the masked vector at 4 bytes per residue when
b ≤ 32, else 8) + its signed key and signed digest per peer; beside it, the same vector as
float32 (what plain P2P sends, per peer). The parameters are a realistic step: C = 1,
γC = 4096, ε = 4 at δ = 1e-5 over 200 steps at q = 0.05, t = 1, b the least for an overflow
probability ≤ 1e-9 with 4096 records per step.

Results: a table on stdout and benchmarks/results/secagg.json. Medians over --rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms  # noqa: E402

from peer.dp.distributed.encoding import (  # noqa: E402
    Encoding,
    decode_sum,
    encode_records,
    encode_sum,
    fwht,
    smallest_bits,
    to_modular,
)
from peer.dp.distributed.skellam import calibrate_share, skellam_share  # noqa: E402
from peer.net.identity import Identity, make_certificate  # noqa: E402
from peer.net.secagg import (  # noqa: E402
    MaskContext,
    aggregate,
    make_ephemeral,
    masked_vector,
    pairwise_seeds,
    sign_masked,
    verify_signed_key,
)


def identity(name: str) -> Identity:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return Identity(name, Path("/nonexistent"), pem, make_certificate(name, key))


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def one_round(
    dim: int, k: int, enc: Encoding, share_variance: float, rng: np.random.Generator, ids, batch: int
) -> dict:
    names = [i.name for i in ids]
    pinned = {i.name: i.cert_pem for i in ids}
    ctx = MaskContext("bench", 0, 0, tuple(names), enc.bits)
    records = rng.normal(size=(batch, dim))
    me = names[0]
    t = {}
    encode = encode_sum if enc.beta == 0 else encode_records
    integer, t["encode"] = timed(lambda: encode(records, enc, rng))
    noise, t["noise"] = timed(lambda: skellam_share(share_variance, enc.padded_dim, rng))
    x, t["to_modular"] = timed(lambda: to_modular(integer + noise, enc.bits))
    eph = {i.name: make_ephemeral(i, ctx) for i in ids}  # the peers' (not timed: their work)

    def keys():
        mine = make_ephemeral(ids[0], ctx)
        peers = {o: verify_signed_key(eph[o].signed, ctx, pinned) for o in names[1:]}
        return mine, pairwise_seeds(ctx, me, mine, peers)

    (mine, seeds), t["keys"] = timed(keys)
    y, t["mask"] = timed(lambda: masked_vector(x, ctx, me, seeds))
    _, t["digest"] = timed(lambda: sign_masked(ids[0], ctx, y))
    # the other sites' masked vectors: any residues do for timing the sum
    received = {n: to_modular(rng.integers(0, 1 << 20, size=enc.padded_dim), enc.bits) for n in names[1:]}
    total, t["sum"] = timed(lambda: aggregate({me: y, **received}, ctx))
    _, t["decode"] = timed(lambda: decode_sum(total, enc))
    t["total"] = sum(t.values())
    residue = 4 if enc.bits <= 32 else 8
    signed_key = 32 + len(mine.signed.signature) + len(ctx.canonical())
    return {
        "seconds": t,
        "bytes_sent": (k - 1) * (enc.padded_dim * residue + signed_key + 32 + 72),
        "bytes_plain_float32": (k - 1) * dim * 4,
    }


def floors(n: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    a = rng.integers(0, 1 << 62, size=n, dtype=np.uint64)
    b = rng.integers(0, 1 << 62, size=n, dtype=np.uint64)
    key = bytes(32)
    out = {}
    for name, fn in (
        ("numpy_add", lambda: a + b),
        (
            "chacha20_keystream",
            lambda: Cipher(algorithms.ChaCha20(key, bytes(16)), None).encryptor().update(bytes(8 * n)),
        ),
        ("walsh_hadamard", lambda: fwht(a[None, :].astype(np.float64))),
        ("sha256", lambda: hashlib.sha256(a.tobytes()).digest()),
    ):
        out[name] = statistics.median(timed(fn)[1] for _ in range(rounds))
    out["chacha20_mb_per_s"] = 8 * n / out["chacha20_keystream"] / 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dim", type=int, default=1_000_000)
    ap.add_argument("--sites", type=int, nargs="+", default=[4, 12])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="records encoded per site and step")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(1)
    modes = {
        "per-record": Encoding(dim=args.dim, clip_norm=1.0, scale=4096.0, bits=64, rotation_seed=12345),
        "summed": Encoding(dim=args.dim, clip_norm=1.0, scale=65536.0, bits=64, beta=0.0, rotation_seed=12345),
    }
    base = modes["summed"]
    results = {
        "dim": args.dim,
        "batch": args.batch,
        "padded_dim": base.padded_dim,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        "floors_s": floors(base.padded_dim, args.rounds),
        "sites": {},
    }
    all_ids = [identity(f"site-{i:02d}") for i in range(max(args.sites))]
    for k, (mode, base) in [(k, m) for k in args.sites for m in modes.items()]:
        cal = calibrate_share(4.0, 1e-5, k, 1, base.l1_sensitivity, base.l2_sensitivity, sample_rate=0.05, steps=200)
        bits = smallest_bits(base, max_records=4096, noise_variance=k * cal.share_variance, target=1e-9)
        enc = Encoding(args.dim, base.clip_norm, base.scale, bits, base.beta, base.rotation_seed)
        runs = [
            one_round(args.dim, k, enc, cal.share_variance, rng, all_ids[:k], args.batch) for _ in range(args.rounds)
        ]
        med = {key: statistics.median(r["seconds"][key] for r in runs) for key in runs[0]["seconds"]}
        results["sites"][f"{k} {mode}"] = {
            "sites": k,
            "mode": mode,
            "sensitivity_over_clip": enc.l2_sensitivity / (enc.scale * enc.clip_norm),
            "bits": bits,
            "share_variance": cal.share_variance,
            "noise_std_over_sensitivity": (cal.total_variance**0.5) / enc.l2_sensitivity,
            "seconds": med,
            "bytes_sent": runs[0]["bytes_sent"],
            "bytes_plain_float32": runs[0]["bytes_plain_float32"],
        }
    f = results["floors_s"]
    print(
        f"d = {args.dim:,} (padded {base.padded_dim:,}); floors: add {f['numpy_add'] * 1e3:.1f} ms, "
        f"ChaCha20 {f['chacha20_keystream'] * 1e3:.1f} ms ({f['chacha20_mb_per_s']:.0f} MB/s), "
        f"Walsh–Hadamard {f['walsh_hadamard'] * 1e3:.1f} ms, SHA-256 {f['sha256'] * 1e3:.1f} ms"
    )
    keys = list(next(iter(results["sites"].values()))["seconds"])
    print(f"batch of {args.batch} records per site; times per site and step")
    head = f"{'k':>3} {'mode':>10} {'b':>3} " + " ".join(f"{key:>10}" for key in keys)
    print(head + f" {'MB sent':>9} {'MB f32':>8}")
    for r in results["sites"].values():
        row = " ".join(f"{r['seconds'][key] * 1e3:>8.1f}ms" for key in keys)
        mb, f32 = r["bytes_sent"] / 1e6, r["bytes_plain_float32"] / 1e6
        print(f"{r['sites']:>3} {r['mode']:>10} {r['bits']:>3} {row} {mb:>9.1f} {f32:>8.1f}")
    out = ROOT / "benchmarks" / "results" / "secagg.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
