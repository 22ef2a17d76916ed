"""Policy losses and rollout corrections against hand-computed values (tolerance 1e-6 in float64)."""

from __future__ import annotations

import math

import pytest
import torch

from sparrow_nemo.grpo.losses import PolicyLossConfig, compute_policy_loss, k3_kl

D = torch.float64


def _t(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=D)


def test_clip_low_and_high_hand_computed() -> None:
    # Token ratios r = exp(logp - old): 1.5 (A=+1: clipped at 1.28), 0.5 (A=-1: clipped at 0.8),
    # 1.1 (A=+1: unclipped), and a masked token that must not count.
    old = torch.zeros(2, 2, dtype=D)
    logp = torch.log(_t([[1.5, 0.5], [1.1, 7.0]])).requires_grad_(True)
    adv = _t([[1.0, -1.0], [1.0, 1.0]])
    mask = torch.tensor([[True, True], [True, False]])
    cfg = PolicyLossConfig(correction="none")
    loss, m = compute_policy_loss(cfg, logp, old, adv, mask)
    # per token: max(-1.5, -1.28) = -1.28; max(0.5, 0.8) = 0.8; max(-1.1, -1.1) = -1.1
    expected = (-1.28 + 0.8 - 1.1) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-9)
    assert m["clip_fraction"] == pytest.approx(2 / 3)
    assert m["ratio_max"] == pytest.approx(1.5)
    assert m["ratio_min"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.1) / 3)
    loss.backward()
    # clipped tokens get no gradient; the unclipped one gets -A * r / N = -1.1 / 3; masked one 0
    torch.testing.assert_close(logp.grad, _t([[0.0, 0.0], [-1.1 / 3, 0.0]]))


def test_sequence_advantages_broadcast_and_seq_mean_token_mean() -> None:
    # on-policy (ratio 1): per-token loss = -A. seq 0: 3 valid tokens of A=2; seq 1: 1 valid token of A=-1.
    logp = torch.zeros(2, 3, dtype=D)
    adv = torch.tensor([2.0, -1.0], dtype=D)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    tok, _ = compute_policy_loss(PolicyLossConfig(correction="none"), logp, logp, adv, mask)
    seq, _ = compute_policy_loss(
        PolicyLossConfig(correction="none", aggregation="seq_mean_token_mean"), logp, logp, adv, mask
    )
    assert tok.item() == pytest.approx((-2 * 3 + 1) / 4)
    assert seq.item() == pytest.approx((-2 + 1) / 2)


def test_tis_weights_are_capped() -> None:
    # train/rollout ratios exp(old - rollout): 3.0 (capped at 2), 0.5, 1.0; on-policy PPO ratio 1; A = 1.
    old = torch.zeros(1, 3, dtype=D)
    rollout = -torch.log(_t([[3.0, 0.5, 1.0]]))
    loss, m = compute_policy_loss(
        PolicyLossConfig(correction="tis", tis_cap=2.0),
        old.clone(),
        old,
        torch.ones(1, dtype=D),
        torch.ones(1, 3),
        rollout_logprobs=rollout,
    )
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 1.0) / 3)
    assert m["tis_clipped_fraction"] == pytest.approx(1 / 3)
    assert m["rollout_ratio_mean"] == pytest.approx((3.0 + 0.5 + 1.0) / 3)
    assert m["token_mult_prob_error"] == pytest.approx((3.0 + 2.0 + 1.0) / 3)


def test_icepop_masks_tokens_outside_band() -> None:
    old = torch.zeros(1, 4, dtype=D)
    rollout = -torch.log(_t([[0.4, 0.5, 5.0, 6.0]]))  # ratios 0.4 (out), 0.5 (in), 5 (in), 6 (out)
    adv = _t([[1.0, 2.0, 3.0, 4.0]])
    loss, m = compute_policy_loss(
        PolicyLossConfig(correction="icepop", icepop_low=0.5, icepop_high=5.0),
        old.clone(),
        old,
        adv,
        torch.ones(1, 4),
        rollout_logprobs=rollout,
    )
    # IcePop's M(rho) = rho inside [0.5, 5]: weights 0, 0.5, 5, 0; masked tokens still count in the denominator
    assert loss.item() == pytest.approx(-(0.5 * 2 + 5.0 * 3) / 4)
    assert m["masked_fraction"] == pytest.approx(0.5)


def test_mis_keeps_the_ratio_below_the_cap_and_drops_the_rest() -> None:
    # ratios 3.0 (above the cap 2: weight 0, not 2 as TIS), 0.5, 2.0 (at the cap: kept); A = 1, 2, 3
    old = torch.zeros(1, 3, dtype=D)
    rollout = -torch.log(_t([[3.0, 0.5, 2.0]]))
    loss, m = compute_policy_loss(
        PolicyLossConfig(correction="mis", mis_cap=2.0),
        old.clone(),
        old,
        _t([[1.0, 2.0, 3.0]]),
        torch.ones(1, 3),
        rollout_logprobs=rollout,
    )
    assert loss.item() == pytest.approx(-(0.0 * 1 + 0.5 * 2 + 2.0 * 3) / 3)
    assert m["masked_fraction"] == pytest.approx(1 / 3)


def test_seq_mask_tis_masks_sequences_and_truncates_token_weights() -> None:
    # seq 0: log ratios ln 3, -ln 3 -> geo mean 1 (kept), token weights min(3, 2) = 2 and 1/3;
    # seq 1: ln 1.5 twice -> geo 1.5 (masked). A = 1 everywhere, 4 valid tokens.
    old = torch.zeros(2, 2, dtype=D)
    rollout = -torch.log(_t([[3.0, 1 / 3], [1.5, 1.5]]))
    loss, m = compute_policy_loss(
        PolicyLossConfig(correction="seq_mask_tis", seq_mask_low=0.9, seq_mask_high=1.1, tis_cap=2.0),
        old.clone(),
        old,
        torch.ones(2, dtype=D),
        torch.ones(2, 2),
        rollout_logprobs=rollout,
    )
    assert loss.item() == pytest.approx(-(2.0 + 1 / 3) / 4)
    assert m["masked_fraction"] == pytest.approx(0.5)
    assert m["tis_clipped_fraction"] == pytest.approx(1 / 4)


def test_seq_mask_uses_geometric_mean_over_valid_tokens() -> None:
    # seq 0: log ratios +0.1, -0.1 -> geo mean 1 (kept). seq 1: +0.2 and a padded token -> geo 1.22 (masked).
    old = torch.zeros(2, 2, dtype=D)
    rollout = -_t([[0.1, -0.1], [0.2, 9.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.tensor([1.0, 1.0], dtype=D)
    loss, m = compute_policy_loss(
        PolicyLossConfig(correction="seq_mask", seq_mask_low=0.9, seq_mask_high=1.1),
        old.clone(),
        old,
        adv,
        mask,
        rollout_logprobs=rollout,
    )
    assert loss.item() == pytest.approx(-2.0 / 3)
    assert m["masked_fraction"] == pytest.approx(1 / 3)


def test_k3_kl_term_value_and_gradient() -> None:
    logp = torch.log(_t([[0.5, 0.25]])).requires_grad_(True)
    ref = torch.log(_t([[0.25, 0.25]]))
    cfg = PolicyLossConfig(correction="none", kl_coef=0.1)
    loss, m = compute_policy_loss(
        cfg, logp, logp.detach(), torch.zeros(1, dtype=D), torch.ones(1, 2), ref_logprobs=ref
    )
    kl0 = 0.5 - math.log(0.5) - 1.0  # exp(d) - d - 1 with d = log(0.25 / 0.5)
    assert m["kl"] == pytest.approx(kl0 / 2)
    assert loss.item() == pytest.approx(0.1 * kl0 / 2)
    loss.backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, _t([[0.1 * (1 - 0.5) / 2, 0.0]]))
    assert torch.all(k3_kl(torch.randn(50, dtype=D), torch.randn(50, dtype=D)) >= 0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"aggregation": "sum"}, "aggregation"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"tis_cap": 0.0}, "tis_cap"),
        ({"icepop_low": 2.0, "icepop_high": 1.0}, "icepop"),
    ],
)
def test_bad_config(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PolicyLossConfig(**kwargs)


def test_bad_shapes_and_names() -> None:
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="mask must have the shape"):
        compute_policy_loss(PolicyLossConfig(), lp, lp, torch.zeros(2), torch.ones(2, 2))
    with pytest.raises(ValueError, match="advantages must be"):
        compute_policy_loss(PolicyLossConfig(), lp, lp, torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="no token"):
        compute_policy_loss(PolicyLossConfig(), lp, lp, torch.zeros(2), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_policy_loss(PolicyLossConfig(kl_coef=0.1), lp, lp, torch.zeros(2), torch.ones(2, 3))
    # unknown registry names are refused when the config is built (the registries' names() are the choices)
    with pytest.raises(
        ValueError,
        match=r"correction='magic' - expected a registered name \(icepop, mis, none, seq_mask, seq_mask_tis, tis\)",
    ):
        PolicyLossConfig(correction="magic")
    with pytest.raises(ValueError, match=r"name='dpo' - expected a registered name \(clipped_pg\)"):
        PolicyLossConfig(name="dpo")


def test_rollout_corr_metrics_hand_computed() -> None:
    """k3 KL, ratio quantiles, masked fraction and mean weight of the sampled tokens (one process)."""
    from sparrow_nemo.grpo.rollout_corr import mismatch_metrics

    ratios = [[3.0, 0.5, 1.0], [2.0, 1.0, 9.0]]  # the last token is padding (masked out)
    old = torch.zeros(2, 3, dtype=D)
    rollout = -torch.log(_t(ratios))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    m = mismatch_metrics(old, rollout, mask, PolicyLossConfig(correction="mis", mis_cap=2.0))
    rho = [3.0, 0.5, 1.0, 2.0, 1.0]
    assert m["rollout_corr/k3_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in rho) / 5)
    assert m["rollout_corr/masked_fraction"] == pytest.approx(1 / 5)  # only 3.0 > the cap
    assert m["rollout_corr/weight_mean"] == pytest.approx((0.5 + 1.0 + 2.0 + 1.0) / 5)
    assert m["rollout_corr/ratio_max"] == pytest.approx(3.0)
    # sorted 0.5, 1, 1, 2, 3: p50 = 1; p01 at position 0.04 -> 0.5 + 0.04 * 0.5; p99 at 3.96 -> 2 + 0.96
    assert m["rollout_corr/ratio_p50"] == pytest.approx(1.0)
    assert m["rollout_corr/ratio_p01"] == pytest.approx(0.52)
    assert m["rollout_corr/ratio_p99"] == pytest.approx(2.96)
    tis = mismatch_metrics(old, rollout, mask, PolicyLossConfig(correction="tis"))
    assert tis["rollout_corr/masked_fraction"] == 0.0
