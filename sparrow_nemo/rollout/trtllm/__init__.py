"""The TensorRT-LLM rollout backend (cluster only): the engine adapter, the Sparrow sparse-attention plugin,
its KV-cache and decode pieces, placement, runtime checks and refit."""
