"""verl's interactions (a simulated user that answers each assistant turn), with verl's classes and
files: `multi_turn.interaction_config_path` is verl's interaction YAML,

    interaction:
      - name: gsm8k                      # optional: the class name without "Interaction", lower case
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction   # or my_package.my_mod.MyInteraction
        config: {}                       # the constructor's `config` (its "name" is set to the entry's name)

and a row picks one by `extra_info.interaction_kwargs.name`; the rest of `interaction_kwargs` goes to
`start_interaction(instance_id, **kwargs)` and `generate_response(instance_id, messages, **kwargs)`.
`generate_response` returns (should_terminate, response_text, turn_score, metrics): the text is the
next user message (prompt-side tokens: attended, not trained), the score is appended to the row's
`turn_scores` (the reward function reads them in `extra_info`).

Interactions are user code: like tools they run in worker processes of the reward workers' machinery
(never in the trainer), with the rewards' memory and process limits and the tool time limit per call.
An interaction keeps state per trajectory, so a trajectory is pinned to one worker (one single-worker
pool each, the request id choosing). What an interaction raises, or does to its worker, is one
warning line naming the interaction and the row; that trajectory ends there (its worker, with any
other instance's state, is replaced at its next call).

`verl.interactions.gsm8k_interaction.Gsm8kInteraction` runs plait's own implementation of verl's GSM8K
interaction when verl does not provide it (verl 0.9.1's wheel has no `verl.interactions`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from typing import Any, Optional
from uuid import uuid4

import yaml

from plait.agents.compat import ToolLoadError, resolve_tool_class
from plait.safeload import load_yaml
from plait.data.math_rewards import gsm8k_score
from plait.safeload import first_line, outside_text

logger = logging.getLogger(__name__)
INTERACTION_WORKER = os.path.abspath(__file__)
KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


class BaseInteraction:
    """verl's base class, verl's signatures: subclass it and override generate_response."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: Optional[str] = None, **kwargs) -> str:
        return str(uuid4()) if instance_id is None else instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs) -> tuple[bool, str, float, dict[str, Any]]:
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self) -> float:
        return 0.0

    async def finalize_interaction(self) -> None:
        pass


class Gsm8kInteraction(BaseInteraction):
    """verl's GSM8K user: scores the last assistant message with the strict GSM8K rule (`#### N`)
    against the row's `interaction_kwargs.ground_truth`; a right answer ends the conversation with
    "Your response is correct!" (score 1.0), a wrong one asks to reflect and try again (score 0.0)."""

    def __init__(self, config: dict):
        super().__init__(config)
        self._instances: dict[str, dict] = {}

    async def start_interaction(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                                **kwargs) -> str:
        instance_id = str(uuid4()) if instance_id is None else instance_id
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs):
        last = next((m.get("content") for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = last
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, "Your response is correct!", reward, {}
        return False, "Your response is incorrect! You need to reflect on your answer and try again.", reward, {}

    async def calculate_score(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return gsm8k_score(state["response"] or "", state["ground_truth"], method="strict", format_score=0.0, score=1.0)

    async def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._instances.pop(instance_id, None)


# -- loading (worker side: runs user code) ------------------------------------------------------

def load_interactions(path: str) -> dict[str, Any]:
    """name -> interaction instance, in the YAML's order (verl's naming rule for entries without a name)."""
    try:
        with open(path) as f:
            data = load_yaml(f)
    except yaml.YAMLError as err:  # an alias bomb too (safeload.load_yaml)
        raise ToolLoadError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    entries = data.get("interaction") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolLoadError(f"{path}: expected a mapping with a non-empty list under 'interaction' "
                            "(verl's interaction config)")
    out: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolLoadError(f"{path}: interaction[{i}] needs class_name (a dotted path to the interaction's class)")
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ToolLoadError(f"{path}: interaction[{i}].config must be a mapping, not {config!r:.60}")
        name = entry.get("name") or default_name(entry["class_name"])
        if name in out:
            raise ToolLoadError(f"{path}: two interactions are named {name!r}; each name must be unique")
        out[name] = resolve_tool_class(entry["class_name"])(config={**config, "name": name})
    return out


def default_name(class_name: str) -> str:
    simple = class_name.rsplit(".", 1)[-1]
    return (simple[:-len("Interaction")] if simple.endswith("Interaction") else simple).lower()


# -- the worker's entry point (loaded by a reward-pool worker as its "function") ------------------

_STATE: dict = {}  # per worker process: "loop", "interactions" (or the load error line)


def serve(op: str, interaction_config_path: str = "", **call) -> dict:
    """op "describe": {"names"}; "start" / "respond" / "finalize": {"ok": ...} or {"failure": line}."""
    if "loop" not in _STATE:
        _STATE["loop"] = asyncio.new_event_loop()
        try:
            _STATE["interactions"] = load_interactions(interaction_config_path)
        except ToolLoadError as err:
            _STATE["interactions"] = str(err)
        except BaseException as err:  # noqa: BLE001 - the user's class failed while loading
            _STATE["interactions"] = f"loading the interactions raised {type(err).__name__}: {first_line(err)}"
    found = _STATE["interactions"]
    if isinstance(found, str):
        return {"load_error": found}
    if op == "describe":
        return {"names": list(found)}
    try:
        value = _STATE["loop"].run_until_complete(_run(found[call["name"]], op, call))
    except BaseException as err:  # noqa: BLE001 - user code: one line, the trajectory ends
        return {"failure": f"raised {type(err).__name__}: {first_line(err)}"}
    return {"ok": value}


async def _run(interaction, op: str, call: dict):
    kwargs, rid = call["kwargs"], call["instance_id"]
    if op == "start":
        await interaction.start_interaction(rid, **kwargs)
        return None
    if op == "finalize":
        await _finalize(interaction, rid, kwargs)
        return None
    done, text, score, metrics = await interaction.generate_response(rid, call["messages"], **kwargs)
    if not isinstance(text, str):
        raise TypeError(f"generate_response's text is {type(text).__name__}, not a string")
    text = outside_text(text, call["max_chars"])  # bounded here, before it crosses to the trainer
    if score is not None:
        score = float(score)
    return {"terminate": bool(done), "text": text, "score": score,
            "metrics": {k: float(v) for k, v in (metrics or {}).items() if isinstance(v, (int, float))}}


async def _finalize(interaction, rid: str, kwargs: dict) -> None:
    """verl's base class takes no instance id; subclasses (verl's GSM8K one) take it: call as written."""
    import inspect
    params = inspect.signature(interaction.finalize_interaction).parameters
    if params:
        await interaction.finalize_interaction(rid, **kwargs)
    else:
        await interaction.finalize_interaction()


# -- the loop's side (trainer / rollout process: never imports the user's classes) ---------------

class InteractionBox:
    """The run's interactions, seen from the loop. Each trajectory is pinned to one worker (its state
    lives there); calls never raise for what the interaction does: a failure is a line, returned."""

    def __init__(self, pools: list, names: list[str]):
        self.pools, self.names = pools, names

    @classmethod
    def from_config(cls, multi_turn, limits) -> Optional["InteractionBox"]:
        """Loads the YAML in every worker now, so a bad file is a ConfigError before any work."""
        from plait.agents.tools import _run_now
        from plait.configtree import ConfigError
        from plait.data.reward_pool import PoolWording, RewardPool, RewardSpec
        from plait.errors import RunError
        path = multi_turn.interaction_config_path
        if not path:
            return None
        if not os.path.isfile(path):
            raise ConfigError(KEY, path, "verl's interaction YAML (interaction: a list of name, class_name, config): no such file")
        wording = PoolWording(describe=_describe, timeout_key=limits.timeout_key, memory_key=limits.memory_key,
                              must="an interaction must return its answer",
                              load_timeout_key="the interactions' load time limit")
        # as the tool workers: a (re)started worker loads the interactions under the load time limit
        pools = [RewardPool(RewardSpec(INTERACTION_WORKER, "serve", {"interaction_config_path": path}), "interactions",
                            1, limits.timeout_s, limits.memory_limit_mb, limits.max_processes, wording,
                            warmup={"op": "describe"}, load_timeout=limits.load_timeout_s)
                 for _ in range(limits.num_workers)]
        try:
            replies = _run_now([p(op="describe") for p in pools])
        except RunError as err:
            replies = [{"load_error": str(err)}]
        bad = [r for r in replies if not isinstance(r, dict) or "names" not in r]
        if bad:
            for p in pools:
                p.close()
            raise ConfigError(KEY, path, bad[0].get("load_error", f"{bad[0]!r:.100}") if isinstance(bad[0], dict)
                              else f"{bad[0]!r:.100}")
        return cls(pools, replies[0]["names"])

    def pick(self, kwargs: Any, row: str) -> str:
        """The interaction a row's `extra_info.interaction_kwargs` names; ValueError (one line) if none."""
        name = kwargs.get("name") if isinstance(kwargs, dict) else None
        if name is None:
            raise ValueError(f"{row}: extra_info.interaction_kwargs needs a 'name' (one of {self.names}) when "
                             f"{KEY} is set")
        if name not in self.names:
            raise ValueError(f"{row}: extra_info.interaction_kwargs.name={name!r} is not an interaction of {KEY}; "
                             f"known: {self.names}")
        return name

    async def call(self, op: str, name: str, instance_id: str, kwargs: dict, row: str,
                   messages: Optional[list] = None, max_chars: int = 1 << 20) -> tuple[Any, Optional[str]]:
        """(value, None) or (None, the failure line naming the interaction and the row). `max_chars`: where
        the user turn's text is cut (the loop's response budget in characters: more could never be kept)."""
        from plait.errors import RunError
        pool = self.pools[int(hashlib.sha1(instance_id.encode()).hexdigest(), 16) % len(self.pools)]
        try:
            out = await pool(op=op, name=name, instance_id=instance_id, kwargs=kwargs, messages=messages, row=row,
                             max_chars=max_chars)
        except RunError as err:  # the worker died, hung or broke: it is replaced at the next call
            return None, str(err)
        if "ok" in out:
            return out["ok"], None
        reason = out.get("failure") or f"its worker could not load the interactions: {out.get('load_error')}"
        return None, f"interaction {name} on {row} ({op}) {reason}"

    def close(self) -> None:
        for p in self.pools:
            p.close()


def _describe(label: str, args: tuple, kwargs: dict) -> str:
    if "name" not in kwargs:
        return "loading the interactions"
    return f"interaction {kwargs['name']} on {kwargs['row']} ({kwargs['op']})"
