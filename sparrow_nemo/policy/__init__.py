"""The megatron-core Qwen3 policy: parallel layout, model, HF import/export, logprobs, train step, checkpoints.

Entry points: :class:`sparrow_nemo.policy.policy.MegatronPolicy` (the worker API),
:func:`sparrow_nemo.policy.plan.plan` / ``format_plan`` (``sparrow plan``), and
:class:`sparrow_nemo.policy.parallel.ParallelLayout`. Modules import megatron-core lazily where they
can, so importing this package stays cheap.
"""
