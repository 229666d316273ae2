"""OpenAI-compatible HTTP server: ``python -m serving.server``.

    python -m serving.server                          # tiny preset, random weights, bytes
    python -m serving.server --preset tiny --block-size 64 --max-num-batched-tokens 256 \\
        --max-model-len 1024 --single-bucket --port 8000
    python -m serving.server --tp 4 --dcp 2          # a (2, 2) mesh of 4 devices
    curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\
        -d '{"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0}'

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both stream as
server-sent events ending in ``data: [DONE]``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (Prometheus text). Request fields are described in ``serving.api``, the
byte tokenizer and the chat template in ``serving.tokenizer``. Requests in flight together
share engine steps (``serving.async_engine``). A client that disconnects aborts its
request; SIGINT / SIGTERM stop accepting connections, abort what is in flight and exit.

``--tp N`` (N > 1) runs the model on a ``(N // dcp, dcp)`` mesh of N devices
(``glmjax.sharding``); on a CPU the server asks JAX for N host devices. With ``--tp 1``,
``--dcp 2`` or ``4`` is emulated on one device (a KV block of ``block_size * dcp`` tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from pathlib import Path

import pydantic
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from glmjax.config import ModelConfig
from glmjax.random_weights import random_model
from glmjax.sharding import ShardingPlan, make_mesh, request_cpu_devices
from serving import api
from serving.async_engine import AsyncEngine, EngineDeadError, prometheus_text
from serving.engine import Engine, EngineConfig, FinishReason, RequestOutput
from serving.request import SamplingParams
from serving.tokenizer import Tokenizer, apply_chat_template, load_tokenizer

logger = logging.getLogger("serving.server")


class Handlers:
    """The endpoints' work: validate, submit to the engine, answer or stream."""

    def __init__(self, async_engine: AsyncEngine, tokenizer: Tokenizer, *, model_name: str):
        self.engine = async_engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = async_engine.engine.config.max_model_len
        self._shutting_down = False

    def shut_down(self) -> None:
        self._shutting_down = True
        self.engine.abort_all()

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "glmjax",
                    "max_model_len": self.max_model_len,
                }
            ],
        }

    def prometheus_text(self) -> str:
        return prometheus_text(self.engine)

    async def completions(self, request: Request):
        try:
            body = await self._parse(request, api.CompletionRequest)
            prompt = self._completion_prompt(body.prompt)
        except api.APIError as error:
            return error.response()
        return await self._generate(
            request,
            body,
            prompt,
            chat=False,
            top_logprobs=body.logprobs,
            max_tokens=body.max_tokens,
        )

    async def chat(self, request: Request):
        try:
            body = await self._parse(request, api.ChatRequest)
            text = apply_chat_template((m.role, m.text()) for m in body.messages)
            prompt = self.tokenizer.encode(text)
        except api.APIError as error:
            return error.response()
        max_tokens = body.max_completion_tokens or body.max_tokens
        return await self._generate(
            request,
            body,
            prompt,
            chat=True,
            top_logprobs=(body.top_logprobs or 0) if body.logprobs else None,
            max_tokens=max_tokens,
        )

    async def _parse(self, request: Request, model: type[pydantic.BaseModel]):
        if self._shutting_down:
            raise api.APIError(503, "the server is shutting down", code="shutting_down")
        try:
            data = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise api.APIError(
                400, f"the body is not valid JSON: {error}", code="invalid_json"
            ) from None
        if not isinstance(data, dict):
            raise api.APIError(400, "the body must be a JSON object", code="invalid_json")
        try:
            body = model.model_validate(data)
        except pydantic.ValidationError as error:
            first = error.errors()[0]
            param = ".".join(map(str, first["loc"])) or None
            raise api.APIError(
                400, f"{param}: {first['msg']}", param=param, code="invalid_value"
            ) from None
        if body.model is not None and body.model != self.model_name:
            raise api.APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return body

    def _completion_prompt(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise api.APIError(
                    400,
                    "batched prompts are not supported: send one prompt per request",
                    param="prompt",
                    code="unsupported_parameter",
                )
            prompt = prompt[0]
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise api.APIError(400, "the prompt is empty", param="prompt", code="empty_prompt")
        return ids

    def _sampling(self, body, prompt: list[int], max_tokens: int | None) -> SamplingParams:
        room = self.max_model_len - len(prompt)
        if room < 1:
            raise api.APIError(
                400,
                f"the prompt has {len(prompt)} tokens; this model's "
                f"maximum context length is {self.max_model_len} (prompt plus "
                "at least one generated token)",
                param="prompt",
                code="context_length_exceeded",
            )
        if max_tokens is None:
            max_tokens = room if isinstance(body, api.ChatRequest) else 16
        if max_tokens > room:
            raise api.APIError(
                400,
                f"max_tokens {max_tokens} plus the prompt's {len(prompt)} "
                f"tokens exceeds this model's maximum context length "
                f"{self.max_model_len}",
                param="max_tokens",
                code="context_length_exceeded",
            )
        top_k = body.top_k or 0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=0 if top_k < 0 else top_k,
            seed=body.seed,
            stop=body.stop_strings(),
            ignore_eos=body.ignore_eos,
        )

    async def _generate(
        self,
        request: Request,
        body,
        prompt: list[int],
        *,
        chat: bool,
        top_logprobs: int | None,
        max_tokens: int | None,
    ):
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            sampling = self._sampling(body, prompt, max_tokens)
            outputs = await self.engine.add_request(request_id, prompt, sampling)
        except api.APIError as error:
            return error.response()
        except ValueError as error:
            return api.APIError(400, str(error), code="invalid_value").response()
        except EngineDeadError as error:
            return api.APIError(503, str(error), code="engine_unavailable").response()
        generation = api.Generation(self.tokenizer, sampling.stop)
        job = _Job(
            self,
            request,
            request_id,
            outputs,
            generation,
            chat=chat,
            top_logprobs=top_logprobs,
            created=api.now(),
        )
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(job.stream(include_usage), media_type="text/event-stream")
        return await job.collect()


class _Job:
    """A submitted request, answered whole (``collect``) or as an event stream."""

    POLL_S = 0.5  # how often a non-streaming wait checks that the client is still there

    def __init__(
        self,
        handlers: Handlers,
        request: Request,
        request_id: str,
        outputs: asyncio.Queue,
        generation: api.Generation,
        *,
        chat: bool,
        top_logprobs: int | None,
        created: int,
    ):
        self.h, self.request, self.id, self.outputs = handlers, request, request_id, outputs
        self.gen, self.chat, self.top_logprobs, self.created = (
            generation,
            chat,
            top_logprobs,
            created,
        )
        self.finished = False

    def _logprobs(self, texts, logprobs, tops, text_offset):
        """None unless the request asked for logprobs (`top_logprobs` alternatives each)."""
        if self.top_logprobs is None:
            return None
        if self.chat:
            return api.chat_logprobs(texts, logprobs, tops, self.top_logprobs)
        return api.completion_logprobs(texts, logprobs, text_offset, tops, self.top_logprobs)

    def _envelope(self, choice, *, chunk, usage=None):
        return api.envelope(
            self.id,
            self.h.model_name,
            choice,
            chat=self.chat,
            chunk=chunk,
            created=self.created,
            usage_=usage,
        )

    async def _next(self) -> RequestOutput:
        item = await self.outputs.get()
        if isinstance(item, EngineDeadError):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    async def collect(self):
        clock = asyncio.get_running_loop().time
        check_at = clock() + self.POLL_S
        try:
            while True:
                try:
                    output = await asyncio.wait_for(self._next(), self.POLL_S)
                except TimeoutError:
                    output = None
                if output is not None and output.finished:
                    break
                if clock() >= check_at:
                    if await self.request.is_disconnected():
                        return None
                    check_at = clock() + self.POLL_S
        except EngineDeadError as error:
            return api.APIError(500, str(error), code="engine_failed").response()
        finally:
            if not self.finished:
                self.h.engine.abort(self.id)
        if output.finish_reason is FinishReason.ABORT:
            return api.APIError(
                503, "the request was aborted: the server is shutting down", code="aborted"
            ).response()
        text, texts, logprobs, tops = self.gen.advance(output)
        logprobs = self._logprobs(texts, logprobs, tops, 0)
        if self.chat:
            choice = api.chat_choice(text, api.finish_reason(output), logprobs, delta=False)
        else:
            choice = api.completion_choice(text, api.finish_reason(output), logprobs)
        usage = api.usage(
            output.num_prompt_tokens, len(output.output_token_ids), output.num_cached_tokens
        )
        return self._envelope(choice, chunk=False, usage=usage)

    async def stream(self, include_usage: bool):
        def event(body: dict) -> str:
            return f"data: {json.dumps(body)}\n\n"

        try:
            if self.chat:
                yield event(
                    self._envelope(
                        api.chat_choice("", None, None, delta=True, first=True), chunk=True
                    )
                )
            while not self.finished:
                try:
                    output = await self._next()
                except EngineDeadError as error:
                    yield event(api.APIError(500, str(error), code="engine_failed").body())
                    break
                if await self.request.is_disconnected():
                    return
                offset = len(self.gen.sent)
                text, texts, logprobs, tops = self.gen.advance(output)
                if not (text or texts or output.finished):
                    continue
                logprobs = self._logprobs(texts, logprobs, tops, offset)
                reason = api.finish_reason(output)
                if self.chat:
                    choice = api.chat_choice(text, reason, logprobs, delta=True)
                else:
                    choice = api.completion_choice(text, reason, logprobs)
                yield event(self._envelope(choice, chunk=True))
                if output.finished and include_usage:
                    usage = api.usage(
                        output.num_prompt_tokens,
                        len(output.output_token_ids),
                        output.num_cached_tokens,
                    )
                    yield event(self._envelope(None, chunk=True, usage=usage))
            yield "data: [DONE]\n\n"
        finally:
            if not self.finished:
                self.h.engine.abort(self.id)


def build_app(async_engine: AsyncEngine, tokenizer: Tokenizer, *, model_name: str) -> FastAPI:
    """The FastAPI app serving ``async_engine`` (started and stopped by the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        yield
        async_engine.stop()

    app = FastAPI(title="glmjax", lifespan=lifespan)
    handlers = Handlers(async_engine, tokenizer, model_name=model_name)
    app.state.handlers = handlers

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        return api.APIError(500, f"internal error: {error!r}", code="internal_error").response()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handlers.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handlers.chat(request)

    @app.get("/v1/models")
    async def models():
        return handlers.models()

    @app.get("/health")
    async def health():
        if async_engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(async_engine.error)}, 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(handlers.prometheus_text(), media_type="text/plain; version=0.0.4")

    return app


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


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m serving.server", description=__doc__.splitlines()[0]
    )
    p.add_argument("--preset", default="tiny", help="model config (glmjax.config.PRESETS)")
    p.add_argument(
        "--weights",
        type=Path,
        help="safetensors folder (with --family) or orbax checkpoint folder; "
        "default: random weights drawn from --seed",
    )
    p.add_argument("--family", choices=("kimi", "glm"), help="upstream naming of safetensors")
    p.add_argument("--tokenizer", help="tokenizer.json (or its folder); default: bytes")
    p.add_argument("--served-model-name", help="the model id clients name (default: preset)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel devices: a (tp // dcp, dcp) mesh"
    )
    p.add_argument(
        "--dcp",
        type=int,
        default=1,
        choices=(1, 2, 4),
        help="decode-context-parallel ranks, dividing --tp (with --tp 1: emulated on one device)",
    )
    p.add_argument(
        "--dcp-interleave",
        type=int,
        default=1,
        help="consecutive tokens per dcp rank in the MLA latent cache (divides --block-size)",
    )
    p.add_argument("--max-num-batched-tokens", type=int, default=8192, help="step budget B")
    p.add_argument("--block-size", type=int, default=512, help="KV block / prefix unit P")
    p.add_argument(
        "--no-prefill-coalescing",
        action="store_true",
        help="schedule the reference ladder instead of coalesced spans",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests per step")
    p.add_argument(
        "--num-kv-blocks", type=int, help="KV block ids (default: 8 requests of --max-model-len)"
    )
    p.add_argument(
        "--num-state-slots",
        type=int,
        default=64,
        help="KDA state slots: running requests plus retained states",
    )
    p.add_argument(
        "--single-bucket",
        action="store_true",
        help="pad every batch to the largest shape: one compile per entry point",
    )
    p.add_argument("--seed", type=int, default=0, help="random weights and request seeds")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def build_engine(args: argparse.Namespace) -> tuple[Engine, Tokenizer, str]:
    """The engine, tokenizer and served model name the arguments describe.

    Raises:
      ValueError: arguments the server cannot run (the message says which and why).
    """
    config = build_config(args)
    steps = None
    if args.tp != 1:
        try:
            mesh = make_mesh(args.tp, args.dcp)
            steps = ShardingPlan(config, mesh, interleave=args.dcp_interleave).steps()
        except ValueError as error:
            raise ValueError(f"--tp {args.tp} --dcp {args.dcp}: {error}") from None
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
    )
    model = load_model(args, config)
    engine = Engine(config, model, engine_config, detokenize=tokenizer.decode, steps=steps)
    return engine, tokenizer, args.served_model_name or args.preset


def build_config(args: argparse.Namespace) -> ModelConfig:
    """The preset, with one KV block per block id (``block_size * dcp`` tokens)."""
    config = ModelConfig.preset(args.preset)
    return dataclasses.replace(config, kv_block_size=args.block_size * args.dcp)


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


def warm_up(engine: Engine) -> None:
    """One short request before serving, so the first client does not wait on compiles
    of the smallest shapes (all of them with --single-bucket). It shows in /metrics."""
    start = time.perf_counter()
    engine.add_request("warm-up", [0], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.run_until_done()
    logger.info("warm-up (compiles) took %.1f s", time.perf_counter() - start)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.tp > 1:
        request_cpu_devices(args.tp)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        engine, tokenizer, model_name = build_engine(args)
    except ValueError as error:
        raise SystemExit(f"error: {error}") from None
    log_features(engine, tokenizer)
    warm_up(engine)
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, tokenizer, model_name=model_name)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    _Server(config, app.state.handlers).run()
    logger.info("server stopped")


if __name__ == "__main__":
    main()
