"""OpenAI-compatible HTTP server: ``python -m serving.server``.

    python -m serving.server                          # tiny preset, random weights, bytes
    python -m serving.server --preset tiny --block-size 64 --max-num-batched-tokens 256 \\
        --max-model-len 1024 --single-bucket --port 8000
    python -m serving.server --tp 4 --dcp 2          # a (2, 2) mesh of 4 devices
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}'

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /v1/models/{id}``,
``GET /health``, ``GET /metrics`` (Prometheus text). Request fields are described in
``serving.api``, the byte tokenizer and the chat template in ``serving.tokenizer``; every
error, 404 and 405 included, has OpenAI's shape ``{"error": {message, type, param, code}}``.
Requests in flight together share engine steps (``serving.async_engine``). A client that
disconnects aborts its request at any stage; ``--request-timeout`` aborts a request that
runs too long (504); ``--api-key`` guards ``/v1/*`` and ``--max-body-bytes`` bounds a body
(``serving.http_guard``). SIGINT / SIGTERM stop accepting connections, abort what is in
flight and exit.

``--tp N`` (N > 1) runs the model on a ``(N // dcp, dcp)`` mesh of N devices
(``glmjax.sharding``); on a CPU the server asks JAX for N host devices. With ``--tp 1``,
``--dcp 2`` or ``4`` is emulated on one device (a KV block of ``block_size * dcp`` tokens).

Over several processes or hosts (``glmjax.distributed``), every process runs the same
command plus ``--coordinator HOST:PORT --num-processes N --process-id I``; process 0
serves HTTP and schedules, the others run the steps it announces (``serving.multiprocess``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse
from flax import nnx
from starlette.exceptions import HTTPException

from glmjax import compile_cache, distributed, xla_options
from glmjax.config import ModelConfig
from glmjax.random_weights import random_model
from glmjax.sharding import ShardingPlan, make_mesh, request_cpu_devices
from serving import api, multiprocess, speculative
from serving.async_engine import AsyncEngine
from serving.compiles import CompileLog
from serving.engine import Engine, EngineConfig
from serving.handlers import Handlers
from serving.http_guard import (
    HTTPGuard,
    HTTPOptions,
)
from serving.precompile import precompile
from serving.request import SamplingParams
from serving.server_args import parse_args
from serving.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger("serving.server")


def build_app(
    async_engine: AsyncEngine,
    tokenizer: Tokenizer,
    *,
    model_name: str,
    options: HTTPOptions | None = None,
) -> FastAPI:
    """The FastAPI app serving ``async_engine`` (started and stopped by the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.stop()

    options = options or HTTPOptions()
    app = FastAPI(title="glmjax", lifespan=lifespan)
    app.add_middleware(HTTPGuard, options=options)
    handlers = Handlers(
        async_engine, tokenizer, model_name=model_name, request_timeout_s=options.request_timeout_s
    )
    app.state.handlers = handlers

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):
        message = f"{error.detail}: {request.method} {request.url.path}"
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        return api.APIError(error.status_code, message, code=code, headers=error.headers).response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        param = ".".join(map(str, first["loc"])) or None
        return api.APIError(
            400, f"{param}: {first['msg']}", param=param, code="invalid_value"
        ).response()

    @app.post("/v1/completions", openapi_extra=_request_body(api.CompletionRequest))
    async def completions(request: Request):
        return await handlers.completions(request)

    @app.post("/v1/chat/completions", openapi_extra=_request_body(api.ChatRequest))
    async def chat_completions(request: Request):
        return await handlers.chat(request)

    @app.get("/v1/models")
    async def models():
        return handlers.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return handlers.model(model_id)

    @app.get("/health")
    async def health():
        if async_engine.error is not None:
            # The cause is in the server log; the body says only that the engine is down.
            return JSONResponse({"status": "error", "error": "the engine is not serving"}, 503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics():
        return PlainTextResponse(handlers.prometheus_text(), media_type="text/plain; version=0.0.4")

    app.openapi = lambda: _openapi_with_bodies(app)
    return app


_SCHEMA_REF = "#/components/schemas/{model}"


def _request_body(model) -> dict:
    """The OpenAPI ``requestBody`` of a route that parses its body itself (to bound and
    check it first, ``serving.json_body``), so that the schema still documents it."""
    schema = {"$ref": _SCHEMA_REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _openapi_with_bodies(app: FastAPI) -> dict:
    """FastAPI's schema plus the request models ``_request_body`` refers to."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (api.CompletionRequest, api.ChatRequest):
            definition = model.model_json_schema(ref_template=_SCHEMA_REF)
            components.update(definition.pop("$defs", {}))
            components[model.__name__] = definition
        app.openapi_schema = schema
    return app.openapi_schema


class _Server(uvicorn.Server):
    """uvicorn, plus: a shutdown signal first aborts every request in flight, so that open
    streams end now rather than when their generations would."""

    def __init__(self, config: uvicorn.Config, handlers: Handlers):
        super().__init__(config)
        self._handlers = handlers

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            logger.info("signal %s: refusing new requests, aborting those in flight", sig)
            self._handlers.shut_down()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn re-raises a captured signal after its shutdown, which ends the process
        with that signal's status; after an orderly shutdown we exit with status 0."""
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def build_steps(args: argparse.Namespace, config: ModelConfig):
    """The mesh's steps for ``--tp N`` (N > 1), else None (one device)."""
    if args.tp == 1:
        return None
    try:
        mesh = make_mesh(args.tp, args.dcp)
        return ShardingPlan(config, mesh, interleave=args.dcp_interleave).steps()
    except ValueError as error:
        raise ValueError(f"--tp {args.tp} --dcp {args.dcp}: {error}") from None


def build_engine(args: argparse.Namespace, channel: multiprocess.StepChannel | None = None
                 ) -> tuple[Engine, Tokenizer, str]:
    """The engine, tokenizer and served model name the arguments describe (on process 0
    of several, its steps announced to the others on `channel`).

    Raises:
      ValueError: arguments the server cannot run (the message says which and why).
    """
    config = build_config(args)
    steps = build_steps(args, config)
    if args.speculative_tokens:  # before any weight is read
        if args.mixed_steps:
            raise ValueError(f"--speculative-tokens {args.speculative_tokens} cannot run with "
                             "--mixed-steps (a mixed step has no verify rows)")
        try:
            speculative.check_supported(config, on_mesh=steps is not None or channel is not None)
        except ValueError as error:
            raise ValueError(f"--speculative-tokens {args.speculative_tokens}: {error}") from None
    if channel is not None:
        steps = multiprocess.leader_steps(steps, channel)
    tokenizer = load_tokenizer(args.tokenizer, config.vocab_size)
    blocks_per_request = -(-args.max_model_len // (args.block_size * args.dcp))
    engine_config = EngineConfig(
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        dcp=args.dcp,
        budget=args.max_num_batched_tokens,
        coalesce=not args.no_prefill_coalescing,
        prefix_caching=not args.no_prefix_caching,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks or 8 * blocks_per_request,
        num_state_slots=args.num_state_slots,
        eos_token_id=tokenizer.eos_token_id,
        single_bucket=args.single_bucket,
        seed=args.seed,
        speculative_tokens=args.speculative_tokens,
        async_scheduling=not args.no_async_scheduling and channel is None,
        mixed_steps=args.mixed_steps,
    )
    model = load_model(args, config)
    engine = Engine(config, model, engine_config, detokenize=tokenizer.decode, steps=steps)
    return engine, tokenizer, args.served_model_name or args.preset


def build_config(args: argparse.Namespace) -> ModelConfig:
    """The preset, with one KV block per block id (``block_size * dcp`` tokens)."""
    config = ModelConfig.preset(args.preset)
    return dataclasses.replace(config, kv_block_size=args.block_size * args.dcp,
                               batch_invariant=args.batch_invariant)


def load_model(args: argparse.Namespace, config: ModelConfig):
    if args.weights is None:
        logger.info("weights: random (seed %d)", args.seed)
        return random_model(config, args.seed)
    if not args.weights.is_dir():
        raise ValueError(f"--weights {args.weights}: not a folder")
    if any(args.weights.glob("*.safetensors")):
        if args.family is None:
            raise ValueError("--weights holds safetensors: name their naming with --family")
        from glmjax.weights import load_safetensors

        logger.info("weights: safetensors %s (%s naming)", args.weights, args.family)
        return load_safetensors(args.weights, config, family=args.family)
    from glmjax.weights import restore_params

    logger.info("weights: orbax checkpoint %s", args.weights)
    return restore_params(args.weights, config)


def log_features(engine: Engine, tokenizer: Tokenizer) -> None:
    """DESIGN section 6: say at start which features are active."""
    c = engine.config
    logger.info("prefill coalescing: %s", "on" if c.coalesce else "off (reference ladder)")
    logger.info("prefix caching: %s", "on" if c.prefix_caching else "off")
    logger.info("speculative decoding: %s", f"MTP, {c.speculative_tokens} drafts per step"
                if c.speculative_tokens else "off")
    mesh = engine.steps.mesh
    if mesh is None:
        where = " (emulated on one device: a block id names block_size * dcp tokens)"
        logger.info("devices: 1; dcp: %d%s", c.dcp, where if c.dcp > 1 else "")
    else:
        logger.info(
            "devices: %d as a (tpo, dcp) = %s mesh (%s); dcp: %d, MLA latents split by token",
            mesh.size,
            tuple(mesh.shape.values()),
            mesh.devices.flat[0].platform,
            c.dcp,
        )
    logger.info(
        "block size %d, budget %d tokens/step, max model len %d, %d KV blocks, "
        "%d state slots, max %d seqs/step%s",
        c.block_size,
        c.budget,
        c.max_model_len,
        c.num_kv_blocks,
        c.num_state_slots,
        c.max_num_seqs,
        ", single bucket" if c.single_bucket else "",
    )
    logger.info("tokenizer: %s, EOS id %s", type(tokenizer).__name__, tokenizer.eos_token_id)
    if tokenizer.chat_template is None:
        logger.warning("the tokenizer has no chat template: chat requests are refused (400)")


def warm_up(engine: Engine, precompile_all: bool) -> None:
    """Compiles what the server can call (every reachable program, or with
    ``precompile_all`` off the smallest shapes), then runs one short request through the
    engine; after a full precompile that request must compile nothing. It shows in
    /metrics."""
    start = time.perf_counter()
    if precompile_all:
        precompile(engine, log=logger.info)
    with CompileLog() as compiles:
        engine.add_request("warm-up", [0], SamplingParams(max_tokens=2, ignore_eos=True))
        engine.run_until_done()
    if precompile_all and compiles.count:
        logger.warning("the warm-up request compiled %d programs after the precompile: %s",
                       compiles.count, compiles.by_function())
    logger.info("ready after %.1f s of compiles and warm-up", time.perf_counter() - start)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.pin_temporaries:
        xla_options.pin_temporaries()
    if args.batch_invariant:
        xla_options.batch_invariant_gemms()
    if args.tp > 1:
        request_cpu_devices(args.tp)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    compile_cache.enable_from_args(args)
    try:
        group = distributed.initialize(args, tp=args.tp, flags=vars(args))
        if group is not None and not group.is_leader:  # a follower serves no HTTP
            config = build_config(args)
            multiprocess.follow(build_steps(args, config),
                                nnx.split(load_model(args, config)), group)
            return
        channel = None if group is None else multiprocess.StepChannel(group)
        engine, tokenizer, model_name = build_engine(args, channel)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    log_features(engine, tokenizer)
    if args.precompile == "all" and group is not None:
        # The followers compile each program when process 0 first announces it: a
        # precompile on process 0 alone would leave them compiling while it serves.
        logger.warning("--precompile all is not supported across processes yet: every "
                       "batch shape compiles the first time a step needs it")
    warm_up(engine, args.precompile == "all" and group is None)
    async_engine = AsyncEngine(engine)
    if group is not None:  # a lost follower fails every request before JAX ends us
        watching = multiprocess.watch(group, is_dead=lambda: async_engine.error is not None,
                                      fail=async_engine.fail,
                                      timeout_s=0.4 * args.heartbeat_timeout)
    app = build_app(async_engine, tokenizer, model_name=model_name, options=args.http)
    if args.http.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "serving on %s without --api-key: anyone who reaches it may use it", args.host
        )
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    _Server(config, app.state.handlers).run()
    if group is not None:
        watching.set()
        multiprocess.stop_followers(channel)
    logger.info("server stopped")


if __name__ == "__main__":
    main()
