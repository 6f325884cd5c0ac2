"""The permutation structure of a site's own ``torch.nn.Module``, derived by tracing.

A hidden unit of a network can be renamed — its index permuted — without changing the function
the network computes, provided every weight axis that reads or writes that unit is permuted the
same way (Ainsworth et al., Git Re-Basin, 2023, §2: "permutation specs"). Units that must move
together form a **permutation group**: the output units of a Linear/Conv and every tensor that
carries them on to the layers that read them. Residual additions ``y = x + f(x)`` force the
units of ``x`` and ``f(x)`` into one group (the sum is permutation-equivariant only if both
operands are permuted alike), and so does every layer that acts unit by unit (normalisation,
elementwise activations, dropout, pooling over space). Input units (features, image channels)
and output units (classes) have a meaning shared by every site: they are **fixed**, and a group
that meets them (a residual stream added to the input, the output layer's rows) is fixed too.

What a group records, for each weight axis it acts on, is ``(param, axis, block)``: the
parameter or buffer's name in the *site's own* state-dict keys, the axis, and how many
consecutive entries of that axis belong to one unit (``block`` = H·W for the first Linear
after flattening an (N, C, H, W) map channel-major; 1 otherwise). Permuting group g by π maps
``t[..., π(i)·block + r, ...]`` to position ``i·block + r`` on every such axis (the convention of
``peer.ldp.fusion``: ``perm[i] = j`` says unit i of A corresponds to unit j of B).

Supported (anything else is refused, naming the fx node):

- ``Linear`` (on the last axis), ``Conv1d``/``Conv2d`` (``groups=1``, or depthwise with
  ``groups = in = out``, which keeps its input group), with or without bias;
- ``BatchNorm1d``/``BatchNorm2d``: weight, bias, ``running_mean`` and ``running_var`` join the
  group of the normalised channels (``num_batches_tracked`` is a scalar and stays);
- ``LayerNorm`` over the last axis only: the mean and variance over the units are symmetric
  functions of them, so a permutation commutes with it when its weight and bias move along;
- ``GroupNorm`` only as ``GroupNorm(1, C)`` (one group: symmetric over all channels) or
  ``GroupNorm(C, C)`` (one channel per group: instance norm). With 1 < groups < C a
  permutation would have to keep channels inside their normalisation group — a constraint
  on the permutation, not a relabelling — which this module does not express, so it refuses;
- elementwise activations (ReLU, GELU, SiLU, Tanh, Sigmoid, LeakyReLU, ELU, Softplus, …),
  ``Dropout``, ``Identity``; max/average/adaptive pooling; means and sums over spatial axes;
- ``Flatten`` / ``torch.flatten`` / ``view`` / ``reshape`` that flatten (N, C, …) to (N, C·…):
  the channel group becomes a block group on the flat axis;
- ``+``, ``-``, ``*`` of two tensors (the operands' groups are merged), or of a tensor and a
  constant.

Refused: unknown modules (attention, RNNs, embeddings, …) and functions, parameters used
directly (``get_attr``), slicing, concatenation, reshapes that mix axes, and a module called
twice on tensors of different groups unless the groups can be merged. Before any of that, a
module whose state dict names one tensor under two keys (:func:`state_aliases`: a submodule
under two attribute names, tied weights, a shared buffer) is refused naming the keys: units
are tensors, not keys, and every step downstream takes each key for a tensor of its own.

Why ``torch.fx.symbolic_trace`` rather than ``torch.export``: fx keeps ``nn`` modules as
``call_module`` nodes named by their attribute path — exactly the site's own state-dict prefix —
so a weight axis is named as the site named it, with no decomposition into aten ops and no
functionalised parameters to map back; it runs without an example input (``ShapeProp`` adds
shapes from one), and needs no compiler stack. ``torch.export`` would give a stricter, complete
graph (data-dependent control flow is caught the same way: tracing fails and the model is
refused), at the cost of aten-level nodes whose parameters are lifted inputs.

The structure is then *proven* on the site's weights by :func:`self_check`: random
permutations of each group, then of all groups at once, must leave the outputs unchanged on
random inputs in eval mode (relative error ≤ 1e-5, computed in float64), or the model is
refused naming the group that broke. The proven structure (:meth:`PermutationStructure.to_json`)
holds only names, shapes, sizes and axes: the store keeps it and the wire can carry it without
any site code. Nothing here reads data: the structure is public.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from peer.base.errors import InvalidArgument, Unsupported

__all__ = [
    "AxisRef",
    "PermutationGroup",
    "PermutationStructure",
    "StatPoint",
    "check_no_aliases",
    "derive_structure",
    "import_structure",
    "permute_state",
    "random_permutations",
    "self_check",
    "state_aliases",
]

STRUCTURE_FORMAT = 1
#: the self-check's tolerance on ‖f(x) − f_π(x)‖_∞ / ‖f(x)‖_∞ (float64 arithmetic)
SELF_CHECK_TOLERANCE = 1e-5

_ELEMENTWISE_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.LeakyReLU,
    nn.ELU,
    nn.Softplus,
    nn.Mish,
    nn.Hardswish,
    nn.Hardtanh,
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.AlphaDropout,
)
_ELEMENTWISE_FUNCTIONS = {
    F.relu,
    F.relu6,
    F.gelu,
    F.silu,
    F.tanh,
    F.sigmoid,
    F.leaky_relu,
    F.elu,
    F.softplus,
    F.mish,
    F.hardswish,
    F.hardtanh,
    F.dropout,
    F.dropout1d,
    F.dropout2d,
    torch.relu,
    torch.tanh,
    torch.sigmoid,
    torch.nn.functional.relu_,
}
_ELEMENTWISE_METHODS = {"relu", "relu_", "tanh", "sigmoid", "contiguous", "float", "clone", "detach"}
_POOL_MODULES = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
)
_POOL_FUNCTIONS = {
    F.max_pool1d,
    F.max_pool2d,
    F.avg_pool1d,
    F.avg_pool2d,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    F.adaptive_max_pool1d,
    F.adaptive_max_pool2d,
}
_BINARY_FUNCTIONS = {
    operator.add,
    torch.add,
    operator.sub,
    torch.sub,
    operator.mul,
    torch.mul,
    operator.iadd,
    operator.truediv,
}
_BINARY_METHODS = {"add", "add_", "sub", "mul", "mul_"}
_FIXED = -1


@dataclass(frozen=True)
class AxisRef:
    """One axis a group permutes: ``param`` (the site's state-dict key), ``axis``, and
    ``block`` consecutive entries per unit."""

    param: str
    axis: int
    block: int = 1


@dataclass(frozen=True)
class StatPoint:
    """Where the pre-activation statistics of a group's units can be reset after fusion:
    ``module`` (the site's module path) is a Linear/Conv (``kind = "affine"``, its weight and
    bias are rescaled) or a BatchNorm (``kind = "batchnorm"``, its running statistics are
    reset); ``group`` is the group its output units belong to. Listed in execution order."""

    module: str
    kind: str
    group: str


@dataclass(frozen=True)
class PermutationGroup:
    """A set of hidden units that must be permuted together: ``size`` units, acting on
    ``axes``. ``producers`` are the Linear/Conv modules whose outputs write into the group
    (several for a residual stream): their weight rows are the units' incoming weights."""

    name: str
    size: int
    axes: tuple[AxisRef, ...]
    producers: tuple[str, ...] = ()


@dataclass(frozen=True)
class PermutationStructure:
    """The permutation groups of one network, and the names and shapes of its state dict.

    ``input_shape`` is one example's shape (no batch axis). ``parameters`` maps every state-dict
    key to its shape; keys no group touches are fixed. Public: names, shapes and axes only."""

    input_shape: tuple[int, ...]
    groups: tuple[PermutationGroup, ...]
    parameters: Mapping[str, tuple[int, ...]]
    stat_points: tuple[StatPoint, ...] = ()
    dtypes: Mapping[str, str] = field(default_factory=dict)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(g.size for g in self.groups)

    def group(self, name: str) -> PermutationGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise InvalidArgument("group", f"no permutation group named {name!r}; groups: {[g.name for g in self.groups]}")

    def to_json(self) -> dict:
        return {
            "format": STRUCTURE_FORMAT,
            "input_shape": list(self.input_shape),
            "groups": [
                {
                    "name": g.name,
                    "size": g.size,
                    "producers": list(g.producers),
                    "axes": [{"param": a.param, "axis": a.axis, "block": a.block} for a in g.axes],
                }
                for g in self.groups
            ],
            # a list, not an object: the site's own key order survives any JSON writer
            "parameters": [
                {"name": k, "shape": list(v), "dtype": self.dtypes.get(k, "float32")}
                for k, v in self.parameters.items()
            ],
            "stat_points": [{"module": s.module, "kind": s.kind, "group": s.group} for s in self.stat_points],
        }

    @classmethod
    def from_json(cls, data: Any) -> PermutationStructure:
        """Read a structure (e.g. from the store or the wire), checking every rule the
        permutation code relies on: known parameters, axes in range, sizes that divide."""
        if not isinstance(data, Mapping) or data.get("format") != STRUCTURE_FORMAT:
            raise InvalidArgument("structure", f"must be an object with format {STRUCTURE_FORMAT}")
        try:
            params = {str(p["name"]): tuple(int(d) for d in p["shape"]) for p in data["parameters"]}
            dtypes = {str(p["name"]): str(p.get("dtype", "float32")) for p in data["parameters"]}
            if len(params) != len(data["parameters"]):
                raise ValueError("parameter names repeat")
            input_shape = tuple(int(d) for d in data["input_shape"])
            groups = []
            for g in data["groups"]:
                axes = tuple(AxisRef(str(a["param"]), int(a["axis"]), int(a.get("block", 1))) for a in g["axes"])
                groups.append(
                    PermutationGroup(
                        str(g["name"]), int(g["size"]), axes, tuple(str(p) for p in g.get("producers", ()))
                    )
                )
            stats = tuple(
                StatPoint(str(s["module"]), str(s["kind"]), str(s["group"])) for s in data.get("stat_points", ())
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise InvalidArgument("structure", f"is malformed: {e!r}") from None
        names = set()
        seen_axes: dict[tuple[str, int], str] = {}
        for i, g in enumerate(groups):
            if g.name in names or g.size <= 0:
                raise InvalidArgument(
                    f"structure.groups[{i}]", f"names must be distinct and sizes positive (group {g.name!r})"
                )
            names.add(g.name)
            for a in g.axes:
                shape = params.get(a.param)
                if shape is None:
                    raise InvalidArgument(
                        f"structure.groups[{i}].axes", f"parameter {a.param!r} is not in the structure's parameters"
                    )
                if not 0 <= a.axis < len(shape) or a.block <= 0 or shape[a.axis] != g.size * a.block:
                    raise InvalidArgument(
                        f"structure.groups[{i}].axes",
                        f"{a.param!r} axis {a.axis} (shape {shape}) does not hold {g.size} units of {a.block}",
                    )
                if (a.param, a.axis) in seen_axes:
                    raise InvalidArgument(
                        f"structure.groups[{i}].axes",
                        f"{a.param!r} axis {a.axis} is already permuted by group {seen_axes[(a.param, a.axis)]!r}",
                    )
                seen_axes[(a.param, a.axis)] = g.name
        for s in stats:
            if s.group not in names or s.kind not in ("affine", "batchnorm"):
                raise InvalidArgument(
                    "structure.stat_points", f"{s.module!r}: kind must be affine/batchnorm and group a known group"
                )
        return cls(input_shape, tuple(groups), params, stats, dtypes)

    def check_arrays(self, arrays: Mapping[str, Any], field_name: str = "weights") -> None:
        """Every state-dict key present with the structure's shape, and nothing else."""
        missing = set(self.parameters) - set(arrays)
        extra = set(arrays) - set(self.parameters)
        if missing or extra:
            raise InvalidArgument(
                field_name, f"do not fit the structure: missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        for k, shape in self.parameters.items():
            if tuple(np.shape(arrays[k])) != tuple(shape):
                raise InvalidArgument(
                    f"{field_name}[{k}]", f"has shape {tuple(np.shape(arrays[k]))}, the structure needs {tuple(shape)}"
                )


# ---------------------------------------------------------------------------------------------
# Tracing


class _Union:
    """Union-find over group ids; id _FIXED (-1) is the fixed units (inputs, outputs)."""

    def __init__(self):
        self.parent: dict[int, int] = {_FIXED: _FIXED}
        self.size: dict[int, int] = {}

    def new(self, size: int) -> int:
        g = len(self.size)
        self.parent[g] = g
        self.size[g] = size
        return g

    def find(self, g: int) -> int:
        while self.parent[g] != g:
            self.parent[g] = self.parent[self.parent[g]]
            g = self.parent[g]
        return g

    def union(self, a: int, b: int, where: str) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if _FIXED in (ra, rb):
            keep, drop = _FIXED, (rb if ra == _FIXED else ra)
        else:
            if self.size[ra] != self.size[rb]:
                raise Unsupported(where, f"joins unit groups of different sizes ({self.size[ra]} and {self.size[rb]})")
            keep, drop = min(ra, rb), max(ra, rb)
        self.parent[drop] = keep
        return keep


@dataclass
class _Layout:
    """Where a tensor's units are: axis ``dim`` holds ``group``'s units, ``block`` entries each."""

    group: int
    dim: int
    block: int = 1


def _refuse(node: fx.Node, why: str) -> Unsupported:
    return Unsupported(f"model.node[{node.name}]", why)


def _target_name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__qualname__", getattr(t, "__name__", repr(t)))


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta")
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def trace_module(module: nn.Module, input_shape: Sequence[int]) -> fx.GraphModule:
    """``symbolic_trace`` the module and annotate shapes from one zero example of ``input_shape``.

    Not to be run while another thread of the process runs forward passes: torch.fx replaces
    ``nn.Module.__call__`` process-wide during a trace (callers that run several sites on threads
    trace before starting them, e.g. ``coordinator_free.after_fusion.stat_points_of``)."""
    try:
        gm = fx.symbolic_trace(module)
    except Exception as e:  # any tracing failure is a refusal, with its reason
        raise Unsupported(
            "model",
            f"cannot be traced by torch.fx (data-dependent control flow or untraceable code): {type(e).__name__}: {e}",
        ) from None
    example = torch.zeros((2, *input_shape), dtype=next((p.dtype for p in module.parameters()), torch.float32))
    was_training = gm.training
    gm.eval()
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(example)
    except Exception as e:
        raise InvalidArgument(
            "input_shape", f"{list(input_shape)} does not fit the model: {type(e).__name__}: {e}"
        ) from None
    finally:
        gm.train(was_training)
    return gm


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) bytes of ``t``'s storage that ``t`` can read (every stride counted)."""
    size = t.element_size()
    first = t.storage_offset() * size
    low = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s < 0)
    high = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True) if s > 0)
    return first + low * size, first + (high + 1) * size


def state_aliases(module: nn.Module) -> list[tuple[str, ...]]:
    """The state-dict keys of ``module`` that name one tensor, as sets of two or more keys (in
    state-dict order): a submodule reachable under two attribute names (``self.shortcut =
    self.skip``), a parameter assigned to two modules (tied weights: ``head.weight =
    embedding.weight``), a buffer registered twice, or two tensors whose memory overlaps.

    ``Module.state_dict`` lists such a tensor once per name (it does not deduplicate, unlike
    ``named_parameters()``/``named_modules()``, whose default ``remove_duplicate=True`` keeps the
    first name only — which is also the name ``torch.fx`` gives the module's calls); so
    without this check every name becomes a unit of its own and one tensor is released, with
    independent noise, once per name. Found from the tensors themselves
    (``state_dict(keep_vars=True)``: identity, then overlapping bytes of one storage), never
    from their values. Empty tensors hold nothing and alias nothing."""
    by_storage: dict[tuple[Any, int], list[tuple[str, int, int]]] = {}
    order: list[str] = []
    for key, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.is_meta or t.layout != torch.strided:
            continue
        first, last = _byte_span(t)
        by_storage.setdefault((t.device, t.untyped_storage().data_ptr()), []).append((key, first, last))
        order.append(key)
    parent = {k: k for k in order}

    def root(k: str) -> str:
        while parent[k] != k:
            k = parent[k]
        return k

    for spans in by_storage.values():
        for i, (a, fa, la) in enumerate(spans):
            for b, fb, lb in spans[i + 1 :]:
                if fa < lb and fb < la and root(a) != root(b):
                    parent[root(b)] = root(a)
    sets: dict[str, list[str]] = {}
    for k in order:
        sets.setdefault(root(k), []).append(k)
    return [tuple(v) for v in sets.values() if len(v) > 1]


def check_no_aliases(module: nn.Module, where: str = "model") -> None:
    """Refuse a module whose state dict names one tensor under two keys (:func:`state_aliases`),
    naming the keys. A released unit is a tensor's rows, not a key's: a tensor under two names
    would be released twice, with independent noise, under a record that charges it once —
    two (ε, δ) releases of one row (at ε = 4, δ = 1e-5: ε = 5.99 by composition; the average
    of the two copies has 1/√2 of the noise). Refusing keeps every downstream step (matching,
    fusion, DP-SGD, export under the site's names) one tensor per key."""
    aliases = state_aliases(module)
    if aliases:
        shown = "; ".join(" = ".join(repr(k) for k in keys) for keys in aliases[:4])
        more = f"; and {len(aliases) - 4} more" if len(aliases) > 4 else ""
        raise Unsupported(
            f"{where}.state_dict",
            f"names one tensor under several keys ({shown}{more}): a parameter or buffer under two names (a "
            "submodule assigned to two attributes, e.g. self.shortcut = self.skip, or tied weights) would be "
            "released once per name, with independent noise, under a charge for one release; register it under one "
            "name (call the one module twice in forward) and give weights without the duplicate keys",
        )


def derive_structure(module: nn.Module, input_shape: Sequence[int]) -> PermutationStructure:
    """The permutation groups of ``module`` (not yet proven: see :func:`import_structure`).
    A module with aliased state-dict keys is refused first (:func:`check_no_aliases`).

    The steps, in order: check the input shape, refuse aliased state-dict keys, trace the
    module (:func:`trace_module`), walk its graph giving every tensor the layout of its units
    and every weight axis the group it acts on (:func:`_walk_units`; a residual addition
    unions its operands' groups, the outputs' groups are fixed), union the groups that share
    a weight axis (:func:`_merge_shared_axes`), check every permuted axis is a state-dict key,
    collect the groups in the order their first axis was met and name them
    (:func:`_ordered_groups`), and list where their statistics are set (:func:`_stat_points`)."""
    input_shape = _checked_input_shape(input_shape)
    check_no_aliases(module)
    walk = _walk_units(trace_module(module, input_shape))
    _merge_shared_axes(walk)
    params = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in module.state_dict().items()}
    _check_axes_in_state_dict(walk, params)
    names, groups = _ordered_groups(walk)
    return PermutationStructure(input_shape, groups, params, _stat_points(walk, names), dtypes)


def _checked_input_shape(input_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(d) for d in input_shape)
    if not shape or any(d <= 0 for d in shape):
        raise InvalidArgument("input_shape", f"must be a non-empty list of positive integers, got {list(shape)}")
    return shape


@dataclass
class _UnitWalk:
    """What the walk over a traced graph has found so far.

    ``layouts``: where each analysed node's units lie (None for a non-tensor value such as a
    size); ``axes``: (group id, weight axis) in the order the walk met them; ``producers``:
    (group id, module name) for every Linear/Conv writing a group; ``stat_candidates``:
    (module name, kind, group id, node) for every layer that sets a group's statistics. Group
    ids are the union-find's, so a group's final id is ``uf.find(id)``."""

    modules: dict[str, nn.Module]
    uf: _Union = field(default_factory=_Union)
    layouts: dict[fx.Node, _Layout | None] = field(default_factory=dict)
    axes: list[tuple[int, AxisRef]] = field(default_factory=list)
    producers: list[tuple[int, str]] = field(default_factory=list)
    stat_candidates: list[tuple[str, str, int, fx.Node]] = field(default_factory=list)
    placeholders: int = 0

    def layout_of(self, arg: Any, node: fx.Node) -> _Layout | None:
        if isinstance(arg, fx.Node):
            if arg not in self.layouts:
                raise _refuse(node, f"reads {arg.name}, which was not analysed")
            return self.layouts[arg]
        return None

    def tensor_in(self, node: fx.Node, arg: Any) -> _Layout:
        lay = self.layout_of(arg, node)
        if lay is None:
            raise _refuse(node, "expects a tensor input")
        return lay

    def fixed(self, lay: _Layout) -> bool:
        # the input's units (and any group merged into them) are never permuted: where they
        # lie does not matter
        return self.uf.find(lay.group) == _FIXED

    def add_axis(self, group: int, name: str, axis: int, block: int = 1) -> None:
        self.axes.append((group, AxisRef(name, axis, block)))


def _walk_units(gm: fx.GraphModule) -> _UnitWalk:
    """Every node of ``gm`` in graph order: the layout of its units, and the weight axes,
    producers and statistic points it adds. Refuses, naming the node, what has no rule."""
    walk = _UnitWalk(dict(gm.named_modules()))
    for node in gm.graph.nodes:
        lay = _node_layout(walk, node)
        if node.op != "output":
            walk.layouts[node] = lay
    return walk


def _node_layout(walk: _UnitWalk, node: fx.Node) -> _Layout | None:
    shape = _shape(node)
    if node.op == "placeholder":
        walk.placeholders += 1
        if walk.placeholders > 1:
            raise _refuse(node, "models with more than one input are not supported")
        return _Layout(_FIXED, 1)
    if node.op == "get_attr":
        raise _refuse(
            node,
            f"uses the parameter or buffer {node.target!r} directly; only nn modules' own parameters can be permuted",
        )
    if node.op == "output":
        _fix_outputs(walk, node)
        return None
    if shape is None:
        return _non_tensor_layout(walk, node)
    if node.op == "call_module":
        return _module_layout(walk, node, shape)
    if node.op in ("call_function", "call_method"):
        return _function_layout(walk, node, shape)
    raise _refuse(node, f"node kind {node.op} is not supported")


def _fix_outputs(walk: _UnitWalk, node: fx.Node) -> None:
    """The returned tensors' units (the classes) mean the same at every site: fixed."""
    returned: list[fx.Node] = []
    fx.node.map_arg(node.args, returned.append)
    for a in returned:
        lay = walk.layout_of(a, node)
        if lay is not None:
            walk.uf.union(lay.group, _FIXED, f"model.node[{node.name}]")


def _non_tensor_layout(walk: _UnitWalk, node: fx.Node) -> None:
    """A non-tensor value (x.size(0), a shape tuple): allowed only as reshape arguments."""
    src = node.args[0] if node.args else None
    if (
        (node.op == "call_method" and node.target in ("size", "dim"))
        or (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(src, fx.Node)
            and _shape(src) is None
        )
        or (node.op == "call_function" and node.target is getattr and node.args[1] == "shape")
    ):
        return None
    if node.op == "call_module":
        raise _refuse(
            node,
            f"module {node.target!r} of type {type(walk.modules[node.target]).__name__} is not supported (it returns no single tensor)",
        )
    raise _refuse(node, f"{node.op} {_target_name(node)} does not produce a tensor and is not supported")


def _module_layout(walk: _UnitWalk, node: fx.Node, shape: tuple[int, ...]) -> _Layout:
    """An ``nn`` module called on one tensor: the layout of its output units."""
    mod = walk.modules[node.target]
    name = str(node.target)
    lay = walk.tensor_in(node, node.args[0]) if node.args else None
    if lay is None or len([a for a in node.args if isinstance(a, fx.Node)]) != 1 or node.kwargs:
        raise _refuse(node, f"module {name!r} ({type(mod).__name__}) must take exactly one tensor")
    in_shape = _shape(node.args[0])
    if isinstance(mod, nn.Linear):
        return _linear_layout(walk, node, mod, lay, in_shape, shape)
    if isinstance(mod, (nn.Conv1d, nn.Conv2d)):
        return _conv_layout(walk, node, mod, lay)
    if isinstance(mod, (nn.BatchNorm1d, nn.BatchNorm2d)):
        if not walk.fixed(lay) and (lay.dim != 1 or lay.block != 1):
            raise _refuse(node, f"BatchNorm {name!r} normalises axis 1, which must hold unflattened units")
        for p in ("weight", "bias", "running_mean", "running_var"):
            if getattr(mod, p, None) is not None:
                walk.add_axis(lay.group, f"{name}.{p}", 0)
        walk.stat_candidates.append((name, "batchnorm", lay.group, node))
        return _Layout(lay.group, 1)
    if isinstance(mod, nn.LayerNorm):
        return _layernorm_layout(walk, node, mod, lay, in_shape)
    if isinstance(mod, nn.GroupNorm):
        return _groupnorm_layout(walk, node, mod, lay)
    if isinstance(mod, _ELEMENTWISE_MODULES):
        return _Layout(lay.group, lay.dim, lay.block)
    if isinstance(mod, _POOL_MODULES):
        if not walk.fixed(lay) and (lay.dim != 1 or lay.block != 1):
            raise _refuse(node, f"pooling {name!r} needs its channels on axis 1 unflattened")
        return _Layout(lay.group, 1)
    if isinstance(mod, nn.Flatten):
        return _flatten_layout(node, lay, in_shape, shape, mod.start_dim, walk.fixed(lay))
    raise _refuse(node, f"module {name!r} of type {type(mod).__name__} is not supported (no permutation rule for it)")


def _linear_layout(walk: _UnitWalk, node: fx.Node, mod: nn.Linear, lay: _Layout, in_shape, shape) -> _Layout:
    """A Linear reads its input's group on weight axis 1 and writes a new group of
    ``out_features`` units (weight axis 0, bias) on its last axis."""
    name = str(node.target)
    if not walk.fixed(lay) and lay.dim != len(in_shape) - 1:
        raise _refuse(node, f"Linear {name!r} reads axis {len(in_shape) - 1} but the units are on axis {lay.dim}")
    walk.add_axis(lay.group, f"{name}.weight", 1, lay.block)
    g = walk.uf.new(mod.out_features)
    walk.add_axis(g, f"{name}.weight", 0)
    if mod.bias is not None:
        walk.add_axis(g, f"{name}.bias", 0)
    walk.producers.append((g, name))
    walk.stat_candidates.append((name, "affine", g, node))
    return _Layout(g, len(shape) - 1)


def _conv_layout(walk: _UnitWalk, node: fx.Node, mod: nn.Conv1d | nn.Conv2d, lay: _Layout) -> _Layout:
    """A convolution reads its input's channel group on weight axis 1 and writes a new group
    of ``out_channels`` (weight axis 0, bias) on axis 1; a depthwise one keeps its input's."""
    name = str(node.target)
    if not walk.fixed(lay) and (lay.dim != 1 or lay.block != 1):
        raise _refuse(node, f"convolution {name!r} needs its channels on axis 1 unflattened")
    if mod.groups == 1:
        walk.add_axis(lay.group, f"{name}.weight", 1)
        g = walk.uf.new(mod.out_channels)
    elif mod.groups == mod.in_channels == mod.out_channels:
        g = lay.group  # depthwise: channel c reads only channel c
    else:
        raise _refuse(
            node,
            f"grouped convolution {name!r} (groups={mod.groups}) ties channels to groups; only groups=1 or depthwise are supported",
        )
    walk.add_axis(g, f"{name}.weight", 0)
    if mod.bias is not None:
        walk.add_axis(g, f"{name}.bias", 0)
    walk.producers.append((g, name))
    walk.stat_candidates.append((name, "affine", g, node))
    return _Layout(g, 1)


def _layernorm_layout(walk: _UnitWalk, node: fx.Node, mod: nn.LayerNorm, lay: _Layout, in_shape) -> _Layout:
    name = str(node.target)
    if len(mod.normalized_shape) != 1:
        raise _refuse(
            node,
            f"LayerNorm {name!r} over {len(mod.normalized_shape)} axes mixes the unit axis with others; only the last axis is supported",
        )
    if not walk.fixed(lay) and lay.dim == len(in_shape) - 1:
        if lay.block != 1:
            raise _refuse(node, f"LayerNorm {name!r} over a flattened axis is not supported")
        for p in ("weight", "bias"):
            if getattr(mod, p, None) is not None:
                walk.add_axis(lay.group, f"{name}.{p}", 0)
    # else the units lie on another axis: each unit is normalised on its own, and the affine
    # parameters (indexed by the last axis) stay where they are
    return _Layout(lay.group, lay.dim, lay.block)


def _groupnorm_layout(walk: _UnitWalk, node: fx.Node, mod: nn.GroupNorm, lay: _Layout) -> _Layout:
    name = str(node.target)
    if not walk.fixed(lay) and (lay.dim != 1 or lay.block != 1):
        raise _refuse(node, f"GroupNorm {name!r} needs its channels on axis 1 unflattened")
    if mod.num_groups not in (1, mod.num_channels):
        raise _refuse(
            node,
            f"GroupNorm {name!r} with {mod.num_groups} groups of {mod.num_channels} channels: a permutation would have to keep channels in their groups (only 1 or C groups are supported)",
        )
    if mod.affine:
        for p in ("weight", "bias"):
            walk.add_axis(lay.group, f"{name}.{p}", 0)
    return _Layout(lay.group, 1)


def _function_layout(walk: _UnitWalk, node: fx.Node, shape: tuple[int, ...]) -> _Layout:
    """A function or tensor method: the layout of its output units."""
    target = node.target
    tensor_args = [
        a
        for a in list(node.args) + list(node.kwargs.values())
        if isinstance(a, fx.Node) and walk.layouts.get(a) is not None
    ]
    first = node.args[0] if node.args else None
    lay = walk.layout_of(first, node) if isinstance(first, fx.Node) else None
    is_fn = node.op == "call_function"
    if (is_fn and target in _ELEMENTWISE_FUNCTIONS) or (not is_fn and target in _ELEMENTWISE_METHODS):
        if lay is None or len(tensor_args) != 1:
            raise _refuse(node, f"{_target_name(node)} must take one tensor")
        return _Layout(lay.group, lay.dim, lay.block)
    if is_fn and target in _POOL_FUNCTIONS:
        if lay is None or (not walk.fixed(lay) and (lay.dim != 1 or lay.block != 1)):
            raise _refuse(node, f"{_target_name(node)} needs channels on axis 1 unflattened")
        return _Layout(lay.group, 1)
    if (is_fn and target in _BINARY_FUNCTIONS) or (not is_fn and target in _BINARY_METHODS):
        return _binary_layout(walk, node, shape, tensor_args)
    if (is_fn and target is torch.flatten) or (not is_fn and target == "flatten"):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        if end not in (-1, len(_shape(first)) - 1):
            raise _refuse(node, "flatten must run to the last axis")
        return _flatten_layout(node, lay, _shape(first), shape, start, lay is not None and walk.fixed(lay))
    if (not is_fn and target in ("view", "reshape")) or (is_fn and target is torch.reshape):
        return _reshape_layout(walk, node, lay, _shape(first), shape)
    if (not is_fn and target in ("mean", "sum", "amax")) or (is_fn and target in (torch.mean, torch.sum, torch.amax)):
        return _reduction_layout(walk, node, lay, _shape(first))
    raise _refuse(node, f"function {_target_name(node)} is not supported (no permutation rule for it)")


def _binary_layout(walk: _UnitWalk, node: fx.Node, shape: tuple[int, ...], tensor_args: list[fx.Node]) -> _Layout:
    """``+``, ``-``, ``*`` (and ``/`` by a constant) of same-shape tensors: the operands'
    groups are unioned (a residual addition), their units must lie alike."""
    lays = [walk.layouts[a] for a in tensor_args]
    if not lays:
        raise _refuse(node, f"{_target_name(node)} has no tensor operand")
    if tuple(shape) != tuple(_shape(tensor_args[0]) or ()) or any(
        tuple(_shape(a)) != tuple(shape) for a in tensor_args
    ):
        raise _refuse(
            node,
            f"{_target_name(node)} broadcasts tensors of shapes {[list(_shape(a)) for a in tensor_args]}; only same-shape operands (a residual addition) or constants are supported",
        )
    if node.target in (operator.truediv,) and len(lays) > 1:
        raise _refuse(node, "division of two tensors is not supported")
    g = lays[0].group
    for other in lays[1:]:
        if (other.dim, other.block) != (lays[0].dim, lays[0].block):
            raise _refuse(node, f"{_target_name(node)} combines tensors whose units lie differently")
        g = walk.uf.union(g, other.group, f"model.node[{node.name}]")
    return _Layout(g, lays[0].dim, lays[0].block)


def _reshape_layout(walk: _UnitWalk, node: fx.Node, lay: _Layout | None, in_shape, shape) -> _Layout:
    if lay is not None and walk.fixed(lay):
        return _Layout(_FIXED, 1)
    if len(shape) == 2 and len(in_shape) >= 2 and shape[0] == in_shape[0]:
        return _flatten_layout(node, lay, in_shape, shape, 1, False)
    if tuple(shape) == tuple(in_shape):
        return _Layout(lay.group, lay.dim, lay.block)
    raise _refuse(
        node,
        f"reshape from {list(in_shape)} to {list(shape)} mixes axes; only flattening (N, C, ...) to (N, C·...) is supported",
    )


def _reduction_layout(walk: _UnitWalk, node: fx.Node, lay: _Layout | None, in_shape) -> _Layout:
    """A mean/sum/max over axes after the units' axis keeps every unit apart."""
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = (dims,) if isinstance(dims, int) else dims
    if lay is None or dims is None:
        raise _refuse(node, f"{_target_name(node)} over all axes mixes the units")
    if walk.fixed(lay):
        return _Layout(_FIXED, 1)
    dims = tuple(d % len(in_shape) for d in dims)
    if lay.dim in dims or any(d < lay.dim for d in dims) or lay.block != 1:
        raise _refuse(node, f"{_target_name(node)} over axes {list(dims)} mixes the units on axis {lay.dim}")
    return _Layout(lay.group, lay.dim)


def _merge_shared_axes(walk: _UnitWalk) -> None:
    """Weight sharing: an axis claimed by two groups merges them (read with one layout)."""
    owner: dict[tuple[str, int], tuple[int, int]] = {}
    for g, ref in walk.axes:
        key = (ref.param, ref.axis)
        if key in owner:
            if owner[key][1] != ref.block:
                raise Unsupported(f"model.{ref.param}", f"axis {ref.axis} is read with two different layouts")
            walk.uf.union(owner[key][0], g, f"model.{ref.param}")
        else:
            owner[key] = (g, ref.block)


def _check_axes_in_state_dict(walk: _UnitWalk, params: Mapping[str, tuple[int, ...]]) -> None:
    missing = {ref.param for _, ref in walk.axes} - set(params)
    if missing:
        raise Unsupported("model", f"permuted parameters {sorted(missing)} are not in the module's state dict")


def _ordered_groups(walk: _UnitWalk) -> tuple[dict[int, str], tuple[PermutationGroup, ...]]:
    """The groups not merged into the fixed units, in the order their first axis was met, each
    with its axes (once each) and producers. A group is named by its first producer (``group<id>``
    with none; ``#<id>`` appended if taken). Returns (final group id → name, groups)."""
    uf = walk.uf
    roots: dict[int, list[AxisRef]] = {}
    order: list[int] = []
    for g, ref in walk.axes:
        r = uf.find(g)
        if r == _FIXED:
            continue
        if r not in roots:
            roots[r] = []
            order.append(r)
        if all((x.param, x.axis) != (ref.param, ref.axis) for x in roots[r]):
            roots[r].append(ref)
    names: dict[int, str] = {}
    for r in order:
        prod = [n for g, n in walk.producers if uf.find(g) == r]
        base = prod[0] if prod else f"group{r}"
        names[r] = base if base not in names.values() else f"{base}#{r}"
    groups = tuple(
        PermutationGroup(
            names[r],
            uf.size[r],
            tuple(roots[r]),
            tuple(dict.fromkeys(n for g, n in walk.producers if uf.find(g) == r)),
        )
        for r in order
    )
    return names, groups


def _stat_points(walk: _UnitWalk, names: Mapping[int, str]) -> tuple[StatPoint, ...]:
    """Statistic points: a Linear/Conv whose output goes straight into a BatchNorm has its
    statistics set by that BatchNorm; every other Linear/Conv producing a group is rescaled."""
    stats = []
    for name, kind, g, node in walk.stat_candidates:
        r = walk.uf.find(g)
        if r == _FIXED:
            continue
        if kind == "affine":
            users = list(node.users)
            if (
                len(users) == 1
                and users[0].op == "call_module"
                and isinstance(walk.modules[users[0].target], (nn.BatchNorm1d, nn.BatchNorm2d))
            ):
                continue
        stats.append(StatPoint(name, kind, names[r]))
    return tuple(stats)


def _flatten_layout(
    node: fx.Node, lay: _Layout | None, in_shape, out_shape, start_dim: int, fixed_units: bool
) -> _Layout:
    if lay is None:
        raise _refuse(node, "flatten needs a tensor")
    if fixed_units:
        return _Layout(_FIXED, 1)
    start = start_dim % len(in_shape)
    if start == len(in_shape) - 1:
        return _Layout(lay.group, lay.dim, lay.block)
    if start != 1 or lay.dim != 1:
        raise _refuse(
            node,
            f"flatten from axis {start_dim} of {list(in_shape)} with units on axis {lay.dim} mixes the units with the batch; only flattening (N, C, ...) to (N, C·...) is supported",
        )
    inner = math.prod(in_shape[2:])
    return _Layout(lay.group, 1, lay.block * inner)


# ---------------------------------------------------------------------------------------------
# Applying permutations


def _index(size: int, block: int, perm: np.ndarray) -> np.ndarray:
    return (perm[:, None] * block + np.arange(block)[None, :]).reshape(-1)


def permute_state(
    structure: PermutationStructure, arrays: Mapping[str, Any], permutations: Mapping[str, np.ndarray]
) -> dict[str, Any]:
    """The state with every group g's axes re-indexed by ``permutations[g]`` (groups not named
    keep their order). Works on numpy arrays and torch tensors alike."""
    out = dict(arrays)
    for g in structure.groups:
        if g.name not in permutations:
            continue
        perm = np.asarray(permutations[g.name])
        if perm.shape != (g.size,) or not np.array_equal(np.sort(perm), np.arange(g.size)):
            raise InvalidArgument(f"permutations[{g.name}]", f"must be a permutation of 0..{g.size - 1}")
        for a in g.axes:
            idx = _index(g.size, a.block, perm.astype(np.int64))
            t = out[a.param]
            if isinstance(t, torch.Tensor):
                out[a.param] = torch.index_select(t, a.axis, torch.as_tensor(idx, device=t.device))
            else:
                out[a.param] = np.take(np.asarray(t), idx, axis=a.axis)
    return out


def random_permutations(
    structure: PermutationStructure, rng: np.random.Generator, only: str | None = None
) -> dict[str, np.ndarray]:
    return {g.name: rng.permutation(g.size) for g in structure.groups if only is None or g.name == only}


# ---------------------------------------------------------------------------------------------
# The self-check


@torch.no_grad()
def self_check(
    module: nn.Module,
    structure: PermutationStructure,
    *,
    seed: int = 0,
    batch: int = 8,
    tolerance: float = SELF_CHECK_TOLERANCE,
) -> None:
    """Prove ``structure`` on ``module``'s own weights, or refuse naming the group that broke.

    For each group alone, then for all groups at once, a random permutation π (from ``seed``)
    is applied to the state dict; the permuted network's outputs on ``batch`` random standard
    normal inputs must satisfy ‖f(x) − f_π(x)‖_∞ ≤ tolerance · max(‖f(x)‖_∞, 1e-12), in eval mode
    and float64. A structure that misses an axis (or permutes one it must not) fails with
    probability 1 over π unless the weights are symmetric in exactly the units moved."""
    m = copy.deepcopy(module).double().eval()
    structure.check_arrays(m.state_dict(), "model.state_dict")
    base_state = {k: v.clone() for k, v in m.state_dict().items()}
    rng = np.random.default_rng(seed)
    x = torch.as_tensor(rng.standard_normal((batch, *structure.input_shape)))
    y = m(x)
    scale = max(float(y.abs().max()), 1e-12)
    try:
        for g in [*(g.name for g in structure.groups), None]:
            if g is not None and structure.group(g).size == 1:
                continue
            perms = random_permutations(structure, rng, only=g)
            # a permutation drawn equal to the identity proves nothing: draw again (n ≥ 2)
            for name, p in perms.items():
                while len(p) > 1 and np.array_equal(p, np.arange(len(p))):
                    p = perms[name] = rng.permutation(len(p))
            m.load_state_dict(permute_state(structure, base_state, perms))
            err = float((m(x) - y).abs().max()) / scale
            if not err <= tolerance:
                what = f"group {g!r}" if g is not None else "all groups together"
                raise InvalidArgument(
                    f"structure.groups[{g}]" if g is not None else "structure",
                    f"self-check failed: permuting {what} changed the outputs (relative error {err:.3g} > {tolerance:g}); the permutation structure is wrong for this model",
                )
    finally:
        m.load_state_dict(base_state)


def import_structure(module: nn.Module, input_shape: Sequence[int], *, seed: int = 0) -> PermutationStructure:
    """Trace ``module``, derive its permutation groups and prove them by :func:`self_check`."""
    structure = derive_structure(module, input_shape)
    self_check(module, structure, seed=seed)
    return structure
