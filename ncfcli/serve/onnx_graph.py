"""The ONNX graph of a trained model, built and checked: ncfcli/serve/onnx_export.py's first step.

Inputs `user`, `item` (int64 [batch], batch dynamic) and, in the session graph, `prev_item`;
output `logit` (float32 [batch]). What the graph holds besides the model (the order term's
latest items, the sequence term's per-user encoder states) is decided here; export.py checks
the graph against PyTorch and `ncf recommend` and writes the files.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path
from typing import Any

from ncfcli.errors import NcfError, first_line
from ncfcli.scoring.scorer import context_window

INPUTS = ("user", "item")
ORDER_INPUT = "prev_item"  # the session model's third input
OUTPUT = "logit"
STATE_USERS = 4096  # users whose encoder states are computed at once for the graph's table


def graph_inputs(session: bool) -> tuple[str, ...]:
    """The graph's input names: user and item; the session model's prev_item too."""
    return INPUTS + ((ORDER_INPUT,) if session else ())


def user_states(model: Any, windows: Any) -> Any:
    """The sequence term's state after each window (int64 [U, L]) -> float32 [U, width], in
    chunks of STATE_USERS (Sequence.scoring_states; the model in eval mode)."""
    import torch

    table = torch.as_tensor(windows, dtype=torch.int64)
    with torch.no_grad():
        parts = [
            model.sequence.scoring_states(table[lo : lo + STATE_USERS])
            for lo in range(0, table.shape[0], STATE_USERS)
        ]
    return torch.cat(parts).float()


def _onnx_module(model: Any, context: Any, session: bool) -> Any:
    """The module to export: (user [B], item [B]) -> logit [B], the user's context looked up
    inside: `context` int64 [n_users] (the order term's previous item; None: no order term) or
    [n_users, L] (the sequence term's windows: the graph holds each window's last item and the
    encoder's state after it); with `session`, (user, item, prev_item) -> logit."""
    import torch

    class Scorer(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
            return self.inner(user, item)

    class ContextScorer(Scorer):
        context: torch.Tensor  # int64 [n_users]: each user's context item

        def __init__(self, inner: torch.nn.Module, table: torch.Tensor) -> None:
            super().__init__(inner)
            self.register_buffer("context", table)  # an initializer of the graph

        def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
            return self.inner(user, item, self.context[user])

    class SessionScorer(Scorer):
        def forward(  # type: ignore[override]
            self, user: torch.Tensor, item: torch.Tensor, prev_item: torch.Tensor
        ) -> torch.Tensor:
            return self.inner(user, item, prev_item)

    class StateScorer(Scorer):
        last: torch.Tensor  # int64 [n_users]: each user's latest item (the order term's)
        states: torch.Tensor  # float32 [n_users, width]: the encoder's state after the window

        def __init__(self, inner: torch.nn.Module, windows: Any) -> None:
            super().__init__(inner)
            table = torch.as_tensor(windows, dtype=torch.int64)
            self.register_buffer("last", table[:, -1].contiguous())
            self.register_buffer("states", user_states(inner, table))

        def forward(self, user: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
            inner: Any = self.inner  # an NCF model
            return inner.with_states(user, item, self.last[user], self.states[user])

    if session:
        return SessionScorer(model).eval()
    if context is not None and len(getattr(context, "shape", ())) == 2:
        return StateScorer(model, context).eval()
    if context is not None:
        return ContextScorer(model, torch.as_tensor(context, dtype=torch.int64)).eval()
    return Scorer(model).eval()


def export_onnx(
    model: Any, path: Path, opset: int, context: Any = None, session: bool = False
) -> None:
    """Write `model` (on the CPU, eval mode) as a single-file ONNX graph with a dynamic batch:
    inputs user, item (the context item from `context` inside the graph), or with `session`
    user, item, prev_item."""
    import torch

    names = graph_inputs(session)
    module = _onnx_module(model, context, session)
    # torch.export specialises example dims of size 0 or 1 to constants; a batch of 2 and a
    # declared dynamic dim keep the graph batch-agnostic.
    example = tuple(torch.tensor([0, 1], dtype=torch.int64) for _ in names)
    length = context_window(model) or 0
    if session and length:  # the sequence term's window: [batch, L]
        example = (*example[:2], torch.zeros(2, length, dtype=torch.int64))
    batch = torch.export.Dim("batch")
    # The exporter reports progress with print() and warnings; the CLI's stdout is for results.
    with (
        contextlib.redirect_stdout(io.StringIO()),
        warnings.catch_warnings(),
        _quiet_loggers(),
    ):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            module,
            example,
            dynamo=True,
            dynamic_shapes=tuple({0: batch} for _ in names),
            input_names=list(names),
            output_names=[OUTPUT],
            opset_version=opset,
            external_data=False,
            verbose=False,
        )
        assert program is not None  # dynamo=True always returns an ONNXProgram
        program.save(str(path), external_data=False)


@contextlib.contextmanager
def _quiet_loggers() -> Any:
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lvl in zip(loggers, levels, strict=True):
            lg.setLevel(lvl)


def build(model: Any, path: Path, opset: int, context: Any, session: bool) -> None:
    """export_onnx, then onnx.checker; each failure one line."""
    import onnx

    try:
        export_onnx(model, path, opset, context, session)
    except (NcfError, OSError):  # a full disk, a folder gone: the caller's one line names it
        raise
    except Exception as e:  # exporter failures are long; the first line says enough
        raise NcfError(f"ONNX export failed: {first_line(e)}") from None
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except Exception as e:
        raise NcfError(f"onnx.checker rejected the exported model: {e}") from None
