"""The modules one ReleaseWeights crosses at the serving site, measured, not listed by hand.

    PYTHONPATH=.:proto .venv/bin/python benchmarks/release_path.py [--json]

Two real sites on loopback (``tests/peer_harness.py``: identities, pinned trust, mutual TLS, a
SQLite ledger); site-b asks site-a for PFA weights once. Every thread of site-a's server is
profiled (``threading.setprofile``), and a call counts while the service's ``ReleaseWeights``
handler is on its stack (from the handler's entry to the end frame). Printed: the project
modules whose code ran and their packages, and the distinct functions of other modules the
service called directly (what "the service is an adapter" means, counted).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure() -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from peer_harness import client, make_site, pin_each_other, running

    modules: set[str] = set()
    direct: set[str] = set()

    def module_of(filename: str) -> str | None:
        try:
            rel = Path(filename).resolve().relative_to(ROOT)
        except ValueError:
            return None
        if rel.parts[0] not in ("peer", "coordinator_free", "scenarios"):
            return None
        name = ".".join(rel.with_suffix("").parts)
        return name.removesuffix(".__init__")

    def profile(frame, event, arg):
        if event != "call":
            return
        f = frame
        while f is not None and not (
            f.f_code.co_name == "ReleaseWeights" and f.f_code.co_filename.endswith("service.py")
        ):
            f = f.f_back
        mod = module_of(frame.f_code.co_filename) if f is not None else None
        if mod is None:
            return
        modules.add(mod)
        caller = frame.f_back
        if (
            caller is not None
            and module_of(caller.f_code.co_filename) == "peer.net.service"
            and mod != "peer.net.service"
        ):
            direct.add(f"{mod}.{frame.f_code.co_qualname}")

    tmp = Path(tempfile.mkdtemp())
    a, b = make_site(tmp, "site-a"), make_site(tmp, "site-b", models={})
    pin_each_other(a, b)
    threading.setprofile(profile)  # before the server starts its threads
    try:
        with running(a) as (_, address), client(b, address) as c:
            c.weights("mlp", epsilon=1.0, delta=1e-5)
    finally:
        threading.setprofile(None)
    return {
        "modules": sorted(modules),
        "packages": sorted({".".join(m.split(".")[:2]) for m in modules}),
        "service_calls": sorted(direct),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    r = measure()
    out = ROOT / "benchmarks" / "results" / "release_path.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(r, indent=2) + "\n")
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(
        f"ReleaseWeights crosses {len(r['modules'])} modules in {len(r['packages'])} packages: {', '.join(r['packages'])}"
    )
    for m in r["modules"]:
        print(f"  {m}")
    print(f"the service calls {len(r['service_calls'])} functions of other modules directly:")
    for c in r["service_calls"]:
        print(f"  {c}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
