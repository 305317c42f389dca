"""The page against the default model (SmolLM2-135M-Instruct) under `localserve serve`'s defaults for it
(greedy): asked from the page, it names Paris, streamed into the page with no console error."""

from __future__ import annotations

import pytest

from localserve.loading.sampling_defaults import sampling_defaults
from tests.helpers.server import make_llm, running_server
from tests.helpers.webui_page import last_reply, open_page, send, wait_reply_done


@pytest.mark.slow
def test_the_default_model_names_paris_in_the_page(page, smollm2_path):
    llm = make_llm(smollm2_path, num_kv_blocks=512, max_model_len=2048)
    defaults = sampling_defaults(smollm2_path, is_default_model=True)
    assert defaults.temperature == 0  # greedy: the same answer every run
    with running_server(llm, sampling_defaults=defaults) as server:
        open_page(page, server.port)
        send(page, "What is the capital of France?")
        wait_reply_done(page)
        answer = last_reply(page).locator(".content").inner_text()
    assert "Paris" in answer, answer
    assert page.log.console_errors == []
