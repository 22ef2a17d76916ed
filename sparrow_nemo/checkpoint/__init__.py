"""Checkpoints: one concept, one module per layer, each named ``checkpoint``.

- :mod:`sparrow_nemo.checkpoint.atomic`: the on-disk protocol, framework-free (torch files, no model): per-rank
  files staged in ``<name>.partial``, a sha256 ``manifest.json`` written last, the rename that publishes it,
  verification on load, the complete checkpoints under a root.
- :mod:`sparrow_nemo.checkpoint.run_state`: the run's files in a step checkpoint (``trainer_state.json``,
  ``callback_tensors.pt``), retention, and which checkpoints ``checkpoint.resume`` tries.
- :mod:`sparrow_nemo.policy.checkpoint`: the policy's part (model shard + optimizer + RNG, one file per rank).
- :mod:`sparrow_nemo.grpo.checkpoint`: one step checkpoint (policy + run state), the collective resume and
  the recipe's ``checkpoint:`` section.

This package imports nothing above :mod:`sparrow_nemo.atomic_io`; policy and grpo import it.
"""
