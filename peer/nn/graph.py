"""Network -> graph.

A network of the kinds in ``peer.nn.architectures`` (MLP; plain CNN with a Linear head) becomes a layered
graph:

- **nodes**: the neurons of each hidden layer (a Linear unit, or a conv channel). The input
  layer (input features / input image channels) and the output layer (classes) are fixed: they
  have the same meaning at every site and are never permuted.
- **node features**: each hidden node's activations on a probe set, after the nonlinearity, as a
  row of length P (number of probes). For a conv channel the activation map is averaged over
  spatial positions, giving one value per probe. Why pooled rather than the full H×W map: a
  channel's identity is spatially equivariant, so the mean response across probes is what tells
  channels apart, and under the per-neuron unit of privacy the Laplace mechanism's L1
  sensitivity is (row length × clip range) — a P-long row needs H·W times less noise per entry
  than a P·H·W-long one.
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

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from peer.base.errors import InvalidArgument
from peer.nn.architectures import ACTIVATIONS, input_tensor, validate_architecture, weight_modules


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

    def with_layers(self, hidden: tuple[HiddenLayer, ...], output_incoming: np.ndarray | None = None) -> "NetworkGraph":
        """The same graph with some feature arrays replaced (e.g. by their noisy versions)."""
        return NetworkGraph(self.architecture, self.input_size, tuple(hidden),
                            self.output_incoming if output_incoming is None else output_incoming, self.output_bias)


def _edge_tensor(weight: torch.Tensor, n_prev: int) -> np.ndarray:
    """Weights of one layer as (n_out, n_prev, e)."""
    w = weight.detach().cpu().numpy().astype(np.float64)
    return w.reshape(w.shape[0], n_prev, -1)


@torch.no_grad()
def extract_graph(arch: Mapping[str, Any], model: nn.Sequential, probe_x: np.ndarray) -> NetworkGraph:
    """The graph of ``model`` with node features measured on ``probe_x`` (the probe set)."""
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
    for i, (name, mod) in enumerate(children):
        h = mod(h)
        if isinstance(mod, tuple(ACTIVATIONS.values())):
            # the weight layer just before this activation
            prev_name = children[i - 1][0]
            v = h.double()
            acts[prev_name] = (v.mean(dim=(2, 3)) if v.dim() == 4 else v).T.numpy().copy()

    hidden = []
    for layer, mod in layers[:-1]:
        hidden.append(HiddenLayer(layer.name, layer.kind, acts[layer.name], _edge_tensor(mod.weight, layer.inputs),
                                  mod.bias.detach().cpu().numpy().astype(np.float64)))
    out_layer, out_mod = layers[-1]
    return NetworkGraph(a, layers[0][0].inputs, tuple(hidden), _edge_tensor(out_mod.weight, out_layer.inputs),
                        out_mod.bias.detach().cpu().numpy().astype(np.float64))
