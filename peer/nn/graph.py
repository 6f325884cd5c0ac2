"""Network -> graph.

A network of the kinds in ``peer.nn.architectures`` (MLP; plain CNN with a Linear head) becomes a layered
graph:

- **nodes**: the neurons of each hidden layer (a Linear unit, or a conv channel). The input
  layer (input features / input image channels) and the output layer (classes) are fixed: they
  have the same meaning at every site and are never permuted.
- **node features**: each hidden node's activations on a probe set, after the nonlinearity, as a
  row of length P (number of probes). For a conv channel the activation map is averaged over
  spatial positions, giving one value per probe. Why pooled rather than the full H×W map: a
  channel's identity is spatially equivariant, so the mean response across probes already tells
  channels apart (less well than the full map does: README "Experiments"), and under the per-neuron unit of privacy the Laplace mechanism's L1
  sensitivity is (row length × clip range) — a P-long row needs H·W times less noise per entry
  than a P·H·W-long one. Exact graphs that are never released (non-private matching) may keep
  every position, and standardise their rows (``extract_graph``'s options): there the row's
  length costs nothing, and the spatial pattern is signal.
- **edge features**: the weights between consecutive layers. ``HiddenLayer.incoming`` keeps them
  as an (n_out, n_in, e) tensor: e = 1 for Linear→Linear, e = k·k for conv→conv (the flattened
  kernel), and e = H·W for the last conv block → first Linear (Flatten is channel-major, so the
  H·W columns of one channel move together): ``WeightLayer.entries_per_input`` of
  ``peer.nn.architectures.weight_layers``, the one listing of an architecture's weight layers.
- **weight features** (what the multi-bit mechanism perturbs): each node's incoming weight
  vector, ``incoming.reshape(n, -1)``; the bias travels with its neuron (``bias``).
- **outgoing weights** of the last hidden layer are ``NetworkGraph.output_incoming``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from peer.base.errors import InvalidArgument
from peer.nn.architectures import ACTIVATIONS, input_tensor, validate_architecture, weight_layers, weight_modules

__all__ = ["HiddenLayer", "NetworkGraph", "extract_graph", "extract_group_graph", "group_members"]


@dataclass(frozen=True)
class HiddenLayer:
    """One hidden layer as graph nodes.

    ``name`` is the state-dict prefix of the weight layer producing it (``"0"``, ``"3"``);
    ``kind`` is ``"linear"`` or ``"conv"``; ``activations`` is (n, P); ``incoming`` is
    (n, n_prev, e); ``bias`` is (n,).
    """

    name: str
    kind: str
    activations: np.ndarray
    incoming: np.ndarray
    bias: np.ndarray

    @property
    def size(self) -> int:
        return int(self.incoming.shape[0])

    @property
    def weight_features(self) -> np.ndarray:
        """(n, n_prev·e): each node's flattened incoming weight vector."""
        return self.incoming.reshape(self.incoming.shape[0], -1)


@dataclass(frozen=True)
class NetworkGraph:
    """A network as a layered graph with fixed input and output layers.

    ``input_size`` counts the fixed input nodes (features, or image channels for a CNN);
    ``output_incoming`` is (n_out, n_last_hidden, e) and ``output_bias`` is (n_out,).
    """

    architecture: Mapping[str, Any]
    input_size: int
    hidden: tuple[HiddenLayer, ...]
    output_incoming: np.ndarray
    output_bias: np.ndarray

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(h.size for h in self.hidden)

    def with_layers(self, hidden: tuple[HiddenLayer, ...], output_incoming: np.ndarray | None = None) -> NetworkGraph:
        """The same graph with some feature arrays replaced (e.g. by their noisy versions)."""
        return NetworkGraph(
            self.architecture,
            self.input_size,
            tuple(hidden),
            self.output_incoming if output_incoming is None else output_incoming,
            self.output_bias,
        )


def _edge_tensor(weight: torch.Tensor, n_prev: int) -> np.ndarray:
    """Weights of one layer as (n_out, n_prev, e)."""
    w = weight.detach().cpu().numpy().astype(np.float64)
    return w.reshape(w.shape[0], n_prev, -1)


#: how a conv channel's activation map becomes its node-feature row (``extract_graph``)
CONV_FEATURES = ("mean", "positions")


@torch.no_grad()
def extract_graph(
    arch: Mapping[str, Any],
    model: nn.Sequential,
    probe_x: np.ndarray,
    conv_features: str = "mean",
    standardise: bool = False,
) -> NetworkGraph:
    """The graph of ``model`` with node features measured on ``probe_x`` (the probe set).

    The defaults give the features a site releases (module docstring). Two options are for
    graphs that are exact and never released — non-private matching of two models one party
    holds — and change only the activation rows:

    - ``conv_features="positions"``: a conv channel's row keeps every spatial position,
      length P·H·W (probe-major: the H·W values of one probe are consecutive), instead of its
      spatial mean (``"mean"``, length P). Rows then differ in length between layers, never
      between two graphs of one architecture on one probe set. Never for a release: under the
      per-neuron unit the Laplace scale is (row length × clip range)/ε, H·W times larger.
    - ``standardise=True``: every row is centred and scaled to unit standard deviation
      (a constant row is only centred). For two standardised rows of length L,
      ‖a − b‖² = 2L(1 − ρ(a, b)), so the matcher's Gaussian activation kernel becomes a
      monotone function of the rows' Pearson correlation ρ — the signal activation matching
      (``peer.ldp.group_matching``) assigns by — and no longer of each unit's scale.
    """
    if conv_features not in CONV_FEATURES:
        raise InvalidArgument("conv_features", f"must be one of {CONV_FEATURES}, got {conv_features!r}")
    a = validate_architecture(arch)
    probe = np.asarray(probe_x)
    if probe.ndim == 0 or probe.shape[0] == 0:
        raise InvalidArgument("probe_x", "the probe set is empty")
    if not np.all(np.isfinite(probe)):
        raise InvalidArgument("probe_x", "contains NaN or infinite values")
    layers = weight_modules(a, model)
    for layer, mod in layers:
        for pname, p in mod.named_parameters():
            if not torch.all(torch.isfinite(p)):
                raise InvalidArgument(f"weights[{layer.name}.{pname}]", "contains NaN or infinite values")
    try:
        x = input_tensor(a, probe)
    except RuntimeError as e:
        raise InvalidArgument("probe_x", f"does not fit the architecture's input: {e}") from None

    # Record post-activation outputs of each hidden weight layer.
    acts: dict[str, np.ndarray] = {}
    children = list(model.named_children())
    h = x
    for i, (_name, mod) in enumerate(children):
        h = mod(h)
        if isinstance(mod, tuple(ACTIVATIONS.values())):
            # the weight layer just before this activation
            prev_name = children[i - 1][0]
            v = h.double()
            if v.dim() == 4:
                rows = v.mean(dim=(2, 3)).T if conv_features == "mean" else v.movedim(1, 0).reshape(v.shape[1], -1)
            else:
                rows = v.T
            if standardise:
                rows = rows - rows.mean(dim=1, keepdim=True)
                std = rows.std(dim=1, unbiased=False, keepdim=True)
                rows = rows / torch.where(std > 0, std, torch.ones_like(std))
            acts[prev_name] = rows.numpy().copy()

    hidden = []
    for layer, mod in layers[:-1]:
        hidden.append(
            HiddenLayer(
                layer.name,
                layer.kind,
                acts[layer.name],
                _edge_tensor(mod.weight, layer.inputs),
                mod.bias.detach().cpu().numpy().astype(np.float64),
            )
        )
    out_layer, out_mod = layers[-1]
    return NetworkGraph(
        a,
        layers[0][0].inputs,
        tuple(hidden),
        _edge_tensor(out_mod.weight, out_layer.inputs),
        out_mod.bias.detach().cpu().numpy().astype(np.float64),
    )


def chain_features(graph: NetworkGraph) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A layered graph as the features of its architecture's chain of permutation groups
    (``peer.nn.architectures.architecture_structure``: group k is hidden layer k, named by its
    state-dict prefix): ``(activations, arrays)`` for ``peer.ldp.matching.groups``. The
    activations are the graph's rows unchanged (post-activation, as released); the arrays are
    its weights and biases under their state-dict keys and shapes — for a released graph, the
    released weight features, so the group matcher reads exactly what the layered one reads."""
    layers = weight_layers(graph.architecture)
    activations = {h.name: np.asarray(h.activations) for h in graph.hidden}
    arrays: dict[str, np.ndarray] = {}
    rows = [(h.incoming, h.bias) for h in graph.hidden] + [(graph.output_incoming, graph.output_bias)]
    for layer, (incoming, bias) in zip(layers, rows, strict=True):
        arrays[f"{layer.name}.weight"] = np.asarray(incoming).reshape(layer.weight_shape)
        arrays[f"{layer.name}.bias"] = np.asarray(bias)
    return activations, arrays


# ---------------------------------------------------------------------------------------------
# Networks described by permutation groups (a site's own module, traced by peer.nn.tracing)


@dataclass(frozen=True)
class GroupNodes:
    """The nodes of one permutation group: one per group element.

    ``activations`` is (n, P·m): each element's responses on the P probes at each of the
    group's m member tensors (the outputs of every module writing into the group — its
    Linear/Conv producers and its BatchNorms — averaged over spatial positions), concatenated
    along the probe axis. ``incoming`` is (n, d): each element's incoming weights over *every*
    layer writing into the group (each producer's row, flattened, then its bias when it has
    one), concatenated in the order of ``members``."""

    name: str
    members: tuple[str, ...]
    activations: np.ndarray
    incoming: np.ndarray

    @property
    def size(self) -> int:
        return int(self.activations.shape[0])


@dataclass(frozen=True)
class GroupGraph:
    """A network as permutation groups of nodes; input and output units are fixed (no group)."""

    groups: tuple[GroupNodes, ...]

    def by_name(self) -> dict[str, GroupNodes]:
        return {g.name: g for g in self.groups}


def group_members(structure) -> dict[str, list[str]]:
    """For each group of a ``peer.nn.tracing.PermutationStructure``, the modules writing into
    it: its producers, then its statistic points (BatchNorms) not already listed."""
    members: dict[str, list[str]] = {g.name: list(g.producers) for g in structure.groups}
    for p in structure.stat_points:
        if p.module not in members[p.group]:
            members[p.group].append(p.module)
    return members


@torch.no_grad()
def extract_group_graph(module: nn.Module, structure, probe_x) -> GroupGraph:
    """The group graph of ``module`` (whose structure is ``structure``) on the probe set."""
    x = probe_x if isinstance(probe_x, torch.Tensor) else torch.as_tensor(np.asarray(probe_x, dtype=np.float32))
    if x.dim() == 0 or x.shape[0] == 0:
        raise InvalidArgument("probe_x", "the probe set is empty")
    if not bool(torch.all(torch.isfinite(x))):
        raise InvalidArgument("probe_x", "contains NaN or infinite values")
    members = group_members(structure)
    mods = dict(module.named_modules())
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for names in members.values():
        for name in names:
            if name not in mods:
                raise InvalidArgument("structure", f"the model has no module {name!r}")
            linear = isinstance(mods[name], nn.Linear)

            def record(m, args, out, name=name, linear=linear):
                t = out.detach().double()
                t = t.movedim(-1, 1) if linear and t.dim() > 2 else t
                seen[name] = t.reshape(t.shape[0], t.shape[1], -1).mean(dim=2)

            hooks.append(mods[name].register_forward_hook(record))
    was_training = module.training
    module.eval()
    try:
        module(x)
    except RuntimeError as e:
        raise InvalidArgument("probe_x", f"does not fit the model's input: {e}") from None
    finally:
        for h in hooks:
            h.remove()
        module.train(was_training)
    groups = []
    for g in structure.groups:
        names = members[g.name]
        acts = np.concatenate([seen[n].T.numpy() for n in names], axis=1)
        rows = []
        for n in g.producers:
            mod = mods[n]
            rows.append(mod.weight.detach().double().reshape(g.size, -1).numpy())
            if getattr(mod, "bias", None) is not None:
                rows.append(mod.bias.detach().double().reshape(g.size, 1).numpy())
        incoming = np.concatenate(rows, axis=1) if rows else np.zeros((g.size, 0))
        groups.append(GroupNodes(g.name, tuple(names), acts, incoming))
    return GroupGraph(tuple(groups))
