"""The torch rollout engine: continuous batching over a paged KV cache, Sparrow sparse decode, lossless
speculative decoding, CUDA graphs, and the CPU kernels it uses."""
