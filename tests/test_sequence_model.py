"""The sequence term's encoder (ncfcli/model/sequence.py), each property against a bug that once
lived or could:

- causality: the encoder's state at position t reads items up to t only;
- padding: a pad slot's own inputs (its position row, E's pad row) never reach a score;
- training scores what serving scores: the loss's logits are raw_scores on every item;
- precision under AMP (G8): q is scaled before q @ kᵀ, and the target's logit and the
  negatives' share one precision.
"""

from __future__ import annotations

import pytest
import torch

from ncfcli.model.sequence import Block, Sequence

N_ITEMS, LENGTH = 11, 6


def _encoder(seed: int = 0, blocks: int = 2) -> Sequence:
    torch.manual_seed(seed)
    seq = Sequence(n_items=N_ITEMS, length=LENGTH, width=8, blocks=blocks, dropout=0.0)
    with torch.no_grad():  # weights large enough that every input moves the states
        for name, p in seq.named_parameters():
            if name != "item.weight":
                p.add_(torch.randn(p.shape) * 0.3)
        seq.item.weight[:N_ITEMS].normal_(0.0, 0.5)
    return seq.eval()


def _windows(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, N_ITEMS, (n, LENGTH), generator=g)


# ---- causality and padding -------------------------------------------------------------------


def test_a_state_at_t_does_not_read_the_items_after_t() -> None:
    seq, window = _encoder(), _windows(5)
    with torch.no_grad():
        base = seq.states(window)
        for t in range(LENGTH - 1):
            later = window.clone()
            later[:, t + 1 :] = (later[:, t + 1 :] + 1 + torch.arange(LENGTH - t - 1)) % N_ITEMS
            moved = seq.states(later)
            assert torch.allclose(moved[:, : t + 1], base[:, : t + 1], atol=1e-6), t
            assert not torch.allclose(moved[:, t + 1 :], base[:, t + 1 :], atol=1e-3), t


def test_a_pad_slots_own_inputs_never_reach_a_score() -> None:
    """A window padded in its first k slots: what those slots would add (the position rows
    0..k-1, E's pad row) is zeroed, so changing it moves no state of the padded user, while the
    same change moves a user whose window is full (the rows are read there)."""
    seq = _encoder()
    window = _windows(2)
    window[0, :3] = N_ITEMS  # user 0: 3 pads, then 3 items
    with torch.no_grad():
        base = seq.states(window)
        scores = seq.raw_scores(window)
        seq.position.weight[:3].add_(torch.randn(3, 8))
        seq.item.weight[N_ITEMS].add_(torch.randn(8))  # garbage in the pad row itself
        moved = seq.states(window)
        assert torch.allclose(moved[0], base[0], atol=1e-6)
        assert torch.allclose(seq.raw_scores(window)[0], scores[0], atol=1e-6)
        assert not torch.allclose(moved[1], base[1], atol=1e-3)  # a real slot reads its row


def test_the_losss_logits_are_the_served_scores_on_every_item() -> None:
    """Training's logit of an item at the window's last position is what scoring gives the
    user for that item (raw_scores, before the scale): the term is trained on what it serves."""
    seq = _encoder()
    seqs = torch.cat([_windows(4), torch.randint(0, N_ITEMS, (4, 1))], dim=1)
    every = torch.arange(N_ITEMS)
    with torch.no_grad():
        logits = seq.logits(seq.states(seqs[:, :-1]), seqs[:, 1:], every)[:, -1]
        served = seq.raw_scores(seqs[:, :-1])
    assert torch.allclose(logits[:, 0], served.gather(1, seqs[:, -1:]).squeeze(1), atol=1e-5)
    own = every[None] == seqs[:, -1:]  # the target's own column among the negatives: left out
    assert torch.isinf(logits[:, 1:][own]).all()
    assert torch.allclose(logits[:, 1:][~own], served[~own], atol=1e-5)


# ---- G8: precision under AMP -----------------------------------------------------------------


def test_attention_scales_q_before_the_half_precision_product() -> None:
    """q = k = 40 in 64 columns: q . k = 102,400 overflows fp16 (65,504), the scaled product
    (12,800) does not. Under fp16 autocast the block must give what it gives in fp32."""
    block = Block(64, dropout=0.0).eval()
    with torch.no_grad():
        block.norm_attn.weight.zero_()
        block.norm_attn.bias.fill_(1.0)  # LN(x) = 1 everywhere
        block.qkv.weight.zero_()
        block.qkv.bias.copy_(torch.cat([torch.full((128,), 40.0), torch.randn(64)]))
    x = torch.randn(2, 3, 64)
    blocked = torch.ones(3, 3, dtype=torch.bool).triu(1)
    with torch.no_grad():
        want = block(x, blocked)
        with torch.autocast("cpu", dtype=torch.float16):
            got = block(x, blocked)
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), want, atol=0.05)


def test_the_targets_logit_and_the_negatives_share_one_precision() -> None:
    """Two positions with one state: item 3 is the first's target and a negative of the
    second's. Under bf16 autocast both logits of item 3 must be the same number (a bf16
    product for the negatives alone rounds them differently), in float32."""
    seq = _encoder()
    h = torch.randn(1, 8).expand(2, 8) * 3
    targets = torch.tensor([3, 5])
    negatives = torch.tensor([3, 7, 1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = seq.logits(h, targets, negatives).detach()
    assert logits.dtype == torch.float32
    assert torch.isinf(logits[0, 1]) and float(logits[1, 1]) == pytest.approx(
        float(logits[0, 0]), rel=1e-6
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = seq.loss(torch.tensor([[N_ITEMS, 2, 4, 6, 8, 9, 3]]), negatives)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_the_terms_dropout_keeps_1_minus_p_scaled_and_is_seeded() -> None:
    """MaskDropout (the sequence term's dropout): each value kept with probability 1 - p and
    scaled by 1 / (1 - p), the same gradient mask, the same draws after the same seed, and the
    identity in eval mode."""
    from ncfcli.model.layers import MaskDropout

    drop = MaskDropout(0.3)
    x = torch.ones(400, 250, requires_grad=True)
    torch.manual_seed(5)
    y = drop(x)
    kept = y != 0
    assert abs(float(kept.float().mean()) - 0.7) < 0.01
    assert torch.allclose(y[kept], torch.full_like(y[kept], 1 / 0.7))
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, y.detach())
    torch.manual_seed(5)
    assert torch.equal(drop(x), y)
    drop.eval()
    assert drop(x) is x
    assert torch.equal(MaskDropout(1.0).train()(x), torch.zeros_like(x))


def test_a_users_state_is_the_last_position_of_every_state() -> None:
    """Scoring computes only the last position through the last block (its query, attention
    and feed-forward): the same state as the whole encoder's last position, padded windows
    included."""
    from ncfcli.model.sequence import Sequence

    torch.manual_seed(2)
    seq = Sequence(40, 6, 16, 3, 0.5).eval()
    window = torch.randint(0, 40, (9, 6))
    window[:3, :4] = 40  # padded on the left, as short histories are
    whole = seq.states(window)[:, -1]
    last = seq.user_state(window)
    assert last.shape == (9, 16)
    torch.testing.assert_close(last, whole, rtol=1e-5, atol=1e-6)
