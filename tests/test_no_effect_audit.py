"""The no-effect audit: every verl key plait accepts without effect, and every data column it reads
or ignores, is classified machinery (cluster sizes, engine tuning, kernels, logging) or semantic
(what is trained, scored or sampled). A semantic key is implemented or refused in one line naming
it; this test walks config_verl.NO_EFFECT and fails on any key in a class marked semantic that
plait would accept away from verl's default.
"""

import json
import re

import pytest
import torch

from plait.config import load_config
from plait.config_verl import ENABLES, NO_EFFECT, RECIPE_KEYS, SEMANTIC
from plait.configtree import ConfigError

# Classes of the no-effect table, by pattern over the dotted key (first match wins).
CLASSES = [
    # owned by the agent-loop issue (issue 28), which implements them: refused or implemented there
    ("agent loop", "agent-loop", r"rollout\.(multi_turn|agent)\.|^data\.(tool_config_path|function_tool_path)$"),
    ("semantic switch, refused when set away from verl's default", "refused", None),  # SEMANTIC / ENABLES / recipes
    ("multimodal options, inert: images take the processor's saved settings; videos and audio are refused",
     "inert", r"return_multi_modal_inputs|mm_processor_kwargs|num_images_in_input"),
    ("options read only when a refused switch is on", "inert",
     r"^algorithm\.pf_ppo\.|critic\.model\.(lora_alpha|target_modules|exclude_modules)$|\.(qat|lora)$|"
     r"router_replay\.(record|replay)_file$|^(distillation|transfer_queue|skip)$|\.mtp$|"
     r"^trainer\.v1\.(separate_async\.hybrid_rollout|sync)$|"
     r"^critic\.model\.mtp$|rollout\.quantization_config_file$"),
    ("sharding, parallelism, kernels, compile, precision, memory", "machinery",
     r"fsdp_config|^critic\.fsdp$|ulysses|torch_compile|fused_kernel|use_liger|tiled_mlp|use_shm|activation_offload|"
     r"entropy_checkpointing|entropy_from_logits|prefix_grouper|hybrid_engine|nccl_timeout|layered_summon|"
     r"pad_to_length|sum_pi_squared|use_remove_padding|torch_dtype|^reward_model\.(strategy|model\.fsdp_config)|"
     r"calculate_entropy|^model_engine$"),
    ("engine tuning, serving and traces", "machinery",
     r"rollout\.(cudagraph|data_parallel|expert_parallel|pipeline_model|scheduling_policy|disable_log_stats|"
     r"multi_stage_wake_up|engine_kwargs|skip_tokenizer_init|prometheus|prompt_length|response_length|"
     r"disaggregation|router_config_path|moe_load_balance|full_determinism|checkpoint_engine|skip_dump_dir|trace|"
     r"sglang_rollout_mode$|server$)|"
     r"^reward\.reward_model\.rollout$"),
    ("profiler", "machinery", r"profiler"),
    # speculative decoding with a model's MTP heads samples the same distribution; training them is refused
    ("multi-token-prediction decoding", "machinery", r"\.mtp\.(enable|enable_rollout|detach_encoder|speculative_\w+|"
     r"method|num_speculative_tokens|mtp_loss_scaling_factor)$"),
    # verl 0.9.1 reads use_rollout_log_probs nowhere (a field of its actor config only); the recipes'
    # rollouter sizes are plait's async_training.* and trainer.total_training_steps
    ("async recipe plumbing", "machinery",
     r"^(async_training\.|rollout\.)|^data\.gen_batch_size$|checkpoint_engine|use_rollout_log_probs$"),
    ("cluster, storage, Ray, dataloader workers, logging and checkpoint files", "machinery",
     r"rollout_n$|data_loader_seed|async_save|dataloader_num_workers|filter_overlong_prompts_workers|"
     r"^reward_model\.(micro_batch_size|launch_reward_fn_async|use_reward_loop|use_dynamic_bsz|"
     r"forward_max_token_len_per_gpu|model\.use_remove_padding|model\.use_fused_kernels)$|^trainer\.(balance_batch|"
     r"esi_redundant_time|default_hdfs_dir|del_local_ckpt_after_load|ray_wait_register_center_timeout|"
     r"use_legacy_worker_impl|rollout_data_dir|validation_data_dir|tensorboard_dir|log_freq|debug|use_v1|"
     r"checkpoint_callback_class)$|^ray_kwargs\.|^transfer_queue\.enable$|checkpoint\.(save|load)_contents$|"
     r"checkpoint\.strict$|^data\.(return_raw_input_ids|return_full_prompt|validation_shuffle|trust_remote_code)$|"
     r"^critic\.shuffle$|external_lib$"),
    # verl 0.9.1 reads these nowhere either: older rollout-correction spellings (its RolloutCorrectionConfig has
    # rollout_rs_threshold), over_sample_rate (a field of its rollout config only) and DeepEyes' '+' key
    # trainer.rl_logging_board_dir (no code of verl or verl-recipe reads it)
    ("keys verl 0.9.1 does not read either", "machinery",
     r"^algorithm\.rollout_correction\.(rollout_rs_threshold_lower|rollout_token_veto_threshold)$|"
     r"^actor_rollout_ref\.rollout\.over_sample_rate$|^data\.min_response_length$|^trainer\.rl_logging_board_dir$"),
    ("deprecated global micro-batch sizes and derived keys", "machinery",
     r"(ppo_micro_batch_size|log_prob_micro_batch_size|forward_micro_batch_size|forward_micro_batch_size_per_gpu)$"),
]
MARKED_SEMANTIC = ("agent-loop", "refused")


def refused_here(key: str) -> bool:
    """A semantic switch plait refuses when it is on: SEMANTIC, a subsystem's enable, a recipe's key."""
    return key in SEMANTIC or key in ENABLES or key in RECIPE_KEYS


def classify(key: str) -> tuple[str, str]:
    if refused_here(key):
        return CLASSES[1][:2]
    for name, kind, pattern in CLASSES:
        if pattern and re.search(pattern, key):
            return name, kind
    return "unclassified", "semantic"


def test_every_no_effect_key_is_machinery_or_refused_when_set():
    unclassified = [key for key in NO_EFFECT if classify(key)[1] == "semantic"]
    assert not unclassified, f"classify these (machinery, or refuse them when set): {unclassified}"


def test_no_key_of_a_semantic_class_has_no_effect_silently():
    # Each key of the classes marked semantic is refused at any value but verl's default (or left to its owner).
    for key in NO_EFFECT:
        name, kind = classify(key)
        if kind == "refused":
            assert key in SEMANTIC or key in ENABLES, key
        assert kind not in ("semantic",), (key, name)


# One value each that turns a semantic key on; every SEMANTIC key is listed (checked below).
ON = {
    "actor_rollout_ref.model.tokenizer_path": "/elsewhere", "data.tokenizer": "/elsewhere",
    "critic.model.tokenizer_path": "/elsewhere",
    "critic.model.custom_chat_template": "{{ x }}", "critic.model.override_config.x": 1,
    "reward_model.model.override_config.x": 1, "actor_rollout_ref.model.hf_config_path": "/elsewhere",
    "critic.model.hf_config_path": "/elsewhere", "actor_rollout_ref.actor.optim.optimizer": "SGD",
    "actor_rollout_ref.actor.optim.optimizer_impl": "bitsandbytes.optim",
    "actor_rollout_ref.actor.optim.override_optimizer_config.betas": [0.9, 0.95], "critic.optim.optimizer": "Muon",
    "critic.optim.optimizer_impl": "torchao.optim", "critic.optim.override_optimizer_config.eps": 1e-6,
    "data.sampler.class_path": "my.py",
    "data.sampler.class_name": "Curriculum", "data.datagen.path": "my.py", "data.datagen.name": "Gen",
    "data.train_max_samples": 100, "data.val_max_samples": 10, "critic.model.lora_rank": 8,
    "critic.model.lora_adapter_path": "/adapter", "actor_rollout_ref.model.lora.rank": 8, "critic.model.lora.rank": 8, "critic.model.lora.adapter_path": "/a",
    "actor_rollout_ref.model.lora.adapter_path": "/a", "actor_rollout_ref.actor.qat.enable": True,
    "actor_rollout_ref.rollout.qat.enable": True, "actor_rollout_ref.actor.fsdp_config.qat.enable": True,
    "actor_rollout_ref.ref.fsdp_config.qat.enable": True, "actor_rollout_ref.rollout.quantization": "fp8",
    "actor_rollout_ref.rollout.quantization_config_file": "/q.json", "actor_rollout_ref.model.mtp.enable_train": True,
    "actor_rollout_ref.rollout.mtp.enable_train": True, "critic.model.mtp.enable_train": True,
    "actor_rollout_ref.actor.router_replay.mode": "R3", "actor_rollout_ref.ref.router_replay.mode": "R2",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": True, "actor_rollout_ref.rollout.skip_rollout": True, "actor_rollout_ref.rollout.logprobs_mode": "raw_logprobs",
    "data.mm_processor_kwargs": "{max_pixels: 3136}",
}


def test_every_semantic_key_has_an_on_value_here():
    assert {k for k in SEMANTIC} <= {next(p for p in (k, k.rsplit(".", 1)[0]) if p in SEMANTIC) for k in ON}


@pytest.mark.parametrize("key", sorted(ON))
def test_a_semantic_key_set_is_refused_in_one_line_naming_it(key):
    value = ON[key]
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"+{key}={value!r}" if isinstance(value, str) else f"+{key}={value}"])
    assert str(err.value).startswith(f"{key}=") and "\n" not in str(err.value)
    assert "would train as if it were unset" in str(err.value)


@pytest.mark.parametrize("key", sorted(SEMANTIC))
def test_a_semantic_key_at_verl_default_loads(key, capsys):
    values = SEMANTIC[key][0]
    value = "null" if values[0] is None else ("{}" if values[0] == {} else values[0])
    load_config(None, [f"+{key}={value}"])


# Data columns: what plait reads, and what it refuses or leaves to their owners (verl's row format).
COLUMNS = {
    "prompt": "read (data.prompt_key): the prompt",
    "data_source": "read (data.reward_fn_key): picks the rule reward",
    "reward_model": "read: ground_truth, the reward's answer; style is verl's label for it, read by no verl scorer",
    "extra_info": "read: handed to the reward function; index names the row",
    "ability": "machinery: a label no verl scorer reads",
    "images": "refused (data.image_key) with a text model; read with Qwen2-VL / Qwen2.5-VL (docs/vlm.md)",
    "videos": "refused (data.video_key)",
    "audios": "refused (data.audio_key)",
    # owned by the agent loop (issue 28), which implements them: the agent_name column and the tool and
    # interaction arguments verl's multi-turn rows carry in extra_info
    "agent_name": "agent loop", "extra_info.tools_kwargs": "agent loop", "extra_info.interaction_kwargs": "agent loop",
    "extra_info.need_tools_kwargs": "agent loop",
}


def test_the_columns_plait_refuses_are_the_multimodal_ones():
    from plait.config import DataConfig
    refused = {column for column, what in COLUMNS.items() if what.startswith("refused")}
    d = DataConfig()
    assert refused == {d.image_key, d.video_key, d.audio_key}  # verl's default column names


@pytest.mark.parametrize("column", ["images", "videos", "audios"])
def test_a_row_with_media_is_refused_in_one_line(tmp_path, column):
    import json

    from plait.data.dataset import load_dataset
    from plait.models import create_tiny_model, load_tokenizer
    tokenizer = load_tokenizer(create_tiny_model(tmp_path / "m", size="xs"))
    rows = [{"prompt": "1+1=", "data_source": "arithmetic", "reward_model": {"ground_truth": "2"}},
            {"prompt": "2+2=", "data_source": "arithmetic", "reward_model": {"ground_truth": "4"},
             column: [{"bytes": "xx"}]}]
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    keys = {"data.image_key": "images", "data.video_key": "videos", "data.audio_key": "audios"}
    with pytest.raises(ConfigError) as err:
        load_dataset("data.train_files", [str(path)], tokenizer, media_keys=keys)
    message = str(err.value)
    assert "\n" not in message and "row 1" in message and repr(column) in message
    assert "training would drop them" in message
    rows[1][column] = []  # an empty column is a text row
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert len(load_dataset("data.train_files", [str(path)], tokenizer, media_keys=keys)) == 2


def test_override_config_is_set_over_the_checkpoints_config(tmp_path):
    # verl's actor_rollout_ref.model.override_config: every role loads the model with the keys set over config.json
    from plait.models import create_tiny_model, load_causal_lm
    from plait.build import resolve_model
    base = create_tiny_model(tmp_path / "m", size="xs")
    cfg = load_config(None, [f"actor_rollout_ref.model.path={base}", f"trainer.default_local_dir={tmp_path}/out",
                             "+actor_rollout_ref.model.override_config.attention_dropout=0.25",
                             "+actor_rollout_ref.model.override_config.embd_pdrop=0.0"])
    path = resolve_model(cfg)
    model, plain = load_causal_lm(path), load_causal_lm(base)
    assert model.config.attention_dropout == 0.25 and plain.config.attention_dropout == 0.0
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    cfg.actor_rollout_ref.model.override_config = {}
    assert resolve_model(cfg) == base


@pytest.mark.parametrize("key, recipe", [("actor_rollout_ref.actor.sppo_eta", "SPPO"), ("trainer.spo.enable", "SPO"),
                                         ("actor_rollout_ref.actor.dpo_beta", "SPIN"), ("data.filter_truncate", "PRIME"),
                                         ("actor_rollout_ref.actor.gvpo_beta", "GVPO")])
def test_a_recipes_own_key_without_its_entry_point_is_refused_naming_it(key, recipe):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"+{key}=0.1"])
    assert str(err.value).startswith(f"{key}=") and f"verl's {recipe} recipe" in str(err.value)


def test_max_inflight_gen_batches_is_named_at_start(capsys):
    load_config(None, ["algorithm.filter_groups.max_inflight_gen_batches=4"])
    err = capsys.readouterr().err
    assert "algorithm.filter_groups.max_inflight_gen_batches" in err and "one at a time" in err
    load_config(None, ["algorithm.filter_groups.max_inflight_gen_batches=1"])
    assert "max_inflight" not in capsys.readouterr().err


def test_apply_chat_template_kwargs_reach_the_template(tmp_path):
    from plait.data.dataset import PromptDataset
    from plait.models import create_tiny_model, load_tokenizer
    tokenizer = load_tokenizer(create_tiny_model(tmp_path / "m", size="xs"))
    tokenizer.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                               "{% if reasoning_effort %}<{{ reasoning_effort }}>{% endif %}=")
    row = {"prompt": [{"role": "user", "content": "1+1"}], "data_source": "arithmetic", "reward_model": {"ground_truth": "2"}}
    plain = PromptDataset([row], tokenizer)
    told = PromptDataset([row], tokenizer, chat_template_kwargs={"reasoning_effort": "low"})
    assert (plain[0].prompt_text, told[0].prompt_text) == ("1+1=", "1+1<low>=")
    cfg = load_config(None, ["+data.apply_chat_template_kwargs.reasoning_effort=medium"])
    assert cfg.data.apply_chat_template_kwargs == {"reasoning_effort": "medium"}


def test_lora_exclude_modules_leaves_those_modules_without_adapters(tmp_path):
    pytest.importorskip("peft")
    from plait.models import add_lora, create_tiny_model, load_causal_lm
    path = create_tiny_model(tmp_path / "m", size="xs")
    names = lambda model: {n for n, _ in model.named_modules() if n.endswith("lora_A")}  # noqa: E731
    every = names(add_lora(load_causal_lm(path), 4, 8, "all-linear"))
    fewer = names(add_lora(load_causal_lm(path), 4, 8, "all-linear", exclude_modules=".*mlp.*"))
    assert any(".mlp." in n for n in every) and not any(".mlp." in n for n in fewer)
    assert fewer == {n for n in every if ".mlp." not in n}
    cfg = load_config(None, ["actor_rollout_ref.model.lora_rank=4", "+actor_rollout_ref.model.exclude_modules=.*mlp.*"])
    assert cfg.actor_rollout_ref.model.exclude_modules == ".*mlp.*"


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "fully_async"])
def test_image_rows_are_refused_before_training_in_every_mode(tmp_path, mode, capsys):
    import json

    from plait.cli import main
    from plait.models import create_tiny_model
    model = create_tiny_model(tmp_path / "m", size="xs")
    rows = [{"prompt": f"{i}+1=", "data_source": "arithmetic", "reward_model": {"ground_truth": str(i + 1)},
             "images": [{"path": "a.png"}] if i == 3 else []} for i in range(8)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    placement = [] if mode == "sync" else ["trainer.placement=separated"]
    rc = main(["train", "--no-progress", f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.rollout.name=hf",
               f"data.train_files={tmp_path / 'train.jsonl'}", "data.train_batch_size=4", f"trainer.mode={mode}",
               *placement, "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"trainer.default_local_dir={tmp_path}/out",
               "data.image_key=images"])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("plait: config error")]
    assert rc == 2 and len(lines) == 1 and "row 3" in lines[0] and "'images' (data.image_key)" in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "out" / "metrics.jsonl").exists()


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}=>{% endif %}"


def test_custom_chat_template_renders_every_prompt_and_trains(tmp_path, tiny_config):
    """verl's actor_rollout_ref.model.custom_chat_template replaces the tokenizer's template: every
    prompt is rendered with it (and the rollout, the agent loops and the checkpoint get that tokenizer)."""
    from plait import driver
    cfg = tiny_config(tmp_path / "out", f"actor_rollout_ref.model.custom_chat_template={json.dumps(TEMPLATE)}",
                      "trainer.total_training_steps=1")
    lc = driver.build(cfg, progress=False)
    item = lc.trainer.cursor.dataset[0]
    assert item.prompt_text.startswith("[user]") and item.prompt_text.endswith("=>")
    assert lc.trainer.tokenizer.decode(item.prompt_ids) == item.prompt_text
    assert lc.run()["training/global_step"] == 1


def test_a_custom_chat_template_that_does_not_render_is_one_line(tmp_path, tiny_config):
    from plait import driver
    cfg = tiny_config(tmp_path / "out", "actor_rollout_ref.model.custom_chat_template='{% for m in messages %}'")
    with pytest.raises(ConfigError) as err:
        driver.build(cfg, progress=False)
    assert str(err.value).startswith("actor_rollout_ref.model.custom_chat_template='{% for m in messages %}': does not "
                                     "render a chat (TemplateSyntaxError: ")
    assert "\n" not in str(err.value)
