"""Where step metrics go: metrics.jsonl (always), the console, TensorBoard, W&B, MLflow, SwanLab.

A logger that fails while training (disk full, a W&B hiccup), or a TensorBoard folder that cannot be
written at start, is reported in one line and switched off; it never stops the run. Asking for a logger whose package is missing fails at start instead,
before any training work (`check_loggers`, which `plait config show` runs too); verl's `file` and
`json_eval` loggers are metrics.jsonl itself. Each metrics.jsonl line is fsync'd when written; on resume the file is
cut back to the checkpoint's step (`keep_until`), a torn line dropped with a warning.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from typing import Iterable

from plait.checks import check_loggers
from plait.configtree import ConfigError

CONSOLE_KEYS = {"critic/score/mean": "score", "actor/pg_loss": "pg_loss", "response_length/mean": "resp_len",
                "perf/time_per_step": "s/step"}


FILE_LOGGERS = ("file", "json_eval")  # verl's JSON-lines loggers: plait's metrics.jsonl is one


class MlflowSink:
    """MLflow under the sink interface (log, finish); metric names keep only the characters MLflow allows."""

    def __init__(self, project: str, experiment: str, config: dict):
        import mlflow
        self.mlflow = mlflow
        mlflow.set_experiment(project)
        mlflow.start_run(run_name=experiment)

    def log(self, record: dict, step: int) -> None:
        self.mlflow.log_metrics({re.sub(r"[^\w\-. /]", "_at_", k): v for k, v in record.items()
                                 if isinstance(v, (int, float)) and k != "step"}, step=step)

    def finish(self) -> None:
        self.mlflow.end_run()


class Tracker:
    def __init__(self, output_dir: str, loggers: list[str], project: str, experiment: str,
                 config: dict | None = None, progress: bool = True):
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, "metrics.jsonl")
        self.console = "console" in loggers
        self.show_progress = progress
        self.sinks: dict[str, object] = {}
        check_loggers(loggers)
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter
            folder = os.path.join(output_dir, "tensorboard")
            try:
                self.sinks["tensorboard"] = SummaryWriter(folder)
            except OSError as err:  # read-only, not a folder, full: metrics.jsonl still has every step
                print(f"plait: warning: trainer.logger=tensorboard cannot write its event file in {folder} "
                      f"({err.strerror or type(err).__name__}); training goes on without TensorBoard "
                      f"(every step is in {self.path})", file=sys.stderr)
        if "wandb" in loggers:
            import wandb
            try:
                self.sinks["wandb"] = wandb.init(project=project, name=experiment, config=config or {})
            except Exception as err:  # noqa: BLE001 - a login the preflight could not see, the network, the server
                raise ConfigError("trainer.logger", "wandb", f"wandb.init failed ({type(err).__name__}: "
                                  f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); `wandb login`, or "
                                  "WANDB_MODE=offline") from None
        if "mlflow" in loggers:
            self.sinks["mlflow"] = MlflowSink(project, experiment, config or {})
        if "swanlab" in loggers:
            import swanlab
            swanlab.init(project=project, experiment_name=experiment, config=config or {})
            self.sinks["swanlab"] = swanlab  # the module logs and finishes its current run
        for name in set(loggers) & set(FILE_LOGGERS):
            print(f"plait: trainer.logger={name}: the JSON-lines log is {self.path}", file=sys.stderr)
        self._bar = None

    def progress(self, steps: Iterable[int], total: int, initial: int) -> Iterable[int]:
        if not self.show_progress or not sys.stderr.isatty():  # redraws in a log file are noise: step lines suffice
            return steps
        from tqdm import tqdm
        # advanced by `log`, not by iterating: tqdm counts a step when the next one starts, so the redraw
        # under the last step's line showed one step short and the closing draw a second, different bar
        self._bar = tqdm(total=total, initial=initial, desc="plait", unit="step", dynamic_ncols=True, file=sys.stderr)
        return steps

    def keep_until(self, step: int, record_path: str = "") -> None:
        """Keep the records of steps up to `step` (a resumed run rewrites later ones). When the
        line of `step` itself was lost (a kill between checkpoint and line), it is restored from
        the checkpoint's copy at `record_path`. A torn line is dropped with a warning."""
        records = read_records(self.path) if os.path.exists(self.path) else []
        keep = [r for r in records if r.get("step", 0) <= step]
        if record_path and step not in {r.get("step") for r in keep} and os.path.exists(record_path):
            with open(record_path) as f:
                keep.append(json.load(f))
        if not records and not keep:
            return
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def log(self, metrics: dict[str, float], step: int) -> None:
        record = as_record(metrics, step)
        if self._bar is not None and step > self._bar.n:
            self._bar.update(step - self._bar.n)
            if self._bar.n >= self._bar.total:  # done: its last draw stays, once, above the last step's line
                self._bar.close()
                self._bar = None
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())  # durable before the next step's checkpoint can cover it
        for name, sink in list(self.sinks.items()):
            try:
                if name == "tensorboard":
                    for k, v in record.items():
                        if isinstance(v, (int, float)) and k != "step":
                            sink.add_scalar(k, v, step)
                    sink.flush()
                else:
                    sink.log(record, step=step)
            except Exception as err:  # noqa: BLE001 - a logger never kills training
                print(f"plait: logger {name} failed ({err!r}); it is switched off for this run", file=sys.stderr)
                del self.sinks[name]
        if self.console:
            self._print(record)

    def log_generations(self, samples: list[tuple[str, str, float]], step: int) -> None:
        """Validation samples (input, output, score): val_generations.jsonl, the console, a TensorBoard
        text table and a W&B table (`trainer.log_val_generations`)."""
        with open(os.path.join(os.path.dirname(self.path), "val_generations.jsonl"), "a") as f:
            for inp, out, score in samples:
                f.write(json.dumps({"step": step, "input": inp, "output": out, "score": score}) + "\n")
        for name, sink in list(self.sinks.items()):
            try:
                if name == "tensorboard":
                    rows = [f"| {i} | {_cell(inp)} | {_cell(out)} | {score:.4g} |" for i, (inp, out, score) in enumerate(samples)]
                    sink.add_text("val/generations", "\n".join(["| # | input | output | score |", "|---|---|---|---|", *rows]), step)
                elif name == "wandb":
                    import wandb
                    sink.log({"val/generations": wandb.Table(columns=["step", "input", "output", "score"],
                                                             data=[[step, *s] for s in samples])}, step=step)
            except Exception as err:  # noqa: BLE001 - a logger never kills training
                print(f"plait: logger {name} failed ({err!r}); it is switched off for this run", file=sys.stderr)
                del self.sinks[name]
        if self.console:
            for inp, out, score in samples:
                line = f"[validation step {step}] score={score:.4g}\n  input:  {inp!r}\n  output: {out!r}"
                self._bar.write(line, file=sys.stderr) if self._bar is not None else print(line, file=sys.stderr)

    def note(self, line: str) -> None:
        """A line on the console, above the progress bar when there is one."""
        self._bar.write(line, file=sys.stderr) if self._bar is not None else print(line, file=sys.stderr)

    def _print(self, record: dict) -> None:
        parts = [f"step {record['step']}"]
        parts += [f"{label}={record[k]:.3g}" for k, label in CONSOLE_KEYS.items()
                  if isinstance(record.get(k), (int, float))]  # "nan" is stored as a string
        parts += [f"{k}={v:.3g}" for k, v in record.items() if k.startswith("val-core/") and isinstance(v, float)]
        line = " | ".join(parts)
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for name, sink in self.sinks.items():
            try:
                sink.close() if name == "tensorboard" else sink.finish()
            except Exception as err:  # noqa: BLE001
                print(f"plait: closing logger {name} failed ({err!r})", file=sys.stderr)
        self.sinks = {}


def _cell(text: str) -> str:
    """One markdown table cell: no newlines or pipes."""
    return text.replace("|", "\\|").replace("\n", " ")


def read_records(path: str) -> list[dict]:
    """The records of a metrics.jsonl; an unreadable (torn) line is dropped with a warning naming the file."""
    records = []
    with open(path, errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                print(f"plait: warning: {path} line {n} is torn (a crash mid-write); dropped", file=sys.stderr)
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step", 0), int):
                print(f"plait: warning: {path} line {n} is not a step record (a JSON object with an integer "
                      f"step: {line.strip()[:60]!r}); dropped", file=sys.stderr)
                continue
            records.append(record)
    return records


def as_record(metrics: dict, step: int) -> dict:
    """The JSON line of one step, as metrics.jsonl and a checkpoint's step_metrics.json hold it."""
    return {"step": step, **{k: _plain(v) for k, v in metrics.items()}}


def _plain(v):
    """JSON-safe scalars: ints and strings as they are, other numbers (numpy, 0-d tensors) as floats."""
    if isinstance(v, (bool, int, str)):
        return v
    v = float(v)
    return v if math.isfinite(v) else str(v)
