"""The ``[site]`` table of site.toml (:class:`SiteConfig`; the schema is in ``peer.net.site``'s
docstring), read with the project's one TOML reader (``peer.base.config``): a bad value is
refused naming the file, the line and the key."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.base.config import Section, load_toml
from peer.base.errors import InvalidArgument
from peer.net.address import check_listen
from peer.net.identity import check_site_name
from peer.net.limits import Limits

#: The keys of ``[site]``.
SITE_KEYS = (
    "name",
    "listen",
    "identity",
    "models",
    "ledger",
    "probe",
    "workers",
    "reserve_workers",
    "max_calls_per_peer",
    "stream_idle_s",
    "stream_deadline_s",
    "shutdown_grace_s",
    "seed",
    "declared_records",
    "metrics_listen",
    "mechanisms",
    "pools",
    "peers",
    "own_models",
)


@dataclass(frozen=True)
class SiteConfig:
    """The ``[site]`` table of site.toml, paths resolved against the file's directory."""

    name: str
    listen: str
    identity: Path
    models: Path
    ledger: Path
    probe: Path | None = None
    workers: int = 32
    shutdown_grace_s: float = 20.0
    reserve_workers: int = 8
    max_calls_per_peer: int = 8
    stream_idle_s: float = 30.0
    stream_deadline_s: float = 600.0
    seed: int | None = None
    # the public record count DP-SGD divides by under add-remove (pool train, iterate runs)
    declared_records: int | None = None
    activation_clip: tuple[float, float] | None = None
    calibration: str = "analytic"
    pools: Mapping[str, Path] = field(default_factory=dict)
    peers: Mapping[str, str] = field(default_factory=dict)
    path: Path | None = None
    pool_validation: Mapping[str, Path] = field(default_factory=dict)
    # how each pool's merges choose pi / lambda (peer.dp.merging): "public-prior" unless set
    pool_selection: Mapping[str, str] = field(default_factory=dict)
    # the site's own networks (``privfusion model import``; default DIR/own_models when it exists)
    own_models: Path | None = None
    # where the opt-in Prometheus endpoint listens (peer.net.metrics); None: no endpoint
    metrics_listen: str | None = None

    @classmethod
    def load(cls, path: str | os.PathLike) -> SiteConfig:
        p = Path(path)
        data, text = load_toml(p, "site config")
        return cls.from_section(Section(data, (), text, str(p)), p.resolve().parent, p)

    @classmethod
    def from_section(cls, root: Section, base: Path, path: Path | None = None) -> SiteConfig:
        """The ``[site]`` table of a parsed file (``root``: the whole file); every error names
        the file, the line and the key."""
        site = root.section("site", required=True)
        site.known(SITE_KEYS)

        def rel(s: Section, key: str, default: Any = ...) -> Path | None:
            v = s.path(key, base, default)
            return None if v is None else v.resolve()

        def checked(s: Section, key: str, check: Callable[[str, str], str]) -> str:
            """A string that ``check(value, field)`` accepts; its refusal names the file and line."""
            value = s.string(key)
            try:
                return check(value, f"site.{key}")
            except InvalidArgument as e:
                s.fail(key, e.rule)

        mechanisms = site.section("mechanisms")
        mechanisms.known(("activation_clip", "calibration"))
        clip = mechanisms.interval("activation_clip", None)
        calibration = mechanisms.string("calibration", "analytic", choices=("analytic", "classical"))
        pools, pool_validation, pool_selection = {}, {}, {}
        for name, t in site.sections("pools").items():
            t.known(("models", "validation", "selection"))
            pools[name] = rel(t, "models")
            if "validation" in t:
                pool_validation[name] = rel(t, "validation")
            pool_selection[name] = t.string("selection", "public-prior", choices=("public-prior", "utility"))
        peers = {}
        for name, t in site.sections("peers").items():
            try:
                check_site_name(name, f"site.peers.{name}")
            except InvalidArgument as e:
                t.fail((), e.rule)
            t.known(("address",))
            peers[name] = t.string("address")
        deadline = site.number("stream_deadline_s", 600.0, exclusive_minimum=0.0)
        idle = site.number("stream_idle_s", 30.0, exclusive_minimum=0.0)
        if idle > deadline:
            site.fail("stream_idle_s", f"must be at most site.stream_deadline_s ({deadline:g}), got {idle:g}")
        return cls(
            name=checked(site, "name", check_site_name),
            listen=checked(site, "listen", check_listen),
            identity=rel(site, "identity"),
            models=rel(site, "models"),
            ledger=rel(site, "ledger"),
            probe=rel(site, "probe", None),
            workers=site.integer("workers", 32, minimum=1),
            reserve_workers=site.integer("reserve_workers", 8, minimum=1),
            max_calls_per_peer=site.integer("max_calls_per_peer", 8, minimum=1),
            stream_idle_s=idle,
            stream_deadline_s=deadline,
            shutdown_grace_s=site.number("shutdown_grace_s", 20.0, minimum=0.0),
            seed=site.integer("seed", None),
            declared_records=site.integer("declared_records", None, minimum=1),
            activation_clip=clip,
            calibration=calibration,
            pools=pools,
            peers=peers,
            path=path,
            pool_validation=pool_validation,
            pool_selection=pool_selection,
            own_models=rel(site, "own_models", None)
            if "own_models" in site
            else ((base / "own_models").resolve() if (base / "own_models").is_dir() else None),
            metrics_listen=checked(site, "metrics_listen", check_listen) if "metrics_listen" in site else None,
        )

    @property
    def limits(self) -> Limits:
        return Limits(
            self.workers, self.reserve_workers, self.max_calls_per_peer, self.stream_idle_s, self.stream_deadline_s
        )
