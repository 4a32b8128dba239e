"""The rollout role's agent side: which loop runs each row, and the RolloutBatch of their outputs.

A row runs the loop its `agent_name` column names, else `rollout.agent.default_agent_loop`. Loops
are the registered ones (plait/agents/loop.py) plus those in `rollout.agent.agent_loop_config_path`:
a YAML list of `{name, _target_: module.Class, **kwargs}` (the kwargs go to the constructor). Each
row gets verl's keyword arguments: raw_prompt, extra_info, tools_kwargs (extra_info's), index,
data_source, reward_model, agent_name. The batch built from the outputs has the two masks
(response_mask: sampled tokens; response_attention: all response tokens), the rollout's log-probs
(0 off sampled tokens), per-token policy versions, and per row in `agent_infos` the loop's metrics,
num_turns and reward_score; turn_scores, tool_rewards and num_turns are also added to the row's
extra_info, where reward functions read them (as verl's reward managers pass them).
"""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path
from typing import Callable

import torch
import yaml

from plait.agents.loop import AgentLoopOutput, ConfigWrap, registered
from plait.agents.runner import EventLoopThread, Run, Scheduler, drive, drive_stream, outputs, release_held
from plait.config import SamplingConfig
from plait.configtree import ConfigError
from plait.errors import RunError
from plait.safeload import load_yaml
from plait.types import PromptBatch, RolloutBatch

GRACE_S = 0.05  # how long a ready request waits for trajectories still in tools before a round starts
START_GRACE_S = 2.0  # ... and for trajectories that have not asked yet, at a batch's start (an outside agent's process)


def load_loop_configs(path: str | None) -> dict[str, dict]:
    """The registry plus the user's YAML list of loops ({name, _target_, **kwargs})."""
    from plait.agents import openai_agent  # noqa: F401 - registers openai_agent (it imports the HTTP stack: here, not at start)
    loops = registered()
    if path is None:
        return loops
    key = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    if not Path(path).is_file():
        raise ConfigError(key, path, "no such file: a YAML list of {name, _target_: module.Class, ...kwargs}")
    try:
        entries = load_yaml(Path(path).read_text()) or []
    except yaml.YAMLError as err:  # an alias bomb too (safeload.load_yaml)
        raise ConfigError(key, path, f"not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e and "_target_" in e for e in entries):
        raise ConfigError(key, path, "must hold a YAML list of mappings, each with `name` and `_target_` (module.Class)")
    for e in entries:
        loops[e["name"]] = {k: v for k, v in e.items() if k != "name"}
    return loops


def resolve_class(target: str):
    key = "actor_rollout_ref.rollout.agent.agent_loop_config_path"
    module, _, name = target.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as err:  # a loop file written against verl, without verl here: the line to change
        from plait.agents.compat import missing_module_line
        raise ConfigError(key, target, missing_module_line(err, f"agent loop {target}")) from None
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(key, target, f"its _target_ cannot be imported: {err}") from None


def check_agent_names(path: str | None, default: str, names: set, fmt: str = "hermes", openai_agent=None) -> None:
    """Every agent_name of the data, and the default loop, must be a known loop; rows that run tool_agent
    need a tool-call format plait parses (verl's loop stops at an unknown one), rows that run openai_agent
    an agent (`openai_agent`: rollout.agent.openai_agent): ConfigErrors at start."""
    from plait.agents.tool_parser import SUPPORTED_FORMATS
    if fmt not in SUPPORTED_FORMATS and "tool_agent" in (set(names) | {default}):
        raise ConfigError("actor_rollout_ref.rollout.multi_turn.format", fmt,
                          f"one of {', '.join(SUPPORTED_FORMATS)}: rows run tool_agent, which reads the model's calls in "
                          "this format (verl 0.9.1 parses hermes, gpt-oss, qwen3_coder, glm, seed, minimax, kimi, "
                          "deepseek_v4, gemma4; plait the first two)")
    if "openai_agent" in (set(names) | {default}) and openai_agent is not None and not openai_agent.given:
        raise ConfigError("actor_rollout_ref.rollout.agent.openai_agent.path", None,
                          "rows run openai_agent: give the agent, a Python file with `async def run(row, base_url, "
                          "api_key)` (openai_agent.path, .name) or a command line (openai_agent.command); docs/agents.md")
    loops = load_loop_configs(path)
    if default not in loops:
        raise ConfigError("actor_rollout_ref.rollout.agent.default_agent_loop", default,
                          f"one of the registered agent loops: {', '.join(sorted(loops))} (add yours with agent_loop_config_path)")
    unknown = sorted(n for n in names if n not in loops)
    if unknown:
        raise ConfigError("agent_name", unknown[0], f"a row names an agent loop that is not registered; registered: "
                          f"{', '.join(sorted(loops))} (add yours with actor_rollout_ref.rollout.agent.agent_loop_config_path)")


class AgentWorker:
    def __init__(self, cfg, tokenizer, model_type: str | None, tools=None, interactions=None,
                 eos_ids: list[int] | None = None):
        """`cfg`: the whole PlaitConfig (loops read it as verl's trainer config); `tools`: a ToolBox or None;
        `interactions`: an InteractionBox (plait/agents/interactions.py) or None; `eos_ids`: the engine's."""
        self.cfg, self.tokenizer, self.model_type, self.tools = cfg, tokenizer, model_type, tools
        self.interactions = interactions
        self.eos_ids = list(eos_ids or [tokenizer.eos_token_id])
        self.external = None  # the gateway and its agents (openai_agent), started with the first such loop
        self.loops = load_loop_configs(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path)
        for name, entry in self.loops.items():  # import every loop now: a bad _target_ fails before any work
            if "cls" not in entry:
                entry["cls"] = resolve_class(entry["_target_"])
        self.default = cfg.actor_rollout_ref.rollout.agent.default_agent_loop
        self.thread = EventLoopThread()
        self.suspended: tuple[Run, PromptBatch, int] | None = None
        self.scheduler: Scheduler | None = None  # the running batch's (generate)
        self.abort_flag = False
        self.warned_single_turn = False

    def make_loop(self, name: str):
        entry = self.loops.get(name)
        if entry is None:
            raise ValueError(f"agent_name {name!r} is not a registered agent loop; registered: {', '.join(sorted(self.loops))} "
                             "(add yours with rollout.agent.agent_loop_config_path)")
        cls = entry.get("cls") or resolve_class(entry["_target_"])
        kwargs = {k: v for k, v in entry.items() if k not in ("_target_", "cls")}
        from plait.agents.openai_agent import ExternalAgents, OpenAIAgentLoop
        if issubclass(cls, OpenAIAgentLoop):  # its agent lives outside plait: it needs this worker's gateway
            if self.external is None:
                self.external = ExternalAgents(self.cfg, self.tokenizer, self.model_type, self.eos_ids, self.thread.loop)
            kwargs["external"] = self.external
        return cls(ConfigWrap(self.cfg), self.scheduler, self.tokenizer, processor=None, dataset_cls=None,
                   data_config=ConfigWrap(self.cfg.data), hf_model_type=self.model_type, tools=self.tools,
                   interactions=self.interactions, **kwargs)

    def agent_names(self, prompts: PromptBatch) -> list[str]:
        names = [n or self.default for n in (prompts.agent_names or [None] * len(prompts))]
        configured = (self.tools is not None, self.interactions is not None)
        if any(configured) and "single_turn_agent" in names and not self.warned_single_turn:
            self.warned_single_turn = True
            what = " and ".join(w for w, on in zip(("the configured tools are not offered to them",
                                                    "the interaction does not answer them"), configured) if on)
            print(f"plait: {names.count('single_turn_agent')} of {len(names)} rows run single_turn_agent (no agent_name "
                  f"column, rollout.agent.default_agent_loop={self.default}): {what}; set agent_name=tool_agent in the "
                  "data or rollout.agent.default_agent_loop=tool_agent")
        return names

    def generate(self, prompts: PromptBatch, sampling: SamplingConfig, engine_round, version: Callable[[], int]) -> RolloutBatch:
        self.abort_flag = False
        self.scheduler = Scheduler(self.cfg.data.max_response_length, len(prompts) * sampling.n, START_GRACE_S)
        names, n = self.agent_names(prompts), sampling.n
        params = dict(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                      do_sample=sampling.do_sample)
        futures = []
        for i in range(len(prompts)):
            for _ in range(n):
                loop = self.make_loop(names[i])
                futures.append(self.thread.submit(loop.run(params, **self.row_kwargs(prompts, i, names[i]))))
        run = Run(futures, self.scheduler)
        return self._drive(run, prompts, n, engine_round, version)

    def resume(self, batch: RolloutBatch, engine_round, version: Callable[[], int]) -> RolloutBatch:
        if self.suspended is None:
            return batch
        (run, prompts, n), self.suspended = self.suspended, None
        self.abort_flag = False
        release_held(run.scheduler)
        return self._drive(run, prompts, n, engine_round, version)

    def _drive(self, run: Run, prompts: PromptBatch, n: int, engine_round, version) -> RolloutBatch:
        """Run the rounds; a run cut by an abort stays suspended for `resume`, whatever other generate calls
        (validation) come in between."""
        aborted = lambda: self.abort_flag  # noqa: E731
        serve = getattr(engine_round, "serve", None)  # an engine with continuous batching (vLLM)
        cut = drive(run, engine_round, version, GRACE_S, aborted) if serve is None else \
            drive_stream(run, serve, version, aborted)
        outs = outputs(run)
        if self.external is not None:  # on the loop's thread, where the agents' lines are counted
            self.thread.loop.call_soon_threadsafe(self.external.output.end_step)
        if cut and any(o is None for o in outs):  # an abort that came as the last trajectory ended leaves none to resume
            if self.suspended is not None:
                raise RuntimeError("a rollout was cut short while another one waited to resume")
            self.suspended = (run, prompts, n)
        failed = [o.extra_fields["session"]["failure"] for o in outs if o is not None and "session" in o.extra_fields]
        if failed and all(failed) and len(failed) == len(outs):
            raise RunError(f"every agent session of the batch failed ({len(failed)}); the first: {failed[0]}")
        return to_batch(outs, prompts, n, self.tokenizer.pad_token_id, version(), self.cfg.data.max_response_length)

    def abort(self) -> None:
        self.abort_flag = True
        if self.scheduler is not None:
            self.scheduler.notify()

    @staticmethod
    def row_kwargs(prompts: PromptBatch, i: int, name: str) -> dict:
        extra = dict(prompts.extra_infos[i] or {})
        raw = extra.get("raw_prompt")
        if raw is None:
            raise ValueError(f"row {prompts.indices[i]}: agent loops need the row's chat messages "
                             "(data.return_raw_chat=true and a list-of-messages prompt)")
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else [dict(m) for m in raw]
        return dict(raw_prompt=messages, extra_info=extra, tools_kwargs=extra.get("tools_kwargs") or {},
                    index=prompts.indices[i], data_source=prompts.data_sources[i],
                    reward_model={"ground_truth": prompts.ground_truths[i]}, agent_name=name,
                    request_id=uuid.uuid4().hex)

    def close(self) -> None:
        if self.external is not None:
            self.external.close()
        self.thread.close()
        for box in (self.tools, self.interactions):
            if box is not None:
                box.close()


def tool_call_rates(infos: list[dict]) -> dict[str, float]:
    """Over the finished trajectories of a batch: agent_loop/tool_call_rate, the share that wrote at
    least one tool call; agent_loop/valid_call_rate, the share of written calls that parsed and ran
    without error (0 when none was written). {} without agent loops."""
    done = [i for i in infos if i]
    if not done:
        return {}
    attempts = sum(i["tool_call_attempts"] for i in done)
    valid = sum(i["tool_calls_made"] - i["tool_errors"] for i in done)
    return {"agent_loop/tool_call_rate": sum(i["tool_call_attempts"] > 0 for i in done) / len(done),
            "agent_loop/valid_call_rate": valid / max(attempts, 1)}


def to_batch(outs: list[AgentLoopOutput | None], prompts: PromptBatch, n: int, pad: int, version: int,
             response_length: int) -> RolloutBatch:
    """The RolloutBatch of one generate call; an unfinished row (None) is an empty, "aborted" one. A session
    of openai_agent with several chains gives a row per chain, its earlier ones before its final one, all of
    the same sample (agent_infos: "session")."""
    rows, sample = [], []  # the outputs, and the sample (index into outs) each row belongs to
    for i, o in enumerate(outs):
        for chain in (o.extra_fields.get("chains", []) if o is not None else []):
            rows.append(chain)
            sample.append(i)
        rows.append(o)
        sample.append(i)
    prompt_ids = [o.prompt_ids if o is not None else prompts.prompt_ids[j // n] for o, j in zip(rows, sample)]
    resp = [o.response_ids if o is not None else [] for o in rows]
    pw, rw = max(len(p) for p in prompt_ids), max(1, max(len(r) for r in resp))
    prompts_t = torch.full((len(rows), pw), pad, dtype=torch.long)
    prompt_mask = torch.zeros((len(rows), pw), dtype=torch.long)
    responses = torch.full((len(rows), rw), pad, dtype=torch.long)
    mask, attn, logp = torch.zeros(len(rows), rw), torch.zeros(len(rows), rw), torch.zeros(len(rows), rw)
    token_versions = torch.full((len(rows), rw), -1, dtype=torch.long)
    for i, (p, o) in enumerate(zip(prompt_ids, rows)):
        prompts_t[i, pw - len(p):], prompt_mask[i, pw - len(p):] = torch.tensor(p, dtype=torch.long), 1
        if o is None or not o.response_ids:
            continue
        k = len(o.response_ids)
        responses[i, :k] = torch.tensor(o.response_ids)
        mask[i, :k] = torch.tensor(o.response_mask, dtype=torch.float)
        attn[i, :k] = 1.0
        if o.response_logprobs:
            logp[i, :k] = torch.tensor(o.response_logprobs, dtype=torch.float) * mask[i, :k]
        if o.response_versions:
            token_versions[i, :k] = torch.tensor(o.response_versions)
    of = lambda xs: [xs[j // n] for j in sample]  # noqa: E731 - a prompt's field for each row
    extra = [dict(e or {}) for e in of(prompts.extra_infos)]
    infos = [row_info(o, e) for o, e in zip(rows, extra)]
    reasons = ["aborted" if o is None else "length" if len(o.response_ids) >= response_length else "eos" for o in rows]
    grammar = [o.response_grammar or {} if o is not None else {} for o in rows]
    return RolloutBatch(prompts=prompts_t, prompt_mask=prompt_mask, responses=responses, response_mask=mask,
                        response_attention=attn, rollout_logprobs=logp, token_versions=token_versions,
                        group_ids=torch.tensor(of(prompts.indices), dtype=torch.long),
                        versions=torch.full((len(rows),), version, dtype=torch.long),
                        data_sources=of(prompts.data_sources), ground_truths=of(prompts.ground_truths),
                        extra_infos=extra, stop_reasons=reasons, agent_infos=infos,
                        grammar_masks=grammar if any(grammar) else None)


def row_info(o: AgentLoopOutput | None, extra: dict) -> dict:
    """A row's agent_infos entry (and what it adds to its extra_info, where reward functions read it)."""
    if o is None:
        return {}
    extra.update(num_turns=o.num_turns, turn_scores=o.extra_fields.get("turn_scores", []),
                 tool_rewards=o.extra_fields.get("tool_rewards", []))
    info = {"num_turns": o.num_turns, "reward_score": o.reward_score, **{
        k: float(o.metrics.get(k, 0.0)) for k in ("generate_sequences", "tool_calls")},
        "num_preempted": float(o.metrics.get("num_preempted", -1)),
        "tool_calls_made": o.extra_fields.get("tool_calls_made", len(o.extra_fields.get("tool_rewards", []))),
        "tool_call_attempts": int(o.extra_fields.get("tool_call_attempts", 0)),
        "tool_spans": list(o.metrics.get("tool_spans", [])),
        "sample_spans": list(o.metrics.get("sample_spans", [])),  # per turn: profiler/samples.py
        "tool_errors": len(o.extra_fields.get("tool_errors", []))}
    if "interaction_turns" in o.extra_fields:
        info.update(interaction=float(o.metrics.get("interaction", 0.0)),
                    interaction_turns=int(o.extra_fields["interaction_turns"]),
                    interaction_errors=len(o.extra_fields.get("interaction_errors", [])))
    if "session" in o.extra_fields:  # openai_agent: the session this row is a chain of
        info["session"] = o.extra_fields["session"]
    return info
