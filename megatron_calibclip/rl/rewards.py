"""Rule-based math reward: extract the final answer, compare numerically, optional format bonus.

Why rule-based: RL with verifiable rewards needs a reward that cannot be gamed by style
and costs nothing per sample. The usual failure is not the comparison but extraction
and normalisation ("1,000" vs "1000", "\\dfrac{1}{2}" vs "0.5", "$72" vs "72"), which is
what this module is about.

Final answer, first match wins:
  1. the content of the last \\boxed{...} / \\fbox{...} (nested braces; "\\boxed 5" too);
  2. the text after the last "#### " (GSM8K);
  3. the last number in the text (optional, on by default).
Equivalence: both sides are normalised (LaTeX spacing, \\text{}, \\left/\\right, $, %,
degrees, \\frac/\\dfrac, "x = ", thousands separators, "a \\times 10^{k}"); if both parse
as numbers (integers, decimals, fractions, scientific notation) they match when
|a - b| <= max(rel_tol * max(|a|, |b|), abs_tol), except that two integers must be
equal exactly (tolerance is for rounded decimals, not for 100000001 vs 100000000); otherwise
the normalised strings must be equal (whitespace-insensitive).
Known limits: no symbolic equivalence (\\sqrt{2}/2 vs \\frac{\\sqrt{2}}{2}), no sets or
intervals up to reordering, "%" is dropped (50% matches 50, not 0.5).
"""
from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from typing import Literal

_BOX_RE = re.compile(r"\\(?:boxed|fbox)")
_UNWRAP_CMDS = ("text", "textbf", "textit", "textrm", "mathrm", "mathbf", "mbox", "operatorname", "boxed")
_NUMBER_IN_TEXT = re.compile(
    r"(?:(?<![\w)\]])[-−])?"  # a sign only where it cannot be a binary minus ("10-15")
    r"(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:\s*/\s*\d+(?:\.\d+)?)?"  # 3/4
)
_INT_RE = re.compile(r"[+-]?\d+")
_DEC_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_THOUSANDS_RE = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SCI_LATEX_RE = re.compile(r"(\d)\s*(?:\\times|\\cdot|×)\s*10\s*\^\s*\{?\s*([+-]?\d+)\s*\}?")
_TRAILING_UNIT_RE = re.compile(r"^(.*?\d)\s+[A-Za-z][A-Za-z\s.]*$")
_VAR_LHS_RE = re.compile(r"^\s*\\?[A-Za-z][A-Za-z0-9_{}]*\s*$")

FormatStyle = Literal["boxed", "answer_tag", "think_answer"]


def _match_brace(text: str, open_idx: int) -> int | None:
    """Index of the '}' matching text[open_idx] == '{', or None if unbalanced."""
    depth = 0
    for i in range(open_idx, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last complete \\boxed{...} (or \\fbox{...}); None if there is none."""
    for m in reversed(list(_BOX_RE.finditer(text))):
        j = m.end()
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            end = _match_brace(text, j)
            if end is not None:
                return text[j + 1 : end].strip()
        elif j > m.end() and j < len(text):  # "\boxed 5": one token
            token = re.match(r"[^\s$]+", text[j:])
            if token:
                return token.group(0)
    return None


def extract_final_answer(text: str, *, allow_last_number: bool = True) -> str | None:
    """The model's final answer string (see module docstring for the order), or None."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str, got {type(text).__name__}")
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        line = tail.splitlines()[0].strip() if tail else ""
        if line:
            return line
    if allow_last_number:
        nums = _NUMBER_IN_TEXT.findall(text)
        if nums:
            return nums[-1]
    return None


def _unwrap_commands(s: str) -> str:
    """\\text{abc} -> abc (nested braces handled)."""
    pattern = re.compile(r"\\(" + "|".join(_UNWRAP_CMDS) + r")\s*\{")
    while True:
        m = pattern.search(s)
        if not m:
            return s
        end = _match_brace(s, m.end() - 1)
        if end is None:
            return s
        s = s[: m.start()] + s[m.end() : end] + s[end + 1 :]


def _replace_fracs(s: str) -> str:
    """\\frac{a}{b} -> (a)/(b); \\frac12 -> (1)/(2)."""
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"(\1)/(\2)", s)
    while True:
        i = s.find("\\frac{")
        if i < 0:
            return s
        a_end = _match_brace(s, i + 5)
        if a_end is None or a_end + 1 >= len(s) or s[a_end + 1] != "{":
            return s
        b_end = _match_brace(s, a_end + 1)
        if b_end is None:
            return s
        num, den = s[i + 6 : a_end], s[a_end + 2 : b_end]
        s = s[:i] + f"({num})/({den})" + s[b_end + 1 :]


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer (LaTeX cosmetics removed)."""
    s = answer.strip()
    for old, new in (
        ("\\displaystyle", ""), ("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""),
        ("\\;", ""), ("\\:", ""), ("\\ ", " "), ("~", " "), ("\\$", ""), ("$", ""),
        ("\\%", ""), ("%", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("°", ""),
        ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("−", "-"), ("{,}", ","),
    ):
        s = s.replace(old, new)
    s = _unwrap_commands(s)
    s = _replace_fracs(s)
    s = _SCI_LATEX_RE.sub(r"\1e\2", s)
    if "=" in s:
        lhs, rhs = s.rsplit("=", 1)
        if _VAR_LHS_RE.match(lhs) and rhs.strip():
            s = rhs
    s = s.strip().rstrip(".").strip()
    while len(s) >= 2 and s[0] == "{" and _match_brace(s, 0) == len(s) - 1:
        s = s[1:-1].strip()
    return s


def _parse_plain(t: str) -> Fraction | None:
    if _THOUSANDS_RE.fullmatch(t):
        t = t.replace(",", "")
    if _INT_RE.fullmatch(t):
        return Fraction(int(t))
    if _DEC_RE.fullmatch(t):
        try:
            return Fraction(Decimal(t))
        except (InvalidOperation, ValueError):
            return None
    return None


def _strip_parens(t: str) -> str:
    """'((1)/(4))' -> '(1)/(4)': drop outer parentheses that match each other."""
    while len(t) >= 2 and t[0] == "(" and t[-1] == ")":
        depth = 0
        for i, ch in enumerate(t):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        if i != len(t) - 1:
            return t
        t = t[1:-1]
    return t


def parse_number(answer: str) -> Fraction | None:
    """Exact rational value of a numeric answer string, or None if it is not a number."""
    s = normalize_answer(answer)
    m = _TRAILING_UNIT_RE.match(s)  # "10 cm", "5 apples"
    if m:
        s = m.group(1)
    t = s.replace(" ", "")
    sign = 1
    if t[:1] in "+-" and t[1:2] == "(":
        sign, t = (-1 if t[0] == "-" else 1), t[1:]
    t = _strip_parens(t)
    if t.count("/") == 1:
        a, b = (_strip_parens(x) for x in t.split("/"))
        num, den = _parse_plain(a), _parse_plain(b)
        if num is None or den is None or den == 0:
            return None
        return sign * num / den
    value = _parse_plain(t)
    return None if value is None else sign * value


def answers_match(pred: str, gold: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Numeric equivalence when both parse as numbers, else normalised string equality."""
    a, b = parse_number(pred), parse_number(gold)
    if a is not None and b is not None:
        if a == b:
            return True
        if a.denominator == 1 and b.denominator == 1:  # integers: exact (100000001 != 1e8)
            return False
        diff = abs(float(a - b))
        return diff <= max(rel_tol * max(abs(float(a)), abs(float(b))), abs_tol)
    if a is not None or b is not None:
        return False
    na = re.sub(r"\s+", "", normalize_answer(pred))
    nb = re.sub(r"\s+", "", normalize_answer(gold))
    if len(na) == 1 and len(nb) == 1 and na.isalpha() and nb.isalpha():  # choice letters
        return na.lower() == nb.lower()
    return na == nb and na != ""


def gold_answer(gold: str | int | float | Fraction) -> str:
    """Reference answer string: a bare answer, or a solution ending in #### / \\boxed{}."""
    if isinstance(gold, bool):
        raise ValueError("gold must be a str or a number, got bool")
    if isinstance(gold, (int, Fraction)):
        return str(gold)
    if isinstance(gold, float):
        if not math.isfinite(gold):
            raise ValueError(f"gold must be finite, got {gold}")
        return repr(gold)
    if not isinstance(gold, str):
        raise ValueError(f"gold must be a str or a number, got {type(gold).__name__}")
    if "\\boxed" in gold or "\\fbox" in gold or "####" in gold:
        extracted = extract_final_answer(gold, allow_last_number=False)
        if extracted is not None:
            return extracted
    return gold.strip()


def verify_math_answer(
    response: str,
    gold: str | int | float | Fraction,
    *,
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    allow_last_number: bool = True,
) -> bool:
    """True when the response's final answer equals the gold answer."""
    pred = extract_final_answer(response, allow_last_number=allow_last_number)
    if pred is None:
        return False
    return answers_match(pred, gold_answer(gold), rel_tol=rel_tol, abs_tol=abs_tol)


def format_reward(text: str, *, style: FormatStyle = "boxed") -> float:
    """1.0 if the response follows the requested answer format, else 0.0.

    boxed: a complete \\boxed{...}; answer_tag: <answer>...</answer>;
    think_answer: <think>...</think> followed by <answer>...</answer>.
    """
    if style == "boxed":
        return 1.0 if extract_boxed(text) is not None else 0.0
    if style == "answer_tag":
        return 1.0 if re.search(r"<answer>.*?</answer>", text, re.DOTALL) else 0.0
    if style == "think_answer":
        ok = re.search(r"<think>.*?</think>\s*<answer>.*?</answer>\s*$", text, re.DOTALL)
        return 1.0 if ok else 0.0
    raise ValueError(f"style={style!r} is not one of ['boxed', 'answer_tag', 'think_answer']")


def math_reward(
    response: str,
    gold: str | int | float | Fraction,
    *,
    correct_reward: float = 1.0,
    wrong_reward: float = 0.0,
    format_weight: float = 0.0,
    format_style: FormatStyle = "boxed",
    rel_tol: float = 1e-6,
    abs_tol: float = 1e-9,
    allow_last_number: bool = True,
) -> float:
    """Scalar reward: correct_reward / wrong_reward (DAPO uses +1 / -1), plus
    format_weight * format_reward when format_weight != 0."""
    ok = verify_math_answer(response, gold, rel_tol=rel_tol, abs_tol=abs_tol, allow_last_number=allow_last_number)
    reward = correct_reward if ok else wrong_reward
    if format_weight:
        reward += format_weight * format_reward(response, style=format_style)
    return float(reward)
