"""The megatron-core Qwen3 policy: parallel layout, model, HF import/export, logprobs, train step, checkpoints."""
