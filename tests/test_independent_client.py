"""The contract can be implemented from the spec alone: an independent client (tests/independent_client.py,
built from the .proto files and docs/wire.md, run in its own process with none of the project's
modules imported) gets a features, a weights and a merged release from a real daemon over mutual
TLS, reassembles them and verifies receipts and manifests offline; what it reports agrees with
the daemon's ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from peer_harness import make_pool, make_site, pin_each_other, running

from peer.budget.ledger import Ledger

ROOT = Path(__file__).resolve().parent.parent


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
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of the project on the path
    with running(a) as (_, address):
        config["address"] = address
        (tmp_path / "config.json").write_text(json.dumps(config))
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "independent_client.py"), str(tmp_path / "config.json"), str(out)],
            cwd=tmp_path,
            env=env,
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
