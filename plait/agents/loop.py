"""Agent loops, verl 0.9.1's meaning and names: one coroutine per trajectory that asks the engine
for tokens (token in, token out), calls tools and returns an `AgentLoopOutput`.

Two loops are registered: `single_turn_agent` (one generation) and `tool_agent`, a state machine
PENDING -> GENERATING -> PROCESSING_TOOLS -> GENERATING ... -> TERMINATED:
- GENERATING samples one assistant turn (its ids appended exactly as sampled, plait/agents/tokens.py)
  and stops the trajectory when the response budget (`rollout.response_length`, i.e.
  data.max_response_length) is used up, at `multi_turn.max_assistant_turns` or
  `max_user_turns`, or when the turn holds no tool call (hermes or gpt-oss format) and no interaction is set;
- PROCESSING_TOOLS runs the first `max_parallel_calls` calls through the ToolBox (isolated
  processes, plait/agents/tools.py), appends the tool messages as the chat template's suffix diff
  (mask 0), and stops if that fills the budget; each tool answer counts as one user turn.
- INTERACTING (with `multi_turn.interaction_config_path`): a turn without tool calls is answered by the
  row's interaction (plait/agents/interactions.py) as the user: a user message (mask 0), its score in
  turn_scores; it ends the trajectory when the interaction says so.
A user loop subclasses `AgentLoopBase`, is decorated with `@register("name")` or listed in
`rollout.agent.agent_loop_config_path`, and may set `reward_score` to replace the reward function.

Each batch of tool calls is timed (wall clock, `metrics["tool_spans"]`); the trainer writes them as
"tool_calls" spans of the rollout role into timeline.jsonl, beside the rollout's "gen" span, so a
report can tell how much of generation went to tools.

Left out: multimodal inputs, tool_call ids (hermes and gpt-oss give none here),
tool spans in the torch profiler's trace (the timeline has them).
"""

from __future__ import annotations

import enum
import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional
from uuid import uuid4

from plait.agents.tokens import ContinuousTokens, Trajectory
from plait.profiler.samples import add_span
from plait.agents.tool_parser import count_call_blocks, parse_tool_calls

logger = logging.getLogger(__name__)


@dataclass
class TokenOutput:
    """What the engine returns for one request (verl's TokenOutput, plus per-token policy versions)."""
    token_ids: list[int]
    log_probs: Optional[list[float]] = None
    stop_reason: str = "eos"           # eos | length | aborted
    versions: list[int] = field(default_factory=list)  # policy version of each token
    num_preempted: int = -1
    started: float = 0.0               # plait: wall time the engine took the request up (its queue wait ends)
    prefilled: float = 0.0             # plait: ... and ended its prefill (0: the engine does not say)


@dataclass
class AgentLoopOutput:
    """One trajectory, verl's fields. response_ids holds sampled AND tool tokens; response_mask is 1 on
    sampled ones only (what is trained on); every response token is attended."""
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: Optional[list[float]] = None
    reward_score: Optional[float] = None   # set by a loop that scores its own trajectory: replaces the reward fn
    num_turns: int = 0                     # user + assistant + tool turns (verl counts the prompt as one)
    metrics: dict[str, Any] = field(default_factory=dict)  # generate_sequences / tool_calls seconds
    extra_fields: dict[str, Any] = field(default_factory=dict)  # turn_scores, tool_rewards, ...
    multi_modal_data: Optional[dict[str, Any]] = None
    routed_experts: Optional[Any] = None
    response_versions: Optional[list[int]] = None  # plait: policy version per response token (-1: not sampled)
    response_grammar: Optional[dict] = None  # plait: its tokens sampled under a decoding grammar, as a batch row
    #   carries them (RolloutBatch.grammar_masks); None: none


@dataclass
class MergeResult:
    """verl's Continuous Token merge result (the boundary token a ChatML merge inserts is counted in
    appended_token_count here; it has mask 0 either way)."""
    token_ids: list[int]
    appended_token_count: int
    kind: str = "context"
    inserted_token_ids: list[int] = field(default_factory=list)
    removed_prefix_token_count: int = 0


_registry: dict[str, dict] = {}


def register(agent_name: str):
    """Class decorator: make this loop available as `agent_name` (a row's agent_name column or
    rollout.agent.default_agent_loop)."""
    def decorator(cls):
        _registry[agent_name] = {"_target_": f"{cls.__module__}.{cls.__qualname__}", "cls": cls}
        return cls
    return decorator


def registered() -> dict[str, dict]:
    return dict(_registry)


class ConfigWrap:
    """verl's DictConfigWrap: the config travels as `.config`."""

    def __init__(self, config):
        self.config = config


class AgentLoopBase(ABC):
    """Base of every agent loop; the constructor takes verl's arguments.

    `server_manager.generate(request_id=, prompt_ids=, sampling_params=)` is awaited for each turn and
    returns a TokenOutput; `tools` is plait's ToolBox (or None); `ct` the Continuous Token builder."""

    def __init__(self, trainer_config: ConfigWrap, server_manager, tokenizer, processor=None, dataset_cls=None,
                 data_config: ConfigWrap | None = None, hf_model_type: str | None = None, tools=None,
                 interactions=None, **kwargs):
        self.config = trainer_config.config
        self.rollout_config = self.config.actor_rollout_ref.rollout
        self.server_manager, self.tokenizer, self.processor = server_manager, tokenizer, processor
        self.dataset_cls, self.data_config = dataset_cls, (data_config.config if data_config else self.config.data)
        self.tools, self.interactions = tools, interactions  # ToolBox, InteractionBox (or None)
        self.prompt_length = self.config.data.max_prompt_length
        self.response_length = self.config.data.max_response_length
        self.ct = ContinuousTokens(tokenizer, hf_model_type)

    async def ct_build_initial_tokens(self, messages: list[dict], tools: list[dict] | None = None, **_mm) -> list[int]:
        return self.ct.initial(messages, tools, self.prompt_length).ids

    async def ct_merge_assistant_token(self, runtime_token_ids: list[int], assistant_token_ids: list[int],
                                       response_mask: list[int], response_logprobs: list[float] | None = None,
                                       assistant_logprobs: list[float] | None = None):
        """verl's: append sampled ids (mask 1, their log-probs) -> (MergeResult, mask, log-probs)."""
        n = len(assistant_token_ids)
        logprobs = None if response_logprobs is None else [*response_logprobs, *(assistant_logprobs or [0.0] * n)]
        return (MergeResult(list(runtime_token_ids) + list(assistant_token_ids), n, "assistant"),
                [*response_mask, *[1] * n], logprobs)

    async def ct_merge_context_msg(self, previous_messages: list[dict], updated_messages: list[dict],
                                   runtime_token_ids: list[int], response_mask: list[int],
                                   response_logprobs: list[float] | None = None, tools: list[dict] | None = None):
        """verl's: append the new messages as the template's suffix diff (mask 0) -> (MergeResult, mask, log-probs)."""
        t = Trajectory(ids=list(runtime_token_ids), mask=list(response_mask),
                       logprobs=list(response_logprobs or [0.0] * len(response_mask)), versions=[-1] * len(response_mask))
        added = self.ct.add_messages(t, previous_messages, updated_messages, tools)
        return MergeResult(t.ids, added, "context"), t.mask, (None if response_logprobs is None else t.logprobs)

    @abstractmethod
    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        """kwargs: the row's fields (raw_prompt, extra_info, tools_kwargs, index, data_source, ...)."""


class Timer:
    """verl's simple_timer: adds the seconds of a block to metrics[name]."""

    def __init__(self, metrics: dict, name: str):
        self.metrics, self.name = metrics, name

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.metrics[self.name] = self.metrics.get(self.name, 0.0) + time.perf_counter() - self.start


def output_of(t: Trajectory, response_length: int, num_turns: int, metrics: dict, extra: dict) -> AgentLoopOutput:
    """The AgentLoopOutput of a finished trajectory, its response cut to `response_length` as verl does."""
    n = response_length
    return AgentLoopOutput(prompt_ids=t.ids[:t.prompt_len], response_ids=t.ids[t.prompt_len:][:n],
                           response_mask=t.mask[:n], response_logprobs=t.logprobs[:n], num_turns=num_turns,
                           metrics=metrics, extra_fields=extra, response_versions=t.versions[:n])


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """One assistant turn on the rendered prompt."""

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        t = self.ct.initial(list(kwargs["raw_prompt"]), None, self.prompt_length)
        metrics: dict[str, Any] = {}
        start = time.time()
        with Timer(metrics, "generate_sequences"):
            out = await self.server_manager.generate(request_id=kwargs.get("request_id"), prompt_ids=list(t.ids),
                                                     sampling_params={**sampling_params, "max_tokens": self.response_length})
        add_span(metrics, "gen", start, time.time(), turn=1)
        self.ct.add_assistant(t, out.token_ids, out.log_probs or [0.0] * len(out.token_ids), out.versions)
        metrics["num_preempted"] = out.num_preempted
        return output_of(t, self.response_length, 2, metrics, {"turn_scores": [], "tool_rewards": []})


class AgentState(enum.Enum):
    PENDING = "pending"
    GENERATING = "generating"
    PROCESSING_TOOLS = "processing_tools"
    INTERACTING = "interacting"
    TERMINATED = "terminated"


@dataclass
class AgentData:
    """One tool_agent trajectory's state (verl's AgentData, text only)."""
    messages: list[dict]
    tools_kwargs: dict
    schemas: list[dict] | None
    selection: list[str] | None
    row: str
    request_id: Any
    metrics: dict = field(default_factory=dict)
    trajectory: Trajectory | None = None
    calls: list = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    tool_rewards: list[float] = field(default_factory=list)
    tool_errors: list[str] = field(default_factory=list)
    call_attempts: int = 0  # call blocks written in turns the loop read (parsed or not)
    user_turns: int = 0
    assistant_turns: int = 0
    interaction: str | None = None          # the row's interaction (None: none, or it failed)
    interaction_kwargs: dict = field(default_factory=dict)
    interaction_turns: int = 0
    interaction_errors: list[str] = field(default_factory=list)


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        mt = self.rollout_config.multi_turn
        self.max_user_turns, self.max_assistant_turns = mt.max_user_turns, mt.max_assistant_turns
        self.max_parallel_calls, self.format = mt.max_parallel_calls, mt.format

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        extra = kwargs.get("extra_info") or {}
        selection = extra.get("tool_selection") or None
        schemas = self.tools.schemas(selection) if self.tools is not None else []
        data = AgentData(messages=list(kwargs["raw_prompt"]), tools_kwargs=kwargs.get("tools_kwargs") or {},
                         schemas=schemas, selection=selection, row=f"row {kwargs.get('index')}",
                         request_id=str(kwargs.get("request_id") or uuid4().hex))
        await self.start_interaction(data, extra)
        state = AgentState.PENDING
        while state != AgentState.TERMINATED:
            if state == AgentState.PENDING:
                data.trajectory = self.ct.initial(data.messages, data.schemas, self.prompt_length)
                state = AgentState.GENERATING
            elif state == AgentState.GENERATING:
                state = await self.generating(data, sampling_params)
            elif state == AgentState.INTERACTING:
                state = await self.interacting(data)
            else:
                state = await self.processing_tools(data)
        if data.interaction is not None:
            await self.interaction_call(data, "finalize")
        extra_fields = {"turn_scores": data.turn_scores, "tool_rewards": data.tool_rewards,
                        "tool_errors": data.tool_errors, "tool_call_attempts": data.call_attempts}
        if self.interactions is not None:
            extra_fields.update(interaction_turns=data.interaction_turns, interaction_errors=data.interaction_errors)
        return output_of(data.trajectory, self.response_length, data.user_turns + data.assistant_turns + 1,
                         data.metrics, extra_fields)

    async def generating(self, data: AgentData, sampling_params: dict) -> AgentState:
        t = data.trajectory
        budget = self.response_length - len(t.mask)
        start = time.time()
        with Timer(data.metrics, "generate_sequences"):
            out = await self.server_manager.generate(request_id=data.request_id, prompt_ids=list(t.ids),
                                                     sampling_params={**sampling_params, "max_tokens": budget})
        data.assistant_turns += 1
        add_span(data.metrics, "gen", start, time.time(), turn=data.assistant_turns)  # samples.jsonl, per turn
        self.ct.add_assistant(t, out.token_ids, out.log_probs or [0.0] * len(out.token_ids), out.versions)
        if len(t.mask) >= self.response_length:
            return AgentState.TERMINATED
        if self.max_assistant_turns and data.assistant_turns >= self.max_assistant_turns:
            return AgentState.TERMINATED
        if self.max_user_turns and data.user_turns >= self.max_user_turns:
            return AgentState.TERMINATED
        text = self.tokenizer.decode(out.token_ids)
        content, data.calls = parse_tool_calls(text, self.format)
        data.call_attempts += count_call_blocks(text, self.format)
        if data.calls:
            data.messages.append(self.assistant_message(content, data.calls))
            return AgentState.PROCESSING_TOOLS
        if data.interaction is None:
            data.messages.append(self.assistant_message(content, []))
            return AgentState.TERMINATED
        # the interaction reads the turn as verl hands it: decoded without special tokens
        data.messages.append({"role": "assistant", "content": self.tokenizer.decode(out.token_ids, skip_special_tokens=True)})
        return AgentState.INTERACTING

    def assistant_message(self, content: str, calls: list) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": _arguments(c)}}
                                     for c in calls[:self.max_parallel_calls]]
        return message

    async def processing_tools(self, data: AgentData) -> AgentState:
        previous = list(data.messages)
        calls = data.calls[:self.max_parallel_calls]
        start = time.time()
        with Timer(data.metrics, "tool_calls"):
            if self.tools is None:
                results = [_no_tools(c) for c in calls]
            else:
                results = await self.tools.call(calls, data.tools_kwargs, data.row, messages=previous,
                                                selection=data.selection)
        data.metrics.setdefault("tool_spans", []).append((start, time.time()))  # wall clock: any process
        add_span(data.metrics, "tool", start, time.time(), turn=data.assistant_turns, calls=len(calls))
        for result in results:
            data.messages.append({"role": "tool", "content": result.text or ""})
            if result.reward is not None:
                data.tool_rewards.append(result.reward)
            if result.error:
                data.tool_errors.append(result.error)
        t = data.trajectory
        trial = Trajectory(ids=list(t.ids), mask=list(t.mask), logprobs=list(t.logprobs), versions=list(t.versions))
        self.ct.add_messages(trial, previous, data.messages, data.schemas)
        if len(trial.mask) >= self.response_length:  # verl drops the tool turn that does not fit
            return AgentState.TERMINATED
        data.trajectory = trial
        data.user_turns += 1
        return AgentState.GENERATING


    async def start_interaction(self, data: AgentData, extra: dict) -> None:
        """The row's interaction (extra_info.interaction_kwargs.name) started for this trajectory."""
        if self.interactions is None:
            return
        kwargs = dict(extra.get("interaction_kwargs") or {})
        data.interaction, data.interaction_kwargs = self.interactions.pick(kwargs, data.row), kwargs
        await self.interaction_call(data, "start")

    async def interaction_call(self, data: AgentData, op: str) -> Any:
        """One call of the row's interaction in its worker; a failure is one warning line and ends
        the conversation (data.interaction becomes None)."""
        with Timer(data.metrics, "interaction"):
            value, error = await self.interactions.call(op, data.interaction, data.request_id, data.interaction_kwargs,
                                                        data.row, messages=list(data.messages) if op == "respond" else None,
                                                        max_chars=CHARS_PER_TOKEN * self.response_length)
        if error is not None:
            logger.warning(error)
            data.interaction_errors.append(error)
            data.interaction = None
        return value

    async def interacting(self, data: AgentData) -> AgentState:
        """verl's INTERACTING state: the interaction answers the assistant as the user; its text is
        appended as a user message (the template's suffix diff, mask 0) and its score to turn_scores."""
        previous = list(data.messages)
        reply = await self.interaction_call(data, "respond")
        data.user_turns += 1
        if reply is None:
            return AgentState.TERMINATED
        data.interaction_turns += 1
        if reply["score"] is not None:
            data.turn_scores.append(reply["score"])
        for key, value in reply["metrics"].items():
            data.metrics[f"interaction/{key}"] = value
        data.messages.append({"role": "user", "content": reply["text"]})
        self.ct.add_messages(data.trajectory, previous, data.messages, data.schemas)
        if reply["terminate"]:
            return AgentState.TERMINATED
        if len(data.trajectory.mask) >= self.response_length:  # verl keeps a user turn past the budget (the output
            data.assistant_turns += 1  # is cut to it) and samples one more turn, which the cut drops: counted, not sampled
            return AgentState.TERMINATED
        return AgentState.GENERATING


CHARS_PER_TOKEN = 64  # a user turn cut at 64 characters per token of the budget loses nothing the budget keeps


def _arguments(call) -> Any:
    """The arguments as the chat template wants them: the parsed object when it is JSON, else the text."""
    try:
        value = json.loads(call.arguments)
    except (TypeError, ValueError):
        return call.arguments
    return value if isinstance(value, dict) else call.arguments


@dataclass
class _NoToolResult:
    text: str
    reward: float = 0.0
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0


def _no_tools(call) -> _NoToolResult:
    """No tool configured: verl answers a call of an unknown function with this text and reward 0."""
    msg = f"Unknown function '{call.name}'. Available tools: []"
    return _NoToolResult(text=msg, error=msg)
