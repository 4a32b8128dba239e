"""How much of verl's and verl-recipe's script corpus `plait config show` accepts.

Each `*.sh` under the given folders is run by bash with every external command stubbed out (nothing
is executed: `python`/`python3` record their arguments, any other command does nothing; `set -e/-u/-x`
are dropped, so an unset $VAR is empty, as in a shell where the script's user never set it). The
shell variables are therefore expanded exactly as the script sets them. Each recorded trainer call
(`python3 -m MODULE ...`, also behind `ray job submit --`) is then loaded the way `plait train` loads
it (`plait config show --entry-point MODULE ...`: the tree's checks and the preflight's), with only
what cannot exist here replaced, and recorded as such: model and data paths (a tiny Qwen2, a tiny
classifier, a few arithmetic rows), a reward file (one defining the function the script names: the
recipes' reward files import verl), the output folder, `rollout.name` (`hf`: vLLM and SGLang are not
installed here) and `trainer.logger` (`console`: wandb is not installed here). Relative config and
tool paths are read against the corpus folder's root, as the scripts run from their repository root;
a --config-path under a folder the user is to fill in (`BASEDIR=base_dir`) is found by its
examples/ or recipe/ part.

The variables a SLURM launcher sets (LAUNCHER below: one node of 8 GPUs) are set, as the scripts
that read them are submitted with sbatch; every other unset variable is empty.

A script whose own model or data are a vision-language model or image data (MULTIMODAL) is marked:
its config loads, but plait's text-only trainers refuse its image rows at start, so it is counted
apart in `accepted_text_data` (the data are replaced here, so only the config is measured).

Counted: scripts whose trainer is verl's main_ppo or an entry point plait runs as it
(config_verl.ENTRY_POINTS), Megatron ones apart (skipped), and the scripts verl itself cannot run
(VERL_REJECTS, each with why) apart. Recipes with a trainer of their own (config_verl.REFUSED_RECIPES,
and any other `main*` module) are listed and counted separately. verl-recipe's scripts run from verl's root with the recipes as
its `recipe/` folder (verl's submodule layout: `data.custom_cls.path=recipe/retool/retool.py`). Get
the corpus and run:

    git clone https://github.com/volcengine/verl && git clone https://github.com/verl-project/verl-recipe verl/recipe
    # bench/results/verl_corpus.json: verl b178a3c, verl-recipe 48ea0a7 (git checkout them for the same scripts);
    # bench/results/verl_corpus_1dda039.json: verl-project/verl 1dda039 (verl 0.9.1's main), verl-recipe 48ea0a7
    python bench/verl_corpus.py --corpus examples=verl:examples --corpus recipes=verl:recipe \
        --verl-site .verl-side [--out bench/results/verl_corpus.json]

Training engines other than PyTorch FSDP (Megatron, Megatron Lite, VeOmni, TorchTitan) are counted apart, as
plait refuses each by name; so are on-policy distillation scripts (`distillation.enabled=True`: a second model,
another issue's work) until plait runs them (`distillation`, `distillation_accepted` in the summary).

A script's dataset class (`data.custom_cls`) is imported as `plait train` imports it, from the corpus root
(the scripts' working directory, so its `recipe.*` imports resolve there); with --verl-site (verl 0.9.1
installed aside, as .ci/run installs it) its `verl.*` imports resolve to verl 0.9.1, as for a verl 0.9.1
user (without it, to the corpus' own verl/ folder, which needs verl's dependencies). Tool classes plait
refuses by name are refused here too, as `plait config show` refuses them.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PRELUDE = r"""
command_not_found_handle() {  # `ray job submit ... -- python3 -m ...`, `nohup python3 ...`: the python call is recorded
  local i
  for ((i = 1; i <= $#; i++)); do
    case "${!i}" in python|python3|python3.*|*/python|*/python3) "$CORPUS_STUBS/python3" "${@:i+1}"; return 0;; esac
  done
  if [[ -p /dev/stdin ]]; then while IFS= read -r _; do :; done; fi  # `... | tee log`: read what the call writes
  return 0
}
set() {  # no errexit, nounset or trace: an unset variable is empty, a failing stub is no stop
  local out=() a
  for a in "$@"; do
    if [[ $a == -?* && $a != -- && $a != -o ]]; then a="-${a//[-eux]/}"; [[ $a == - ]] && continue; fi
    out+=("$a")
  done
  builtin set "${out[@]}"
}
cd() { builtin cd "$@" 2>/dev/null; return 0; }
source() { [[ -f $1 ]] && builtin source "$@"; return 0; }
"""
STUB = '#!/bin/bash\nprintf "%s\\0" "$@" > "$CORPUS_CALLS/call.${EPOCHREALTIME/./}.$RANDOM"\n'

LAUNCHER = {"SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "1", "SLURM_GPUS_PER_NODE": "8", "SLURM_CPUS_PER_TASK": "16",
            "SLURM_JOB_NODELIST": "localhost"}
# Scripts verl's own entry point cannot run as written: not counted (their result is still recorded).
VERL_REJECTS = {
    "examples/ppo_trainer/run_deepseek7b_llm_pfppo.sh":
        "line 6 ends in `\\  # [...]`: bash passes ' ' as an argument (Hydra cannot parse it) and the comment ends the "
        "command, so the script's later lines never reach the trainer",
    "examples/ppo_trainer/run_deepseek7b_llm_sandbox_fusion.sh":
        "sets reward_model.reward_manager=prime: verl 0.9.1 looks reward managers up in its reward loop's registry "
        "(naive, dapo, gdpo, limited, remote), which has no prime, so it stops with `Unknown reward manager: prime` "
        "(its sandbox keys load in plait: without that line the script is accepted)",
    "examples/gspo_trainer/run_qwen3_32b_gspo_npu.sh":
        "divides by sp_size (line 66) before setting it (line 72): bash's division by zero leaves "
        "actor_ppo_max_token_len empty, so with use_dynamic_bsz=True verl's dynamic batching gets "
        "ppo_max_token_len_per_gpu='' where it multiplies and compares a number",
    "recipe/entropy/32b_clip_cov.sh":
        "sets actor_rollout_ref.actor.clip_cov_ratio without '+': neither verl's ppo_trainer nor the recipe's "
        "entropy_trainer.yaml has that key (it is actor.policy_loss.clip_cov_ratio), so Hydra refuses the override",
    "recipe/entropy/32b_kl_cov.sh":
        "sets actor_rollout_ref.actor.loss_mode without '+': a key of neither verl's ppo_trainer nor "
        "entropy_trainer.yaml (it is actor.policy_loss.loss_mode), so Hydra refuses the override",
    **dict.fromkeys(("examples/sapo_trainer/run_qwen3_8b_fsdp.sh", "examples/sapo_trainer/run_qwen3_30b_a3b_fsdp.sh"),
        "adds +actor_rollout_ref.actor.policy_loss.tau_pos / tau_neg: verl 0.9.1's PolicyLossConfig has no such fields, "
        "so building the actor's config stops with `PolicyLossConfig.__init__() got an unexpected keyword argument "
        "'tau_pos'` (SAPO's temperatures are actor.tau_pos / tau_neg, which plait implements; with those keys the "
        "script loads)"),
    "recipe/collabllm/train_rl_collabllm.sh":
        "sets reward_model.reward_manager=collabllm, which its reward file registers in verl's legacy registry "
        "(verl.workers.reward_manager); verl 0.9.1 looks managers up in its reward loop's registry (naive, dapo, gdpo, "
        "limited, remote), which stops with `Unknown reward manager: collabllm`",
    **dict.fromkeys((f"recipe/retool/{name}" for name in ("run_gpt_oss_ppo.sh", "run_qwen2-32b_dapo.sh",
                                                          "run_qwen2-32b_ppo.sh", "run_qwen2_7b_dapo.sh")),
        "its dataset class (data.custom_cls, recipe/retool/retool.py) imports verl.tools.sandbox_fusion_tools, which "
        "verl 0.9.1 does not have: verl stops importing it"),
}
# A vision-language model or image data in the script's own model path and data files: plait loads
# the config, but refuses image rows at start (text-only trainers) until the VLM work lands.
MULTIMODAL = re.compile(r"(?i)(^|[^a-z])vl([^a-z]|$)|glm-?4\.?1v|minicpm-?o|geo3k|omniact")
TINY_LM_KEYS = ("actor_rollout_ref.model.path", "critic.model.path", "critic.model.tokenizer_path",
                "reward_model.model.input_tokenizer", "reward.reward_model.input_tokenizer")
CLASSIFIER_KEYS = ("reward_model.model.path", "reward.reward_model.model_path")
REWARD_FILE_KEYS = {"custom_reward_function.path": "custom_reward_function.name",
                    "reward.custom_reward_function.path": "reward.custom_reward_function.name"}
REPO_RELATIVE_KEYS = ("data.custom_cls.path", "actor_rollout_ref.rollout.multi_turn.tool_config_path",
                      "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
                      "actor_rollout_ref.rollout.agent.agent_loop_config_path", "data.tool_config_path")


def trainer_calls(script: Path, root: Path, work: Path) -> list[list[str]]:
    """The argument lists of the script's python calls, in order, as its shell expands them."""
    stubs, calls = work / "stubs", Path(tempfile.mkdtemp(dir=work))
    stubs.mkdir(exist_ok=True)
    for name in ("python", "python3"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    (work / "prelude.sh").write_text(PRELUDE)
    env = {"PATH": str(stubs), "HOME": str(work / "home"), "BASH_ENV": str(work / "prelude.sh"),
           "CORPUS_STUBS": str(stubs), "CORPUS_CALLS": str(calls), **LAUNCHER, "SLURM_SUBMIT_DIR": str(root)}
    try:
        # Output through a pipe: its end waits for a call the script put in the background (`python3 ... &`).
        subprocess.run(["/bin/bash", str(script)], cwd=root, env=env, stdin=subprocess.DEVNULL,
                       capture_output=True, timeout=60)
    except subprocess.TimeoutExpired:
        pass
    return [f.read_bytes().decode(errors="replace").split("\0")[:-1] for f in sorted(calls.iterdir())]


def module_of(args: list[str]) -> tuple[str | None, list[str]]:
    """(MODULE, its arguments) of `[-u] -m MODULE ...`, or of a `.../main_ppo.py`-style script path."""
    for i, a in enumerate(args):
        if a == "-m" and i + 1 < len(args):
            return args[i + 1], args[i + 2:]
        if a.endswith(".py") and not a.startswith("-"):
            return a.removesuffix(".py").lstrip("./").replace("/", "."), args[i + 1:]
        if not a.startswith("-"):
            break
    return None, []


def other_engine(args: list[str]) -> str | None:
    """The training engine other than PyTorch FSDP a call selects (Megatron, Megatron Lite, VeOmni, TorchTitan), if any:
    counted apart, as plait refuses each by name (config_verl.other_engine)."""
    from plait.config_verl import other_engine as engine_of
    if is_megatron(args):
        return "megatron"
    for a in args:
        key, _, value = a.lstrip("+~").partition("=")
        engine = engine_of(key, value)
        if engine:
            return engine
    return None


def is_megatron(args: list[str]) -> bool:
    return any("megatron" in a.split("=", 1)[0].lower() or a.lower().endswith("=megatron")
               or (a.startswith("--config-name") and "megatron" in a) for a in args) or "megatron" in " ".join(
        a for a in args if not a.startswith(("-", "+")) and "=" not in a)


def substitute(args: list[str], fixtures: dict[str, str], root: Path) -> tuple[list[str], list[str]]:
    """`args` with what cannot exist here replaced, and the keys that were."""
    out, replaced = [], []
    names = {k.lstrip("+~"): v for k, v in (a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))}
    flags = iter(args)
    for a in flags:
        if a in ("--config-path", "--config-name"):  # the space-separated form
            a = f"{a}={next(flags, '')}"
        if a.startswith("--config-path="):
            out.append(f"--config-path={config_folder(a.split('=', 1)[1], root)}")
            continue
        if "=" not in a or a.startswith("-"):
            out.append(a)
            continue
        raw, value = a.split("=", 1)
        key, new = raw.lstrip("+~"), None
        if key in TINY_LM_KEYS and value:
            new = fixtures["model"]
        elif key in CLASSIFIER_KEYS and value:
            new = fixtures["classifier"]
        elif key in ("data.train_files", "data.val_files"):
            new = fixtures["train" if key == "data.train_files" else "val"]
        elif key == "trainer.default_local_dir":
            new = fixtures["out"]
        elif key in REWARD_FILE_KEYS and value:
            new = reward_file(names.get(REWARD_FILE_KEYS[key]) or "compute_score", fixtures["out"])
        elif key == "actor_rollout_ref.rollout.name" and value != "hf":
            new = "hf"
        elif key == "trainer.logger":
            new = "[console]"
        elif key in REPO_RELATIVE_KEYS and value and not os.path.isabs(value) and (root / value).exists():
            new = str(root / value)
        if new is not None and new != value:
            replaced.append(key)
            a = f"{raw}={new}"
        out.append(a)
    return out, replaced


def config_folder(folder: str, root: Path) -> str:
    """A script's --config-path here: relative to the repository root, and a folder under a path the
    user is to fill in (`BASEDIR=base_dir`, `$HOME/verl/...`) found by its examples/ or recipe/ part."""
    path = root / folder if folder and not os.path.isabs(folder) else Path(folder)
    parts = path.parts
    for top in ("recipe", "examples"):
        if not path.is_dir() and top in parts and (root.joinpath(*parts[parts.index(top):])).is_dir():
            return str(root.joinpath(*parts[parts.index(top):]))
    return str(path)


def reward_file(name: str, folder: str) -> str:
    path = Path(folder) / f"reward_{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"def {name}(data_source, solution_str, ground_truth, extra_info=None, **kwargs):\n"
                    "    return float(solution_str.strip() == str(ground_truth))\n")
    return str(path)


def load(module: str, args: list[str]) -> tuple[bool, str]:
    """What `plait config show --entry-point MODULE ARGS` says: (accepted, its first error line)."""
    from plait.cli import main
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            code = main(["config", "show", "--entry-point", module, *args])
        except SystemExit as exit_:  # argparse
            code = exit_.code
        except Exception as exc:  # a traceback is a finding: recorded, never hidden
            return False, f"TRACEBACK {type(exc).__name__}: {exc}".splitlines()[0]
    if code == 0:
        return True, ""
    lines = [line for line in err.getvalue().splitlines() if line.startswith("plait: config error")]
    return False, (lines or err.getvalue().strip().splitlines()[-1:] or [f"exit status {code}"])[0]


NOT_TRAINERS = ("main_eval", "main_generation", "main_generation_server", "data_process", "model_merger", "proxy")


def classify(module: str | None) -> str:
    """main_ppo: verl's trainer or one plait runs as it; own_trainer: a recipe's own trainer (refused
    recipes, and any other `main*` module); other: generation, evaluation, data and merge scripts."""
    from plait.config_verl import ENTRY_POINTS, REFUSED_RECIPES
    if module is None:
        return "other"
    module = module.replace("/", ".")
    if module in ENTRY_POINTS:
        return "main_ppo"
    last = module.split(".")[-1]
    if module in REFUSED_RECIPES or (last.startswith("main") and last not in NOT_TRAINERS):
        return "own_trainer"
    return "other"


def measure_script(script: Path, root: Path, work: Path, fixtures: dict[str, str]) -> dict | None:
    """The record of one script: its trainer calls (not a data or eval script), each loaded."""
    calls = [module_of(c) for c in trainer_calls(script, root, work)]
    calls = [(m, a) for m, a in calls if classify(m) != "other"]
    if not calls:
        return None
    name = str(script.relative_to(root))
    record = {"script": name, "module": calls[0][0], "kind": classify(calls[0][0])}
    if name in VERL_REJECTS:
        record.update(kind="verl_rejects", why=VERL_REJECTS[name])
    engine = next((e for _, a in calls if (e := other_engine(a))), None)
    if engine:
        return {**record, "status": "megatron" if engine == "megatron" else "other_engine", "engine": engine}
    # on-policy distillation (a second model) is another issue's: counted apart until plait runs it
    record["distillation"] = any(a.lstrip("+").lower() in ("distillation.enabled=true", "distillation.enabled=1")
                                 for _, args in calls for a in args)
    status, first, replaced = "accepted", "", set()
    record["multimodal"] = any(MULTIMODAL.search(a.split("=", 1)[1]) for _, args in calls for a in args if
                               a.split("=", 1)[0].lstrip("+") in ("actor_rollout_ref.model.path", "data.train_files"))
    for module, args in calls:
        args, keys = substitute(args, fixtures, root)
        replaced |= set(keys)
        with contextlib.chdir(root):  # where the script runs: a dataset class's own imports (`recipe.*`) resolve there
            ok, line = load(module, args)
        if not ok and status == "accepted":
            status, first = "refused", line
    return {**record, "status": status, "refusal": first, "replaced": sorted(replaced), "calls": len(calls)}


def build_fixtures(folder: Path) -> dict[str, str]:
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from plait.data.tasks import write_task_files
    from plait.models import TINY_SIZES, build_char_tokenizer, create_tiny_model
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), num_labels=1, pad_token_id=tokenizer.pad_token_id, **TINY_SIZES["xs"])
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(folder / "rm")
    tokenizer.save_pretrained(folder / "rm")
    train, val = write_task_files("arithmetic", folder / "data", 8, 4)
    return {"model": create_tiny_model(folder / "model", size="xs"), "classifier": str(folder / "rm"),
            "train": train, "val": val, "out": str(folder / "out")}


def summary(records: list[dict]) -> dict:
    engines = [r for r in records if r["status"] == "other_engine"]
    distill = [r for r in records if r.get("distillation") and r["kind"] == "main_ppo"]
    counted = [r for r in records if r["kind"] == "main_ppo" and r["status"] not in ("megatron", "other_engine")
               and not r.get("distillation")]
    own = [r for r in records if r["kind"] == "own_trainer" and r["status"] not in ("megatron", "other_engine")]
    accepted = sum(r["status"] == "accepted" for r in counted)
    text = sum(r["status"] == "accepted" and not r["multimodal"] for r in counted)
    return {"scripts": len(records), "megatron_skipped": sum(r["status"] == "megatron" for r in records),
            "counted": len(counted), "accepted": accepted,
            "accepted_fraction": round(accepted / len(counted), 3) if counted else None,
            # of those accepted, the ones whose own data are text: image rows are refused at start
            "accepted_text_data": text, "accepted_text_data_fraction": round(text / len(counted), 3) if counted else None,
            "own_trainer_recipes": len(own), "own_trainer_accepted": sum(r["status"] == "accepted" for r in own),
            "other_engines_skipped": {e: sum(r["engine"] == e for r in engines) for e in sorted({r["engine"] for r in engines})},
            "distillation": len(distill), "distillation_accepted": sum(r["status"] == "accepted" for r in distill),
            "verl_rejects": sum(r["kind"] == "verl_rejects" for r in records)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", action="append", required=True, metavar="NAME=ROOT[:SUBDIR]",
                        help="a repository folder whose *.sh (under SUBDIR, recursively) are measured, named NAME in "
                             "the results; the scripts run from ROOT, as from their repository's root")
    parser.add_argument("--out", default="bench/results/verl_corpus.json")
    parser.add_argument("--verl-site", metavar="DIR", help="verl 0.9.1 installed aside (.ci/run's --no-deps line), "
                        "put after plait's own packages: a dataset class that imports verl loads against it")
    args = parser.parse_args()
    if args.verl_site:
        sys.path.append(os.path.abspath(args.verl_site))
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fixtures = build_fixtures(work / "fixtures")
        for spec in args.corpus:
            name, folder = spec.split("=", 1)
            root, _, sub = folder.partition(":")
            root = Path(root).resolve()
            records = [r for s in sorted((root / sub).rglob("*.sh")) if (r := measure_script(s, root, work, fixtures))]
            for r in records:
                r["refusal"] = r.get("refusal", "").replace(tmp, "<fixtures>").replace(str(root), "<root>")
            result[name] = {"summary": summary(records), "scripts": records}
            print(name, json.dumps(result[name]["summary"]), file=sys.stderr)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
