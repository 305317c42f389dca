"""The path of one Ollama `/api/chat` request with tools, socket to engine and back: the server modules whose
code runs for it (recorded with a profile hook on every thread while the request is in flight), and the model
looked up once. A scripted thinking model (tests/helpers/tool_models.py) calls a tool."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import ollama

from localserve.server.registry.registry import ModelRegistry
from tests.helpers.server import make_llm, running_server
from tests.helpers.tool_models import THINKING_TEMPLATE, hermes_call, write_tool_model

SERVER = Path(__file__).resolve().parents[2] / "localserve" / "server"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "what is the weather in paris"}]
# Socket to engine and back (before the server was grouped by purpose: 24, the model looked up twice): the
# transport, connection phases, the exchange and access; the HTTP app; Ollama's routes, field map and view; the
# request model, its field kinds, messages, sampling rules and checks; the registry, the served model and the
# engine access; the service, the turn's plan, the stream and its samples; the HTTP runner. Since images came:
# the server's config (the body's bound, with room for images) and the request's images (the messages' sink).
MAX_MODULES = 24


class ModulesSeen:
    """The server modules whose functions run on any thread while `recording`."""

    def __init__(self) -> None:
        self.recording = False
        self.modules: set[str] = set()

    def __call__(self, frame, event, arg):
        if self.recording and event == "call":
            path = frame.f_code.co_filename
            if path.startswith(str(SERVER)):
                self.modules.add(str(Path(path).relative_to(SERVER)))
        return None


def test_an_ollama_chat_with_tools_passes_few_modules_and_looks_its_model_up_once(tmp_path, monkeypatch):
    seen = ModulesSeen()
    finds = []
    find = ModelRegistry.find
    monkeypatch.setattr(ModelRegistry, "find", lambda self, name: finds.append(name) or find(self, name))
    write_tool_model(tmp_path, ["<think>\nlook\n</think>\n\n", hermes_call("get_weather", {"city": "Paris"})],
                     ["sunny"], THINKING_TEMPLATE)
    threading.setprofile(seen)
    sys.setprofile(seen)
    try:
        with running_server(make_llm(tmp_path, max_model_len=1024), model_alias="tools") as server:
            client = ollama.Client(host=f"http://127.0.0.1:{server.port}", timeout=60)
            client.chat(model="tools", messages=ASK, tools=TOOLS, options={"temperature": 0})  # warm
            finds.clear()
            seen.recording = True
            called = client.chat(model="tools", messages=ASK, tools=TOOLS, options={"temperature": 0})
            seen.recording = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert [call.function.name for call in called.message.tool_calls] == ["get_weather"]
    print(f"{len(seen.modules)} server modules:", *sorted(seen.modules), sep="\n  ")
    assert len(finds) == 1, finds
    assert len(seen.modules) <= MAX_MODULES, sorted(seen.modules)
