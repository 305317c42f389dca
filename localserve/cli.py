"""The `localserve` command: generate, serve, chat, tui, plan.

stdout carries only what the user asked for (generated text); logs and progress go to stderr. torch
is imported only by the subcommands that load a model (`chat` and `tui` are websocket clients, `plan`
reads configs).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from localserve.engine.config import DEFAULT_MAX_NUM_SEQS, SPEC_TOKENS, STATE_CHECKPOINT_TOKENS, EngineConfig
from localserve.engine.sampling_params import SamplingParams
from localserve.kv.memory_plan import parse_size
from localserve.plan_command import add_plan_args, cmd_plan
from localserve.server.request.images import ImageBounds
from localserve.server.wire.connection_phases import PhaseBounds

if TYPE_CHECKING:
    import torch

    from localserve.llm import LLM

log = logging.getLogger("localserve")

DTYPES = ("float32", "bfloat16", "float16", "float64")  # names of torch dtypes


def add_model_args(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """Flags shared by every command that loads a model (named as in llama.cpp and vLLM); `several`: `-m`
    may be given more than once (`serve`)."""
    g = parser.add_argument_group("model")
    if several:
        g.add_argument("-m", "--model", action="append", default=[],
                       help="HF folder, hub repo id or .gguf file; repeat it to serve several (default: "
                            "SmolLM2-135M-Instruct, unless --models-dir gives models)")
    else:
        g.add_argument("-m", "--model", help="HF folder, hub repo id or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--offline", action="store_true", help="never contact the Hugging Face hub")
    g.add_argument("--dtype", choices=DTYPES, help="weights and activations (default: bfloat16 on a GPU and on "
                   "a CPU with bf16 instructions, else float32)")
    g.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    g.add_argument("--chat-template-file", type=Path, help="a Jinja chat template replacing the model's")
    e = parser.add_argument_group("engine")
    e.add_argument("-c", "--ctx-size", type=int, help="context length per sequence (default: the model's)")
    e.add_argument("-np", "--parallel", type=int,
                   help=f"sequences running at once (slots; default {DEFAULT_MAX_NUM_SEQS}, fewer for a model whose "
                        "recurrent states would take more than half the KV memory)")
    e.add_argument("--max-num-batched-tokens", type=int, default=512, help="token budget of one step")
    e.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    e.add_argument("--num-kv-blocks", type=int, default=2048, help="blocks in the KV pool")
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    e.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute")
    e.add_argument("-ctk", "--cache-type-k", help="KV cache format of K: fp16, bf16, fp32, q8_0, q4_rot "
                   "(default: the model dtype)")
    e.add_argument("-ctv", "--cache-type-v", help="KV cache format of V (same choices as -ctk)")
    e.add_argument("--kv-cache-dtype", help="KV cache format of both K and V (-ctk/-ctv override it)")
    e.add_argument("--gpu-memory-utilization", type=float,
                   help="size the KV pool to this fraction of the GPU, weights included (overrides --num-kv-blocks)")
    e.add_argument("--kv-cache-memory",
                   help="size the KV pool to this many bytes, e.g. 6GB (overrides --num-kv-blocks)")
    e.add_argument("--keep-quantized-weights", action=argparse.BooleanOptionalAction,
                   help="keep a .gguf's quantized weights (and a folder's MXFP4 experts) in their blocks on the "
                        "device, multiplied by Triton kernels (default: on for those on CUDA, off on a CPU)")
    e.add_argument("--attention-backend", default="auto",
                   help="attention implementation: auto (the fastest that supports the device and KV formats), "
                        "torch, triton")
    e.add_argument("--state-checkpoint-tokens", type=int, default=STATE_CHECKPOINT_TOKENS,
                   help="models with linear-attention layers (Qwen3.5/3.6, Qwen3-Next): checkpoint each sequence's "
                        "recurrent state every this many tokens (a multiple of --block-size) and at the last block "
                        "boundary 8 tokens or more before its prompt's end, for prefix reuse; a hit between "
                        "checkpoints recomputes up to this many tokens, denser checkpoints cost a whole state each "
                        "(about 60-150 MiB on Qwen3.6 "
                        f"models; default {STATE_CHECKPOINT_TOKENS}: one default step budget)")
    e.add_argument("--state-cache-slots", type=int,
                   help="models with linear-attention layers: state slots kept for cached checkpoints besides "
                        "those the running sequences need (default: one per --parallel slot, so each "
                        "conversation's last checkpoint can survive the others' turns)")
    e.add_argument("--max-step-ms", default="auto",
                   help="time budget of one step: prompts are prefilled beside the decodes only as far as keeps a "
                        "step within it; auto (twice a stream's usual gap), a number of ms, or off "
                        "(--max-num-batched-tokens stays an upper bound)")
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--spec-type", choices=("ngram", "draft"),
                   help="draft tokens to verify in one step: ngram (prompt lookup), draft (a draft model, -md); "
                        "default: off, or draft when -md is given")
    s.add_argument("--spec-tokens", "--draft-max", type=int, default=SPEC_TOKENS,
                   help=f"at most this many drafted tokens a step per sequence (fewer as drafts fail; "
                        f"default {SPEC_TOKENS})")
    s.add_argument("-md", "--model-draft", help="the draft model (HF folder, hub repo id or .gguf), of the model's "
                   "tokenizer")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine settings the command line gives, checked (ValueError: a KV format or an attention backend
    it does not know, a step budget or speculation setting it refuses) before torch is imported or a model
    file opened."""
    if args.spec_type == "draft" and not args.model_draft:
        raise ValueError("--spec-type draft needs a draft model (-md/--model-draft PATH)")
    return EngineConfig(
        num_kv_blocks=args.num_kv_blocks, block_size=args.block_size, max_model_len=args.ctx_size,
        enable_prefix_caching=args.enable_prefix_caching,
        cache_type_k=args.cache_type_k or args.kv_cache_dtype,
        cache_type_v=args.cache_type_v or args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
        max_num_seqs=args.parallel, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill, preemption_mode=args.preemption_mode,
        attention_backend=args.attention_backend, max_step_ms=max_step_ms(args.max_step_ms),
        spec_type=args.spec_type or ("draft" if args.model_draft else None), spec_tokens=args.spec_tokens,
        state_checkpoint_tokens=args.state_checkpoint_tokens, state_cache_slots=args.state_cache_slots)


def max_step_ms(value: str) -> float | str | None:
    """--max-step-ms: "auto", "off" (None), or milliseconds (ValueError otherwise: EngineConfig checks > 0)."""
    if value in ("auto", "off"):
        return None if value == "off" else value
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"--max-step-ms must be auto, off or a number of milliseconds, got {value!r}") from None


def build_llm(args: argparse.Namespace, config: EngineConfig) -> LLM:
    """Load the model the command line names, with its engine."""
    from localserve.llm import LLM

    device, dtype = model_device_and_dtype(args)
    llm = LLM(args.model, dtype=dtype, device=device, offline=args.offline, engine_config=config,
              keep_quantized_weights=args.keep_quantized_weights,
              draft_model=args.model_draft if config.spec_type == "draft" else None)
    if args.chat_template_file:
        llm.tokenizer.chat_template = args.chat_template_file.read_text()
    return llm


def model_device_and_dtype(args: argparse.Namespace) -> tuple[str, torch.dtype]:
    """The device and the torch dtype the flags ask for (defaults: cuda when there is one; serving_dtype)."""
    import torch

    from localserve.loading.hf import serving_dtype

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, getattr(torch, args.dtype) if args.dtype else serving_dtype(device)


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", "-n", type=int, default=256)
    g.add_argument("--temperature", "--temp", type=float, default=0.0, help="0 is greedy (the default)")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          seed=args.seed, max_tokens=args.max_tokens, stop=args.stop)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # bad values fail before the model loads
    llm = build_llm(args, engine_config(args))
    if args.chat:
        prompt_ids = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt_ids = llm.tokenizer.encode(args.prompt)
    stream_completion(llm.engine, prompt_ids, params)
    return 0


def stream_completion(engine, prompt_ids: list[int], params: SamplingParams) -> str:
    """Run one request, writing its text to stdout as it is generated; returns the whole text."""
    request_id = engine.add_request(prompt_ids, params)
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                delta = output.outputs[0].delta_text
                text += delta
                sys.stdout.write(delta)
                sys.stdout.flush()
    sys.stdout.write("\n")
    return text


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve the models over HTTP and websockets (DESIGN.md section 7) until SIGINT or SIGTERM, then exit 0.

    The default model is loaded before the port opens; the others when a request names them
    (server/registry/registry.py)."""
    settings = engine_config(args)  # a bad setting fails at once, before torch is imported
    mmproj = mmproj_pair(args)
    import asyncio
    import signal

    from localserve.server.app import LocalServer
    from localserve.server.registry.registry import ModelPolicy, ModelRegistry
    from localserve.server.wire.access import check_bind_safety

    config = server_config(args)
    policy = ModelPolicy(max_loaded_models=args.max_loaded_models, sleep_idle_s=args.sleep_idle_seconds)
    api_key = config.api_key
    check_bind_safety(config)  # before minutes of loading, not after
    # Only in a terminal: with any stream redirected (a log file, a pipe, a service) plain logs are wanted.
    show_tui = not args.no_tui and all(stream.isatty() for stream in (sys.stdin, sys.stdout, sys.stderr))
    if not args.verbose:  # one line per connection is noise at INFO
        logging.getLogger("websockets").setLevel(logging.WARNING)
    from localserve.model_loader import EngineLoader, find_models  # torch: only once the flags are accepted

    found = find_models(args.model, args.models_dir, default_name=args.default_model, alias=args.alias,
                        offline=args.offline, sampling_overrides=sampling_overrides(args))
    for entry in found.catalog.entries:
        log.info("model %s (%s): answers to %s; sampling defaults for requests that set none: %s", entry.id,
                 entry.files.path, ", ".join(entry.names), found.sampling_defaults[entry.id].describe())
    device, dtype = model_device_and_dtype(args)
    load = EngineLoader(settings, dtype, device, args.keep_quantized_weights,
                        args.chat_template_file.read_text() if args.chat_template_file else None, mmproj=mmproj)
    default = found.catalog.default
    models = ModelRegistry(found.catalog, load, found.sampling_defaults, policy, loaded={default.id: load(default)},
                           describe=load.describe)
    try:
        server = LocalServer(models, config)

        async def serve_until_signalled() -> None:
            shutdowns: list[asyncio.Task] = []

            def on_signal(signum: int) -> None:  # end responses with a final event, then exit 0
                if not shutdowns:
                    log.info("%s: shutting down", signal.Signals(signum).name)
                    shutdowns.append(asyncio.create_task(server.shutdown()))

            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, on_signal, signum)
            await server.start()
            log_web_page(server)
            await server.serve_forever()
            await asyncio.gather(*shutdowns)

        if show_tui:
            serve_with_tui(server, api_key)
        else:
            asyncio.run(serve_until_signalled())
    finally:
        models.unload_all()
    return 0


def mmproj_pair(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """(the model's path, its mmproj) of `--mmproj`, which pairs with one `-m` .gguf file (ValueError
    otherwise, before anything is loaded); None without the flag."""
    if args.mmproj is None:
        return None
    if len(args.model) != 1:
        raise ValueError(f"--mmproj pairs with one -m model (a .gguf file); {len(args.model)} given")
    model = Path(args.model[0]).expanduser()
    if model.suffix != ".gguf":
        raise ValueError(f"--mmproj {args.mmproj}: pairs with a .gguf language model; -m {args.model[0]} is not one "
                         f"(a checkpoint folder's vision weights load from the folder)")
    if not args.mmproj.expanduser().is_file():
        raise ValueError(f"--mmproj {args.mmproj}: no such file")
    return model.resolve(), args.mmproj.expanduser()


def server_config(args: argparse.Namespace):
    """The ServerConfig of `localserve serve`'s flags (the key also from $LOCALSERVE_API_KEY)."""
    import os

    from localserve.server.config import ServerConfig
    from localserve.server.request.generation_request import RequestLimits

    return ServerConfig(host=args.host, port=args.port, api_key=args.api_key or os.environ.get("LOCALSERVE_API_KEY"),
                        allowed_origins=tuple(args.allowed_origins), allowed_hosts=tuple(args.allowed_hosts),
                        max_connections=args.max_connections,
                        max_unfinished_connections=args.max_unfinished_connections,
                        phase_bounds=phase_bounds(args), default_max_output_tokens=args.max_tokens,
                        monitor_interval_s=args.monitor_interval, web_ui=not args.no_webui,
                        limits=RequestLimits(images=image_bounds(args)))


def image_bounds(args: argparse.Namespace) -> ImageBounds:
    """The ImageBounds of `localserve serve`'s flags (IMAGE_FLAGS); a bound below 1 is an error naming its flag."""
    values = {}
    for flag, name, _, _ in IMAGE_FLAGS:
        values[name] = getattr(args, flag[2:].replace("-", "_"))
        if values[name] < 1:
            raise SystemExit(f"localserve: {flag} must be >= 1, got {values[name]}")
    return ImageBounds(**values)


def sampling_overrides(args: argparse.Namespace) -> dict[str, float | int]:
    """The sampling flags given (--temp, --top-k, --top-p, --min-p): over every model's own defaults."""
    return {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "min_p")
            if getattr(args, name) is not None}


def log_web_page(server) -> None:
    """Say where the web page is, once the server listens (a newcomer opens the printed URL)."""
    if server.config.web_ui:
        host = "127.0.0.1" if server.config.host in ("0.0.0.0", "::", "") else server.config.host
        log.info("the web page (chat and monitor): http://%s:%d/", host, server.port)


def serve_with_tui(server, api_key: str | None) -> None:
    """Run `server` on a background thread and the TUI in this terminal; quitting the TUI stops both.

    The terminal is the TUI's while it runs, so log records go to its "Server log" panel.
    """
    from localserve.server.app import BackgroundServer
    from localserve.tui import LogBuffer, MonitorApp, monitor_url
    from localserve.tui.client import DEFAULT_INTERVAL_S

    background = BackgroundServer(server).start()
    root = logging.getLogger()
    buffer, stderr_handlers = LogBuffer(), root.handlers[:]
    root.handlers = [buffer]
    try:
        log.info("listening on ws://%s:%d (q in the TUI stops the server)", server.config.host, background.port)
        log_web_page(server)
        host = "127.0.0.1" if server.config.host in ("0.0.0.0", "::", "") else server.config.host
        MonitorApp(monitor_url(f"{host}:{background.port}", DEFAULT_INTERVAL_S), api_key=api_key,
                   server_log=buffer).run()
    finally:
        root.handlers = stderr_handlers
        background.stop()


# the image bounds' flags: flag, ImageBounds field, metavar, help
IMAGE_FLAGS = (
    ("--max-image-bytes", "max_bytes", "BYTES", "the largest image file a request may carry (decoded from base64)"),
    ("--max-request-image-bytes", "max_total_bytes", "BYTES",
     "every image of one request together (the request body may grow by their base64)"),
    ("--max-images", "max_images", "N", "images in one request"),
    ("--max-image-pixels", "max_pixels", "N", "width x height of one image, read from its header before it is "
     "decoded (decompression bombs are refused)"),
)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Flags of `localserve serve`: where to listen, who may connect, defaults for requests."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (anything but loopback needs --api-key)")
    g.add_argument("--port", type=int, default=8080)
    g.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $LOCALSERVE_API_KEY)")
    g.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="browser origins allowed besides the server's own, e.g. http://localhost:3000")
    g.add_argument("--allowed-hosts", nargs="*", default=[], metavar="NAME",
                   help="Host header names answered besides loopback names, IP addresses and --host "
                        "('*': any; guards against DNS rebinding)")
    g.add_argument("--alias", help="the default model's id: the name /v1/models lists it under (it answers to its "
                   "own names too)")
    m = parser.add_argument_group("models", "several models served by name, loaded when a request names one")
    m.add_argument("--models-dir", type=Path, metavar="DIR",
                   help="serve every .gguf file and every HF folder (with a config.json) directly in DIR, besides -m")
    m.add_argument("--mmproj", type=Path, metavar="FILE",
                   help="llama.cpp's mmproj file (the vision tower and projector) of the one -m model, a .gguf: the "
                        "model then takes images")
    m.add_argument("--default-model", metavar="NAME",
                   help="the model a request naming none (or 'default') gets, loaded at start (default: the first "
                        "-m, else the first model of --models-dir by name)")
    m.add_argument("--max-loaded-models", type=int, default=1, metavar="N",
                   help="models kept loaded at once; a request for another unloads the least recently used after "
                        "its requests finish (default: 1, what a 24 GB card holds)")
    m.add_argument("--sleep-idle-seconds", type=float, metavar="S",
                   help="unload a model no request has used for S seconds (default: never)")
    g.add_argument("--max-connections", type=int, default=256,
                   help="connections with a request in progress, idle between two, or websockets that have spoken; "
                        "a whole request beyond them gets 429")
    g.add_argument("--max-unfinished-connections", type=int,
                   help="connections still sending their first (or next) request, counted apart; one more closes "
                        "the oldest of them (default: --max-connections)")
    bounds = PhaseBounds()
    g.add_argument("--header-timeout", type=float, default=bounds.header_s, metavar="S",
                   help="seconds from a connection (or its first byte after a response) to the end of a request head")
    g.add_argument("--body-gap-timeout", type=float, default=bounds.body_gap_s, metavar="S",
                   help="the longest pause between the bytes of a request body; also the grace of --min-body-rate")
    g.add_argument("--min-body-rate", type=float, default=bounds.min_body_rate, metavar="BYTES_PER_S",
                   help="the slowest average a request body may keep once past its first --body-gap-timeout "
                        "(0: none)")
    g.add_argument("--keep-alive-timeout", type=float, default=bounds.keep_alive_s, metavar="S",
                   help="how long an idle keep-alive HTTP connection is kept")
    g.add_argument("--handshake-timeout", type=float, default=bounds.handshake_s, metavar="S",
                   help="seconds from a websocket upgrade's head to its 101")
    g.add_argument("--first-event-timeout", type=float, default=bounds.first_event_s, metavar="S",
                   help="seconds a /v1/responses websocket may stay silent after opening")
    g.add_argument("--max-tokens", "-n", type=int, default=None,
                   help="max_output_tokens of a request that sets none (default: none, the context bounds it; "
                        "always cut to the context)")
    g.add_argument("--temperature", "--temp", type=float,
                   help="temperature of a request that sets none (default: the model's generation_config.json, "
                        "else 0.8)")
    g.add_argument("--top-k", type=int, help="top_k of a request that sets none (default: the model's, else 40)")
    g.add_argument("--top-p", type=float, help="top_p of a request that sets none (default: the model's, else 0.95)")
    g.add_argument("--min-p", type=float, help="min_p of a request that sets none (default: the model's, else 0.05)")
    g.add_argument("--monitor-interval", type=float, default=0.5,
                   help="seconds between /v1/monitor snapshots")
    images = ImageBounds()
    for flag, name, metavar, what in IMAGE_FLAGS:
        g.add_argument(flag, type=int, default=getattr(images, name), metavar=metavar, help=what)
    g.add_argument("--no-webui", action="store_true",
                   help="serve no web page at / (the chat and monitor page; / is then a 404)")
    g.add_argument("--no-tui", action="store_true",
                   help="do not show the TUI in this terminal (shown when stdin, stdout and stderr are one)")


def phase_bounds(args: argparse.Namespace) -> PhaseBounds:
    """The time bounds of a connection's phases from `localserve serve`'s flags."""
    return PhaseBounds(header_s=args.header_timeout, body_gap_s=args.body_gap_timeout,
                       min_body_rate=args.min_body_rate, keep_alive_s=args.keep_alive_timeout,
                       handshake_s=args.handshake_timeout, first_event_s=args.first_event_timeout)


def cmd_tui(args: argparse.Namespace) -> int:
    """Watch a running server's KV pool, slots and events in this terminal (localserve/tui)."""
    import os

    from localserve.tui import MonitorApp, monitor_url

    api_key = args.api_key or os.environ.get("LOCALSERVE_API_KEY")
    MonitorApp(monitor_url(args.url, args.interval), api_key=api_key).run()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Chat in this terminal with a running server (see localserve/chat_client.py)."""
    from localserve.chat.client import run_chat

    return run_chat(args.url, api_key=args.api_key, model=args.model, instructions=args.instructions,
                    max_output_tokens=args.max_tokens, temperature=args.temperature)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="localserve", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt and print it")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    serve = sub.add_parser("serve", help="serve models over HTTP (OpenAI's API) and websockets")
    add_model_args(serve, several=True)
    add_server_args(serve)
    serve.set_defaults(func=cmd_serve)
    chat = sub.add_parser("chat", help="chat in this terminal with a running server")
    chat.add_argument("url", nargs="?", default="ws://127.0.0.1:8080",
                      help="the server (default: %(default)s)")
    chat.add_argument("--api-key", help="the server's key (default: $LOCALSERVE_API_KEY)")
    chat.add_argument("--model", help="model name to send (default: the server's)")
    chat.add_argument("--instructions", help="system prompt")
    chat.add_argument("--max-tokens", "-n", type=int, help="max_output_tokens per reply")
    chat.add_argument("--temperature", "--temp", type=float)
    chat.set_defaults(func=cmd_chat)
    tui = sub.add_parser("tui", help="watch a running server's KV blocks, slots and events")
    tui.add_argument("url", nargs="?", default="ws://127.0.0.1:8080", help="the server (default: %(default)s)")
    tui.add_argument("--api-key", help="the server's key (default: $LOCALSERVE_API_KEY)")
    tui.add_argument("--interval", type=float, default=0.2, help="seconds between snapshots (default: %(default)s)")
    tui.set_defaults(func=cmd_tui)
    plan = sub.add_parser("plan", help="KV memory plan: per cache format, bytes/token and tokens that fit")
    add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, OSError) as exc:
        # One clear line naming the file and the problem; the traceback only with -v.
        if args.verbose:
            raise
        print(f"localserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
