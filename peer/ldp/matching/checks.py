"""What two graphs must satisfy to be matched: one architecture, one probe set, finite features."""

from __future__ import annotations

import numpy as np

from peer.base.errors import InvalidArgument
from peer.nn.graph import NetworkGraph


def _check_array(name: str, arr, ndim: int) -> np.ndarray:
    a = np.asarray(arr)
    if a.ndim != ndim:
        raise InvalidArgument(name, f"must have {ndim} dimensions, got shape {a.shape}")
    if a.size == 0:
        raise InvalidArgument(name, f"is empty (shape {a.shape})")
    if not np.issubdtype(a.dtype, np.number) or not np.all(np.isfinite(a)):
        raise InvalidArgument(name, "contains NaN or infinite values")
    return a


def _check_graphs(graph_a, graph_b) -> None:
    """Both graphs well-formed and of one architecture and one probe set; else InvalidArgument
    naming the field that differs."""
    for gname, g in (("graph_a", graph_a), ("graph_b", graph_b)):
        if not isinstance(g, NetworkGraph):
            raise InvalidArgument(gname, f"must be a peer.nn.graph.NetworkGraph, got {type(g).__name__}")
        if len(g.hidden) == 0:
            raise InvalidArgument(f"{gname}.hidden", "has no hidden layers: there is nothing to match")
        for ell, h in enumerate(g.hidden):
            _check_array(f"{gname}.hidden[{ell}].activations", h.activations, 2)
            _check_array(f"{gname}.hidden[{ell}].incoming", h.incoming, 3)
        _check_array(f"{gname}.output_incoming", g.output_incoming, 3)
    if dict(graph_a.architecture) != dict(graph_b.architecture):
        raise InvalidArgument(
            "graph_b.architecture",
            f"differs from graph_a's: {dict(graph_b.architecture)} vs {dict(graph_a.architecture)}",
        )
    if len(graph_a.hidden) != len(graph_b.hidden):
        raise InvalidArgument(
            "graph_b.hidden", f"has {len(graph_b.hidden)} hidden layers, graph_a has {len(graph_a.hidden)}"
        )
    if graph_a.input_size != graph_b.input_size:
        raise InvalidArgument("graph_b.input_size", f"is {graph_b.input_size}, graph_a's is {graph_a.input_size}")
    n_prev = graph_a.input_size
    for ell, (ha, hb) in enumerate(zip(graph_a.hidden, graph_b.hidden, strict=True)):
        if ha.kind != hb.kind:
            raise InvalidArgument(f"graph_b.hidden[{ell}].kind", f"is {hb.kind!r}, graph_a's is {ha.kind!r}")
        for gname, h in (("graph_a", ha), ("graph_b", hb)):
            w = np.asarray(h.incoming)
            if w.shape[1] != n_prev:
                raise InvalidArgument(
                    f"{gname}.hidden[{ell}].incoming",
                    f"has {w.shape[1]} inputs per node, the previous layer has {n_prev} nodes",
                )
            act = np.asarray(h.activations)
            if act.shape[0] != w.shape[0]:
                raise InvalidArgument(
                    f"{gname}.hidden[{ell}].activations", f"has {act.shape[0]} rows for {w.shape[0]} nodes"
                )
            # a layer's rows may differ in length from another layer's (a conv channel's row
            # may hold every spatial position of every probe), never from the other graph's
            probes = np.asarray(ha.activations).shape[1]
            if act.shape[1] != probes:
                raise InvalidArgument(
                    f"{gname}.hidden[{ell}].activations",
                    f"has {act.shape[1]} columns (probes × positions), graph_a.hidden[{ell}] has {probes}: "
                    "both graphs must use the same probe set",
                )
        if np.asarray(ha.incoming).shape != np.asarray(hb.incoming).shape:
            raise InvalidArgument(
                f"graph_b.hidden[{ell}].incoming",
                f"has shape {np.asarray(hb.incoming).shape}, graph_a's is {np.asarray(ha.incoming).shape}",
            )
        n_prev = np.asarray(ha.incoming).shape[0]
    for gname, g in (("graph_a", graph_a), ("graph_b", graph_b)):
        if np.asarray(g.output_incoming).shape[1] != n_prev:
            raise InvalidArgument(
                f"{gname}.output_incoming",
                f"has {np.asarray(g.output_incoming).shape[1]} inputs per output, the last hidden layer has {n_prev} nodes",
            )
    if np.asarray(graph_a.output_incoming).shape != np.asarray(graph_b.output_incoming).shape:
        raise InvalidArgument(
            "graph_b.output_incoming",
            f"has shape {np.asarray(graph_b.output_incoming).shape}, graph_a's is {np.asarray(graph_a.output_incoming).shape}",
        )
