"""Driving the web page in the browser tests: its API fetched from Python, a message sent, a reply awaited, the
block map's cells read back, an image dropped or pasted."""

from __future__ import annotations

import json
import urllib.request


def get_json(port: int, path: str, body: dict | None = None) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode() if body else None,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def open_page(page, port: int):
    page.goto(f"http://127.0.0.1:{port}/")
    page.wait_for_selector("body[data-ready=true]")
    return page


def set_settings(page, values: dict[str, str]) -> None:
    if page.get_attribute("#settings", "open") is None:
        page.click("#settings summary")
    for name, value in values.items():
        page.fill(f"#settings-fields [name={name}]", value)


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_reply(page):
    return page.locator(".message.assistant").last


def wait_reply_done(page) -> None:
    page.wait_for_selector(".message.assistant:last-child .meta .regenerate")


# page.evaluate(READ_CELLS): the block map as drawn, each cell's colour read back from its canvas pixels, with
# the legend's counts and the snapshot time and scale it drew
READ_CELLS = """() => {
  const canvas = document.querySelector('#block-map');
  const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
  const {columns, pitch, numCells, time} = canvas.dataset;
  const colours = [];
  for (let cell = 0; cell < Number(numCells); cell += 1) {
    const x = (cell % columns) * pitch, y = Math.floor(cell / columns) * pitch;
    const offset = (y * canvas.width + x) * 4;
    colours.push('#' + [0, 1, 2].map((i) => data[offset + i].toString(16).padStart(2, '0')).join(''));
  }
  const legend = Object.fromEntries([...document.querySelectorAll('#map-legend [data-state]')]
    .map((item) => [item.dataset.state, Number(item.textContent.replace(/[^0-9]/g, ''))]));
  return {time: Number(time), blocksPerCell: Number(canvas.dataset.blocksPerCell), colours, legend};
}"""

# page.evaluate(DROP_OR_PASTE, ["drop" or "paste", the file's bytes, its name]): a PNG file dropped or pasted
# on the message box; returns whether the page took the event
DROP_OR_PASTE = """async ([kind, bytes, name]) => {
  const transfer = new DataTransfer();
  transfer.items.add(new File([new Uint8Array(bytes)], name, { type: 'image/png' }));
  const init = { bubbles: true, cancelable: true };
  const event = kind === 'drop' ? new DragEvent('drop', { ...init, dataTransfer: transfer })
    : new ClipboardEvent('paste', { ...init, clipboardData: transfer });
  document.querySelector('#prompt').dispatchEvent(event);
  return event.defaultPrevented;
}"""
