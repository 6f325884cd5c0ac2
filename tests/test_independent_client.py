"""The contract can be implemented from the spec alone: an independent client (tests/independent_client.py,
built from the .proto files and docs/wire.md, run in its own process with none of the project's
modules imported) gets a features, a weights and a merged release from a real daemon over mutual
TLS, reassembles them and verifies receipts and manifests offline; what it reports agrees with
the daemon's ledger. As an auditor it recomputes every hash chain of a ledger file, and the
anchor, from docs/wire.md section 9 alone, and refuses a file with one byte changed."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

import independent_client as spec
import numpy as np
import pytest
from ledger_reference import gaussian_record, laplace_record
from peer_harness import make_pool, make_site, pin_each_other, running

from peer.budget.ledger import Ledger
from peer.budget.policy import Policy

ROOT = Path(__file__).resolve().parent.parent
#: what runs the independent code: no PYTHONPATH, so nothing of the project can be imported
BARE_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def audit(ledger: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess, dict | None]:
    """``independent_client.py --audit-ledger`` in its own process, none of the project on its path."""
    out = tmp_path / "audit.json"
    out.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "independent_client.py"), "--audit-ledger", str(ledger), str(out)],
        cwd=tmp_path,
        env=BARE_ENV,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return proc, (json.loads(out.read_text()) if proc.returncode == 0 else None)


def flip_one_byte(path: Path, old: bytes, new: bytes) -> None:
    """Change one byte of the SQLite file where ``old`` (found exactly once) is stored."""
    assert len(old) == len(new) and sum(a != b for a, b in zip(old, new, strict=True)) == 1
    raw = path.read_bytes()
    assert raw.count(old) == 1, f"{old!r} is stored {raw.count(old)} times"
    path.write_bytes(raw.replace(old, new))


def test_the_ledger_encodings_written_from_the_text_are_the_ledgers_own():
    """docs/wire.md 9.1 defines FLOAT and STRING byte for byte; the independent client encodes
    from that text (not with json), and the ledger hashes with Python's json. They agree on
    200 000 doubles drawn as uniform 64-bit patterns (every exponent and sign, subnormals, ±0,
    ±inf), on the edges of the exponent rule, and on every code point class of STRING;
    deterministic (seed 0), so it cannot fail by chance."""
    rng = random.Random(0)
    edges = [0.0, -0.0, 1.0, 2.0, 0.1, 1e-4, 1e-5, 1.5e-5, 1e15, 1e16, 9999999999999998.0, 1e22]
    edges += [5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, math.inf, -math.inf, 123.456, 1 / 3]
    doubles = [struct.unpack("<d", struct.pack("<Q", rng.getrandbits(64)))[0] for _ in range(200_000)]
    for x in edges + [d for d in doubles if not math.isnan(d)]:
        assert spec.ledger_float(x) == json.dumps(x), x
    samples = ['"\\/\b\f\n\r\t', "".join(map(chr, range(0x800))), "é☃\u2028\ud7ff\ue000\uffff😀\U0010ffff"]
    for text in samples:
        assert spec.ledger_string(text) == json.dumps(text)
    # the worked examples in docs/wire.md 9.1 are what the encoders give
    doc = (ROOT / "docs" / "wire.md").read_text()
    examples = [line for line in doc.splitlines() if line.startswith("| `") and "` → `" in line]
    assert len(examples) >= 10
    for line in examples:
        value, encoded = (part.strip().strip("`") for part in line.strip("|").split("|")[0].split("→"))
        assert spec.ledger_json(json.loads(value)) == encoded, line


def test_a_records_bytes_are_the_canonical_json_docs_wire_md_defines():
    """6.4: ASCII with non-ASCII escaped, sorted keys at every depth, FLOAT numbers, an
    infinite ε as the string "inf", the fixed-seed warning; the schema check written from the
    text accepts the project's records (a composite of the Gaussian, Laplace and multi-bit
    mechanisms' own records, with a non-ASCII subject) and refuses an unknown field, as the project's reader does."""
    from peer.base.errors import InvalidArgument
    from peer.base.records import ReleaseRecord
    from peer.base.rng import make_randomness
    from peer.ldp.mechanisms.gaussian import gaussian_perturbation
    from peer.ldp.mechanisms.laplace import laplace_activations
    from peer.ldp.mechanisms.multibit import multibit
    from peer.ldp.mechanisms.records import composite_record

    x = np.random.default_rng(0).random((3, 4))
    rnd = make_randomness(7)
    parts = [
        gaussian_perturbation(x, epsilon=1.0, delta=1e-5, clip_norm=1.0, randomness=rnd)[1],
        laplace_activations(x, epsilon=0.5, clip=(0.0, 1.0), randomness=rnd)[1],
        multibit(x, epsilon=2.0, bounds=(-1.0, 1.0), randomness=rnd)[1],
    ]
    record = composite_record(parts, "sequential", randomness=rnd).with_(subject="modèle-☃", counterparty="site-b")
    raw = record.canonical_json()
    assert raw.isascii() and b"mod\\u00e8le-\\u2603" in raw
    assert spec.canonical_json(json.loads(raw)) == raw.decode()
    assert spec.check_record(raw)["randomness_warning"] == "fixed seed: not private"
    unbounded = record.with_(epsilon=math.inf).canonical_json()
    assert b'"epsilon":"inf"' in unbounded and spec.check_record(unbounded)["epsilon"] == "inf"
    extra = json.loads(raw)
    extra["note"] = "x"
    with pytest.raises(ValueError, match=r"record\.fields"):
        spec.check_record(spec.canonical_json(extra).encode())
    with pytest.raises(InvalidArgument, match="unknown fields"):
        ReleaseRecord.from_json(json.dumps(extra))
    with pytest.raises(ValueError, match="not canonical"):
        spec.check_record(json.dumps(json.loads(raw), sort_keys=True).encode())  # spaces after , and :


def small_ledger(path: Path) -> dict:
    """A ledger with every chain: charges to two budgets, an event, a cancellation and a
    served-again row, with non-ASCII text in names, details and reasons."""
    from test_ledger import full_batch

    from peer.dp.accounting.release_accounting import dpsgd_record

    policy = Policy.from_mapping(
        {
            "peers": {"*": {"allow": ["features", "weights", "merge"]}},
            "model": {"total": {"epsilon": 50.0, "delta": 1e-5}, "per_counterparty": {"epsilon": 40.0, "delta": 1e-5}},
            "data": {"unit": "record:add-remove", "epsilon": 50.0, "delta": 1e-5},
        }
    )
    with Ledger(path, policy) as led:
        a = led.charge(gaussian_record(noise_std=20.0, subject="modèle-☃"), "b")
        led.record_event(a.release_id, "sent", "détail ✓")
        c = led.charge(laplace_record(epsilon=0.5), "c")
        led.cancel(c.release_id, "never left: the partner refused (ünïcode)")
        d = led.charge(dpsgd_record(full_batch(6.0, steps=2), 1e-5, subject="pool/m0"), "b")
        served = led.serve_again(d.release_id, "c", "asked again")
        return {"charges": [d.entry_id, d.hash], "served_again": [served["id"], served["hash"]], "a": a, "c": c}


def test_an_auditor_recomputes_every_chain_from_the_spec_and_refuses_one_changed_byte(tmp_path):
    path = tmp_path / "ledger.sqlite"
    made = small_ledger(path)
    assert not Path(str(path) + "-wal").exists()  # closed: every row is in the file itself
    proc, found = audit(path, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert found["project_modules_loaded"] == []
    assert found["heads"]["charges"] == made["charges"] and found["heads"]["served_again"] == made["served_again"]
    assert found["anchored"] == found["heads"] and found["cancelled"] == [made["c"].entry_id]
    assert found["charge_hashes"][str(made["a"].entry_id)] == made["a"].hash

    # one byte of a stored record (the noise scale of charge 1), of a cancellation's reason, of
    # an event's detail: each is refused, naming the row; so is a file cut back behind its anchor
    for old, new, refusal in (
        (b'"noise_std":20.0', b'"noise_std":20.5', "charges: the hash of charge 1"),
        (b"the partner refused", b"the partner refusee", "cancellations: row 1"),
        (b"asked again", b"asked agaiN", "served_again: row 1"),
    ):
        copy = tmp_path / "copy.sqlite"
        shutil.copy(path, copy)
        shutil.copy(str(path) + ".anchor", str(copy) + ".anchor")
        flip_one_byte(copy, old, new)
        proc, _ = audit(copy, tmp_path)
        assert proc.returncode == 1 and refusal in proc.stderr, (old, proc.stderr)
        with pytest.raises(ValueError, match=refusal):
            spec.audit_ledger(str(copy))
    copy = tmp_path / "cut.sqlite"
    shutil.copy(path, copy)
    shutil.copy(str(path) + ".anchor", str(copy) + ".anchor")
    con = sqlite3.connect(copy)
    con.execute("DROP TRIGGER served_again_no_delete")
    con.execute("DELETE FROM served_again")
    con.commit()
    con.close()
    with pytest.raises(ValueError, match="anchor: served_again row 1"):
        spec.audit_ledger(str(copy))
    # one who knows the spec rewrites a cancellation's reason and recomputes its hash: the
    # chain then holds, and only the anchor shows the row was rewritten
    copy = tmp_path / "rewritten.sqlite"
    shutil.copy(path, copy)
    shutil.copy(str(path) + ".anchor", str(copy) + ".anchor")
    con = sqlite3.connect(copy)
    con.execute("DROP TRIGGER cancellations_no_update")
    cid, seq, release_id, at, head, prev = con.execute(
        "SELECT id, seq, release_id, at, head_hash, prev_hash FROM cancellations"
    ).fetchone()
    charge = con.execute("SELECT hash FROM charges WHERE seq = ?", (seq,)).fetchone()[0]
    forged = spec.ledger_hash_lines(b"cancel\n", (prev, seq, release_id, charge, head, at, "another reason"))
    con.execute("UPDATE cancellations SET reason = 'another reason', hash = ? WHERE id = ?", (forged, cid))
    con.commit()
    con.close()
    with pytest.raises(ValueError, match="anchor: cancellations row 1"):
        spec.audit_ledger(str(copy))


@pytest.mark.slow
def test_an_independent_client_runs_releases_and_verifies_them_from_the_spec(tmp_path):
    pool = make_pool(tmp_path / "pool-models")
    a = make_site(tmp_path, "site-a", seed=5, pools={"dp": pool})
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    config = {
        "proto_root": str(ROOT / "proto"),
        "stubs": str(tmp_path / "stubs"),
        "me": "site-b",
        "peer": "site-a",
        "key": str(b.identity_dir / "site.key"),
        "cert": str(b.identity_dir / "site.crt"),
        "peer_cert": str(b.identity_dir / "trusted" / "site-a.crt"),
        "model": "mlp",
        "pool": "dp",
    }
    for f in ("key", "cert", "peer_cert"):
        assert Path(config[f]).is_file(), config[f]
    out = tmp_path / "independent.json"
    with running(a) as (_, address):
        config["address"] = address
        (tmp_path / "config.json").write_text(json.dumps(config))
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "independent_client.py"), str(tmp_path / "config.json"), str(out)],
            cwd=tmp_path,
            env=BARE_ENV,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        seconds = time.perf_counter() - started
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(out.read_text())
    print(f"independent client: three releases, reassembled and verified offline in {seconds:.1f} s")

    # it used its own protoc-generated stubs and none of the project's modules
    assert got["stubs"].startswith(config["stubs"]) and got["project_modules_loaded"] == []
    releases = got["releases"]
    for kind in ("features", "weights", "merged", "merged_again"):
        # the offline verifier refused every edit of the manifest and of the bytes
        # the offline verifier refused every edit of the manifest and of the bytes, and of the
        # ledger position the receipt signs (docs/wire.md 6.3)
        assert releases[kind]["refused_edits"] == [
            *("metadata_json", "kind", "architecture_json", "shape", "bytes"),
            *("ledger_head", "ledger_seq", "strip"),
        ]
    # the probe went in 1000-byte chunks under one header carrying the whole probe's SHA-256
    assert releases["features"]["shapes"]["hidden.0.activations"] == [16, 7]
    assert releases["merged"]["level"] == "data" and releases["features"]["level"] == "model"

    # the same merge asked again: the identical bytes, served again under the original entry
    again = releases.pop("merged_again")
    assert again["served_again"] and releases["merged"]["served_again"] == ""
    assert again["entry"] == releases["merged"]["entry"]
    assert again["tensors_sha256"] == releases["merged"]["tensors_sha256"]
    # the ledger's position it was served at: the charge chain's head then (the last charge)
    assert again["ledger_seq"] == max(r["ledger_seq"] for r in releases.values())

    # every release it verified is the entry the daemon charged it for, under the same id
    with Ledger(a.ledger) as ledger:
        entries = {str(e.entry_id): e for e in ledger.entries(counterparty="site-b")}
        assert [str(s["id"]) for s in ledger.served_again()] == [again["served_again"]]
    assert sorted(entries) == sorted(r["entry"] for r in releases.values())
    for r in releases.values():
        # each fresh receipt carries the ledger's position right after its own charge
        assert (str(r["ledger_seq"]), r["ledger_head"]) == (r["entry"], entries[r["entry"]].hash)
        assert entries[r["entry"]].release_id == r["release_id"]
        assert entries[r["entry"]].epsilon == pytest.approx(r["epsilon"])

    # refusals carry what docs/wire.md 7.3 lists: a merge no weighting reaches names its reason
    # (in the table, with its status) and the reachable range; an unknown model is NOT_FOUND
    from test_wire_reasons import reasons_in_doc

    table, _ = reasons_in_doc()
    unreachable = got["refusals"]["unreachable_merge"]
    assert unreachable["reason"] == "TARGET_UNREACHABLE" and unreachable["domain"] == "privfusion.v1"
    assert table[unreachable["reason"]] == unreachable["status"] == "INVALID_ARGUMENT"
    assert unreachable["fields"] == ["target_epsilon"] and unreachable["metadata"]["reachable_epsilon_max"] == "inf"
    assert float(unreachable["metadata"]["reachable_epsilon_min"]) > 1e-3
    assert got["refusals"]["unknown_model"]["status"] == "NOT_FOUND"

    # ListLedger (docs/wire.md 3.3): one row per fresh charge to the caller, none for the merge
    # served again, each with the very record bytes its receipt signed
    rows = {r["entry_id"]: r for r in got["ledger_rows"]}
    assert sorted(rows) == sorted(r["entry"] for r in releases.values())
    for r in releases.values():
        assert rows[r["entry"]]["record_sha256"] == r["record_sha256"] and rows[r["entry"]]["counterparty"] == "site-b"
        assert rows[r["entry"]]["created_at"] == entries[r["entry"]].charged_at

    # the ledger the daemon wrote, audited from docs/wire.md section 9 alone: every chain
    # recomputes, reaches its anchor, and holds each receipt's signed position
    proc, found = audit(a.ledger, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert found["project_modules_loaded"] == [] and found["anchored"] == found["heads"]
    assert set(found["heads"]) == {"charges", "served_again", "events"}
    for r in [*releases.values(), again]:
        assert found["charge_hashes"][str(r["ledger_seq"])] == r["ledger_head"]
    assert found["heads"]["served_again"][0] == int(again["served_again"])
    # one byte of the merge's stored record changed (a digit of its release_sha256): refused
    copy = tmp_path / "copy.sqlite"
    shutil.copy(a.ledger, copy)
    shutil.copy(str(a.ledger) + ".anchor", str(copy) + ".anchor")
    digest = next(
        json.loads(e.record.canonical_json())["parameters"]["release_sha256"]
        for e in entries.values()
        if e.level == "data"
    )
    stored = f'"release_sha256":"{digest}"'.encode()
    flip_one_byte(copy, stored, stored[:-2] + (b"0" if stored[-2:-1] != b"0" else b"1") + b'"')
    proc, _ = audit(copy, tmp_path)
    assert proc.returncode == 1 and f"charges: the hash of charge {releases['merged']['entry']}" in proc.stderr
