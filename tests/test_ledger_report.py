"""``privfusion ledger report``: the audit page of a ledger written by real charges, its numbers
against independent references (dp-accounting's RDP conversion on closed-form RDP curves), its
receipt checks against receipts signed with a real site key, a tampered and a cut ledger, HTML
escaping, the command as a subprocess, and the page as headless Chromium renders it."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ledger_reference import filter_spent, gaussian_rdp, gaussian_record, laplace_rdp, laplace_record
from peer_harness import cli

from peer.base.errors import InvalidArgument
from peer.budget.ledger import Ledger
from peer.budget.policy import Policy
from peer.cli.ledger_report import (
    PROTECTION,
    STATUS_BAD_SIGNATURE,
    STATUS_DIFFERS,
    STATUS_NOT_IN_LEDGER,
    STATUS_OTHER_SIGNER,
    STATUS_UNCHECKED,
    STATUS_VERIFIED,
    collect,
    write_report,
)
from peer.dp.accounting.release_accounting import dpsgd_record
from peer.net.identity import CERT_FILE, init_identity
from peer.net.receipts import Manifest, TensorEntry, sign_receipt
from privfusion.v1 import tensor_pb2 as tpb

EVIL = "<script>alert('x')</script>"
MODEL_TOTAL, PER_CP, DATA = (8.0, 1e-5), (6.0, 1e-5), (8.0, 1e-5)


def policy() -> Policy:
    return Policy.from_mapping(
        {
            "peers": {"*": {"allow": ["features", "weights", "merge", "fuse", "ledger"]}},
            "model": {
                "total": {"epsilon": MODEL_TOTAL[0], "delta": MODEL_TOTAL[1]},
                "per_counterparty": {"epsilon": PER_CP[0], "delta": PER_CP[1]},
            },
            "data": {"unit": "record:add-remove", "epsilon": DATA[0], "delta": DATA[1]},
        }
    )


def full_batch(noise_multiplier: float, steps: int):
    from peer.dp.accounting import TrainingRecord

    return TrainingRecord.constant(
        "add-remove", steps, learning_rate=0.1, clip_norm=1.0, noise_multiplier=noise_multiplier
    )


def manifest() -> Manifest:
    data = np.arange(2, dtype="<f4").tobytes()
    tensor = TensorEntry("w", tpb.DType.Value("DTYPE_FLOAT32"), (2,), len(data), hashlib.sha256(data).digest())
    return Manifest("weights", "mlp-a", "", "{}", (tensor,), len(data))


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """A site "hospital-a" with a key, and a ledger written by real charges: Gaussian and
    Laplace model-level releases to two counterparties (one named like a script tag), a DP-SGD
    data-level release served again to a third, a cancelled charge, delivery events; and the
    receipts its counterparties hold, signed with its key."""
    d = tmp_path_factory.mktemp("site")
    ident = init_identity(d / "identity", "hospital-a")
    db = d / "ledger.sqlite"
    with Ledger(db, policy()) as led:
        g1 = led.charge(gaussian_record(subject="mlp-a", noise_std=6.0), "hospital-b")
        lap = led.charge(laplace_record(subject="mlp-a", epsilon=0.5), EVIL)
        sgd = led.charge(dpsgd_record(full_batch(6.0, steps=20), 1e-5, subject="pool/m0"), "hospital-b")
        g2 = led.charge(gaussian_record(subject="mlp-a", noise_std=8.0), "hospital-b")
        gone = led.charge(laplace_record(subject="mlp-a", epsilon=0.25), "hospital-c")
        led.cancel(gone.release_id, "the partner refused")
        for e in (g1, lap, sgd, g2):
            led.record_event(e.release_id, "sent")
        served = led.serve_again(sgd.release_id, "hospital-c")
        orders = led.orders

        def receipt(entry, **kw):
            seq, head = led.chain_position(entry.entry_id, kw.get("served_again"))
            return sign_receipt(
                ident,
                str(entry.entry_id),
                entry.record,
                manifest(),
                ledger_seq=seq,
                ledger_head=bytes.fromhex(head),
                **kw,
            )

        good = {
            "g1": receipt(g1),
            "lap": receipt(lap),
            "sgd": receipt(sgd),
            "served": receipt(sgd, served_again=str(served["id"]), served_to="hospital-c"),
        }
    # a receipt without the ledger's position (the previous version's layout) still verifies
    good["g2"] = sign_receipt(ident, str(g2.entry_id), g2.record, manifest())
    return {
        "dir": d,
        "db": db,
        "cert": d / "identity" / CERT_FILE,
        "ident": ident,
        "orders": orders,
        "entries": {"g1": g1, "lap": lap, "sgd": sgd, "g2": g2, "gone": gone},
        "served": served,
        "good": good,
    }


def round_report(path: Path, receipts) -> Path:
    """A round report as ``privfusion round`` writes it: every receipt received, as JSON."""
    path.write_text(json.dumps({"charges": [{"peer": r.signer, "receipt": r.to_json()} for r in receipts]}))
    return path


def copy_site(site, tmp_path) -> Path:
    """The ledger and its anchor, copied (a tampering test must not touch the shared one)."""
    for name in ("ledger.sqlite", "ledger.sqlite.anchor"):
        shutil.copy(site["dir"] / name, tmp_path / name)
    return tmp_path / "ledger.sqlite"


# ---- the numbers ---------------------------------------------------------------------------------


def test_every_budget_over_time_ends_at_the_ledgers_figure_and_matches_dp_accounting(site):
    """Each curve point is the filter's ε of the charges so far, recomputed here from
    closed-form RDP (Gaussian: α/(2σ²); Laplace: Mironov's Prop. 6; full-batch DP-SGD: T·α/(2σ²))
    through dp-accounting's RDP → (ε, δ) conversion; the last point is ``ledger show``'s."""
    report = collect(site["db"])
    assert report.chain_ok and not report.problems
    orders = site["orders"]
    g6, g8 = gaussian_rdp(orders, 1.0, 6.0), gaussian_rdp(orders, 1.0, 8.0)
    lap = laplace_rdp(orders, 3.0, 3.0 / 0.5)  # laplace_record: shape (4, 3), clip [0, 1], per neuron
    sgd = 20 * gaussian_rdp(orders, 1.0, 6.0)
    expected = {
        "model/mlp-a/total": [(g6, math.inf), (g6 + lap, math.inf), (g6 + lap + g8, math.inf)],
        "model/mlp-a/peer/hospital-b": [(g6, math.inf), (g6 + g8, math.inf)],
        f"model/mlp-a/peer/{EVIL}": [(lap, 0.5)],
        "data/record:add-remove": [(sgd, math.inf)],
    }
    delta = {"model/mlp-a/total": MODEL_TOTAL[1], "data/record:add-remove": DATA[1]}
    budgets = {b["budget"]: b for b in report.summary["budgets"]}
    assert set(report.timelines) == set(expected) == set(budgets)
    for name, steps in expected.items():
        got = [eps for _, eps in report.timelines[name]]
        want = [filter_spent(orders, rdp, pure, delta.get(name, PER_CP[1])) for rdp, pure in steps]
        assert got == pytest.approx(want, rel=1e-9), name
        assert got[-1] == pytest.approx(budgets[name]["spent_epsilon_filter"], rel=1e-12), name
    # the cancelled charge is in no sum, but it is listed, marked
    cancelled = [e for e in report.entries if e["cancelled"]]
    assert [e["release_id"] for e in cancelled] == [site["entries"]["gone"].release_id]


def test_spending_per_counterparty(site):
    """Model level: the ledger's own per-counterparty budgets. Data level: each counterparty's
    data-level releases composed by the filter at the data budget's δ (here the one DP-SGD
    release to hospital-b; serving it again to hospital-c costs nothing and is not a row)."""
    report = collect(site["db"])
    rows = {(r["counterparty"], r["scope"].split(",")[0]): r for r in report.spending}
    states = {b["counterparty"]: b for b in report.summary["budgets"] if b["counterparty"]}
    assert set(rows) == {("hospital-b", "model mlp-a"), (EVIL, "model mlp-a"), ("hospital-b", "data level")}
    for cp in ("hospital-b", EVIL):
        assert rows[(cp, "model mlp-a")]["epsilon_filter"] == states[cp]["spent_epsilon_filter"]
        assert rows[(cp, "model mlp-a")]["releases"] == states[cp]["count"]
    sgd = 20 * gaussian_rdp(site["orders"], 1.0, 6.0)
    data_row = rows[("hospital-b", "data level")]
    assert data_row["releases"] == 1
    assert data_row["epsilon_filter"] == pytest.approx(filter_spent(site["orders"], sgd, math.inf, DATA[1]), rel=1e-9)


# ---- receipts ----------------------------------------------------------------------------------


def test_receipts_signed_by_the_site_verify_and_match_the_ledger(site, tmp_path):
    good = site["good"]
    path = round_report(tmp_path / "round-1.json", [good["g1"], good["lap"], good["sgd"], good["served"]])
    (tmp_path / "g2.json").write_text(good["g2"].to_json())
    report = collect(site["db"], receipts=[tmp_path], cert=site["cert"])
    assert report.site == "hospital-a"
    assert not report.problems, report.problems
    assert [c.status for c in report.receipts] == [STATUS_VERIFIED] * 5
    assert {c.source for c in report.receipts} >= {f"{path} (charges[0])", f"{tmp_path / 'g2.json'}"}
    served = [c for c in report.receipts if c.served_again]
    assert [(c.served_again, c.recipient) for c in served] == [(str(site["served"]["id"]), "hospital-c")]


def test_each_kind_of_bad_receipt_is_named_and_is_a_problem(site, tmp_path):
    """A flipped signature, a signed receipt for a release this ledger never charged (what a cut
    ledger looks like to a counterparty), one whose record differs from the entry's, one naming
    another chain position; a receipt of another signer is listed, not checked."""
    import dataclasses

    good, ident = site["good"], site["ident"]
    bad_sig = dataclasses.replace(good["g1"], signature=good["lap"].signature)
    ghost = sign_receipt(ident, "99", gaussian_record(subject="mlp-a", noise_std=7.0), manifest())
    g1 = site["entries"]["g1"]
    other_record = sign_receipt(ident, str(g1.entry_id), g1.record.with_(epsilon=g1.record.epsilon / 2), manifest())
    wrong_position = sign_receipt(
        ident, str(g1.entry_id), g1.record, manifest(), ledger_seq=g1.entry_id + 1, ledger_head=b"\x01" * 32
    )
    gone = site["entries"]["gone"]
    cancelled = sign_receipt(ident, str(gone.entry_id), gone.record, manifest())
    ghost_forged = dataclasses.replace(ghost, signature=good["lap"].signature)
    other_dir = tmp_path / "other"
    other = sign_receipt(init_identity(other_dir, "hospital-z"), "1", gaussian_record(subject="m"), manifest())
    path = round_report(
        tmp_path / "round-2.json", [bad_sig, ghost, other_record, wrong_position, other, cancelled, ghost_forged]
    )
    report = collect(site["db"], receipts=[path], cert=site["cert"])
    statuses = [(c.status, c.problem) for c in report.receipts]
    assert statuses == [
        (STATUS_BAD_SIGNATURE, True),
        (STATUS_NOT_IN_LEDGER, True),
        (STATUS_DIFFERS, True),
        (STATUS_DIFFERS, True),
        (STATUS_OTHER_SIGNER, False),
        (STATUS_DIFFERS, True),
        (STATUS_BAD_SIGNATURE, True),
    ]
    assert "record it signs is not the one entry" in report.receipts[2].detail
    assert f"signs chain position {g1.entry_id + 1}" in report.receipts[3].detail
    assert f"entry {gone.entry_id} was cancelled" in report.receipts[5].detail
    assert report.chain_ok
    assert len(report.problems) == 1 and "6 receipt(s) contradict the ledger" in report.problems[0]
    # every receipt is on the page: by its release's row, or among those matching none
    out = tmp_path / "report"
    write_report(site["db"], out, receipts=[path], cert=site["cert"])
    page = (out / "index.html").read_text()
    for c in report.receipts:
        assert html_escaped(f"{c.source}") in page, c.source
    unmatched = page[page.index('<h2 id="receipts">') :]
    assert ghost.record.release_id in unmatched and ghost_forged.record.release_id in unmatched
    assert "hospital-z" in unmatched


def test_without_a_certificate_nothing_is_proven(site, tmp_path):
    """The cross-check runs, but an unsigned claim is never a problem nor a "verified"."""
    ghost = sign_receipt(site["ident"], "99", gaussian_record(subject="mlp-a"), manifest())
    path = round_report(tmp_path / "r.json", [site["good"]["g1"], ghost])
    report = collect(site["db"], receipts=[path])
    assert [(c.status, c.problem) for c in report.receipts] == [
        (STATUS_UNCHECKED, False),
        (STATUS_NOT_IN_LEDGER, False),
    ]
    assert not report.problems
    assert any("receipts are not verified" in n for n in report.notes)


def test_a_named_file_without_receipts_is_refused_by_name(site, tmp_path):
    bad = tmp_path / "notes.json"
    bad.write_text('{"hello": 1}')
    with pytest.raises(InvalidArgument, match=re.escape(str(bad))):
        collect(site["db"], receipts=[bad])
    # in a directory it is skipped, and the page says so
    report = collect(site["db"], receipts=[tmp_path])
    assert report.skipped == [f"{bad}: holds no receipt"]


# ---- the page ------------------------------------------------------------------------------------


def test_the_page_is_self_contained_escaped_and_writes_its_pngs(site, tmp_path):
    out = tmp_path / "report"
    report = write_report(site["db"], out)
    page = (out / "index.html").read_text()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["budget-01.png", "budget-02.png", "budget-03.png", "budget-04.png", "counterparties.png"]
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert page.count('src="data:image/png;base64,') == len(pngs)
    assert not re.search(r"<script|src=\"(?!data:)|href=", page, re.IGNORECASE), "nothing outside the page"
    assert html_escaped(EVIL) in page and EVIL not in page
    assert 'id="verdict"' in page and "banner good" in page and "banner bad" not in page
    for e in report.entries:
        assert e["release_id"] in page
        assert html_escaped(e["record_json"]) in page
    for heading, paragraphs in PROTECTION:
        assert html_escaped(heading) in page
        assert all(html_escaped(p) in page for p in paragraphs)
    # writing again replaces the earlier report; a directory holding anything else is refused
    write_report(site["db"], out)
    (out / "mine.txt").write_text("x")
    with pytest.raises(InvalidArgument, match=r"mine\.txt"):
        write_report(site["db"], out)


def html_escaped(text: str) -> str:
    import html

    return html.escape(text, quote=True)


def test_without_matplotlib_the_page_says_so_and_has_no_figures(site, tmp_path, monkeypatch):
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib... raises ImportError
    out = tmp_path / "report"
    write_report(site["db"], out)
    page = (out / "index.html").read_text()
    assert "matplotlib is not installed" in page and "data:image/png" not in page
    assert not list(out.glob("*.png"))


def tamper_epsilon(path: Path) -> None:
    """Rewrite one charge's ε in place, as someone with write access to the file would."""
    con = sqlite3.connect(path)
    try:
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            con.execute(f"DROP TRIGGER {name}")
        con.execute("UPDATE charges SET epsilon = epsilon / 10 WHERE seq = 1")
        con.commit()
    finally:
        con.close()


def cut_last_charge(path: Path) -> None:
    """Drop the last charge and rewrite every total to the sums of what is left (the chain then
    verifies on its own; only the anchor and the receipts show the cut)."""
    con = sqlite3.connect(path)
    try:
        for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'").fetchall():
            con.execute(f"DROP TRIGGER {name}")
        (last,) = con.execute("SELECT MAX(seq) FROM charges").fetchone()
        for table in ("cancellations", "charge_budgets", "charge_models", "charges"):
            con.execute(f"DELETE FROM {table} WHERE seq = ?", (last,))
        con.commit()
    finally:
        con.close()


def test_the_command_as_a_subprocess(site, tmp_path):
    """Exit 0 and "verified" for a ledger that verifies with its receipts; exit 1, the page
    still written with a red banner, when a receipt contradicts it."""
    good = round_report(tmp_path / "good.json", list(site["good"].values()))
    out = tmp_path / "report"
    r = cli("ledger", "report", "--db", site["db"], "--out", out, "--receipts", good, "--cert", site["cert"])
    assert r.returncode == 0, r.stderr
    assert "5 receipt(s) checked" in r.stdout and "verified: the chain, and every receipt agrees" in r.stdout
    assert "banner good" in (out / "index.html").read_text()

    ghost = sign_receipt(site["ident"], "99", gaussian_record(subject="mlp-a"), manifest())
    bad = round_report(tmp_path / "bad.json", [ghost])
    r = cli(
        "ledger", "report", "--db", site["db"], "--out", out, "--receipts", bad, "--cert", site["cert"], check=False
    )
    assert r.returncode == 1
    assert "NOT VERIFIED: 1 receipt(s) contradict the ledger" in r.stderr
    page = (out / "index.html").read_text()
    assert "banner bad" in page and html_escaped(STATUS_NOT_IN_LEDGER) in page


def run_main(capsys, *args) -> tuple[int, str, str]:
    """``privfusion ARGS`` in this process (peer.cli.app.main: its exit status and output)."""
    from peer.cli.app import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_missing_ledger_is_an_error_naming_the_file(tmp_path, capsys):
    code, _, err = run_main(capsys, "ledger", "report", "--db", tmp_path / "none.sqlite", "--out", tmp_path / "x")
    assert code == 2 and "--db" in err and "none.sqlite" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "tamper,words", [(tamper_epsilon, "hash chain broken at entry 1"), (cut_last_charge, "behind its anchor")]
)
def test_a_tampered_or_cut_ledger_gets_a_red_banner_and_exit_1(site, tmp_path, capsys, tamper, words):
    db = copy_site(site, tmp_path)
    tamper(db)
    out = tmp_path / "report"
    code, stdout, stderr = run_main(capsys, "ledger", "report", "--db", db, "--out", out)
    assert code == 1, stdout + stderr
    assert "NOT VERIFIED: the ledger does not verify" in stderr and words in stderr
    page = (out / "index.html").read_text()
    verdict = page[page.index('id="verdict"') - 40 : page.index("<h1>")]
    assert "banner bad" in verdict and "NOT VERIFIED" in verdict and html_escaped(words) in verdict
    assert "banner good" not in page
    # and under every heading whose figures come from the file: red, saying so
    for section in ("budgets", "over-time", "counterparties", "releases"):
        after = page[page.index(f'<h2 id="{section}">') :]
        assert after.split("</h2>", 1)[1].lstrip().startswith('<div class="banner bad">From a ledger that does not')


def test_a_policy_gives_the_limits_and_names_the_site(site, tmp_path):
    """``--policy site.toml``: the [policy] limits (as for ``ledger show --policy``), the site's
    name from [site], and its certificate from [site] identity."""
    db = copy_site(site, tmp_path)
    shutil.copytree(site["dir"] / "identity", tmp_path / "identity")
    (tmp_path / "site.toml").write_text(
        '[site]\nname = "hospital-a"\nidentity = "identity"\n\n'
        '[policy.peers."*"]\nallow = ["features", "weights", "merge", "fuse", "ledger"]\n'
        "[policy.model.total]\nepsilon = 20.0\ndelta = 1e-5\n"
        "[policy.model.per_counterparty]\nepsilon = 6.0\ndelta = 1e-5\n"
        '[policy.data]\nunit = "record:add-remove"\nepsilon = 8.0\ndelta = 1e-5\n'
    )
    good = round_report(tmp_path / "good.json", [site["good"]["g1"]])
    report = collect(db, policy=tmp_path / "site.toml", receipts=[good])
    assert report.site == "hospital-a" and report.certificate.endswith(CERT_FILE)
    assert [c.status for c in report.receipts] == [STATUS_VERIFIED]
    total = next(b for b in report.summary["budgets"] if b["budget"] == "model/mlp-a/total")
    assert total["epsilon_limit"] == 20.0


# ---- what a reader sees: headless Chromium -------------------------------------------------------


def chromium() -> str:
    """Debian's chromium (scripts/test.sh installs it as root); under CI its absence fails."""
    exe = shutil.which("chromium")
    if exe is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is missing under CI: scripts/test.sh installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed (scripts/test.sh installs it as root with apt-get)")
    return exe


def render(exe: str, page: Path, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            exe,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={profile}",
            *args,
            page.resolve().as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def visible_text(dom: str) -> str:
    """The text of the rendered DOM, tags dropped, entities read, whitespace folded."""
    import html

    dom = re.sub(r"<style.*?</style>", " ", dom, flags=re.DOTALL)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


def test_chromium_renders_what_a_reader_must_see(site, tmp_path, tmp_path_factory, record_property):
    """Headless Chromium's DOM holds the summary, the budgets and the releases (the escaped
    name read back as text, not run as a script); its screenshots show a green banner for the
    ledger that verifies and a red one for a tampered copy. The screenshots are kept as test
    artefacts (the path is printed: ``pytest -rP``)."""
    from PIL import Image

    exe = chromium()
    keep = tmp_path_factory.mktemp("ledger-report-screenshots")
    good_receipts = round_report(tmp_path / "good.json", list(site["good"].values()))
    tampered = copy_site(site, tmp_path)
    tamper_epsilon(tampered)
    for name, db, receipts, rgb in (
        ("verified", site["db"], [good_receipts], (0x1B, 0x5E, 0x20)),
        ("tampered", tampered, [good_receipts], (0xB0, 0x00, 0x20)),
    ):
        out = tmp_path / f"report-{name}"
        report = write_report(db, out, receipts=receipts, cert=site["cert"])
        dom = render(exe, out / "index.html", tmp_path / f"profile-{name}", "--dump-dom").stdout
        text = visible_text(dom)
        assert "Ledger audit report — hospital-a" in text
        assert f"ledger file {db}" in text
        for b in report.summary["budgets"]:
            assert b["budget"] in text and b["scope"] in text
        assert "spent ε filter" in text and "spent ε PLD" in text and "remaining ε" in text
        for e in report.entries:
            assert e["release_id"] in text
        assert EVIL in text  # read as text: escaped in the source
        assert "What is not protected, or rests on an assumption" in text
        if name == "verified":
            assert "Verified: the ledger's chain verifies and every receipt given agrees with it." in text
            assert text.count(STATUS_VERIFIED) >= 5
        else:
            assert "NOT VERIFIED" in text and "hash chain broken at entry 1" in text
            assert f"{STATUS_VERIFIED} (against a ledger that does not verify)" in text
        shot = keep / f"ledger-report-{name}.png"
        render(exe, out / "index.html", tmp_path / f"profile-{name}", f"--screenshot={shot}", "--window-size=1280,2000")
        image = Image.open(shot).convert("RGB")
        assert image.size == (1280, 2000)
        banner = image.getpixel((640, 30))  # the verdict banner spans the top of the page
        assert all(abs(a - b) <= 8 for a, b in zip(banner, rgb, strict=True)), (name, banner)
        record_property(f"screenshot_{name}", str(shot))
        print(f"ledger report screenshot ({name}): {shot}")


# ---- a real release through a daemon -------------------------------------------------------------


def test_a_release_served_by_a_real_daemon_is_verified_from_the_saved_receipt(tmp_path):
    """site-a's daemon charges and signs a weights release to site-b, which saves it; the report
    on site-a's ledger, with site-a's site.toml (its name, its certificate) and the saved
    release's JSON, finds the receipt verified, chain position included."""
    from peer_harness import client, make_site, pin_each_other, running

    from peer.net.client import save_release

    a = make_site(tmp_path, "site-a", seed=3)
    b = make_site(tmp_path, "site-b", models={})
    pin_each_other(a, b)
    with running(a) as (_, address), client(b, address) as c:
        got = c.weights("mlp", epsilon=2.0, delta=1e-5)
    _, doc = save_release(got, tmp_path / "got" / "mlp-a")
    assert got.receipt.ledger_seq >= 1  # the daemon signs its ledger's position
    report = write_report(a.ledger, tmp_path / "audit", receipts=[doc], policy=a.config)
    assert report.site == "site-a" and not report.problems, report.problems
    (check,) = report.receipts
    assert (check.status, check.release_id, check.recipient) == (
        STATUS_VERIFIED,
        got.receipt.record.release_id,
        "site-b",
    )
    assert "chain position" in check.detail
    page = (tmp_path / "audit" / "index.html").read_text()
    assert "banner good" in page and got.receipt.record.release_id in page
