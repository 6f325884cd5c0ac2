"""No traps in the configuration: what ``privfusion site new`` writes works, as a user runs it.

Every test drives the ``privfusion`` command as a subprocess in a temporary directory (site
new, model/pool train, round, peer serve, site check), editing site.toml as an operator would.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from peer_harness import (
    LABEL,
    SiteFiles,
    cli,
    client,
    holds_count,
    make_site,
    pin_each_other,
    running,
    write_records,
)

from coordinator_free.roster import write_roster


def new_site(root: Path, name: str = "hospital-a", *extra: str) -> Path:
    d = root / name
    cli("site", "new", "--name", name, "--dir", str(d), "--listen", "127.0.0.1:0", "--address", "127.0.0.1", *extra)
    return d


def documented_iterate(text: str) -> str:
    """The iterate round file of docs/deployment.md (section 3.1), as a user copies it."""
    block = re.search(r"```toml\n(# iterate\.toml.*?)```", text, re.S)
    assert block, "docs/deployment.md has no iterate.toml block"
    return block[1]


# ------------------------------------------------------------------------------ 1. site new's budgets


def test_a_fresh_site_admits_its_documented_pool_merges_and_iterate_run(tmp_path):
    """Before: ``site new`` wrote a replace-one data budget; the documented iterate run (add-remove,
    its default) was refused ("the site's policy needs a [policy.data] budget in that unit"), and
    after switching the budget to add-remove, merges of pools trained by ``pool train``'s
    defaults (replace-one) were refused. Now a fresh site's budget is add-remove, ``pool train
    --site`` trains in the site's unit (declared n = [site] declared_records, no true count in
    any record), a merge at a round's default target (2, 1e-5) is served, and the documented
    iterate run goes through, every segment charged to the same budget."""
    d = new_site(tmp_path)
    records = write_records(tmp_path / "records.csv", 240, 1)
    public = write_records(tmp_path / "public.csv", 120, 2)
    common = ("--site", str(d), "--data", str(records), "--label", LABEL, "--public", str(public))
    cli("model", "train", *common, "--name", "mlp", "--epochs", "5")
    cli("pool", "train", *common, "--architecture", '{"kind": "mlp", "hidden": [64]}')
    for manifest in sorted((d / "pool").glob("dpsgd-*.json")):
        record = json.loads(manifest.read_text())["metadata"]["record"]
        assert record["unit"] == "record:add-remove", manifest.name
        params = record["parameters"]
        assert (params["dataset_size"], params["dataset_size_source"]) == (1000, "declared"), manifest.name
        # no true count (240 records, 192 after the validation split) anywhere in the manifest: as
        # a number or a word — not as digits inside another number or a digest (a SHA-256 with
        # "…0c24051e…" failed the substring test once: the pool's noise is fresh from the CSPRNG,
        # so such digits come and go between runs)
        assert not holds_count(json.loads(manifest.read_text()), (240, 192)), manifest.name

    # a peer asks for an RS merge at a round's default target: admitted and charged to the data budget
    site = SiteFiles("hospital-a", d, d / "site.toml", d / "identity")
    peer = make_site(tmp_path, "hospital-b", models={})
    pin_each_other(site, peer)
    with running(site) as (_, address), client(peer, address, peer="hospital-a") as c:
        merged = c.merged("dpsgd", method="rs", epsilon=2.0, delta=1e-5)
        assert merged.receipt.record.unit == "record:add-remove"

    # the documented iterate run on another fresh site (the run's noise is calibrated to the whole
    # (4, 1e-5) budget, which the merge above has partly spent), alone in its roster
    d = new_site(tmp_path, "hospital-c")
    cli("model", "train", *common[:1], str(d), *common[2:], "--name", "mlp", "--epochs", "5")
    write_roster(d / "roster.toml", [("hospital-c", "127.0.0.1:1", "identity/site.crt")])
    docs = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text(encoding="utf-8")
    round_file = documented_iterate(docs).replace('records = "records.csv"', f'records = "{records}"')
    (d / "iterate.toml").write_text(round_file.replace("rounds = 20", "rounds = 3"), encoding="utf-8")
    proc = cli("round", "--config", str(d / "site.toml"), "--round", str(d / "iterate.toml"), check=False)
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(cli("ledger", "show", "--db", str(d / "ledger.sqlite"), "--json", "--no-pld").stdout)
    segments = [e for e in shown["entries"] if e["mechanism"] == "dpsgd"]
    assert len(segments) == 3 and {e["unit"] for e in segments} == {"record:add-remove"}, proc.stdout
    assert "iterate run iterate: finished (all 3 rounds done)" in proc.stdout, proc.stdout


def test_a_replace_one_site_trains_replace_one_pools(tmp_path):
    """``site new --adjacency replace-one``: the data budget and ``pool train --site``'s default
    unit are replace-one (n = the true count, public there); an explicit --adjacency still wins
    and a pool in the other unit is the operator's choice."""
    d = new_site(tmp_path, "hospital-a", "--adjacency", "replace-one")
    assert 'unit = "record:replace-one"' in (d / "site.toml").read_text()
    records = write_records(tmp_path / "records.csv", 100, 1)
    public = write_records(tmp_path / "public.csv", 60, 2)
    cli("pool", "train", "--site", str(d), "--data", str(records), "--label", LABEL, "--public", str(public),
        "--steps", "3")  # fmt: skip
    record = json.loads((d / "pool" / "dpsgd-a.json").read_text())["metadata"]["record"]
    assert record["unit"] == "record:replace-one" and record["parameters"]["dataset_size_source"] == "count"


# ------------------------------------------------------------------------------ 2. budgets edited in site.toml


def charge_merge(site_toml: Path, noise: float, release_id: str) -> None:
    """What the daemon does for one RS merge of a one-model pool (add-remove, declared n):
    charge its record to the site's ledger under the site's policy."""
    from peer.budget.ledger import Ledger
    from peer.budget.policy import Policy
    from peer.dp.accounting import TrainingRecord
    from peer.dp.accounting.release_accounting import rs_merge_record
    from peer.net.site import SiteConfig

    training = TrainingRecord.constant("add-remove", 10, 1.0, 1.0, noise, 1.0)
    record = rs_merge_record([training], [1.0], 1e-5, names=["pool/m"], subject="pool").with_(release_id=release_id)
    with Ledger(SiteConfig.load(site_toml).ledger, Policy.from_toml(site_toml)) as ledger:
        ledger.charge(record, "hospital-b", kind="merge")


def set_data_epsilon(site_toml: Path, epsilon: float) -> None:
    text = site_toml.read_text()
    edited = re.sub(r"(?m)^epsilon = [0-9.]+( +# all data-level)", f"epsilon = {epsilon}\\1", text)
    assert edited != text
    site_toml.write_text(edited)


def test_a_budget_edited_in_site_toml_is_applied_and_said_at_start_and_by_site_check(tmp_path):
    """Before: raising [policy.data] epsilon after charges changed what the next charge admitted
    without a word anywhere (``ledger show`` went on showing the old limit). Now ``site check``
    and the daemon's start say, for the budget, the recorded and the new limits; the next charge
    is admitted under the new limit and records it in the ledger; a limit lowered to or below
    what is spent makes the budget exhausted (every further release refused), and says so."""
    from peer.base.errors import BudgetExhausted

    d = new_site(tmp_path)
    toml = d / "site.toml"
    charge_merge(toml, 5.0, "first")  # ε ≈ 3.2 by the filter's figure: within the template's 4
    with pytest.raises(BudgetExhausted):
        charge_merge(toml, 5.0, "second")  # a second does not fit 4
    checked = cli("site", "check", "--site", str(d))
    assert "budget: " not in checked.stdout  # nothing changed yet

    set_data_epsilon(toml, 8.0)
    checked = cli("site", "check", "--site", str(d))
    said = [line for line in checked.stdout.splitlines() if line.startswith("budget: ")]
    assert len(said) == 1 and "data/record:add-remove" in said[0], checked.stdout
    assert "from (ε=4, δ=1e-05)" in said[0] and "to (ε=8, δ=1e-05)" in said[0] and "next charge" in said[0]
    # the daemon says it too, as it starts (its log: one JSON object per line on stderr)
    log = serve_until_ready(d)
    changed = [e for e in log if e.get("event") == "budget-limits-changed"]
    assert len(changed) == 1 and changed[0]["level"] == "warning" and "to (ε=8" in changed[0]["detail"]
    # applied: the second merge now fits, and the ledger records the new limit with it
    charge_merge(toml, 5.0, "second")
    shown = json.loads(cli("ledger", "show", "--db", str(d / "ledger.sqlite"), "--json", "--no-pld").stdout)
    assert [b["epsilon_limit"] for b in shown["budgets"]] == [8.0]
    assert "budget: " not in cli("site", "check", "--site", str(d)).stdout  # recorded now: no change left

    set_data_epsilon(toml, 1.0)  # below the ε already spent
    checked = cli("site", "check", "--site", str(d))
    assert "is exhausted, every further release to it is refused" in checked.stdout, checked.stdout
    with pytest.raises(BudgetExhausted):
        charge_merge(toml, 1000.0, "third")  # even a nearly free release


def serve_until_ready(d: Path) -> list[dict]:
    """``privfusion peer serve`` of site ``d`` until it is ready, then SIGTERM: its log lines."""
    ready = d / "ready.json"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "peer",
            "serve",
            "--config",
            str(d / "site.toml"),
            "--ready-file",
            str(ready),
        ],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.stderr.read() if proc.poll() is not None else "not ready in 120 s"
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    lines = []
    for line in err.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:
            lines.append({"text": line})
    return lines


# ------------------------------------------------------------------------------ 3. site check = peer serve's checks


def error_line(proc: subprocess.CompletedProcess) -> str:
    """The one error line of a refused command (after ``privfusion COMMAND: error: ``)."""
    lines = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(lines) == 1, proc.stderr
    return lines[0].partition(": error: ")[2]


def test_site_check_refuses_what_peer_serve_refuses_with_the_same_words(tmp_path):
    """Before: ``site check`` read only the file lists and exited 0 on a typo in site.toml, a
    corrupt model or a missing key, all of which ``peer serve`` refuses (or leaves out). Now it
    runs the daemon's own start-up checks: exit 2 with ``peer serve``'s very refusal where the
    daemon would not start, 1 where it would start but leave out a file that exists, 0 (saying
    what it checked) for a fresh site, whose empty pool and missing probe set are "not yet"."""
    d = new_site(tmp_path)
    toml = d / "site.toml"
    fresh = cli("site", "check", "--site", str(d))
    assert "checked, as privfusion peer serve does" in fresh.stdout and "not yet: pool" in fresh.stdout
    assert not (d / "ledger.sqlite").exists() and not (d / "ledger.sqlite.anchor").exists()  # writes nothing

    def refused_alike() -> str:
        checked = cli("site", "check", "--site", str(d), check=False)
        served = cli("peer", "serve", "--config", str(toml), check=False)
        assert (checked.returncode, served.returncode) == (2, 2), (checked.stderr, served.stderr)
        assert error_line(checked) == error_line(served)
        return error_line(checked)

    original = toml.read_text()
    toml.write_text(original.replace('models = "models" ', 'modles = "models" ', 1))  # a typo in [site]
    line = original.splitlines().index(next(x for x in original.splitlines() if x.startswith('models = "models"'))) + 1
    assert f"site.modles ({toml}, line {line}): unknown key" in refused_alike()
    toml.write_text(original.replace("show_remaining = ", "show_remainig = ", 1))  # a typo in [policy]
    assert "policy.show_remainig" in refused_alike() and "unknown key" in refused_alike()
    toml.write_text(original)

    (d / "identity" / "site.key").rename(d / "site.key.away")  # a missing identity file
    assert "has no site.key/site.crt" in refused_alike()
    (d / "site.key.away").rename(d / "identity" / "site.key")

    (d / "ledger.sqlite").write_bytes(b"not a ledger" * 100)  # a corrupt ledger
    assert "is not a PrivFusion ledger" in refused_alike()
    (d / "ledger.sqlite").unlink()

    (d / "models" / "bent.json").write_text("{not json")  # a corrupt model: served without it
    (d / "models" / "bent.safetensors").write_bytes(b"")
    checked = cli("site", "check", "--site", str(d), check=False)
    assert checked.returncode == 1 and "not served: models/bent.json: does not load" in checked.stdout
    as_json = cli("site", "check", "--site", str(d), "--json", check=False)
    assert as_json.returncode == 1 and "models/bent.json" in [e["path"] for e in json.loads(as_json.stdout)]


# ------------------------------------------------------------------------------ 4. the daemon says what it does


def test_the_daemon_logs_each_step_of_its_start(tmp_path):
    """Before: ``peer serve`` said nothing between its start and "serving" (two silent minutes
    under load, while it loaded pools and verified the ledger). Now each step is a log line, in
    order, each with its duration once done."""
    d = new_site(tmp_path)
    events = [e["event"] for e in serve_until_ready(d) if "event" in e]
    steps = ["starting", "loading-models", "models-loaded", "opening-ledger", "ledger-verified", "site-loaded"]
    steps += ["binding", "serving"]
    assert [e for e in events if e in steps] == steps, events


# ------------------------------------------------------------------------------ 5. no torch where none is needed

#: ``python -c NO_TORCH ARGS`` runs ``privfusion ARGS`` with torch unimportable (a finder first
#: on sys.meta_path refuses it), as on a machine or in a container without it
NO_TORCH = """
import runpy, sys

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is unimportable in this test")

sys.meta_path.insert(0, NoTorch())
sys.argv = ["privfusion", *sys.argv[1:]]
runpy.run_module("peer.cli", run_name="__main__")
"""


def without_torch(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def test_commands_that_need_no_torch_run_without_it(tmp_path):
    """Before: ``site new`` and ``roster pin`` imported torch (through ``peer.net.site`` and
    ``peer.nn.store``), a second or more of start-up each and a failure where torch is not
    installed. Now they, ``ledger show`` and ``peer info`` / ``peer health`` against a running
    daemon work with torch unimportable."""
    without_torch("--help")
    a, b = tmp_path / "hospital-a", tmp_path / "hospital-b"
    with socket.socket() as s:  # a free port: `peer health` dials the listen address of site.toml
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for d in (a, b):
        without_torch("site", "new", "--name", d.name, "--dir", str(d), "--listen", f"127.0.0.1:{port}")
    write_roster(tmp_path / "roster.toml", [(d.name, "127.0.0.1:1", f"{d.name}/identity/site.crt") for d in (a, b)])
    for d in (a, b):
        without_torch("roster", "pin", "--roster", str(tmp_path / "roster.toml"), "--dir", str(d / "identity"))
    with serving(a):
        info = without_torch(
            "peer", "info", "--via", f"127.0.0.1:{port}", "--identity", str(b / "identity"), "--peer", "hospital-a"
        )
        assert "hospital-a" in info.stdout
        without_torch("peer", "health", "--config", str(a / "site.toml"))
    shown = without_torch("ledger", "show", "--db", str(a / "ledger.sqlite"))
    assert "0 entries" in shown.stdout


class serving:
    """``privfusion peer serve`` of site ``d`` in a subprocess while the block runs; its port."""

    def __init__(self, d: Path):
        self.d, self.ready = d, d / "ready.json"

    def __enter__(self) -> int:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "peer.cli", "peer", "serve", "--config", str(self.d / "site.toml"), "--ready-file",
             str(self.ready)],
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not self.ready.exists() and self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if not self.ready.exists():
            self.__exit__()
            raise AssertionError(f"peer serve did not start (exit {self.proc.returncode})")
        return json.loads(self.ready.read_text())["port"]

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)


# ------------------------------------------------------------------------------ 6. output into a closed pipe


@pytest.mark.parametrize(
    "args",
    [("--help",), ("ledger", "show", "--db", "{ledger}"), ("ledger", "show", "--db", "{ledger}", "--json"),
     ("roster", "check", "--roster", "{roster}", "--dir", "{identity}"), ("site", "check", "--site", "{site}")],
    ids=["help", "ledger-show", "ledger-show-json", "roster-check", "site-check"],
)  # fmt: skip
def test_output_into_a_closed_pipe_ends_quietly(tmp_path, args):
    """``privfusion ... | head -1``: the reader is gone before the command writes; the command
    ends without a traceback (exit 0 when nothing was written yet, 141 = 128 + SIGPIPE, as a
    Unix tool ended by a closed pipe, otherwise)."""
    d = new_site(tmp_path)
    from peer.budget.ledger import Ledger
    from peer.budget.policy import Policy

    Ledger(d / "ledger.sqlite", Policy.from_toml(d / "site.toml")).close()
    write_roster(tmp_path / "roster.toml", [("hospital-a", "127.0.0.1:1", "hospital-a/identity/site.crt")])
    where = {"ledger": d / "ledger.sqlite", "roster": tmp_path / "roster.toml", "identity": d / "identity", "site": d}
    argv = [a.format(**where) for a in args]
    proc = subprocess.Popen(
        [sys.executable, "-m", "peer.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    proc.stdout.close()  # what `| head -1` does once it has its line, here before the first one
    err = proc.stderr.read()
    assert proc.wait(timeout=120) in (0, 141), err
    assert "Traceback" not in err and "Exception ignored" not in err and "BrokenPipe" not in err, err
