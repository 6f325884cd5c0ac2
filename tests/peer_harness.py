"""Real sites for tests: identities, model stores, site.toml files, daemons on loopback.

Everything is real: keys and certificates from ``peer.net.identity``, pinned trust
directories, safetensors model stores, a SQLite ledger file, the gRPC server with mutual TLS.
Daemons run in-process (``running``) or as a separate ``privfusion peer serve`` process
(``DaemonProcess``), the latter for signals and crashes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from peer.net.identity import Identity, init_identity, load_identity
from peer.net.trust import TrustStore
from peer.nn.architectures import build_model, state_arrays
from peer.nn.store import save_model

ARCH = {"kind": "mlp", "input_dim": 64, "hidden": [16, 12], "output_dim": 10, "activation": "relu"}

OPEN_POLICY = """
[policy]
show_remaining = "own"

[policy.data]
unit = "record:replace-one"
epsilon = 1000.0
delta = 1e-3

[policy.model]
total = { epsilon = 1000.0, delta = 1e-3 }
per_counterparty = { epsilon = 1000.0, delta = 1e-3 }

[policy.peers."*"]
allow = ["features", "weights", "merge", "fuse", "ledger"]
"""


@dataclass
class SiteFiles:
    name: str
    root: Path
    config: Path
    identity_dir: Path

    @property
    def identity(self) -> Identity:
        return load_identity(self.identity_dir)

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.sqlite"


def model_arrays(arch=ARCH, seed=0) -> dict[str, np.ndarray]:
    return state_arrays(build_model(arch, seed=seed))


def make_site(
    root: Path,
    name: str,
    *,
    models: dict | None = None,
    policy: str = OPEN_POLICY,
    peers: dict[str, str] | None = None,
    probe: np.ndarray | None = None,
    seed: int | None = None,
    workers: int = 8,
    activation_clip=(0.0, 4.0),
    grace: float = 5.0,
    extra_site: str = "",
    pools: dict[str, Path] | None = None,
) -> SiteFiles:
    """A site directory with an identity, a model store, site.toml (and its [policy])."""
    d = root / name
    d.mkdir(parents=True)
    init_identity(d / "identity", name, ["127.0.0.1", "localhost"])
    for model_name, (arch, arrays) in (models if models is not None else {"mlp": (ARCH, model_arrays())}).items():
        save_model(d / "models", model_name, arch, arrays)
    (d / "models").mkdir(exist_ok=True)
    lines = [
        "[site]",
        f'name = "{name}"',
        'listen = "127.0.0.1:0"',
        'identity = "identity"',
        'models = "models"',
        'ledger = "ledger.sqlite"',
        f"workers = {workers}",
        f"shutdown_grace_s = {grace}",
    ]
    if seed is not None:
        lines.append(f"seed = {seed}")
    if probe is not None:
        from safetensors.numpy import save_file

        save_file({"x": np.ascontiguousarray(probe)}, str(d / "probe.safetensors"))
        lines.append('probe = "probe.safetensors"')
    lines.append(extra_site)
    lines += ["", "[site.mechanisms]", f"activation_clip = [{activation_clip[0]}, {activation_clip[1]}]"]
    for pool, directory in (pools or {}).items():
        lines += ["", f'[site.pools."{pool}"]', f'models = "{directory}"']
    for peer, address in (peers or {}).items():
        lines += ["", f'[site.peers."{peer}"]', f'address = "{address}"']
    (d / "site.toml").write_text("\n".join(lines) + "\n" + policy)
    return SiteFiles(name, d, d / "site.toml", d / "identity")


LOGREG = {"kind": "mlp", "input_dim": 64, "hidden": [], "output_dim": 10}


def make_pool(directory: Path, noise=(4.0, 12.0), steps: int = 3, arch=LOGREG, seed: int | None = None) -> Path:
    """A small real DP-SGD pool (full batch, replace-one) on digits, as `privfusion pool train` makes
    (CSPRNG noise; a fixed ``seed`` makes a pool only a --simulation daemon serves)."""
    from peer.base.rng import make_randomness
    from peer.dp.accounting import TrainingRecord
    from peer.dp.pools import load_splits, save_trained
    from peer.dp.training import train_pool

    s = load_splits("digits")
    trainings = [TrainingRecord.constant("replace-one", steps, 2.0, 1.0, sigma) for sigma in noise]
    models = train_pool(
        arch, s.x_train, s.y_train, trainings, init_seed=0, randomness=make_randomness(seed), delta=1e-5
    )
    for i, m in enumerate(models):
        save_trained(directory, f"m{i}", m, data=s.description)
    return directory


def pin(site: SiteFiles, *others: SiteFiles) -> None:
    store = TrustStore(site.identity_dir / "trusted")
    for o in others:
        store.add((o.identity_dir / "site.crt").read_bytes())


def roster_of(path: Path, addresses: dict[str, str], *sites: SiteFiles):
    """The roster file ``path`` of ``sites`` at ``addresses`` (name -> HOST:PORT), loaded."""
    from coordinator_free.roster import Roster, write_roster

    return Roster.load(
        write_roster(path, [(x.name, addresses[x.name], str(x.identity_dir / "site.crt")) for x in sites])
    )


def pin_each_other(*sites: SiteFiles) -> None:
    for s in sites:
        pin(s, *[o for o in sites if o is not s])


def set_peer_address(site: SiteFiles, peer: str, address: str) -> None:
    text = site.config.read_text()
    site.config.write_text(text.replace("[policy]", f'[site.peers."{peer}"]\naddress = "{address}"\n\n[policy]', 1))


@contextlib.contextmanager
def running(site: SiteFiles, insecure: bool = False, simulation: bool | None = None):
    """An in-process daemon for ``site``; yields (daemon, "127.0.0.1:PORT"). ``simulation``: as
    ``peer serve --simulation`` (None: whether the site has a fixed seed)."""
    from peer.net.daemon import Daemon, open_site

    daemon = Daemon(open_site(site.config, insecure=insecure, simulation=simulation))
    port = daemon.start()
    try:
        yield daemon, f"127.0.0.1:{port}"
    finally:
        daemon.stop(grace=1.0)


def client(site: SiteFiles, address: str, peer: str | None = None, **kw):
    from peer.net.client import PeerClient

    return PeerClient(site.identity, address, peer=peer, **kw)


class DaemonProcess:
    """``privfusion peer serve`` in its own process (for SIGTERM / SIGKILL tests)."""

    def __init__(
        self, site: SiteFiles, log_path: Path | None = None, insecure: bool = False, simulation: bool | None = None
    ):
        self.site = site
        self.ready = site.root / f"ready-{time.monotonic_ns()}.json"
        self.log_path = log_path or site.root / "daemon.log"
        # held for the daemon's lifetime (its output), closed when it is stopped
        self.log = open(self.log_path, "ab")  # noqa: SIM115
        args = [
            sys.executable,
            "-m",
            "peer.cli",
            "peer",
            "serve",
            "--config",
            str(site.config),
            "--ready-file",
            str(self.ready),
        ]
        if insecure:
            args.append("--insecure")
        if simulation is None:  # a site made with a fixed seed is a simulation
            import tomllib

            simulation = "seed" in tomllib.loads(site.config.read_text())["site"]
        if simulation:
            args.append("--simulation")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log, env=env)

    def wait_ready(self, cpu_seconds: float | None = None) -> str:
        """The daemon's address once it is ready; the allowance is on the CPU time it used, so a
        loaded machine waits longer instead of failing (``peer.net.readiness``)."""
        from peer.net.readiness import DEFAULT_CPU_SECONDS, wait_for_ready_file

        try:
            info = wait_for_ready_file(
                self.ready, self.proc.pid, self.proc.poll, cpu_seconds=cpu_seconds or DEFAULT_CPU_SECONDS
            )
        except (ChildProcessError, TimeoutError) as e:
            raise RuntimeError(f"{e}: {self.log_path.read_text()[-3000:]}") from None
        return f"127.0.0.1:{info['port']}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def serve_in_child(config: str, ready: str, log_path: str) -> None:
    """Target of a forked daemon process: the real ``serve`` (the CLI's), logging to a file."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    from peer.net.daemon import serve

    serve(config, ready_file=ready)


class ForkedDaemons:
    """Starts daemons by forking a server process that imported everything once (a
    multiprocessing forkserver), so a restart costs milliseconds instead of a Python start."""

    def __init__(self):
        import multiprocessing

        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(
            [
                "peer.net.daemon",
                "peer.ldp.mechanisms",
                "peer.ldp.fusion",
                "peer.ldp.matching",
                "peer.dp.pools",
                "peer.dp.accounting",
                "peer.net.client",
                "peer_harness",
            ]
        )

    def start(self, site: SiteFiles):
        from peer.net.readiness import wait_for_ready_file

        ready = site.root / f"ready-{time.monotonic_ns()}.json"
        proc = self.ctx.Process(
            target=serve_in_child, args=(str(site.config), str(ready), str(site.root / "daemon.log"))
        )
        proc.start()
        try:
            wait_for_ready_file(ready, proc.pid, lambda: None if proc.is_alive() else proc.exitcode, poll=0.01)
        except (ChildProcessError, TimeoutError) as e:
            proc.kill()
            raise RuntimeError(f"{e}: {(site.root / 'daemon.log').read_text()[-3000:]}") from None
        return proc, f"127.0.0.1:{json.loads(ready.read_text())['port']}"


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``privfusion ARGS`` as a subprocess, as a user runs it (``check``: it must exit 0)."""
    proc = subprocess.run(
        [sys.executable, "-m", "peer.cli", *args], capture_output=True, text=True, timeout=300, check=False
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


@dataclass
class TerminalRun:
    returncode: int
    stdout: str
    terminal: str  # everything written to stderr, a terminal, as the bytes arrived (\r included)


def cli_on_terminal(*args: str, columns: int = 120, env: dict | None = None) -> TerminalRun:
    """``privfusion ARGS`` as a subprocess whose stderr is a terminal (a pseudo-terminal of
    ``columns`` columns) and whose stdout is a pipe: what a user sees of the progress bars.
    ``TQDM_MININTERVAL=0`` draws every update (tqdm's default redraws at most every 0.1 s, so
    that a short run might show only its first and last frame)."""
    import fcntl
    import struct
    import termios
    import threading

    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "peer.cli", *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env={**os.environ, "TQDM_MININTERVAL": "0", **(env or {})},
    )
    os.close(slave)
    chunks: list[bytes] = []

    def read_terminal() -> None:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                return
            if not chunk:
                return
            chunks.append(chunk)

    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        stdout, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
        os.close(master)
    return TerminalRun(proc.returncode, stdout.decode(), b"".join(chunks).decode(errors="replace"))


#: the label column of the small tables that write_records writes
LABEL = "outcome"


def write_records(path: Path, rows: int, seed: int) -> Path:
    """A small table: three numeric columns and a binary label that depends on them."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 3))
    y = (x @ np.array([1.0, -0.5, 0.25]) + 0.3 * rng.normal(size=rows) > 0).astype(int)
    lines = [f"a,b,c,{LABEL}"] + [f"{r[0]:.5f},{r[1]:.5f},{r[2]:.5f},{v}" for r, v in zip(x, y, strict=True)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def cli_parallel(*commands: tuple[str, ...], timeout: float = 300) -> list[str]:
    """Several ``privfusion`` commands at once, as different sites run them (each on its own
    machine, in real life); each must exit 0. Their standard outputs, in order."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "peer.cli", *c], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for c in commands
    ]
    outs = []
    for c, p in zip(commands, procs, strict=True):
        out, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise AssertionError(f"privfusion {' '.join(c)} exited {p.returncode}:\n{out[-2000:]}\n{err[-4000:]}")
        outs.append(out)
    return outs


# ------------------------------------------------------------------------------ image records


def digits_images(n: int, seed: int, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """``n`` of scikit-learn's 8x8 digits (classes 0 .. ``classes`` - 1), as uint8 images scaled
    to 0..255, drawn without replacement by ``seed``."""
    from sklearn.datasets import load_digits

    d = load_digits()
    keep = np.flatnonzero(d.target < classes)
    pick = np.random.default_rng(seed).choice(keep, size=n, replace=False)
    return (d.images[pick] * (255 / 16)).round().astype(np.uint8), d.target[pick]


def write_folder(root: Path, images: np.ndarray, labels: np.ndarray, *, rgb: bool = False, jpeg_every: int = 0) -> Path:
    """DIR/<label>/<i>.png (every ``jpeg_every``-th as .jpg), grayscale or RGB: a folder by class."""
    from PIL import Image

    for i, (a, y) in enumerate(zip(images, labels, strict=True)):
        d = root / str(int(y))
        d.mkdir(parents=True, exist_ok=True)
        im = Image.fromarray(a, mode="L")
        if rgb:
            im = im.convert("RGB")
        if jpeg_every and i % jpeg_every == 0:
            im.save(d / f"{i:04d}.jpg", quality=95)
        else:
            im.save(d / f"{i:04d}.png")
    return root


def holds_count(value, counts) -> bool:
    """Whether a JSON value holds one of ``counts`` as a number (int, or a float equal to it) or
    as a whole word of a string, at any depth."""
    if isinstance(value, dict):
        return any(holds_count(k, counts) or holds_count(v, counts) for k, v in value.items())
    if isinstance(value, list):
        return any(holds_count(v, counts) for v in value)
    if isinstance(value, bool):
        return False
    if isinstance(value, (int, float)):
        return value in counts
    if isinstance(value, str):
        # a whole word: not digits inside another number or a hex digest ("…0c24051e…")
        return any(re.search(rf"(?<![0-9A-Za-z.]){c}(?![0-9A-Za-z.])", value) for c in counts)
    return False
