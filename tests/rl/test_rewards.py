"""The math verifier on a table of tricky answers (right and wrong), and the format reward."""
from fractions import Fraction

import pytest

from megatron_calibclip.rl import (
    extract_boxed,
    extract_final_answer,
    format_reward,
    math_reward,
    parse_number,
    verify_math_answer,
)

# (response, gold, is it correct?) -- each expectation follows from the documented rules
TABLE = [
    ("The answer is \\boxed{42}.", "42", True),
    ("The answer is \\boxed{41}.", "42", False),
    ("\\boxed{\\frac{1}{2}}", "0.5", True),  # LaTeX fraction vs decimal
    ("\\boxed{\\dfrac{3}{4}}", "3/4", True),
    ("\\boxed{0.75}", "\\frac{3}{4}", True),
    ("\\boxed{\\frac12}", "1/2", True),  # \frac12 shorthand
    ("\\boxed{-\\frac{2}{3}}", "-2/3", True),
    ("\\boxed{\\frac{2}{3}}", "-2/3", False),  # sign matters
    ("so \\boxed{1,234}", "1234", True),  # thousands separator
    ("\\boxed{1,234,567}", "1234567", True),
    ("\\boxed{1{,}000}", "1000", True),  # LaTeX thousands separator
    ("\\boxed{1,23}", "123", False),  # not a thousands grouping
    ("#### 1,000", "1000", True),  # GSM8K marker
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "She sold 72.\n#### 72", True),  # gold solution text
    ("\\boxed{\\$18}", "18", True),
    ("\\boxed{50\\%}", "50", True),  # percent sign dropped
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{x = -5}", "-5", True),
    ("\\boxed{\\text{10 cm}}", "10", True),  # unit text
    ("\\boxed{{5}}", "5", True),  # nested braces
    ("\\boxed{\\left(\\frac{1}{4}\\right)}", "0.25", True),
    ("\\boxed{2.50}", "2.5", True),
    ("\\boxed{1.5e3}", "1500", True),
    ("\\boxed{1.5 \\times 10^{3}}", "1500", True),
    ("\\boxed{0.3333333}", "1/3", True),  # within rel_tol 1e-6
    ("\\boxed{0.33}", "1/3", False),  # outside tolerance
    ("\\boxed{3.14159}", "3.1415926", True),  # rel diff 8e-7
    ("\\boxed{100000001}", "100000000", False),  # integers compare exactly
    ("\\boxed{−4}", "-4", True),  # unicode minus
    ("\\boxed{3/0}", "3", False),  # not a number
    ("First \\boxed{3}, no wait, \\boxed{5}", "5", True),  # last box wins
    ("First \\boxed{3}, no wait, \\boxed{5}", "3", False),
    ("\\boxed{\\frac{1}{2}} and \\boxed{\\frac{2}{3}}", "2/3", True),
    ("The total is 15 apples and 3 oranges, so 18", "18", True),  # last number
    ("I think it is 17.", "18", False),
    ("Pages 10-15 are missing", "15", True),  # binary minus is not a sign
    ("Pages 10-15 are missing", "-15", False),
    ("The result is -7", "-7", True),
    ("no answer here", "42", False),
    ("", "0", False),
    ("\\boxed 7", "7", True),
    ("\\fbox{8}", "8", True),
    ("\\boxed{b}", "B", True),  # choice letters, case-insensitive
    ("\\boxed{C}", "B", False),
    ("\\boxed{\\text{Paris}}", "Paris", True),
    ("\\boxed{x^2 + 1}", "x^2+1", True),  # whitespace-insensitive string match
    ("\\boxed{x^2 + 2}", "x^2+1", False),
    ("\\boxed{\\sqrt{2}}", "1.41421356", False),  # no symbolic evaluation (documented limit)
    ("\\boxed{12}", 12, True),  # numeric gold
    ("\\boxed{1/2}", 0.5, True),
    ("\\boxed{1/3}", Fraction(1, 3), True),
]


@pytest.mark.parametrize("response, gold, expected", TABLE)
def test_verifier_table(response, gold, expected):
    assert verify_math_answer(response, gold) is expected


def test_table_is_big_and_has_wrong_rows():
    assert len(TABLE) >= 30
    assert sum(1 for *_, ok in TABLE if not ok) >= 10


def test_extraction_order_and_nesting():
    assert extract_boxed("\\boxed{\\frac{a}{\\sqrt{b}}} tail") == "\\frac{a}{\\sqrt{b}}"
    assert extract_boxed("\\boxed{unbalanced") is None
    # an unbalanced (truncated) box falls through to #### and then the last number
    assert extract_final_answer("\\boxed{12 \n#### 7") == "7"
    assert extract_final_answer("so 1,234.") == "1,234"
    assert extract_final_answer("so 3/4.") == "3/4"
    assert extract_final_answer("nothing", allow_last_number=False) is None
    assert extract_final_answer("value 5", allow_last_number=False) is None
    assert verify_math_answer("value 5", "5", allow_last_number=False) is False


def test_parse_number():
    assert parse_number("1,000") == 1000
    assert parse_number("\\frac{3}{4}") == Fraction(3, 4)
    assert parse_number("-(1)/(2)") == Fraction(-1, 2)
    assert parse_number(".5") == Fraction(1, 2)
    assert parse_number("1e-3") == Fraction(1, 1000)
    assert parse_number("abc") is None
    assert parse_number("nan") is None
    assert parse_number("inf") is None


def test_tolerance_is_configurable():
    assert verify_math_answer("\\boxed{3.14}", "3.14159") is False
    assert verify_math_answer("\\boxed{3.14}", "3.14159", rel_tol=1e-3) is True


def test_format_reward():
    assert format_reward("so \\boxed{3}") == 1.0
    assert format_reward("so 3") == 0.0
    assert format_reward("<answer>3</answer>", style="answer_tag") == 1.0
    assert format_reward("<think>hm</think> <answer>3</answer>", style="think_answer") == 1.0
    assert format_reward("<answer>3</answer>", style="think_answer") == 0.0
    with pytest.raises(ValueError, match="style"):
        format_reward("x", style="xml")


def test_math_reward_values():
    assert math_reward("\\boxed{4}", "4") == 1.0
    assert math_reward("\\boxed{5}", "4", correct_reward=1.0, wrong_reward=-1.0) == -1.0  # DAPO
    assert math_reward("\\boxed{4}", "4", format_weight=0.1) == pytest.approx(1.1)
    assert math_reward("it is 4", "4", format_weight=0.1) == pytest.approx(1.0)  # right but unformatted


def test_bad_inputs():
    with pytest.raises(ValueError, match="text"):
        extract_final_answer(None)
    with pytest.raises(ValueError, match="gold"):
        verify_math_answer("\\boxed{1}", float("nan"))
    with pytest.raises(ValueError, match="gold"):
        verify_math_answer("\\boxed{1}", True)
