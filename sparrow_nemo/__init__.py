"""sparrow_nemo: GRPO on Qwen3 thinking models with sparse rollouts (the Sparrow method).

Layers (see README): ``sparse`` (the method, framework-free), ``rollout`` (generation
engines), ``policy`` (megatron-core Qwen3), ``grpo`` (algorithm), ``callbacks``,
``rewards``, ``config`` and ``cli``.
"""

__version__ = "0.1.0"
