"""Images on the web page, in a real Chromium against a real server on the tiny text model: the attach
button is hidden for a model that takes no images and shown for one that does (the /v1/models list the
page reads, rewritten by the test, says which; the picker switches); a PNG picked, dropped or pasted is shown
as a removable thumbnail, checked against the server's default bounds (type, bytes, pixels, images and bytes a
request: at each bound and one past) and read as a picture by the browser, with a clear message; sent as an
OpenAI `image_url` data-URL part (the request body Chromium sends holds the same bytes), kept in the
conversation across a reload (without its pixels when the browser's storage is full), kept by an edit; the
server's 400 (this model takes no images) is shown in the conversation. The block view: fed monitor frames
with a request's `image_spans`, the page draws the selected request's blocks that hold image tokens in their
own colour, with a legend entry, a mark in the slots table and the hover line."""

from __future__ import annotations

import base64
import json
import random

import pytest
from localserve.tui.block_map import COLOURS, IMAGE_COLOUR, SELECTED_COLOUR
from localserve.tui.feed import BlockState
from PIL import Image
from playwright.sync_api import Error as PlaywrightError

from localserve.server.request.images import MEDIA_TYPES, ImageBounds
from tests.helpers.monitor_frames import hello_frame, request_entry, snapshot_frame
from tests.helpers.pictures import picture
from tests.helpers.server import make_llm, running_server
from tests.helpers.vision_models import data_url, png_file
from tests.helpers.webui_page import DROP_OR_PASTE, READ_CELLS, open_page, send, set_settings, wait_reply_done

MIB = 2 ** 20


def png_bytes(width: int = 24, height: int = 16, seed: int = 0) -> bytes:
    return png_file(picture(width, height, seed))


@pytest.fixture(scope="module")
def server(tiny_chat_model_dir):
    with running_server(make_llm(tiny_chat_model_dir, max_model_len=512), monitor_interval_s=0.1) as background:
        yield background


def seeing(page, takes_images=True) -> None:
    """Make the page read every model of /v1/models as taking images (or not)."""
    def answer(route):
        try:
            listing = route.fetch().json()
        except PlaywrightError:  # the page closed meanwhile (a reply's last read of the list, at the test's end)
            return
        for model in listing["data"]:
            model["takes_images"] = takes_images(model["id"]) if callable(takes_images) else takes_images
        route.fulfill(json=listing)
    page.route("**/v1/models", answer)


def attach(page, name: str, data: bytes, mime: str = "image/png") -> None:
    page.set_input_files("#attach-input", files=[{"name": name, "mimeType": mime, "buffer": data}])


def thumbnails(page, where: str = "#attachments img") -> list[bytes]:
    """The pictures shown at `where`, decoded from their data URLs."""
    urls = page.eval_on_selector_all(where, "images => images.map((image) => image.src)")
    assert all(url.startswith("data:image/png;base64,") for url in urls), urls
    return [base64.b64decode(url.split(",", 1)[1]) for url in urls]


def test_a_text_model_has_no_attach_button_and_a_text_message_is_as_before(page, server):
    open_page(page, server.port)
    assert page.is_hidden("#attach")
    assert page.evaluate("fetch('/v1/models').then((r) => r.json())")["data"][0]["takes_images"] is False
    set_settings(page, {"max_tokens": "2"})
    send(page, "hello")
    wait_reply_done(page)
    node = page.locator(".message.user")
    assert node.locator(".images").count() == 0
    assert node.evaluate("(node) => [...node.childNodes].map((child) => child.className)") == ["role", "text", "meta"]
    assert page.log.console_errors == []


def test_an_attached_image_is_shown_sent_as_an_image_url_part_and_the_servers_400_shown(page, server):
    seeing(page)
    open_page(page, server.port)
    assert page.is_visible("#attach")
    first, second = png_bytes(seed=0), png_bytes(32, 20, seed=1)
    attach(page, "first.png", first)
    attach(page, "second.png", second)
    page.wait_for_function("() => document.querySelectorAll('#attachments img').length === 2")
    assert thumbnails(page) == [first, second]
    page.click("#attachments .attachment:first-child .remove")  # removable before sending
    page.wait_for_function("() => document.querySelectorAll('#attachments img').length === 1")
    assert thumbnails(page) == [second]
    bodies = []
    page.on("request", lambda request: bodies.append(request.post_data_json)
            if request.url.endswith("/v1/chat/completions") else None)
    send(page, "what is in this picture")
    page.wait_for_selector(".message.assistant .error")
    (body,) = bodies
    assert body["messages"][-1] == {"role": "user", "content": [
        {"type": "text", "text": "what is in this picture"},
        {"type": "image_url", "image_url": {"url": data_url(second)}}]}
    error = page.inner_text(".message.assistant .error")
    assert "does not take images" in error and "messages[0].content[1]" in error, error
    assert thumbnails(page, ".message.user .images img") == [second]  # in the conversation
    assert page.locator("#attachments img").count() == 0  # the composer is cleared
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert thumbnails(page, ".message.user .images img") == [second]  # kept across a reload
    assert page.inner_text(".message.user .text") == "what is in this picture"
    page.click(".message.user .edit")  # an edited message keeps its images
    page.fill(".message.user textarea.edit", "and now?")
    page.click(".message.user .resend")
    page.wait_for_selector(".message.assistant .error")
    assert bodies[-1]["messages"][-1]["content"] == [{"type": "text", "text": "and now?"}, body["messages"][-1][
        "content"][1]]
    assert thumbnails(page, ".message.user .images img") == [second]
    errors = [text for text in page.log.console_errors if "400" not in text]  # the refused requests' own lines
    assert errors == []


@pytest.mark.parametrize("kind", ["drop", "paste"])
def test_an_image_dropped_or_pasted_on_the_message_box_is_attached(page, server, kind):
    seeing(page)
    open_page(page, server.port)
    data = png_bytes(seed=2)
    assert page.evaluate(DROP_OR_PASTE, [kind, list(data), "shot.png"]) is True  # taken, not typed in
    page.wait_for_function("() => document.querySelectorAll('#attachments img').length === 1")
    assert thumbnails(page) == [data] and page.input_value("#prompt") == ""
    if kind == "paste":  # pasted text is left to the browser
        assert page.evaluate("""() => {
          const transfer = new DataTransfer();
          transfer.setData('text/plain', 'some text');
          const event = new ClipboardEvent('paste', { bubbles: true, cancelable: true, clipboardData: transfer });
          document.querySelector('#prompt').dispatchEvent(event);
          return event.defaultPrevented;
        }""") is False
    bodies = []
    page.on("request", lambda request: bodies.append(request.post_data_json)
            if request.url.endswith("/v1/chat/completions") else None)
    page.press("#prompt", "Enter")  # an image alone is a message
    page.wait_for_selector(".message.assistant .error")
    url = data_url(data)
    assert bodies[0]["messages"] == [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    assert page.locator("#conversation-list .title").all_inner_texts() == ["image"]


def test_a_model_that_takes_no_images_refuses_a_drop_and_the_picker_switches_the_button(page, server, tmp_path):
    seeing(page, takes_images=False)
    open_page(page, server.port)
    page.evaluate(DROP_OR_PASTE, ["drop", list(png_bytes()), "shot.png"])
    page.wait_for_selector("#attach-error:not([hidden])")
    assert "does not take images" in page.inner_text("#attach-error")
    assert page.locator("#attachments img").count() == 0
    page.unroute("**/v1/models")
    seeing(page, takes_images=True)
    page.click("#settings summary")
    page.focus("#settings-fields [name=model]")  # opening the picker reads the list again: now it sees
    page.wait_for_selector("#attach:not([hidden])")


def test_files_the_server_would_refuse_are_refused_with_a_clear_message(page, server):
    seeing(page)
    open_page(page, server.port)
    attach(page, "notes.bmp", b"BM" + b"\0" * 60, "image/bmp")
    page.wait_for_selector("#attach-error:not([hidden])")
    assert page.inner_text("#attach-error") == '"notes.bmp" is image/bmp: the server takes PNG, JPEG, WebP, GIF images'
    attach(page, "big.png", b"\x89PNG" + b"\0" * (10 * MIB - 3))
    page.wait_for_function("() => document.querySelector('#attach-error').textContent.includes('big.png')")
    assert page.inner_text("#attach-error") == '"big.png" is 10.0 MiB: an image may be 10.0 MiB at most'
    attach(page, "broken.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    page.wait_for_function("() => document.querySelector('#attach-error').textContent.includes('broken.png')")
    assert page.inner_text("#attach-error") == \
        '"broken.png" could not be read: it is not a picture the browser can read'
    for width, height in ((8192, 4096), (8193, 4096)):  # 2 ** 25 pixels, and one column more
        attach(page, f"{width}.png", png_file(Image.new("L", (width, height))))
        if width == 8192:
            page.wait_for_selector("#attachments img")
            page.click("#attachments .remove")
    page.wait_for_function("() => document.querySelector('#attach-error').textContent.includes('8193.png')")
    assert page.inner_text("#attach-error") == \
        '"8193.png" is 8193×4096 pixels: an image may have 33,554,432 pixels at most'
    assert page.locator("#attachments img").count() == 0


BOUNDS = """async (cases) => {
  const module = await import('/webui/js/attachments.js');
  return { bounds: [module.MAX_IMAGE_BYTES, module.MAX_REQUEST_IMAGE_BYTES, module.MAX_IMAGES, module.MAX_IMAGE_PIXELS],
    types: Object.keys(module.IMAGE_TYPES).sort(),
    results: cases.map(([type, size, count, bytes]) => module.refusal({ name: 'x.png', type, size }, count, bytes)) };
}"""


def test_the_pages_bounds_are_the_servers_and_hold_at_the_limit_and_one_past(page, server):
    open_page(page, server.port)
    cases = [("image/png", 10 * MIB, 0, 0), ("image/png", 10 * MIB + 1, 0, 0),
             ("image/webp", 1, 15, 0), ("image/gif", 1, 16, 0),
             ("image/jpeg", 10 * MIB, 1, 10 * MIB), ("image/jpeg", 10 * MIB, 1, 10 * MIB + 1),
             ("image/svg+xml", 1, 0, 0), ("", 1, 0, 0)]
    checked = page.evaluate(BOUNDS, [list(case) for case in cases])
    bounds = ImageBounds()  # the server's defaults
    assert checked["bounds"] == [bounds.max_bytes, bounds.max_total_bytes, bounds.max_images, bounds.max_pixels]
    assert checked["bounds"] == [10 * MIB, 20 * MIB, 16, 2 ** 25]
    assert checked["types"] == sorted(MEDIA_TYPES)
    results = checked["results"]
    assert results[0] is None and results[2] is None and results[4] is None
    assert results[1] == '"x.png" is 10.0 MiB: an image may be 10.0 MiB at most'
    assert results[3] == '"x.png" would be image 17: a request may carry 16 images at most'
    assert results[5] == '"x.png" would make the request\'s images 20.0 MiB: 20.0 MiB at most together'
    assert results[6].startswith('"x.png" is image/svg+xml: the server takes PNG, JPEG, WebP, GIF')
    assert results[7].startswith('"x.png" is not an image')


# 32 blocks of 16 tokens. r1: 40 text tokens, a 64-token image (40..103), 10 more: its table's indices 2-6 hold
# image tokens; r2 has none.
STATES = "u" * 9 + "." * 23
R1 = request_entry("r1", "decode", [[8, 7, 6, 5, 4, 3, 2]], num_prompt_tokens=110, num_computed_prompt_tokens=110,
                   image_spans=[[40, 64]])
R2 = request_entry("r2", "decode", [[0, 1]])


def test_the_block_view_marks_the_blocks_that_hold_image_tokens(page, server):
    sockets = []
    page.route_web_socket("**/v1/monitor**", lambda socket: sockets.append(socket))
    open_page(page, server.port)
    for _ in range(200):  # the page takes a ticket, then opens the socket
        if sockets:
            break
        page.wait_for_timeout(50)
    assert len(sockets) == 1
    sockets[0].send(json.dumps(hello_frame(32)))
    sockets[0].send(json.dumps(snapshot_frame(STATES, requests=[R1, R2])))
    page.wait_for_selector("#slots tbody tr[data-label=r1]")
    state = page.locator("#slots tbody tr[data-label=r1] td").nth(1)
    assert state.inner_text() == "decode ▣1" and state.get_attribute("title") == "1 image"
    assert page.locator("#slots tbody tr[data-label=r2] td").nth(1).inner_text() == "decode"
    page.click("#slots tbody tr[data-label=r1]")
    drawn = page.evaluate(READ_CELLS)
    image_blocks = {6, 5, 4, 3, 2}
    for block, colour in enumerate(drawn["colours"]):
        expected = IMAGE_COLOUR if block in image_blocks else SELECTED_COLOUR if block in (7, 8) else COLOURS[
            BlockState.USED if block < 9 else BlockState.EMPTY]
        assert colour == expected, block
    assert drawn["legend"]["image"] == 5
    box = page.locator("#block-map").bounding_box()
    pitch = float(page.get_attribute("#block-map", "data-pitch")) / page.evaluate("devicePixelRatio")
    columns = int(page.get_attribute("#block-map", "data-columns"))
    page.mouse.move(box["x"] + (4 % columns + 0.3) * pitch, box["y"] + (4 // columns + 0.3) * pitch)  # block 4
    assert page.inner_text("#map-hover") == "block 4: used · r1 (image tokens)"
    page.click("#slots tbody tr[data-label=r2]")
    drawn = page.evaluate(READ_CELLS)
    assert IMAGE_COLOUR not in drawn["colours"] and "image" not in drawn["legend"]
    assert page.log.console_errors == []


def test_images_over_the_browsers_storage_are_not_kept_but_the_conversation_is(page, server):
    seeing(page)
    open_page(page, server.port)
    noise = []
    for seed in range(3):  # noise does not compress: 3 MiB files
        noise.append(png_file(Image.frombytes("RGB", (1024, 1024), random.Random(seed).randbytes(3 * MIB))))
    for index, data in enumerate(noise):
        attach(page, f"big{index}.png", data)
    page.wait_for_function("() => document.querySelectorAll('#attachments img').length === 3")
    send(page, "three big pictures")  # 12 MiB of data URLs: more than a browser keeps for a page
    page.wait_for_selector(".message.assistant .error")  # the text model takes no images: a 400
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.inner_text(".message.user .text") == "three big pictures"
    notes = page.locator(".message.user .images .dropped").all_inner_texts()
    assert notes == [f"big{index}.png (not kept: browser storage full)" for index in range(3)]
    assert page.locator(".message.assistant .error").count() == 1
