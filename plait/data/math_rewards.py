"""Rule rewards for the math data sets verl's preprocessing scripts produce: GSM8K, MATH, DAPO.

Each scorer takes the response text and the ground truth as stored in the row and returns a
number (or a dict with "score"), the way verl scores these sources, so a verl user's GSM8K or
MATH parquet trains against the same targets here:

- GSM8K (`openai/gsm8k`): the answer is the number after the last `#### ` (digits, `.`, `,`; so
  `#### $42` has none), commas dropped; "flexible" takes the last such run anywhere instead, as
  written ("1,000" is not "1000"). 1.0 when it equals the ground truth string, `format_score` when
  an answer was found but is wrong.
- MATH (`lighteval/MATH`, ...): the answer is the last `\\boxed{...}` (or `\\boxed x$`);
  both sides are normalised (Hendrycks et al.'s MATH rules: `\\dfrac` -> `\\frac`, a unit after
  `\\text{ ` and spaces dropped, `\\%` dropped, `0.5` -> `\\frac{1}{2}`, ...) and compared as
  strings; where a rule cannot apply the raw strings are compared. A ground truth that is not a
  string never matches. 1.0 or 0.0.
- DAPO (`math_dapo`, `math`, `math_dapo_reasoning`, `aime*`): the answer follows the last `Answer:`,
  both sides normalised with Minerva's rules (Lewkowycz et al. 2022); without an `Answer:` line the
  last `\\boxed{...}` of the last 100 characters, compared as written. +1 when right, -1 otherwise,
  with "acc" and "pred"; an `Answer:` line that normalises to `[INVALID]` falls back to the box, and
  a ground truth that is not a string is an error (verl raises too).

- Geometry3k (`hiyouga/geometry3k`): the last `\\boxed{...}` graded against the ground truth by
  mathruler's `grade_answer` (PRM800K's grader: MATH normalisation, then LaTeX to text and sympy),
  the grader verl calls, so the two agree; 0.9 for a right answer plus 0.1 when the whole response
  is `<think>...</think>` followed by a box, as verl 0.9.1 weighs them.

These follow verl 0.9.1's scorers (verl/utils/reward_score), checked side by side on the same strings.

Left out: symbolic equivalence outside geometry3k (math-verify), code execution, and the other
sources verl routes (numina, code contests): score those with a custom reward function.
"""

from __future__ import annotations

import re

TAIL_CHARS = 300  # answers sit at the end; regexes over a whole long response are slow


# -- GSM8K ---------------------------------------------------------------------------------------

def gsm8k_answer(response: str, method: str = "strict") -> str | None:
    """The final answer of a GSM8K response; None if there is none. strict: the number after the last
    `#### `, commas dropped. flexible: the last run of digits, `.` and `,` that is not a lone `.`, as
    written (verl 0.9.1: "1,000" stays "1,000"; with only lone dots, the first of them)."""
    tail = response[-TAIL_CHARS:]
    if method == "strict":
        found = re.findall(r"#### (-?[0-9.,]+)", tail)
        return found[-1].replace(",", "").replace("$", "") if found else None
    if method != "flexible":
        raise ValueError(f"gsm8k method must be 'strict' or 'flexible', not {method!r}")
    found = re.findall(r"-?[0-9.,]+", tail)
    valid = [s for s in found if s != "."]
    return valid[-1] if valid else (found[0] if found else None)


def gsm8k_score(solution_str: str, ground_truth: str, method: str = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    answer = gsm8k_answer(solution_str, method)
    if answer is None:
        return 0.0
    return score if answer == ground_truth else format_score  # a non-string ground truth never matches


def gsm8k_synthetic_score(solution_str: str, ground_truth: str) -> dict:
    """plait's synthetic word problems (word_problems.py): the last number of the response must be the
    answer (1, else 0), its thousands separators dropped ("1,000" is 1000: plait's rule for its own task;
    verl's flexible GSM8K mode compares the text as written). `acc` is that score, which verl's validation
    reports as the core metric (val-core/gsm8k_synthetic/acc/mean@N) when a reward returns it; `strict` is
    verl's default strict rule (the number after the last "####")."""
    numbers = [s.replace(",", "") for s in re.findall(r"-?[0-9.,]+", solution_str[-TAIL_CHARS:])]
    numbers = [s for s in numbers if s.strip(".")]
    score = 1.0 if numbers and numbers[-1].rstrip(".") == ground_truth else 0.0
    return {"score": score, "acc": score, "strict": gsm8k_score(solution_str, ground_truth)}


# -- MATH ----------------------------------------------------------------------------------------

def last_boxed(text: str) -> str | None:
    """MATH's answer: `\\boxed x$` wherever it appears (the text after the last `\\boxed `, up to a
    dollar sign), else the content of the last `\\boxed{...}`, braces balanced; None if there is none
    or it does not close (verl scores `\\fbox` 0 too)."""
    if "\\boxed " in text:
        return text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    rest = text[start + len("\\boxed"):] if start >= 0 else ""
    return _braced(rest) if rest.startswith("{") else None


def _braced(rest: str) -> str | None:
    """The content of the brace group `rest` opens with (its first brace, balanced); None if it never closes."""
    depth = 0
    for i, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if ch == "}" and depth == 0:
            return rest[rest.index("{") + 1:i]
    return None


def _braced_fracs(s: str) -> str:
    r"""\frac12 -> \frac{1}{2}, \frac1{2} -> \frac{1}{2}: single-character arguments get braces.
    ValueError for a \frac with nothing after it (verl then compares the raw strings)."""
    out, parts = [], s.split("\\frac")
    out.append(parts[0])
    for part in parts[1:]:
        if not part:
            raise ValueError("\\frac with nothing after it")
        if part.startswith("{"):
            out.append("\\frac" + part)
            continue
        if len(part) < 2:
            return s  # "\frac" and one character: left as it was
        num, rest = part[0], part[1:]
        den, rest = (rest, "") if rest.startswith("{") else (f"{{{rest[0]}}}", rest[1:])
        out.append(f"\\frac{{{num}}}{den}{rest}")
    return "".join(out)


def _braced_sqrt(s: str) -> str:
    r"""\sqrt3 -> \sqrt{3} (any one character after \sqrt gets braces). ValueError for a \sqrt with
    nothing after it before the next \sqrt or the end (\sqrt\sqrt3: verl then compares the raw strings)."""
    head, *parts = s.split("\\sqrt")
    if any(not part for part in parts):
        raise ValueError("\\sqrt with nothing after it")
    return head + "".join("\\sqrt" + (part if part[0] == "{" else f"{{{part[0]}}}{part[1:]}") for part in parts)


def normalize_math_answer(s: str) -> str:
    """MATH's answer normalisation: the same number or expression written two common ways maps
    to one string. ValueError where a rule cannot apply (two units, a bare \\sqrt)."""
    s = s.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    s = s.replace("tfrac", "frac").replace("dfrac", "frac")
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("^{\\circ}", "").replace("^\\circ", "")
    s = s.replace("\\$", "")
    if "\\text{ " in s:  # a unit and all after it: "5\text{ cm}^2" -> "5"
        if s.count("\\text{ ") > 1:
            raise ValueError("more than one unit")
        s = s.split("\\text{ ")[0]
    s = s.replace("\\\\%", "").replace("\\%", "")  # \\% (3 or 4 backslashes written) then \%; a bare % stays
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    lhs, eq, rhs = s.partition("=")
    if eq and len(lhs) <= 2 and "=" not in rhs:  # "x = 3" -> "3"
        s = rhs
    s = _braced_sqrt(s).replace(" ", "")
    s = _braced_fracs(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(-?\d+)/(-?\d+)", s)
    if m and s == f"{int(m.group(1))}/{int(m.group(2))}":  # "1/2", not "01/2"
        s = f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}"
    return s


def math_score(solution_str: str, ground_truth: str) -> float:
    answer = last_boxed(solution_str)
    if answer is None or not isinstance(ground_truth, str):
        return 0.0
    try:
        return float(normalize_math_answer(answer) == normalize_math_answer(ground_truth))
    except ValueError:  # a rule that cannot apply: the strings as written
        return float(answer == ground_truth)


# -- DAPO (Minerva normalisation) ----------------------------------------------------------------

MINERVA_REPLACE = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                   ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
                   ("\\text{m}", "\\text{}")]
MINERVA_DROP = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
                "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm",
                "gm", "pounds", "meters", "meals", "edges", "students", "childrentickets",
                "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
                "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!",
                "{,}", '"', "\\dots"]


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation of a final answer: the right side of the last '=', units and
    filler words dropped, `\\text{}`/`\\boxed{}` wrappers removed, shorthand TeX braced."""
    s = answer.split("=")[-1]
    for old, new in MINERVA_REPLACE:
        s = s.replace(old, new)
    for word in MINERVA_DROP:
        s = s.replace(word, "")
    s = re.sub(r"^.*?\$(.*?)\$.*$", r"$\1$", s)  # keep the first inline-math span
    for wrapper in ("text", "textbf", "overline"):
        s = re.sub(rf"\\{wrapper}\{{(.*?)\}}", r"\1", s)
    s = re.sub(r"\\boxed\{(.*)\}", r"\1", s)
    s = re.sub(r"frac([^{])(.)", r"frac{\1}{\2}", s)
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_score(solution_str: str, ground_truth: str) -> dict:
    """+1 when the text after the last 'Answer:' matches the ground truth after normalisation, else -1;
    without an 'Answer:' line, the last `\\boxed{...}` of the last 100 characters as written."""
    if not isinstance(ground_truth, str):  # verl 0.9.1 raises here too (its normalisation splits the string)
        raise TypeError(f"the DAPO/AIME/math scorer needs a string ground truth, got {type(ground_truth).__name__} "
                        f"{ground_truth!r:.40}; store reward_model.ground_truth as a string")
    tail = solution_str[-TAIL_CHARS:]
    found = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", tail)
    pred = normalize_final_answer(found[-1] if found else "[INVALID]")
    correct = pred == normalize_final_answer(ground_truth)
    if pred == "[INVALID]":  # no Answer: line, or one that normalises to [INVALID]: the box decides
        start = tail[-100:].rfind("\\boxed{")
        boxed = _braced(tail[-100:][start + len("\\boxed"):]) if start >= 0 else None
        if boxed is not None:
            pred, correct = boxed, boxed == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


# -- Geometry3k ----------------------------------------------------------------------------------

GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)  # the whole response must match


def geo3k_score(solution_str: str, ground_truth: str, use_boxed: bool = True, format_score: float = 0.1) -> float:
    """Geometry3k: (1 - format_score) for a right answer (the last box, or the whole response with
    use_boxed=False, graded by mathruler) plus format_score for a `<think>...</think> ... \\boxed{...}` response."""
    try:  # a dependency of plait; imported here because it pulls in sympy (a second or two)
        from mathruler.grader import extract_boxed_content, grade_answer
    except ModuleNotFoundError as err:
        raise RuntimeError(f"the geometry3k scorer needs mathruler and pylatexenc (pip install mathruler "
                           f"pylatexenc): {err}") from None
    if not isinstance(ground_truth, str):  # verl 0.9.1 raises too (the grader strips the string)
        raise TypeError(f"the geometry3k scorer needs a string ground truth, got {type(ground_truth).__name__} "
                        f"{ground_truth!r:.40}; store reward_model.ground_truth as a string")
    answer = extract_boxed_content(solution_str) if use_boxed else solution_str  # "None" when there is no box
    right = 1.0 if grade_answer(answer, ground_truth) else 0.0
    well_formed = 1.0 if GEO3K_FORMAT.fullmatch(solution_str) else 0.0
    return (1.0 - format_score) * right + format_score * well_formed  # verl's order: the same float


MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")  # verl's names
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # verl 0.9.1 scores these (and aime*) as DAPO
GEO3K_SOURCES = ("hiyouga/geometry3k",)  # verl's examples/data_preprocess/geo3k.py writes this data_source
