"""The `plait` command: `plait train [--config FILE] key=value ...`, `plait config show ...`,
`plait profile report DIR`, `plait export CHECKPOINT OUT`, `plait serve MODEL`.

Overrides take verl's Hydra forms (`key=value`, `+key=value`, `~key`). Bad config keys, types or
values exit with status 2 and one line each naming the key, the value and what would be valid,
all errors of the command line at once (the tree's, and the data files, model directories and
loggers of the rest of it: plait/checks.py), no traceback. `config show` checks what `train` checks.
Bad data or a bad model dir also exit 2 with one line naming the file. A failure while running
that one line explains (RunError) exits 1; SIGTERM 143 and SIGINT 130.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import yaml

from plait.configtree import ConfigError, ConfigErrors, to_dict
from plait.errors import Interrupted, RunError


def main(argv: list[str] | None = None) -> int:
    """`plait train | config show | profile report | export`; the exit status. Over 60 lines: the parser is
    defined in one piece, read top to bottom as the command's help; the dispatch after it is short."""
    # PyTorch's C++ warnings (CPUAllocator's "Memory block of unknown size was allocated before the
    # profiling started" at every memory window) are read from this once, at torch's import; set it to
    # WARNING to see them. Worker processes of a Ray instance plait starts inherit it.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from plait import __version__
    parser = argparse.ArgumentParser(prog="plait", description="RL post-training: one step lifecycle for every trainer mode.")
    parser.add_argument("--version", action="version", version=f"plait {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train (the built-in demo when no config is given)")
    train.add_argument("--config", help="a YAML config file, or a built-in one by name: "
                                        f"{', '.join(builtin_configs())} (plait/configs/); key=value overrides apply on top")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="action", required=True)
    show = config_sub.add_parser("show", help="print the resolved config tree, after the checks train makes")
    show.add_argument("--config")
    for p in (train, show):
        p.add_argument("--config-name", help="verl's Hydra config name: ppo_trainer is plait's built-in tree; "
                                             "another name is NAME.yaml in --config-path")
        p.add_argument("--config-path", help="the folder of --config-name's YAML (verl's Hydra form)")
        p.add_argument("--entry-point", help="the module verl's script ran (python -m MODULE): sets the mode it "
                                             "implies, or refuses a recipe plait does not implement")
        p.add_argument("overrides", nargs="*", metavar="key=value")
    profile = sub.add_parser("profile", help="read what the profiler and the stage timeline recorded")
    profile_sub = profile.add_subparsers(dest="action", required=True)
    report = profile_sub.add_parser("report", help="write DIR/report/index.html and DIR/report/timeline.json.gz")
    report.add_argument("dir", help="a run's output dir or a profiler save_path")
    report.add_argument("--profile", help="the profiler save_path, when it is not DIR or DIR/profile")
    report.add_argument("--run", help="the run's output dir (timeline.jsonl, metrics.jsonl), when it is not DIR")
    report.add_argument("--json", action="store_true", help="print the verdict with each rule's inputs and "
                                                            "predicted bound (DIR/report/verdict.json) instead of the summary")
    report.add_argument("--no-merge", action="store_true", help="write no merged traces (the page and the verdict only)")
    report.add_argument("--watch", action="store_true", help="rewrite the report whenever the run's files change, "
                                                             "until the run ends (its summary.json) or Ctrl-C")
    report.add_argument("--interval", type=float, default=10.0, help="--watch: seconds between checks (default 10)")
    diff = profile_sub.add_parser("diff", help="run A against run B: stages, operators, memory, A's predictions")
    diff.add_argument("run_a", help="a run's output dir (the one whose verdict was applied)")
    diff.add_argument("run_b", help="the other run's output dir (the rerun)")
    diff.add_argument("--json", action="store_true", help="print the comparison as JSON")
    otel = profile_sub.add_parser("export-otel", help="send the timeline's spans and each sample's lifecycle as "
                                                      "OpenTelemetry spans over OTLP/HTTP (pip install 'plait[otel]')")
    otel.add_argument("dir", help="a run's output dir")
    otel.add_argument("--endpoint", default="http://127.0.0.1:4318",
                      help="the OTLP/HTTP receiver (Tempo, Jaeger, a Collector); spans go to ENDPOINT/v1/traces")
    otel.add_argument("--timeout", type=float, default=10.0, help="seconds to keep trying a batch (default 10)")
    export = sub.add_parser("export", help="write a checkpoint's policy as a Hugging Face folder (transformers, vLLM)")
    export.add_argument("checkpoint", help="a checkpoints/global_step_N folder (or checkpoints/: its newest), or a "
                                           "Tinker checkpoint: tinker://RUN/weights/NAME (see --tinker-dir) or its folder")
    export.add_argument("out", help="the folder to write: config.json, model.safetensors, tokenizer, generation config")
    export.add_argument("--lora", choices=("merge", "adapter"), default="merge",
                        help="a LoRA checkpoint: merge the adapter into the base weights (default) or write the peft adapter")
    export.add_argument("--base", help="a LoRA checkpoint's base model folder, when it moved since training")
    export.add_argument("--tinker-dir", help="where plait serve keeps tinker:// checkpoints (default $PLAIT_CACHE/tinker "
                                             "or ~/.cache/plait/tinker)")
    serve = sub.add_parser("serve", help="serve a model or checkpoint over OpenAI's and Anthropic's APIs, and train "
                                         "LoRA adapters on it over the Tinker API (docs/tinker.md)")
    serve.add_argument("model", help="a checkpoint (checkpoints/global_step_N), a model folder or a built-in model name")
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--engine", help="the rollout engine (a row of plait/workers/engine.py; default plait's own)")
    serve.add_argument("--max-tokens", type=int, default=1024, help="a request's budget when it names none")
    serve.add_argument("--tool-format", default="hermes", help="how tool calls are read from the model's text")
    serve.add_argument("--name", help="the model's name in both APIs (Tinker's base_model; default: MODEL's folder name)")
    serve.add_argument("--tinker-dir", help="where tinker:// checkpoints are kept (default $PLAIT_CACHE/tinker or "
                                            "~/.cache/plait/tinker)")
    serve.add_argument("--no-tinker", action="store_true", help="serve without the Tinker API (no training)")
    serve.add_argument("--tinker-batch-tokens", type=int, help="the most tokens (rows x the longest, padded) in one "
                                                               "Tinker forward / backward pass; a larger request runs "
                                                               "in pieces, gradients added up (default 1024)")
    serve.add_argument("--max-body-mb", type=float, default=8, help="the largest request body, in MiB (413 past it)")
    serve.add_argument("--output-dir", help="where the server's timeline.jsonl goes, for `plait profile report DIR` "
                                            "(default: the Tinker dir; none with --no-tinker)")
    args = parser.parse_args(argv)
    if args.command == "export":
        return export_command(args)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "profile":
        return profile_command(args)

    from plait.config import load_config
    from plait.config_verl import entry_point_overrides
    cfg = None
    try:
        implied = entry_point_overrides(args.entry_point)
        path = config_file(args.config, args.config_name, args.config_path)
        cfg = load_config(path, [*implied, *args.overrides], search=[args.config_path] if args.config_path else [])
        from plait.driver import preflight, run  # transformers and the trainers: after the config's own errors
        preflight(cfg)
        if args.command == "config":
            yaml.safe_dump(to_dict(cfg), sys.stdout, sort_keys=False)
            return 0
        run(cfg, progress=not args.no_progress, checked=True)
    except ConfigError as err:
        for one in all_errors(err):
            print(f"plait: config error: {one}", file=sys.stderr)
        return 2
    except RunError as err:
        print(f"plait: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:  # 143 for SIGTERM, 130 for SIGINT: the shells' convention
        print(f"plait: interrupted; {kept(cfg.output_dir) if cfg is not None else 'nothing was started'}", file=sys.stderr)
        return 128 + (err.signum if isinstance(err, Interrupted) else signal.SIGINT)
    return 0


def profile_command(args) -> int:
    """`plait profile report DIR [--watch]`, `plait profile diff A B`, `plait profile export-otel DIR`: exit 2 with one line for a folder
    that is not a run's."""
    from plait.profiler.analysis import build_report, diff_runs, watch
    try:
        if args.action == "diff":
            print(diff_runs(args.run_a, args.run_b, as_json=args.json))
            return 0
        if args.action == "export-otel":
            from plait.profiler.analysis.otel import export
            try:
                print(export(args.dir, args.endpoint, args.timeout))
            except ImportError as err:  # without the otel extra
                print(f"plait: profile export-otel: needs {err.name or 'opentelemetry'}: pip install 'plait[otel]'",
                      file=sys.stderr)
                return 2
            except ConnectionError as err:  # the receiver refused or is not there
                print(f"plait: profile export-otel: {err}", file=sys.stderr)
                return 1
            return 0
        if args.watch:
            return watch(args.dir, profile=args.profile, run=args.run, merge=not args.no_merge, interval=args.interval)
        text = build_report(args.dir, profile=args.profile, run=args.run, merge=not args.no_merge)
        if args.json:
            with open(os.path.join(args.dir, "report", "verdict.json")) as f:
                text = f.read()
        print(text)
    except FileNotFoundError as err:
        print(f"plait: profile {args.action}: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a folder it may not write, a full disk: one line
        print(f"plait: profile {args.action}: {err.filename or ''}: {err.strerror or err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def kept(output_dir: str) -> str:
    """What an interrupted run leaves to resume from, said as it is (no checkpoint is no checkpoint)."""
    from plait.trainers.checkpoint import checkpoint_steps
    steps = checkpoint_steps(os.path.join(output_dir, "checkpoints"))
    if not steps:
        ran = os.path.join(output_dir, "summary.json")
        return ("no checkpoint was saved (trainer.save_freq), so a rerun starts from step 1"
                + (f"; {ran} says what ran" if os.path.exists(ran) else ""))
    return (f"the newest checkpoint is {os.path.join(output_dir, 'checkpoints', f'global_step_{max(steps)}')} "
            f"(a checkpoint is whole or absent); the same command resumes after step {max(steps)}")


def all_errors(err: ConfigError) -> list[ConfigError]:
    """The config's errors, and when the rest of it builds (err.partial), the torch-free checks on that
    rest (data files, model directories, loggers: plait/checks.py), so that one pass names them all."""
    errors = err.errors if isinstance(err, ConfigErrors) else [err]
    if err.partial is None:
        return errors
    from plait.checks import light_errors
    keys = {e.key.split("[")[0] for e in errors}
    return [*errors, *(e for e in light_errors(err.partial) if e.key.split("[")[0] not in keys)]


def export_command(args) -> int:
    import transformers
    from plait.export import ExportError, actor_dir, export_checkpoint, tinker_folder
    transformers.utils.logging.disable_progress_bar()  # "Writing model shards" for one file
    if os.path.isdir(args.out) and os.listdir(args.out):  # files of another model would mix with this one's
        print(f"plait: export: {args.out} exists and is not empty; give a new folder", file=sys.stderr)
        return 2
    tinker_dir = args.tinker_dir or default_tinker_dir()
    try:
        out = export_checkpoint(args.checkpoint, args.out, lora=args.lora, base=args.base, tinker_dir=tinker_dir)
        source = args.checkpoint if tinker_folder(args.checkpoint, tinker_dir) is not None else \
            os.path.dirname(actor_dir(args.checkpoint))  # a run's folder or checkpoints/: the step it took
    except ExportError as err:
        print(f"plait: export: {err}", file=sys.stderr)
        return 2
    how = (f"PeftModel.from_pretrained(base_model, {out!r})" if args.lora == "adapter" and
           os.path.isfile(os.path.join(out, "adapter_config.json")) else
           f"AutoModelForCausalLM.from_pretrained({out!r}) or vllm serve {out}")
    print(f"plait: exported {source} to {out}: load it with {how} (docs/export.md)", file=sys.stderr)
    return 0


def default_tinker_dir() -> str:
    return os.path.join(os.environ.get("PLAIT_CACHE") or os.path.expanduser("~/.cache/plait"), "tinker")


def serve_command(args) -> int:
    from plait.serving.serve import serve
    try:
        serve(args.model, args.host, args.port, args.engine, args.max_tokens, args.tool_format, name=args.name,
              tinker_dir=None if args.no_tinker else args.tinker_dir or default_tinker_dir(), max_body_mb=args.max_body_mb,
              output_dir=args.output_dir, tinker_batch_tokens=args.tinker_batch_tokens)
    except (FileNotFoundError, ConfigError, OSError) as err:
        print(f"plait: serve: {err}", file=sys.stderr)
        return 2
    return 0


def config_file(config: str | None, name: str | None, folder: str | None) -> str | None:
    """The YAML file to load: --config, or verl's --config-path/--config-name pair. verl's own
    ppo_trainer is plait's built-in tree; its Megatron tree is refused."""
    from plait.config_verl import VERL_CONFIGS
    if name is None:
        return builtin_config(config)
    name = name.removesuffix(".yaml")
    if "megatron" in name:
        raise ConfigError("--config-name", name, "Megatron-LM is not supported: plait trains with PyTorch (strategy fsdp or fsdp2)")
    if config:
        raise ConfigError("--config-name", name, "give --config FILE or --config-path/--config-name, not both")
    if name in VERL_CONFIGS:
        return None
    path = os.path.join(folder or ".", f"{name}.yaml")
    if not os.path.isfile(path):
        raise ConfigError("--config-name", name, f"no {name}.yaml in --config-path {folder or '(not given: .)'}; "
                                                 "verl's ppo_trainer is plait's built-in tree")
    return path


def builtin_configs() -> list[str]:
    """The names of the configs shipped in plait/configs/ (demo is the default's preset)."""
    folder = os.path.join(os.path.dirname(__file__), "configs")
    return sorted(name.removesuffix(".yaml") for name in os.listdir(folder) if name.endswith(".yaml"))


def builtin_config(name: str | None) -> str | None:
    """`--config diffusion_demo` names a config shipped in plait/configs/; an existing path wins."""
    shipped = os.path.join(os.path.dirname(__file__), "configs", f"{name}.yaml")
    return shipped if name and not os.path.exists(name) and os.path.isfile(shipped) else name


if __name__ == "__main__":
    sys.exit(main())
