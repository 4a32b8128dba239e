"""A FAPO-style judge for plait's synthetic GSM8K-style problems (the smollm2_gsm8k_judge preset; docs/rewards.md
"A judge as the reward model").

The rule decides right or wrong (plait's gsm8k_synthetic rule: the last number must be the answer). A right answer
of a training row is then shown to the judge, its lines numbered as steps, beside the reference answer; the judge
names the first wrong step in \\boxed{} (-1: none). A right answer the judge finds a flaw in is a flawed positive
and earns 0 instead of 1, as FAPO lowers them (verl-recipe fapo/: a penalty of 1). Validation rows (split test)
are scored by the rule alone, so the validation accuracy stays the rule's.

The judge is asked as FAPO asks verl's reward router: the prompt tokenised with the judge's chat template
(`reward_model_tokenizer`), posted as token ids to SGLang's `/generate` at `reward_router_address`, greedy.
"""

import asyncio
import re

import requests  # one of plait's own dependencies; any HTTP client works (FAPO's uses aiohttp)

from plait.data.math_rewards import gsm8k_synthetic_score, last_boxed

PROMPT = ("Check a student's solution to a math word problem.\n\n"
          "Problem: {problem}\n\n"
          "Correct final answer: {answer}\n\n"
          "Student's solution, one step per line:\n{steps}\n\n"
          "Find the first step that is wrong. Answer with its number in \\boxed{{}}, or \\boxed{{-1}} if every step "
          "is right.")
MAX_VERDICT_TOKENS = 48     # a short verdict: the number in \boxed{} comes first from a small judge, or not at all
FLAWED_PENALTY = 1.0        # FAPO's: a flawed positive is worth no more than a wrong answer


def problem_of(extra_info: dict) -> str:
    """The problem's text: verl's GSM8K rows keep it as extra_info["question"]; plait's as the user message of
    extra_info["raw_prompt"] (data.return_raw_chat), its instruction sentence dropped."""
    if extra_info.get("question"):
        return str(extra_info["question"])
    user = [m["content"] for m in extra_info.get("raw_prompt") or [] if m.get("role") == "user"]
    return user[-1].split(" Let's think step by step")[0] if user else ""


def steps_of(solution: str) -> str:
    lines = [line.strip() for line in re.split(r"\n+|(?<=[.!?])\s+(?=[A-Z])", solution.strip()) if line.strip()]
    return "\n".join(f"Step {i}: {line}" for i, line in enumerate(lines))


def verdict_index(text: str) -> int | None:
    """The step the judge named in its last \\boxed{}, -1 for none; None when it boxed no integer."""
    boxed = last_boxed(text)
    try:
        return int(str(boxed).strip())
    except (TypeError, ValueError):
        return None


async def compute_score(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
    rule = gsm8k_synthetic_score(solution_str, str(ground_truth))
    result = {**rule, "judged": 0.0, "flawed_positive": 0.0, "verdict_boxed": 0.0}
    extra_info = extra_info or {}
    if not rule["acc"] or extra_info.get("split") == "test":
        return result
    prompt = PROMPT.format(problem=problem_of(extra_info), answer=ground_truth, steps=steps_of(solution_str))
    ids = reward_model_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=True,
                                                     add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # transformers 5 answers a BatchEncoding
    response = await asyncio.to_thread(requests.post, f"http://{reward_router_address}/generate", json={
        "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_VERDICT_TOKENS}})
    response.raise_for_status()
    verdict = reward_model_tokenizer.decode(response.json()["output_ids"], skip_special_tokens=True)
    index = verdict_index(verdict)
    flawed = index is not None and index != -1
    return {**result, "judged": 1.0, "verdict_boxed": float(index is not None), "flawed_positive": float(flawed),
            "score": rule["score"] - FLAWED_PENALTY * flawed}
