"""docker/: what can be checked without a Docker engine (there is none on the build machines).

The compose file is parsed and every service is checked against the real CLI and the real
files; the Dockerfile's user, entrypoint, torch pin and copied paths are checked; the init
script is run for real (with its paths pointed at a temporary directory) and a round is run
between daemons started from exactly the files it wrote."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from peer.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
HOSPITALS = ["hospital-a", "hospital-b", "hospital-c"]


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _volumes(service):
    out = {}
    for v in service.get("volumes", []):
        source, target, *mode = v.split(":")
        out[target] = (source, mode[0] if mode else "rw")
    return out


def test_compose_has_three_hospitals_and_a_one_shot_init(compose):
    services = compose["services"]
    assert set(services) == {"init", *HOSPITALS}
    assert set(compose["volumes"]) == {*HOSPITALS, "certs"}
    for name in HOSPITALS:
        s = services[name]
        assert s["hostname"] == name
        assert s["depends_on"] == {"init": {"condition": "service_completed_successfully"}}
        vols = _volumes(s)
        # its own volume for identity, models, pool and ledger; certificates read-only
        assert vols == {"/site": (name, "rw"), "/certs": ("certs", "ro")}
        assert s["stop_signal"] == "SIGTERM"
        args = build_parser().parse_args(s["command"])
        assert (args.command, args.peer_command, args.config) == ("peer", "serve", "/site/site.toml")
    init = services["init"]
    assert init["restart"] == "no"
    vols = _volumes(init)
    assert vols["/certs"] == ("certs", "rw")
    assert {vols[f"/sites/{h}"] for h in HOSPITALS} == {(h, "rw") for h in HOSPITALS}
    source, mode = vols["/config/scenario.toml"]
    assert mode == "ro" and (DOCKER / source).is_file()
    assert init["entrypoint"] == ["/bin/sh", "/opt/privfusion/docker/init-sites.sh"]
    for s in services.values():
        assert s["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
        assert s["image"] == "privfusion:latest"
        assert "environment" not in s  # configured only by files
    assert (DOCKER / ".." / services["init"]["build"]["dockerfile"]).is_file()


def test_the_compose_scenario_names_the_compose_hospitals(compose):
    from scenarios.schema import load_scenario

    sc = load_scenario(DOCKER / "scenario.toml")
    assert [s.name for s in sc.sites] == HOSPITALS


def test_the_commands_the_compose_file_documents_are_real(compose):
    text = (DOCKER / "compose.yaml").read_text()
    documented = re.findall(r"docker compose exec (\S+) privfusion (.+)", text)
    assert documented
    for service, command in documented:
        assert service in compose["services"]
        build_parser().parse_args(shlex.split(command))


def test_dockerfile_runs_privfusion_as_a_non_root_user_with_cpu_torch():
    text = (DOCKER / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0")
    assert re.search(r'^ENTRYPOINT \["privfusion"\]$', text, re.M)
    cmd = re.search(r"^CMD (\[.*\])$", text, re.M).group(1)
    args = build_parser().parse_args(yaml.safe_load(cmd))
    assert (args.command, args.peer_command, args.config) == ("peer", "serve", "/site/site.toml")
    pin = re.search(r"--index-url https://download\.pytorch\.org/whl/cpu torch==(\S+)", text).group(1)
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch=={pin}" in deps
    for source in re.findall(r"^COPY (\S+) ", text, re.M):
        assert (ROOT / source).exists(), source
    assert (ROOT / "docker" / "init-sites.sh").is_file()


def test_init_script_is_valid_sh():
    subprocess.run(["sh", "-n", str(DOCKER / "init-sites.sh")], check=True)


@pytest.mark.slow
def test_init_script_makes_sites_that_fuse(tmp_path):
    """Run init-sites.sh as the compose `init` service would (paths moved to tmp), then start
    the three daemons from the files it wrote and run hospital-a's round."""
    from coordinator_free.roster import Roster, write_roster
    from coordinator_free.runner import load_local_site, load_round_config, run_round
    from peer.net.daemon import Daemon, open_site
    from peer.net.identity import load_identity
    from peer.net.trust import TrustStore

    sites, certs = tmp_path / "sites", tmp_path / "certs"
    certs.mkdir()
    env = dict(
        os.environ,
        SITES=" ".join(HOSPITALS),
        SITES_DIR=str(sites),
        CERTS_DIR=str(certs),
        SCENARIO=str(DOCKER / "scenario.toml"),
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    first = subprocess.run(["sh", str(DOCKER / "init-sites.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    # the shared volume holds certificates and the roster, never a key
    assert sorted(p.name for p in certs.iterdir()) == sorted([f"{h}.crt" for h in HOSPITALS] + ["roster.toml"])
    assert not any(b"PRIVATE KEY" in p.read_bytes() for p in certs.iterdir())
    fingerprints = {}
    for h in HOSPITALS:
        ident = load_identity(sites / h / "identity")  # refuses a key others can read
        assert (sites / h / "identity" / "site.key").stat().st_mode & 0o777 == 0o600
        assert sorted(TrustStore(ident.trust_dir).peers()) == sorted(set(HOSPITALS) - {h})
        fingerprints[h] = ident.fingerprint
        assert "seed" not in tomllib.loads((sites / h / "site.toml").read_text())["site"]  # CSPRNG noise
    roster = Roster.load(certs / "roster.toml")
    assert {n: s.address for n, s in roster.sites.items()} == {h: f"{h}:50051" for h in HOSPITALS}
    # what makes a second run harmless: an existing identity and site are left as they are
    assert 'if [ ! -f "$dir/identity/site.key" ]' in (DOCKER / "init-sites.sh").read_text()
    assert (
        "exists: leaving"
        in subprocess.run(
            [
                "privfusion",
                "demo",
                "site",
                str(DOCKER / "scenario.toml"),
                "--site",
                "hospital-a",
                "--dir",
                str(sites / "hospital-a"),
                "--roster",
                str(certs / "roster.toml"),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout
    )
    assert load_identity(sites / "hospital-a" / "identity").fingerprint == fingerprints["hospital-a"]

    # The compose network would resolve hospital-X:50051; here each daemon listens on loopback.
    with contextlib.ExitStack() as stack:
        addresses = {}
        for h in HOSPITALS:
            local = sites / h / "site-loopback.toml"
            local.write_text(
                (sites / h / "site.toml").read_text().replace('listen = "0.0.0.0:50051"', 'listen = "127.0.0.1:0"')
            )
            daemon = Daemon(open_site(local))
            addresses[h] = f"127.0.0.1:{daemon.start()}"
            stack.callback(daemon.stop, 1.0)
        loop = write_roster(
            tmp_path / "roster-loopback.toml", [(h, addresses[h], str(certs / f"{h}.crt")) for h in HOSPITALS]
        )
        cfg = load_round_config(sites / "hospital-a" / "site.toml")
        assert cfg.roster == certs / "roster.toml"  # what the init script told `demo site`
        cfg = dataclasses.replace(cfg, roster=loop, out=tmp_path / "rounds")
        result = run_round(load_local_site(sites / "hospital-a" / "site.toml", cfg.model), Roster.load(loop), cfg)
    assert result.status == "fused", result.reason
    assert sorted(result.report["contributors"]) == ["hospital-b", "hospital-c"]
