"""The built-in rewards: exact match after each extractor, numeric equality within a tolerance,
the format regex, DAPO's soft length punishment; bad settings are refused."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.components.base import default_config
from kiln.components.rewards.builtin import Completion


def _reward(name, **values):
    return default_config("reward", name, **values).build()


def _c(text, tokens=5, **fields):
    return Completion(text, tokens, False, fields)


def test_exact_match_with_a_regex_the_last_number_or_the_whole_text():
    texts = [_c("47 * 22 = 1034.", answer="1034"), _c("47 * 22 = 1035.", answer="1034"),
             _c("no idea", answer="1034")]
    assert _reward("exact_match", regex=r"= (-?\d+)")(texts) == [1.0, 0.0, 0.0]
    assert _reward("exact_match", extract="last_number")(texts) == [1.0, 0.0, 0.0]
    # the number read drops its thousands commas, and so does the gold it is compared with
    assert _reward("exact_match", extract="last_number")(
        [_c("so 1,034.", answer="1,034"), _c("so 1034", answer="1,034")]) == [1.0, 1.0]
    assert _reward("exact_match", extract="all", field="x", ignore_case=True)(
        [_c(" Yes ", x="yes"), _c("yes.", x="yes")]) == [1.0, 0.0]
    last = _reward("exact_match", regex=r"(\d+)", occurrence="last", field="v")
    assert last([_c("1 then 2", v="2")]) == [1.0]


def test_exact_match_compares_a_number_field_as_a_number_and_a_text_field_as_text():
    """A gold stored as a number (a float column holds 58 as 58.0) equals the number read;
    stored as text it is matched as text; an answer that is no number never equals one."""
    r = _reward("exact_match", extract="last_number", field="sol")
    assert r([_c("so 58", sol=58.0), _c("so 58.0", sol=58), _c("1,034", sol=1034),
              _c("so 58", sol=58.5), _c("so 58", sol="58.0"), _c("so 58.0", sol="58.0")]) == [
        1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    words = _reward("exact_match", extract="all", field="v")
    assert words([_c("fifty", v=50), _c("True", v=True), _c("50", v=50)]) == [0.0, 1.0, 1.0]


def test_numeric_within_a_tolerance_and_commas():
    r = _reward("numeric", tolerance=0.01)
    assert r([_c("about 3.141", answer="3.14"), _c("1,034", answer="1034"),
              _c("3.2", answer="3.14"), _c("none", answer="1")]) == [1.0, 1.0, 0.0, 0.0]
    # a bare fraction is the number it reads as, and only thousands groups join across commas
    r = _reward("numeric")
    assert r([_c("so x = .5", answer="0.5"), _c("it is -.25", answer="-0.25"),
              _c("the list 1,2,3", answer="3"), _c("1,034.5 m", answer="1034.5"),
              _c("12,34", answer="34")]) == [1.0] * 5
    with pytest.raises(ValueError, match="'answer' is not a number"):
        r([_c("1", answer="many")])


def test_format_and_length():
    fmt = _reward("format", regex=r"^\d+ [-+*] \d+ = -?\d+\.$", full=True)
    assert fmt([_c("2 + 3 = 5."), _c("2 + 3 = 5. And more")]) == [1.0, 0.0]
    length = _reward("length", max_tokens=10, buffer=4)
    assert length([_c("", tokens=n) for n in (6, 8, 10, 12)]) == [0.0, -0.5, -1.0, -1.0]


@pytest.mark.parametrize("max_tokens, buffer", [(10, 4), (16, 16), (7, 1)])
def test_the_length_reward_equals_trls_soft_overlong_punishment(max_tokens, buffer):
    rewards = pytest.importorskip("trl.rewards")
    lengths = list(range(1, 2 * max_tokens))
    theirs = rewards.get_soft_overlong_punishment(max_tokens, buffer)(
        completion_ids=[[0] * n for n in lengths])
    ours = _reward("length", max_tokens=max_tokens, buffer=buffer)(
        [_c("", tokens=n) for n in lengths])
    assert ours == pytest.approx(theirs)


def test_bad_settings_are_refused():
    with pytest.raises(ValidationError, match="is not a regular expression"):
        default_config("reward", "format", regex="(")
    with pytest.raises(ValueError, match="needs a regex"):
        _reward("exact_match")
    with pytest.raises(ValueError, match="buffer must be at most"):
        _reward("length", max_tokens=2, buffer=4)
