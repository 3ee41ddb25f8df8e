"""A deprecation our own code causes is attributed to our own code, so that pyproject's
filterwarnings (``error::FutureWarning:<our modules>``) fail the test that causes it.

A filterwarnings entry's module field matches the module a warning is attributed to: the
frame its ``stacklevel`` names. Libraries name the wrong frame for some of the calls we
make. transformers' renamed-argument warning (``past_key_values`` -> ``cache``) names the
caller of the model's ``forward``, which is torch's ``Module.__call__``, not the code that
called the model; a deprecated property warns with stacklevel 1 and names itself. So the
warning that ``model(..., past_key_values=...)`` in specmesh/engine/model_engine.py raised read as
torch's, and a filter on our modules never saw it.

``install`` puts a hook where the interpreter hands a warning that passed the filters to
be shown (``warnings._showwarnmsg``), while the warning's stack is still live. For a
DeprecationWarning or FutureWarning attributed to a library frame, the hook finds who
used the deprecated thing: the attributed frame (or, where the emitter named itself, its
caller), then outward past frames that only pass a call through (torch's module call,
torch's no_grad/inference_mode decorators, transformers' forward decorators, contextlib).
Where that is our code, the warning is issued again from there (``warn_explicit`` with
our file, line and module), and the filters decide: our modules' entries make it an
error, raised into the code that made the call. Everything else is shown as it came: a
library's own deprecations (peft reading transformers' deprecated
``is_gradient_checkpointing`` while we build a LoRA model) stay warnings.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from pathlib import Path
from types import FrameType

ROOT = str(Path(__file__).resolve().parents[1]) + os.sep
OUR_PACKAGES = frozenset({"specmesh", "draft_service", "target_service", "orchestrator"})
CATEGORIES = (DeprecationWarning, FutureWarning)

# Frames that only pass a call through to the function that warned.
_PASS_THROUGH = tuple(os.path.join(*path.split("/")) for path in (
    "torch/nn/modules/module.py",  # Module.__call__ -> forward
    "torch/utils/_contextlib.py",  # @torch.no_grad(), @torch.inference_mode()
    "transformers/utils/generic.py",  # @can_return_tuple, @check_model_inputs, ...
    "transformers/utils/deprecation.py",  # @deprecate_kwarg
    "transformers/utils/output_capturing.py",  # @capture_outputs
))
_STDLIB_PASS_THROUGH = frozenset({"contextlib.py", "functools.py"})

_local = threading.local()
_original = None


def ours(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    if filename.startswith(ROOT) and f"{os.sep}site-packages{os.sep}" not in filename:
        return True
    module = frame.f_globals.get("__name__") or ""
    return module.split(".", 1)[0] in OUR_PACKAGES


def _passes_through(frame: FrameType) -> bool:
    filename = frame.f_code.co_filename
    if filename.endswith(_PASS_THROUGH):
        return True
    return (os.path.basename(filename) in _STDLIB_PASS_THROUGH
            and os.path.dirname(filename) == os.path.dirname(os.__file__))


def user_frame(message: warnings.WarningMessage, innermost: FrameType | None) -> FrameType | None:
    """Our frame that used what `message` deprecates, where the library attributed it elsewhere."""
    frames = []
    while innermost is not None:
        frames.append(innermost)
        innermost = innermost.f_back
    for index, frame in enumerate(frames):
        if frame.f_code.co_filename == message.filename and frame.f_lineno == message.lineno:
            break
    else:
        return None
    if ours(frames[index]):
        return None  # attributed to us already: the filters see our module
    if index == 0:
        index = 1  # the emitter named its own frame (stacklevel 1): the user is its caller
    while index < len(frames) and _passes_through(frames[index]):
        index += 1
    return frames[index] if index < len(frames) and ours(frames[index]) else None


def _showwarnmsg(message: warnings.WarningMessage) -> None:
    if getattr(_local, "reissuing", False) or not issubclass(message.category, CATEGORIES):
        return _original(message)
    # Called by the interpreter's warn: the first frame outside the warnings module is the code
    # that called warnings.warn (or the C function that warned).
    innermost = sys._getframe(1)
    while innermost is not None and innermost.f_globals.get("__name__") in ("warnings", "_py_warnings"):
        innermost = innermost.f_back
    frame = user_frame(message, innermost)
    if frame is None:
        return _original(message)
    _local.reissuing = True
    try:
        warnings.warn_explicit(message.message, message.category, frame.f_code.co_filename, frame.f_lineno,
                               module=frame.f_globals.get("__name__"), source=message.source)
    finally:
        _local.reissuing = False


def install() -> None:
    global _original
    if _original is None and hasattr(warnings, "_showwarnmsg"):
        _original = warnings._showwarnmsg
        warnings._showwarnmsg = _showwarnmsg


def uninstall() -> None:
    global _original
    if _original is not None:
        warnings._showwarnmsg = _original
        _original = None
