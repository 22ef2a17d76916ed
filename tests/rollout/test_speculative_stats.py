"""With sampling, speculative rollout is indistinguishable from dense rollout - and the test can tell.

One fixed prompt, a random Qwen3 with a vocabulary of 8 and peaky next-token distributions, 2,000 samples
of 4 tokens each way (per-sample seeds). The draft keeps only the sink and local pages (12 of 40 cached
tokens), so it disagrees with the dense model often (mean acceptance ~0.8; top token ~0.4). A two-sample chi-square test of
homogeneity at each generated position and on the joint of positions 1-2 compares the token counts:

- dense vs speculative (plain sampling, and top-k + top-p applied to both p and q): every p-value > 1e-4;
- the same test against two deliberately wrong acceptance rules run through the same engine - accepting
  every draft (samples from the sparse draft) and resampling a rejection from p instead of max(0, p - q) -
  gives p < 1e-6 somewhere, so the test has the power to see the difference the right rule removes.

Seeds are fixed, so the outcome is deterministic; the thresholds leave orders of magnitude of margin.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sparrow_nemo.rollout.engine import SamplingParams
from sparrow_nemo.rollout.sampling import kept_probs, sample_from
from sparrow_nemo.rollout.torch import spec_decode
from sparrow_nemo.rollout.torch.engine import TorchRolloutEngine
from sparrow_nemo.rollout.torch.speculative import SpeculativeConfig, Verdict, verify_drafts
from sparrow_nemo.sparse.schedule import BudgetSchedule

from ._helpers import SHAPE

pytestmark = pytest.mark.slow

VOCAB = 8
SAMPLES = 2000
NEW_TOKENS = 4
DENSE = BudgetSchedule.dense(16, 4)
DRAFT = BudgetSchedule(bin_tokens=16, budgets=(12,), page_size=4, name="sink+local")
SPEC = SpeculativeConfig(draft_tokens=(3,))
PLAIN = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, stop_token_ids=())
FILTERED = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.5, top_k=4, top_p=0.95, stop_token_ids=())


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> TorchRolloutEngine:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from sparrow_nemo.hf_qwen3 import hf_config_dict

    # initializer_range 0.15, seed 1: broad next-token distributions (top token ~0.4) that the sparse draft
    # gets quite wrong (mean acceptance ~0.8)
    config = Qwen3Config(**hf_config_dict(SHAPE.replace(vocab_size=VOCAB)), initializer_range=0.15)
    torch.manual_seed(1)
    path: Path = tmp_path_factory.mktemp("qwen3_vocab8")
    Qwen3ForCausalLM(config).float().eval().save_pretrained(path)
    return TorchRolloutEngine.from_hf_dir(path, dense_layers=1, page_size=4, attention_backend="torch")


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def _tokens(engine, prompt, sampling: SamplingParams, seed: int, **kw) -> torch.Tensor:
    out = engine.generate([prompt] * SAMPLES, _with_seed(sampling, seed), DRAFT if kw else DENSE, **kw)
    return torch.stack([s.response_ids for s in out.samples])  # [SAMPLES, NEW_TOKENS]


def _with_seed(sampling: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(sampling, seed=seed)


def chi_square_p(a: torch.Tensor, b: torch.Tensor, categories: int) -> float:
    """p-value of the chi-square test that two samples of category ids come from one distribution
    (2 x C contingency table; categories seen in neither sample are dropped)."""
    counts = torch.stack([torch.bincount(x, minlength=categories) for x in (a, b)]).double()
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    df = counts.shape[1] - 1
    if df == 0:  # one category in both samples: nothing to tell apart
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def p_values(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """Per generated position, then the joint of positions 1 and 2 (the first two drafted tokens)."""
    per_position = [chi_square_p(a[:, t], b[:, t], VOCAB) for t in range(NEW_TOKENS)]
    joint = chi_square_p(a[:, 1] * VOCAB + a[:, 2], b[:, 1] * VOCAB + b[:, 2], VOCAB * VOCAB)
    return [*per_position, joint]


def accept_every_draft(
    dense_logits, draft_logits, drafts, num_drafts, sampling, accept_u, final_u
) -> Verdict:
    """Wrong: keep all k drafts and add the bonus token (the samples follow the sparse draft)."""
    v = verify_drafts(dense_logits, draft_logits, drafts, num_drafts, sampling, accept_u, final_u)
    rows = torch.arange(drafts.shape[0])
    bonus = sample_from(kept_probs(dense_logits[rows, num_drafts], sampling), final_u[rows, num_drafts])
    return Verdict(accepted=num_drafts.clone(), next_token=bonus, alpha=v.alpha, tested=v.tested)


def resample_from_p(dense_logits, draft_logits, drafts, num_drafts, sampling, accept_u, final_u) -> Verdict:
    """Wrong: after a rejection draw from the dense p itself instead of normalise(max(0, p - q))."""
    v = verify_drafts(dense_logits, draft_logits, drafts, num_drafts, sampling, accept_u, final_u)
    rows = torch.arange(drafts.shape[0])
    from_p = sample_from(kept_probs(dense_logits[rows, v.accepted], sampling), final_u[rows, v.accepted])
    rejected = v.accepted < num_drafts
    return Verdict(v.accepted, torch.where(rejected, from_p, v.next_token), v.alpha, v.tested)


@pytest.mark.parametrize("sampling", [PLAIN, FILTERED], ids=["plain", "top_k+top_p"])
def test_speculative_samples_cannot_be_told_from_dense_samples(engine, prompt, sampling) -> None:
    dense = _tokens(engine, prompt, sampling, seed=1)
    spec = _tokens(engine, prompt, sampling, seed=2, speculative=SPEC)
    p = p_values(dense, spec)
    assert min(p) > 1e-4, p
    # several tokens possible at every position (the test is not vacuous)
    assert all(len(torch.unique(dense[:, t])) >= 3 for t in range(NEW_TOKENS))


@pytest.mark.parametrize("wrong_rule", [accept_every_draft, resample_from_p])
def test_a_wrong_acceptance_rule_fails_the_same_test(engine, prompt, wrong_rule, monkeypatch) -> None:
    dense = _tokens(engine, prompt, PLAIN, seed=1)
    monkeypatch.setattr(spec_decode, "verify_drafts", wrong_rule)
    wrong = _tokens(engine, prompt, PLAIN, seed=2, speculative=SPEC)
    p = p_values(dense, wrong)
    assert min(p) < 1e-6, p
    assert p[0] > 1e-4  # position 0 comes from the dense prefill either way: only the rule differs
