"""The image encoder's time in the step's time budget (engine/encode_budget.py) through the engine, with a tiny
random Gemma 3 (its images encoded by our GemmaVision): beside a decoding stream, a prompt whose new image's
encode does not fit the step stops before the image, the image goes in a later step with room, and every
request's greedy tokens and log-probabilities are transformers'. The step's cost and the encoder's are fixed
laws here (tests/helpers/step_costs.py), so the schedule does not depend on the machine."""

from __future__ import annotations

import pytest

from tests.helpers.gemma_image_engine import (
    ImagePrompt,
    assert_matches,
    load_gemma3_image_models,
    make_engine,
    params,
    reference,
)
from tests.helpers.step_costs import FixedEncoderCost, FrozenTimeBudget, LinearStepCost

MM = 16  # soft tokens an image
FIXED, PER_ROW, PER_TOKEN = 5e-3, 2e-3, 1e-3
# Beside one decoding stream a step may add 40 prompt tokens; an image's encode counts as 20 of them.
LIMIT = FIXED + PER_ROW + PER_ROW + 40.5 * PER_TOKEN
ENCODE_S_PER_TOKEN = 20 * PER_TOKEN / MM


@pytest.fixture(scope="module")
def gemma3_image(tmp_path_factory):
    """(our text model, our vision encoder, transformers' model), float32."""
    return load_gemma3_image_models(tmp_path_factory.mktemp("gemma3_encode_budget"), MM)


def prompt(*parts) -> ImagePrompt:
    return ImagePrompt.of(list(parts), MM)


TEXT = prompt([30 + i for i in range(25)])  # the decoding stream
ONE = prompt([5, 6, 7, 8, 9], 1, [10, 11, 12])  # 27 tokens, the image's [7, 23): 23 + 20 > 40
TWO = prompt([20, 21], 2, [22, 23, 24], 3, [25, 26])  # two images


def budgeted_engine(model):
    """The engine with a time budget whose step cost and encoder cost are the fixed laws above."""
    engine = make_engine(model, budget=64, max_step_ms=1000)
    scheduler = engine.scheduler
    cost = LinearStepCost(FIXED, PER_ROW, PER_TOKEN)
    scheduler.step_budget = FrozenTimeBudget(cost, LIMIT, min_prefill_tokens=1)
    scheduler.step_cost = cost
    scheduler.filler.images.cost = FixedEncoderCost(ENCODE_S_PER_TOKEN)
    return engine


def test_a_new_image_waits_for_a_step_with_room_and_the_tokens_are_transformers(gemma3_image):
    model, vision, hf_model = gemma3_image
    engine = budgeted_engine(model)
    chunks: list[tuple[str, int, int, float]] = []  # request, start, end, the step's image charge
    mark_computed = engine.scheduler.mark_computed

    def recording(batch):
        charged = batch.images.charged if batch.images is not None else 0.0
        chunks.extend((row.request.request_id, row.chunk.start_pos, row.chunk.start_pos + row.query_len, charged)
                      for row in batch.rows if row.query_len > 1)
        mark_computed(batch)

    engine.scheduler.mark_computed = recording
    text_id = engine.add_request(TEXT.token_ids, params(8))
    engine.step()  # the stream's prompt, alone: no decodes to keep steady
    ids = [engine.add_request(item.token_ids, params(4), multimodal=item.multimodal(vision)) for item in (ONE, TWO)]
    final = engine.run_to_completion()
    assert engine.is_idle_and_clean()
    one = [(start, end, charged) for request_id, start, end, charged in chunks if request_id == ids[0]]
    # The text before the image first (its encode does not fit beside it), then the image and the rest.
    assert [(start, end) for start, end, _ in one] == [(0, 7), (7, 27)]
    assert one[1][2] == pytest.approx(20)
    assert engine.image_embeds.num_encoded == 3
    assert_matches(final[text_id], reference(hf_model, TEXT, 8))
    for request_id, item in zip(ids, (ONE, TWO)):
        assert_matches(final[request_id], reference(hf_model, item, 4))
