"""What a checkpoint holds stays what it held: `python -m pytest tests/test_model_keys.py`.

Run directories written by earlier versions load by key name (checkpoint, export, recommend,
refit and the pretrained towers read weights by name), and a seed must keep giving the same
weights. KEYS is the state_dict of every kind, with and without the order term (and `mf` with
its biases), as the single-file model.py wrote it before the model became a package.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ncfcli.model.config import ModelConfig
from ncfcli.model.neumf import build_model

SHAPE = {"n_users": 7, "n_items": 11, "factors": 5}

# (kind, order_factors, layers): [(key, shape), ...] in state_dict order.
KEYS: dict[tuple[str, int, tuple[int, ...]], list[tuple[str, tuple[int, ...]]]] = {
    ("mf", 0, (16, 8, 4)): [
        ("global_bias", (1,)),
        ("user_gmf.weight", (7, 5)),
        ("item_gmf.weight", (11, 5)),
        ("user_bias.weight", (7, 1)),
        ("item_bias.weight", (11, 1)),
    ],
    ("mf", 3, (16, 8, 4)): [
        ("global_bias", (1,)),
        ("user_gmf.weight", (7, 5)),
        ("item_gmf.weight", (11, 5)),
        ("prev_item.weight", (12, 3)),
        ("next_item.weight", (11, 3)),
        ("user_bias.weight", (7, 1)),
        ("item_bias.weight", (11, 1)),
    ],
    ("gmf", 0, (16, 8, 4)): [
        ("user_gmf.weight", (7, 5)),
        ("item_gmf.weight", (11, 5)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 5)),
    ],
    ("gmf", 3, (16, 8, 4)): [
        ("user_gmf.weight", (7, 5)),
        ("item_gmf.weight", (11, 5)),
        ("prev_item.weight", (12, 3)),
        ("next_item.weight", (11, 3)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 5)),
    ],
    ("mlp", 0, (16, 8, 4)): [
        ("user_mlp.weight", (7, 8)),
        ("item_mlp.weight", (11, 8)),
        ("mlp_in.bias", (8,)),
        ("mlp_in.weights.0", (8, 8)),
        ("mlp_in.weights.1", (8, 8)),
        ("mlp.2.weight", (4, 8)),
        ("mlp.2.bias", (4,)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 4)),
    ],
    ("mlp", 0, (8,)): [
        ("user_mlp.weight", (7, 4)),
        ("item_mlp.weight", (11, 4)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 4)),
        ("head.weights.1", (1, 4)),
    ],
    ("mlp", 3, (16, 8, 4)): [
        ("user_mlp.weight", (7, 8)),
        ("item_mlp.weight", (11, 8)),
        ("prev_item.weight", (12, 3)),
        ("next_item.weight", (11, 3)),
        ("mlp_in.bias", (8,)),
        ("mlp_in.weights.0", (8, 8)),
        ("mlp_in.weights.1", (8, 8)),
        ("mlp.2.weight", (4, 8)),
        ("mlp.2.bias", (4,)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 4)),
    ],
    ("mlp", 3, (8,)): [
        ("user_mlp.weight", (7, 4)),
        ("item_mlp.weight", (11, 4)),
        ("prev_item.weight", (12, 3)),
        ("next_item.weight", (11, 3)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 4)),
        ("head.weights.1", (1, 4)),
    ],
    ("neumf", 0, (16, 8, 4)): [
        ("user_gmf.weight", (7, 5)),
        ("item_gmf.weight", (11, 5)),
        ("user_mlp.weight", (7, 8)),
        ("item_mlp.weight", (11, 8)),
        ("mlp_in.bias", (8,)),
        ("mlp_in.weights.0", (8, 8)),
        ("mlp_in.weights.1", (8, 8)),
        ("mlp.2.weight", (4, 8)),
        ("mlp.2.bias", (4,)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 5)),
        ("head.weights.1", (1, 4)),
    ],
    ("neumf", 0, (8,)): [
        ("user_gmf.weight", (7, 5)),
        ("item_gmf.weight", (11, 5)),
        ("user_mlp.weight", (7, 4)),
        ("item_mlp.weight", (11, 4)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 5)),
        ("head.weights.1", (1, 4)),
        ("head.weights.2", (1, 4)),
    ],
    ("neumf", 3, (16, 8, 4)): [
        ("user_gmf.weight", (7, 5)),
        ("item_gmf.weight", (11, 5)),
        ("user_mlp.weight", (7, 8)),
        ("item_mlp.weight", (11, 8)),
        ("prev_item.weight", (12, 3)),
        ("next_item.weight", (11, 3)),
        ("mlp_in.bias", (8,)),
        ("mlp_in.weights.0", (8, 8)),
        ("mlp_in.weights.1", (8, 8)),
        ("mlp.2.weight", (4, 8)),
        ("mlp.2.bias", (4,)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 5)),
        ("head.weights.1", (1, 4)),
    ],
    ("neumf", 3, (8,)): [
        ("user_gmf.weight", (7, 5)),
        ("item_gmf.weight", (11, 5)),
        ("user_mlp.weight", (7, 4)),
        ("item_mlp.weight", (11, 4)),
        ("prev_item.weight", (12, 3)),
        ("next_item.weight", (11, 3)),
        ("head.bias", (1,)),
        ("head.weights.0", (1, 5)),
        ("head.weights.1", (1, 4)),
        ("head.weights.2", (1, 4)),
    ],
}


@pytest.mark.parametrize("case", list(KEYS), ids=lambda c: f"{c[0]}-order{c[1]}-{len(c[2])}layers")
def test_state_dict_keys_and_shapes_are_those_of_earlier_checkpoints(
    case: tuple[str, int, tuple[int, ...]],
) -> None:
    kind, order, layers = case
    model = build_model(ModelConfig(kind=kind, order_factors=order, layers=layers, **SHAPE))
    got = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert got == KEYS[case]
    # Every parameter is listed once (the towers own none), and the optimizer sees each once.
    assert sorted(n for n, _ in model.named_parameters()) == sorted(k for k, _ in KEYS[case])


def _reference_weights(kind: str, order: int) -> dict[str, torch.Tensor]:
    """The weights of seed 0 as the earlier model.py drew them, written out: GMF tables, MLP
    tables, order tables (nn.Embedding's own N(0, 1) draw, then N(0, 0.01)), the MLP's first
    layer drawn whole, its other Linears (their default init, then Glorot), then the head drawn
    whole (LeCun) or MF's biases."""
    torch.manual_seed(0)
    n_users, n_items, f = SHAPE["n_users"], SHAPE["n_items"], SHAPE["factors"]
    layers = (16, 8, 4)
    w: dict[str, torch.Tensor] = {}

    def table(name: str, rows: int, width: int) -> None:
        t = nn.Embedding(rows, width)
        w[name] = nn.init.normal_(t.weight, 0.0, 0.01).detach()

    def whole(name: str, sizes: tuple[int, ...], out: int, init: object) -> None:
        full = torch.empty(out, sum(sizes))
        init(full)  # type: ignore[operator]
        for k, block in enumerate(full.split(list(sizes), dim=1)):
            w[f"{name}.weights.{k}"] = block
        bound = 1.0 / sum(sizes) ** 0.5
        w[f"{name}.bias"] = torch.empty(out).uniform_(-bound, bound)

    gmf, mlp = kind in ("neumf", "gmf", "mf"), kind in ("neumf", "mlp")
    if gmf:
        table("user_gmf.weight", n_users, f)
        table("item_gmf.weight", n_items, f)
    if mlp:
        table("user_mlp.weight", n_users, 8)
        table("item_mlp.weight", n_items, 8)
    if order:
        table("prev_item.weight", n_items + 1, order)
        table("next_item.weight", n_items, order)
    if mlp:
        whole("mlp_in", (8, 8), layers[1], nn.init.xavier_uniform_)
        lin = nn.Linear(layers[1], layers[2])
        nn.init.xavier_uniform_(lin.weight)
        w["mlp.2.weight"], w["mlp.2.bias"] = lin.weight.detach(), lin.bias.detach()
    if kind == "mf":
        for name, rows in (("user_bias.weight", n_users), ("item_bias.weight", n_items)):
            nn.Embedding(rows, 1)  # its N(0, 1) draw, then zeros
            w[name] = torch.zeros(rows, 1)
        w["global_bias"] = torch.zeros(1)
    else:
        sizes = ((f,) if gmf else ()) + ((layers[-1],) if mlp else ())

        def lecun(t: torch.Tensor) -> None:
            bound = (3.0 / t.shape[1]) ** 0.5
            nn.init.uniform_(t, -bound, bound)

        whole("head", sizes, 1, lecun)
    return w


@pytest.mark.parametrize("order", [0, 3])
@pytest.mark.parametrize("kind", ["mf", "gmf", "mlp", "neumf"])
def test_a_seed_gives_the_weights_it_always_gave(kind: str, order: int) -> None:
    want = _reference_weights(kind, order)
    torch.manual_seed(0)
    model = build_model(ModelConfig(kind=kind, order_factors=order, layers=(16, 8, 4), **SHAPE))
    got = model.state_dict()
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
