"""verl's interface beyond the tree's fields: keys with no effect here, refusals, verl 0.8's reward
spellings, verl's entry points, and verl's YAML files (Hydra's defaults list and interpolations).

verl's trainer tree (verl 0.9.1's generated ppo_trainer config, and the one-step-off / fully-async
recipe configs) has keys for machinery plait does not have: FSDP/Megatron sharding, vLLM/SGLang
engine tuning, agent loops, extension classes. A verl script that sets them still loads;
`load_config` takes them out of the tree and `no_effect_notice` names the ones the user set, once,
at start, grouped by reason. Every other verl key is a field of the config tree (plait/config.py)
with verl's default. Left out: OmegaConf itself (`compose_yaml` and `resolve_interpolations` cover
the forms verl's YAMLs use: defaults entries, `${key}`, `${.key}`, `oc.select`, `oc.env`).
"""

from __future__ import annotations

import os
import re

import yaml

from plait.configtree import ConfigError

_GROUPS = {
    ("FSDP/Megatron knobs plait's sharding does not have (mesh size, sequence parallelism, fused-kernel "
     "and compile switches; plait implements strategy and fsdp_config's offload, reshard_after_forward, "
     "forward_prefetch and wrap_policy.min_num_params)"): """
        actor_rollout_ref.actor.fsdp_config.fsdp_size
        actor_rollout_ref.actor.fsdp_config.mixed_precision.buffer_dtype
        actor_rollout_ref.ref.fsdp_config.mixed_precision.buffer_dtype
        critic.model.fsdp_config.mixed_precision.buffer_dtype
        reward_model.model.fsdp_config.mixed_precision.buffer_dtype
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
        actor_rollout_ref.ref.use_torch_compile
        actor_rollout_ref.ref.router_replay.mode
        actor_rollout_ref.ref.router_replay.record_file
        actor_rollout_ref.ref.router_replay.replay_file
        actor_rollout_ref.ref.fsdp_config.fsdp_size
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
        critic.model.fsdp_config.fsdp_size
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
        critic.ulysses_sequence_parallel_size
        reward_model.model.use_shm
        reward_model.model.use_fused_kernels
        reward_model.model.fsdp_config.fsdp_size
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
        reward.reward_model.rollout
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
    ("verl 0.8's reward-model sharding keys: the reward model (verl 0.9 serves it from a rollout "
     "engine) is sharded here like the actor, by actor_rollout_ref.actor.strategy and its fsdp_config"): """
        reward_model.strategy
        reward_model.model.fsdp_config.wrap_policy.min_num_params
        reward_model.model.fsdp_config.param_offload
        reward_model.model.fsdp_config.reshard_after_forward
        reward_model.model.fsdp_config.forward_prefetch
        reward_model.model.fsdp_config.mixed_precision.param_dtype
        reward_model.model.fsdp_config.mixed_precision.reduce_dtype
    """,
    ("FSDP engine extras plait's FSDP2 does not have: verl's chunk size for entropy from logits (plait "
     "always chunks, workers/logprobs.py), no_sync accumulation, padding to fixed lengths, QAT, the "
     "Turbo engine, and verl's new-engine copy of the critic's FSDP settings (critic.fsdp; plait reads "
     "critic.model.fsdp_config)"): """
        actor_rollout_ref.actor.fsdp_config.entropy_from_logits_chunk_size
        actor_rollout_ref.actor.fsdp_config.use_no_sync_for_gradient_accumulation
        actor_rollout_ref.actor.fsdp_config.pad_to_length
        actor_rollout_ref.actor.fsdp_config.pad_to_length_bucket
        actor_rollout_ref.actor.fsdp_config.qat
        actor_rollout_ref.actor.fsdp_config.turbo_config
        actor_rollout_ref.ref.fsdp_config.entropy_from_logits_chunk_size
        actor_rollout_ref.ref.fsdp_config.use_no_sync_for_gradient_accumulation
        actor_rollout_ref.ref.fsdp_config.pad_to_length
        actor_rollout_ref.ref.fsdp_config.pad_to_length_bucket
        actor_rollout_ref.ref.fsdp_config.qat
        actor_rollout_ref.ref.fsdp_config.turbo_config
        critic.fsdp
    """,
    ("multimodal (image/video) inputs: plait's LM trainers take text prompts"): """
        actor_rollout_ref.actor.freeze_vision_tower
        data.image_patch_size
        data.image_key
        data.video_key
        data.return_multi_modal_inputs
    """,
    ("profiler options plait takes from global_profiler for every role (tool, save_path, the finish "
     "hook, which runs once in the driver, snapshot grouping; results are written under save_path, "
     "never relocated), or tools plait does not drive (NPU, nsys options)"): """
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
        actor_rollout_ref.actor.profiler.relocate_results
        actor_rollout_ref.actor.profiler.finish_hook_cmd
        actor_rollout_ref.actor.profiler.finish_hook_all_ranks
        actor_rollout_ref.actor.profiler.finish_hook_ranks
        actor_rollout_ref.actor.profiler.tool_config.torch_memory.memory_snapshot_num_steps
        actor_rollout_ref.ref.profiler.relocate_results
        actor_rollout_ref.ref.profiler.finish_hook_cmd
        actor_rollout_ref.ref.profiler.finish_hook_all_ranks
        actor_rollout_ref.ref.profiler.finish_hook_ranks
        actor_rollout_ref.ref.profiler.tool_config.torch_memory.memory_snapshot_num_steps
        actor_rollout_ref.rollout.profiler.relocate_results
        actor_rollout_ref.rollout.profiler.finish_hook_cmd
        actor_rollout_ref.rollout.profiler.finish_hook_all_ranks
        actor_rollout_ref.rollout.profiler.finish_hook_ranks
        actor_rollout_ref.rollout.profiler.tool_config.torch_memory.memory_snapshot_num_steps
        critic.profiler.relocate_results
        critic.profiler.finish_hook_cmd
        critic.profiler.finish_hook_all_ranks
        critic.profiler.finish_hook_ranks
        critic.profiler.tool_config.torch_memory.memory_snapshot_num_steps
        actor_rollout_ref.rollout.profiler.tool_config.npu.contents
        actor_rollout_ref.rollout.profiler.tool_config.npu.level
        actor_rollout_ref.rollout.profiler.tool_config.npu.analysis
        actor_rollout_ref.rollout.profiler.tool_config.npu.discrete
        actor_rollout_ref.rollout.profiler.tool_config.npu.profile_token_start
        actor_rollout_ref.rollout.profiler.tool_config.npu.profile_token_end
        reward.reward_model.profiler.tool
        reward.reward_model.profiler.save_path
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
        critic.optim.optimizer
        critic.optim.optimizer_impl
        critic.optim.override_optimizer_config
        critic.model.override_config
        critic.model.external_lib
        reward_model.model.external_lib
        reward_model.model.override_config
        reward.sandbox_fusion.url
        reward.sandbox_fusion.max_concurrent
        reward.sandbox_fusion.memory_limit_mb
        reward_model.use_reward_loop
    """,
    ("cluster, storage and Ray plumbing of verl's single controller (HDFS, ESI, register timeouts, "
     "dataloader workers, transfer queue): plait's backends manage their own processes"): """
        actor_rollout_ref.actor.rollout_n
        actor_rollout_ref.actor.data_loader_seed
        actor_rollout_ref.actor.checkpoint.async_save
        actor_rollout_ref.ref.rollout_n
        data.dataloader_num_workers
        data.filter_overlong_prompts_workers
        critic.rollout_n
        critic.data_loader_seed
        critic.checkpoint.async_save
        reward_model.micro_batch_size
        reward_model.launch_reward_fn_async
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
    # verl 0.9's new keys (its generated ppo_trainer config; tests/fixtures/verl091_ppo_trainer_keys.txt)
    ("verl 0.9 kernel, padding and quantization switches (QAT, Megatron-style LoRA, fused kernels, chunked "
     "entropy, MTP): plait computes in plain PyTorch; its LoRA is actor_rollout_ref.model.lora_rank (peft)"): """
        actor_rollout_ref.actor.qat
        actor_rollout_ref.rollout.qat
        actor_rollout_ref.model.lora
        actor_rollout_ref.actor.entropy_from_logits_chunk_size
        actor_rollout_ref.actor.pad_to_length
        actor_rollout_ref.ref.entropy_from_logits_chunk_size
        actor_rollout_ref.ref.pad_to_length
        actor_rollout_ref.model.torch_dtype
        critic.model.lora
        critic.model.mtp
        critic.model.use_liger
        critic.model.use_fused_kernels
        critic.model.fused_kernel_options.impl_backend
    """,
    ("FSDP mixed-precision policies: plait's workers compute in actor_rollout_ref.model.dtype (the FSDP2 "
     "work implements these)"): """
    """,
    ("verl 0.9 serving, routing and agent machinery (prefill/decode disaggregation, routers, MoE load metrics, "
     "tool functions, rollout traces, custom checkpoint-engine backends): plait's rollout is single-turn "
     "generation in its own engine"): """
        actor_rollout_ref.rollout.disaggregation
        actor_rollout_ref.rollout.router_config_path
        actor_rollout_ref.rollout.moe_load_balance_metrics_interval
        actor_rollout_ref.rollout.full_determinism
        actor_rollout_ref.rollout.multi_turn.function_tool_path
        actor_rollout_ref.rollout.trace.project_name
        actor_rollout_ref.rollout.trace.experiment_name
        actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module
        data.function_tool_path
    """,
    ("verl 0.9 multimodal inputs (audio, processor arguments, images per prompt): plait's LM trainers take "
     "text prompts"): """
        data.audio_key
        data.mm_processor_kwargs
        actor_rollout_ref.actor.num_images_in_input
    """,
    ("verl 0.9 subsystems plait does not have (on-policy distillation, the transfer queue, the v1 trainer's "
     "own modes and sampler, rollout skipping/caching, checkpoint callbacks); each refuses to be enabled"): """
        distillation
        transfer_queue
        trainer.use_v1
        trainer.v1
        trainer.checkpoint_callback_class
        skip
        ray_kwargs.ray_init.runtime_env.py_executable
    """,
    ("verl options plait does not implement (docs/verl.md lists them): critic adapters and tokenizer, "
     "strict checkpoint loading (plait always loads strictly), logging cadence and debug switches, "
     "older rollout-correction spellings"): """
        critic.model.hf_config_path
        critic.model.custom_chat_template
        critic.model.exclude_modules
        critic.model.lora_adapter_path
        actor_rollout_ref.actor.checkpoint.strict
        trainer.tensorboard_dir
        trainer.log_freq
        trainer.debug
        algorithm.rollout_correction.rollout_rs_threshold_lower
        algorithm.rollout_correction.rollout_token_veto_threshold
    """,
}

NO_EFFECT: dict[str, str] = {key: reason for reason, keys in _GROUPS.items() for key in keys.split()}

# Fields plait implements that only a multi-process backend uses.
LOCAL_BACKEND_NO_EFFECT = {
    key: "process counts of a cluster: the local backend runs every role in this process (trainer.backend=ray "
         "starts nnodes x n_gpus_per_node workers on GPUs)"
    for key in ("trainer.nnodes", "trainer.n_gpus_per_node", "actor_rollout_ref.rollout.nnodes",
                "actor_rollout_ref.rollout.n_gpus_per_node", "reward.reward_model.enable_resource_pool",
                "reward.reward_model.nnodes", "reward.reward_model.n_gpus_per_node")}

# ... and that nothing reads without CUDA (any backend).
CPU_NO_EFFECT = {
    f"{role}.fsdp_config.{key}":
        "offload to CPU memory: without CUDA parameters and optimizer state are in CPU memory already"
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model")
    for key in ("param_offload", "optimizer_offload", "offload_policy")}

# The async recipes' standalone rollout pool, spelled at the top level there: the same keys as the rollout's.
RECIPE_ROLLOUT_POOL = {f"rollout.{key}": f"actor_rollout_ref.rollout.{key}" for key in ("nnodes", "n_gpus_per_node")}

# ... and that the Ray backend reads only with CUDA.
CPU_RAY_NO_EFFECT = {
    key: "GPU counts: without CUDA the Ray backend starts trainer.ray.num_cpu_workers trainer processes"
    for key in ("trainer.nnodes", "trainer.n_gpus_per_node")}


# Rollout fields only the vLLM engine reads: named at start when the run's engine is hf.
HF_ENGINE_NO_EFFECT = {
    f"actor_rollout_ref.rollout.{key}": "vLLM engine settings: this run's rollout engine is hf (rollout.name=vllm reads them)"
    for key in ("gpu_memory_utilization", "max_num_batched_tokens", "max_num_seqs", "max_model_len", "enforce_eager",
                "enable_chunked_prefill", "enable_prefix_caching", "free_cache_engine", "load_format", "seed",
                "tensor_model_parallel_size", "engine_kwargs.vllm")}

# verl 0.9 switches of subsystems whose other keys have no effect here: turning one on is refused.
ENABLES = {"distillation.enabled": "on-policy distillation (distillation.*)",
           "transfer_queue.enable": "verl's transfer queue (its main_ppo recipe)",
           "trainer.v1.trainer_mode": "verl's v1 trainer modes (plait's modes: trainer.mode=sync, one_step_off, fully_async)",
           **{f"skip.{part}.enable": "skipping rollouts from a dump (skip.*)" for part in ("rollout", "rollout_tq", "async_rollout")}}


def refusal(user: dict[str, object]) -> tuple[str, object, str] | None:
    """(key, value, why) when plait cannot run a verl config at all, given the leaf keys the user set."""
    for key, value in user.items():
        if "megatron" in key.split(".") or (key.endswith(".strategy") and value == "megatron"):
            return key, value, ("Megatron-LM is not supported: plait trains with PyTorch (strategy fsdp or fsdp2); "
                                "drop the *.megatron.* keys and set actor_rollout_ref.actor.strategy=fsdp")
        if key in RECIPE_KEYS:
            return key, value, (f"a key of verl's {RECIPE_KEYS[key]} recipe, which plait does not implement "
                                "(docs/verl.md lists the recipes it runs)")
        if key in ENABLES and value not in (None, False, "sync"):
            return key, value, f"{ENABLES[key]} is not supported in plait (docs/verl.md); drop the key or set it off"
        if key in ("global_profiler.tool", "trainer.device") and value == "npu":
            return key, value, ("Ascend NPU is not supported: plait runs on CPU and CUDA (global_profiler.tool: "
                                "torch, torch_memory, nsys; trainer.device: auto, cpu, cuda)")
    return None


# verl 0.8's reward keys and where verl 0.9 moved them (verl maps a legacy key that is not null
# onto the new tree, as load_config does here, naming each once at start). Longest prefix wins;
# legacy keys not listed (reward_model.strategy, ...) stay in the no-effect table under their old names.
LEGACY_REWARD = {
    "custom_reward_function": "reward.custom_reward_function",
    "sandbox_fusion": "reward.sandbox_fusion",
    "reward_model.sandbox_fusion": "reward.sandbox_fusion",
    "reward_model.num_workers": "reward.num_workers",
    "reward_model.reward_manager": "reward.reward_manager.name",
    "reward_model.reward_loop_source": "reward.reward_manager.source",
    "reward_model.reward_loop_module_path": "reward.reward_manager.module.path",
    "reward_model.reward_loop_class_name": "reward.reward_manager.module.name",
    "reward_model.reward_kwargs": "reward.reward_kwargs",
    "reward_model.overlong_buffer": "reward.overlong_buffer",
    "reward_model.enable": "reward.reward_model.enable",
    "reward_model.enable_resource_pool": "reward.reward_model.enable_resource_pool",
    "reward_model.n_gpus_per_node": "reward.reward_model.n_gpus_per_node",
    "reward_model.nnodes": "reward.reward_model.nnodes",
    "reward_model.model.path": "reward.reward_model.model_path",
    "reward_model.model.input_tokenizer": "reward.reward_model.input_tokenizer",
    "reward_model.model.trust_remote_code": "reward.reward_model.trust_remote_code",
    "reward_model.micro_batch_size_per_gpu": "reward.reward_model.micro_batch_size_per_gpu",
    "reward_model.max_length": "reward.reward_model.max_length",
    "reward_model.profiler": "reward.reward_model.profiler",
    "reward_model.rollout": "reward.reward_model.rollout",
}


# verl's and verl-recipe's entry points (`plait train --entry-point MODULE`, the module verl's script
# ran with python -m): those plait runs, as the overrides that select the mode, and those it refuses.
ENTRY_POINTS: dict[str, list[str]] = {
    "verl.trainer.main_ppo": [],
    "recipe.dapo.main_dapo": [],              # DAPO: algorithm.filter_groups plus reward_manager dapo
    "recipe.entropy.main_entropy": [],        # clip_cov / kl_cov losses and filter_groups
    "verl.experimental.one_step_off_policy.main_ppo": ["trainer.mode=one_step_off", "trainer.placement=separated"],
    "recipe.one_step_off_policy.main_ppo": ["trainer.mode=one_step_off", "trainer.placement=separated"],
    "verl.experimental.fully_async_policy.fully_async_main": ["trainer.mode=fully_async", "trainer.placement=separated"],
    "recipe.fully_async_policy.fully_async_main": ["trainer.mode=fully_async", "trainer.placement=separated"],
}
REFUSED_RECIPES = {
    "recipe.sppo.main_sppo": "SPPO (self-play preference optimisation)",
    "recipe.flowrl.main_flowrl": "FlowRL",
    "recipe.prime.main_prime": "PRIME (implicit process rewards)",
    "recipe.spin.main_spin": "SPIN (self-play fine-tuning)",
    "recipe.gvpo.main_gvpo": "GVPO",
    "recipe.spo.main_spo": "SPO (single-stream policy optimisation)",
    "verl.trainer.main_ppo_split": "split placement (main_ppo_split.py)",
    "recipe.split_placement.main_ppo_split": "split placement (main_ppo_split.py)",
    "verl.experimental.transfer_queue.main_ppo": "the transfer-queue trainer",
    "recipe.transfer_queue.main_ppo": "the transfer-queue trainer",
}
# Keys only a refused recipe reads: named with the recipe instead of as unknown.
RECIPE_KEYS = {"data.filter_accuracy": "PRIME", "data.accuracy_lower_bound": "PRIME", "data.accuracy_upper_bound": "PRIME",
               "data.oversample_factor": "PRIME", "algorithm.sppo_eta": "SPPO", "algorithm.tb_coef": "FlowRL"}


def entry_point_overrides(module: str | None) -> list[str]:
    """The overrides verl's entry point `module` implies; a recipe plait does not run is refused in one line."""
    if module is None:
        return []
    module = module.removesuffix(".py").replace("/", ".")
    if module in REFUSED_RECIPES:
        raise ConfigError("--entry-point", module, f"verl's recipe {REFUSED_RECIPES[module]} is not implemented in "
                                                   "plait; it would otherwise run as plain PPO/GRPO")
    if module not in ENTRY_POINTS:
        raise ConfigError("--entry-point", module, f"not an entry point plait knows; it runs {', '.join(ENTRY_POINTS)}")
    return ENTRY_POINTS[module]


# -- verl's YAML files: Hydra's defaults list, `hydra:` and `_target_` ------------------------------
#
# A verl YAML (a recipe's config, or a user's copy of one) composes verl's own config groups through
# `defaults:`. plait's tree already holds verl's defaults, so an entry naming verl's own configs or
# groups composes to nothing; an entry naming a YAML file beside the file (or under --config-path)
# is read and merged as Hydra does (the file's own keys last unless `_self_` says otherwise).
# `hydra:` and every `_target_` are dropped; `${...}` interpolations are resolved against the file,
# then plait's defaults; `???` (a value verl requires) is left to plait's default.

VERL_CONFIGS = ("ppo_trainer", "_generated_ppo_trainer", "legacy_reward_impl", "evaluation")
VERL_GROUPS = ("actor", "critic", "data", "model", "ref", "reward", "rollout", "algorithm", "distillation",
               "transfer_queue", "model_engine", "engine", "optim", "profiler", "npu_profile", "reward_model")


def compose_yaml(tree: dict, where: str, search: list[str], read) -> dict:
    """`tree` (read from `where`) with its defaults list composed; `read(path)` reads one YAML file."""
    tree = dict(tree)
    tree.pop("hydra", None)
    defaults = tree.pop("defaults", None) or []
    if not isinstance(defaults, list):
        raise ConfigError("defaults", defaults, f"{where}: Hydra's defaults list is a list")
    before, after, own_placed = [], [], False
    for entry in defaults:
        if entry == "_self_":
            own_placed = True
            continue
        (after if own_placed else before).append(_default_entry(entry, where, search, read))
    out: dict = {}
    for part in [*before, _drop_targets(tree), *after]:
        out = merge(out, part)
    return out


def _default_entry(entry, where: str, search: list[str], read) -> dict:
    if isinstance(entry, dict) and len(entry) == 1:
        (key, option), = entry.items()
        group, _, package = str(key).removeprefix("override ").strip().partition("@")
        name, package = f"{group}/{option}", package or group
    elif isinstance(entry, str):
        name, _, package = entry.removeprefix("override ").strip().partition("@")  # "file" or "file@package"
        option, group = entry, name.split("/")[0]
    else:
        raise ConfigError("defaults", entry, f"{where}: a defaults entry is a name or a one-key mapping")
    if option is None:
        return {}
    if "megatron" in str(option) or "megatron" in name:
        raise ConfigError("defaults", entry, "Megatron-LM is not supported: plait trains with PyTorch (fsdp or fsdp2)")
    if name.removesuffix(".yaml") in VERL_CONFIGS or group in VERL_GROUPS:
        return {}  # verl's own config: plait's tree holds its defaults
    for folder in search:
        path = os.path.join(folder, f"{name.removesuffix('.yaml')}.yaml")
        if os.path.isfile(path):
            part = compose_yaml(read(path), path, [os.path.dirname(path), *search], read)
            for key in reversed(package.split(".") if package else []):
                part = {key: part}
            return part
    raise ConfigError("defaults", entry, f"{where}: names neither one of verl's config groups nor a YAML file in "
                                         f"{', '.join(dict.fromkeys(search))}")


def _drop_targets(tree):
    if isinstance(tree, dict):
        return {k: _drop_targets(v) for k, v in tree.items() if k != "_target_"}
    return tree


def merge(base: dict, top: dict) -> dict:
    """`top` over `base`, section by section."""
    out = dict(base)
    for key, value in top.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


INTERPOLATION = re.compile(r"\$\{([^${}]*)\}")


def resolve_interpolations(tree: dict, defaults: dict) -> dict:
    """Replace verl's `${key}`, `${.key}`, `${oc.select:key,default}` and `${oc.env:VAR,default}` with
    their values (the tree's own, else plait's default for that key); drop `???` values."""
    def lookup(key: str, here: str):
        if key.startswith("."):
            key = here.rsplit(".", 1)[0] + key if "." in here else key[1:]
        for source in (tree, defaults):
            node = source
            for part in key.split("."):
                node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
            if node is not _MISSING:
                return resolve(node, key, 0)
        return _MISSING

    def one(expr: str, here: str, depth: int):
        kind, _, rest = expr.partition(":") if expr.startswith("oc.") else ("", "", expr)
        key, _, fallback = rest.partition(",")
        if kind == "oc.env":
            return os.environ.get(key.strip(), yaml.safe_load(fallback) if fallback else None)
        value = lookup(key.strip(), here)
        if value is _MISSING:
            if kind == "oc.select":
                return resolve(yaml.safe_load(fallback), here, depth + 1) if fallback.strip() else None
            raise ConfigError(here, "${" + expr + "}", f"refers to {key.strip()}, which neither the file nor plait's tree has")
        return value

    def resolve(value, here: str, depth: int):
        match = INTERPOLATION.search(value) if isinstance(value, str) and depth <= 20 else None
        if match is None:  # innermost first: ${oc.select:a,${oc.select:b,null}} resolves b, then a
            return value
        got = one(match.group(1), here, depth)
        if match.span() == (0, len(value)):  # the whole value: keep the type (a number, a list)
            return resolve(got, here, depth + 1)
        text = value[:match.start()] + ("null" if got is None else str(got)) + value[match.end():]
        return resolve(text, here, depth + 1)

    def walk(node, prefix: str):
        out = {}
        for key, value in node.items():
            here = f"{prefix}{key}"
            if isinstance(value, dict):
                out[key] = walk(value, f"{here}.")
            else:
                resolved = resolve(value, here, 0)
                if resolved != "???":
                    out[key] = resolved
        return out
    return walk(tree, "")


_MISSING = object()
