"""`pageserve serve [MODEL]`: load the model, then serve the OpenAI API with uvicorn (uvloop,
httptools)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import ssl
import time
from pathlib import Path

import orjson
import uvicorn

from pageserve.app.http_protocol import HeadLimits, protocol_class
from pageserve.app.lora import RUNTIME_UPDATING_ENV, parse_lora_modules, runtime_updating_allowed
from pageserve.app.reasoning import REASONING_PARSERS
from pageserve.app.state import ServerSettings
from pageserve.app.tool_parsers import DEFAULT_TOOL_PARSER, TOOL_PARSERS

logger = logging.getLogger(__name__)


# the order `pageserve serve --help` (and docs/serving.md's table) shows the groups in
HELP_GROUPS = ("model", "engine", "memory", "scheduling", "server", "API", "security", "observability",
               "parallel", "images (vision-language models)", "LoRA adapters", "speculative decoding")


def add_args(parser: argparse.ArgumentParser) -> None:
    from pageserve.runtime.engine_args import EngineArgs

    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model directory or .gguf file (same as --model)")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind: loopback only unless changed (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="model names the API answers to; the first is reported (default: the model's)")
    g.add_argument("--max-num-queued-reqs", type=int, default=1024,
                   help="past this many requests waiting for the engine (a request of n > 1 counts n), new ones "
                        "get a 503 with Retry-After")
    g.add_argument("--request-timeout", type=float, default=None,
                   help="seconds a request may take once its body is read and its prompt checked; past it, a "
                        "408 (or an error event) and its blocks are freed (default: no limit)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds that requests in flight may take before they are stopped with an "
                        "error; new requests are refused meanwhile")
    g.add_argument("--disable-frontend", action="store_true", help="do not serve the chat page at /")
    g.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML file of these flags, as vLLM's (port: 8001, api-key: [KEY1, KEY2], ...); a flag on "
                        "the command line too takes the command line's value")
    g.add_argument("--headless", action="store_true",
                   help="with --nnodes above 1, on nodes 1..: run only this node's ranks, no engine and no API; "
                        "give the same model and engine flags as node 0")
    g = parser.add_argument_group("API")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, or the template itself) that replaces the model's own")
    g.add_argument("--generation-config", default="auto",
                   help="where unset sampling fields' defaults come from: auto (the model's "
                        "generation_config.json), a folder holding one, or vllm (the API's own)")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='sampling defaults set on top of --generation-config\'s, e.g. \'{"temperature": 0.5}\' '
                        "(temperature, top_p, top_k, min_p, repetition_penalty)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='name each logprob entry\'s token "token_id:N" (as a request\'s '
                        'return_tokens_as_token_ids does)')
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model decide when to call tools (tool_choice auto); needs --tool-call-parser")
    g.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default=None,
                   help=f"how tool calls are written in the model's output, as vLLM's parsers of the same names "
                        f"(default: {DEFAULT_TOOL_PARSER})")
    g.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                   help="put a reasoning model's thinking (between <think> tags) in reasoning_content, "
                        "never in content")
    g.add_argument("--max-stored-responses", type=int, default=1024,
                   help="finished /v1/responses answers kept in memory per API key, least recently used "
                        "out; 0 keeps none")
    g.add_argument("--max-stored-responses-mb", type=float, default=256,
                   help="the memory one API key's stored responses may hold (as JSON), each counted with "
                        "the conversation it continues")
    g = parser.add_argument_group("security")
    g.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*; repeatable; also $PAGESERVE_API_KEY")
    g.add_argument("--allowed-origins", action="append", default=None, metavar="ORIGINS",
                   help="CORS origins allowed (a JSON list, comma-separated, or repeated); none by default")
    g.add_argument("--allowed-hosts", action="append", default=None, metavar="HOSTS",
                   help="Host names a request may carry besides localhost and IP addresses (a JSON list, "
                        "comma-separated, or repeated; '*' for any); checked where set and whenever the server "
                        "binds a loopback address, against DNS rebinding")
    g.add_argument("--allowed-media-domains", action="append", default=None, metavar="HOSTS",
                   help="hosts whose http(s) image URLs the server fetches (a JSON list, comma-separated, or "
                        "repeated); none by default, and never private addresses")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (PEM); needs --ssl-certfile")
    g.add_argument("--ssl-certfile", default=None, help="the server's certificate chain (PEM) for HTTPS")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="CA certificates (PEM) that client certificates are checked against")
    g.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE), choices=[0, 1, 2],
                   help="client certificates: 0 not asked for, 1 checked when given, 2 required (mutual TLS; "
                        "needs --ssl-ca-certs)")
    g.add_argument("--max-request-body-mb", type=float, default=32.0, help="larger request bodies get a 413")
    g.add_argument("--h11-max-incomplete-event-size", type=int, default=HeadLimits.max_bytes, metavar="BYTES",
                   help="the most bytes of a request's line and headers; more get a 431 (vLLM's name)")
    g.add_argument("--h11-max-header-count", type=int, default=HeadLimits.max_headers, metavar="N",
                   help="the most header lines of a request; more get a 431 (vLLM's name)")
    g.add_argument("--max-prompt-logprobs-tokens", type=int, default=32768,
                   help="prompt tokens one request may ask logprobs of (echo with logprobs, or prompt_logprobs)")
    g = parser.add_argument_group("observability")
    g.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
    g.add_argument("--enable-log-prompts", action="store_true",
                   help="add the prompt text to each request's log line (off: prompts stay private)")
    g.add_argument("--disable-log-stats", action="store_true", help="no engine status line every 5 s")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's own log level")
    EngineArgs.add_cli_args(parser)
    g = next(group for group in parser._action_groups if group.title == "LoRA adapters")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='adapters served from the start: name=path, or JSON {"name": ..., "path": ..., '
                        '"base_model_name": ...}')
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key); "
                        f"also ${RUNTIME_UPDATING_ENV}=true, as vLLM")
    # positional arguments and -h first, then HELP_GROUPS' order (sort is stable)
    order = {title: i for i, title in enumerate(HELP_GROUPS)}
    parser._action_groups.sort(key=lambda group: order.get(group.title, -1))


def _allowed_hosts(ns: argparse.Namespace) -> tuple[str, ...] | None:
    """--allowed-hosts, lower-cased; a server bound to a loopback address checks Host even
    without it (only local names then), one bound elsewhere only with it (None: no check)."""
    from pageserve.app.server import is_loopback

    hosts = tuple(h.lower() for h in _list_flag(ns.allowed_hosts, "--allowed-hosts"))
    if ns.allowed_hosts is not None or is_loopback(ns.host):
        return hosts
    return None


def _list_flag(values: list[str] | None, flag: str) -> tuple[str, ...]:
    """A repeatable flag whose values are JSON lists or comma-separated."""
    out: list[str] = []
    for v in values or []:
        v = v.strip()
        if v.startswith("["):
            try:
                items = orjson.loads(v)
            except orjson.JSONDecodeError:
                raise ValueError(f"{flag}: {v!r} is not a JSON list") from None
            out.extend(str(i) for i in items)
        else:
            out.extend(o.strip() for o in v.split(",") if o.strip())
    return tuple(out)


def _json_object(value: str | None, flag: str) -> dict:
    if value is None:
        return {}
    try:
        obj = orjson.loads(value)
    except orjson.JSONDecodeError:
        obj = None
    if not isinstance(obj, dict):
        raise ValueError(f"{flag}: {value!r} is not a JSON object")
    return obj


def settings_from_args(ns: argparse.Namespace, model: str) -> ServerSettings:
    keys = list(ns.api_key or [])
    if os.environ.get("PAGESERVE_API_KEY"):
        keys.append(os.environ["PAGESERVE_API_KEY"])
    if any(not k for k in keys):
        raise ValueError("--api-key must not be empty")
    names = tuple(ns.served_model_name or [model])
    if ns.request_timeout is not None and not ns.request_timeout > 0:
        raise ValueError(f"--request-timeout must be > 0 seconds, got {ns.request_timeout}")
    if not ns.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {ns.shutdown_timeout}")
    if ns.enable_auto_tool_choice and ns.tool_call_parser is None:
        raise ValueError(f"--enable-auto-tool-choice needs --tool-call-parser ({', '.join(TOOL_PARSERS)})")
    if ns.lora_modules and not ns.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if not 0 < ns.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {ns.port}")
    return ServerSettings(served_model_names=names, model_path=model, api_keys=tuple(keys),
                          allowed_origins=_list_flag(ns.allowed_origins, "--allowed-origins"),
                          allowed_hosts=_allowed_hosts(ns),
                          allowed_media_domains=_list_flag(ns.allowed_media_domains, "--allowed-media-domains"),
                          max_request_body_bytes=int(ns.max_request_body_mb * (1 << 20)),
                          max_num_queued_reqs=ns.max_num_queued_reqs,
                          log_requests=not ns.disable_log_requests, log_prompts=ns.enable_log_prompts,
                          enable_auto_tool_choice=ns.enable_auto_tool_choice,
                          tool_call_parser=ns.tool_call_parser or DEFAULT_TOOL_PARSER,
                          enable_frontend=not ns.disable_frontend,
                          chat_template=read_chat_template(ns.chat_template),
                          generation_config=ns.generation_config,
                          override_generation_config=_json_object(ns.override_generation_config,
                                                                  "--override-generation-config"),
                          max_stored_responses=ns.max_stored_responses,
                          max_stored_responses_mb=ns.max_stored_responses_mb,
                          max_prompt_logprobs_tokens=ns.max_prompt_logprobs_tokens,
                          reasoning_parser=ns.reasoning_parser,
                          lora_modules=parse_lora_modules(ns.lora_modules),
                          allow_runtime_lora_updating=runtime_updating_allowed(ns.allow_runtime_lora_updating),
                          return_tokens_as_token_ids=ns.return_tokens_as_token_ids)


def tls_options(ns: argparse.Namespace) -> dict:
    """uvicorn's HTTPS settings from the --ssl-* flags, checked (before the model loads)."""
    if (ns.ssl_keyfile is None) != (ns.ssl_certfile is None):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if ns.ssl_certfile is None:
        if ns.ssl_ca_certs is not None or ns.ssl_cert_reqs != ssl.CERT_NONE:
            raise ValueError("--ssl-ca-certs and --ssl-cert-reqs need HTTPS (--ssl-keyfile and --ssl-certfile)")
        return {}
    if ns.ssl_cert_reqs != ssl.CERT_NONE and ns.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs to check client certificates against")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(ns, flag)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"--{flag.replace('_', '-')} {path!r} is not a file")
    try:  # a key that does not match its certificate, or a file that is not PEM, fails here
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(ns.ssl_certfile, ns.ssl_keyfile)
        if ns.ssl_ca_certs is not None:
            context.load_verify_locations(ns.ssl_ca_certs)
    except (ssl.SSLError, OSError) as e:
        raise ValueError(f"the --ssl-* files cannot be used: {e}") from None
    return dict(ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
                ssl_cert_reqs=ns.ssl_cert_reqs)


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the value itself when it is a template."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{%" in value or "{{" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


class GracefulServer(uvicorn.Server):
    """On shutdown, uvicorn stops listening and closes idle connections; meanwhile the engine
    refuses new requests and gives those in flight `shutdown_timeout` seconds, then stops the
    rest with an error (an error event then [DONE] in a stream, a 503 otherwise), so every
    client hears how its request ended."""

    def __init__(self, config: uvicorn.Config, engine, shutdown_timeout: float):
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig, frame) -> None:
        """A second Ctrl-C (uvicorn's force exit) ends the requests in flight now."""
        super().handle_exit(sig, frame)
        if self.force_exit and self._loop is not None:
            self._loop.call_soon_threadsafe(self.engine.hurry)

    async def shutdown(self, sockets=None) -> None:
        drain = asyncio.ensure_future(self.engine.drain(self.shutdown_timeout))
        if self.force_exit:
            self.engine.hurry()
        await super().shutdown(sockets)
        await drain
        if self.force_exit:  # uvicorn skips the lifespan's shutdown then: it stops the engine
            await self.lifespan.shutdown()


def run(ns: argparse.Namespace) -> int:
    from pageserve.app.server import build_app
    from pageserve.app.state import ServerState
    from pageserve.runtime.async_engine import AsyncEngine
    from pageserve.runtime.engine_args import EngineArgs
    from pageserve.runtime.models.loader import DEFAULT_GGUF_FILE

    if ns.model_tag is not None:
        ns.model = ns.model_tag
    args = EngineArgs.from_cli_args(ns)
    if ns.headless:
        from pageserve.runtime.executor import run_headless_node

        return run_headless_node(args)
    # checked before the model loads, so that a bad flag fails in a second
    settings = settings_from_args(ns, args.model or DEFAULT_GGUF_FILE.split(".")[0])
    tls = tls_options(ns)
    head = HeadLimits(ns.h11_max_incomplete_event_size, ns.h11_max_header_count)
    # until serving starts, SIGTERM stops start-up as Ctrl-C does (its compilers and children too)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    engine = AsyncEngine.build(args, settings.max_num_queued_reqs,
                               log_stats_interval=float("inf") if ns.disable_log_stats else 5.0,
                               request_timeout=ns.request_timeout)
    try:
        # "any JSON object" is the slowest grammar to compile (seconds): done before serving, so
        # that the first json_object request does not wait for it, and no compile shares the
        # cores with the first requests (docs/performance.md, "Start-up and the first request")
        from pageserve.grammar.regexes import json_object_regex

        started = time.perf_counter()
        try:
            engine.compile_grammar(json_object_regex()).result()
        except Exception as e:  # noqa: BLE001 - a request that needs it will report the error
            logger.warning("the json_object grammar did not compile at start-up: %s", e)
        logger.info("grammar warm-up: %.1f s", time.perf_counter() - started)
        state = ServerState(engine, engine.tokenizer, settings, engine.max_model_len)
        app = build_app(state)
        # what start-up made lives as long as the server: the collector's passes skip it from now on
        gc.collect()
        gc.freeze()
        logger.info("serving %s on %s://%s:%d%s%s", ", ".join(settings.served_model_names),
                    "https" if tls else "http", ns.host, ns.port, " (API key required)" if settings.api_keys else "",
                    "; chat page at /" if settings.enable_frontend else "")
        # uvicorn's own grace period only backs ours up: by then every request has ended
        config = uvicorn.Config(app, host=ns.host, port=ns.port, loop="uvloop", http=protocol_class(head),
                                log_level=ns.uvicorn_log_level, access_log=False,
                                timeout_graceful_shutdown=ns.shutdown_timeout + 5, **tls)
        server = GracefulServer(config, engine, ns.shutdown_timeout)
        # an engine that cannot go on takes the process down (non-zero), so a supervisor restarts it
        engine.on_dead.append(lambda: setattr(server, "should_exit", True))
        # uvicorn shuts down gracefully on SIGTERM, then raises the signal again for the previous
        # handler: a no-op one makes that a normal exit (status 0), as supervisors expect
        signal.signal(signal.SIGTERM, lambda *_: None)
    except BaseException:
        engine.close()
        raise
    server.run()
    if engine.error is not None:
        logger.error("exiting: the engine stopped on %r", engine.error)
        return 1
    return 0
