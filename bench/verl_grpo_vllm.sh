#!/usr/bin/env bash
# verl's GRPO example (examples/grpo_trainer/run_qwen2-7b.sh) with rollout.name=vllm and its usual vLLM
# keys, run unchanged but for paths and sizes: SmolLM2-135M-Instruct, plait's built-in arithmetic task,
# 3 steps. Run in the vLLM environment (docs/rollout.md). Pick the mode, backend and (sync) placement with
#   MODE=sync|one_step_off|fully_async  BACKEND=local|ray  PLACEMENT=colocated|separated \
#     bench/verl_grpo_vllm.sh [more overrides]
# bench/vllm_modes.py runs every combination and writes bench/results/vllm_modes.json.
set -euo pipefail
MODEL=${MODEL:-$(python -c "from plait.models import smollm2_dir; print(smollm2_dir())")}
MODE=${MODE:-sync}
BACKEND=${BACKEND:-local}
PLACEMENT=${PLACEMENT:-colocated}
[ "$MODE" = sync ] || PLACEMENT=separated  # the async modes need their own rollout
OUT=${OUT:-outputs/verl_grpo_vllm/$MODE-$PLACEMENT-$BACKEND}
case $MODE in
  sync) PLACE=(trainer.placement="$PLACEMENT");;
  one_step_off) PLACE=(trainer.mode=one_step_off trainer.placement=separated);;
  fully_async) PLACE=(trainer.mode=fully_async trainer.placement=separated async_training.staleness_threshold=1
                      async_training.partial_rollout=True async_training.trigger_parameter_sync_step=1);;
esac
RAY=()
[ "$BACKEND" = ray ] && RAY=(trainer.backend=ray trainer.ray.num_cpu_workers=1 trainer.ray.cpus_per_worker=1)
plait train --no-progress \
    algorithm.adv_estimator=grpo \
    data.train_batch_size=8 \
    data.max_prompt_length=128 \
    data.max_response_length=32 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=4 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.actor.use_kl_loss=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.enable_chunked_prefill=True \
    actor_rollout_ref.rollout.max_num_batched_tokens=4096 \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name="smollm2_vllm_${MODE}_$PLACEMENT" \
    trainer.n_gpus_per_node=1 \
    trainer.nnodes=1 \
    trainer.save_freq=-1 \
    trainer.test_freq=-1 \
    trainer.total_training_steps=3 \
    trainer.default_local_dir="$OUT" \
    global_profiler.tool=torch global_profiler.steps='[1]' global_profiler.save_path="$OUT/profile" \
    actor_rollout_ref.rollout.profiler.enable=True \
    "${PLACE[@]}" "${RAY[@]}" "$@"
