"""DDP's "Expected to have finished reduction in the prior iteration" said with the parameters' names.

DDP without ``find_unused_parameters`` waits for a gradient of every trainable parameter; a step that leaves one
out (a layer skipped at random, a branch the data did not take) fails the step after, with a message of several
paragraphs that names parameters by index only. Where a step raises it, the dry-run reports the names instead
(DDP's indices count the wrapped module's trainable parameters in ``named_parameters`` order) and the fix.
"""

from __future__ import annotations

import re

from torch import nn
from torch.nn.parallel import DistributedDataParallel

_SIGNATURE = "Expected to have finished reduction in the prior iteration"
_INDICES = re.compile(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)")


class UnusedGradientError(RuntimeError):
    """DDP's unused-parameter failure, said with the names of the parameters that got no gradient."""


def explain_unused_gradients(exc: BaseException, model: object) -> BaseException:
    """``exc`` as an ``UnusedGradientError`` naming the parameters, where it is DDP's unused-parameter failure and
    ``model`` holds the DDP module; otherwise ``exc`` itself."""
    if _SIGNATURE not in str(exc) or not isinstance(model, nn.Module):
        return exc
    ddp = next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)
    match = _INDICES.search(str(exc))
    names: list[str] = []
    if ddp is not None and match:
        ignored = getattr(ddp.module, "_ddp_params_and_buffers_to_ignore", ())
        trainable = [name for name, p in ddp.module.named_parameters() if p.requires_grad and name not in ignored]
        names = [trainable[i] for i in map(int, match.group(1).split()) if i < len(trainable)]
    # the fix first: a failure's reason is cut at its first 500 characters, and the names can be long
    shown = ", ".join(repr(n) for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    error = UnusedGradientError(
        "a step left trainable parameters without gradient, and DDP without find_unused_parameters waits for "
        "every one ('Expected to have finished reduction in the prior iteration'): pass find_unused_parameters=True, "
        "or freeze what is not trained (module.requires_grad_(False)); the model leaves parameters out of some "
        "steps (a layer skipped at random such as config.layerdrop, a branch the data decides, an output the loss "
        f"leaves out){': ' + shown if names else ''}")
    error.__cause__ = exc
    return error
