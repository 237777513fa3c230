"""NCF models in plain torch: `python -c "from ncfcli.model.neumf import build_model; print(build_model({'kind': 'neumf', 'n_users': 10, 'n_items': 20}))"`.

Every model maps (users [B] int, items [B] int) -> logits [B] float32; the sigmoid of a logit
is the predicted probability of an interaction. Ids are dense (as prepared), int32 or int64.

- neumf: GMF tower (elementwise product of `factors`-wide embeddings) and MLP tower
  (concatenated `layers[0]//2`-wide embeddings through `layers`), joined by one linear head
  (He et al., 2017). Defaults follow NVIDIA's reference: 64 factors, MLP 256-256-128-64,
  dropout 0.5, embeddings N(0, 0.01), Glorot-uniform MLP weights, LeCun-uniform head.
- gmf / mlp: one tower with its own head.
- mf: dot product plus user, item and global biases (Rendle et al., 2020).

Any kind may add an order term (`order_factors` > 0, FPMC-style: Rendle et al., 2010): the
logit gains <P[prev], Q[item]>, prev being the item the user interacted with just before; and
a sequence term (a window of L > 0 items, SASRec-style: Kang and McAuley, 2018): scale x
<h, E[item]>, h the state of a causal self-attention encoder after the user's latest L items.
Three names, one each: `uses_order` (the order term), `uses_sequence` (the sequence term),
`takes_context` (either). A model that takes a context scores (users, items, context): the
previous item [B] with the order term alone, the latest L items [B, L] with the sequence term.

One file per part of the paper, each with its equations and tensor shapes:

    kinds.py    the kinds `--model` takes (NCF kinds and baselines), importable without torch
    config.py   ModelConfig (saved inside every checkpoint)
    gmf.py      GMF: p_u ⊙ q_i                         [B, factors]
    mlp.py      MLP: phi_L(...phi_2([p_u; q_i])...)    [B, layers[-1]]
    order.py    the order term <P[prev], Q[item]>      [B]
    sequence.py the sequence term scale <h, E[item]>    [B]; its own loss on sequences
    bias.py     MF's b_u + b_i + b                     [B]
    neumf.py    NCF: the towers joined by the head     [B]; score_all [U, n_items]
    layers.py   what they share: tables, the row gather, SplitLinear, ReLU + dropout
    baselines.py pop, itemknn, EASE and ALS (NumPy/SciPy, implicit), fitted in one go

Each tower has its own user and item tables, and no concatenation is ever materialised: the
layers that read one (the MLP's first layer, the NeuMF head) are `SplitLinear`s, one weight
block per input, y = b + sum_k x_k W_k^T, which is nn.Linear on the concatenation written out.
Training-only rewrites (the gather's one-scatter backward, the MLP's projected first layer,
the fused ReLU + dropout) compute the same function and gradient as the plain layers;
evaluation and export run the plain path (model.eval()), so ONNX sees only standard ops.

Under autocast (`ncf train --amp`) the matrix products run in bf16/fp16 while parameters,
gradients and `_Gather`'s row sums stay fp32; tests/test_amp.py runs every kind that way on the
CPU. Scoring for metrics is always fp32 (ncfcli/scoring/metrics.py).
"""
