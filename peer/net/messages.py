"""The answers of the light calls, converted in one place in both directions: a site's plain
values (``peer.net.peer_info``) ↔ their ``privfusion.v1`` messages.

* ``GetPeerInfo``: :func:`peer_info_message` (the servicer, from the site's
  :class:`~peer.net.peer_info.SiteInfo`) and :func:`peer_info_from_message` (the client, into a
  :class:`~peer.net.peer_info.PeerInfo`); a received answer encodes back to the same message.
* ``ListLedger``: :func:`ledger_entry_from_message` (the client, into a
  :class:`~peer.net.peer_info.LedgerEntry` with its record as charged; the servicer writes each
  entry from the ledger's row).

Releases travel as frames (``peer.net.wire``) and core objects as named tensors
(``peer.net.codec``); this module holds what neither does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from peer.base.records import ReleaseRecord
from peer.net import wire
from peer.net.peer_info import (
    BudgetInfo,
    LayerInfo,
    LedgerEntry,
    ModelInfo,
    PeerInfo,
    PoolInfo,
    SiteInfo,
    UnusableFile,
)
from privfusion.v1 import peer_pb2 as pb

__all__ = ["ledger_entry_from_message", "peer_info_from_message", "peer_info_message"]


def _architecture_json(architecture: Mapping[str, Any] | None) -> str:
    return json.dumps(architecture, sort_keys=True)


def _architecture_of(text: str) -> dict[str, Any] | None:
    """An offer's architecture as the peer sent it, parsed; None when it is not a JSON object
    (such an offer matches no architecture of ours: nothing is asked of it)."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def peer_info_message(info: SiteInfo | PeerInfo) -> pb.PeerInfo:
    """``GetPeerInfo``'s answer: the site's description plus the wire's own facts (protocol,
    largest chunk: this build's for a :class:`SiteInfo`; for a :class:`PeerInfo`, the ones it
    was received with, so that a received answer encodes back to the message it came from)."""
    models = [
        pb.ModelInfo(
            name=m.name,
            architecture_json=_architecture_json(m.architecture),
            parameter_count=m.parameter_count,
            hidden_sizes=list(m.hidden_sizes),
            layers=[
                pb.LayerInfo(
                    name=layer.name,
                    kind=layer.kind,
                    weight_shape=list(layer.weight_shape),
                    bias_shape=list(layer.bias_shape),
                    hidden=layer.hidden,
                )
                for layer in m.layers
            ],
        )
        for m in info.models
    ]
    pools = [
        pb.PoolInfo(
            name=p.name,
            architecture_json=_architecture_json(p.architecture),
            members=list(p.members),
            methods=list(p.methods),
        )
        for p in info.pools
    ]
    budgets = [
        pb.BudgetInfo(
            budget=b.budget,
            scope=b.scope,
            epsilon_limit=b.epsilon_limit,
            delta_limit=b.delta_limit,
            epsilon_spent=b.epsilon_spent,
            epsilon_remaining=b.epsilon_remaining,
            releases=b.releases,
        )
        for b in info.budgets
    ]
    received = isinstance(info, PeerInfo)
    return pb.PeerInfo(
        name=info.name,
        certificate_sha256=info.certificate_sha256,
        protocol=info.protocol if received else wire.PROTOCOL,
        insecure=info.insecure,
        models=models,
        pools=pools,
        mechanisms=list(info.mechanisms),
        budgets=budgets,
        has_probe_set=info.has_probe_set,
        max_chunk_bytes=info.max_chunk_bytes if received else wire.MAX_CHUNK_BYTES,
        unusable=[pb.UnusableFile(path=p, reason=why) for p, why in info.unusable],
    )


def peer_info_from_message(message: pb.PeerInfo) -> PeerInfo:
    """The client's :class:`~peer.net.peer_info.PeerInfo` from a ``GetPeerInfo`` answer: every
    field as sent (repeated fields as tuples), each offer's architecture parsed from its JSON."""
    return PeerInfo(
        name=message.name,
        certificate_sha256=message.certificate_sha256,
        protocol=message.protocol,
        insecure=message.insecure,
        models=tuple(
            ModelInfo(
                name=m.name,
                architecture=_architecture_of(m.architecture_json),
                parameter_count=int(m.parameter_count),
                hidden_sizes=tuple(int(h) for h in m.hidden_sizes),
                layers=tuple(
                    LayerInfo(
                        name=layer.name,
                        kind=layer.kind,
                        weight_shape=tuple(int(d) for d in layer.weight_shape),
                        bias_shape=tuple(int(d) for d in layer.bias_shape),
                        hidden=layer.hidden,
                    )
                    for layer in m.layers
                ),
            )
            for m in message.models
        ),
        pools=tuple(
            PoolInfo(
                name=p.name,
                architecture=_architecture_of(p.architecture_json),
                members=tuple(p.members),
                methods=tuple(p.methods),
            )
            for p in message.pools
        ),
        mechanisms=tuple(message.mechanisms),
        budgets=tuple(
            BudgetInfo(
                budget=b.budget,
                scope=b.scope,
                epsilon_limit=b.epsilon_limit,
                delta_limit=b.delta_limit,
                epsilon_spent=b.epsilon_spent,
                epsilon_remaining=b.epsilon_remaining,
                releases=int(b.releases),
            )
            for b in message.budgets
        ),
        has_probe_set=message.has_probe_set,
        max_chunk_bytes=int(message.max_chunk_bytes),
        unusable=tuple(UnusableFile(u.path, u.reason) for u in message.unusable),
    )


def ledger_entry_from_message(entry: pb.LedgerEntry) -> LedgerEntry:
    """One ``ListLedger`` entry: its id, the charged record (its canonical JSON parsed), when."""
    return LedgerEntry(entry.entry_id, ReleaseRecord.from_json(entry.record_json), entry.created_at)
