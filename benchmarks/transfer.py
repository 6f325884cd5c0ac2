"""Streaming a large model between two peers, side by side with a raw socket copy of the same bytes.

    .venv/bin/python benchmarks/transfer.py                 # 300 MB model, 2 rounds
    .venv/bin/python benchmarks/transfer.py --size-mb 50 --rounds 1

What runs (all on loopback, each side in its own process):

- **privfusion**: site A's daemon (`privfusion peer serve`, mutual TLS with pinned certificates)
  holds an MLP of about --size-mb MB; site B's client asks for it and writes it as safetensors
  + JSON exactly like `privfusion merge|weights --via` (streamed into the file as it arrives).
  Default `--release merged`: an RS merge of a one-model pool, which releases the model's bytes
  unchanged (ledger charge, signed receipt, chunked stream with per-tensor SHA-256; the received
  file is compared with the source). `--release weights`: ReleaseWeights, whose PFA perturbation
  runs first. *Stream time* runs from the receipt's arrival (the math and the charge are done,
  the first tensor is next) to the end frame; *end to end* from the request.
- **raw TCP**: one process sends the same number of bytes with `socket.sendall` from one
  buffer, the other `recv_into`s a freshly allocated, untouched buffer — what any receiver of a
  new release does (the privfusion client writes into a new file); its pages are faulted in as
  bytes arrive. Also reported: the same into a *prefaulted* buffer, the bare socket's ceiling
  (on small virtual machines page faults can cost as much as the copy itself).
- **raw TLS**: the same over `ssl` with the sites' certificates (mutual TLS 1.3): what the
  encryption alone costs (Python's ssl module: one TLS record per read).
- Diagnostic, for the merged release: the same request received into a buffer allocated and
  touched before the request, which splits the client's cost into transport and page faults
  the same way the two raw TCP variants do.

Memory: high-water marks of resident memory (VmHWM, Linux) of both processes. The daemon's is
reset when it is ready (start-up, which loads the model, is reported apart) and again when the
receipt reaches the client, splitting the release into computing + charging and streaming;
the streaming increment is the streaming peak minus the RSS at the receipt. The client's covers
its whole life after imports.

Rounds alternate the three transfers so they see the same machine load; the table reports
medians. Results: a table on stdout and benchmarks/results/transfer.json (transfer-weights.json
for --release weights). Timings on a shared machine are noisy: the load average is recorded.
"""

from __future__ import annotations

import argparse
import json
import math
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


def machine_facts() -> dict:
    """What a benchmark's JSON says of the machine it ran on (the caller adds the load average
    at the moments it reads it): cores, the cores this process may use, platform, Python, and
    torch's version and thread count."""
    import torch

    return {
        "cpus": os.cpu_count(),
        "nproc": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def reset_hwm(pid: int | str = "self") -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def architecture(size_mb: float) -> dict:
    """A digits-sized MLP (64 inputs, 10 classes) of about size_mb MB of float32: five hidden
    layers of equal width."""
    params = size_mb * 1e6 / 4
    # 4·w² + (64 + 10 + 5)·w + 10 ≈ params
    width = int((-(79) + (79**2 + 16 * (params - 10)) ** 0.5) / 8)
    return {"kind": "mlp", "input_dim": 64, "hidden": [width] * 5, "output_dim": 10, "activation": "relu"}


SITE = """
[site]
name = "site-a"
listen = "127.0.0.1:0"
identity = "identity"
models = "models"
ledger = "ledger.sqlite"
workers = 4

[site.pools.big]
models = "pool"

[policy]
[policy.data]
unit = "record:replace-one"
epsilon = 1000.0
delta = 1e-3
[policy.model]
total = { epsilon = 1000.0, delta = 1e-3 }
[policy.peers."site-b"]
allow = ["weights", "merge"]
"""


def make_sites(root: Path, size_mb: float, release: str) -> tuple[Path, Path, int]:
    """Site A (the daemon's files) and site B (an identity), pinned to each other.

    ``release="merged"``: A's pool "big" holds one model of size_mb and an RS merge releases it
    as it is — the transfer alone, no math on the bytes. Its weights are a fresh initialisation
    and its DP-SGD training record describes a run that did not happen (50 full-batch steps,
    σ = 2): a fixture for moving bytes, nothing to learn from. ``release="weights"``: A's model
    "big" is released through the PFA (perturbation + smoothing filter), the real per-request
    work of ReleaseWeights.
    """
    from peer.base.rng import make_randomness
    from peer.dp.accounting import TrainingRecord
    from peer.dp.pools import load_splits
    from peer.dp.training import dpsgd_release_record
    from peer.net.identity import init_identity
    from peer.net.trust import TrustStore
    from peer.nn.architectures import build_model, validate_architecture
    from peer.nn.store import save_model

    arch = validate_architecture(architecture(size_mb))
    arrays = {k: v.detach().numpy() for k, v in build_model(arch, seed=0).state_dict().items()}
    nbytes = sum(a.nbytes for a in arrays.values())
    (root / "a" / "models").mkdir(parents=True)
    if release == "merged":
        training = TrainingRecord.constant("replace-one", 50, 0.5, 1.0, 2.0)
        splits = load_splits("digits")
        record = dpsgd_release_record(
            training,
            delta=1e-5,
            dataset_size=len(splits.x_train),
            # a CSPRNG record, as a production pool has: a fixed-seed pool model is served only
            # by a --simulation daemon, and the benchmark's daemon is started as a site's would be
            randomness=make_randomness(None),
            init_seed=0,
            architecture=arch,
            subject="big",
        )
        save_model(
            root / "a" / "pool",
            "big",
            arch,
            arrays,
            {"training": training.to_dict(), "record": record.to_dict(), "data": splits.description},
        )
    else:
        save_model(root / "a" / "models", "big", arch, arrays)
    del arrays
    a = init_identity(root / "a" / "identity", "site-a", ["127.0.0.1"])
    b = init_identity(root / "b" / "identity", "site-b", ["127.0.0.1"])
    TrustStore(a.trust_dir).add(b.cert_pem)
    TrustStore(b.trust_dir).add(a.cert_pem)
    (root / "a" / "site.toml").write_text(
        SITE if release == "merged" else SITE.replace('[site.pools.big]\nmodels = "pool"\n', "")
    )
    return root / "a", root / "b", nbytes


# ------------------------------------------------------------------ the privfusion transfer


class PrefaultedSink:
    """Diagnostic only: receive into one buffer allocated and touched before the request, to
    separate what the transport costs from what first-touch page faults cost (the same split
    as raw TCP fresh / prefaulted)."""

    def __init__(self, nbytes: int):
        self.buffer = np.ones(nbytes, dtype=np.uint8)
        self.view = memoryview(self.buffer)

    def start(self, specs, metadata) -> None:
        self.offsets, pos = [], 0
        for spec in specs:
            self.offsets.append(pos)
            pos += spec.nbytes

    def writer(self, index: int):
        base = self.offsets[index]

        def write(offset: int, data) -> None:
            self.view[base + offset : base + offset + len(data)] = data

        return write

    def done(self, spec, array) -> None:
        pass

    def finish(self):
        return self.buffer

    def abort(self) -> None:
        pass


def fetch_prefaulted(identity_dir: str, address: str, nbytes: int, queue) -> None:
    """The same request, received into a prefaulted buffer (diagnostic)."""
    from peer.net.client import PeerClient
    from peer.net.identity import load_identity

    sink = PrefaultedSink(nbytes)
    times = {}
    with PeerClient(
        load_identity(identity_dir),
        address,
        peer="site-a",
        on_receipt=lambda _: times.setdefault("receipt", time.perf_counter()),
    ) as c:
        c.merged("big", method="rs", epsilon=1000.0, delta=1e-5, out=sink)
        times["end"] = time.perf_counter()
    queue.put(times["end"] - times["receipt"])


def fetch(identity_dir: str, address: str, out_path: str, release: str, receipt_event, queue) -> None:
    """Site B: ask for the release and write it like `privfusion merge|weights --via` does
    (streamed into OUT.safetensors as it arrives, then the JSON document beside)."""
    from peer.net.client import PeerClient, save_release
    from peer.net.identity import load_identity

    base = vm()
    reset_hwm()
    times = {}

    def on_receipt(_):
        times["receipt"] = time.perf_counter()
        receipt_event.set()

    with PeerClient(load_identity(identity_dir), address, peer="site-a", on_receipt=on_receipt) as c:
        times["request"] = time.perf_counter()
        if release == "merged":
            got = c.merged("big", method="rs", epsilon=1000.0, delta=1e-5, out=out_path)
        else:
            got = c.weights("big", epsilon=4.0, delta=1e-6, out=out_path)
        times["end"] = time.perf_counter()
        save_release(got, out_path)
        times["saved"] = time.perf_counter()
    queue.put(
        {
            "bytes": got.total_bytes,
            "stream_s": times["end"] - times["receipt"],
            "end_to_end_s": times["end"] - times["request"],
            "save_s": times["saved"] - times["end"],
            "client_rss_before": base["VmRSS"],
            "client_hwm": vm()["VmHWM"],
        }
    )


def privfusion_round(site_a: Path, site_b: Path, workdir: Path, release: str) -> dict:
    ready = workdir / f"ready-{time.monotonic_ns()}.json"
    # closed in the finally below, after the daemon that writes to it has stopped
    log = open(workdir / "daemon.log", "ab")  # noqa: SIM115
    env = dict(os.environ, PRIVFUSION_LOG_LEVEL="WARNING")
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "peer.cli",
            "peer",
            "serve",
            "--config",
            str(site_a / "site.toml"),
            "--ready-file",
            str(ready),
        ],
        stdout=log,
        stderr=log,
        env=env,
        cwd=ROOT,
    )
    out = workdir / "got" / "big"
    try:
        while not ready.exists():
            if daemon.poll() is not None:
                raise RuntimeError(f"daemon exited: {(workdir / 'daemon.log').read_text()[-2000:]}")
            time.sleep(0.05)
        port = json.loads(ready.read_text())["port"]
        startup = vm(daemon.pid)
        reset_hwm(daemon.pid)
        ctx = mp.get_context("spawn")
        q, receipt = ctx.Queue(), ctx.Event()
        p = ctx.Process(
            target=fetch, args=(str(site_b / "identity"), f"127.0.0.1:{port}", str(out), release, receipt, q)
        )
        p.start()
        receipt.wait(1800)
        # the receipt is out: everything before it (the math, the charge) is behind; from here on
        # the daemon only streams
        computed = vm(daemon.pid)
        reset_hwm(daemon.pid)
        result = q.get(timeout=1800)
        p.join()
        streamed = vm(daemon.pid)
        if release == "merged":
            p = ctx.Process(
                target=fetch_prefaulted, args=(str(site_b / "identity"), f"127.0.0.1:{port}", result["bytes"], q)
            )
            p.start()
            result["stream_prefaulted_s"] = q.get(timeout=1800)
            p.join()
    finally:
        daemon.terminate()
        daemon.wait(60)
        log.close()
    if release == "merged":
        result["identical"] = same_tensors(out.with_name("big.safetensors"), site_a / "pool" / "big.safetensors")
    for f in out.parent.glob("*"):
        f.unlink()
    result.update(
        server_rss_idle=startup["VmRSS"],
        server_hwm_startup=startup["VmHWM"],
        server_rss_at_receipt=computed["VmRSS"],
        server_hwm_compute=computed["VmHWM"],
        server_hwm_stream=streamed["VmHWM"],
    )
    return result


def same_tensors(got: Path, source: Path) -> bool:
    """Whether the received file holds exactly the source model's tensors (one at a time)."""
    from safetensors import safe_open

    with safe_open(str(got), framework="numpy") as g, safe_open(str(source), framework="numpy") as s:
        return set(g.keys()) == set(s.keys()) and all(
            np.array_equal(g.get_tensor(k), s.get_tensor(k))
            for k in s.keys()  # noqa: SIM118 (a safetensors file handle, not a dict: no iteration)
        )


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


def interpreter_rss() -> int:
    """Peak RSS of a bare Python that imports what the daemon imports (torch, gRPC, the
    accountants) and holds no model: the part of the daemon's figures no model size changes."""
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child of this (large)
    # process would report the parent's peak
    code = (
        "import peer.net.daemon, peer.net.service, peer.dp.pools, peer.dp.merging, peer.dp.accounting, torch; "
        "from benchmarks.transfer import vm; print(vm()['VmHWM'])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, capture_output=True, text=True)
    return int(out.stdout.strip())


# ------------------------------------------------------------------ main


def run(size_mb: float = 300.0, rounds: int = 2, release: str = "merged") -> dict:
    """Measure; return the result document (what main writes as JSON)."""
    with tempfile.TemporaryDirectory(prefix="privfusion-transfer-") as tmp:
        work = Path(tmp)
        site_a, site_b, nbytes = make_sites(work, size_mb, release)
        a_id, b_id = site_a / "identity", site_b / "identity"
        tls = (
            str(a_id / "site.crt"),
            str(a_id / "site.key"),
            str(b_id / "site.crt"),
            str(b_id / "site.crt"),
            str(b_id / "site.key"),
            str(a_id / "site.crt"),
        )
        runs = {"privfusion": [], "raw_tcp_s": [], "raw_tcp_prefaulted_s": [], "raw_tls_s": []}
        for r in range(rounds):
            runs["raw_tcp_s"].append(raw_round(nbytes))
            runs["privfusion"].append(privfusion_round(site_a, site_b, work, release))
            runs["raw_tls_s"].append(raw_round(nbytes, tls))
            runs["raw_tcp_prefaulted_s"].append(raw_round(nbytes, prefault=True))
            print(
                f"round {r + 1}/{rounds}: privfusion stream {runs['privfusion'][-1]['stream_s']:.2f}s, "
                f"raw TCP {runs['raw_tcp_s'][-1]:.2f}s (prefaulted {runs['raw_tcp_prefaulted_s'][-1]:.2f}s), "
                f"raw TLS {runs['raw_tls_s'][-1]:.2f}s",
                file=sys.stderr,
            )

    med = statistics.median
    pf = runs["privfusion"]
    stream_s = med([x["stream_s"] for x in pf])
    tcp_s, tls_s, pre_s = med(runs["raw_tcp_s"]), med(runs["raw_tls_s"]), med(runs["raw_tcp_prefaulted_s"])
    mbps = lambda s: nbytes / s / 1e6  # noqa: E731
    memory = {
        k: max(x[k] for x in pf)
        for k in (
            "server_rss_idle",
            "server_hwm_startup",
            "server_rss_at_receipt",
            "server_hwm_compute",
            "server_hwm_stream",
            "client_rss_before",
            "client_hwm",
        )
    }
    # what streaming added on top of what the daemon held when the receipt went out
    memory["server_stream_increment"] = max(x["server_hwm_stream"] - x["server_rss_at_receipt"] for x in pf)
    memory["interpreter"] = interpreter_rss()
    return {
        "release": release,
        "model_bytes": nbytes,
        "rounds": rounds,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average": os.getloadavg(),
        },
        "seconds": {
            "privfusion_stream": stream_s,
            "raw_tcp": tcp_s,
            "raw_tcp_prefaulted": pre_s,
            "raw_tls": tls_s,
            "privfusion_stream_prefaulted": med([x.get("stream_prefaulted_s", math.nan) for x in pf]),
            "privfusion_end_to_end": med([x["end_to_end_s"] for x in pf]),
            "privfusion_save": med([x["save_s"] for x in pf]),
        },
        "throughput_MBps": {
            "privfusion_stream": mbps(stream_s),
            "raw_tcp": mbps(tcp_s),
            "raw_tls": mbps(tls_s),
            "raw_tcp_prefaulted": mbps(pre_s),
        },
        "ratio_privfusion_to_raw_tcp": tcp_s / stream_s,
        "ratio_privfusion_to_raw_tcp_prefaulted": pre_s / stream_s,
        # the merged (RS) release is the pool model's bytes: compared with the source file;
        # a weights release is perturbed, so there is nothing to compare it with (None)
        "identical": all(x["identical"] for x in pf) if release == "merged" else None,
        "memory_bytes": memory,
        "memory_over_model": {k: v / nbytes for k, v in memory.items()},
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=300.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--release",
        choices=("merged", "weights"),
        default="merged",
        help="merged: an RS merge of a one-model pool (the bytes as they are; default); "
        "weights: ReleaseWeights (PFA perturbation first)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON result (default benchmarks/results/transfer[-weights].json)"
    )
    args = parser.parse_args(argv)
    out = args.out or ROOT / "benchmarks" / "results" / (
        "transfer.json" if args.release == "merged" else "transfer-weights.json"
    )
    result = run(args.size_mb, args.rounds, args.release)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, sort_keys=True))
    print(report(result))
    print(f"wrote {out}")
    return 0


def report(result: dict) -> str:
    s, t, mo = result["seconds"], result["throughput_MBps"], result["memory_over_model"]
    nbytes = result["model_bytes"]
    prefaulted = s["privfusion_stream_prefaulted"]
    lines = [
        f"{result['release']} release of a {nbytes / 1e6:.1f} MB model, {result['rounds']} rounds (medians), "
        f"load average {result['machine']['load_average'][0]:.1f} on {result['machine']['cpus']} CPUs",
        f"{'transfer':<34}{'seconds':>9}{'MB/s':>9}{'vs raw TCP':>12}",
        f"{'privfusion stream (mTLS gRPC)':<34}{s['privfusion_stream']:>9.2f}{t['privfusion_stream']:>9.0f}{result['ratio_privfusion_to_raw_tcp']:>11.0%}",
        *(
            [
                f"{'  same, into a prefaulted buffer':<34}{prefaulted:>9.2f}{nbytes / prefaulted / 1e6:>9.0f}{s['raw_tcp'] / prefaulted:>11.0%}"
            ]
            if math.isfinite(prefaulted)
            else []
        ),
        f"{'raw TCP socket (fresh buffer)':<34}{s['raw_tcp']:>9.2f}{t['raw_tcp']:>9.0f}{1:>11.0%}",
        f"{'raw TCP socket (prefaulted)':<34}{s['raw_tcp_prefaulted']:>9.2f}{t['raw_tcp_prefaulted']:>9.0f}{s['raw_tcp'] / s['raw_tcp_prefaulted']:>11.0%}",
        f"{'raw TLS socket (Python ssl)':<34}{s['raw_tls']:>9.2f}{t['raw_tls']:>9.0f}{s['raw_tcp'] / s['raw_tls']:>11.0%}",
        f"received bytes identical to the source model: {'not comparable (perturbed)' if result['identical'] is None else result['identical']}; "
        f"privfusion vs the prefaulted raw socket: {result['ratio_privfusion_to_raw_tcp_prefaulted']:.0%}; "
        f"end to end (request to last byte): {s['privfusion_end_to_end']:.1f}s; writing the JSON beside: {s['privfusion_save']:.2f}s",
        "peak RSS / model size:",
        f"  daemon: idle {mo['server_rss_idle']:.2f}x (start-up peak {mo['server_hwm_startup']:.2f}x), "
        f"computing + charging {mo['server_hwm_compute']:.2f}x, streaming {mo['server_hwm_stream']:.2f}x "
        f"(+{mo['server_stream_increment']:.2f}x over the RSS when the receipt went out)",
        f"  of which the interpreter with the daemon's imports and no model: {mo['interpreter']:.2f}x",
        f"  client: before the request {mo['client_rss_before']:.2f}x, peak {mo['client_hwm']:.2f}x",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
