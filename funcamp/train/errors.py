"""What a train step that fails to compile says: one paragraph, with dynamo's report below it.

The paragraph says what failed, where in the user's code, and the option that gets round it. A
compile failure the user can cause in their own model comes in a few kinds, each with its own
way out:

* a call dynamo cannot trace (a graph break);
* a Python branch on a tensor's value (a data-dependent guard);
* an op that fails on fake tensors although it runs eagerly;
* a failure of the compiler backend itself.

The step first re-runs eagerly. An error there is the model's own, and is raised plainly instead
(see ``make_train_step``).

Workaround of torch internals (docs/upstream.md#errors):

- Root cause: dynamo's failures are exceptions whose only stable description is their text.
- Upstream: none; see docs/upstream.md#errors.
- Why it is safe: an unmatched error is raised as it came, with dynamo's report chained; only
  the added paragraph depends on the text.
- Tested on: torch 2.13 and 2.14.
- Delete when: dynamo's exceptions carry a machine-readable kind (graph break, data-dependent
  guard, fake-tensor failure).

"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

__all__ = [
    "breaks_graph",
    "compile_failure_message",
    "explain",
    "graph_break_notice",
    "refuses_torch_func",
    "user_frame",
]

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
# funcamp's own package root (not funcamp/train: amp and the tree helpers run inside the trace too)
_FUNCAMP_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_STDLIB_DIR = os.path.dirname(os.path.abspath(os.__file__))
_LIBRARY_DIRS = (_TORCH_DIR + os.sep, _FUNCAMP_DIR + os.sep)
_INSTALLED = {"site-packages", "dist-packages"}  # under the stdlib's directory, not the stdlib

#: What functorch says of an autograd function it cannot differentiate (torch 2.6-2.13): an
#: ``autograd.Function`` written the old way, which is also how torch runs the formula of a
#: ``torch.library.custom_op`` given ``register_autograd`` (Hugging Face's MoE ``grouped_mm``).
#: And activation checkpointing (``torch.utils.checkpoint``), whose saved-tensor hooks torch.func
#: does not support (pytorch issues 122729, 141845, 146036).
_TORCH_FUNC_REFUSALS = (
    "must override the setup_context staticmethod",
    "don't yet support saved tensor hooks",
    "call requires_grad_() outside of a function being transformed",
)


def refuses_torch_func(error: BaseException) -> bool:
    """Whether ``torch.func`` refused to differentiate the model (``_TORCH_FUNC_REFUSALS``)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(refusal in str(error) for refusal in _TORCH_FUNC_REFUSALS):
            return True
        error = error.__cause__ or error.__context__
    return False


def _library(filename: str) -> bool:
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    if path.startswith(_LIBRARY_DIRS):
        return True
    return path.startswith(_STDLIB_DIR + os.sep) and not _INSTALLED & set(path.split(os.sep))


def user_frame(error: BaseException) -> str:
    """The innermost frame of the user's code that dynamo was tracing when it failed.

    User code is their model, loss function or a library model (such as ``transformers``'). The
    frame reads ``File "...", line N, in f: `code```; ``""`` when unknown.
    """
    stack = getattr(error, "real_stack", None) or []
    for frame in reversed(list(stack)):
        if not _library(frame.filename):
            line = (frame.line or "").strip()
            return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}' + (
                f": `{line}`" if line else ""
            )
    text = str(error)
    if "from user code:" in text:  # dynamo's own rendering of the same stack
        lines = text.split("from user code:", 1)[1].splitlines()
        frames = [i for i, line in enumerate(lines) if line.strip().startswith("File ")]
        for i in reversed(frames):
            where = lines[i].strip()
            filename = where.split('"')[1] if where.count('"') >= 2 else ""
            if filename and _library(filename):
                continue
            if i + 1 < len(lines) and lines[i + 1].strip():
                where += f": `{lines[i + 1].strip()}`"
            return where
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if not _library(frame.filename):
            return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}'
    return ""


def _reason(error: BaseException) -> str:
    text = str(error)
    start = text.find("Could not guard on data-dependent expression")
    if start >= 0:  # after dynamo's advice to annotate with torch._check
        end = min(
            i for i in (text.find(" (unhinted", start), text.find(".", start), len(text)) if i > 0
        )
        reason = text[start:end].strip()
        cause = text.find("Caused by: ")
        if cause >= 0:  # the branch: `code  # file:line in function (dynamo's frame)`
            line = text[cause + len("Caused by: ") :].splitlines()[0]
            code, _, where = line.partition("  # ")
            reason += f", at `{code.strip()}` ({where.split(' (')[0].strip()})"
        return reason
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    context = [x for x in lines if x.startswith("Developer debug context: ")]
    detail = context[0].split(": ", 1)[1] if context else ""
    return lines[0] + (f": {detail}" if detail and len(detail) <= 80 else "")


_PIECES = (
    "build the step with `compile=funcamp.Compile(fullgraph=False)` (compiled in pieces "
    "around it, gradients by torch.autograd) or `compile=False` (eager)"
)
_AUTO = (
    "build the step with `compile=True` (fullgraph='auto', the default: the loss compiled in "
    "pieces around it with gradients by torch.autograd, the update one graph) or "
    "`compile=False` (eager)"
)
_BREAKS = {
    "data": "a Python branch on a tensor's value",
    "call": "a call dynamo cannot trace",
}


def _kind(error: BaseException) -> tuple[str, str]:
    """``(what failed, the way out)`` for this kind of failure."""
    exc = torch._dynamo.exc
    text = str(error)
    if isinstance(error, exc.UserError) and "data-dependent" in text:
        return (
            "a Python branch on a tensor's value (`.item()`, `bool(tensor)`, `if tensor:` or "
            "a shape computed from values), which one graph cannot hold: the branch taken "
            "would be fixed when the step is traced",
            "compute both sides and select with `torch.where` (or `torch.cond`), keep the "
            f"branch out of the model's forward, or {_AUTO}",
        )
    if isinstance(error, exc.Unsupported):
        return (
            "a call torch.compile(fullgraph=True) cannot trace (a graph break)",
            "change that call in your model or loss_fn (for Hugging Face models see "
            "docs/guides/transformers.md, e.g. `model.loss_type = ...`), or " + _AUTO,
        )
    if isinstance(error, exc.BackendCompilerFailed):
        return (
            "the compiler backend failed on the traced step (the trace itself succeeded)",
            "build the step with `compile=funcamp.Compile(backend='aot_eager')` (traced and "
            "differentiated as one graph, no code generation) or `compile=False`, and report "
            "the backend failure to PyTorch with the report below",
        )
    if isinstance(error, exc.TorchRuntimeError):
        return (
            "an op failed on the fake tensors dynamo traces with, although the same step runs "
            "eagerly",
            _PIECES[0].upper() + _PIECES[1:],
        )
    return ("dynamo failed while compiling the step", _PIECES[0].upper() + _PIECES[1:])


def breaks_graph(error: BaseException) -> bool:
    """Whether ``error`` is a failure that ``fullgraph=False`` compiles around: a call dynamo
    cannot trace (an RNN module, an unsupported call) or a branch on a tensor's value."""
    exc = torch._dynamo.exc
    if isinstance(error, exc.UserError):
        return "data-dependent" in str(error)
    return isinstance(error, exc.Unsupported)


def graph_break_notice(api: str, error: BaseException, what: str, subject: str = "the loss") -> str:
    """What a step says once when ``subject`` cannot be one graph and it compiles ``what``."""
    kind = _BREAKS["data" if isinstance(error, torch._dynamo.exc.UserError) else "call"]
    where = user_frame(error)
    return (
        f"funcamp.{api}: {subject} cannot be one graph: {kind} ({_reason(error)}) "
        f"{'at ' + where if where else '(where: not known)'}; {what}. "
        "compile=funcamp.Compile(fullgraph=True) refuses it instead"
    )


def compile_failure_message(api: str, error: BaseException) -> str:
    """One paragraph for a compile failure the eager step does not have: what, where, how out."""
    what, fix = _kind(error)
    where = user_frame(error)
    return (
        f"funcamp.{api}: the step cannot be compiled as one graph. What: {what} "
        f"({_reason(error)}). Where: {where or 'not known (see the report below)'}. The step "
        f"runs eagerly, so the model itself is correct. Way out: {fix}. dynamo's own report is "
        "chained below."
    )


def explain(api: str, error: BaseException, rerun: Any) -> BaseException:
    """The exception to raise for ``error``, a dynamo failure of a compiled step.

    ``rerun()`` runs the step eagerly, and raises the model's own error plainly if it has one.
    Else it is the one paragraph of :func:`compile_failure_message`, chained to ``error``.
    """
    rerun()
    failure = RuntimeError(compile_failure_message(api, error))
    failure.__cause__ = error
    return failure
