"""Network architectures PrivFusion handles, described as data, and plain (non-private) training.

An architecture is a JSON object; ``build_model`` turns it into an ``nn.Sequential`` whose
module indices are stable, so that state-dict keys (``"0.weight"``, ``"3.bias"``) are the same at
every site for the same architecture.

MLP::

    {"kind": "mlp", "input_dim": 64, "hidden": [128, 128], "output_dim": 10,
     "activation": "relu"}

    -> Linear(64,128), ReLU, Linear(128,128), ReLU, Linear(128,10)

Plain CNN (conv blocks, then a Linear head)::

    {"kind": "cnn", "input_shape": [1, 8, 8], "channels": [16, 32], "kernel_size": 3,
     "pool": [2, 2], "hidden": [64], "output_dim": 10, "activation": "relu"}

    -> Conv2d(1,16,3,padding=1), ReLU, MaxPool2d(2), Conv2d(16,32,3,padding=1), ReLU,
       MaxPool2d(2), Flatten, Linear(32*2*2, 64), ReLU, Linear(64, 10)

``pool`` gives one max-pooling factor per conv block (1 = no pooling). Convolutions use "same"
padding (kernel_size // 2, odd kernel sizes only) so spatial size changes only by pooling.

A built-in architecture is a factory of a torch module like a site's own network is: its module
is traced by ``peer.nn.tracing`` into permutation groups exactly as an imported one
(:func:`architecture_structure`), and that structure is the chain of :func:`weight_layers`: one
group per hidden weight layer, named by its state-dict prefix, acting on that layer's rows and
bias and on the next weight layer's input axis (H·W consecutive entries per unit for the Linear
after Flatten, one otherwise), the input and the output units fixed (``tests/test_architectures.py``
checks it for MLPs and CNNs; docs/architecture.md, "One network kind").
"""

from __future__ import annotations

import copy
import math
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from peer.base.errors import InvalidArgument, Unsupported
from peer.nn.tracing import PermutationStructure, import_structure

__all__ = [
    "ACTIVATIONS",
    "WeightLayer",
    "accuracy",
    "build_model",
    "fit_classifier",
    "hidden_sizes",
    "input_tensor",
    "model_from_arrays",
    "predict_proba",
    "seeded_initialisation",
    "state_arrays",
    "torch_threads",
    "train_classifier",
    "validate_architecture",
    "weight_layers",
    "weight_modules",
]


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run torch with ``count`` intra-op threads, restoring the setting afterwards.

    Training the models here is many small tensor operations; on a small shared machine
    OpenMP's thread hand-offs dominate them (measured on 2 busy cores: one DP-SGD step of digits
    logistic regression 77 ms with 2 threads, 2.5 ms with 1; a 64-128-128-10 MLP's 20 Adam
    epochs 38 s with 2 threads under load, about 2 s with 1)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid}


def _positive_int(arch: Mapping, key: str) -> int:
    v = arch.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise InvalidArgument(f"architecture.{key}", f"must be a positive integer, got {v!r}")
    return v


def _positive_int_list(arch: Mapping, key: str, allow_empty: bool = True) -> list[int]:
    v = arch.get(key, [])
    if not isinstance(v, (list, tuple)) or (not allow_empty and not v):
        raise InvalidArgument(
            f"architecture.{key}",
            f"must be a {'non-empty ' if not allow_empty else ''}list of positive integers, got {v!r}",
        )
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
            raise InvalidArgument(f"architecture.{key}[{i}]", f"must be a positive integer, got {x!r}")
    return list(v)


def validate_architecture(arch: Mapping[str, Any]) -> dict:
    """Check an architecture description; return a normalised copy (defaults filled in)."""
    if not isinstance(arch, Mapping):
        raise InvalidArgument("architecture", "must be an object")
    kind = arch.get("kind")
    act = arch.get("activation", "relu")
    if act not in ACTIVATIONS:
        raise InvalidArgument("architecture.activation", f"must be one of {sorted(ACTIVATIONS)}, got {act!r}")
    if kind == "mlp":
        allowed = {"kind", "input_dim", "hidden", "output_dim", "activation"}
        out = {
            "kind": "mlp",
            "input_dim": _positive_int(arch, "input_dim"),
            "hidden": _positive_int_list(arch, "hidden"),
            "output_dim": _positive_int(arch, "output_dim"),
            "activation": act,
        }
    elif kind == "cnn":
        allowed = {"kind", "input_shape", "channels", "kernel_size", "pool", "hidden", "output_dim", "activation"}
        shape = arch.get("input_shape")
        if (
            not isinstance(shape, (list, tuple))
            or len(shape) != 3
            or not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in shape)
        ):
            raise InvalidArgument(
                "architecture.input_shape", f"must be [channels, height, width] of positive integers, got {shape!r}"
            )
        channels = _positive_int_list(arch, "channels", allow_empty=False)
        k = arch.get("kernel_size", 3)
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % 2 == 0:
            raise InvalidArgument("architecture.kernel_size", f"must be a positive odd integer, got {k!r}")
        pool = _positive_int_list({"pool": arch.get("pool", [1] * len(channels))}, "pool")
        if len(pool) != len(channels):
            raise InvalidArgument(
                "architecture.pool", f"must give one factor per conv block ({len(channels)}), got {len(pool)}"
            )
        h, w = shape[1], shape[2]
        for i, p in enumerate(pool):
            if h % p or w % p:
                raise InvalidArgument(
                    f"architecture.pool[{i}]", f"factor {p} does not divide the spatial size {h}x{w} at block {i}"
                )
            h, w = h // p, w // p
        out = {
            "kind": "cnn",
            "input_shape": list(shape),
            "channels": channels,
            "kernel_size": k,
            "pool": pool,
            "hidden": _positive_int_list(arch, "hidden"),
            "output_dim": _positive_int(arch, "output_dim"),
            "activation": act,
        }
    else:
        raise InvalidArgument("architecture.kind", f"must be 'mlp' or 'cnn', got {kind!r}")
    extra = set(arch) - allowed
    if extra:
        raise InvalidArgument("architecture", f"unknown keys {sorted(extra)} for kind {kind!r}")
    return out


def cnn_flat_shape(arch: Mapping[str, Any]) -> tuple[int, int, int]:
    """(channels, height, width) of the last conv block's output, i.e. what Flatten sees."""
    a = validate_architecture(arch)
    h, w = a["input_shape"][1], a["input_shape"][2]
    for p in a["pool"]:
        h, w = h // p, w // p
    return a["channels"][-1], h, w


def _layout(a: Mapping[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The modules of a validated architecture in ``nn.Sequential`` order, as (type, sizes):
    ``("conv", (c_in, c_out, k))``, ``("linear", (n_in, n_out))``, ``("act", ())``,
    ``("pool", (p,))``, ``("flatten", ())``. The one description that :func:`build_model` builds
    and :func:`weight_layers` lists, so that the two always agree on names and shapes."""
    out: list[tuple[str, tuple[int, ...]]] = []
    if a["kind"] == "mlp":
        widths = [a["input_dim"], *a["hidden"]]
    else:
        c_in = a["input_shape"][0]
        for c, p in zip(a["channels"], a["pool"], strict=True):
            out += [("conv", (c_in, c, a["kernel_size"])), ("act", ())]
            if p > 1:
                out.append(("pool", (p,)))
            c_in = c
        out.append(("flatten", ()))
        c, h, w = cnn_flat_shape(a)
        widths = [c * h * w, *a["hidden"]]
    for i in range(len(a["hidden"])):
        out += [("linear", (widths[i], widths[i + 1])), ("act", ())]
    out.append(("linear", (widths[-1], a["output_dim"])))
    return out


def build_model(arch: Mapping[str, Any], seed: int | None = None) -> nn.Sequential:
    """An ``nn.Sequential`` for the architecture; initialised from ``seed`` when given."""
    a = validate_architecture(arch)
    act = ACTIVATIONS[a["activation"]]
    layers: list[nn.Module] = []
    with _BUILD:
        return _build_layers(a, act, layers, seed)


#: torch's initialisation draws from its one global generator: a seeded build must not have
#: another build's draws interleaved with its own (sites of a simulation in threads of one process)
_BUILD = threading.RLock()


@contextmanager
def seeded_initialisation(seed: int) -> Iterator[None]:
    """torch's global generator seeded with ``seed`` while a module is built in the block (a site's
    own factory: ``with seeded_initialisation(init_seed): module = factory()``), and restored after;
    no other seeded build of this process draws in between (the lock ``build_model`` takes: sites
    of a simulation or a test are threads of one process, and an interleaved draw gives each a
    different θ_0)."""
    with _BUILD:
        state = torch.random.get_rng_state()
        torch.manual_seed(int(seed))
        try:
            yield
        finally:
            torch.random.set_rng_state(state)


def _build_layers(a: Mapping[str, Any], act, layers: list, seed: int | None) -> nn.Sequential:
    if seed is not None:
        gen_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
    try:
        # modules are created in order, so the initialisation draws from the generator in order
        for kind, sizes in _layout(a):
            if kind == "linear":
                layers.append(nn.Linear(*sizes))
            elif kind == "conv":
                c_in, c_out, k = sizes
                layers.append(nn.Conv2d(c_in, c_out, k, padding=k // 2))
            elif kind == "pool":
                layers.append(nn.MaxPool2d(sizes[0]))
            elif kind == "flatten":
                layers.append(nn.Flatten())
            else:
                layers.append(act())
        model = nn.Sequential(*layers)
    finally:
        if seed is not None:
            torch.random.set_rng_state(gen_state)
    return model


@dataclass(frozen=True)
class WeightLayer:
    """One Linear/Conv2d of an architecture, known from the architecture alone (public).

    ``name``: its state-dict prefix (``"0"``, ``"3"``); ``kind``: ``"linear"`` or ``"conv"``;
    ``units``: its neurons (output features or channels); ``inputs``: the nodes feeding it (the
    input features or channels, or the previous weight layer's units); ``entries_per_input``:
    the weights between one unit and one input node — k·k for a conv kernel, H·W for the first
    Linear after Flatten (which is channel-major, so a channel's H·W columns belong to it), else
    1; ``is_output``: the last weight layer (every other one produces a hidden layer).
    """

    name: str
    kind: str
    units: int
    inputs: int
    entries_per_input: int
    is_output: bool

    @property
    def fan_in(self) -> int:
        """Incoming weights per unit, bias excluded: inputs · entries_per_input."""
        return self.inputs * self.entries_per_input

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """The shape of the layer's ``weight`` in the state dict."""
        if self.kind == "conv":
            k = math.isqrt(self.entries_per_input)
            return (self.units, self.inputs, k, k)
        return (self.units, self.fan_in)


def weight_layers(arch: Mapping[str, Any]) -> tuple[WeightLayer, ...]:
    """Every Linear/Conv2d of the architecture in order, the output layer last: the one listing
    of weight layers that graphs, mechanisms, fusion and the wire all use."""
    a = validate_architecture(arch)
    out: list[WeightLayer] = []
    per_input = 1
    for index, (kind, sizes) in enumerate(_layout(a)):
        if kind == "flatten":
            _, h, w = cnn_flat_shape(a)
            per_input = h * w
        elif kind == "conv":
            c_in, c_out, k = sizes
            out.append(WeightLayer(str(index), "conv", c_out, c_in, k * k, False))
        elif kind == "linear":
            n_in, n_out = sizes
            out.append(WeightLayer(str(index), "linear", n_out, n_in // per_input, per_input, False))
            per_input = 1
    out[-1] = replace(out[-1], is_output=True)
    return tuple(out)


def hidden_sizes(arch: Mapping[str, Any]) -> list[int]:
    """The width of every hidden layer (conv channels, then hidden Linear units), in order."""
    return [layer.units for layer in weight_layers(arch) if not layer.is_output]


def weight_modules(arch: Mapping[str, Any], model: nn.Module) -> list[tuple[WeightLayer, nn.Module]]:
    """Each of :func:`weight_layers` with its module in ``model``, after checking that ``model``
    is the plain ``nn.Sequential`` the architecture describes: supported layer types only, plain
    convolutions, every weight layer with a bias, and the names and weight shapes listed."""
    layers = weight_layers(arch)
    if not isinstance(model, nn.Sequential):
        raise Unsupported(
            "model", f"must be an nn.Sequential built by peer.nn.architectures, got {type(model).__name__}"
        )
    found = []
    allowed = (nn.Linear, nn.Conv2d, nn.MaxPool2d, nn.Flatten, *ACTIVATIONS.values())
    for name, mod in model.named_children():
        if not isinstance(mod, allowed):
            raise Unsupported(
                f"model[{name}]",
                f"layer type {type(mod).__name__} is not supported by the graph extractor (Linear, Conv2d, MaxPool2d, Flatten, {'/'.join(ACTIVATIONS)})",
            )
        if isinstance(mod, nn.Conv2d) and (mod.groups != 1 or mod.stride != (1, 1) or mod.dilation != (1, 1)):
            raise Unsupported(
                f"model[{name}]", "only plain convolutions (groups=1, stride=1, dilation=1) are supported"
            )
        if isinstance(mod, (nn.Linear, nn.Conv2d)):
            if mod.bias is None:
                raise Unsupported(f"model[{name}]", "layers without bias are not supported")
            found.append((name, mod))
    if len(found) != len(layers):
        raise InvalidArgument("model", f"has {len(found)} weight layers, the architecture describes {len(layers)}")
    for layer, (name, mod) in zip(layers, found, strict=True):
        if name != layer.name or tuple(mod.weight.shape) != layer.weight_shape:
            raise InvalidArgument(
                f"model[{name}]",
                f"has weight {tuple(mod.weight.shape)}, the architecture has layer {layer.name!r} with weight {layer.weight_shape}",
            )
    return [(layer, mod) for layer, (_, mod) in zip(layers, found, strict=True)]


def example_shape(arch: Mapping[str, Any]) -> tuple[int, ...]:
    """One example's input shape (no batch axis): ``(input_dim,)`` for an MLP, ``input_shape``
    (channels, height, width) for a CNN."""
    a = validate_architecture(arch)
    return (a["input_dim"],) if a["kind"] == "mlp" else tuple(a["input_shape"])


def architecture_structure(arch: Mapping[str, Any]) -> PermutationStructure:
    """The permutation groups of the architecture, traced from the module :func:`build_model`
    makes (``peer.nn.tracing.import_structure``: derived by ``torch.fx`` and proven by the
    self-check on a seeded initialisation), as for a site's own network. A function of the
    architecture alone (public): the chain of :func:`weight_layers` (module docstring)."""
    return import_structure(build_model(arch, seed=0), example_shape(arch))


def input_tensor(arch: Mapping[str, Any], x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Shape a batch of flat or image inputs the way the architecture expects."""
    a = validate_architecture(arch)
    t = torch.as_tensor(np.asarray(x, dtype=np.float32)) if not isinstance(x, torch.Tensor) else x.float()
    if a["kind"] == "cnn":
        return t.reshape(t.shape[0], *a["input_shape"])
    return t.reshape(t.shape[0], -1)


def state_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's parameters as float32 numpy arrays keyed like the state dict."""
    return {k: v.detach().cpu().numpy().astype(np.float32, copy=True) for k, v in model.state_dict().items()}


def model_from_arrays(arch: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> nn.Sequential:
    """Rebuild a model from state arrays, checking every name, shape and value."""
    model = build_model(arch)
    expected = model.state_dict()
    missing = set(expected) - set(arrays)
    extra = set(arrays) - set(expected)
    if missing or extra:
        raise InvalidArgument(
            "weights", f"do not fit the architecture: missing {sorted(missing)}, unexpected {sorted(extra)}"
        )
    state = {}
    for k, ref in expected.items():
        arr = np.asarray(arrays[k])
        if tuple(arr.shape) != tuple(ref.shape):
            raise InvalidArgument(
                f"weights[{k}]", f"has shape {tuple(arr.shape)}, the architecture needs {tuple(ref.shape)}"
            )
        if not np.all(np.isfinite(arr)):
            raise InvalidArgument(f"weights[{k}]", "contains NaN or infinite values")
        with warnings.catch_warnings():
            # a read-only array (a released merge, say) is fine here: load_state_dict only
            # reads it, copying into the module's own parameters
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            state[k] = torch.as_tensor(np.asarray(arr, dtype=np.float32))
    model.load_state_dict(state)
    return model


@torch.no_grad()
def predict_proba(arch: Mapping[str, Any], model: nn.Module, x: np.ndarray) -> np.ndarray:
    model.eval()
    return torch.softmax(model(input_tensor(arch, x)), dim=1).numpy()


def accuracy(arch: Mapping[str, Any], model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(predict_proba(arch, model, x).argmax(axis=1) == np.asarray(y)))


def train_classifier(
    arch: Mapping[str, Any],
    x: np.ndarray,
    y: np.ndarray,
    *,
    seed: int,
    epochs: int = 60,
    batch_size: int = 64,
    learning_rate: float = 1e-3,
    weight_decay: float = 0.0,
    init: nn.Module | None = None,
    threads: int = 1,
    progress=None,
) -> nn.Sequential:
    """Plain (non-private) Adam training with cross-entropy; deterministic given ``seed``.
    Runs on ``threads`` torch threads (one by default: see :func:`torch_threads`);
    ``progress()`` is called after every epoch (a progress bar)."""
    if len(x) == 0:
        raise InvalidArgument("x", "training set is empty")
    with torch_threads(threads):
        return _train(
            arch,
            x,
            y,
            seed=seed,
            epochs=epochs,
            batch_size=batch_size,
            learning_rate=learning_rate,
            weight_decay=weight_decay,
            init=init,
            progress=progress,
        )


def _train(arch, x, y, *, seed, epochs, batch_size, learning_rate, weight_decay, init, progress=None) -> nn.Sequential:
    model = copy.deepcopy(init) if init is not None else build_model(arch, seed=seed)
    xt = input_tensor(arch, x)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.long)
    return fit_classifier(
        model, xt, yt, seed=seed, epochs=epochs, batch_size=batch_size, learning_rate=learning_rate,
        weight_decay=weight_decay, progress=progress,
    )  # fmt: skip


def fit_classifier(
    model: nn.Module,
    xt: torch.Tensor,
    yt: torch.Tensor,
    *,
    seed: int,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    weight_decay: float = 0.0,
    progress=None,
) -> nn.Module:
    """Plain (non-private) training of any classifier module in place, returned in eval mode:
    Adam, cross-entropy, minibatches in the order of a generator seeded by ``seed``
    (``progress()`` after each epoch). What :func:`train_classifier` runs on a built-in
    architecture, and the simulator on a site's own network."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=learning_rate, weight_decay=weight_decay)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(len(xt), generator=g)
        for start in range(0, len(xt), batch_size):
            idx = perm[start : start + batch_size]
            opt.zero_grad()
            loss_fn(model(xt[idx]), yt[idx]).backward()
            opt.step()
        if progress is not None:
            progress()
    model.eval()
    return model
