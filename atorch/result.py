"""What ``auto_accelerate`` returns as ``result``: ATorch's six-field namedtuple, plus names ATorch lacks.

``model, optim, dataloader, loss_func, prepare_input, args = result`` works as ATorch documents; the LR
scheduler is an attribute (``result.lr_scheduler``), not a seventh field, so that unpacking stays six-way.
A result with ``status`` False (the automatic search found no strategy) holds ``None`` in every field and
says why in ``result.reason`` / ``result.problems``.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

RESULT_FIELDS = ("model", "optim", "dataloader", "loss_func", "prepare_input", "args")  # ATorch's order


class AccelerateResult(namedtuple("AccelerateResult", RESULT_FIELDS)):
    """ATorch's result namedtuple ``(model, optim, dataloader, loss_func, prepare_input, args)``, plus
    ``lr_scheduler`` (by name only), ``problems`` / ``reason`` (why status is False; empty on success) and
    ``close()``: release everything it holds.

    ``with auto_accelerate(...)[1] as result:`` closes it at the end of the block. Dropping every
    reference to a result also frees it; ``close()`` does so at once, even while other references
    to its parts remain (a trial of the search, a notebook cell).
    """

    # Not tuple fields: defaults here, per-result values in the instance's __dict__ (a namedtuple
    # subclass without __slots__ has one), so that unpacking and len() stay ATorch's six.
    lr_scheduler: Any = None
    problems: tuple[str, ...] = ()

    def __new__(cls, model: Any = None, optim: Any = None, dataloader: Any = None, loss_func: Any = None,
                prepare_input: Any = None, args: Any = None, *, lr_scheduler: Any = None,
                problems: list[str] | tuple[str, ...] = ()) -> AccelerateResult:
        self = super().__new__(cls, model, optim, dataloader, loss_func, prepare_input, args)
        self.__dict__.update(lr_scheduler=lr_scheduler, problems=tuple(problems))
        return self

    @classmethod
    def failed(cls, problems: list[str]) -> AccelerateResult:
        """The result that goes with ``status`` False: nothing built, and why."""
        return cls(problems=problems)

    @property
    def reason(self) -> str | None:
        """Why nothing was built (status False), as one text; None on success."""
        return "\n".join(self.problems) if self.problems else None

    def _replace(self, **changes: Any) -> AccelerateResult:  # namedtuple's would drop lr_scheduler and problems
        extra = {k: changes.pop(k) for k in ("lr_scheduler", "problems") if k in changes}
        return type(self)(**{**self._asdict(), **changes}, **{**self.__dict__, **extra})

    def close(self) -> None:
        from atorch.lifecycle import release

        release(self)

    def __enter__(self) -> AccelerateResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
