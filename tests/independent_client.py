"""A privfusion.v1 client written from the .proto files and docs/wire.md alone.

Run by tests/test_independent_client.py in its own process, whose import path holds nothing of
the project: the stubs are generated here by protoc (grpcio-tools) from proto/privfusion/v1/*.proto,
signatures are checked with ``cryptography``, tensors are reassembled with ``numpy``. It asks a
real daemon for a features, a weights and a merged release over mutual TLS, reassembles every
tensor from its frames (docs/wire.md sections 2, 4, 5), then verifies each release *offline* from
what it kept (receipt, manifest, tensor bytes) and the pinned certificate (section 6), and
writes what it found as JSON.

    python independent_client.py CONFIG.json OUT.json

It is also an auditor of a site's ledger (section 9): it reads the SQLite file with the
standard library's ``sqlite3``, recomputes every hash chain (charges from the genesis,
cancellations, served-again rows, events) with encodings written here from the text, checks the
anchor file and the totals cache, and writes the heads it found.

    python independent_client.py --audit-ledger LEDGER OUT.json
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
import sys
from itertools import pairwise
from pathlib import Path

PROJECT_MODULES = ("peer", "coordinator_free", "scenarios")


def generate_stubs(proto_root: Path, out: Path) -> None:
    """protoc over the contract's .proto files into ``out`` (docs: generated, never copied)."""
    import grpc_tools
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    files = sorted(str(p.relative_to(proto_root)) for p in (proto_root / "privfusion" / "v1").glob("*.proto"))
    rc = protoc.main(
        [
            "protoc",
            f"-I{proto_root}",
            f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            *files,
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed: {rc}")
    for d in (out / "privfusion", out / "privfusion" / "v1"):
        (d / "__init__.py").touch()
    sys.path.insert(0, str(out))


# ------------------------------------------------------------------ docs/wire.md section 6


def u32(n: int) -> bytes:
    return struct.pack(">I", n)


def u64(n: int) -> bytes:
    return struct.pack(">Q", n)


def blob(b: bytes) -> bytes:
    return u32(len(b)) + bytes(b)


def text(s: str) -> bytes:
    return blob(s.encode("utf-8"))


def digest32(b: bytes) -> bytes:
    if len(b) != 32:
        raise ValueError(f"a digest must be 32 bytes, got {len(b)}")
    return blob(b)


def receipt_payload(r) -> bytes:
    # docs/wire.md 6.3: a release served again is signed under its own context, with its two
    # fields after the fresh layout's; a receipt with the ledger's position (ledger_seq and
    # ledger_head, both or neither) under the "/3" (served again: "/2") context, with the two last
    positioned = bool(r.ledger_seq) or bool(r.ledger_head)
    if positioned and not (r.ledger_seq >= 1 and len(r.ledger_head) == 32):
        raise ValueError("receipt.ledger_seq/ledger_head: set together, a 32-byte head")
    if r.served_again:
        context = b"privfusion.v1/receipt-served-again/2\n" if positioned else b"privfusion.v1/receipt-served-again/1\n"
    else:
        context = b"privfusion.v1/receipt/3\n" if positioned else b"privfusion.v1/receipt/2\n"
    out = context + text(r.signer) + text(r.ledger_entry_id) + blob(r.record_json) + u32(len(r.tensors))
    for t in r.tensors:
        out += text(t.name) + digest32(t.sha256)
    out += digest32(r.manifest_sha256)
    if r.served_again:
        out += text(r.served_again) + text(r.served_to)
    if positioned:
        out += u64(r.ledger_seq) + digest32(r.ledger_head)
    return out


def manifest_bytes(m) -> bytes:
    out = (
        b"privfusion.v1/manifest/2\n"
        + text(m.kind)
        + text(m.model)
        + text(m.architecture_json)
        + text(m.metadata_json)
        + u32(len(m.tensors))
    )
    for t in m.tensors:
        out += text(t.name) + u32(t.dtype) + u32(len(t.shape)) + b"".join(u64(d) for d in t.shape)
        out += u64(t.nbytes) + digest32(t.sha256)
    out += u64(m.total_bytes) + u32(len(m.upstream))
    return out + b"".join(digest32(hashlib.sha256(receipt_payload(u)).digest()) for u in m.upstream)


def release_sha256(manifest) -> str:
    """``parameters.release_sha256`` of a stored release (section 6.4), from its signed manifest."""
    h = hashlib.sha256(b"privfusion.v1/stored-release/1\n")
    for t in manifest.tensors:
        h.update(t.name.encode("utf-8") + b"\0" + t.sha256)
    return h.hexdigest()


def verify_offline(receipt, manifest, tensors: dict[str, bytes], cert_pem: bytes, signer: str, me: str) -> dict:
    """Everything section 4 and 6 ask of a release, from kept bytes and the pinned certificate."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    if receipt.signer != signer or receipt.signature_algorithm != "ecdsa-p256-sha256":
        raise ValueError("receipt: wrong signer or algorithm")
    key = x509.load_pem_x509_certificate(cert_pem).public_key()
    try:
        key.verify(receipt.signature, receipt_payload(receipt), ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        raise ValueError("receipt.signature: does not verify") from None
    if hashlib.sha256(manifest_bytes(manifest)).digest() != receipt.manifest_sha256:
        raise ValueError("manifest: not the signed one")
    if [(t.name, t.sha256) for t in manifest.tensors] != [(t.name, t.sha256) for t in receipt.tensors]:
        raise ValueError("manifest.tensors: not the receipt's")
    itemsize = {1: 4, 2: 8, 3: 4, 4: 8}
    for t in manifest.tensors:
        raw = tensors[t.name]
        if len(raw) != t.nbytes or t.nbytes != math.prod(t.shape) * itemsize[t.dtype]:
            raise ValueError(f"tensor {t.name}: size")
        if hashlib.sha256(raw).digest() != t.sha256:
            raise ValueError(f"tensor {t.name}: sha256")
    if manifest.total_bytes != sum(t.nbytes for t in manifest.tensors):
        raise ValueError("manifest.total_bytes")
    record = check_record(receipt.record_json)
    if receipt.served_again:
        if receipt.served_to != me:
            raise ValueError("receipt.served_to: not this site")
    elif record["counterparty"] != me:
        raise ValueError("record.counterparty: not this site")
    return record


# ------------------------------------------------------------------ docs/wire.md section 6.4: the record

RECORD_FIELDS = {
    "release_id", "mechanism", "level", "unit", "epsilon", "delta", "sensitivity", "sensitivity_norm",
    "parameters", "components", "randomness", "seed", "subject", "counterparty", "created_at",
}  # fmt: skip
#: the parameters every record of a mechanism carries (6.4's table; others are informative)
MECHANISM_PARAMETERS = {
    "laplace": {"scale", "clip", "shape"},
    "multibit": {"bounds", "m", "d", "shape", "centre", "half_step"},
    "gaussian": {"noise_std", "clip_norm", "entry_bound", "calibration", "adjacency", "shape"},
    "composite": {"composition"},
    "dpsgd": {"training", "epsilon_rdp"},
    "rs-merge": {"pi", "models", "names", "epsilon_rdp"},
    "lc-merge": {"lam", "models", "names", "bound", "epsilon_rdp"},
}
NORMS = {"laplace": "l1", "multibit": "range", "gaussian": "l2", "composite": "none", "dpsgd": "l2"}
RFC3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def canonical_json(value) -> str:
    """6.4's canonical JSON written from the text: sorted keys, no whitespace, STRING and FLOAT of 9.1."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{ledger_string(k)}:{canonical_json(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(canonical_json(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("record: no NaN or infinity in canonical JSON")
    return ledger_json(value)


def check_record(raw: bytes) -> dict:
    """A record's bytes are canonical (re-encoding them from 6.4 gives the same bytes) and the
    record, with every component, obeys 6.4's schema; returns it parsed."""
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        raise ValueError("record_json: not ASCII") from None
    record = json.loads(text)
    if canonical_json(record) != text:
        raise ValueError("record_json: not canonical JSON")
    check_record_fields(record, "record")
    return record


def check_record_fields(r: dict, where: str) -> None:
    def rule(ok: bool, field: str, what: str) -> None:
        if not ok:
            raise ValueError(f"{where}.{field}: {what}, got {r.get(field)!r}")

    fixed = r.get("randomness") == "fixed-seed"
    rule(set(r) == RECORD_FIELDS | ({"randomness_warning"} if fixed else set()), "fields", "exactly 6.4's fields")
    mechanism = r["mechanism"]
    rule(mechanism in MECHANISM_PARAMETERS, "mechanism", "one of 6.4's mechanisms")
    rule(r["level"] == ("data" if mechanism in ("dpsgd", "rs-merge", "lc-merge") else "model"), "level", "its level")
    units = {"model": ("neuron", "entry"), "data": ("record:replace-one", "record:add-remove")}[r["level"]]
    rule(r["unit"] in units, "unit", f"one of {units}")
    number = (int, float)
    rule(r["epsilon"] == "inf" or (isinstance(r["epsilon"], number) and r["epsilon"] >= 0), "epsilon", '>= 0 or "inf"')
    rule(isinstance(r["delta"], number) and 0 <= r["delta"] < 1, "delta", "in [0, 1)")
    norm = NORMS.get(mechanism, "none")
    rule(r["sensitivity_norm"] == norm, "sensitivity_norm", f"{norm!r} for {mechanism}")
    if norm == "none":
        rule(r["sensitivity"] is None, "sensitivity", "null")
    else:
        rule(isinstance(r["sensitivity"], number) and r["sensitivity"] >= 0, "sensitivity", ">= 0")
    rule(isinstance(r["parameters"], dict), "parameters", "an object")
    missing = MECHANISM_PARAMETERS[mechanism] - set(r["parameters"])
    rule(not missing, "parameters", f"a {mechanism} record's {sorted(missing)}")
    if mechanism == "composite":
        composition = r["parameters"]["composition"]
        rule(composition in ("sequential", "parallel"), "parameters", "composition sequential or parallel")
        rule(
            (composition == "parallel") == (r["parameters"].get("parallel_over") in ("neurons", "entries")),
            "parameters",
            "parallel_over exactly when parallel",
        )
        rule(bool(r["components"]), "components", "a composite's parts")
    rule(r["randomness"] in ("csprng", "fixed-seed", "none"), "randomness", "csprng, fixed-seed or none")
    rule(isinstance(r["seed"], int) if fixed else r["seed"] is None, "seed", "an integer exactly when fixed-seed")
    if fixed:
        rule(r["randomness_warning"] == "fixed seed: not private", "randomness_warning", "the fixed text")
    rule(isinstance(r["subject"], str), "subject", "a string")
    rule(r["counterparty"] is None or isinstance(r["counterparty"], str), "counterparty", "a string or null")
    rule(isinstance(r["created_at"], str) and RFC3339_UTC.fullmatch(r["created_at"]), "created_at", "RFC 3339 UTC")
    rule(isinstance(r["release_id"], str) and r["release_id"], "release_id", "a non-empty string")
    rule(isinstance(r["components"], list), "components", "an array")
    for i, c in enumerate(r["components"]):
        check_record_fields(c, f"{where}.components[{i}]")


# ------------------------------------------------------------------ docs/wire.md section 9: the ledger
#
# An auditor's recomputation of a site's ledger from its SQLite file and its anchor, with the
# standard library only: the encodings below are written from the definitions in section 9
# (not with json.dumps), so a difference between the text and what the daemon writes fails.


def ledger_float(x: float) -> str:
    """FLOAT(x), section 9.1: the shortest decimal that reads back as x, laid out by the exponent rule."""
    if x != x:
        return "NaN"
    if x in (math.inf, -math.inf):
        return "Infinity" if x > 0 else "-Infinity"
    sign = "-" if math.copysign(1.0, x) < 0 else ""
    x = abs(x)
    if x == 0:
        return sign + "0.0"
    for p in range(1, 18):  # the fewest significant digits whose correctly rounded value reads back as x
        s = f"{x:.{p - 1}e}"
        if float(s) == x:
            break
    mantissa, exponent = s.split("e")
    digits = mantissa.replace(".", "")
    point = int(exponent) + 1  # x = 0.DIGITS × 10^point
    if -4 < point <= 16:
        if point <= 0:
            return sign + "0." + "0" * -point + digits
        if point >= len(digits):
            return sign + digits + "0" * (point - len(digits)) + ".0"
        return sign + digits[:point] + "." + digits[point:]
    e = point - 1
    body = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
    return f"{sign}{body}e{'-' if e < 0 else '+'}{abs(e):02d}"


_JSON_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def ledger_string(s: str) -> str:
    """STRING(s), section 9.1: a JSON string in ASCII, everything outside U+0020..U+007E escaped."""
    out = ['"']
    for ch in s:
        c = ord(ch)
        if ch in _JSON_ESCAPES:
            out.append(_JSON_ESCAPES[ch])
        elif 0x20 <= c <= 0x7E:
            out.append(ch)
        elif c <= 0xFFFF:
            out.append(f"\\u{c:04x}")
        else:  # a UTF-16 surrogate pair
            c -= 0x10000
            out.append(f"\\u{0xD800 + (c >> 10):04x}\\u{0xDC00 + (c & 0x3FF):04x}")
    out.append('"')
    return "".join(out)


def ledger_json(value) -> str:
    """LJSON(v), section 9.1: arrays of strings, integers and floats, no whitespace."""
    if isinstance(value, list):
        return "[" + ",".join(ledger_json(v) for v in value) + "]"
    if isinstance(value, str):
        return ledger_string(value)
    if isinstance(value, bool):
        raise TypeError("no booleans in a ledger hash")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return ledger_float(value)
    raise TypeError(f"not a ledger hash value: {type(value).__name__}")


def ledger_hash_json(value) -> str:
    return hashlib.sha256(ledger_json(value).encode("ascii")).hexdigest()


def ledger_hash_lines(context: bytes, parts) -> str:
    """The cancellation and served-again hashes: the context, then each part's UTF-8 and a newline."""
    h = hashlib.sha256(context)
    for part in parts:
        h.update(str(part).encode("utf-8") + b"\n")
    return h.hexdigest()


ZERO_HEAD = "0" * 64
CHARGE_COLUMNS = (
    "seq", "release_id", "charged_at", "level", "unit", "record_unit", "counterparty", "subject",
    "mechanism", "epsilon", "delta", "rdp", "pure_epsilon", "budgets", "record",
)  # fmt: skip
FLOAT_COLUMNS = {"epsilon", "delta", "pure_epsilon", "epsilon_limit", "delta_limit"}
BUDGET_COLUMNS = ("budget", "level", "unit", "subject", "counterparty", "epsilon_limit", "delta_limit")


def _typed(columns, row) -> list:
    # REAL columns as IEEE doubles with −0.0 read as 0.0; INTEGER as integers; TEXT as text
    return [float(v) + 0.0 if c in FLOAT_COLUMNS else v for c, v in zip(columns, row, strict=True)]


def audit_ledger(path: str, anchor: str | None = None) -> dict:
    """Recompute every chain of the ledger at ``path`` (section 9) and check that it reaches its
    anchor (``path + ".anchor"`` unless given) and that the totals cache is the sum of its rows.

    Returns the genesis, each chain's head (row id, hash), the anchored points, the cancelled
    charges and each budget's count; raises ValueError naming the first row whose stored hash,
    link or reference differs from the recomputation."""
    import sqlite3

    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

        def rows_of(table: str, sql: str) -> list:
            # cancellations and served_again are absent from files written before they existed
            return con.execute(sql).fetchall() if table in tables else []

        meta = dict(con.execute("SELECT key, value FROM meta"))
        if meta.get("schema_version") != "2":
            raise ValueError(f"meta.schema_version: {meta.get('schema_version')!r}, expected '2'")
        orders = [float(o) for o in json.loads(meta["orders"])]
        genesis = ledger_hash_json(["privfusion-ledger-genesis", "2", orders])
        budgets: dict[int, list] = {}
        for seq, *row in con.execute(f"SELECT seq, {', '.join(BUDGET_COLUMNS)} FROM charge_budgets"):
            budgets.setdefault(seq, []).append(_typed(BUDGET_COLUMNS, row))
        models: dict[int, list] = {}
        for seq, model, lc in con.execute("SELECT seq, model, lc FROM charge_models"):
            models.setdefault(seq, []).append([model, lc])
        heads: dict[str, tuple[int, str]] = {}
        prev, charge_hash, charge_level, charge_release = genesis, {}, {}, {}
        for *row, prev_hash, stored in con.execute(
            f"SELECT {', '.join(CHARGE_COLUMNS)}, prev_hash, hash FROM charges ORDER BY seq"
        ):
            seq, own_budgets = row[0], budgets.pop(row[0], [])
            h = ledger_hash_json(
                [
                    "privfusion-ledger-charge",
                    prev,
                    _typed(CHARGE_COLUMNS, row),
                    sorted(own_budgets),
                    sorted(models.pop(seq, [])),
                ]
            )
            if prev_hash != prev or stored != h:
                raise ValueError(f"charges: the hash of charge {seq} does not recompute")
            if sorted(json.loads(row[CHARGE_COLUMNS.index("budgets")])) != sorted(b[0] for b in own_budgets):
                raise ValueError(f"charges: charge {seq}'s budgets column and its charge_budgets rows differ")
            prev, charge_hash[seq], charge_level[seq] = h, h, row[CHARGE_COLUMNS.index("level")]
            charge_release[seq] = row[CHARGE_COLUMNS.index("release_id")]
            heads["charges"] = (seq, h)
        if budgets or models:
            raise ValueError(f"charge_budgets/charge_models: rows of no charge {sorted({*budgets, *models})}")
        known_heads = set(charge_hash.values())
        cancelled: set[int] = set()
        prev = ZERO_HEAD
        for cid, seq, release_id, at, reason, head, prev_hash, stored in rows_of(
            "cancellations",
            "SELECT id, seq, release_id, at, reason, head_hash, prev_hash, hash FROM cancellations ORDER BY id",
        ):
            h = ledger_hash_lines(b"cancel\n", (prev, seq, release_id, charge_hash.get(seq, ""), head, at, reason))
            if charge_release.get(seq) != release_id or head not in known_heads or prev_hash != prev or stored != h:
                raise ValueError(f"cancellations: row {cid} does not recompute")
            prev, heads["cancellations"] = h, (cid, h)
            cancelled.add(seq)
        prev = ZERO_HEAD
        for sid, seq, release_id, cp, at, detail, head, prev_hash, stored in rows_of(
            "served_again",
            "SELECT id, seq, release_id, counterparty, at, detail, head_hash, prev_hash, hash"
            " FROM served_again ORDER BY id",
        ):
            h = ledger_hash_lines(
                b"served-again\n", (prev, seq, release_id, charge_hash.get(seq, ""), cp, head, at, detail)
            )
            if charge_release.get(seq) != release_id or head not in known_heads or prev_hash != prev or stored != h:
                raise ValueError(f"served_again: row {sid} does not recompute")
            if seq in cancelled or charge_level[seq] != "data":
                raise ValueError(f"served_again: row {sid} names a cancelled or model-level charge")
            prev, heads["served_again"] = h, (sid, h)
        prev = ZERO_HEAD
        for eid, release_id, at, kind, detail, prev_hash, stored in con.execute(
            "SELECT id, release_id, at, kind, detail, prev_hash, hash FROM events ORDER BY id"
        ):
            h = ledger_hash_json(["privfusion-ledger-event", prev, [eid, release_id, at, kind, detail]])
            if prev_hash != prev or stored != h:
                raise ValueError(f"events: the hash of event {eid} does not recompute")
            prev, heads["events"] = h, (eid, h)
        stored_rows = {
            chain: dict(rows_of(chain, f"SELECT {key}, hash FROM {chain}"))
            for chain, key in (("charges", "seq"), ("cancellations", "id"), ("served_again", "id"), ("events", "id"))
        }
        totals = audit_totals(con, len(orders), cancelled)
    finally:
        con.close()
    anchored = read_anchor(anchor if anchor is not None else path + ".anchor")
    for chain, (n, head) in anchored.items():
        if stored_rows.get(chain, {}).get(n) != head:
            raise ValueError(f"anchor: {chain} row {n} with hash {head[:16]}… is not in the ledger")
    return {
        "genesis": genesis,
        "heads": {c: list(v) for c, v in heads.items()},
        "anchored": {c: list(v) for c, v in anchored.items()},
        "charge_hashes": {str(k): v for k, v in charge_hash.items()},
        "cancelled": sorted(cancelled),
        "totals": totals,
    }


def audit_totals(con, n_orders: int, cancelled: set) -> dict:
    """Section 9.4: each budget's totals row is the sum, in charge order, of its charges that
    are not cancelled (the RDP vectors order by order, the pure ε, the count, the last seq)."""
    sums: dict[str, list] = {}
    for seq, budget, rdp, pure in con.execute(
        "SELECT c.seq, b.budget, c.rdp, c.pure_epsilon FROM charges c JOIN charge_budgets b ON b.seq = c.seq"
        " ORDER BY c.seq"
    ):
        if seq in cancelled:
            continue
        vector = json.loads(rdp)
        if len(vector) != n_orders:
            raise ValueError(f"charges: charge {seq}'s rdp has {len(vector)} values for {n_orders} orders")
        s = sums.setdefault(budget, [0, [0.0] * n_orders, 0.0, 0])
        s[0], s[1], s[2], s[3] = s[0] + 1, [a + b for a, b in zip(s[1], vector, strict=True)], s[2] + pure, seq
    stored = {
        b: [count, json.loads(rdp), pure, last]
        for b, count, rdp, pure, last in con.execute("SELECT budget, count, rdp, pure_epsilon, last_seq FROM totals")
    }
    if stored != sums:
        raise ValueError(f"totals: the cache differs from the sums of the rows ({sorted(stored)} vs {sorted(sums)})")
    return {b: {"count": s[0], "last_seq": s[3]} for b, s in sums.items()}


def read_anchor(path: str) -> dict[str, tuple[int, str]]:
    """Section 9.5: per chain, the anchored point with the largest n; lines that do not parse are skipped."""
    out: dict[str, tuple[int, str]] = {}
    for raw in Path(path).read_bytes().split(b"\n"):
        try:
            d = json.loads(raw)
        except ValueError:
            continue
        if not isinstance(d, dict) or d.get("format") != "privfusion-ledger-anchor/1" or "chain" not in d:
            continue
        if d["chain"] not in out or d["n"] > out[d["chain"]][0]:
            out[d["chain"]] = (d["n"], d["head"])
    return out


# ------------------------------------------------------------------ talking to the daemon


class Client:
    def __init__(self, cfg: dict):
        import grpc

        from privfusion.v1 import peer_pb2, peer_pb2_grpc

        self.pb = peer_pb2
        self.cfg = cfg
        self.peer_cert = Path(cfg["peer_cert"]).read_bytes()
        creds = grpc.ssl_channel_credentials(
            root_certificates=self.peer_cert,
            private_key=Path(cfg["key"]).read_bytes(),
            certificate_chain=Path(cfg["cert"]).read_bytes(),
        )
        self.channel = grpc.secure_channel(
            cfg["address"],
            creds,
            options=[
                ("grpc.ssl_target_name_override", cfg["peer"]),
                ("grpc.max_receive_message_length", 16 << 20),
                ("grpc.max_send_message_length", 16 << 20),
            ],
        )
        self.stub = peer_pb2_grpc.PeerStub(self.channel)

    def header(self):
        return self.pb.RequestHeader(sender=self.cfg["me"], receiver=self.cfg["peer"])

    def read(self, frames) -> tuple:
        """Reassemble a release from its frames in the order of section 4."""
        frames = iter(frames)
        first = next(frames)
        assert first.WhichOneof("frame") == "receipt", "the receipt comes first"
        receipt = first.receipt
        second = next(frames)
        assert second.WhichOneof("frame") == "manifest", "then the manifest"
        manifest = second.manifest
        assert manifest.tensor_count == len(manifest.tensors) == len(receipt.tensors)
        tensors, chunks_seen, current, end = {}, 0, None, None
        for f in frames:
            which = f.WhichOneof("frame")
            assert end is None, "nothing follows ReleaseEnd"
            if which == "tensor":
                assert current is None or len(tensors[current.name]) == current.nbytes
                current = f.tensor
                assert current == manifest.tensors[len(tensors)], "headers repeat the manifest, in order"
                tensors[current.name] = bytearray()
            elif which == "chunk":
                assert 0 < len(f.chunk.data) <= 4 << 20
                tensors[current.name] += f.chunk.data
                chunks_seen += 1
            elif which == "end":
                end = f.end
            else:
                raise AssertionError(f"unexpected {which}")
        assert end is not None and end.tensor_count == len(tensors) and end.total_bytes == manifest.total_bytes
        return receipt, manifest, {k: bytes(v) for k, v in tensors.items()}, chunks_seen

    def refusal(self, method, request) -> dict:
        """Call ``method`` expecting a refusal; its status, and the google.rpc details of 7.3
        decoded from the ``grpc-status-details-bin`` trailer (the generic google.rpc protos)."""
        import grpc
        from google.rpc import error_details_pb2, status_pb2

        try:
            for _ in method(request, timeout=60):
                pass
        except grpc.RpcError as e:
            out: dict = {"status": e.code().name, "reason": "", "domain": "", "metadata": {}, "fields": []}
            raw = dict(e.trailing_metadata() or ()).get("grpc-status-details-bin")
            if raw is not None:
                status = status_pb2.Status.FromString(raw)
                assert status.code == e.code().value[0] and status.message == e.details()
                for detail in status.details:
                    if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                        info = error_details_pb2.ErrorInfo()
                        detail.Unpack(info)
                        out.update(reason=info.reason, domain=info.domain, metadata=dict(info.metadata))
                    elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                        bad = error_details_pb2.BadRequest()
                        detail.Unpack(bad)
                        out["fields"] = [v.field for v in bad.field_violations]
            return out
        raise AssertionError("the call was expected to be refused")

    def features(self, model: str, probe, chunk: int):
        import numpy as np

        raw = np.ascontiguousarray(probe, dtype="<f8").tobytes()
        head = self.pb.FeaturesRequest(
            probe={
                "name": "probe",
                "dtype": 2,
                "shape": list(probe.shape),
                "nbytes": len(raw),
                "sha256": hashlib.sha256(raw).digest(),
            }
        )  # the WHOLE probe's digest

        def requests():
            yield self.pb.FeaturesRequest(
                params=self.pb.FeaturesParams(
                    header=self.header(),
                    model=model,
                    activation_epsilon=2.0,
                    weight_epsilon=2.0,
                    activation_clip_low=0.0,
                    activation_clip_high=4.0,
                )
            )
            yield head
            for i in range(0, len(raw), chunk):
                yield self.pb.FeaturesRequest(chunk={"data": raw[i : i + chunk]})

        return self.read(self.stub.ReleaseFeatures(requests(), timeout=120))

    def weights(self, model: str):
        return self.read(
            self.stub.ReleaseWeights(
                self.pb.WeightsRequest(header=self.header(), model=model, epsilon=2.0, delta=1e-5), timeout=120
            )
        )

    def merged(self, pool: str):
        return self.read(
            self.stub.ReleaseMerged(
                self.pb.MergeRequest(header=self.header(), pool=pool, method="rs", epsilon=8.0, delta=1e-5), timeout=120
            )
        )


def array(manifest, tensors: dict[str, bytes], name: str):
    import numpy as np

    t = next(t for t in manifest.tensors if t.name == name)
    dtype = {1: "<f4", 2: "<f8", 3: "<i4", 4: "<i8"}[t.dtype]
    return np.frombuffer(tensors[name], dtype=dtype).reshape(tuple(t.shape))


def main(config_path: str, out_path: str) -> int:
    import numpy as np

    cfg = json.loads(Path(config_path).read_text())
    generate_stubs(Path(cfg["proto_root"]), Path(cfg["stubs"]))
    from privfusion.v1 import peer_pb2

    c = Client(cfg)
    info = c.stub.GetPeerInfo(peer_pb2.GetPeerInfoRequest(header=c.header()), timeout=30)
    [model] = [m for m in info.models if m.name == cfg["model"]]
    layers = list(model.layers)
    probe = np.random.default_rng(0).random((7, json.loads(model.architecture_json)["input_dim"]))
    kept = {
        "features": c.features(model.name, probe, chunk=1000),
        "weights": c.weights(model.name),
        "merged": c.merged(cfg["pool"]),
        "merged_again": c.merged(cfg["pool"]),  # the same request: served again, not charged
    }
    # section 7.3: a refusal a client can act on, read from the trailer with generic protos
    refusals = {
        "unreachable_merge": c.refusal(
            c.stub.ReleaseMerged,
            peer_pb2.MergeRequest(header=c.header(), pool=cfg["pool"], method="rs", epsilon=1e-3, delta=1e-5),
        ),
        "unknown_model": c.refusal(
            c.stub.ReleaseWeights, peer_pb2.WeightsRequest(header=c.header(), model="no-such", epsilon=2.0, delta=1e-5)
        ),
    }
    # section 3.3: the caller's rows of the server's ledger, each with the charged record's bytes
    ledger_rows = [
        {
            "entry_id": e.entry_id,
            "counterparty": e.counterparty,
            "created_at": e.created_at,
            "record_sha256": hashlib.sha256(e.record_json).hexdigest(),
            "mechanism": check_record(e.record_json)["mechanism"],
        }
        for e in c.stub.ListLedger(peer_pb2.LedgerRequest(header=c.header()), timeout=30)
    ]
    c.channel.close()

    # ---- offline: only the kept bytes and the pinned certificate from here on
    out: dict = {"stubs": peer_pb2.__file__, "releases": {}, "ledger_rows": ledger_rows, "refusals": refusals}
    for kind, (receipt, manifest, tensors, chunks) in kept.items():
        record = verify_offline(receipt, manifest, tensors, c.peer_cert, cfg["peer"], cfg["me"])
        assert manifest.kind == kind.removesuffix("_again")
        assert manifest.kind in ("features", "features+weights", "weights", "merged", "fused", "segment")  # section 5
        if kind.startswith("merged"):  # section 7.1: the stored merge's record binds its bytes
            assert record["parameters"]["release_sha256"] == release_sha256(manifest)
        out["releases"][kind] = {
            "entry": receipt.ledger_entry_id,
            "served_again": receipt.served_again,
            "ledger_seq": receipt.ledger_seq,
            "ledger_head": receipt.ledger_head.hex(),
            "tensors_sha256": hashlib.sha256(b"".join(tensors[t.name] for t in manifest.tensors)).hexdigest(),
            "release_id": record["release_id"],
            "record_sha256": hashlib.sha256(receipt.record_json).hexdigest(),
            "epsilon": record["epsilon"],
            "level": record["level"],
            "chunks": chunks,
            "names": [t.name for t in manifest.tensors],
            "shapes": {t.name: list(t.shape) for t in manifest.tensors},
            "metadata": json.loads(manifest.metadata_json),
        }
        # a verifier that cannot fail proves nothing: each edit below must be refused
        refused = []
        for field, value in (
            ("metadata_json", manifest.metadata_json + " "),
            ("kind", "fused"),
            ("architecture_json", manifest.architecture_json.replace("10", "11")),
        ):
            edited = type(manifest)()
            edited.CopyFrom(manifest)
            setattr(edited, field, value)
            try:
                verify_offline(receipt, edited, tensors, c.peer_cert, cfg["peer"], cfg["me"])
            except ValueError:
                refused.append(field)
        edited = type(manifest)()
        edited.CopyFrom(manifest)
        edited.tensors[0].shape.append(1)
        try:
            verify_offline(receipt, edited, tensors, c.peer_cert, cfg["peer"], cfg["me"])
        except ValueError:
            refused.append("shape")
        flipped = dict(tensors)
        name = manifest.tensors[0].name
        flipped[name] = bytes([flipped[name][0] ^ 1]) + flipped[name][1:]
        try:
            verify_offline(receipt, manifest, flipped, c.peer_cert, cfg["peer"], cfg["me"])
        except ValueError:
            refused.append("bytes")
        # the ledger's position is signed: another head, another count, or the two stripped
        for field, value in (("ledger_head", bytes(32)), ("ledger_seq", receipt.ledger_seq + 1), ("strip", None)):
            edited = type(receipt)()
            edited.CopyFrom(receipt)
            if field == "strip":
                edited.ClearField("ledger_seq")
                edited.ClearField("ledger_head")
            else:
                setattr(edited, field, value)
            try:
                verify_offline(edited, manifest, tensors, c.peer_cert, cfg["peer"], cfg["me"])
            except ValueError:
                refused.append(field)
        out["releases"][kind]["refused_edits"] = refused

    # ---- the layouts of section 5, checked against PeerInfo's layers
    _, fm, ft, _ = kept["features"]
    meta = json.loads(fm.metadata_json)
    hidden = [layer for layer in layers if layer.hidden]
    assert [layer["name"] for layer in meta["layers"]] == [layer.name for layer in hidden]
    want = []
    for layer in hidden:
        want += [f"hidden.{layer.name}.activations", f"hidden.{layer.name}.incoming", f"hidden.{layer.name}.bias"]
    assert [t.name for t in fm.tensors] == [*want, "output.incoming", "output.bias"]
    n_prev = meta["input_size"]
    for layer in hidden:
        n = layer.weight_shape[0]
        assert array(fm, ft, f"hidden.{layer.name}.activations").shape == (n, probe.shape[0])
        incoming = array(fm, ft, f"hidden.{layer.name}.incoming")
        assert incoming.shape == (n, n_prev, 1) == (n, layer.weight_shape[1], 1)  # Linear -> Linear: e = 1
        assert array(fm, ft, f"hidden.{layer.name}.bias").shape == (n,)
        n_prev = n
    assert array(fm, ft, "output.incoming").shape == (layers[-1].weight_shape[0], n_prev, 1)
    _, wm, wt, _ = kept["weights"]
    names = [t.name for t in wm.tensors]
    assert names == sorted(names) == sorted(f"{layer.name}.{p}" for layer in layers for p in ("weight", "bias"))
    for layer in layers:
        assert array(wm, wt, f"{layer.name}.weight").shape == tuple(layer.weight_shape)
        assert array(wm, wt, f"{layer.name}.bias").shape == tuple(layer.bias_shape)
    _, mm, mt, _ = kept["merged"]
    arch = json.loads(mm.architecture_json)
    names = [t.name for t in mm.tensors]
    assert names == sorted(names) and arch["kind"] == "mlp"
    widths = [arch["input_dim"], *arch["hidden"], arch["output_dim"]]
    assert [array(mm, mt, n).shape for n in names if n.endswith(".weight")] == [(o, i) for i, o in pairwise(widths)]
    out["project_modules_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT_MODULES)
    Path(out_path).write_text(json.dumps(out, indent=2))
    return 0


def audit_main(ledger_path: str, out_path: str) -> int:
    """``--audit-ledger LEDGER OUT.json``: section 9's recomputation; exit 1 naming the first difference."""
    try:
        found = audit_ledger(ledger_path)
    except ValueError as e:
        print(f"ledger {ledger_path}: {e}", file=sys.stderr)
        return 1
    found["project_modules_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] in PROJECT_MODULES)
    Path(out_path).write_text(json.dumps(found, indent=2))
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--audit-ledger":
        sys.exit(audit_main(sys.argv[2], sys.argv[3]))
    sys.exit(main(sys.argv[1], sys.argv[2]))
