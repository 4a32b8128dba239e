"""Synthetic GSM8K-style word problems: short arithmetic stories in GSM8K's row format.

These are NOT GSM8K. They are generated here, from a seed, in the shape verl's GSM8K
preprocessing gives `openai/gsm8k`: the question followed by verl's instruction to think step by
step and put the final answer after "####", and the ground truth as the bare number (verl's
GSM8K reward reads the number after the last "####" of the response and compares it), plus one
sentence of plait's on the form of that last line (see INSTRUCTION).

They are mostly one-step stories with small numbers (sums of two one-digit numbers, differences
under 15, products of numbers up to 5, exact shares) and some two-step ones, so
SmolLM2-135M-Instruct gets the arithmetic of some right from the start and RL has both a signal
and room: it mostly learns to finish with "#### <number>" and to stop there. Real GSM8K problems
take 2 to 8 steps with larger numbers, far beyond a model of this size. Every problem draws a
template, names, items and numbers from the rng; `tasks.py` makes the rows and splits train and
test by the question's text.
"""

from __future__ import annotations

import random

# verl's examples/data_preprocess/gsm8k.py appends the first sentence to every question. The second
# is plait's: with verl's sentence alone SmolLM2-135M-Instruct wrote "####" in 3-16 % of its answers
# (32 test problems, greedy and sampled); with both, in 44-62 % (32-48 problems), and many of those fail
# only by what follows it (no number, or more "####" lines after the answer), which is what RL can fix.
# An example line ("if the answer is 42, the last line is: #### 42") raised well-formed answers from
# 5/32 to 22/32 at the start, but the model copied the example's number, and with the format score
# GRPO turned that into "#### 42" for every problem within 5 steps (reward hacking): no example here.
INSTRUCTION = ('Let\'s think step by step and output the final answer after "####". '
               'Write the final line as #### followed by the number only.')
# The system prompt of the tasks that solve these with the calculator tool (tasks.py; agents/builtin_tools.py
# writes the warm start's transcripts with it).
CALCULATOR_SYSTEM = ('You can use a calculator. To call it, write <tool_call>{"name": "calculator", "arguments": '
                     '{"expression": "<arithmetic>"}}</tool_call> and wait for its answer.')

NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kira",
         "Liam", "Maya", "Noah", "Olga", "Pedro", "Rosa", "Sam", "Tara", "Victor")
ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "stamps", "shells",
         "balloons", "cards", "toy cars", "oranges")
CONTAINERS = ("box", "bag", "basket", "jar", "pack")
# How often each of _story's six kinds is drawn: the four one-step kinds three times as often as the
# two two-step ones, so most problems are within the model's reach at the start.
KIND_WEIGHTS = (3, 3, 3, 3, 1, 1)


def _story(rng: random.Random) -> tuple[str, int]:
    """One question (without the instruction) and its answer."""
    name, friend = rng.sample(NAMES, 2)
    item, box = rng.choice(ITEMS), rng.choice(CONTAINERS)
    kind = rng.choices(range(6), weights=KIND_WEIGHTS)[0]
    if kind == 0:  # a + b
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return f"{name} has {a} {item}. {friend} gives {name} {b} more {item}. How many {item} does {name} have now?", a + b
    if kind == 1:  # a - b
        a = rng.randint(5, 15)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {item} and gave {b} of them to {friend}. How many {item} does {name} have left?", a - b
    if kind == 2:  # a * b
        a, b = rng.randint(2, 5), rng.randint(2, 5)
        return f"{name} buys {a} {box}s of {item}. Each {box} holds {b} {item}. How many {item} does {name} buy?", a * b
    if kind == 3:  # (a * b) / b
        each, n = rng.randint(2, 5), rng.randint(2, 4)
        return (f"{name} shares {each * n} {item} equally among {n} friends. "
                f"How many {item} does each friend get?"), each
    if kind == 4:  # a + b - c
        a, b = rng.randint(3, 9), rng.randint(1, 9)
        c = rng.randint(2, a + b - 1)
        return (f"{name} has {a} {item}. {name} buys {b} more and then gives {c} to {friend}. "
                f"How many {item} does {name} have now?"), a + b - c
    # a * b + c
    a, b, c = rng.randint(2, 4), rng.randint(2, 5), rng.randint(1, 5)
    return (f"{name} has {a} {box}s with {b} {item} in each {box}, and {c} loose {item}. "
            f"How many {item} does {name} have in all?"), a * b + c


def word_problem(rng: random.Random) -> tuple[str, str]:
    """A GSM8K-format prompt text (question + verl's instruction) and its answer as a string."""
    question, answer = _story(rng)
    return f"{question} {INSTRUCTION}", str(answer)
