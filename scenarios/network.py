"""The network every site of a scenario runs (``[model]``), behind one small adapter used by
the world, the evaluation, the baselines and iterate's evaluation: a built-in architecture
(``peer.nn.architectures``: the MLP or the built-in CNN), or a site's own network (``[model]
factory = "MODULE:FUNCTION"``, e.g. ``scenarios.networks:residual_gn_cnn``), traced into
permutation groups (``peer.nn.tracing.import_structure``) and stored as ``privfusion model
import`` stores it (``peer.nn.imported``: the own-model store ``SITE/own_models``). A built-in
architecture's calls are exactly the ones the simulator made before (same seeds, same numbers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

#: a site's own-model store, beside its built-in ``models`` (``privfusion model import``)
OWN_MODELS = "own_models"


@dataclass(frozen=True)
class Network:
    """``architecture``: the public description every release carries (a built-in one's JSON,
    or an own network's traced structure and digest); ``factory`` and ``structure``: the own
    network's ``MODULE:FUNCTION`` and traced structure (None for a built-in one)."""

    architecture: dict
    factory: str | None = None
    structure: Any = None

    @classmethod
    def builtin(cls, architecture: Mapping[str, Any]) -> Network:
        return cls(dict(architecture))

    @classmethod
    def own(cls, factory: str, input_shape: Sequence[int], field: str = "model.factory") -> Network:
        """The network ``factory`` builds, traced and self-checked at ``input_shape``."""
        from peer.base.errors import InvalidArgument, Unsupported
        from peer.nn.imported import build_module, imported_architecture, load_factory
        from peer.nn.tracing import import_structure

        module = build_module(load_factory(factory, field=field), factory)
        try:
            structure = import_structure(module, list(input_shape))
        except (InvalidArgument, Unsupported) as e:
            raise InvalidArgument(field, f"{factory} does not trace at input shape {list(input_shape)}: {e}") from None
        return cls(imported_architecture(structure), factory, structure)

    @property
    def is_own(self) -> bool:
        return self.factory is not None

    def _factory(self):
        from peer.nn.imported import load_factory

        return load_factory(self.factory)

    def build(self, seed: int) -> torch.nn.Module:
        """A fresh module: a built-in one's ``build_model(seed)``; an own one built by its factory
        under ``torch.manual_seed(seed)`` (as ``train_dpsgd_module`` builds θ_0), in eval mode."""
        if not self.is_own:
            from peer.nn.architectures import build_model

            return build_model(self.architecture, seed=seed)
        from peer.nn.architectures import seeded_initialisation
        from peer.nn.imported import build_module

        with seeded_initialisation(seed):
            module = build_module(self._factory(), self.factory)
        return module.float().eval()

    def module(self, arrays: Mapping[str, Any]) -> torch.nn.Module:
        """The network holding ``arrays`` (a state dict), in eval mode."""
        if not self.is_own:
            from peer.nn.architectures import model_from_arrays

            return model_from_arrays(self.architecture, arrays)
        from peer.nn.imported import module_from_arrays

        return module_from_arrays(self._factory(), self.structure, arrays)

    def inputs(self, x: Any) -> torch.Tensor:
        """Rows of records as the float32 batch the network takes."""
        if not self.is_own:
            from peer.nn.architectures import input_tensor

            return input_tensor(self.architecture, x)
        from peer.nn.imported import input_batch

        return input_batch(self.structure, x)

    def accuracy_of(self, module: torch.nn.Module, x: Any, y: Any) -> float:
        if not self.is_own:
            from peer.nn.architectures import accuracy

            return accuracy(self.architecture, module, x, y)
        from peer.nn.imported import module_accuracy

        return module_accuracy(module, self.structure, x, y)

    def accuracy(self, arrays: Mapping[str, Any], x: Any, y: Any) -> float:
        """Test accuracy of the network holding ``arrays``."""
        return self.accuracy_of(self.module(arrays), x, y)

    def arrays(self, module: torch.nn.Module) -> dict[str, np.ndarray]:
        """A module's state dict as arrays (a built-in one's: float32, as stored)."""
        if not self.is_own:
            from peer.nn.architectures import state_arrays

            return state_arrays(module)
        return {k: np.array(v.detach().cpu().numpy(), order="C", copy=True) for k, v in module.state_dict().items()}

    @property
    def parameters(self) -> int:
        """Entries of the parameters (what a secure sum adds up)."""
        return sum(int(p.numel()) for p in self.build(0).parameters())

    def train(
        self, x: np.ndarray, y: np.ndarray, *, seed: int, epochs: int, batch_size: int, learning_rate: float
    ) -> torch.nn.Module:
        """Plain (non-private) Adam training with cross-entropy, deterministic given ``seed``: a
        built-in one's ``train_classifier``; an own network by the same loop (one torch thread,
        θ_0 from :meth:`build`, batches in the order of a generator seeded by ``seed``)."""
        from peer.base.errors import InvalidArgument
        from peer.nn.architectures import fit_classifier, torch_threads, train_classifier

        if not self.is_own:
            return train_classifier(
                self.architecture, x, y, seed=seed, epochs=epochs, batch_size=batch_size, learning_rate=learning_rate
            )
        if len(x) == 0:
            raise InvalidArgument("x", "training set is empty")
        with torch_threads(1):
            model = self.build(seed)
            yt = torch.as_tensor(np.asarray(y), dtype=torch.long)
            return fit_classifier(
                model, self.inputs(x), yt, seed=seed, epochs=epochs, batch_size=batch_size, learning_rate=learning_rate
            )

    def train_pool(self, x, y, trainings, *, init_seed: int, randomness, delta: float, dataset_size, public_x=None):
        """DP-SGD pool models: a built-in one's ``train_pool``; an own network's one
        ``train_dpsgd_module`` per training, each on its own spawned stream, as ``privfusion pool
        train --from-model`` trains them (eval mode, θ_0 from the factory under ``init_seed``)."""
        if not self.is_own:
            from peer.dp.training import train_pool

            return train_pool(
                self.architecture, x, y, trainings, init_seed=init_seed, randomness=randomness, delta=delta,
                dataset_size=dataset_size,
            )  # fmt: skip
        from peer.dp.training import train_dpsgd_module

        factory = self._factory()
        out = []
        for training in trainings:
            out.append(
                train_dpsgd_module(
                    factory,
                    self.architecture,
                    self.structure.input_shape,
                    x,
                    y,
                    training,
                    init_seed=init_seed,
                    randomness=randomness.spawn(),
                    delta=delta,
                    dataset_size=dataset_size,
                    public_x=public_x,
                )
            )
        return out

    def save_own(self, root: Path, name: str, arrays, metadata: dict, preprocessing=None) -> None:
        """A site's own model into its store: ``root/models`` (built-in) or ``root/own_models``
        (own network: the files ``privfusion model import`` writes)."""
        if not self.is_own:
            from peer.nn.store import save_model

            save_model(root / "models", name, self.architecture, arrays, metadata, preprocessing)
            return
        from peer.nn.imported import save_imported

        (root / "models").mkdir(parents=True, exist_ok=True)  # the built-in store, empty (as `site new` makes it)
        save_imported(root / OWN_MODELS, name, self.factory, self.structure, arrays, metadata, preprocessing)

    def load(self, root: Path, name: str) -> dict[str, np.ndarray]:
        """The arrays of a model a round saved at the site ``root``: ``root/rounds/models``
        (built-in), or the own-model store ``root/own_models`` (an own network's fused models)."""
        if not self.is_own:
            from peer.nn.store import load_model

            return load_model(root / "rounds" / "models", name).arrays
        from peer.nn.imported import load_imported

        return dict(load_imported(root / OWN_MODELS, name).arrays)

    def oracle_fuse(self, own: Mapping[str, Any], others: Sequence[Mapping[str, Any]], probe, weights):
        """NON-PRIVATE: α-fusion of the exact models, aligned on the exact features of ``probe``:
        graph matching (built-in) or group activation matching (own network)."""
        from peer.ldp.fusion import average_arrays
        from peer.ldp.pipeline import align, align_groups, average_states

        if not self.is_own:
            from peer.nn.graph import extract_graph

            arch = self.architecture
            g_own = extract_graph(arch, self.module(own), probe)
            aligned = [align(arch, g_own, extract_graph(arch, self.module(o), probe), o)[0] for o in others]
            return average_arrays([own, *aligned], weights)
        mine, px = self.module(own), self.inputs(probe)
        aligned = [align_groups(self.structure, mine, self.module(o), px).apply(self.structure, o) for o in others]
        return average_states(self.structure, [own, *aligned], weights)


def as_network(architecture: Mapping[str, Any] | Network) -> Network:
    return architecture if isinstance(architecture, Network) else Network.builtin(architecture)
