"""The multi-hospital simulator behind ``privfusion simulate``.

Everything a real deployment does happens for real, on loopback:

1. **data** — a bundled scikit-learn set or the scenario's own records (``[data] path``, read
   and prepared by ``peer.nn.tables``, with a preprocessing fitted on the public set only and
   shared by every site), split into a global test set (every
   accuracy is measured on it), a PUBLIC set (probe sets and the merges' validation data come
   from it), and the protected records, divided among the sites by a Dirichlet label skew
   (``peer.nn.data.split_dirichlet``) or IID;
2. **sites** — each site trains its own model on its records (plain training) and, when the
   scenario has a ``[pool]``, a small DP-SGD pool (``peer.dp.training.train_pool``); it gets its
   own identity (``peer init``: key + self-signed certificate), pins every other site, and a
   ``site.toml`` with its policy, its ledger file and its fixed noise seed (reported in every
   release record — a simulation option, never production);
3. **daemons** — each site's ``privfusion peer serve`` in its own process, on a free port,
   mutual TLS with the pinned certificates; a roster of all sites is written;
4. **rounds** — every site runs the rounds of the plan, all sites at once, with its own
   identity, trust store, model and probe set (its site.toml); their events stream back as
   progress. They run here, in the simulate process, one thread per site (``RoundThread``):
   the same ``coordinator_free.runner.run_rounds`` as the ``privfusion round`` command, every
   call still a mutual-TLS call to a peer's daemon, without one more process per site that
   would load torch, gRPC and NumPy again (~330 MB resident each: at 12 sites, 4 GB). The
   failure scenario SIGKILLs one site, daemon and round, once its ledger holds a given number
   of charges: that site's rounds run as the ``privfusion round`` command in a process of its
   own (``RoundProcess``), which is what a SIGKILL can take down;
5. **evaluation** — own, privately fused and merged-fused models on the test set, and the
   non-private ORACLE (graph matching on exact features, computed here with every site's
   exact model — no real site could), with the same contributors and weights;
6. **ledgers** — after the daemons stop, every site's ledger file is opened and its entries
   and budgets go into the report as they are; the rounds' receipts are reconciled with them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from coordinator_free.roster import write_roster
from coordinator_free.rounds import fusion_weights
from peer.base.errors import FailedPrecondition, InvalidArgument
from peer.ldp.fusion import average_arrays
from peer.ldp.pipeline import align
from peer.net.readiness import NotReady, wait_for_ready_file
from peer.nn.architectures import accuracy, model_from_arrays
from peer.nn.graph import extract_graph
from scenarios.schema import Scenario

MODEL = "mlp"
POOL = "dpsgd"


def _now() -> str:
    from peer.base.records import now_rfc3339

    return now_rfc3339()


@dataclass
class SiteWorld:
    name: str
    root: Path
    seed: int
    alpha: float
    x: np.ndarray
    y: np.ndarray
    probe: np.ndarray
    architecture: dict
    arrays: dict[str, np.ndarray]
    pool: list[dict] = field(default_factory=list)

    @property
    def config(self) -> Path:
        return self.root / "site.toml"

    @property
    def ledger(self) -> Path:
        return self.root / "ledger.sqlite"

    @property
    def identity(self) -> Path:
        return self.root / "identity"


@dataclass
class World:
    scenario: Scenario
    out: Path
    sites: dict[str, SiteWorld]
    x_test: np.ndarray
    y_test: np.ndarray
    x_public: np.ndarray
    y_public: np.ndarray
    plan: list[tuple[str, str, float]]
    timings: dict[str, float] = field(default_factory=dict)


class Progress:
    """Progress lines on stderr (or wherever ``write`` sends them), with the elapsed time."""

    def __init__(self, write: Callable[[str], None] | None = None):
        self._write = write or (lambda s: print(s, file=sys.stderr, flush=True))
        self._start = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self, text: str) -> None:
        with self._lock:
            self._write(f"[{time.monotonic() - self._start:6.1f}s] {text}")


# ------------------------------------------------------------------------------------- plan


def round_plan(sc: Scenario) -> list[tuple[str, str, float]]:
    """(label, method, ε scale) of every round each site runs, in order."""
    plan = [(m, m, 1.0) for m in sc.round.methods]
    if "ldp" in sc.round.methods:
        plan += [(f"ldp-x{s:g}", "ldp", s) for s in sc.round.frontier]
    return plan


def released_epsilon(sc: Scenario, scale: float) -> float:
    """Model-level ε (per the round's unit: neuron by default) one peer releases to one requester
    in an ldp round at ``scale`` (features: activations + weight features, plus weights; basic
    composition, as asked — the ledger's figures are in the report beside it)."""
    r = sc.round
    return scale * (r.activation_epsilon + r.weight_epsilon + r.weights_epsilon)


# ------------------------------------------------------------------------------------- sites


def _policy_toml(sc: Scenario) -> str:
    p = sc.policy
    lines = ["[policy]", 'show_remaining = "own"']
    if sc.pool is not None:
        lines += [
            "",
            "[policy.data]",
            f'unit = "record:{sc.pool.adjacency}"',
            f"epsilon = {p.data_epsilon!r}",
            f"delta = {p.data_delta!r}",
        ]
    lines += [
        "",
        "[policy.model]",
        f"total = {{ epsilon = {p.model_epsilon!r}, delta = {p.model_delta!r} }}",
        f"per_counterparty = {{ epsilon = {p.model_epsilon_per_peer!r}, delta = {p.model_delta!r} }}",
        "",
        '[policy.peers."*"]',
        'allow = ["features", "weights", "merge", "ledger"]',
    ]
    return "\n".join(lines) + "\n"


def site_toml(
    sc: Scenario, s: SiteWorld, listen: str = "127.0.0.1:0", round_table: str = "", fixed_seed: bool = True
) -> str:
    """A site's site.toml: where it listens, its files, its pool and policy, optionally a
    ``[round]`` table, and — in simulations only — its fixed noise seed (reported in every
    release record; without it every release draws CSPRNG noise)."""
    lo, hi = sc.round.activation_clip
    lines = [
        "[site]",
        f'name = "{s.name}"',
        f'listen = "{listen}"',
        'identity = "identity"',
        'models = "models"',
        'ledger = "ledger.sqlite"',
        'probe = "probe.safetensors"',
        "workers = 16",
        "shutdown_grace_s = 5",
    ]
    if fixed_seed:
        lines.append(f"seed = {s.seed}")
    lines += ["", "[site.mechanisms]", f"activation_clip = [{lo!r}, {hi!r}]", f'calibration = "{sc.round.calibration}"']
    if sc.pool is not None:
        # merges judge candidates on the public set, never on the site's protected records
        lines += ["", f"[site.pools.{POOL}]", 'models = "pool"', 'validation = "validation.npz"']
    return "\n".join(lines) + "\n\n" + _policy_toml(sc) + (f"\n{round_table}" if round_table else "")


def round_toml(sc: Scenario, s: SiteWorld, label: str, method: str, scale: float, roster: Path) -> str:
    r = sc.round
    lines = [
        "[round]",
        f'roster = "{roster}"',
        f'model = "{MODEL}"',
        f"alpha = {s.alpha!r}",
        f"quorum = {r.quorum}",
        f'method = "{method}"',
        'out = "rounds"',
        f'label = "{label}"',
        f"call_timeout_s = {r.call_timeout_s!r}",
        f"health_timeout_s = {r.health_timeout_s!r}",
        "",
        "[round.features]",
        f"activation_epsilon = {r.activation_epsilon * scale!r}",
        f"weight_epsilon = {r.weight_epsilon * scale!r}",
        f'unit = "{r.unit}"',
        f"activation_clip = [{r.activation_clip[0]!r}, {r.activation_clip[1]!r}]",
        "",
        "[round.weights]",
        f"epsilon = {r.weights_epsilon * scale!r}",
        f"delta = {r.weights_delta!r}",
        "",
        "[round.merge]",
        f'method = "{r.merge_method}"',
        f"epsilon = {r.merge_epsilon!r}",
        f"delta = {r.merge_delta!r}",
    ]
    return "\n".join(lines + _after_fusion_toml(sc, s)) + "\n"


def _after_fusion_toml(sc: Scenario, s: SiteWorld) -> list[str]:
    """The round's local steps after fusion (coordinator_free.after_fusion): the site's own records
    (``records.npz`` in its own directory: they never leave it), REPAIR, candidate selection on
    the PUBLIC validation set, fine-tuning."""
    r = sc.round
    lines = ["", "[round.records]", 'path = "records.npz"', "prepared = true"]
    lines += ["", "[round.repair]", f'data = "{r.repair}"']
    if r.select:
        alphas = ", ".join(repr(a) for a in dict.fromkeys((s.alpha, *r.select_alphas)))
        lines += ["", "[round.select]", 'validation = "validation.npz"', f"alphas = [{alphas}]"]
    lines += ["", "[round.finetune]", f"epochs = {r.finetune_epochs}", f"learning_rate = {r.finetune_learning_rate!r}"]
    return lines


@dataclass(frozen=True)
class ScenarioData:
    """The scenario's data, split the same way wherever it is computed (everything follows from
    the scenario's seed): test set, public set, and each site's protected records."""

    x_test: np.ndarray
    y_test: np.ndarray
    x_public: np.ndarray
    y_public: np.ndarray
    parts: tuple[tuple[np.ndarray, np.ndarray], ...]
    architecture: dict
    num_classes: int
    preprocessing: Any = None  # peer.nn.tables.Preprocessing of the scenario's own records


def _public_order(sc: Scenario, n: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of the n training examples: the first ``public_size`` are the public set."""
    d = sc.data
    if d.public_size >= n - d.min_per_site * len(sc.sites):
        raise InvalidArgument(
            "data.public_size", f"{d.public_size} leaves too few of the {n} training examples for the sites"
        )
    return rng.permutation(n)


def split_data(sc: Scenario) -> ScenarioData:
    from peer.nn.data import Dataset, load_dataset, split_dirichlet, split_homogeneous

    d = sc.data
    rng = np.random.default_rng(sc.seed)
    prep = None
    if d.path is None:
        ds = load_dataset(d.dataset, test_fraction=d.test_fraction, seed=sc.seed)
        order = _public_order(sc, len(ds.y_train), rng)
    else:
        from peer.nn.tables import Preprocessing, read_table

        table = read_table(
            d.path,
            label=d.label,
            features=d.features,
            categorical=d.categorical,
            missing="impute" if d.impute else "refuse",
        )
        rest, test = table.split(d.test_fraction, seed=sc.seed)
        order = _public_order(sc, len(rest), rng)
        # Fitted on the public set only: the sites' DP-SGD pools are private for one record
        # given their preprocessing, so it must not depend on the protected records.
        prep = Preprocessing.fit(rest.take(np.sort(order[: d.public_size])), unseen=d.unseen, split="public")
        (x_tr, y_tr), (x_te, y_te) = prep.transform(rest), prep.transform(test)
        ds = Dataset(d.dataset, x_tr, y_tr, x_te, y_te, prep.num_classes, None)
    public, protected = order[: d.public_size], np.sort(order[d.public_size :])
    x_prot, y_prot = ds.x_train[protected], ds.y_train[protected]
    if d.split == "dirichlet":
        idx = split_dirichlet(
            y_prot, len(sc.sites), concentration=d.concentration, seed=sc.seed, min_per_site=d.min_per_site
        )
    else:
        idx = split_homogeneous(y_prot, len(sc.sites), seed=sc.seed)
    arch = {
        "kind": "mlp",
        "input_dim": ds.input_dim,
        "hidden": list(sc.model.hidden),
        "output_dim": ds.num_classes,
        "activation": sc.model.activation,
    }
    return ScenarioData(
        ds.x_test,
        ds.y_test,
        ds.x_train[public],
        ds.y_train[public],
        tuple((x_prot[i], y_prot[i]) for i in idx),
        arch,
        ds.num_classes,
        prep,
    )


def prepare_site(sc: Scenario, data: ScenarioData, name: str, root: Path, fixed_seed: bool = True) -> SiteWorld:
    """One site's files from the scenario: its records' model (``models/mlp``), its DP-SGD pool
    (``pool/``), its public probe set and the public validation set of its merges. No identity
    and no site.toml: those depend on where the site runs. ``fixed_seed``: the pool's noise
    comes from the site's seed (a simulation: its daemon runs with ``--simulation``), else from
    the CSPRNG (a site run elsewhere, ``privfusion demo site``: its daemon refuses a fixed-seed
    pool)."""
    import torch
    from safetensors.numpy import save_file

    from peer.nn.architectures import state_arrays, train_classifier
    from peer.nn.store import save_model

    index = [s.name for s in sc.sites].index(name)
    spec = sc.sites[index]
    seed = sc.seed * 1000 + index + 1
    root.mkdir(parents=True, exist_ok=True)
    x, y = data.parts[index]
    probe = data.x_public[
        np.random.default_rng(seed).choice(len(data.x_public), size=sc.data.probe_size, replace=False)
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small models: thread hand-offs cost more than they save
    try:
        model = train_classifier(
            data.architecture,
            x,
            y,
            seed=seed,
            epochs=sc.model.epochs,
            batch_size=sc.model.batch_size,
            learning_rate=sc.model.learning_rate,
        )
        s = SiteWorld(
            name,
            root,
            seed,
            sc.round.alpha if spec.alpha is None else spec.alpha,
            x,
            y,
            np.ascontiguousarray(probe, dtype=np.float32),
            data.architecture,
            state_arrays(model),
        )
        save_model(
            root / "models",
            MODEL,
            data.architecture,
            s.arrays,
            {"trained_on": len(y), "seed": seed},
            data.preprocessing,
        )
        save_file({"x": s.probe}, str(root / "probe.safetensors"))
        # the site's own prepared records, for its rounds' REPAIR and fine-tuning (never sent)
        np.savez(root / "records.npz", x=x, y=y)
        np.savez(root / "validation.npz", x=data.x_public, y=data.y_public)
        if sc.pool is not None:
            s.pool = _train_pool(
                sc, s, data.x_public, data.y_public, data.x_test, data.y_test, data.preprocessing, fixed_seed
            )
    finally:
        torch.set_num_threads(threads)
    return s


def prepare(sc: Scenario, out: Path, progress: Progress) -> World:
    """Data, models, pools, identities, pins and config files of every site."""
    from peer.net.identity import init_identity
    from peer.net.trust import TrustStore
    from peer.nn.architectures import accuracy, model_from_arrays

    data = split_data(sc)
    world = World(sc, out, {}, data.x_test, data.y_test, data.x_public, data.y_public, round_plan(sc))
    for spec in sc.sites:
        s = prepare_site(sc, data, spec.name, out / "sites" / spec.name)
        init_identity(s.identity, spec.name, ["127.0.0.1", "localhost"])
        world.sites[spec.name] = s
        own = accuracy(s.architecture, model_from_arrays(s.architecture, s.arrays), data.x_test, data.y_test)
        counts = np.bincount(s.y, minlength=data.num_classes).tolist()
        pool = (", pool " + ", ".join(f"ε={m['epsilon']:.3g}: {m['accuracy']:.3f}" for m in s.pool)) if s.pool else ""
        progress(f"{spec.name}: {len(s.y)} records (labels {counts}), own model test accuracy {own:.3f}{pool}")
    for s in world.sites.values():
        store = TrustStore(s.identity / "trusted")
        for o in world.sites.values():
            if o is not s:
                store.add((o.identity / "site.crt").read_bytes())
        s.config.write_text(site_toml(sc, s), encoding="utf-8")
    return world


def _train_pool(
    sc: Scenario, s: SiteWorld, x_val, y_val, x_test, y_test, preprocessing=None, fixed_seed: bool = True
) -> list[dict]:
    from peer.base.rng import make_randomness
    from peer.dp.accounting import Optimizer, TrainingRecord
    from peer.dp.pools import load_pool, save_trained, warm_pool_profiles
    from peer.dp.training import train_pool
    from peer.nn.architectures import accuracy, model_from_arrays

    p = sc.pool
    trainings = [
        TrainingRecord.constant(
            p.adjacency, p.steps, p.learning_rate, p.clip_norm, nm, p.sample_rate, optimizer=Optimizer(p.optimizer)
        )
        for nm in p.noise_multipliers
    ]
    models = train_pool(
        s.architecture,
        s.x,
        s.y,
        trainings,
        init_seed=s.seed + 500_000,
        randomness=make_randomness(s.seed if fixed_seed else None),
        delta=p.delta,
        # the scenario's public count (required under add-remove), never len(s.y) there
        dataset_size=p.declared_records,
    )
    out = []
    for nm, m in zip(p.noise_multipliers, models, strict=True):
        name = f"dpsgd-sigma{nm:g}"
        module = model_from_arrays(s.architecture, m.arrays)
        save_trained(
            s.root / "pool",
            name,
            m,
            accuracy=accuracy(s.architecture, module, x_val, y_val),
            preprocessing=preprocessing,
        )
        out.append(
            {
                "name": name,
                "noise_multiplier": nm,
                "epsilon": m.record.epsilon,
                "delta": m.record.delta,
                "accuracy": accuracy(s.architecture, module, x_test, y_test),
            }
        )
    # The pool's privacy profiles (T-step PLD and RDP compositions) into the pool's profile
    # cache, as its daemon would build them at start-up: built here, one site after another,
    # rather than by every daemon at once (each would hold ~70 MB of composition buffers at
    # its peak for it). The daemon reads them back, checked against each model's record.
    with contextlib.suppress(InvalidArgument):  # a pool RS cannot account: each request says why
        warm_pool_profiles(load_pool(s.root / "pool"), s.root / "pool")
    return out


# ------------------------------------------------------------------------------------- processes


def _child_env() -> dict:
    # One BLAS/torch thread per process: eight processes share two cores.
    return dict(
        os.environ,
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PRIVFUSION_LOG_LEVEL=os.environ.get("PRIVFUSION_LOG_LEVEL", "INFO"),
    )


class Daemon:
    """One site's ``privfusion peer serve`` process."""

    def __init__(self, site: SiteWorld):
        self.site = site
        self.ready = site.root / "daemon.ready.json"
        self.ready.unlink(missing_ok=True)
        # held for the daemon's lifetime (its stderr), closed when it is stopped
        self.log = open(site.root / "daemon.log", "ab")  # noqa: SIM115
        # --simulation: the sites' fixed noise seeds (refused by a production `peer serve`)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "peer.cli",
                "peer",
                "serve",
                "--config",
                str(site.config),
                "--simulation",
                "--ready-file",
                str(self.ready),
            ],
            stdout=self.log,
            stderr=self.log,
            env=_child_env(),
        )
        self.address: str | None = None
        self.killed_at: str | None = None

    def wait_ready(self) -> str:
        """The daemon's address once it is ready. The allowance is on the CPU time the daemon
        used (``peer.net.readiness``): a loaded machine waits longer instead of failing."""
        log = self.site.root / "daemon.log"
        try:
            info = wait_for_ready_file(self.ready, self.proc.pid, self.proc.poll)
        except ChildProcessError:
            raise FailedPrecondition(
                f"the daemon of {self.site.name} exited with {self.proc.returncode}; see {log}"
            ) from None
        except NotReady as e:
            raise FailedPrecondition(f"the daemon of {self.site.name}: {e}; see {log}") from None
        self.address = f"127.0.0.1:{info['port']}"
        return self.address

    def kill(self) -> None:
        self.killed_at = _now()  # taken before the signal: every consequence comes after it
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM: graceful shutdown (health NOT_SERVING, in-flight releases finish)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class RoundProcess:
    """One site's ``privfusion round`` process running the plan; its events stream to ``on_event``."""

    def __init__(self, site: SiteWorld, round_files: list[Path], on_event: Callable[[dict], None]):
        self.site = site
        self.events: list[dict] = []
        # held for the process's lifetime (its stderr), closed when it has ended
        self.log = open(site.root / "rounds.log", "ab")  # noqa: SIM115
        # --simulation: the site's fixed noise seed (refused by a production `privfusion round`)
        args = [sys.executable, "-m", "peer.cli", "round", "--config", str(site.config), "--events", "--simulation"]
        for f in round_files:
            args += ["--round", str(f)]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=self.log, env=_child_env(), text=True)
        self.killed_at: str | None = None
        self._reader = threading.Thread(target=self._read, args=(on_event,), daemon=True)
        self._reader.start()

    def _read(self, on_event) -> None:
        for line in self.proc.stdout:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            self.events.append(e)
            on_event(e)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.killed_at = _now()
            self.proc.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        self.log.close()
        return code


class RoundThread:
    """One site's rounds run in this (the simulator's) process, on a thread: the same
    ``coordinator_free.runner.run_rounds`` that ``privfusion round`` runs, with the site's own
    site.toml — its identity, trust store, model and probe set — and round files, so every
    call is still a mutual-TLS call between two sites. Why not a process per site: each
    would import torch, gRPC and NumPy again (about 330 MB resident apiece; twelve sites
    need twelve), while this process has them already. The command itself stays covered by
    the failure scenario's victim (below) and by the round tests.

    ``kill`` cannot SIGKILL a thread: it interrupts the rounds as SIGTERM would the command
    (nothing more is requested, the report says ``interrupted``); the exit code is the one the
    command would have (0 every round fused, 3 one did not, 143 interrupted, 2 refused input,
    1 any other error — its traceback in the site's rounds.log)."""

    def __init__(self, site: SiteWorld, round_files: list[Path], on_event: Callable[[dict], None]):
        self.site = site
        self.events: list[dict] = []
        self.killed_at: str | None = None
        self.code: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(round_files, on_event), name=f"rounds-{site.name}", daemon=True
        )
        self._thread.start()

    def _run(self, round_files: list[Path], on_event: Callable[[dict], None]) -> None:
        import traceback

        from coordinator_free.iterate import IterateConfig
        from coordinator_free.runner import run_rounds
        from peer.base.errors import PrivFusionError

        def emit(e: dict) -> None:
            e = json.loads(json.dumps(e, sort_keys=True, default=str))  # as the command prints it
            self.events.append(e)
            on_event(e)

        code = 0
        try:
            for cfg, result in run_rounds(self.site.config, round_files, emit, self._stop, simulation=True):
                if result.status == "interrupted":
                    code = 128 + signal.SIGTERM
                    break
                if result.status != "fused" and not isinstance(cfg, IterateConfig):  # as the command
                    code = 3
        except PrivFusionError as e:
            code = 2
            self._log(f"privfusion round: error: {e}\n")
        except Exception:
            code = 1
            self._log(traceback.format_exc())
        self.code = code

    def _log(self, text: str) -> None:
        with open(self.site.root / "rounds.log", "a", encoding="utf-8") as f:
            f.write(text)

    def poll(self) -> int | None:
        return None if self._thread.is_alive() else self.code

    def kill(self) -> None:
        if self._thread.is_alive():
            self.killed_at = _now()
            self._stop.set()

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        return self.code


def _ledger_count(path: Path) -> int:
    from peer.budget.ledger import Ledger

    if not path.exists():
        return 0
    ledger = Ledger(path, verify=False)
    try:
        return len(ledger.entries())
    finally:
        ledger.close()


# ------------------------------------------------------------------------------------- the run


def _shut_down(rounds, daemons) -> None:
    """Stop what a phase started: rounds still running are interrupted and waited for, then every
    daemon gets SIGTERM (all at once, so their grace periods overlap) and is waited for."""
    for r in rounds:
        if r.poll() is None:
            r.kill()
            r.wait()
    daemons = list(daemons)
    for d in daemons:
        d.terminate()
    for d in daemons:
        d.stop()


def run_sites(world: World, progress: Progress) -> dict:
    """Start every daemon, write the roster, run every site's rounds at once, stop the daemons.
    Returns what happened to processes (kills, exit codes)."""
    import torch

    from coordinator_free.events import QUIET, describe

    sc = world.scenario
    # The sites' rounds share this process (RoundThread): one torch thread each, as a round
    # process has (OMP_NUM_THREADS=1); the ops are small and the cores are few.
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # and glibc's arenas capped at two, as a daemon's are: by default each of the rounds' ~100
    # threads that allocates while another holds the heap gets an arena that keeps what it
    # freed (measured at 12 sites: the simulate process's peak 723 → 628 MiB); for the rest of
    # this process, as glibc has no way back
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(-8, 2)  # M_ARENA_MAX (malloc.h)
    daemons: dict[str, Daemon] = {}
    rounds: dict[str, RoundProcess | RoundThread] = {}
    failure: dict[str, Any] = {}
    try:
        t0 = time.monotonic()
        for s in world.sites.values():
            daemons[s.name] = Daemon(s)
        # all start at once and share the cores: a start-up takes ~5 s of CPU (imports, pools),
        # so the wait is on each daemon's own CPU time, not the wall clock
        for name, d in daemons.items():
            progress(
                f"{name}: daemon serving on {d.wait_ready()} (pid {d.proc.pid}, mutual TLS, ledger {d.site.ledger.name})"
            )
        world.timings["daemons_start_s"] = time.monotonic() - t0
        roster = world.out / "roster.toml"
        write_roster(
            roster, [(n, d.address, str((world.sites[n].identity / "site.crt").resolve())) for n, d in daemons.items()]
        )

        def on_event(e: dict) -> None:
            if e["event"] not in QUIET:
                progress(describe(e))

        t0 = time.monotonic()
        victim = sc.failure.site if sc.failure is not None else None
        if sc.round.repair != "off":
            # REPAIR's statistic points come from a torch.fx trace, which hijacks nn.Module.__call__
            # process-wide while it runs: trace the one architecture now, before the round threads
            # run forward passes (coordinator_free.after_fusion.stat_points_of remembers it)
            from coordinator_free.after_fusion import stat_points_of
            from peer.nn.architectures import input_tensor

            some = next(iter(world.sites.values()))
            shape = tuple(input_tensor(some.architecture, np.asarray(some.x)[:1]).shape[1:])
            stat_points_of(some.architecture, shape)
        for s in world.sites.values():
            files = []
            for label, method, scale in world.plan:
                f = s.root / f"round-{label}.toml"
                f.write_text(round_toml(sc, s, label, method, scale, roster.resolve()), encoding="utf-8")
                files.append(f)
            # a SIGKILL must take the victim's rounds down with its daemon: a process of its own
            rounds[s.name] = (RoundProcess if s.name == victim else RoundThread)(s, files, on_event)
        progress(f"every site started its rounds ({', '.join(label for label, _, _ in world.plan)}) at once")

        if sc.failure is not None:
            while rounds[victim].poll() is None:
                if _ledger_count(world.sites[victim].ledger) >= sc.failure.after_releases:
                    daemons[victim].kill()
                    rounds[victim].kill()
                    failure = {
                        "site": victim,
                        "killed_at": daemons[victim].killed_at,
                        "signal": "SIGKILL",
                        "trigger": f"scripted: once its ledger held {sc.failure.after_releases} charge(s)",
                        "ledger_entries_at_kill": _ledger_count(world.sites[victim].ledger),
                    }
                    progress(
                        f"FAILURE: SIGKILL {victim} (daemon and round) at {failure['killed_at']}: {failure['trigger']}"
                    )
                    break
                time.sleep(0.02)
            if not failure:
                failure = {
                    "site": victim,
                    "killed_at": None,
                    "trigger": f"not reached: its ledger never held {sc.failure.after_releases} charges",
                }
                progress(f"FAILURE not triggered: {failure['trigger']}")
        codes = {n: r.wait() for n, r in rounds.items()}
        world.timings["rounds_s"] = time.monotonic() - t0
    finally:
        _shut_down(rounds.values(), daemons.values())
        torch.set_num_threads(torch_threads)
    return {"exit_codes": codes, "failure": failure, "addresses": {n: d.address for n, d in daemons.items()}}


# ------------------------------------------------------------------------------------- evaluation


def round_reports(site: SiteWorld) -> dict[str, dict]:
    """The round reports a site wrote, by label (a killed site may have none)."""
    out = {}
    for p in sorted((site.root / "rounds").glob("round-*.json")):
        r = json.loads(p.read_text())
        out[r["label"]] = r
    return out


def oracle_accuracy(world: World, site: SiteWorld, contributors: list[str]) -> float:
    """NON-PRIVATE baseline: the same α-fusion, aligned by graph matching on every model's EXACT
    features on the site's probe set (the simulator holds every exact model; no site could)."""
    arch = site.architecture
    own = extract_graph(arch, model_from_arrays(arch, site.arrays), site.probe)
    aligned = []
    for name in contributors:
        other = world.sites[name]
        g = extract_graph(arch, model_from_arrays(arch, other.arrays), site.probe)
        aligned.append(align(arch, own, g, other.arrays)[0])
    fused = average_arrays([site.arrays, *aligned], fusion_weights(site.alpha, len(aligned)))
    return accuracy(arch, model_from_arrays(arch, fused), world.x_test, world.y_test)


def after_fusion_accuracies(world: World, site: SiteWorld, r: dict) -> dict:
    """Test accuracy of each local stage after fusion the round saved (``selected``,
    ``repaired``, ``finetuned``) and what the round did (kept peers, α, adopted stage)."""
    from peer.nn.store import load_model

    out: dict[str, Any] = {}
    for stage in ("selected", "repaired", "finetuned"):
        name = r.get(f"{stage}_model")
        m = load_model(site.root / "rounds" / "models", name) if name else None
        out[f"accuracy_{stage}"] = (
            None if m is None else accuracy(site.architecture, m.module(), world.x_test, world.y_test)
        )
    a = r.get("after_fusion") or {}
    sel = a.get("select") or {}
    out["after_fusion"] = {
        "repair": (a.get("repair") or {}).get("data", "off"),
        "kept": sel.get("kept"),
        "dropped": sel.get("dropped"),
        "alpha": sel.get("alpha"),
        "finetune_epochs": (a.get("finetune") or {}).get("epochs", 0),
        "adopt": a.get("adopt"),
        "error": a.get("error"),
    }
    return out


def evaluate(world: World) -> dict[str, dict]:
    from peer.nn.architectures import accuracy, model_from_arrays
    from peer.nn.store import load_model

    out = {}
    for name, s in world.sites.items():
        arch = s.architecture
        reports = round_reports(s)
        rounds = {}
        for label, method, scale in world.plan:
            r = reports.get(label)
            if r is None:
                rounds[label] = {
                    "status": "missing",
                    "method": method,
                    "scale": scale,
                    "accuracy": None,
                    "reason": "no round report (the site was killed before it finished this round)",
                }
                continue
            acc = None
            if r["status"] == "fused":
                m = load_model(s.root / "rounds" / "models", r["fused_model"])
                acc = accuracy(arch, model_from_arrays(arch, m.arrays), world.x_test, world.y_test)
            drops = [p["drop"] for p in r["peers"].values() if p["drop"] is not None]
            rounds[label] = {
                "status": r["status"],
                "reason": r["reason"],
                "method": method,
                "scale": scale,
                "round_id": r["round_id"],
                "accuracy": acc,
                "contributors": r["contributors"],
                "weights": r["weights"],
                "dropped": drops,
                "started_at": r["started_at"],
                "finished_at": r["finished_at"],
                "released_epsilon_per_peer": released_epsilon(world.scenario, scale) if method == "ldp" else None,
                "methods": {p: v["method"] for p, v in r["peers"].items() if v["state"] == "contributed"},
                **after_fusion_accuracies(world, s, r),
            }
        main = next((rounds[label] for label, m, sc in world.plan if m == "ldp" and sc == 1.0), None)
        contributors = (
            main["contributors"] if main and main.get("contributors") else [n for n in world.sites if n != name]
        )
        out[name] = {
            "records": len(s.y),
            "alpha": s.alpha,
            "own_accuracy": accuracy(arch, model_from_arrays(arch, s.arrays), world.x_test, world.y_test),
            "rounds": rounds,
            "oracle": {
                "accuracy": oracle_accuracy(world, s, contributors),
                "contributors": contributors,
                "label": "ORACLE (non-private): graph matching on exact features, computed by the simulator",
            },
            "pool": s.pool,
        }
    return out


def read_ledger(path: Path) -> dict:
    """A site's ledger as the file holds it: entries and budget states (the filter's ε), plus
    each budget's basic-composition sums (Σε, Σδ over its entries).

    The ledger's PLD figure is left out: composing the PLDs of a few dozen composite releases
    takes minutes on two cores, and for these per-neuron releases it is not below the
    filter's ε anyway (``privfusion ledger show`` computes it on demand)."""
    from peer.budget.ledger import Ledger

    ledger = Ledger(path)  # read-only (no policy); verified at open: integrity, hash chain, totals
    try:
        summary = ledger.summary(pld=False)
    finally:
        ledger.close()
    for b in summary["budgets"]:
        mine = [e for e in summary["entries"] if b["budget"] in e["budgets"]]
        b["epsilon_sum"] = float(sum(e["epsilon"] for e in mine))
        b["delta_sum"] = float(sum(e["delta"] for e in mine))
    return summary


def read_ledgers(world: World) -> dict[str, dict]:
    return {name: read_ledger(s.ledger) for name, s in world.sites.items()}


def reconcile(world: World, evaluation: dict, ledgers: dict) -> dict[str, dict]:
    """For each releasing site: its ledger entries against the receipts requesters reported.

    Every receipt a requester got must be an entry of the releasing site's ledger. An entry no
    surviving report holds a receipt for went to a requester that died before writing its
    report, or whose stream broke before the receipt arrived (the charge stands)."""
    receipts: dict[str, dict[str, dict]] = {n: {} for n in world.sites}
    for name, s in world.sites.items():
        for r in round_reports(s).values():
            for c in r["charges"]:
                receipts[c["peer"]][c["release_id"]] = {
                    "requester": name,
                    "round": r["label"],
                    "step": c["step"],
                    "entry_id": c["entry_id"],
                }
    out = {}
    for name in world.sites:
        entries = {e["release_id"]: e for e in ledgers[name]["entries"]}
        missing = sorted(set(receipts[name]) - set(entries))
        unreported = [
            {"entry_id": e["entry_id"], "counterparty": e["counterparty"], "mechanism": e["mechanism"]}
            for rid, e in entries.items()
            if rid not in receipts[name]
        ]
        out[name] = {
            "ledger_entries": len(entries),
            "receipts_reported": len(receipts[name]),
            "receipts_missing_from_ledger": missing,
            "entries_without_reported_receipt": unreported,
            "consistent": not missing,
        }
    return out


def run_baselines(world: World, progress: Progress) -> dict:
    """Central pooled training always, DP-FedAvg when the scenario has ``[iterate]``
    (``scenarios.baselines``), on the sites' own split and the same test set."""
    from scenarios.baselines import scenario_baselines

    t0 = time.monotonic()
    sites = [world.sites[s.name] for s in world.scenario.sites]
    out = scenario_baselines(
        world.scenario, sites[0].architecture, [(s.x, s.y) for s in sites], world.x_test, world.y_test, progress
    )
    world.timings["baselines_s"] = time.monotonic() - t0
    return out


def simulate(sc: Scenario, out: str | os.PathLike, progress: Progress | None = None) -> dict:
    """Run a scenario end to end and write its report into ``out``; returns the report."""
    from scenarios.report import write_report

    progress = progress or Progress()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FailedPrecondition(f"--out {out} is not empty; give a new directory (a simulation never overwrites one)")
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    progress(f"scenario {sc.name!r}: {len(sc.sites)} sites, {sc.data.dataset}, split {sc.data.split}; output in {out}")
    t0 = time.monotonic()
    world = prepare(sc, out, progress)
    world.timings["prepare_s"] = time.monotonic() - t0
    processes = run_sites(world, progress)
    # the iterate run's daemons and loops are processes of their own: they run while the
    # rounds above are evaluated here
    iterate = None
    if sc.iterate is not None:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=1)
        iterate = pool.submit(run_iterate_sites, world, progress)
        pool.shutdown(wait=False)
    t0 = time.monotonic()
    progress("evaluating models and the non-private oracle; reading every ledger")
    evaluation = evaluate(world)
    ledgers = read_ledgers(world)
    world.timings["evaluate_s"] = time.monotonic() - t0
    baselines = run_baselines(world, progress)
    if iterate is not None:
        for name, it in evaluate_iterate(world, iterate.result()).items():
            evaluation[name]["iterate"] = it
    world.timings["total_s"] = time.monotonic() - started
    report = {
        "scenario": sc.to_dict(),
        "plan": [{"label": label, "method": m, "scale": s} for label, m, s in world.plan],
        "sites": evaluation,
        "ledgers": ledgers,
        "reconciliation": reconcile(world, evaluation, ledgers),
        "baselines": baselines,
        "failure": processes["failure"],
        "round_exit_codes": processes["exit_codes"],
        "addresses": processes["addresses"],
        "timings": world.timings,
        "test_examples": len(world.y_test),
        "public_examples": len(world.y_public),
    }
    write_report(report, out)
    return report


# ------------------------------------------------------------------------------------- iterate
#
# Multi-round peer-to-peer DP training (``coordinator_free.iterate``), run after the rounds
# above as a deployment of its own: every site gets a fresh ledger whose data budget is the
# run's (ε, δ) per record (``[iterate]``), so that the run is measured at the same per-record
# cost as the DP-FedAvg baseline and its ledger holds nothing else; the site's identity, model
# store and probe set are the ones above. Its records are written into its own directory (they
# never leave it: the daemon serves only the charged segments).


def iterate_orders(sc: Scenario) -> tuple[float, ...]:
    """The Rényi orders of the run's ledgers (``[iterate] ledger_orders``)."""
    from peer.budget.dpsgd_noise import planned_orders
    from peer.budget.filter import FILTER_ORDERS

    it = sc.iterate
    if it.ledger_orders == "default":
        return FILTER_ORDERS
    if it.ledger_orders == "planned":
        return planned_orders(it.epsilon, it.delta, it.rounds * it.local_steps, adjacency=it.adjacency)
    return tuple(it.ledger_orders)


def iterate_site_toml(sc: Scenario, s: SiteWorld) -> str:
    """site.toml of a site's iterate deployment (``SITE/iterate/``): the site's identity, models
    and probe set, a fresh ledger with the run's data budget, segments allowed to every peer."""
    it = sc.iterate
    orders = ", ".join(repr(float(o)) for o in iterate_orders(sc))
    lines = [
        "[site]",
        f'name = "{s.name}"',
        'listen = "127.0.0.1:0"',
        'identity = "../identity"',
        'models = "../models"',
        'ledger = "ledger.sqlite"',
        'probe = "../probe.safetensors"',
        "workers = 16",
        "shutdown_grace_s = 5",
        f"seed = {s.seed}",
        "",
        "[policy]",
        'show_remaining = "own"',
        f"orders = [{orders}]",
        "",
        "[policy.data]",
        f'unit = "record:{it.adjacency}"',
        f"epsilon = {it.epsilon!r}",
        f"delta = {it.delta!r}",
        "",
        '[policy.peers."*"]',
        'allow = ["segment", "ledger"]',
    ]
    return "\n".join(lines) + "\n"


def iterate_round_toml(sc: Scenario, roster: Path) -> str:
    it = sc.iterate
    lines = [
        "[round]",
        f'roster = "{roster}"',
        f'model = "{MODEL}"',
        'method = "iterate"',
        'out = "rounds"',
        f"call_timeout_s = {sc.round.call_timeout_s!r}",
        "",
        "[round.iterate]",
        'records = "records.npz"',
        'run = "iterate"',
        f"rounds = {it.rounds}",
        f"local_steps = {it.local_steps}",
        f"learning_rate = {it.learning_rate!r}",
        f"clip_norm = {it.clip_norm!r}",
        f"epsilon = {it.epsilon!r}",
        f"delta = {it.delta!r}",
        f'adjacency = "{it.adjacency}"',
        *([f"declared_records = {it.declared_records}"] if it.declared_records is not None else []),
        f"init_seed = {it.init_seed}",
        "wait_s = 30.0",
    ]
    return "\n".join(lines) + "\n"


def run_iterate_sites(world: World, progress: Progress) -> dict[str, SiteWorld]:
    """Every site's iterate daemon (a process of its own) and loop (a thread of this process, as
    the rounds: ``RoundThread``), all at once; the sites' iterate worlds (``SITE/iterate/``)."""
    import dataclasses

    from coordinator_free.iterate import describe as describe_iterate

    sc = world.scenario
    sites = {n: dataclasses.replace(s, root=s.root / "iterate") for n, s in world.sites.items()}
    for s in sites.values():
        s.root.mkdir(parents=True, exist_ok=True)
        np.savez(s.root / "records.npz", x=s.x, y=s.y)  # the site's own records, in its own directory
        s.config.write_text(iterate_site_toml(sc, s), encoding="utf-8")
    daemons: dict[str, Daemon] = {}
    loops: dict[str, RoundThread] = {}
    try:
        t0 = time.monotonic()
        for s in sites.values():
            daemons[s.name] = Daemon(s)
        for d in daemons.values():
            d.wait_ready()
        roster = world.out / "roster-iterate.toml"
        write_roster(
            roster,
            [(n, d.address, str((world.sites[n].identity / "site.crt").resolve())) for n, d in daemons.items()],
        )

        def on_event(e: dict) -> None:
            line = describe_iterate(e) if str(e.get("event", "")).startswith("iterate-") else None
            if line:
                progress(line)

        for s in sites.values():
            f = s.root / "round-iterate.toml"
            f.write_text(iterate_round_toml(sc, roster.resolve()), encoding="utf-8")
            loops[s.name] = RoundThread(s, [f], on_event)
        it = sc.iterate
        progress(
            f"iterate: every site runs {it.rounds} rounds × {it.local_steps} DP-GD steps at ε = {it.epsilon:g} "
            f"(δ = {it.delta:g}) per record, ledger orders {list(iterate_orders(sc))}"
        )
        for n, r in loops.items():
            sites[n].exit_code = r.wait()
        world.timings["iterate_s"] = time.monotonic() - t0
    finally:
        _shut_down(loops.values(), daemons.values())
    return sites


def evaluate_iterate(world: World, sites: dict[str, SiteWorld]) -> dict[str, dict]:
    """Per site: each round's fused model on the test set, ε spent by round (the ledger's
    filter and the PLD of the steps so far), bytes, contributors; and the ledger's own figures
    read back from the file after the run (filter and PLD of every charged segment)."""
    from peer.budget.ledger import Ledger
    from peer.nn.store import load_model

    out = {}
    for name, s in sites.items():
        path = s.root / "rounds" / "iterate.json"
        if not path.exists():
            out[name] = {
                "status": "missing",
                "reason": f"no report (exit code {getattr(s, 'exit_code', None)}; see {s.root / 'rounds.log'})",
                "rounds": [],
                "final_accuracy": None,
                "epsilon_filter": None,
                "epsilon_pld": None,
            }
            continue
        rep = json.loads(path.read_text())
        rounds = []
        for r in rep["rounds"]:
            m = load_model(s.root / "rounds" / "models", r["model"])
            acc = accuracy(s.architecture, model_from_arrays(s.architecture, m.arrays), world.x_test, world.y_test)
            rounds.append(
                {
                    "round": r["round"],
                    "accuracy": acc,
                    "epsilon_filter": r["epsilon_filter"],
                    "epsilon_pld": r["epsilon_pld"],
                    "bytes_sent": r["bytes_sent"],
                    "bytes_received": r["bytes_received"],
                    "contributors": r["contributors"],
                    "staleness": {p: v["staleness"] for p, v in r["peers"].items() if v.get("staleness") is not None},
                }
            )
        ledger = Ledger(s.ledger)  # read-only, verified at open
        try:
            data = [b for b in ledger.budget_states(pld=True) if b.key.level == "data"]
            charges = len(ledger.entries())
            served = len(ledger.served_again())
        finally:
            ledger.close()
        out[name] = {
            "status": rep["status"],
            "reason": rep["reason"],
            "rounds": rounds,
            "rounds_done": rep["rounds_done"],
            "final_accuracy": rounds[-1]["accuracy"] if rounds else None,
            "epsilon_filter": rep["epsilon_filter"],
            "epsilon_pld": rep["epsilon_pld"],
            "noise_multiplier": rep["noise_multiplier"],
            "ledger_orders": rep["plan"]["ledger_orders"],
            "bytes_sent": rep["bytes_sent"],
            "bytes_received": rep["bytes_received"],
            "exit_code": getattr(s, "exit_code", None),
            "ledger": {
                "charges": charges,
                "served_again": served,
                "epsilon_limit": data[0].epsilon_limit if data else None,
                "epsilon_filter": data[0].spent_epsilon if data else None,
                "epsilon_pld": data[0].pld_epsilon if data else None,
            },
        }
    return out
