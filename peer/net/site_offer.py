"""What a site offers and where its noise comes from: its models (built-in and its own networks),
pools and their selection, the public activation range, and its randomness. Mixed into
``peer.net.site.Site``, which loads the state read here (``models``, ``imported``, ``pools``,
``config``, the validation splits, the master seed)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load_file

from peer.base.errors import FailedPrecondition, InvalidArgument, NotFound, Unsupported
from peer.base.records import FIXED_SEED_WARNING, ReleaseRecord
from peer.base.rng import Randomness, make_randomness


def load_probe(path: Path) -> np.ndarray:
    """A site's public probe set: the tensor ``x`` of a safetensors file, finite values only."""
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise InvalidArgument("site.probe", f"{path} is not a readable safetensors file: {e}") from None
    if "x" not in tensors:
        raise InvalidArgument("site.probe", f"{path} must hold the probe inputs as tensor 'x'")
    x = tensors["x"]
    if not np.all(np.isfinite(x)):
        raise InvalidArgument("site.probe", "contains NaN or infinite values")
    return x


class SiteOffer:
    """The models, pools and randomness a site serves from (see the module docstring)."""

    # ---- what is offered ----------------------------------------------------------------------

    def model(self, name: str, field_name: str = "model", own: bool = False):
        """The model ``name`` on offer: a built-in ``StoredModel`` or, with ``own`` (the
        releases that work per permutation group: ReleaseFeatures, ReleaseWeights), a site's
        own network (``peer.nn.imported.ImportedModel``)."""
        if not name:
            raise InvalidArgument(field_name, "is required")
        m = self.models.get(name)
        if m is None:
            if name in self.imported:
                if own:
                    return self.imported[name]
                raise FailedPrecondition(
                    f"{field_name}: {name!r} is a site's own network: it is released by ReleaseFeatures and "
                    "ReleaseWeights (method ldp) or through its DP pools (method merged), not by this call",
                    reason="MODEL_KIND_UNSUPPORTED",
                    metadata={"field": field_name},
                )
            raise NotFound(
                f"{field_name}: {self.name!r} offers no model {name!r}",
                reason="MODEL_NOT_FOUND",
                metadata={"field": field_name},
            )
        return m

    @staticmethod
    def architecture_of(model) -> Mapping[str, Any]:
        """The public architecture a release of ``model`` carries (an own network's: its traced
        structure and digest, never its code): the model store's ``release_architecture``."""
        return model.release_architecture

    def own_module(self, own):
        """A fresh instance of a site's own network holding its stored state (built by the
        site's factory: site code, run here only; fresh per release, as a release hooks it)."""
        from peer.nn.imported import load_factory, module_from_arrays

        factories = self.__dict__.setdefault("_own_factories", {})
        if own.factory not in factories:
            base = self.config.path.resolve().parent if self.config.path else self.config.models.parent
            try:
                factories[own.factory] = load_factory(own.factory, [base])
            except InvalidArgument as e:
                raise FailedPrecondition(
                    f"model: {own.name!r}'s factory cannot be loaded at this site: {e}; nothing was charged",
                    reason="MODEL_FACTORY_UNAVAILABLE",
                ) from None
        try:
            return module_from_arrays(factories[own.factory], own.structure, own.arrays)
        except Unsupported as e:  # the site's module itself (aliased keys): not the caller's fault
            raise FailedPrecondition(
                f"model: {own.name!r} cannot be released: {e}; nothing was charged", reason="MODEL_MODULE_FAILED"
            ) from None

    def pool(self, name: str):
        """The pool's models (``peer.dp.merging.PoolModel``)."""
        if not name:
            raise InvalidArgument("pool", "is required")
        p = self.pools.get(name)
        if p is None:
            raise NotFound(
                f"pool: {self.name!r} has no pool {name!r}", reason="POOL_NOT_FOUND", metadata={"field": "pool"}
            )
        return p

    def pool_validation(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        return self._validation[name]

    def rs_utilities(self, name: str) -> list[float]:
        return self._rs_utilities[name]

    def pool_selection(self, name: str) -> str:
        """How merges of pool ``name`` choose π / λ: "public-prior" (default) or "utility"."""
        return self.config.pool_selection.get(name, "public-prior")

    def activation_clip(self, requested: tuple[float, float] | None = None) -> tuple[float, float] | None:
        """The public activation range: the caller's (checked by the service), else the site's
        default (None: the mechanism's own default, which exists only for bounded activations)."""
        return requested if requested is not None else self.config.activation_clip

    def randomness_mechanism(self) -> str:
        """Where this site's noise comes from, as listed in PeerInfo.mechanisms (no proto field
        needed): ``"randomness:csprng"`` or ``"randomness:fixed-seed (fixed seed: not private)"``."""
        if self._master is None:
            return "randomness:csprng"
        return f"randomness:fixed-seed ({FIXED_SEED_WARNING})"

    def randomness(self) -> Randomness | None:
        """Fresh CSPRNG noise per release; with a configured seed, the next child stream of it."""
        if self._master is None:
            return make_randomness()
        with self._master_lock:
            return self._master.spawn()

    def check_randomness(self, record: ReleaseRecord, what: str) -> None:
        """Refuse (FailedPrecondition, nothing charged) a data-level release whose record says
        it was trained or drawn with a fixed seed — a pool model of ``pool train --seed``, a
        segment of a simulation — unless this site is a simulation (``peer serve --simulation``):
        anyone who knows the seed reproduces the noise."""
        if self.simulation:
            return
        fixed = [r for r in (record, *record.components) if r.randomness == "fixed-seed"]
        if fixed:
            raise FailedPrecondition(
                f"{what} was trained or drawn with a fixed noise seed (seed {fixed[0].seed}: {FIXED_SEED_WARNING}); "
                "a daemon started without --simulation does not serve it",
                reason="FIXED_SEED_NOT_SERVED",
            )
