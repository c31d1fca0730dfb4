"""vlserve as a backend of NVIDIA Dynamo: an `LLMEngine` of Dynamo's Python backend SDK around our `AsyncLLM`.

Dynamo's `Worker` (Rust) registers the model card (the checkpoint folder: tokenizer and chat template, which its
frontend uses), serves the `generate` endpoint and calls `generate` per request with the frontend's token ids;
pictures come as URLs beside one placeholder token each, which our prompt encoder fetches (under the media
policy flags), decodes and expands. Tokens stream back as they come; Dynamo's frontend detokenizes them.
KV events reach Dynamo's router through `KVEventRelay`; load through its snapshot publisher.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from dynamo.common.backend import EngineConfig, LLMEngine, WorkerConfig
from dynamo.common.backend.engine import LlmRegistration
from dynamo.common.backend.health_check import build_health_check_payload
from dynamo.common.backend.publisher import ComponentSnapshot, PushSource
from dynamo.common.utils.token_ids import normalize_request_token_ids
from dynamo.llm.exceptions import EngineShutdown, InvalidArgument, Unknown, WorkerUnavailable

from vlserve.core.config import LANGUAGE, SERVE, Options
from vlserve.core.errors import (ConfigurationError, EngineDeadError, InvalidInputError, ServiceUnavailableError,
                                 VlserveError)
from vlserve.core.private_dirs import PrivateDir
from vlserve.dynamo.flags import FromFlags, worker_setup
from vlserve.dynamo.kv_relay import KVEventRelay, routing_tokens
from vlserve.dynamo.request import ENCODER_RESULT_KEY, dynamo_prompt

logger = logging.getLogger("vlserve.dynamo")

SNAPSHOT_INTERVAL_S = 0.25  # how often the router's load view (used KV blocks) is refreshed
RELAY_BLOCKS_PER_POOL_BLOCK = 4  # blocks whose routing tokens are kept, per block of the engine's pool


class ClientGone(Exception):
    """Dynamo cancelled the request (its client left, or it stopped it): the stream ends as cancelled."""


def dynamo_error(error: Exception) -> Exception:
    """Ours as Dynamo's typed errors (its frontend maps them to HTTP statuses)."""
    if isinstance(error, InvalidInputError):
        return InvalidArgument(str(error))
    if isinstance(error, EngineDeadError):
        return EngineShutdown(str(error))
    if isinstance(error, ServiceUnavailableError):  # overloaded or stopping: another worker may take it
        return WorkerUnavailable(str(error))
    return Unknown(str(error))


class VlserveEngine(FromFlags, LLMEngine):
    def __init__(self, opts: Options, worker: WorkerConfig, log_level: str = "INFO", role: str = SERVE):
        """`role`: SERVE (media handled here) or LANGUAGE (media go to vlserve encoders found in the registry;
        with `worker.route_to_encoder`, first to the one Dynamo's encode step names)."""
        from vlserve.server.api_server import make_engine

        self.opts = opts
        self._events_dir: PrivateDir | None = None
        if opts.engine.enable_prefix_caching and worker.enable_kv_routing:
            # The engine's KV events, for the relay only (Dynamo's router never reads them): a socket in a folder
            # of this process's own, no port to race for.
            self._events_dir = PrivateDir("vlserve-dynamo-")
            opts.engine = dataclasses.replace(
                opts.engine, kv_events_endpoint=f"ipc://{os.path.join(self._events_dir.path, 'kv-events')}")
        self.role = role
        if self.role == LANGUAGE:  # its registry entry names Dynamo's system port (health, metrics), if any
            opts.server = dataclasses.replace(opts.server, port=int(os.environ.get("DYN_SYSTEM_PORT") or 0))
        self.engine = make_engine(opts, log_level, self.role)  # config and tokenizer now; the engine process later
        self.model_path = str(self.engine.cfg.model_path)
        self.served_name = opts.server.served_model_name or opts.engine.model
        worker.model_name, worker.served_model_name = self.model_path, self.served_name
        self.worker = worker
        self.relay: KVEventRelay | None = None
        self._snapshots: Any = None
        self._snapshot_task: asyncio.Task | None = None
        self._started = False
        # Dynamo's request id -> our engine request (None while it is being prepared); an abort that comes
        # before the request reached the engine is remembered in `_cancelled`.
        self._live: dict[str, Any] = {}
        self._cancelled: set[str] = set()

    # ---- lifecycle ---------------------------------------------------------------------------------------
    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, log_level: str = "INFO"):
        opts, worker, role = worker_setup(ns)
        if ns.disaggregation_mode != "agg":
            raise ConfigurationError(f"--disaggregation-mode {ns.disaggregation_mode} is served by another engine "
                                     "class: start it with `vlserve dynamo-worker`")
        worker.route_to_encoder = ns.route_to_encoder
        return cls(opts, worker, log_level, role), worker

    async def start(self, worker_id: int) -> EngineConfig:
        await self.engine.start()
        self._started = True
        cfg, args = self.engine.cfg, self.opts.engine
        if args.kv_events_endpoint is not None:
            self.relay = KVEventRelay(args.kv_events_endpoint, args.block_size,
                                      RELAY_BLOCKS_PER_POOL_BLOCK * max(self.engine.num_kv_blocks, 1))
        self._snapshot_task = asyncio.get_running_loop().create_task(self._publish_load())
        logger.info("vlserve worker %s ready for Dynamo: %s as %r, %d KV blocks of %d tokens", worker_id,
                    self.model_path, self.served_name, self.engine.num_kv_blocks, args.block_size)
        return EngineConfig(model=self.model_path, served_model_name=self.served_name,
                            llm=LlmRegistration(context_length=cfg.max_model_len, kv_cache_block_size=args.block_size,
                                                total_kv_blocks=self.engine.num_kv_blocks,
                                                max_num_seqs=cfg.max_num_seqs,
                                                max_num_batched_tokens=args.max_num_batched_tokens))

    async def cleanup(self) -> None:
        """Null-safe and idempotent; each step runs whatever the one before it raised."""
        if self._snapshot_task is not None:
            self._snapshot_task.cancel()
            self._snapshot_task = None
        try:
            if self.relay is not None:
                relay, self.relay = self.relay, None
                await asyncio.get_running_loop().run_in_executor(None, relay.stop)
        finally:
            try:
                if self._started:
                    self._started = False
                    await self.engine.shutdown()
            finally:
                if self._events_dir is not None:
                    self._events_dir.remove()
                    self._events_dir = None

    async def kv_event_sources(self) -> list:
        if self.relay is None:
            return []
        return [PushSource(on_ready=self.relay.start, dp_rank=0)]

    async def register_prometheus(self, metrics: Any) -> None:
        """vlserve's own metrics (the server's /metrics: prefix-cache hits, TTFT, encoder time ...) on the worker's
        /metrics (Dynamo's system port, DYN_SYSTEM_PORT), labelled by Dynamo."""
        from dynamo.common.backend.metrics import register_engine_registry

        register_engine_registry(metrics, self.engine.metrics.registry)

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self._snapshots = publisher

    async def health_check_payload(self) -> dict[str, Any] | None:
        tok = self.engine.tokenizer
        bos = getattr(tok, "bos_token_id", None)
        return build_health_check_payload(bos_token_id=bos if isinstance(bos, int) else 0)

    async def _publish_load(self) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
            if self._snapshots is None:
                continue
            stats, total = self.engine.stats, self.engine.num_kv_blocks
            queries = stats.prefix_cache_queries_total
            try:
                self._snapshots.publish(0, ComponentSnapshot(
                    kv_used_blocks=round(stats.kv_cache_usage_perc * total), kv_total_blocks=total,
                    gpu_cache_usage=stats.kv_cache_usage_perc, dp_rank=0,
                    kv_cache_hit_rate=stats.prefix_cache_hits_total / queries if queries else None))
            except Exception:
                logger.exception("the load snapshot could not be published")

    # ---- requests ----------------------------------------------------------------------------------------
    async def abort(self, context) -> None:
        key = context.id()
        if key not in self._live:
            return
        handle = self._live[key]
        if handle is None:
            self._cancelled.add(key)  # still being prepared: never sent
            return
        handle.close()  # out of the engine; its stream is woken to end the generator
        handle.stream.fail(ClientGone("cancelled"))

    async def generate(self, request: dict, context) -> AsyncGenerator[dict, None]:
        key, rid = context.id(), f"dyn-{uuid.uuid4().hex}"  # ours is unique even if Dynamo retries an id here
        if key in self._live:  # (a retry racing the first try's end here: another worker may take it now)
            raise WorkerUnavailable(f"request {key} is still running on this worker")
        self._live[key] = None
        handle = None
        try:
            try:
                handle, params, prompt_tokens = await self._submit(normalize_request_token_ids(request), rid)
            except VlserveError as e:
                raise dynamo_error(e) from None
            if key in self._cancelled or context.is_stopped() or context.is_killed():
                yield _cancelled(prompt_tokens)
                return
            self._live[key] = handle
            async for chunk in self._stream(handle, params, prompt_tokens):
                yield chunk
        except ClientGone:
            yield _cancelled(prompt_tokens)
        finally:
            self._live.pop(key, None)
            self._cancelled.discard(key)
            if handle is not None:
                handle.close()  # aborts it in the engine unless it finished

    def _check_same_tokens(self, prompt, frontend_ids: list[int]) -> None:
        """The encoder's tokens of the frontend's text are the frontend's own, or the request is refused (a
        tokenizer or template that differs between them would otherwise answer another prompt)."""
        placeholders = self._placeholders()
        if _collapsed(prompt.prompt_token_ids, placeholders) != _collapsed(frontend_ids, placeholders):
            raise InvalidInputError("the encoder's tokens of extra_args.formatted_prompt differ from token_ids: "
                                    "the frontend and the workers must use the same checkpoint's tokenizer")

    def _placeholders(self) -> set[int]:
        m = self.engine.cfg.model
        return {t for t in (m.image_token_id, m.video_token_id, m.audio_token_id) if t is not None}

    async def _stream(self, handle, params, prompt_tokens: int) -> AsyncGenerator[dict, None]:
        sent = 0
        try:
            async for out in handle:
                done = out.outputs[0]
                chunk: dict[str, Any] = {"token_ids": done.token_ids[sent:], "index": 0}
                if params.logprobs is not None and done.logprobs:
                    chunk.update(_logprobs(done, sent))
                sent = len(done.token_ids)
                if done.finish_reason is not None:
                    chunk["finish_reason"] = done.finish_reason
                    chunk["completion_usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                                                 "total_tokens": prompt_tokens + sent}
                    yield chunk
                    return
                if chunk["token_ids"]:
                    yield chunk
            raise ClientGone("aborted")  # the handle ended unfinished: `abort` closed it
        except ClientGone:
            raise
        except VlserveError as e:
            raise dynamo_error(e) from None

    async def _submit(self, request: dict, rid: str):
        engine, server = self.engine, self.opts.server
        encoder = None
        if self.worker.route_to_encoder:  # the encoder Dynamo's encode step used (it holds the items now)
            result = request.pop("encoder_result", None) or {}
            encoder = result.get(ENCODER_RESULT_KEY) if isinstance(result, dict) else None
            if encoder is not None and not isinstance(encoder, str):
                raise InvalidInputError(f"encoder_result.{ENCODER_RESULT_KEY} must be an encoder's instance id")
        asked = dynamo_prompt(request, set(engine.cfg.model.eos_token_ids))
        params = asked.params
        stops = [params.stop] if isinstance(params.stop, str) else params.stop or []
        if len(stops) > server.max_stop_strings or len(params.stop_token_ids or []) > server.max_stop_strings:
            raise InvalidInputError(f"at most {server.max_stop_strings} stop strings and stop token ids each "
                                    "(--max-stop-strings)")
        if any(len(s) > server.max_stop_string_chars for s in stops):
            raise InvalidInputError(f"a stop string may be at most {server.max_stop_string_chars} characters long "
                                    "(--max-stop-string-chars)")
        if params.structured_outputs is not None:
            await engine.grammar_compiler.check(params.structured_outputs)
        remote = self.role == LANGUAGE and "multi_modal_data" in asked.prompt
        if remote:  # an encoder tokenizes the text itself (placeholders expanded there): the frontend's text
            if asked.text is None:
                raise InvalidInputError("extra_args.formatted_prompt is missing: the encoders need the prompt's text")
            asked.prompt["prompt"] = asked.text
        prepared = await engine.prepare(asked.prompt, asked.mm_processor_kwargs, request_id=rid, params=params,
                                        peer=encoder)
        with prepared:  # closed here unless handed to the engine
            loop = asyncio.get_running_loop()
            if remote:  # (off the event loop: it grows with the prompt)
                await loop.run_in_executor(engine.executor, self._check_same_tokens, prepared.prompt,
                                           asked.prompt["prompt_token_ids"])
            room = engine.cfg.max_model_len - prepared.num_tokens
            max_tokens = asked.max_tokens if asked.max_tokens is not None else room
            if max_tokens > room or room < 1:
                raise InvalidInputError(f"this model's maximum context length is {engine.cfg.max_model_len} tokens; "
                                        f"the prompt has {prepared.num_tokens} tokens and max_tokens is "
                                        f"{max_tokens}: reduce one of them")
            params = msgspec.structs.replace(params, max_tokens=max_tokens)
            if params.logprobs is not None and max_tokens * (params.logprobs + 1) > server.max_logprob_entries:
                raise InvalidInputError(f"max_tokens {max_tokens} x {params.logprobs + 1} log-probabilities per "
                                        f"token is over the {server.max_logprob_entries} one request may ask for "
                                        "(--max-logprob-entries)")
            if self.relay is not None:
                prompt, placeholders = prepared.prompt, self._placeholders()
                await loop.run_in_executor(
                    engine.executor, lambda: self.relay.remember(
                        prompt.prompt_token_ids, prompt.mm_items,
                        routing_tokens(prompt.prompt_token_ids, prompt.mm_items, asked.mm_hashes, placeholders)))
            handle = engine.generate(prepared, params, rid)
        return handle, params, prepared.num_tokens


def _collapsed(ids, placeholders: set[int]) -> list[int]:
    """Token ids with each run of placeholder tokens as one (the frontend's form: one per item)."""
    out: list[int] = []
    for t in ids:
        if not (t in placeholders and out and out[-1] == t):
            out.append(t)
    return out


def _cancelled(prompt_tokens: int) -> dict:
    return {"token_ids": [], "index": 0, "finish_reason": "cancelled",
            "completion_usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 0, "total_tokens": prompt_tokens}}


def _logprobs(done, sent: int) -> dict:
    """Dynamo's wire form of the new tokens' logprobs (only the new part: no work that grows per chunk)."""
    log_probs, top = [], []
    for token, alternatives in zip(done.token_ids[sent:], done.logprobs[sent:]):
        chosen = alternatives.get(token)
        log_probs.append(chosen.logprob if chosen is not None else float("-inf"))
        top.append([{"rank": lp.rank, "token_id": t, "token": lp.decoded_token, "logprob": lp.logprob}
                    for t, lp in sorted(alternatives.items(), key=lambda kv: -kv[1].logprob)])
    return {"log_probs": log_probs, "top_logprobs": top}
