"""What a training step keeps for its backward pass: `python -m pytest tests/test_model_memory.py`.

At ml-20m's batch of 2^20 the saved activations are the largest thing on the GPU
(docs/gpu-memory.md). The training path saves each MLP layer's dropout output only (not the
ReLU's output and the mask as well), and computes what the plain nn.Sequential computes.
"""

from __future__ import annotations

import pytest
import torch

from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = ModelConfig(kind="neumf", n_users=30, n_items=40, factors=4, layers=(16, 32, 16, 8),
                      dropout=0.4)  # fmt: skip
    return build_model(cfg).train()


def _saved_bytes(fn: object) -> int:
    """Bytes of the distinct tensors autograd saves while `fn()` runs its forward pass."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()  # type: ignore[operator]
    return sum(seen.values())


def test_training_mlp_saves_only_the_dropout_outputs() -> None:
    model = _model()
    h = torch.randn(500, 32, requires_grad=True)  # h * 1: a pre-activation, as in forward()
    head = torch.randn(8, 1, requires_grad=True)  # a consumer that saves the last output
    fused = _saved_bytes(lambda: model.mlp_tower.hidden(h * 1) @ head)
    plain = _saved_bytes(lambda: model.mlp(h * 1) @ head)
    # Widths 32, 16, 8: plain also keeps each ReLU's output (4 B an element) and dropout's
    # mask (a float tensor on the CPU, 4 B; a bool on CUDA); both keep the dropout outputs.
    assert plain - fused == 500 * (32 + 16 + 8) * (4 + 4)


def test_training_mlp_computes_what_the_plain_layers_do() -> None:
    model = _model()
    h = torch.randn(64, 32, dtype=torch.float64)
    model.double()
    grads = []
    outs = []
    for fn in (model.mlp_tower.hidden, model.mlp):
        x = h.clone().requires_grad_(True)
        torch.manual_seed(5)  # the same dropout draws
        y = fn(x * 1)
        (y * torch.linspace(-1, 1, y.numel(), dtype=torch.float64).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([x.grad, *(p.grad.clone() for p in model.mlp.parameters())])
        model.zero_grad(set_to_none=True)
    assert torch.equal(outs[0], outs[1])
    assert (outs[0] == 0).float().mean() > 0.3  # dropout and ReLU both cut
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("training", [True, False])
def test_eval_and_dropout_free_models_use_the_plain_layers(training: bool) -> None:
    model = _model().train(training)
    h = torch.randn(8, 32)
    torch.manual_seed(1)
    a = model.mlp_tower.hidden(h)
    torch.manual_seed(1)
    assert torch.equal(a, model.mlp(h))
