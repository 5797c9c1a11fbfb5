"""The drawn clips and the scorer: every prompt reads back, and on clips whose truth is known the
scorer sees what was drawn (and notices what was not)."""

from __future__ import annotations

import numpy as np
import pytest

from service.models.demo.clips import (
    BACKGROUNDS,
    COLOURS,
    MOTIONS,
    SHAPES,
    ClipSpec,
    all_specs,
    draw_clip,
    parse_prompt,
)
from service.models.demo.score import prompt_set, score_clip, summarise


def test_every_combination_of_the_words_is_a_prompt_that_reads_back() -> None:
    specs = all_specs()
    assert len(specs) == len(SHAPES) * len(COLOURS) * len(MOTIONS) * len(BACKGROUNDS) == 225
    assert all(parse_prompt(s.prompt) == s for s in specs)
    assert parse_prompt("A white square, standing still, on a white background.") == \
        ClipSpec("square", "white", "still", "white")


@pytest.mark.parametrize("prompt", ["a red circle moving left", "a red moving left on a black background",
                                    "a circle moving left on a black background", "a red circle on a black "
                                    "background"])
def test_a_prompt_missing_a_word_is_refused_naming_the_kind(prompt: str) -> None:
    with pytest.raises(ValueError, match="names no"):
        parse_prompt(prompt)


def test_a_bad_word_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="colour must be one of"):
        ClipSpec("circle", "purple", "left", "black")


def test_the_same_seed_draws_the_same_clip_and_another_seed_another() -> None:
    spec = ClipSpec("triangle", "yellow", "down", "gray")
    a, b, c = draw_clip(spec, 3), draw_clip(spec, 3), draw_clip(spec, 4)
    assert a.shape == (17, 64, 64, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_the_scorer_sees_what_was_drawn() -> None:
    scores = [score_clip(draw_clip(s, i), s) for i, s in enumerate(all_specs()) if s.visible]
    summary = summarise(scores)
    assert summary["clips"] == 210  # 225 less white on white (3 shapes x 5 motions)
    for key in ("colour", "motion", "background", "shape", "all_three"):
        assert summary[key] == 1.0, key
    assert summary["jitter_px"] < 0.5  # drawn motion is uniform


def test_the_scorer_notices_a_wrong_clip() -> None:
    asked = ClipSpec("circle", "red", "left", "black")
    wrong = [ClipSpec("circle", "blue", "left", "black"), ClipSpec("circle", "red", "right", "black"),
             ClipSpec("circle", "red", "left", "gray"), ClipSpec("square", "red", "still", "black")]
    got = [score_clip(draw_clip(w, 1), asked) for w in wrong]
    assert [g.colour_ok for g in got] == [False, True, True, True]
    assert [g.motion_ok for g in got] == [True, False, True, False]
    assert [g.background_ok for g in got] == [True, True, False, True]
    assert not got[3].shape_ok
    empty = np.full((17, 64, 64, 3), BACKGROUNDS["black"], np.uint8)  # nothing drawn at all
    nothing = score_clip(empty, asked)
    assert nothing.colour is None and not nothing.colour_ok and nothing.seen_frames == 0.0
    shaken = draw_clip(asked, 2).copy()
    shaken[::2] = np.roll(shaken[::2], 6, axis=2)  # every other frame jumps 6 px
    assert score_clip(shaken, asked).jitter > 3.0


def test_the_prompt_set_covers_every_colour_and_motion_twice_and_is_all_visible() -> None:
    specs = prompt_set()
    assert len(specs) == 50 and len(set(specs)) == 50 and all(s.visible for s in specs)
    for colour in COLOURS:
        for motion in MOTIONS:
            assert sum(s.colour == colour and s.motion == motion for s in specs) == 2
    assert {s.background for s in specs} == set(BACKGROUNDS) and {s.shape for s in specs} == set(SHAPES)
