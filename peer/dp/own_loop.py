"""A site's own training loop around our DP-SGD step.

A site names a training function (``[round.iterate] train = "MODULE:FUNCTION"``, its own code,
run only at that site, loaded like a model factory: ``peer.nn.imported.load_factory``). It is
called once per segment as ``FUNCTION(model, records, step)``:

- ``model``: the segment's ``torch.nn.Module``, holding the start θ_0 of the segment;
- ``records``: :class:`SiteRecords`, copies of the site's own prepared inputs ``x`` and labels
  ``y`` (the step object keeps its own, so changing them changes nothing it computes);
- ``step``: a :class:`DPStep`. Each call ``step(transform, loss, learning_rate)`` is one DP-SGD
  step, exactly the built-in loop's (``peer.dp.training.take_step``, the same code)::

      (z_t, B_t) = draw_step(generator, θ_t, n, q)          # ours: noise, then Poisson batch
      θ_{t+1} = θ_t − η_t · ( Σ_{i ∈ B_t} clip_C(∇_θ ℓ(θ_t; transform(x_i), y_i)) + σ C z_t ) / (q n)
      ℓ(θ; x, y) = loss(model_θ(x[None]), y[None])            # the site's per-example loss

  The site chooses ``transform`` (its augmentation, applied record by record to the batch's
  inputs: each call sees one record's input and returns one input of the same shape),
  ``loss`` (its own loss of (outputs, labels) for one record: e.g. cross-entropy with label
  smoothing; default cross-entropy); ``learning_rate`` η_t is the plan's, declared in the
  round file (``learning_rate`` or ``learning_rate_schedule``; ``step.learning_rate`` reads it,
  and a different value is refused). We choose B_t (full batch, or Poisson at rate q), the clip norm C,
  σ and z_t, all drawn from the segment's generator (CSPRNG-seeded) in the built-in loop's
  order, so with the identity transform, cross-entropy and the config's η the own loop computes
  the built-in loop's θ bit for bit from the same generator.

**Why per record.** Per-example clipping bounds the sensitivity only if record i's clipped
gradient depends on record i alone. ``transform`` and ``loss`` are therefore evaluated one
record at a time (an augmentation across the batch — mixup, batch statistics — would let one
record move another's gradient). The learning rate scales noise and sensitivity alike, so ε
does not depend on it, but it shapes the release: a rate chosen by the site's code could depend
on the records, outside the guarantee. So it is declared with the plan (public, like σ, C, q),
the step object refuses any other, and the record lists each step's η_t.

**What is released and charged.** Exactly the configured steps must be taken: a call beyond
them is refused by the step object, fewer are refused when the function returns. The released
parameters are the step object's own copy θ_T; the module's parameters must equal it when the
function returns (a change outside the step — an optimiser of the site's own, an edit — would
be released without noise: refused). Every refusal happens before any record is built, so
nothing is charged or released. The record (:func:`OwnLoopRun.training`) has the plan's steps
(σ, C, q, count) with the η_t taken, so its accountant call — and the charge — is the built-in
loop's. The unit of privacy is one of the site's training records under the plan's adjacency.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peer.base.errors import InvalidArgument
from peer.base.rng import Randomness
from peer.dp.accounting import TrainingRecord
from peer.dp.accounting.training_records import SGD, GaussianStep
from peer.dp.training import draw_step, module_loss, take_step

__all__ = ["DPStep", "OwnLoopRun", "SiteRecords", "run_own_loop"]

#: (model, records, step) -> anything (the return value is ignored)
TrainFn = Callable[[torch.nn.Module, "SiteRecords", "DPStep"], object]
#: one record's input -> one input of the same shape
Transform = Callable[[torch.Tensor], torch.Tensor]
#: (outputs of one record, its label) -> scalar loss
Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SiteRecords:
    """The site's own prepared records as its training function sees them (copies)."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True)
class OwnLoopRun:
    """What a site's own loop released: the step object's θ_T and the steps as taken."""

    params: dict[str, torch.Tensor]
    training: TrainingRecord


def _per_record(transform: Transform, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The batch's inputs with ``transform`` applied to each record on its own."""

    def apply(batch: torch.Tensor) -> torch.Tensor:
        if batch.shape[0] == 0:
            return batch
        rows = []
        for row in batch:
            try:
                out = transform(row.clone())
            except Exception as e:  # the site's code: refused with its reason
                raise InvalidArgument(field, f"the transform raised {type(e).__name__}: {e}") from None
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(row.shape):
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise InvalidArgument(
                    field,
                    f"the transform must return one record's input as a tensor of shape {tuple(row.shape)} "
                    f"(it is applied record by record), got {got}",
                )
            rows.append(out.detach().to(batch.dtype))
        return torch.stack(rows)

    return apply


def _scalar_loss(loss: Loss, field: str) -> Loss:
    """``loss`` checked to give one number per record (a one-element tensor is taken as it)."""

    def checked(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        value = loss(outputs, labels)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise InvalidArgument(
                field, f"the loss must return one number for one record's (outputs, labels), got {got}"
            )
        return value.reshape(())

    return checked


def _same_rate(given: object, declared: float) -> bool:
    """``given`` is the declared η (to 1e-12 relative: a schedule recomputed in the site's code
    may round differently)."""
    try:
        value = float(given)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return math.isfinite(value) and abs(value - declared) <= 1e-12 * abs(declared)


class DPStep:
    """The DP step object a site's training function calls (module docstring): ``step(transform,
    loss, learning_rate)`` takes the next of the plan's ``steps`` steps; ``taken`` counts them.
    It keeps its own copy of the parameters, writes each new θ into the module (so the site's
    code sees the current iterate) and refuses a call beyond the plan. ``field`` is the config
    key every refusal names."""

    def __init__(
        self,
        module: torch.nn.Module,
        x: torch.Tensor,
        y: torch.Tensor,
        training: TrainingRecord,
        *,
        randomness: Randomness,
        dataset_size: int,
        field: str = "train",
    ):
        if training.optimizer != SGD:
            raise InvalidArgument(field, "a site's own loop takes plain DP-SGD steps (the plan's optimizer is not sgd)")
        self._module = module
        self._mode = module.training
        self._x, self._y = x, y
        self._plan = training.steps
        self._generator = randomness.generator
        self._n = int(dataset_size)
        self._field = field
        self._params = {k: v.detach().clone() for k, v in module.named_parameters()}
        self._taken: list[GaussianStep] = []
        self._refusal: InvalidArgument | None = None

    @property
    def steps(self) -> int:
        """How many steps the segment takes (``local_steps``): exactly these, no more, no fewer."""
        return len(self._plan)

    @property
    def taken(self) -> int:
        return len(self._taken)

    @property
    def learning_rate(self) -> float | None:
        """η of the next step, as the plan declares it (None once every step is taken)."""
        t = len(self._taken)
        return self._plan[t].learning_rate if t < len(self._plan) else None

    def parameters(self) -> dict[str, torch.Tensor]:
        """A copy of the current iterate θ_t (the step object's own)."""
        return {k: v.clone() for k, v in self._params.items()}

    def _refuse(self, rule: str) -> InvalidArgument:
        self._refusal = self._refusal or InvalidArgument(self._field, rule)
        return InvalidArgument(self._field, rule)

    def __call__(
        self, transform: Transform | None = None, loss: Loss | None = None, learning_rate: float | None = None
    ) -> None:
        t = len(self._taken)
        if t >= len(self._plan):
            raise self._refuse(
                f"step() was called for step {t + 1}, but the segment has exactly {len(self._plan)} steps "
                "(round.iterate.local_steps): the extra step is refused, and nothing of this segment is charged "
                "or released"
            )
        s = self._plan[t]
        if learning_rate is not None and not _same_rate(learning_rate, s.learning_rate):
            raise self._refuse(
                f"step {t + 1}: learning_rate {learning_rate!r} is not the declared {s.learning_rate!r}: η shapes "
                "what is released, so it is public and declared with the plan (round.iterate.learning_rate, or "
                "round.iterate.learning_rate_schedule for one per step); read it as step.learning_rate"
            )
        inputs = None if transform is None else _per_record(transform, self._field)
        per_example = torch.nn.functional.cross_entropy if loss is None else _scalar_loss(loss, self._field)
        noise, sampled = draw_step(self._generator, self._params, int(self._x.shape[0]), s.sample_rate)
        mode = self._module.training
        self._module.train(self._mode)  # the mode the segment started in, whatever the site's code set
        try:
            new = take_step(
                module_loss(self._module, per_example), self._params, self._x, self._y, s,
                dataset_size=self._n, noise=noise, sampled=sampled, inputs=inputs,
            )  # fmt: skip
        except InvalidArgument as e:
            raise self._refuse(f"step {t + 1}: {e.rule}") from None
        except Exception as e:  # the site's loss failed under per-example gradients
            raise self._refuse(
                f"step {t + 1}: the loss failed under per-example gradients (torch.func.vmap over one record "
                f"at a time): {type(e).__name__}: {e}"
            ) from None
        finally:
            self._module.train(mode)
        self._params = {k: v.detach() for k, v in new.items()}
        with torch.no_grad():
            for k, p in self._module.named_parameters():
                p.copy_(self._params[k])
        self._taken.append(s)

    def released(self, adjacency: str) -> OwnLoopRun:
        """θ_T and the record of the steps taken, after the function returned; refused (naming
        the field) when a step was refused, the count is not the plan's, or the module's
        parameters are not the step object's."""
        if self._refusal is not None:
            raise InvalidArgument(self._field, f"{self._refusal.rule} (the training function went on after it)")
        if len(self._taken) != len(self._plan):
            raise InvalidArgument(
                self._field,
                f"the training function took {len(self._taken)} DP steps; the segment has exactly {len(self._plan)} "
                "(round.iterate.local_steps): refused before anything is charged or released",
            )
        theirs = dict(self._module.named_parameters())
        if set(theirs) != set(self._params):
            raise InvalidArgument(
                self._field,
                f"the module's parameters are now {sorted(theirs)}, not the segment's {sorted(self._params)}",
            )
        changed = [k for k, p in theirs.items() if not torch.equal(p.detach(), self._params[k])]
        if changed:
            raise InvalidArgument(
                self._field,
                f"the training function changed the module's parameters {changed} outside step(): the segment "
                "releases only what the DP steps produced; refused before anything is charged or released",
            )
        training = TrainingRecord(adjacency, tuple(self._taken))
        return OwnLoopRun({k: v.clone() for k, v in self._params.items()}, training)


def run_own_loop(
    train: TrainFn,
    module: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    training: TrainingRecord,
    *,
    randomness: Randomness,
    dataset_size: int,
    field: str = "train",
    name: str = "the training function",
) -> OwnLoopRun:
    """One segment by the site's own loop ``train(module, SiteRecords(x, y), step)`` (module
    docstring): the plan ``training`` (its σ, C, q per step and count; η its default learning
    rate), noise and batches from ``randomness``, denominator q·``dataset_size``. Returns the
    step object's θ_T with the record of the steps taken; InvalidArgument naming ``field`` for
    every refusal (the function raised, a step refused, a wrong count, parameters changed
    outside the step), always before anything is charged."""
    if not callable(train):
        raise InvalidArgument(field, f"{name} is not callable")
    if not training.steps:
        raise InvalidArgument(field, "the plan has no steps")
    step = DPStep(module, x, y, training, randomness=randomness, dataset_size=dataset_size, field=field)
    try:
        train(module, SiteRecords(x.clone(), y.clone()), step)
    except InvalidArgument as e:
        if step._refusal is not None:  # ours, raised from step() through the site's code
            raise InvalidArgument(field, e.rule) from None
        raise InvalidArgument(field, f"{name} raised InvalidArgument: {e}") from None
    except Exception as e:  # the site's code failed: refused with its reason
        raise InvalidArgument(field, f"{name} raised {type(e).__name__}: {e}") from None
    return step.released(training.adjacency)
