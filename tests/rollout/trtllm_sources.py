"""What the TensorRT-LLM sources say, written down for the CPU tests of the adapter (test data).

Read in the index copies of NVIDIA/TensorRT-LLM files (no TensorRT-LLM can be installed here). The copies
carry no release tag; each was placed in the 1.2 line by its content (the features named below), next to
``tensorrt_llm/version.py`` at commit b35ac1b64368513d215c57d2ed01d62d910df8da (``1.2.0rc2``).
"""

from __future__ import annotations


def _fields(text: str) -> frozenset[str]:
    """Field names written one after another, as they appear in the class body."""
    return frozenset(text.split())


# tensorrt_llm/llmapi/llm_args.py, the copy with SkipSoftmaxAttentionConfig in the SparseAttentionConfig
# union, KvCacheConfig.use_kv_cache_manager_v2 and TorchLlmArgs.enable_sleep (139,423 characters):
# BaseLlmArgs declares model_config = ConfigDict(extra="forbid"): an unknown keyword is a ValidationError.
BASE_LLM_ARGS_FIELDS = _fields(
    """
    model tokenizer tokenizer_mode custom_tokenizer skip_tokenizer_init trust_remote_code tensor_parallel_size
    dtype revision tokenizer_revision model_kwargs pipeline_parallel_size context_parallel_size gpus_per_node
    moe_cluster_parallel_size moe_tensor_parallel_size moe_expert_parallel_size enable_attention_dp
    enable_lm_head_tp_in_adp pp_partition cp_config load_format enable_lora lora_config kv_cache_config
    enable_chunked_prefill guided_decoding_backend batched_logits_processor iter_stats_max_iterations
    request_stats_max_iterations peft_cache_config scheduler_config cache_transceiver_config
    sparse_attention_config speculative_config max_batch_size max_input_len max_seq_len max_beam_width
    max_num_tokens gather_generation_logits num_postprocess_workers postprocess_tokenizer_dir reasoning_parser
    decoding_config mpi_session otlp_traces_endpoint backend return_perf_metrics perf_metrics_max_requests
    orchestrator_type env_overrides
    """
)
TORCH_LLM_ARGS_FIELDS = BASE_LLM_ARGS_FIELDS | _fields(
    """
    garbage_collection_gen0_threshold cuda_graph_config attention_dp_config disable_overlap_scheduler moe_config
    nvfp4_gemm_config attn_backend sampler_type sampler_force_async_worker enable_iter_perf_stats
    enable_iter_req_stats print_iter_log batch_wait_timeout_ms batch_wait_timeout_iters
    batch_wait_max_tokens_ratio torch_compile_config enable_autotuner enable_layerwise_nvtx_marker load_format
    enable_min_latency stream_interval force_dynamic_quantization allreduce_strategy checkpoint_loader
    checkpoint_format kv_connector_config mm_encoder_only ray_worker_extension_cls ray_placement_config
    enable_sleep use_cute_dsl_blockscaling_mm use_cute_dsl_blockscaling_bmm disable_flashinfer_sampling
    max_stats_len layer_wise_benchmarks_config backend
    """
)
# TorchLlmArgs validators of that copy the kwargs must satisfy
SAMPLER_TYPES = frozenset({"TRTLLMSampler", "TorchSampler", "auto"})  # SamplerType
ORCHESTRATOR_TYPES = frozenset({None, "rpc", "ray"})  # ray_worker_extension_cls needs "ray"
# the same copy, KvCacheConfig (extra fields forbidden too: StrictBaseModel)
KV_CACHE_CONFIG_FIELDS = _fields(
    """
    enable_block_reuse max_tokens max_attention_window sink_token_length free_gpu_memory_fraction
    host_cache_size onboard_blocks cross_kv_cache_fraction secondary_offload_min_priority event_buffer_max_size
    attention_dp_events_gather_period_ms enable_partial_reuse copy_on_partial_reuse use_uvm max_gpu_total_bytes
    dtype mamba_ssm_cache_dtype tokens_per_block use_kv_cache_manager_v2 max_util_for_resume
    """
)
# tensorrt_llm/sampling_params.py, the copy with logprobs / prompt_logprobs next to return_context_logits
# (28,692 characters): the dataclass fields SamplingParams(**kwargs) accepts
SAMPLING_PARAMS_FIELDS = _fields(
    """
    end_id pad_id max_tokens bad bad_token_ids stop stop_token_ids include_stop_str_in_output embedding_bias
    logits_processor apply_batched_logits_processor n best_of use_beam_search top_k top_p top_p_min
    top_p_reset_ids top_p_decay seed temperature min_tokens beam_search_diversity_rate repetition_penalty
    presence_penalty frequency_penalty length_penalty early_stopping no_repeat_ngram_size min_p
    beam_width_array logprobs prompt_logprobs return_context_logits return_generation_logits
    exclude_input_from_output return_encoder_output return_perf_metrics additional_model_outputs
    lookahead_config guided_decoding ignore_eos detokenize add_special_tokens truncate_prompt_tokens
    skip_special_tokens spaces_between_special_tokens
    """
)
# tensorrt_llm/_torch/pyexecutor/sampler.py: LogProbsState of the TorchSampler that adds the sampled token
# (TorchSampler(Sampler, AsyncWorkerMixin), DEFAULT_MAX_TOPK_LOGPROBS = 20), and a record without the
# sampled fields: a TorchSampler that returns the top-K only (as issue 21 describes the 1.2.0rc2 files).
LOGPROB_STATE_WITH_SAMPLED = frozenset(
    {"sampled_vals", "sampled_indices", "sampled_rank", "topk_vals", "topk_indices"}
)
LOGPROB_STATE_TOPK_ONLY = frozenset({"topk_vals", "topk_indices"})
