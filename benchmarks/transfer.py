"""Streaming a large model between two peers, side by side with a raw socket copy of the same bytes.

    .venv/bin/python benchmarks/transfer.py                 # 300 MB model, 2 rounds
    .venv/bin/python benchmarks/transfer.py --size-mb 50 --rounds 1

What runs (all on loopback, each side in its own process):

- **privfusion**: site A's daemon (`privfusion peer serve`, mutual TLS with pinned certificates)
  holds an MLP of about --size-mb MB; site B's client asks for it (`ReleaseWeights`: PFA
  perturbation, ledger charge, signed receipt, chunked stream with per-tensor SHA-256) and
  writes it as safetensors + JSON, exactly like `privfusion weights --via`. *Stream time* runs
  from the receipt's arrival (the charge is done, the first tensor is next) to the end frame;
  *end to end* includes the perturbation and the charge.
- **raw TCP**: one process sends the same number of bytes with `socket.sendall` from one
  buffer, the other `recv_into`s a freshly allocated, untouched buffer — what any receiver of a
  new release does (the privfusion client writes into a new file); its pages are faulted in as
  bytes arrive. Also reported: the same into a *prefaulted* buffer, the bare socket's ceiling
  (on small virtual machines page faults can cost as much as the copy itself).
- **raw TLS**: the same over `ssl` with the sites' certificates (mutual TLS 1.3): what the
  encryption alone costs.

Memory: the high-water mark of resident memory (VmHWM) of the daemon (reset once it is ready,
so it covers the release, not start-up; start-up is reported too) and of the client process.

Rounds alternate the three transfers so they see the same machine load; the table reports
medians. Results: a table on stdout and benchmarks/results/transfer.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

MIB = 1 << 20


def vm(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM of a process, in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


def reset_hwm(pid: int | str = "self") -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def architecture(size_mb: float) -> dict:
    """An MLP of about size_mb MB (float32): 2048 inputs, hidden layers of width 4096."""
    width, inp, out = 4096, 2048, 10
    params = size_mb * 1e6 / 4
    layers = max(1, round((params - inp * width) / (width * width)) + 1)
    return {"kind": "mlp", "input_dim": inp, "hidden": [width] * layers, "output_dim": out, "activation": "relu"}


def make_sites(root: Path, size_mb: float) -> tuple[Path, Path, int]:
    from coordinator_free.identity import init_identity
    from coordinator_free.trust import TrustStore
    from peer.models import build_model, validate_architecture
    from peer.store import save_model
    import torch

    arch = validate_architecture(architecture(size_mb))
    model = build_model(arch, seed=0)
    arrays = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    nbytes = sum(a.nbytes for a in arrays.values())
    save_model(root / "a" / "models", "big", arch, arrays)
    del model, arrays, torch
    a = init_identity(root / "a" / "identity", "site-a", ["127.0.0.1"])
    b = init_identity(root / "b" / "identity", "site-b", ["127.0.0.1"])
    TrustStore(a.trust_dir).add(b.cert_pem)
    TrustStore(b.trust_dir).add(a.cert_pem)
    (root / "a" / "site.toml").write_text("""
[site]
name = "site-a"
listen = "127.0.0.1:0"
identity = "identity"
models = "models"
ledger = "ledger.sqlite"
workers = 4

[policy]
[policy.model]
total = { epsilon = 1000.0, delta = 1e-3 }
[policy.peers."site-b"]
allow = ["weights"]
""")
    return root / "a", root / "b", nbytes


# ------------------------------------------------------------------ the privfusion transfer


def fetch(identity_dir: str, address: str, out_path: str, queue) -> None:
    """Site B: ask for the weights and write them like `privfusion weights --via` does
    (streamed into OUT.safetensors as they arrive, then the JSON document beside)."""
    from coordinator_free.identity import load_identity
    from peer.client import PeerClient, save_release

    base = vm()
    reset_hwm()
    times = {}
    with PeerClient(load_identity(identity_dir), address, peer="site-a",
                    on_receipt=lambda r: times.setdefault("receipt", time.perf_counter())) as c:
        times["request"] = time.perf_counter()
        release = c.weights("big", epsilon=4.0, delta=1e-6, out=out_path)
        times["end"] = time.perf_counter()
        save_release(release, out_path)
        times["saved"] = time.perf_counter()
    queue.put({"bytes": release.total_bytes, "stream_s": times["end"] - times["receipt"],
               "end_to_end_s": times["end"] - times["request"], "save_s": times["saved"] - times["end"],
               "client_rss_before": base["VmRSS"], "client_hwm": vm()["VmHWM"]})


def privfusion_round(site_a: Path, site_b: Path, workdir: Path) -> dict:
    ready = workdir / f"ready-{time.monotonic_ns()}.json"
    log = open(workdir / "daemon.log", "ab")
    env = dict(os.environ, PRIVFUSION_LOG_LEVEL="WARNING")
    daemon = subprocess.Popen([sys.executable, "-m", "peer.cli", "peer", "serve", "--config", str(site_a / "site.toml"),
                               "--ready-file", str(ready)], stdout=log, stderr=log, env=env, cwd=ROOT)
    try:
        while not ready.exists():
            if daemon.poll() is not None:
                raise RuntimeError(f"daemon exited: {(workdir / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        startup = vm(daemon.pid)
        reset_hwm(daemon.pid)
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        p = ctx.Process(target=fetch, args=(str(site_b / "identity"), f"127.0.0.1:{port}", str(workdir / "got" / "big"), q))
        p.start()
        result = q.get(timeout=1800)
        p.join()
        server = vm(daemon.pid)
    finally:
        daemon.terminate()
        daemon.wait(60)
        log.close()
    result.update(server_rss_idle=startup["VmRSS"], server_hwm_startup=startup["VmHWM"], server_hwm_release=server["VmHWM"])
    return result


# ------------------------------------------------------------------ raw socket copies


def raw_receiver(port_q, result_q, nbytes: int, tls: tuple[str, str, str] | None, prefault: bool = False) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    if tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(tls[0], tls[1])
        ctx.load_verify_locations(tls[2])
        ctx.verify_mode = ssl.CERT_REQUIRED
        conn = ctx.wrap_socket(conn, server_side=True)
    # a fresh, untouched buffer, like the one a receiving peer allocates for a release: its
    # pages are faulted in as bytes arrive, on both sides of the comparison
    buf = np.empty(nbytes, dtype=np.uint8)
    if prefault:  # the socket's own ceiling: memory already mapped before the first byte
        buf.fill(1)
    view = memoryview(buf)
    got = 0
    start = None
    while got < nbytes:
        n = conn.recv_into(view[got:], min(nbytes - got, 4 * MIB))
        if n == 0:
            raise RuntimeError("sender closed early")
        if start is None:
            start = time.perf_counter()
        got += n
    elapsed = time.perf_counter() - start
    conn.sendall(b"k")
    conn.close()
    result_q.put(elapsed)


def raw_round(nbytes: int, tls: tuple[str, str, str, str, str, str] | None = None, prefault: bool = False) -> float:
    """Seconds from the first byte to the last at the receiver."""
    ctx = mp.get_context("spawn")
    port_q, result_q = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=raw_receiver, args=(port_q, result_q, nbytes, tls[:3] if tls else None, prefault))
    p.start()
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    s = socket.create_connection(("127.0.0.1", port_q.get(timeout=60)))
    if tls:
        c = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        c.load_cert_chain(tls[3], tls[4])
        c.load_verify_locations(tls[5])
        s = c.wrap_socket(s, server_hostname="site-a")
    s.sendall(memoryview(data))
    s.recv(1)
    s.close()
    elapsed = result_q.get(timeout=600)
    p.join()
    return elapsed


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "transfer.json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="privfusion-transfer-") as tmp:
        work = Path(tmp)
        site_a, site_b, nbytes = make_sites(work, args.size_mb)
        tls = (str(site_a / "identity" / "site.key"), str(site_a / "identity" / "site.crt"), str(site_b / "identity" / "site.crt"))
        tls = (tls[1], tls[0], tls[2], str(site_b / "identity" / "site.crt"), str(site_b / "identity" / "site.key"),
               str(site_a / "identity" / "site.crt"))
        runs = {"privfusion": [], "raw_tcp_s": [], "raw_tcp_prefaulted_s": [], "raw_tls_s": []}
        for r in range(args.rounds):
            runs["raw_tcp_s"].append(raw_round(nbytes))
            runs["privfusion"].append(privfusion_round(site_a, site_b, work))
            runs["raw_tls_s"].append(raw_round(nbytes, tls))
            runs["raw_tcp_prefaulted_s"].append(raw_round(nbytes, prefault=True))
            print(f"round {r + 1}/{args.rounds}: privfusion stream {runs['privfusion'][-1]['stream_s']:.2f}s, "
                  f"raw TCP {runs['raw_tcp_s'][-1]:.2f}s (prefaulted {runs['raw_tcp_prefaulted_s'][-1]:.2f}s), "
                  f"raw TLS {runs['raw_tls_s'][-1]:.2f}s", file=sys.stderr)

    med = lambda xs: statistics.median(xs)  # noqa: E731
    pf = runs["privfusion"]
    stream_s = med([x["stream_s"] for x in pf])
    tcp_s, tls_s, pre_s = med(runs["raw_tcp_s"]), med(runs["raw_tls_s"]), med(runs["raw_tcp_prefaulted_s"])
    mbps = lambda s: nbytes / s / 1e6  # noqa: E731
    result = {
        "model_bytes": nbytes,
        "rounds": args.rounds,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "throughput_MBps": {"privfusion_stream": mbps(stream_s), "raw_tcp": mbps(tcp_s), "raw_tls": mbps(tls_s),
                            "raw_tcp_prefaulted": mbps(pre_s)},
        "ratio_privfusion_to_raw_tcp": tcp_s / stream_s,
        "ratio_privfusion_to_raw_tcp_prefaulted": pre_s / stream_s,
        "ratio_privfusion_to_raw_tls": tls_s / stream_s,
        "privfusion_end_to_end_s": med([x["end_to_end_s"] for x in pf]),
        "privfusion_save_s": med([x["save_s"] for x in pf]),
        "memory_bytes": {
            "server_rss_idle": max(x["server_rss_idle"] for x in pf),
            "server_hwm_startup": max(x["server_hwm_startup"] for x in pf),
            "server_hwm_release": max(x["server_hwm_release"] for x in pf),
            "client_rss_before": max(x["client_rss_before"] for x in pf),
            "client_hwm": max(x["client_hwm"] for x in pf),
        },
        "runs": runs,
    }
    m = result["memory_bytes"]
    result["memory_over_model"] = {"server_release": m["server_hwm_release"] / nbytes, "server_startup": m["server_hwm_startup"] / nbytes,
                                   "client": m["client_hwm"] / nbytes}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True))

    t = result["throughput_MBps"]
    print(f"model: {nbytes / 1e6:.1f} MB, {args.rounds} rounds (medians)")
    print(f"{'transfer':<32}{'seconds':>10}{'MB/s':>10}{'vs raw TCP':>12}")
    print(f"{'privfusion stream (mTLS gRPC)':<32}{stream_s:>10.2f}{t['privfusion_stream']:>10.0f}{tcp_s / stream_s:>11.0%}")
    print(f"{'raw TCP socket':<32}{tcp_s:>10.2f}{t['raw_tcp']:>10.0f}{1:>11.0%}")
    print(f"{'raw TCP, prefaulted buffer':<32}{pre_s:>10.2f}{t['raw_tcp_prefaulted']:>10.0f}{tcp_s / pre_s:>11.0%}")
    print(f"{'raw TLS socket':<32}{tls_s:>10.2f}{t['raw_tls']:>10.0f}{tcp_s / tls_s:>11.0%}")
    print(f"privfusion end to end (PFA perturbation + charge + stream): {result['privfusion_end_to_end_s']:.1f}s; "
          f"writing safetensors: {result['privfusion_save_s']:.1f}s")
    mo = result["memory_over_model"]
    print(f"peak RSS / model size: daemon during the release {mo['server_release']:.2f}x "
          f"(idle {m['server_rss_idle'] / nbytes:.2f}x, start-up {mo['server_startup']:.2f}x), client {mo['client']:.2f}x "
          f"(before the request {m['client_rss_before'] / nbytes:.2f}x)")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
