"""verl keys plait accepts but that have no effect here, grouped by the reason.

verl's trainer tree (its ppo_trainer config and the one-step-off / fully-async recipe configs) has
keys for machinery plait does not have: FSDP/Megatron sharding, vLLM/SGLang engine tuning, agent
loops, extension classes. A verl script that sets them still loads; `load_config` takes them out of
the tree and `no_effect_notice` names the ones the user set, once, at start, grouped by reason.
Every other verl key is a field of the config tree (plait/config.py) with verl's default.
"""

from __future__ import annotations

_GROUPS = {
    ("FSDP/Megatron sharding, offload, sequence parallelism and fused-kernel switches: each plait "
     "worker holds a whole model (data parallel across processes with trainer.backend=ray)"): """
        actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params
        actor_rollout_ref.actor.fsdp_config.param_offload
        actor_rollout_ref.actor.fsdp_config.optimizer_offload
        actor_rollout_ref.actor.fsdp_config.offload_policy
        actor_rollout_ref.actor.fsdp_config.reshard_after_forward
        actor_rollout_ref.actor.fsdp_config.fsdp_size
        actor_rollout_ref.actor.fsdp_config.forward_prefetch
        actor_rollout_ref.actor.fsdp_config.model_dtype
        actor_rollout_ref.actor.fsdp_config.use_orig_params
        actor_rollout_ref.actor.fsdp_config.seed
        actor_rollout_ref.actor.fsdp_config.full_determinism
        actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size
        actor_rollout_ref.actor.fsdp_config.entropy_from_logits_with_chunking
        actor_rollout_ref.actor.fsdp_config.use_torch_compile
        actor_rollout_ref.actor.fsdp_config.entropy_checkpointing
        actor_rollout_ref.actor.fsdp_config.forward_only
        actor_rollout_ref.actor.fsdp_config.strategy
        actor_rollout_ref.actor.fsdp_config.dtype
        actor_rollout_ref.actor.use_prefix_grouper
        actor_rollout_ref.actor.use_torch_compile
        actor_rollout_ref.actor.use_fused_kernels
        actor_rollout_ref.actor.router_replay.mode
        actor_rollout_ref.actor.router_replay.record_file
        actor_rollout_ref.actor.router_replay.replay_file
        actor_rollout_ref.actor.ulysses_sequence_parallel_size
        actor_rollout_ref.actor.entropy_from_logits_with_chunking
        actor_rollout_ref.actor.entropy_checkpointing
        actor_rollout_ref.actor.calculate_sum_pi_squared
        actor_rollout_ref.actor.sum_pi_squared_checkpointing
        actor_rollout_ref.ref.strategy
        actor_rollout_ref.ref.use_torch_compile
        actor_rollout_ref.ref.router_replay.mode
        actor_rollout_ref.ref.router_replay.record_file
        actor_rollout_ref.ref.router_replay.replay_file
        actor_rollout_ref.ref.fsdp_config.wrap_policy.min_num_params
        actor_rollout_ref.ref.fsdp_config.param_offload
        actor_rollout_ref.ref.fsdp_config.optimizer_offload
        actor_rollout_ref.ref.fsdp_config.offload_policy
        actor_rollout_ref.ref.fsdp_config.reshard_after_forward
        actor_rollout_ref.ref.fsdp_config.fsdp_size
        actor_rollout_ref.ref.fsdp_config.forward_prefetch
        actor_rollout_ref.ref.fsdp_config.model_dtype
        actor_rollout_ref.ref.fsdp_config.use_orig_params
        actor_rollout_ref.ref.fsdp_config.seed
        actor_rollout_ref.ref.fsdp_config.full_determinism
        actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size
        actor_rollout_ref.ref.fsdp_config.entropy_from_logits_with_chunking
        actor_rollout_ref.ref.fsdp_config.use_torch_compile
        actor_rollout_ref.ref.fsdp_config.entropy_checkpointing
        actor_rollout_ref.ref.fsdp_config.forward_only
        actor_rollout_ref.ref.fsdp_config.strategy
        actor_rollout_ref.ref.fsdp_config.dtype
        actor_rollout_ref.ref.ulysses_sequence_parallel_size
        actor_rollout_ref.ref.entropy_from_logits_with_chunking
        actor_rollout_ref.ref.entropy_checkpointing
        actor_rollout_ref.rollout.mtp
        actor_rollout_ref.rollout.layered_summon
        actor_rollout_ref.model.use_shm
        actor_rollout_ref.model.enable_activation_offload
        actor_rollout_ref.model.use_liger
        actor_rollout_ref.model.use_fused_kernels
        actor_rollout_ref.model.fused_kernel_options.impl_backend
        actor_rollout_ref.model.tiled_mlp.enabled
        actor_rollout_ref.model.tiled_mlp.num_shards
        actor_rollout_ref.model.mtp.enable
        actor_rollout_ref.model.mtp.enable_train
        actor_rollout_ref.model.mtp.enable_rollout
        actor_rollout_ref.model.mtp.detach_encoder
        actor_rollout_ref.model.mtp.mtp_loss_scaling_factor
        actor_rollout_ref.model.mtp.speculative_algorithm
        actor_rollout_ref.model.mtp.speculative_num_steps
        actor_rollout_ref.model.mtp.speculative_eagle_topk
        actor_rollout_ref.model.mtp.speculative_num_draft_tokens
        actor_rollout_ref.model.mtp.method
        actor_rollout_ref.model.mtp.num_speculative_tokens
        actor_rollout_ref.hybrid_engine
        actor_rollout_ref.nccl_timeout
        data.use_shm
        critic.model.fsdp_config.wrap_policy.min_num_params
        critic.model.fsdp_config.param_offload
        critic.model.fsdp_config.optimizer_offload
        critic.model.fsdp_config.offload_policy
        critic.model.fsdp_config.reshard_after_forward
        critic.model.fsdp_config.fsdp_size
        critic.model.fsdp_config.forward_prefetch
        critic.model.fsdp_config.model_dtype
        critic.model.fsdp_config.use_orig_params
        critic.model.fsdp_config.seed
        critic.model.fsdp_config.full_determinism
        critic.model.fsdp_config.ulysses_sequence_parallel_size
        critic.model.fsdp_config.entropy_from_logits_with_chunking
        critic.model.fsdp_config.use_torch_compile
        critic.model.fsdp_config.entropy_checkpointing
        critic.model.fsdp_config.forward_only
        critic.model.fsdp_config.strategy
        critic.model.fsdp_config.dtype
        critic.model.use_shm
        critic.model.enable_activation_offload
        critic.model.tiled_mlp.enabled
        critic.model.tiled_mlp.num_shards
        critic.strategy
        critic.ulysses_sequence_parallel_size
        reward_model.strategy
        reward_model.model.use_shm
        reward_model.model.use_fused_kernels
        reward_model.model.fsdp_config.wrap_policy.min_num_params
        reward_model.model.fsdp_config.param_offload
        reward_model.model.fsdp_config.reshard_after_forward
        reward_model.model.fsdp_config.fsdp_size
        reward_model.model.fsdp_config.forward_prefetch
        reward_model.ulysses_sequence_parallel_size
    """,
    ("fully-async / one-step-off recipe knobs for verl's rollouter processes and weight transfer: "
     "plait's async modes use async_training.{staleness_threshold,trigger_parameter_sync_step,require_ "
     "batches,partial_rollout,gen_batch_size} and sync weights in-process or through Ray"): """
        actor_rollout_ref.rollout.checkpoint_engine.backend
        actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes
        actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs
        async_training.use_rollout_log_probs
        async_training.compute_prox_log_prob
        async_training.use_trainer_do_validate
        async_training.checkpoint_engine.enable
        async_training.checkpoint_engine.device_buffer_size_M
        async_training.checkpoint_engine.overlap_broadcast_and_consume
        rollout.nnodes
        rollout.n_gpus_per_node
        rollout.n
        rollout.total_rollout_steps
        rollout.total_epochs
        rollout.test_freq
        data.gen_batch_size
        actor_rollout_ref.checkpoint_engine
        actor_rollout_ref.actor.use_rollout_log_probs
    """,
    ("vLLM/SGLang/TensorRT-LLM engine tuning that plait's engines do not take (rollout.name=vllm "
     "takes the vLLM keys docs/rollout.md lists, and any vLLM argument through engine_kwargs.vllm)"): """
        actor_rollout_ref.rollout.prompt_length
        actor_rollout_ref.rollout.response_length
        actor_rollout_ref.rollout.cudagraph_capture_sizes
        actor_rollout_ref.rollout.data_parallel_size
        actor_rollout_ref.rollout.expert_parallel_size
        actor_rollout_ref.rollout.pipeline_model_parallel_size
        actor_rollout_ref.rollout.logprobs_mode
        actor_rollout_ref.rollout.scheduling_policy
        actor_rollout_ref.rollout.disable_log_stats
        actor_rollout_ref.rollout.over_sample_rate
        actor_rollout_ref.rollout.multi_stage_wake_up
        actor_rollout_ref.rollout.engine_kwargs.sglang
        actor_rollout_ref.rollout.engine_kwargs.trtllm
        actor_rollout_ref.rollout.skip_tokenizer_init
        actor_rollout_ref.rollout.enable_rollout_routing_replay
        actor_rollout_ref.rollout.prometheus.enable
        actor_rollout_ref.rollout.prometheus.port
        actor_rollout_ref.rollout.prometheus.file
        actor_rollout_ref.rollout.prometheus.served_model_name
        actor_rollout_ref.rollout.quantization
        actor_rollout_ref.rollout.quantization_config_file
        reward_model.rollout.name
        reward_model.rollout.dtype
        reward_model.rollout.gpu_memory_utilization
        reward_model.rollout.enforce_eager
        reward_model.rollout.cudagraph_capture_sizes
        reward_model.rollout.free_cache_engine
        reward_model.rollout.data_parallel_size
        reward_model.rollout.expert_parallel_size
        reward_model.rollout.tensor_model_parallel_size
        reward_model.rollout.max_num_batched_tokens
        reward_model.rollout.max_model_len
        reward_model.rollout.max_num_seqs
        reward_model.rollout.load_format
        reward_model.rollout.engine_kwargs
        reward_model.rollout.limit_images
        reward_model.rollout.enable_chunked_prefill
        reward_model.rollout.enable_prefix_caching
        reward_model.rollout.disable_log_stats
        reward_model.rollout.skip_tokenizer_init
        reward_model.rollout.prompt_length
        reward_model.rollout.response_length
    """,
    ("agent loops, multi-turn chat and tool calling: plait's rollout is single-turn generation"): """
        actor_rollout_ref.rollout.multi_turn.enable
        actor_rollout_ref.rollout.multi_turn.max_assistant_turns
        actor_rollout_ref.rollout.multi_turn.tool_config_path
        actor_rollout_ref.rollout.multi_turn.max_user_turns
        actor_rollout_ref.rollout.multi_turn.max_parallel_calls
        actor_rollout_ref.rollout.multi_turn.max_tool_response_length
        actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side
        actor_rollout_ref.rollout.multi_turn.interaction_config_path
        actor_rollout_ref.rollout.multi_turn.use_inference_chat_template
        actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode
        actor_rollout_ref.rollout.multi_turn.format
        actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts
        actor_rollout_ref.rollout.agent.num_workers
        actor_rollout_ref.rollout.agent.default_agent_loop
        actor_rollout_ref.rollout.agent.agent_loop_config_path
        actor_rollout_ref.rollout.agent.custom_async_server.path
        actor_rollout_ref.rollout.agent.custom_async_server.name
        actor_rollout_ref.rollout.trace.backend
        actor_rollout_ref.rollout.trace.token2text
        actor_rollout_ref.rollout.trace.max_samples_per_step_per_worker
        data.tool_config_path
    """,
    ("multimodal (image/video) inputs: plait's LM trainers take text prompts"): """
        actor_rollout_ref.actor.freeze_vision_tower
        data.image_patch_size
        data.image_key
        data.video_key
        data.return_multi_modal_inputs
    """,
    ("profiler options plait takes from global_profiler for every role (tool, save_path), or tools "
     "plait does not drive (NPU, nsys options, memory-snapshot context)"): """
        actor_rollout_ref.actor.profiler.tool
        actor_rollout_ref.actor.profiler.save_path
        actor_rollout_ref.actor.profiler.tool_config.nsys.discrete
        actor_rollout_ref.actor.profiler.tool_config.npu.contents
        actor_rollout_ref.actor.profiler.tool_config.npu.level
        actor_rollout_ref.actor.profiler.tool_config.npu.analysis
        actor_rollout_ref.actor.profiler.tool_config.npu.discrete
        actor_rollout_ref.actor.profiler.tool_config.torch_memory.trace_alloc_max_entries
        actor_rollout_ref.actor.profiler.tool_config.torch_memory.stack_depth
        actor_rollout_ref.ref.profiler.tool
        actor_rollout_ref.ref.profiler.save_path
        actor_rollout_ref.ref.profiler.tool_config.nsys.discrete
        actor_rollout_ref.ref.profiler.tool_config.npu.contents
        actor_rollout_ref.ref.profiler.tool_config.npu.level
        actor_rollout_ref.ref.profiler.tool_config.npu.analysis
        actor_rollout_ref.ref.profiler.tool_config.npu.discrete
        actor_rollout_ref.ref.profiler.tool_config.torch_memory.trace_alloc_max_entries
        actor_rollout_ref.ref.profiler.tool_config.torch_memory.stack_depth
        actor_rollout_ref.rollout.profiler.tool
        actor_rollout_ref.rollout.profiler.save_path
        critic.profiler.tool
        critic.profiler.save_path
        critic.profiler.tool_config.nsys.discrete
        critic.profiler.tool_config.npu.contents
        critic.profiler.tool_config.npu.level
        critic.profiler.tool_config.npu.analysis
        critic.profiler.tool_config.npu.discrete
        critic.profiler.tool_config.torch_memory.trace_alloc_max_entries
        critic.profiler.tool_config.torch_memory.stack_depth
        reward_model.profiler.tool
        reward_model.profiler.save_path
        global_profiler.global_tool_config.nsys.discrete
        global_profiler.global_tool_config.nsys.controller_nsight_options.trace
        global_profiler.global_tool_config.nsys.controller_nsight_options.cuda-memory-usage
        global_profiler.global_tool_config.nsys.controller_nsight_options.cuda-graph-trace
        global_profiler.global_tool_config.nsys.worker_nsight_options.trace
        global_profiler.global_tool_config.nsys.worker_nsight_options.cuda-memory-usage
        global_profiler.global_tool_config.nsys.worker_nsight_options.cuda-graph-trace
        global_profiler.global_tool_config.nsys.worker_nsight_options.capture-range
        global_profiler.global_tool_config.nsys.worker_nsight_options.capture-range-end
        global_profiler.global_tool_config.nsys.worker_nsight_options.kill
        global_profiler.global_tool_config.torch_memory.context
        global_profiler.global_tool_config.torch_memory.stacks
        global_profiler.global_tool_config.torch_memory.kw_args
    """,
    ("verl extension points by class or module path (custom dataset, sampler, data generator, reward "
     "manager and reward loop classes, async servers, sandbox, external model libraries, optimizer "
     "classes): plait's components are chosen by name"): """
        actor_rollout_ref.actor.optim.optimizer
        actor_rollout_ref.actor.optim.optimizer_impl
        actor_rollout_ref.actor.optim.override_optimizer_config
        actor_rollout_ref.model.hf_config_path
        actor_rollout_ref.model.custom_chat_template
        actor_rollout_ref.model.external_lib
        actor_rollout_ref.model.override_config
        actor_rollout_ref.model.exclude_modules
        data.custom_cls.path
        data.custom_cls.name
        data.sampler.class_path
        data.sampler.class_name
        data.datagen.path
        data.datagen.name
        reward_manager.source
        reward_manager.name
        reward_manager.module.path
        reward_manager.module.name
        critic.optim.optimizer
        critic.optim.optimizer_impl
        critic.optim.override_optimizer_config
        critic.model.override_config
        critic.model.external_lib
        reward_model.model.external_lib
        reward_model.model.override_config
        reward_model.reward_loop_source
        reward_model.reward_loop_module_path
        reward_model.reward_loop_class_name
        reward_model.sandbox_fusion.url
        reward_model.sandbox_fusion.max_concurrent
        reward_model.sandbox_fusion.memory_limit_mb
        reward_model.use_reward_loop
    """,
    ("cluster, storage and Ray plumbing of verl's single controller (HDFS, ESI, register timeouts, "
     "resource pools, dataloader workers, transfer queue): plait's backends manage their own processes"): """
        actor_rollout_ref.actor.rollout_n
        actor_rollout_ref.actor.data_loader_seed
        actor_rollout_ref.actor.checkpoint.async_save
        actor_rollout_ref.ref.rollout_n
        data.dataloader_num_workers
        data.filter_overlong_prompts_workers
        critic.rollout_n
        critic.data_loader_seed
        critic.checkpoint.async_save
        reward_model.enable_resource_pool
        reward_model.n_gpus_per_node
        reward_model.nnodes
        reward_model.micro_batch_size
        reward_model.launch_reward_fn_async
        reward_model.num_workers
        trainer.balance_batch
        trainer.esi_redundant_time
        trainer.default_hdfs_dir
        trainer.del_local_ckpt_after_load
        trainer.ray_wait_register_center_timeout
        trainer.use_legacy_worker_impl
        transfer_queue.enable
        ray_kwargs.ray_init.num_cpus
        ray_kwargs.timeline_json_file
    """,
    ("verl's deprecated global micro-batch sizes: set the *_micro_batch_size_per_gpu keys, which plait "
     "implements"): """
        actor_rollout_ref.actor.ppo_micro_batch_size
        actor_rollout_ref.ref.log_prob_micro_batch_size
        actor_rollout_ref.rollout.log_prob_micro_batch_size
        critic.ppo_micro_batch_size
        critic.forward_micro_batch_size
    """,
    ("keys verl derives from another key plait implements (actor_rollout_ref.model.use_remove_padding; "
     "critic.ppo_micro_batch_size_per_gpu)"): """
        actor_rollout_ref.actor.use_remove_padding
        critic.forward_micro_batch_size_per_gpu
    """,
    ("not implemented in plait yet (docs/verl.md lists them)"): """
        actor_rollout_ref.actor.calculate_entropy
        actor_rollout_ref.actor.checkpoint.save_contents
        actor_rollout_ref.actor.checkpoint.load_contents
        actor_rollout_ref.rollout.skip_rollout
        actor_rollout_ref.rollout.skip_dump_dir
        actor_rollout_ref.model.tokenizer_path
        data.tokenizer
        data.train_max_samples
        data.val_max_samples
        data.return_raw_input_ids
        data.return_full_prompt
        data.validation_shuffle
        data.trust_remote_code
        data.apply_chat_template_kwargs
        critic.model.tokenizer_path
        critic.model.lora_rank
        critic.model.lora_alpha
        critic.model.target_modules
        critic.shuffle
        critic.checkpoint.save_contents
        critic.checkpoint.load_contents
        reward_model.model.use_remove_padding
        reward_model.use_dynamic_bsz
        reward_model.forward_max_token_len_per_gpu
        algorithm.use_pf_ppo
        algorithm.pf_ppo.reweight_method
        algorithm.pf_ppo.weight_pow
        trainer.rollout_data_dir
        trainer.validation_data_dir
        trainer.val_only
    """,
}

NO_EFFECT: dict[str, str] = {key: reason for reason, keys in _GROUPS.items() for key in keys.split()}

# Fields plait implements that only a multi-process backend uses.
LOCAL_BACKEND_NO_EFFECT = {
    key: "process counts of a cluster: the local backend runs every role in this process (trainer.backend=ray "
         "starts nnodes x n_gpus_per_node workers on GPUs)"
    for key in ("trainer.nnodes", "trainer.n_gpus_per_node")}


# Rollout fields only the vLLM engine reads: named at start when the run's engine is hf.
HF_ENGINE_NO_EFFECT = {
    f"actor_rollout_ref.rollout.{key}": "vLLM engine settings: this run's rollout engine is hf (rollout.name=vllm reads them)"
    for key in ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "enforce_eager",
                "enable_chunked_prefill", "enable_prefix_caching", "free_cache_engine", "load_format", "seed",
                "tensor_model_parallel_size", "engine_kwargs.vllm")}

def refusal(user: dict[str, object]) -> tuple[str, object, str] | None:
    """(key, value, why) when plait cannot run a verl config at all, given the leaf keys the user set."""
    for key, value in user.items():
        if "megatron" in key.split(".") or (key.endswith(".strategy") and value == "megatron"):
            return key, value, ("Megatron-LM is not supported: plait trains with PyTorch (strategy fsdp or fsdp2); "
                                "drop the *.megatron.* keys and set actor_rollout_ref.actor.strategy=fsdp")
        if key in ("global_profiler.tool", "trainer.device") and value == "npu":
            return key, value, ("Ascend NPU is not supported: plait runs on CPU and CUDA (global_profiler.tool: "
                                "torch, torch_memory, nsys; trainer.device: auto, cpu, cuda)")
    return None
