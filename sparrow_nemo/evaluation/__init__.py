"""``sparrow eval``: n samples per prompt, mean@n and the unbiased pass@k estimator (AIME-style reporting)."""

from sparrow_nemo.evaluation.passk import default_ks, pass_at_k
from sparrow_nemo.evaluation.runner import EvalSummary, PromptResult, evaluate_samples, summarize

__all__ = ["EvalSummary", "PromptResult", "default_ks", "evaluate_samples", "pass_at_k", "summarize"]
