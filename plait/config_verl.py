"""verl's interface beyond the tree's fields: keys with no effect here, refusals, verl 0.8's reward
spellings, verl's entry points, and verl's YAML files (Hydra's defaults list and interpolations).

verl's trainer tree (verl 0.9.1's generated ppo_trainer config, and the one-step-off / fully-async
recipe configs) has keys for machinery plait does not have: FSDP/Megatron sharding, vLLM/SGLang
engine tuning, agent loops, extension classes. A verl script that sets them still loads;
`load_config` takes them out of the tree and `no_effect_notice` names the ones the user set, once,
at start, grouped by reason; those that would change what is trained, scored or sampled
(`SEMANTIC`) are accepted only at verl's default and refused in one line otherwise, and so are the
keys only a recipe plait does not run reads (`RECIPE_KEYS`). Every other verl key is a field of the
config tree (plait/config.py) with verl's default. Left out: OmegaConf itself (`compose_yaml` and `resolve_interpolations` cover
the forms verl's YAMLs use: defaults entries, `${key}`, `${.key}`, `oc.select`, `oc.env`).
"""

from __future__ import annotations

import os
import re

from plait.configtree import ConfigError
from plait.safeload import YamlBomb, load_yaml  # noqa: F401 - config's and the tests' names for them

_GROUPS = {
    ("FSDP/Megatron knobs plait's sharding does not have (mesh size, sequence parallelism, fused-kernel "
     "and compile switches; plait implements strategy and fsdp_config's offload, reshard_after_forward, "
     "forward_prefetch and wrap_policy.min_num_params)"): """
        actor_rollout_ref.actor.fsdp_config.fsdp_size
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
        model_engine
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
        actor_rollout_ref.rollout.sglang_rollout_mode
        actor_rollout_ref.rollout.engine_kwargs.trtllm
        actor_rollout_ref.rollout.skip_tokenizer_init
        actor_rollout_ref.rollout.enable_rollout_routing_replay
        actor_rollout_ref.rollout.prometheus.enable
        actor_rollout_ref.rollout.prometheus.port
        actor_rollout_ref.rollout.prometheus.file
        actor_rollout_ref.rollout.prometheus.served_model_name
        actor_rollout_ref.rollout.quantization
        actor_rollout_ref.rollout.quantization_config_file
    """,
    ("a judge's engine layout and tuning: each judge replica (reward.reward_model with a causal LM) is one engine "
     "in one worker process, awake for the whole run"): """
        reward.reward_model.rollout.tensor_model_parallel_size
        reward.reward_model.rollout.data_parallel_size
        reward.reward_model.rollout.expert_parallel_size
        reward.reward_model.rollout.pipeline_model_parallel_size
        reward.reward_model.rollout.free_cache_engine
        reward.reward_model.rollout.cudagraph_capture_sizes
        reward.reward_model.rollout.layered_summon
        reward.reward_model.rollout.scheduling_policy
        reward.reward_model.rollout.multi_stage_wake_up
        reward.reward_model.rollout.engine_kwargs
        reward.reward_model.rollout.limit_images
        reward.reward_model.rollout.disable_log_stats
        reward.reward_model.rollout.skip_tokenizer_init
        reward.reward_model.rollout.disaggregation
        reward.reward_model.rollout.quantization
        reward.reward_model.rollout.quantization_config_file
        reward.reward_model.rollout.mtp
    """,
    ("judge request fields verl's reward server does not read either (a request's own fields decide what it "
     "samples)"): """
        reward.reward_model.rollout.n
        reward.reward_model.rollout.do_sample
        reward.reward_model.rollout.ignore_eos
    """,
    ("rollout traces and data-side tool lists: plait's agent loops (rollout.multi_turn, rollout.agent) take "
     "their tools from rollout.multi_turn and keep no rollout trace"): """
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
    ("multimodal plumbing: plait always passes a VL model's processor outputs to every forward"): """
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
        actor_rollout_ref.actor.profiler.tool_config.memray.memory_snapshot_num_steps
        actor_rollout_ref.ref.profiler.tool_config.memray.memory_snapshot_num_steps
        actor_rollout_ref.rollout.profiler.tool_config.memray.memory_snapshot_num_steps
        critic.profiler.tool_config.memray.memory_snapshot_num_steps
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
    ("verl extension points by class or module path (sampler, data generator, reward "
     "manager and reward loop classes, async servers, external model libraries, optimizer "
     "classes): plait's components are chosen by name"): """
        actor_rollout_ref.actor.optim.optimizer
        actor_rollout_ref.actor.optim.optimizer_impl
        actor_rollout_ref.actor.optim.override_optimizer_config
        actor_rollout_ref.model.hf_config_path
        actor_rollout_ref.model.external_lib
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
     "critic.ppo_micro_batch_size_per_gpu; the sum of squared probabilities is computed when "
     "algorithm.adv_estimator needs it)"): """
        actor_rollout_ref.actor.calculate_sum_pi_squared
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
        trainer.rollout_data_dir
        trainer.validation_data_dir
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
     "rollout traces, custom checkpoint-engine backends): plait's rollout serves "
     "generation from its own engine"): """
        actor_rollout_ref.rollout.disaggregation
        actor_rollout_ref.rollout.router_config_path
        actor_rollout_ref.rollout.moe_load_balance_metrics_interval
        actor_rollout_ref.rollout.full_determinism
        actor_rollout_ref.rollout.server
        actor_rollout_ref.rollout.trace.project_name
        actor_rollout_ref.rollout.trace.experiment_name
        actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module
        data.function_tool_path
    """,
    ("verl 0.9 multimodal inputs (audio, processor arguments, images per prompt): plait takes images with "
     "the processor's saved settings"): """
        data.mm_processor_kwargs
        actor_rollout_ref.actor.num_images_in_input
    """,
    ("verl 0.9's TransferQueue, the V1 trainer's store of prompts and trajectories between roles (verl 0.9.1 "
     "turns it on for every V1 run): plait keeps them in the trainer's own buffer"): """
        transfer_queue
    """,
    "verl 0.9 subsystems plait does not have (rollout skipping/caching); each refuses to be enabled": """
        skip
        ray_kwargs.ray_init.runtime_env.py_executable
    """,
    ("the V1 trainer's hybrid-rollout switch tuning and its empty sync section: plait does not lend the "
     "trainer's devices to generation (enable_switch=true is refused), and verl's sync mode has no keys"): """
        trainer.v1.separate_async.hybrid_rollout
        trainer.v1.sync
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
    ("keys no code of verl (volcengine/verl b178a3c) or verl-recipe reads: a script adds them with '+', and "
     "verl ignores them too"): """
        data.min_response_length
        trainer.rl_logging_board_dir
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


# Keys of the no-effect table that change what is trained, scored or sampled once set away from verl's
# default: accepted at the values listed (a verl YAML copies every default), refused at any other value
# (and any sub-key of a dict-valued one) in one line naming the key and what it would have changed.
_DEFAULT_ONLY = {
    "tokenizer (plait tokenizes with the model's own tokenizer)": ((None,), """
        actor_rollout_ref.model.tokenizer_path data.tokenizer critic.model.tokenizer_path"""),
    "chat template (the critic scores the actor's tokens; the actor's is actor_rollout_ref.model.custom_chat_template)": (
        (None, {}), """
        critic.model.custom_chat_template"""),
    "model config (plait loads the checkpoint's config.json as is)": ((None, {}), """
        critic.model.override_config reward_model.model.override_config
        actor_rollout_ref.model.hf_config_path critic.model.hf_config_path"""),
    "optimizer (plait trains with torch.optim.AdamW and the optim.* keys)": ((None, {}, "AdamW", "adamw", "torch.optim"), """
        actor_rollout_ref.actor.optim.optimizer actor_rollout_ref.actor.optim.optimizer_impl
        actor_rollout_ref.actor.optim.override_optimizer_config critic.optim.optimizer critic.optim.optimizer_impl
        critic.optim.override_optimizer_config"""),
    "sampler or data generator class (plait reads the rows of data.train_files in its own order; verl 0.9.1 itself has "
    "neither key: its data config dropped data.sampler and data.datagen)": ((None,), """
        data.sampler.class_path data.sampler.class_name data.datagen.path data.datagen.name"""),
    "image processing (plait resizes each image by its own min_pixels / max_pixels and the processor's saved "
    "settings)": ((None, {}), """
        data.mm_processor_kwargs"""),
    "rows kept (plait trains and validates on every row)": ((None, -1), """
        data.train_max_samples data.val_max_samples"""),
    "adapters (plait's LoRA is actor_rollout_ref.model.lora_rank on the actor only)": ((None, 0, [], "none"), """
        critic.model.lora_rank critic.model.lora_adapter_path
        actor_rollout_ref.model.lora.rank critic.model.lora.rank critic.model.lora.adapter_path
        actor_rollout_ref.model.lora.adapter_path"""),
    "quantization or multi-token prediction (plait trains and samples the plain model)": ((None, False), """
        reward.reward_model.rollout.quantization reward.reward_model.rollout.quantization_config_file
        reward.reward_model.rollout.mtp
        actor_rollout_ref.actor.qat.enable actor_rollout_ref.rollout.qat.enable
        actor_rollout_ref.actor.fsdp_config.qat.enable actor_rollout_ref.ref.fsdp_config.qat.enable
        actor_rollout_ref.rollout.quantization actor_rollout_ref.rollout.quantization_config_file
        actor_rollout_ref.model.mtp.enable_train actor_rollout_ref.rollout.mtp.enable_train critic.model.mtp.enable_train"""),
    "MoE router replay (plait's forward routes as the model does)": ((None, False, "disabled"), """
        actor_rollout_ref.actor.router_replay.mode actor_rollout_ref.ref.router_replay.mode
        actor_rollout_ref.rollout.enable_rollout_routing_replay"""),
    "rollout samples (plait generates every response to the end and keeps it)": ((None, 0, 0.0, False), """
        actor_rollout_ref.rollout.skip_rollout"""),
    "rollout log-probs (plait's engines return the sampling distribution's log-probs, verl's processed_logprobs)":
        (("processed_logprobs",), "actor_rollout_ref.rollout.logprobs_mode"),
}
SEMANTIC: dict[str, tuple[tuple, str]] = {key: (values, what) for what, (values, keys) in _DEFAULT_ONLY.items()
                                          for key in keys.split()}


def semantic_refusal(key: str, value) -> str | None:
    """Why `key=value` is refused when `key` (or a dict-valued key above it) is in SEMANTIC and set away
    from verl's default; None otherwise."""
    parts = key.split(".")
    for i in range(len(parts), 0, -1):
        top = ".".join(parts[:i])
        if top in SEMANTIC and (top != key or value not in SEMANTIC[top][0]):
            return (f"changes the {SEMANTIC[top][1]}; plait does not implement it, so the run would train as if "
                    "it were unset: drop it")
    return None


# Fields plait reads whose verl meaning is machinery plait does differently: named at start when set
# away from verl's default (the value), with what plait does instead.
FIELD_NO_EFFECT = {
    "algorithm.filter_groups.max_inflight_gen_batches": (1, "concurrent generation while dynamic sampling fills a "
        "batch: plait generates the extra batches one at a time (the same groups are kept, only slower)"),
    "actor_rollout_ref.rollout.agent.num_workers": (8, "the size of verl's pool of agent-loop worker processes: plait "
        "runs every agent loop of a rollout on one event loop beside its engine (the same rows, in the same order)")}

# verl 0.9 switches of subsystems whose other keys have no effect here: turning one on is refused.
ENABLES = {"trainer.v1.separate_async.hybrid_rollout.enable_switch": (
               "lending the trainer's devices to generation between steps (verl's hybrid rollout switch): plait's "
               "separated rollout is one engine on workers of its own, and the trainer's workers hold no second engine "
               "to lend (on a CPU machine the two share the same cores anyway)"),
           **{f"skip.{part}.enable": "skipping rollouts from a dump (skip.*)" for part in ("rollout", "rollout_tq", "async_rollout")}}


# verl's other training engines (config groups model_engine=..., their own actor configs, strategies and key trees)
OTHER_ENGINES = {"megatron": "Megatron-LM", "mlite": "Megatron Lite", "veomni": "VeOmni", "torchtitan": "TorchTitan"}


def other_engine(key: str, value) -> str | None:
    """The verl training engine plait does not have that `key=value` selects or configures, if any."""
    text = str(value).lower() if isinstance(value, str) else ""
    for name in OTHER_ENGINES:
        if (name in key.split(".") or (key.endswith(".strategy") and text == name)
                or (key == "model_engine" and text == name) or ("@" in key and text.startswith(f"{name}_"))):
            return name
    return None


def refusal(user: dict[str, object]) -> tuple[str, object, str] | None:
    """(key, value, why) when plait cannot run a verl config at all, given the leaf keys the user set; another
    training engine is named first, whatever the order of the keys."""
    for key, value in user.items():
        engine = other_engine(key, value)
        if engine:
            return key, value, (f"{OTHER_ENGINES[engine]} is not supported (one of verl's training engines): plait "
                                "trains with PyTorch (strategy fsdp or fsdp2); drop model_engine and the engine's keys "
                                f"(*.{engine}.*) and set actor_rollout_ref.actor.strategy=fsdp")
    for key, value in user.items():
        recipe = next((RECIPE_KEYS[p] for p in _prefixes(key) if p in RECIPE_KEYS), None)
        if recipe:
            return key, value, (f"a key of verl's {recipe} recipe, which plait does not implement (it would "
                                "otherwise train plain PPO/GRPO; docs/verl.md lists the recipes it runs)")
        why = semantic_refusal(key, value)
        if why:
            return key, value, why
        if key in ENABLES and value not in (None, False, "sync"):
            return key, value, f"{ENABLES[key]} is not supported in plait (docs/verl.md); drop the key or set it off"
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


# -- where verl's scripts name their machine ------------------------------------------------------
#
# An Ascend script (trainer.device=npu, global_profiler.tool=npu) trains the same model with the same
# algorithm as on a GPU: the device is machinery. plait runs on what this machine has and says so.
# A checkpoint that verl would write without the optimizer (save_contents=[hf_model]) is written whole.

def machine_notes(tree: dict) -> list[str]:
    """Take the machine choices plait does not make from `tree`, in place; one notice line for each."""
    notes = []
    trainer, profiler = tree.get("trainer"), tree.get("global_profiler")
    if isinstance(trainer, dict) and trainer.get("device") == "npu":
        del trainer["device"]
        notes.append("plait: trainer.device=npu: Ascend NPUs are not supported; plait runs on what this machine has "
                     "(trainer.device=auto: CUDA when available, else CPU) with the same model and algorithm")
    if isinstance(profiler, dict) and profiler.get("tool") == "npu":
        profiler["tool"] = None
        notes.append("plait: global_profiler.tool=npu: Ascend's profiler does not run here, so no profile is taken "
                     "(global_profiler.tool=torch, torch_memory, memray or nsys profile on this machine)")
    turbo = [key for key in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
             if (_node(tree, key) or {}).get("strategy") == "fsdp_turbo"]
    for key in turbo:
        _node(tree, key)["strategy"] = "fsdp2"
    if turbo:
        notes.append(f"plait: {', '.join(f'{k}.strategy' for k in turbo)}=fsdp_turbo: verl's FSDP-Turbo engine is FSDP2 with "
                     "its own sharding plans and fused kernels (the same training); plait shards with FSDP2 (strategy=fsdp2)")
    node, whole = _node(tree, "actor_rollout_ref.actor.checkpoint"), ["model", "optimizer", "extra"]
    contents = node.get("save_contents") if node is not None else None
    if isinstance(contents, list) and set(contents) <= {*whole, "hf_model"} and not set(whole) <= set(contents):
        node["save_contents"] = [*whole, *(c for c in contents if c not in whole)]
        notes.append(f"plait: actor_rollout_ref.actor.checkpoint.save_contents={contents}: plait's checkpoints always "
                     "hold the model, optimizer and extra (what a resume needs), so they are written too")
    return notes


def _node(tree: dict, dotted: str) -> dict | None:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree if isinstance(tree, dict) else None


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
    "recipe.spo.spo_main_ppo": "SPO (single-stream policy optimisation)",
    "recipe.gvpo.gvpo_main_ppo": "GVPO",
    "recipe.partial_rollout.main_ppo": "partial rollout",
    "recipe.async_flow.grpo_main": "async flow",
    "recipe.dynamo.main_dynamo": "Dynamo",
    "recipe.atropos.main_atropos": "Atropos",
    "recipe.reward_queue.main": "the reward queue",
    "recipe.dance_grpo.main_dance": "DanceGRPO",
    "recipe.dapo.dapo_transfer_queue.main_dapo": "DAPO on the transfer queue",
    "verl.trainer.main_ppo_split": "split placement (main_ppo_split.py)",
    "recipe.split_placement.main_ppo_split": "split placement (main_ppo_split.py)",
    "verl.experimental.transfer_queue.main_ppo": "the transfer-queue trainer",
    "recipe.transfer_queue.main_ppo": "the transfer-queue trainer",
}
# Keys only a refused recipe reads: named with the recipe instead of as unknown.
# A key here names a leaf or a section (every key under it).
RECIPE_KEYS = {
    **dict.fromkeys(("data.filter_accuracy", "data.accuracy_lower_bound", "data.accuracy_upper_bound",
                     "data.oversample_factor", "data.filter_truncate", "reward_model.prime_granularity",
                     "reward_model.prime_norm", "reward_model.mini_batch_size", "reward_model.model.ref_path",
                     "reward_model.model.ref_type", "reward_model.model.update", "reward_model.model.beta_train",
                     "reward_model.model.loss_type", "reward_model.model.optim"), "PRIME"),
    "algorithm.sppo_eta": "SPPO", "actor_rollout_ref.actor.sppo_eta": "SPPO",
    "actor_rollout_ref.actor.dpo_beta": "SPIN", "trainer.ref_update_freq": "SPIN",
    "actor_rollout_ref.actor.gvpo_beta": "GVPO", "trainer.spo": "SPO", "algorithm.tb_coef": "FlowRL"}


def _prefixes(key: str) -> list[str]:
    parts = key.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


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


# -- an empty value where verl reads null ------------------------------------------------------------
#
# `key=$VAR` with VAR unset reaches Hydra as `key=`, the empty string. verl reads these keys by
# truthiness (or never, in the mode that leaves them unset), so '' means what null means there;
# plait drops them from the tree (its default, null, applies). Every other key keeps '' as a value
# and is checked as one: an empty model path, data file or number is still refused.
EMPTY_IS_NULL = (
    "trainer.resume_from_path",              # read only with resume_mode=resume_path (ray_trainer._load_checkpoint)
    "global_profiler.save_path",             # the profilers' `save_path or "outputs/profile"`
    "reward.custom_reward_function.path",    # get_custom_reward_fn: `if not module_path: return None`
    "trainer.rollout_data_dir", "trainer.validation_data_dir",   # `if rollout_data_dir:` / `if val_data_dir:`
    "data.tool_config_path", "actor_rollout_ref.rollout.multi_turn.tool_config_path",  # `if tool_config_path`
    "data.custom_cls.path",                  # `if data_config.custom_cls.get("path", None)`
    "actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module",  # `custom_backend_module or None`
)


def drop_empty(tree: dict) -> None:
    """Take each EMPTY_IS_NULL key whose value is '' out of `tree`, in place (and the sections it
    leaves empty: an empty section of a no-effect tree is not a key the user set)."""
    for key in EMPTY_IS_NULL:
        parts, path = key.split("."), [tree]
        for part in parts[:-1]:
            path.append(path[-1].get(part) if isinstance(path[-1], dict) else None)
        if not isinstance(path[-1], dict) or path[-1].get(parts[-1]) != "":
            continue
        del path[-1][parts[-1]]
        for node, parent, part in reversed(list(zip(path[1:], path[:-1], parts))):
            if node:
                break
            del parent[part]


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
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise ConfigError("defaults", entry, f"{where}: a defaults entry names a config inside the config search path "
                                             f"({', '.join(dict.fromkeys(search))}), as Hydra resolves it; an absolute "
                                             "path or '..' reaches outside it")
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
MAX_VALUE_CHARS = 100_000   # an interpolated value longer than this is a bomb, not a config
MAX_SUBSTITUTIONS = 1_000   # per value: a key's value is resolved once, so only a runaway string gets here


def resolve_interpolations(tree: dict, defaults: dict) -> dict:
    """Replace verl's `${key}`, `${.key}`, `${oc.select:key,default}` and `${oc.env:VAR,default}` with
    their values (the tree's own, else plait's default for that key); drop `???` values. Each key is
    resolved once (memoised), a key that needs itself is an interpolation loop, and a value that
    outgrows MAX_VALUE_CHARS is refused: one ConfigError line each, in time linear in the tree.
    Over 60 lines: four closures share one memo and one chain of keys in resolution; split, that state
    would be parked on an object."""
    done: dict[str, object] = {}
    chain: list[str] = []  # the keys being resolved, outermost first

    def lookup(key: str, here: str):
        if key.startswith("."):
            key = here.rsplit(".", 1)[0] + key if "." in here else key[1:]
        if key in done:
            return done[key]
        if key in chain:
            loop = " -> ".join([*chain[chain.index(key):], key])
            raise ConfigError(chain[-1], "${" + key + "}", f"an interpolation loop: {loop}")
        for source in (tree, defaults):
            node = source
            for part in key.split("."):
                node = node.get(part, _MISSING) if isinstance(node, dict) else _MISSING
            if node is not _MISSING:
                chain.append(key)
                done[key] = resolve(node, key)
                chain.pop()
                return done[key]
        return _MISSING

    def one(expr: str, here: str):
        kind, _, rest = expr.partition(":") if expr.startswith("oc.") else ("", "", expr)
        key, _, fallback = rest.partition(",")
        if kind == "oc.env":
            return os.environ.get(key.strip(), load_yaml(fallback) if fallback else None)
        value = lookup(key.strip(), here)
        if value is _MISSING:
            if kind == "oc.select":
                return resolve(load_yaml(fallback), here) if fallback.strip() else None
            raise ConfigError(here, "${" + expr + "}", f"refers to {key.strip()}, which neither the file nor plait's tree has")
        return value

    def resolve(value, here: str):
        for _ in range(MAX_SUBSTITUTIONS):
            match = INTERPOLATION.search(value) if isinstance(value, str) else None
            if match is None:  # innermost first: ${oc.select:a,${oc.select:b,null}} resolves b, then a
                return value
            got = one(match.group(1), here)
            if match.span() == (0, len(value)):  # the whole value: keep the type (a number, a list)
                return got
            value = value[:match.start()] + ("null" if got is None else str(got)) + value[match.end():]
            if len(value) > MAX_VALUE_CHARS:
                raise ConfigError(here, value[:60] + "...",
                                  f"its interpolations expand past {MAX_VALUE_CHARS} characters")
        raise ConfigError(here, value[:60] + "...", f"more than {MAX_SUBSTITUTIONS} interpolations in one value")

    def walk(node, prefix: str):
        out = {}
        for key, value in node.items():
            here = f"{prefix}{key}"
            if isinstance(value, dict):
                out[key] = walk(value, f"{here}.")
            else:
                chain.append(here)
                resolved = resolve(value, here)
                chain.pop()
                if resolved != "???":
                    out[key] = resolved
        return out
    return walk(tree, "")


_MISSING = object()
