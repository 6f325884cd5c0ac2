"""``privfusion site new``: a new site's directory, ready to serve.

    privfusion site new --name hospital-a --dir site --listen 0.0.0.0:50051 [--address a.example.org ...]
                        [--adjacency add-remove|replace-one]
    privfusion site check --site site [--json]    # what the daemon would not serve, and why

Makes, in DIR (which must not exist or be empty):

- ``identity/`` — the site's key pair and self-signed certificate (as ``privfusion peer init``),
  with an empty ``trusted/`` for the peers it will pin;
- ``models/`` — an empty model store (``peer.nn.store``): ``privfusion model train`` writes the
  site's models there, ``privfusion model adopt`` puts fused or merged models there;
- ``pool/`` — an empty DP-SGD pool directory (``privfusion pool train`` fills it); a pool with
  no model is not offered, and the daemon says so;
- ``site.toml`` — the daemon's configuration with commented, conservative budgets (below), a
  ledger path (``ledger.sqlite``, created when the daemon first starts) and the probe path
  (``probe.safetensors``, made by ``privfusion probe make``; the daemon serves without it until
  then).

``privfusion peer serve --config DIR/site.toml`` works at once (it offers nothing yet).

The default budgets (``site.toml`` says the same beside each number):

- **data level** (central DP on the site's training records; unit: one training record,
  add-remove by default — ``--adjacency replace-one`` for the other): ε = 4 at δ = 1e-5 over
  *every* data-level release this site ever makes (merges of its pool, segments of iterate
  runs), all peers together, by the ledger's filter (RDP, δ split over its orders). The unit is
  the one the site's own templates use: iterate runs default to add-remove, and ``privfusion
  pool train --site`` trains in the site's unit (``peer.cli.pool.pool_adjacency``), dividing by
  the public ``[site] declared_records`` (1000 in the template), never by the true count. A
  pool or run in the other unit is refused by the ledger, never mixed. A merge's target ε is
  its PLD ε; the filter charges an RS merge more, because its RDP bound of a mixture is looser
  than the mixture's PLD. With ``privfusion pool train``'s default pool in add-remove, a merge
  at a round's default target (ε = 2, δ = 1e-5) mixing dpsgd-a into dpsgd-b is charged
  ε ≈ 3.61 (``ledger show``: 0.39 remaining) and a second is refused; an iterate run at its
  default (4, 1e-5) has its noise calibrated to the whole budget. Under replace-one the default
  pool's models are twice as sensitive: the b-into-c merge is charged 3.05, a second fits (3.68),
  a third does not. (``tests/test_site.py`` checks these figures against the ledger,
  ``tests/test_config_traps.py`` the documented pool, merge and iterate run end to end.) Raise
  it only with a reason.
- **model level** (local DP on one model's neurons; unit: one neuron — its activation row on a
  probe set and its incoming weights with bias): per model, ε = 24 at δ = 1e-5 in total and
  ε = 12 at δ = 1e-5 per counterparty. A round at the default per-neuron parameters (features
  at ε = 1 + 1, weights at (2, 1e-5)) costs a peer's model about ε ≈ 4 in the filter's terms
  (RDP composition makes later rounds a little cheaper), so each counterparty can run three
  such rounds against a model and all peers together seven (``tests/test_site.py`` counts
  them against a real daemon).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound

SITE_TOML = """\
# site.toml of {name!r}, written by `privfusion site new`. Paths are relative to this file.
# Schema: [site] in peer/net/daemon.py, [policy] in peer/budget/policy.py, [round] in
# coordinator_free/rounds.py. Start the daemon with: privfusion peer serve --config site.toml

[site]
{name_line}# the CN of identity/site.crt: peers pin it under this name
{listen_line}# where the daemon listens (HOST:PORT; peers dial the --address)
identity = "identity"             # site.key (private, mode 600), site.crt, trusted/ (pinned peers)
models = "models"                 # the models this site offers (privfusion model train / model adopt)
ledger = "ledger.sqlite"          # the privacy-budget ledger: append-only, created on first start
probe = "probe.safetensors"       # this site's PUBLIC probe set (privfusion probe make); peers see it
declared_records = 1000           # PUBLIC record count DP-SGD divides by under add-remove adjacency
                                  # (pool train --adjacency add-remove, iterate runs), where the true
                                  # count is private and never used: set one you may publish (e.g. a
                                  # rounded size); replace-one uses the true count (public there)
# limits (defaults shown): no single peer can take the site down
# workers = 32                    # streaming calls (releases, ledger listings) served at once
# reserve_workers = 8             # more threads, kept for health checks and GetPeerInfo
# max_calls_per_peer = 8          # calls one peer may have in progress (health checks exempt)
# metrics_listen = "127.0.0.1:9464"  # opt-in Prometheus endpoint (docs/deployment.md, Monitoring)

[site.mechanisms]
activation_clip = [0.0, 6.0]      # public range activations are clipped to before Laplace noise

[site.pools.dpsgd]                # the DP-SGD pool for RS/LC merges (privfusion pool train)
models = "pool"                   # not offered while it holds no model
validation = "validation.npz"     # PUBLIC labelled x/y that judges merge candidates (privfusion
                                  # probe make --label COL --pool dpsgd); needed once the pool has models

# ---- budgets: everything is closed unless granted here ------------------------------------
[policy]
show_remaining = "own"            # a peer may see what is left of its own budgets

[policy.data]                     # DATA LEVEL: central DP on this site's training records.
unit = "record:{adjacency}"{unit_pad}# unit of privacy: one training record, {unit_words}
                                  # pool train --site trains in this unit by default; a pool or
                                  # iterate run in the other unit is refused here, never mixed
epsilon = 4.0                     # all data-level releases ever (merges of the pool, iterate
delta = 1e-5                      # segments), all peers together, compose within (4, 1e-5)-DP per
                                  # record, by the ledger's filter (RDP, delta split over its
                                  # orders), which charges an RS merge more than its target (PLD)
{data_note}

[policy.model]                    # MODEL LEVEL: local DP on one model's neurons (each model has
                                  # its own). Unit of privacy: one neuron (its activations on the
                                  # probe set and its incoming weights and bias). A round at the
                                  # default parameters (features 1 + 1, weights (2, 1e-5)) costs
                                  # about 4 here: seven rounds in total, three per peer.
total = {{ epsilon = 24.0, delta = 1e-5 }}            # all counterparties together
per_counterparty = {{ epsilon = 12.0, delta = 1e-5 }}  # each counterparty on its own

[policy.caps]                     # the most epsilon one request may carry, per kind
features = 4.0                    # activation + weight-feature epsilon, per neuron
weights = 4.0                     # per neuron
merge = 4.0                       # per training record

[policy.peers."*"]                # every PINNED peer (privfusion peer trust add); others cannot connect
allow = ["features", "weights", "merge", "ledger", "segment"]  # segment: iterate runs' segments
# [policy.peers."hospital-b"]     # a peer with its own rule
# allow = ["features", "weights", "merge", "fuse", "ledger"]

# ---- a fusion round started by this site (privfusion round --config site.toml) ----------------
# [round]
# roster = "roster.toml"          # the sites to fuse with (address and certificate of each)
# model = "mlp"                   # our model to improve (a name in models/)
# alpha = 0.5                     # our weight; the peers that contribute share 1 - alpha
# quorum = 2                      # fewest sites (us included) a fused model may come from
# method = "auto"                 # a merge where a peer offers a pool, else LDP features + weights
# [round.features]                # per neuron, model level, charged at each peer
# activation_epsilon = 1.0
# weight_epsilon = 1.0
# [round.weights]
# epsilon = 2.0
# delta = 1e-5
# [round.merge]                   # per training record, data level, charged at each peer
# method = "rs"
# epsilon = 2.0
# delta = 1e-5
# method = "iterate" with [round.iterate]: multi-round DP training (docs/deployment.md, 3.1);
# its segments are charged to [policy.data] above, in its unit{iterate_note}
"""

#: What site.toml says about the data budget, per unit: the figures of ``privfusion pool
#: train``'s default pool trained in that unit (``tests/test_site.py`` recomputes them).
DATA_NOTES = {
    "add-remove": (
        "added or removed (the true\n"
        "                                  # record count is private: DP-SGD divides by declared_records);",
        """\
                                  # epsilon. With pool train's default pool (add-remove, n =
                                  # declared_records), a merge at a round's default target (2, 1e-5)
                                  # mixing dpsgd-a into dpsgd-b is charged 3.61 (ledger show: 0.39
                                  # left) and a second is refused; an iterate run at its default
                                  # (4, 1e-5) takes the whole budget (its noise is calibrated to it).""",
        "",
    ),
    "replace-one": (
        "replaced by another (the\n"
        "                                  # record count is public here: DP-SGD divides by it);",
        """\
                                  # epsilon. With pool train's default pool, a merge at a round's
                                  # default target (2, 1e-5) mixing dpsgd-b into dpsgd-c is charged
                                  # 3.05 (ledger show: 0.95 left), yet a second fits (3.68 after two)
                                  # and a third does not; one mixing dpsgd-a into dpsgd-c is charged
                                  # 6.97: refused.""",
        ': give it adjacency = "replace-one" (its default is add-remove)',
    ),
}
ADJACENCIES = tuple(DATA_NOTES)


def default_addresses(listen: str) -> list[str]:
    """The host of ``listen`` when it names one (not a wildcard): what peers will dial."""
    host = listen.rpartition(":")[0].strip("[]")
    return [] if host in ("0.0.0.0", "::", "") else [host]


def new_site(
    name: str,
    directory: str | Path,
    listen: str,
    addresses: list[str] | None = None,
    days: int = 730,
    adjacency: str = "add-remove",
) -> Path:
    """Make a site directory (see the module docstring); the path of its site.toml. ``adjacency``
    is the unit of its data budget (``--adjacency``), which ``pool train --site`` and iterate runs
    then train in."""
    from peer.net.address import check_listen
    from peer.net.identity import check_site_name, init_identity

    check_site_name(name, "--name")
    check_listen(listen, "--listen")
    d = Path(directory)
    if d.exists() and (not d.is_dir() or any(d.iterdir())):
        raise FailedPrecondition(f"--dir: {d} exists and is not an empty directory; a new site needs its own")
    if adjacency not in ADJACENCIES:
        raise InvalidArgument("--adjacency", f"must be one of {list(ADJACENCIES)}, got {adjacency!r}")
    if '"' in listen or "\\" in listen:
        raise InvalidArgument("--listen", f"must be HOST:PORT, got {listen!r}")
    d.mkdir(parents=True, exist_ok=True)
    init_identity(d / "identity", name, list(addresses or default_addresses(listen)), days=days)
    (d / "models").mkdir()
    (d / "pool").mkdir()
    path = d / "site.toml"
    path.write_text(
        SITE_TOML.format(
            name=name,
            name_line=f'name = "{name}"'.ljust(34),
            listen_line=f'listen = "{listen}"'.ljust(34),
            adjacency=adjacency,
            unit_pad=" " * (34 - len(f'unit = "record:{adjacency}"')),
            unit_words=DATA_NOTES[adjacency][0],
            data_note=DATA_NOTES[adjacency][1],
            iterate_note=DATA_NOTES[adjacency][2],
        ),
        encoding="utf-8",
    )
    return path


def _new(args) -> int:
    from peer.net.identity import CERT_FILE, format_fingerprint, load_identity

    path = new_site(args.name, args.dir, args.listen, args.address, days=args.days, adjacency=args.adjacency)
    d = Path(args.dir)
    ident = load_identity(d / "identity")
    print(f"site {args.name!r} in {d}: identity/ (key mode 600), models/ (empty), pool/ (empty), {path.name}")
    print(f"certificate SHA-256 fingerprint: {format_fingerprint(ident.fingerprint)}")
    print(
        f"give {d / 'identity' / CERT_FILE} to the sites you work with; read them this fingerprint over another channel"
    )
    print("next (docs/deployment.md, section 1):")
    print(f"  privfusion peer trust add OTHER.crt --dir {d / 'identity'}        # each site you work with")
    print(f"  privfusion model train --site {d} --data RECORDS.csv --label COL --name NAME")
    print(
        f'  privfusion pool train --site {d} --data RECORDS.csv --label COL --architecture \'{{"kind": "mlp", "hidden": [64]}}\''
        "   # the model's architecture"
    )
    print(f"  privfusion probe make --site {d} --data PUBLIC.csv --label COL")
    print(f"  privfusion peer serve --config {path}")
    return 0


def check_site(site: str | Path) -> list[tuple[str, str]]:
    """What the daemon of this site would not serve, and why (as it logs and ``GetPeerInfo``
    lists it), by the daemon's own checks (``peer.net.daemon.check_site``); raises what
    ``peer serve`` would refuse to start with."""
    from peer.net.daemon import check_site as daemon_check

    found = daemon_check(Path(site) / "site.toml")
    return [*found.broken, *found.pending]


def _check(args) -> int:
    """Exit 0: the daemon would start and serve every file there is; 1: it would start but
    leave out files that exist (a model that does not load, a stray file); 2 (through
    ``peer.cli.app``): it would refuse to start, and why."""
    from peer.net.daemon import check_site as daemon_check

    found = daemon_check(Path(args.site) / "site.toml", simulation=args.simulation)
    if args.json:
        print(json.dumps([{"path": p, "reason": why} for p, why in (*found.broken, *found.pending)], indent=2))
        return 1 if found.broken else 0
    print("checked, as privfusion peer serve does before it listens:")
    for what in found.checked:
        print(f"  {what}")
    for p, why in found.broken:
        print(f"not served: {p}: {why}")
    for p, why in found.pending:
        print(f"not yet: {p}: {why}")
    for change in found.changes:
        print(f"budget: {change.describe()}")
    if found.broken:
        print(f"the daemon would start, leaving out {len(found.broken)} file(s) above", file=sys.stderr)
        return 1
    print("the daemon would start and serve every model and pool file there is")
    return 0


def register(subparsers) -> None:
    site = subparsers.add_parser(
        "site", help="make a new site's directory (identity, model store, site.toml); check it"
    )
    sub = site.add_subparsers(dest="site_command", metavar="ACTION")
    sub.required = True
    p = sub.add_parser("new", help="identity, empty model store and pool, ledger path and a commented site.toml")
    p.add_argument("--name", required=True, help="the site name (certificate CN; how peers pin it)")
    p.add_argument("--dir", required=True, help="the site directory to create (must not exist or be empty)")
    p.add_argument("--listen", required=True, metavar="HOST:PORT", help="where the daemon listens, e.g. 0.0.0.0:50051")
    p.add_argument(
        "--address",
        action="append",
        default=[],
        help="a host or IP peers dial this site by (repeatable; default: the host of --listen unless a wildcard)",
    )
    p.add_argument("--days", type=int, default=730, help="certificate validity in days (default 730)")
    p.add_argument(
        "--adjacency",
        choices=ADJACENCIES,
        default="add-remove",
        help="the unit of the data budget: one training record added or removed (default; DP-SGD then divides by "
        "the public [site] declared_records) or replaced; pool train --site and iterate runs train in it",
    )
    p.set_defaults(func=_new)
    p = sub.add_parser(
        "check",
        help="everything peer serve checks before it listens: exit 2 if it would refuse to start, 1 if it "
        "would leave out files that exist (and why)",
    )
    p.add_argument("--site", required=True, metavar="DIR", help="the site directory (its site.toml)")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.add_argument(
        "--simulation",
        action="store_true",
        help="check as peer serve --simulation starts (fixed seeds allowed: tests and simulations only)",
    )
    p.set_defaults(func=_check)


# ------------------------------------------------------------------------------ adopt, export


def adopt_model(
    site: str | Path, source: str | Path, name: str, preprocessing_from: str | None = None
) -> tuple[Path, dict]:
    """Put a fused or merged model into the site's store as ``name``, with its provenance.

    ``source`` is a round's fused model (``rounds/models/MODEL-fused-ID``; its round
    report ``rounds/round-ID.json``, with every signed receipt and every drop, is copied as
    provenance, and the preprocessing of the round's own model comes with it: fusion keeps the
    input space), or a release pair ``OUT.safetensors`` + ``OUT.json`` from ``privfusion
    weights / merge / fuse``, whose signature, manifest and tensors are verified against the
    site's pinned certificates first (``peer.net.client.verify_saved_release``; a release that
    does not verify is refused) and whose document is copied as provenance; a release carries no
    preprocessing, so it comes from ``preprocessing_from`` or the site's default; or a local
    RS/LC merge of the site's own pool (``privfusion merge --pool``: its record and weight
    choice are the provenance, the pool's preprocessing comes with it).

    Writes ``models/NAME.safetensors``, ``models/NAME.json`` (metadata ``adopted``: what, from
    where, when; and the preprocessing) and ``models/NAME.provenance.json`` (the whole report
    or release document). A name already in the store is refused. The daemon offers the model
    after its next start; a round with ``[round] model = NAME`` starts from it.
    """
    from peer.base.records import now_rfc3339
    from peer.cli.evaluate import describe_file_model, release_pair, site_default_preprocessing, site_models_dir
    from peer.nn.store import check_name, load_model, load_model_pair, save_model, write_sidecar

    check_name(name, "--name")
    store = site_models_dir(site)
    if (store / f"{name}.json").exists() or (store / f"{name}.safetensors").exists():
        raise FailedPrecondition(f"--name: the site already has a model {name!r} in {store}; choose another name")
    directory, stem = release_pair(source)
    stored = load_model_pair(directory / stem)
    kind = describe_file_model(stored.metadata)
    adopted: dict = {"from": str(Path(directory) / stem), "kind": kind, "at": now_rfc3339()}
    prep, prep_source = None, None
    if kind == "release":
        from peer.net.client import verify_saved_release
        from peer.net.site import SiteConfig
        from peer.net.trust import TrustStore

        config = SiteConfig.load(Path(site) / "site.toml")
        check = verify_saved_release(Path(directory) / stem, TrustStore(config.identity / "trusted"))
        meta = stored.metadata
        record = meta.get("record", {})
        adopted.update(
            release_kind=meta["release"]["kind"],
            signer=meta["release"]["signer"],
            ledger_entry_id=meta["release"]["ledger_entry_id"],
            release_id=record.get("release_id"),
            level=record.get("level"),
            unit=record.get("unit"),
            epsilon=record.get("epsilon"),
            delta=record.get("delta"),
            verified=True,
        )
        provenance = {
            "kind": "release",
            "verification": check,
            "document": json.loads((Path(directory) / f"{stem}.json").read_text()),
        }
    elif kind == "round":
        round_meta = stored.metadata["round"]
        report_path = Path(directory).parent / f"round-{round_meta['round_id']}.json"
        if not report_path.is_file():
            raise NotFound(
                f"--from: the round report {report_path} of {stem!r} is missing; it is the model's provenance"
            )
        report = json.loads(report_path.read_text(encoding="utf-8"))
        adopted.update(
            round_id=round_meta["round_id"],
            site=round_meta.get("site"),
            base_model=report.get("model"),
            contributors=round_meta.get("contributors"),
            weights=round_meta.get("weights"),
            report=str(report_path),
        )
        provenance = {"kind": "round", "report": report}
        if preprocessing_from is None and report.get("model"):
            base = load_model(store, report["model"]) if (store / f"{report['model']}.json").is_file() else None
            prep = base.preprocessing if base is not None else None
            prep_source = f"the round's own model {report['model']!r}" if prep is not None else None
    elif kind == "merge":  # a local RS/LC merge of this site's own pool (privfusion merge --pool)
        adopted.update(
            release_id=stored.metadata["record"].get("release_id"),
            mechanism=stored.metadata["record"].get("mechanism"),
            level=stored.metadata["record"].get("level"),
            unit=stored.metadata["record"].get("unit"),
            epsilon=stored.metadata["record"].get("epsilon"),
            delta=stored.metadata["record"].get("delta"),
        )
        provenance = {"kind": "merge", "document": json.loads((Path(directory) / f"{stem}.json").read_text())}
        if preprocessing_from is None:
            from peer.cli.evaluate import site_pool_preprocessing

            prep, prep_source = site_pool_preprocessing(site) or (None, None)
    else:
        raise InvalidArgument(
            "--from",
            f"{source} is neither a round's fused model, a release nor a merge; "
            "a site's own models are already in its store",
        )
    if prep is None:
        prep = stored.preprocessing
        prep_source = "stored with it" if prep is not None else None
    if prep is None or preprocessing_from is not None:
        prep, prep_source = site_default_preprocessing(site, preprocessing_from)
    adopted["preprocessing_from"] = prep_source
    # provenance first: a model exists once its manifest does, and then its provenance is there
    write_sidecar(store, name, ".provenance.json", provenance)
    path = save_model(store, name, stored.architecture, stored.arrays, {"adopted": adopted}, preprocessing=prep)
    return path, adopted


EXPORT_FORMATS = ("safetensors", "pt")


def export_model(site: str | Path, name: str, fmt: str, out: str | Path) -> Path:
    """Write a site model's weights for use outside PrivFusion: a plain state_dict (keys as
    torch's ``nn.Sequential`` of the architecture names them, float32).

    ``safetensors``: the tensors, with the architecture JSON in the header metadata
    (``privfusion_architecture``). ``pt``: ``torch.save`` of a dict of tensors only (loads with
    ``torch.load(..., weights_only=True)``). Neither holds the preprocessing (its statistics come
    from the site's training records and are not DP): ``model export`` writes it beside them as
    ``FILE.preprocessing.json`` (``peer.cli.model``), saying so.
    """
    from peer.cli.evaluate import site_models_dir
    from peer.nn.store import load_model

    if fmt not in EXPORT_FORMATS:
        raise InvalidArgument("--format", f"must be one of {list(EXPORT_FORMATS)}, got {fmt!r}")
    stored = load_model(site_models_dir(site), name)
    out = Path(out)
    if out.exists():
        raise FailedPrecondition(f"--out: {out} exists; export never overwrites")
    out.parent.mkdir(parents=True, exist_ok=True)
    arrays = {k: np.ascontiguousarray(np.asarray(v, dtype=np.float32)) for k, v in stored.arrays.items()}
    if fmt == "safetensors":
        from safetensors.numpy import save_file

        save_file(
            arrays,
            str(out),
            metadata={
                "privfusion_architecture": json.dumps(stored.architecture, sort_keys=True),
                "privfusion_model": name,
            },
        )
    else:
        import torch

        torch.save({k: torch.from_numpy(v.copy()) for k, v in arrays.items()}, str(out))
    return out
