"""plait's own tools: verl's GSM8K and geometry3k answer checkers (for verl's multi-turn GSM8K and
Geo3K examples, where `class_name: verl.tools.gsm8k_tool.Gsm8kTool` / `verl.tools.geo3k_tool.Geo3kTool`
land here when verl does not provide them: verl 0.9.1's wheel ships neither) and a calculator, with
the worked transcripts a supervised warm start teaches it from: for each of plait's synthetic word
problems (plait/data/word_problems.py) one calculator call with the problem's arithmetic, the tool's
answer, and a final line "#### N".

Left out: verl's other built-ins (compat.py says why each is refused).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
import sys
from typing import Any, Optional
from uuid import uuid4

from plait.agents.tools import BaseTool, OpenAIFunctionToolSchema, ToolResponse
from plait.data.math_rewards import geo3k_score, gsm8k_score
from plait.data.word_problems import CALCULATOR_SYSTEM


class Gsm8kTool(BaseTool):
    """verl's `calc_gsm8k_reward`: the model submits its answer; the tool scores it with verl's GSM8K
    rule (flexible: the last number) against the row's `tools_kwargs.calc_gsm8k_reward.create_kwargs
    .ground_truth`, answers "Current parsed answer='..' reward=.." and gives a step reward of 0.0
    when the score beats the instance's previous one, else -0.05 (verl 0.9.1 makes one instance per
    call, so: 0.0 for a right answer, -0.05 for a wrong one)."""

    def __init__(self, config: dict, tool_schema: Optional[OpenAIFunctionToolSchema]):
        super().__init__(config, tool_schema)
        self._instances: dict[str, dict] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {"name": "calc_gsm8k_reward", "description": "A tool for calculating the reward of gsm8k",
                         "parameters": {"type": "object", "required": ["answer"], "properties": {
                             "answer": {"type": "string", "description": "The answer to the question"}}}}})

    async def create(self, instance_id: Optional[str] = None, ground_truth: Optional[str] = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id if instance_id is not None else str(uuid4())
        if ground_truth is None:
            ground_truth = kwargs.get("create_kwargs", {}).get("ground_truth")
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = parameters.get("answer", "")
        answer = answer if isinstance(answer, str) else str(answer)
        state = self._instances[instance_id]
        state["response"] = self.submitted(answer)
        reward = await self.calc_reward(instance_id)
        tool_reward = 0.0 if reward > state["reward"] else -0.05  # no better than before: a small penalty
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward!r}"), tool_reward, {}

    @staticmethod
    def submitted(answer: str) -> str:
        """What is scored: the answer as GSM8K's final line."""
        return answer if answer.startswith("#### ") else "#### " + answer

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return gsm8k_score(state["response"], state["ground_truth"], method="flexible", format_score=0.0, score=1.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        del self._instances[instance_id]


class Geo3kTool(Gsm8kTool):
    """verl's `calc_geo3k_reward` (verl's examples at b178a3c): as Gsm8kTool, but the answer is scored as
    submitted by verl's geometry3k rule (mathruler's grader) with no box and no format bonus
    (`use_boxed=False, format_score=0.0`), against `tools_kwargs.calc_geo3k_reward.create_kwargs.ground_truth`."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {"name": "calc_geo3k_reward", "description": "A tool for calculating the reward of geo3k",
                         "parameters": {"type": "object", "required": ["answer"], "properties": {
                             "answer": {"type": "string", "description": "The answer to the question"}}}}})

    @staticmethod
    def submitted(answer: str) -> str:
        return answer

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self._instances[instance_id]
        return geo3k_score(state["response"], state["ground_truth"], use_boxed=False, format_score=0.0)


class CalculatorTool(BaseTool):
    """`calculator`: evaluates one arithmetic expression (numbers, + - * / // %, parentheses) and
    answers its value; anything else raises, which the model reads as verl's error text."""

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return OpenAIFunctionToolSchema.model_validate({
            "type": "function",
            "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                         "parameters": {"type": "object", "required": ["expression"], "properties": {
                             "expression": {"type": "string", "description": "e.g. (12 + 30) * 4 / 3"}}}}})

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        return ToolResponse(text=format_number(evaluate(str(parameters.get("expression", ""))))), 0.0, {}


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}
MAX_MAGNITUDE = 1e15  # bigger numbers are refused: a calculator for word problems, not a bignum engine


def evaluate(expression: str) -> float:
    """The value of an arithmetic expression; ValueError for anything else (names, calls, powers)."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.replace(",", ""), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = -_eval(node.operand) if isinstance(node.op, ast.USub) else _eval(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_eval(node.left), _eval(node.right))  # ZeroDivisionError says itself
    else:
        raise ValueError(f"only numbers, + - * / // % and parentheses are allowed, not {ast.unparse(node)!r}")
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"a number beyond {MAX_MAGNITUDE:g}")
    return value


def format_number(value: float) -> str:
    """42.0 -> "42"; 2/3 -> "0.666667" (six significant decimals, trailing zeros dropped)."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


# -- calculator transcripts for a supervised warm start ------------------------------------------

# The arithmetic of each of word_problems._story's six templates, most specific first: the numbers
# in the order the story states them, and how they combine.
_TEMPLATES = (
    (re.compile(r"has (\d+) .* buys (\d+) more and then gives (\d+) to"), "{} + {} - {}"),
    (re.compile(r"has (\d+) \w+s with (\d+) .* and (\d+) loose"), "{} * {} + {}"),
    (re.compile(r"has (\d+) .*\. \w+ gives \w+ (\d+) more"), "{} + {}"),
    (re.compile(r"had (\d+) .* gave (\d+) of them"), "{} - {}"),
    (re.compile(r"buys (\d+) \w+s of .* holds (\d+)"), "{} * {}"),
    (re.compile(r"shares (\d+) .* among (\d+) friends"), "{} / {}"),
)


def expression_of(question: str) -> Optional[str]:
    """The arithmetic expression a synthetic word problem asks for; None for another text."""
    for pattern, form in _TEMPLATES:
        match = pattern.search(question)
        if match:
            return form.format(*match.groups())
    return None


def calculator_transcript(question: str, answer: str, rng: Optional[random.Random] = None) -> Optional[list[dict]]:
    """The conversation a tool-using model should have on `question`: the call, the calculator's
    answer, and the final line; None when the problem's expression is unknown or gives another answer.
    With `rng`, each operator of the expression is drawn at random from + - * / and the transcript ends with
    what the calculator says to that: the format (a call with the story's numbers, its answer read back)
    without the arithmetic the story asks for."""
    expression = expression_of(question)
    if expression is None or format_number(evaluate(expression)) != answer:
        return None
    if rng is not None:
        expression = re.sub(r"[-+*/]", lambda m: rng.choice("+-*/"), expression)
        answer = format_number(evaluate(expression))
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return [{"role": "system", "content": CALCULATOR_SYSTEM},
            {"role": "user", "content": question},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": f"{expression} = {answer}.\n#### {answer}"}]


def transcript_trajectory(tokenizer, messages: list[dict], model_type: Optional[str] = None,
                          tools: Optional[list[dict]] = None):
    """A transcript's token ids and loss mask exactly as plait's tool_agent lays out a trajectory
    (plait/agents/tokens.py): the prompt rendered with the generation prompt, each assistant turn's
    content encoded plus eos (mask 1), everything else as the chat template's suffix diff (mask 0),
    so a warm start trains on the token layout RL then samples in."""
    from plait.agents.tokens import ContinuousTokens
    ct = ContinuousTokens(tokenizer, model_type)
    start = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    trajectory = ct.initial(messages[:start], tools, prompt_length=sys.maxsize)  # the whole prompt
    i = start
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            ids = tokenizer.encode(messages[i]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
            ct.add_assistant(trajectory, ids, [0.0] * len(ids), [0] * len(ids))
            i += 1
            continue
        end = next((j for j in range(i, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
        ct.add_messages(trajectory, messages[:i], messages[:end], tools)
        i = end
    return trajectory
