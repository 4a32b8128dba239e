"""A ReAct calculator agent written only against the `openai` SDK: the smollm2_gsm8k_gateway preset trains
SmolLM2 through plait's gateway with it, unchanged but for the base URL and key it is given.

It asks the model with a `calculator` tool; when the answer calls it, it computes the expression and
hands back the result as a tool message, and asks again; the third answer, or the first without a call,
is final. It returns None: plait scores the final conversation with the run's reward function (the
preset's GSM8K rule), as it would score an in-process rollout.
"""

import ast
import json
import operator

from openai import AsyncOpenAI

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression (+ - * / and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
MAX_CALLS = 3
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression) -> str:
    """The expression's value as the calculator writes it (12, 0.5), or an error line."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")
    try:
        result = float(value(ast.parse(str(expression).replace(",", ""), mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError, RecursionError) as err:
        return f"Error: {err}"
    return str(int(result)) if result.is_integer() else f"{result:.6f}".rstrip("0").rstrip(".")


async def run(row, base_url, api_key):
    client = AsyncOpenAI(base_url=base_url, api_key=api_key)
    messages = list(row["messages"])
    for _ in range(MAX_CALLS):
        response = await client.chat.completions.create(model="smollm2", messages=messages, tools=[CALCULATOR])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression")
            except (ValueError, AttributeError):
                expression = None
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return None
