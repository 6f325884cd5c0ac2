"""Progress bars of the long commands (``peer.base.progress``), as a user sees them: the command
runs as a subprocess with its stderr on a pseudo-terminal (a bar with the time left) or on a
pipe (no bar, the output as it always was); ``--json`` and ``round --events`` draw none even
on a terminal. A bar holds counts of epochs, steps and rounds, never a record's value."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from peer_harness import LABEL, cli, cli_on_terminal, write_records

from coordinator_free.roster import write_roster

# tqdm's frame as peer.base.progress.BAR_FORMAT draws it: "DESC: 40%|███   | 8/20 epochs [00:01 elapsed, 00:02 left]"
FRAME = r"{desc}: +\d+%\|[^|]*\| (\d+)/{total} {unit} \[\d\d:\d\d elapsed, (\d\d:\d\d|\?) left\]"


def a_site(tmp_path: Path) -> tuple[Path, Path]:
    d = tmp_path / "hospital-a"
    cli("site", "new", "--name", "hospital-a", "--dir", str(d), "--listen", "127.0.0.1:0", "--address", "127.0.0.1")
    return d, write_records(tmp_path / "records.csv", 240, 1)


def frames(text: str, desc: str, total: int, unit: str) -> list[tuple[int, str]]:
    """(count, time left) of every frame of the bar ``desc`` in what the terminal received."""
    return [(int(n), left) for n, left in re.findall(FRAME.format(desc=re.escape(desc), total=total, unit=unit), text)]


def test_model_train_on_a_terminal_shows_a_bar_with_the_time_left(tmp_path):
    d, records = a_site(tmp_path)
    run = cli_on_terminal(
        "model", "train", "--site", str(d), "--data", str(records), "--label", LABEL, "--name", "m", "--epochs", "12"
    )
    assert run.returncode == 0, run.terminal
    seen = frames(run.terminal, "training m", 12, "epochs")
    # every epoch drawn, in order, from 0 to 12, and a time left estimated once an epoch is done
    assert [n for n, _ in seen] == list(range(13)), run.terminal
    assert seen[0][1] == "?" and all(re.fullmatch(r"\d\d:\d\d", left) for _, left in seen[1:])
    assert run.terminal.endswith("\r"), "the bar is cleared when the training ends"
    # the summary on stdout is untouched by the bar
    assert "\r" not in run.stdout and "left]" not in run.stdout
    assert run.stdout.startswith("model m: 192 training records"), run.stdout


def test_model_train_piped_or_with_json_draws_no_bar(tmp_path):
    d, records = a_site(tmp_path)
    common = ("model", "train", "--site", str(d), "--data", str(records), "--label", LABEL, "--epochs", "12")
    piped = subprocess.run(
        [sys.executable, "-m", "peer.cli", *common, "--name", "m1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={"TQDM_MININTERVAL": "0", **__import__("os").environ},
    )
    assert piped.returncode == 0, piped.stderr
    assert "\r" not in piped.stderr and "left]" not in piped.stderr and "epochs" not in piped.stderr, piped.stderr
    assert json.loads(piped.stdout)["model"] == "m1"
    # on a terminal too, --json draws no bar: its output is for a program
    run = cli_on_terminal(*common, "--name", "m2", "--json")
    assert run.returncode == 0, run.terminal
    assert frames(run.terminal, "training m2", 12, "epochs") == [] and "left]" not in run.terminal, run.terminal
    assert json.loads(run.stdout)["model"] == "m2"


def test_pool_train_on_a_terminal_counts_the_dp_sgd_steps(tmp_path):
    d, records = a_site(tmp_path)
    public = write_records(tmp_path / "public.csv", 120, 2)
    run = cli_on_terminal(
        "pool", "train", "--site", str(d), "--data", str(records), "--label", LABEL, "--public", str(public),
        "--architecture", '{"kind": "mlp", "hidden": [8]}',
        "--model", "noise=1,clip=1,steps=5", "--model", "noise=2,clip=1,steps=7",
    )  # fmt: skip
    assert run.returncode == 0, run.terminal
    seen = frames(run.terminal, "DP-SGD pool dpsgd", 12, "steps")
    assert [n for n, _ in seen] == list(range(13)), run.terminal
    assert "left]" not in run.stdout


def lone_iterate_site(tmp_path: Path, rounds: int) -> Path:
    """A fresh site with a model and the documented iterate round file (docs/deployment.md,
    section 3.1), alone in its roster."""
    d, records = a_site(tmp_path)
    public = write_records(tmp_path / "public.csv", 60, 2)  # iterate refuses a preprocessing fitted on its records
    cli("model", "train", "--site", str(d), "--data", str(records), "--label", LABEL, "--public", str(public),
        "--name", "mlp", "--epochs", "3")  # fmt: skip
    write_roster(d / "roster.toml", [("hospital-a", "127.0.0.1:1", "identity/site.crt")])
    docs = (Path(__file__).resolve().parents[1] / "docs" / "deployment.md").read_text(encoding="utf-8")
    block = re.search(r"```toml\n(# iterate\.toml.*?)```", docs, re.S)
    assert block, "docs/deployment.md has no iterate.toml block"
    text = block[1].replace('records = "records.csv"', f'records = "{records}"')
    (d / "iterate.toml").write_text(text.replace("rounds = 20", f"rounds = {rounds}"), encoding="utf-8")
    return d


def test_an_iterate_run_on_a_terminal_counts_its_rounds_and_events_draw_none(tmp_path):
    d = lone_iterate_site(tmp_path, rounds=3)
    run = cli_on_terminal("round", "--config", str(d / "site.toml"), "--round", str(d / "iterate.toml"))
    assert run.returncode == 0, run.terminal
    seen = frames(run.terminal, "iterate iterate", 3, "rounds")
    assert [n for n, _ in seen] == [0, 1, 2, 3], run.terminal
    # the run's lines are written above the bar, whole: the last one after the bar is cleared
    assert re.search(r"\r {20,}\r\[hospital-a\] iterate run finished after 3 rounds\r\n", run.terminal), run.terminal
    assert "iterate run iterate: finished (all 3 rounds done)" in run.stdout
    assert "left]" not in run.stdout

    (d / "iterate.toml").write_text(
        (d / "iterate.toml").read_text().replace('run = "iterate"', 'run = "second"'), encoding="utf-8"
    )
    events = cli_on_terminal("round", "--config", str(d / "site.toml"), "--round", str(d / "iterate.toml"), "--events")
    assert "left]" not in events.terminal and "%|" not in events.terminal, events.terminal
    kinds = [json.loads(line)["event"] for line in events.stdout.splitlines()]
    assert kinds[0] == "iterate-started" and kinds[-1] == "iterate-finished", kinds


def test_simulate_on_a_terminal_counts_its_stages(tmp_path):
    """``privfusion simulate`` (the tiny scenario of tests/test_scenarios.py: three sites, one
    round, no iterate): a bar of its 4 stages on the terminal, the progress lines above it whole,
    the tables on stdout without a bar."""
    from test_scenarios import TINY

    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY, encoding="utf-8")
    run = cli_on_terminal("simulate", str(scenario), "--out", str(tmp_path / "out"))
    assert run.returncode == 0, run.terminal
    seen = frames(run.terminal, "simulate tiny", 4, "stages")
    counts = [n for n, _ in seen]  # a frame is redrawn under every line written above it
    assert counts == sorted(counts) and set(counts) == {0, 1, 2, 3, 4}, run.terminal
    assert "evaluating models and the non-private oracle" in run.terminal
    assert "left]" not in run.stdout and "oracle (non-private)" in run.stdout
