"""The TUI following a real server of a model that sees (a tiny Gemma 3, tests/helpers/vision_models.py): while a
request with an image runs, its row is marked [1 image] and, chosen, its blocks that hold the image's tokens are
drawn as ▣, exactly those its block table holds at the span the server reports."""

from __future__ import annotations

import asyncio

from localserve.tui.app import MonitorApp
from localserve.tui.block_map import IMAGE_COLOUR, IMAGE_GLYPH, BlockMap
from localserve.tui.client import monitor_url
from localserve.tui.slots import SlotsTable

from tests.helpers.browser import slowed
from tests.helpers.pictures import picture
from tests.helpers.server import make_llm, openai_client, running_server
from tests.helpers.tui_pilot import map_cells, wait_until
from tests.helpers.vision_models import data_url, png_file, write_tiny_gemma3_vision

MM_TOKENS = 4
ATTEMPTS = 3  # a random model may end its reply before the screen is held: then another request


def ask_with_image(port: int) -> None:
    url = data_url(png_file(picture(40, 30, seed=1)))
    with openai_client(port) as client:
        client.chat.completions.create(model="default", max_tokens=12, temperature=0, messages=[
            {"role": "user", "content": [{"type": "text", "text": "what is in this picture?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}])


def test_the_tui_marks_a_live_requests_image_blocks(tmp_path):
    folder = write_tiny_gemma3_vision(tmp_path / "gemma3", seed=3, mm_tokens_per_image=MM_TOKENS)
    llm = slowed(make_llm(folder, num_kv_blocks=64), 0.1)

    async def main(port: int) -> None:
        app = MonitorApp(monitor_url(f"127.0.0.1:{port}", interval_s=0.05))
        async with app.run_test(size=(160, 48)) as pilot:
            await wait_until(pilot, lambda: app.snapshot is not None, "a snapshot from the server")
            for _ in range(ATTEMPTS):
                asking = asyncio.ensure_future(asyncio.to_thread(ask_with_image, port))
                await wait_until(pilot, lambda: any(request.image_spans for request in app.snapshot.requests),
                                 "a request with an image", timeout_s=30)
                app.action_toggle_pause()  # at once: the screen holds the snapshot just checked
                (request,) = app.snapshot.requests
                table = app.query_one(SlotsTable)
                table.focus()
                await pilot.press("enter")
                await pilot.pause()
                held = request.block_tables != ()
                if held:
                    ((offset, length),) = request.image_spans
                    assert length == MM_TOKENS and table.rows[0][1].endswith("[1 image]"), table.rows[0]
                    size = app.hello.block_size
                    (blocks,) = request.block_tables
                    expected = {blocks[index] for index in range(offset // size, (offset + length - 1) // size + 1)}
                    cells = map_cells(app.query_one(BlockMap))
                    drawn = {block for block, (glyph, colour) in enumerate(cells)
                             if (glyph, colour) == (IMAGE_GLYPH, IMAGE_COLOUR)}
                    assert drawn == expected == request.image_block_ids(size)
                app.action_toggle_pause()
                await asking
                if held:
                    return
            raise AssertionError(f"no request held its blocks on a held screen in {ATTEMPTS} requests")

    with running_server(llm, model_alias="default") as server:
        asyncio.run(asyncio.wait_for(main(server.port), 120))
