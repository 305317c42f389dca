"""engine/image_prompt.py on its own, with a stand-in encoder: the i-th marker becomes image i's text, another
number of markers is an ImageCountError saying both counts; each image's span is the first run of its ids after
the previous image's (generated prompts: the runs placed are the runs found; a run that is not there is named);
`find_run` against a plain scan; `pixel_hash` by content, not by file or mode alone."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from localserve.models.vision.adapter import PreparedImage
from PIL import Image

from localserve.engine.image_hash import pixel_hash
from localserve.engine.image_prompt import ImageCountError, ImagePrompt, SpanNotFoundError, find_run

MARKER = "<img>"
IMAGE_ID = 9


@dataclass
class StandIn:
    marker: str = MARKER
    hidden_size: int = 2

    def prepare(self, picture):  # not used: the tests make PreparedImages themselves
        raise NotImplementedError

    def encode(self, prepared):
        return prepared.inputs


def prompt(*span_lengths: int) -> ImagePrompt:
    prepared = tuple(PreparedImage(text=f"[{'i' * length}]", span_ids=(IMAGE_ID,) * length, inputs=length)
                     for length in span_lengths)
    return ImagePrompt(StandIn(), tuple(bytes([index + 1]) for index in range(len(span_lengths))), prepared)


def naive_find(ids: list[int], run: list[int], start: int) -> int | None:
    return next((i for i in range(start, len(ids) - len(run) + 1) if ids[i:i + len(run)] == run), None)


@given(pieces=st.lists(st.text(st.sampled_from("ab <>\n")), min_size=1, max_size=6))
def test_each_marker_becomes_its_images_text(pieces):
    lengths = [index + 1 for index in range(len(pieces) - 1)]
    expanded = prompt(*lengths).expand(MARKER.join(pieces))
    assert expanded == pieces[0] + "".join(f"[{'i' * length}]" + piece for length, piece in zip(lengths, pieces[1:]))


@pytest.mark.parametrize("markers, images", [(0, 1), (2, 1), (1, 0), (3, 2)])
def test_another_number_of_markers_is_refused_with_both_counts(markers, images):
    with pytest.raises(ImageCountError) as caught:
        prompt(*[1] * images).expand("x" + MARKER * markers + "y")
    assert (caught.value.found, caught.value.expected) == (markers, images)
    assert f"placed {markers} image marker" in str(caught.value)


def test_no_images_and_no_markers_leave_the_text():
    assert prompt().expand("plain text") == "plain text"


@st.composite
def prompts_with_runs(draw):
    """Ids (0-8: text) with image runs placed between them, each followed by an end token."""
    lengths = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    ids, offsets = [], []
    for length in lengths:
        ids += draw(st.lists(st.integers(0, 8), max_size=5))
        offsets.append(len(ids))
        ids += [IMAGE_ID] * length
        ids += [0]  # an image's end token
    return ids + draw(st.lists(st.integers(0, 8), max_size=3)), lengths, offsets


@given(case=prompts_with_runs())
def test_the_spans_found_are_the_runs_placed(case):
    ids, lengths, offsets = case
    multimodal = prompt(*lengths).multimodal(ids)
    assert [(span.offset, span.length) for span in multimodal.spans] == list(zip(offsets, lengths))
    assert [span.content_hash for span in multimodal.spans] == [bytes([i + 1]) for i in range(len(lengths))]
    assert [multimodal.span_embeddings(index) for index in range(len(lengths))] == lengths


def test_a_span_that_is_not_there_is_named():
    with pytest.raises(SpanNotFoundError, match="image 1: its 3 tokens are not in the tokenized prompt after "
                                                "token 3") as caught:
        prompt(2, 3).multimodal([1, IMAGE_ID, IMAGE_ID, 0, IMAGE_ID, IMAGE_ID, 0])
    assert caught.value.index == 1


@given(ids=st.lists(st.integers(0, 2), max_size=12), run=st.lists(st.integers(0, 2), max_size=3),
       start=st.integers(0, 12))
def test_find_run_is_a_plain_scan(ids, run, start):
    assert find_run(ids, run, start) == (naive_find(ids, run, start) if run else None)


def test_pixel_hash_is_of_the_content():
    red = Image.new("RGB", (3, 2), (200, 0, 0))
    assert pixel_hash(red) == pixel_hash(red.convert("P", palette=Image.Palette.ADAPTIVE)) == pixel_hash(
        red.convert("RGBA").convert("RGB"))
    assert pixel_hash(red) != pixel_hash(Image.new("RGB", (2, 3), (200, 0, 0)))
    seen = red.convert("RGBA")
    faint = seen.copy()
    faint.putalpha(100)
    assert pixel_hash(seen) != pixel_hash(faint)
