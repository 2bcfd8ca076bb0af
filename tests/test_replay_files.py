"""Every field of the shipped recordings changed to a wrong type or an out-of-range value (issue 41, item 3): the
reader refuses the file with one sentence that names the field, or the Replay page draws every step (or round) of
it without an exception. Nothing past the reader's check may fail."""

import copy
import json
import math
import re

import pytest
from apptest import APP
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from streamlit.testing.v1 import AppTest

from model.errors import InputError
from model.recording.replay import DECODE, SHIPPED, read_recording, recording_kind, shipped_recording
from model.texts import LANGUAGES

HUGE = "HUGE-NUMBER"  # written into the JSON as a 5,000-digit number, which json.dumps itself refuses to write
ODD = [None, True, False, 0, -1, -3, 1, 2, 2**31, 2**53, 2**64, 10**400, 0.5, 1.5, -0.5, 1e300, -1e300, math.nan,
       math.inf, -math.inf, "", "x", "<b>x</b>", "zz", "00", "\ud800", "\x00", [], [0], [None], ["x"], [-1], {},
       {"id": 1}, HUGE]


def paths(value, at=()):
    """Every path into a recording: keys of objects and indexes of lists, the root's own path left out."""
    if at:
        yield at
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from paths(inner, at + (key,))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield from paths(inner, at + (index,))


def near(value) -> list:
    """Values of the field's own type just out of its usual range."""
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1, -value, value * 10**6]
    if isinstance(value, float):
        return [value + 1, -value, value * 1e6, 1 - value]
    if isinstance(value, str):
        return ["", value * 2, value[::-1]]
    if isinstance(value, list):
        return [[], value * 2, value[::-1], value[:1]]
    return [{}]


def encode(run: dict) -> bytes:
    return json.dumps(run).replace(json.dumps(HUGE), "1" + "0" * 5000).encode()


@st.composite
def mutated(draw, name: str) -> tuple[str, bytes]:
    """(what was changed, the file) for one change of one shipped recording."""
    run = shipped_recording(name)
    every = list(paths(run))
    at = draw(st.sampled_from(every))
    *parents, last = at
    holder = run
    for key in parents:
        holder = holder[key]
    old = holder[last]
    how = draw(st.sampled_from(["replace", "delete", "append"]))
    if how == "delete":
        del holder[last]
    else:
        values = ODD + near(old) + [copy.deepcopy(draw(st.sampled_from(every)))]
        value = draw(st.one_of(st.sampled_from(values), st.integers(), st.floats(), st.text(max_size=4)))
        if how == "append" and isinstance(old, list):
            old.append(value)
        else:
            holder[last] = value
    return f"{how} {'.'.join(map(str, at))}", encode(run)


class Page:
    """One AppTest of the Replay page, opened once: each recording is put in its session as an uploaded file."""

    at = None

    @classmethod
    def draws_every_step(cls, run: dict) -> None:
        if cls.at is None:
            cls.at = AppTest.from_file(APP, default_timeout=60)
            cls.at.session_state["lang"] = "vi"
            cls.at.session_state["device"] = "cpu"
            cls.at.run()
            cls.at.switch_page("app_pages/replay.py")
            cls.at.session_state["replay_source"] = "upload"
        at = cls.at
        at.session_state["replay_uploaded"] = run
        at.session_state["replay_uploaded_name"] = "run.json"
        at.session_state["replay_step"] = 0
        at.run()
        entries = run["steps"] if recording_kind(run) == DECODE else run["rounds"]
        for index in range(len(entries)):
            assert not at.exception, (index, at.exception)
            assert at.session_state["replay_step"] == index
            if index < len(entries) - 1:
                at.button(key="replay_next").click().run()


def refused_in_one_sentence(refused: InputError) -> None:
    assert refused.code.startswith("recording_"), refused.code
    for lang in LANGUAGES:
        sentence = refused.message(lang)
        assert not re.search(r"\{[a-z_]*\}", sentence) and sentence.count(". ") <= 1, sentence
        assert len(sentence) < 400, sentence
        if "field" in refused.details:
            assert refused.details["field"] in sentence


@pytest.mark.parametrize("name", SHIPPED)
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_a_changed_field_is_refused_in_one_sentence_or_the_page_draws_every_step(name, data):
    _change, file = data.draw(mutated(name), label="change")
    try:
        run = read_recording(file)
    except InputError as refused:
        refused_in_one_sentence(refused)
        return
    Page.draws_every_step(run)

