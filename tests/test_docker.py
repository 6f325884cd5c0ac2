"""docker/: what can be checked without a Docker engine (there is none on the build machines).

The compose file is parsed and every service is checked against the real CLI and the real
files; the Dockerfile's user, entrypoint, torch pin and copied paths are checked; the init
script is run for real (with its paths pointed at a temporary directory) and a round is run
between daemons started from exactly the files it wrote."""

from __future__ import annotations

import contextlib
import dataclasses
import json
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
    # the base and torch's source are build arguments, defaulting to the official ones
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim-bookworm$", text, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert re.search(r"^ARG TORCH_FIND_LINKS=$", text, re.M)
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    assert (ROOT / "docker" / "init-sites.sh").is_file()


def test_the_image_installs_the_pinned_cpu_torch_and_the_dependencies_before_the_source():
    """torch is the +cpu build of pyproject's pin (never CUDA), installed with every other
    pinned dependency from pyproject.toml alone, before any source file is copied."""
    text = (DOCKER / "Dockerfile").read_text()
    out = subprocess.run(
        [sys.executable, str(DOCKER / "pinned-requirements.py"), str(ROOT / "pyproject.toml"), "--torch"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("torch==")]
    assert out == [f"{pin}+cpu"]
    every = subprocess.run(
        [sys.executable, str(DOCKER / "pinned-requirements.py"), str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert every == deps
    lines = text.splitlines()
    first_source = min(i for i, line in enumerate(lines) if re.match(r"COPY (peer|proto|coordinator_free) ", line))
    deps_install = next(i for i, line in enumerate(lines) if "pip install -r requirements.txt" in line)
    assert deps_install < first_source
    copies_before = [line for line in lines[:deps_install] if line.startswith("COPY ")]
    assert copies_before == ["COPY pyproject.toml docker/pinned-requirements.py ./"]
    assert "pip install --no-deps ." in text
    assert "assert torch.version.cuda is None" in text


def test_pinned_requirements_refuses_a_torch_that_is_not_one_exact_version(tmp_path):
    bad = tmp_path / "pyproject.toml"
    bad.write_text('[project]\ndependencies = ["torch>=2.13", "numpy==2.4.6"]\n')
    out = subprocess.run(
        [sys.executable, str(DOCKER / "pinned-requirements.py"), str(bad), "--torch"], capture_output=True, text=True
    )
    assert out.returncode == 1
    assert "project.dependencies: torch must be pinned once as torch==X" in out.stderr


def test_healthchecks_run_peer_health_on_the_sites_own_config(compose):
    text = (DOCKER / "Dockerfile").read_text()
    check = re.search(r"^HEALTHCHECK .*\\\n\s+CMD (\[.*\])$", text, re.M).group(1)
    args = build_parser().parse_args(yaml.safe_load(check)[1:])
    assert (args.command, args.peer_command, args.config) == ("peer", "health", "/site/site.toml")
    for name in HOSPITALS:
        test = compose["services"][name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        args = build_parser().parse_args(test[2:])
        assert (test[1], args.peer_command, args.config) == ("privfusion", "health", "/site/site.toml")
    assert compose["services"]["init"]["healthcheck"] == {"disable": True}


def test_compose_v1_accepts_the_file(compose):
    """Compose v1 (docker-compose 1.29) refuses a top-level `name:`; v2 reads the same file."""
    assert set(compose) <= {"services", "volumes", "x-privfusion", "x-hospital"}


def test_both_builders_ignore_the_same_files():
    def rules(path):
        return [line for line in path.read_text().splitlines() if line and not line.startswith("#")]

    assert rules(ROOT / ".dockerignore") == rules(DOCKER / "Dockerfile.dockerignore")
    assert "**/.venv" in rules(ROOT / ".dockerignore")


def test_e2e_script_is_valid_bash_and_keeps_dockerd_inside_10_232():
    script = ROOT / "scripts" / "docker_e2e.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert 'BRIDGE_IP="10.232.0.1/24"' in text and 'POOL_BASE="10.232.128.0/17"' in text
    assert "docker build --network host" in text
    assert re.search(r"^set -euo pipefail$", text, re.M)


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
        cfg = dataclasses.replace(cfg, roster=loop)
        assert cfg.out == sites / "hospital-a" / "rounds"  # in the site's volume, where the check reads it
        result = run_round(load_local_site(sites / "hospital-a" / "site.toml", cfg.model), Roster.load(loop), cfg)
    assert result.status == "fused", result.reason
    assert sorted(result.report["contributors"]) == ["hospital-b", "hospital-c"]

    # what scripts/docker_e2e.sh checks after the round: every ledger against the receipts
    check = [sys.executable, str(DOCKER / "check-ledgers.py"), "--sites", str(sites), "--certs", str(certs)]
    ok = subprocess.run(check, capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    lines = dict(line.split(": ", 1) for line in ok.stdout.splitlines())
    assert set(lines) == set(HOSPITALS)
    charged = {h: sum(c["peer"] == h for c in result.report["charges"]) for h in HOSPITALS}
    assert charged["hospital-b"] > 0 and charged["hospital-c"] > 0
    for h in HOSPITALS:
        assert f"{charged[h]} receipts held by others match it; 0 unmatched" in lines[h], lines[h]
    # a ledger entry with no receipt (a charge the requester never got) is reported, by site
    report = next((sites / "hospital-a" / "rounds").glob("round-*.json"))
    data = json.loads(report.read_text())
    dropped = next(c for c in reversed(data["charges"]) if c["peer"] == "hospital-b")
    data["charges"] = [c for c in data["charges"] if c is not dropped]
    report.write_text(json.dumps(data))
    bad = subprocess.run(check, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1
    assert (
        f"check-ledgers: {dropped['peer']}: entry {dropped['entry_id']} charged to 'hospital-a' has no receipt"
        in bad.stderr
    )
