"""The `plait` command: `plait train [--config FILE] key=value ...`, `plait config show ...`.

A bad config key, type or value exits with status 2 and one line naming the key, the value and
what would be valid — no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from plait.configtree import ConfigError, ConfigErrors, to_dict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait", description="RL post-training: one step lifecycle for every trainer mode.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train (the built-in demo when no config is given)")
    train.add_argument("--config", help="a YAML config file, or a built-in one by name (diffusion_demo); "
                                        "key=value overrides apply on top")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("overrides", nargs="*", metavar="key=value")
    config = sub.add_parser("config", help="inspect configuration")
    config_sub = config.add_subparsers(dest="action", required=True)
    show = config_sub.add_parser("show", help="print the resolved config tree")
    show.add_argument("--config")
    show.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)

    from plait.config import load_config
    try:
        cfg = load_config(builtin_config(args.config), args.overrides)
        if args.command == "config":
            yaml.safe_dump(to_dict(cfg), sys.stdout, sort_keys=False)
            return 0
        from plait.driver import run
        run(cfg, progress=not args.no_progress)
    except ConfigError as err:
        for one in err.errors if isinstance(err, ConfigErrors) else [err]:
            print(f"plait: config error: {one}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("plait: interrupted; the last checkpoint and closed artifacts are intact", file=sys.stderr)
        return 130
    return 0


def builtin_config(name: str | None) -> str | None:
    """`--config diffusion_demo` names a config shipped in plait/configs/; an existing path wins."""
    shipped = os.path.join(os.path.dirname(__file__), "configs", f"{name}.yaml")
    return shipped if name and not os.path.exists(name) and os.path.isfile(shipped) else name


if __name__ == "__main__":
    sys.exit(main())
