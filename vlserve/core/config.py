"""Every user-settable option, defined once: the Python API, the CLI flags of every role and the command lines
that `serve --disagg` builds for its children all come from these three dataclasses.

Each field says which roles honour it (`roles`); a role's parser registers exactly those flags, so a flag can
never reach one role and silently miss another. Nothing here imports torch: `--help` stays fast.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from vlserve.core.errors import InvalidInputError

# Roles: processes a user starts. "serve" is the aggregated server (and the `--disagg` launcher), "language" and
# "encode" the two halves of an E->PD deployment, "prefill" and "decode" the language half split in two (E->P->D),
# "bootstrap" their registry, "demo" offline generation, "router" the cache-aware front of several replicas.
SERVE, LANGUAGE, ENCODE, BOOTSTRAP, DEMO = "serve", "language", "encode", "bootstrap", "demo"
PREFILL, DECODE, ROUTER = "prefill", "decode", "router"
ROLES = (SERVE, LANGUAGE, ENCODE, PREFILL, DECODE, BOOTSTRAP, DEMO, ROUTER)
LM_ROLES = frozenset({SERVE, LANGUAGE, PREFILL, DECODE, DEMO})  # roles that run the language model
VISION_ROLES = frozenset({SERVE, ENCODE, DEMO})  # roles that run the vision tower
HTTP_ROLES = frozenset({SERVE, LANGUAGE, DECODE, ROUTER})  # roles that answer the OpenAI API
ENGINE_HTTP_ROLES = HTTP_ROLES - {ROUTER}  # ... with an engine behind them
DISAGG_ROLES = frozenset({LANGUAGE, ENCODE, PREFILL, DECODE})  # roles that meet through the registry
REGISTRY_ROLES = DISAGG_ROLES | {ROUTER}  # roles that read the registry (a router finds replicas there)
MODEL_ROLES = frozenset({SERVE, DEMO}) | DISAGG_ROLES  # roles that load (part of) the model
MEDIA_ROLES = frozenset({SERVE, ENCODE, ROUTER})  # roles that fetch and decode media (a router: to hash it)
KV_ROLES = frozenset({PREFILL, DECODE})  # roles whose engine moves KV between instances (a KV connector)
# roles that apply LoRA adapters (an encoder the towers' part, the others the language model's), each serving only
# those it was started with (a peer names one by name and content, never by path); those loading them at runtime:
# the API servers
LORA_ROLES = frozenset({SERVE, DEMO, LANGUAGE, ENCODE, PREFILL, DECODE})
LORA_API_ROLES = frozenset({SERVE, LANGUAGE, DECODE})
# A worker behind NVIDIA Dynamo's frontend (`vlserve dynamo-worker`): the aggregated server's engine and media
# options, or a language server's with encoders found through the registry (E->PD), none of the HTTP server's
# (Dynamo's frontend answers HTTP and renders the chat template), nor LoRA (a request's model is not routed to
# adapters there yet), nor the KV events socket (the worker binds its own), nor the prefill/decode split's.
DYNAMO = "dynamo"
DERIVED_ROLES = {DYNAMO: ((SERVE, LANGUAGE), frozenset({
    "kv_events_endpoint", "enable_lora", "lora_modules", "max_loras", "max_lora_rank", "max_cpu_loras",
    "max_cpu_lora_memory_gb", "port", "api_key", "max_request_bytes", "max_n", "header_read_timeout",
    "body_read_timeout", "shutdown_timeout", "trust_request_chat_template", "enable_api_docs",
    "allow_runtime_lora", "lora_dir", "playground", "allowed_hosts", "disagg", "num_encoders", "num_prefill",
    "num_decode", "prefill_tensor_parallel_size", "decode_tensor_parallel_size", "disagg_base_port",
    "kv_buffer_blocks", "kv_send_by_layer", "kv_allocate_tokens", "enable_mm_embeds"}))}
# role -> (the roles whose options it takes, the first giving their defaults; those it leaves out)  # role -> (the role whose options it takes, those it leaves)
DEFAULT_MAX_CPU_LORAS = 8  # at least; twice --max-loras when that is more
# Kinds a user does not name keep these. Audio: 4 clips of at most --max-audio-seconds (30 s) each, 3000 audio
# tokens at 25 a second, less than one large picture may take.
DEFAULT_MM_LIMITS = {"image": 8, "video": 1, "audio": 4}
DEFAULT_MAX_AUDIO_SECONDS = 30.0
DEFAULT_MAX_PIXELS_DECODED = 64_000_000  # 64 MP
# A model's media towers and the kinds each encodes (a video heard with its sound needs both).
TOWER_MODALITIES = {"vision": ("image", "video"), "audio": ("audio",)}
TOWERS = tuple(TOWER_MODALITIES)


# Ranges of numeric options (inclusive; None: unbounded). Every number is also finite; an option without bounds
# is >= 0. Checked when a role starts (core/options.py): exit 78 naming the flag.
COUNT = (1, None)  # how many of something: at least one
SECONDS = (0.001, 30 * 86400)  # a timeout or interval: positive, at most 30 days
PORT = (0, 65535)  # 0: any free port
SHARE = (0.0, 1.0)
ANY = (None, None)


def option(default: Any = None, help: str = "", roles=frozenset(), *, factory=None, flag: str | None = None,
           parse=None, env: str | None = None, secret: bool = False, nargs: str | None = None,
           choices: tuple | None = None, negate: bool = False, role_defaults: dict | None = None,
           metavar: str | None = None, aliases: tuple[str, ...] = (), bounds: tuple | None = None) -> Any:
    """A dataclass field that is also a CLI flag of `roles`.

    `flag` overrides the flag name; `negate` makes a True-by-default bool a `--disable-...` switch; `parse`
    turns the flag's text into the value; `env` names an environment variable used when the flag is absent;
    `secret` values never go on a command line (children get them through the environment); `role_defaults`
    gives some roles another default (an encoder listens on 8100, not 8000); `aliases` are further flags for the
    same option (an old name kept working); `bounds` (lo, hi) is a numeric option's range (default: >= 0).
    """
    meta = {"help": help, "roles": frozenset(roles), "flag": flag, "parse": parse, "env": env, "secret": secret,
            "nargs": nargs, "choices": choices, "negate": negate, "role_defaults": role_defaults or {},
            "metavar": metavar, "aliases": tuple(aliases), "bounds": bounds}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def parse_limits(text: str) -> dict[str, int]:
    """`image=8,video=1,audio=2` -> {"image": 8, "video": 1, "audio": 2}."""
    limits = {}
    for part in filter(None, text.split(",")):
        kind, _, value = part.partition("=")
        if not value.strip().isdigit():
            raise ValueError(f"expected kind=N pairs like image=8,video=1,audio=2, got '{part}'")
        if kind.strip() not in DEFAULT_MM_LIMITS:
            raise ValueError(f"unknown media kind '{kind.strip()}' in '{part}'; the kinds are "
                             f"{', '.join(DEFAULT_MM_LIMITS)}")
        limits[kind.strip()] = int(value)
    return limits


@dataclass
class EngineArgs:
    """The engine's options: `LLM(model, **engine_args)` takes these names, the CLI the same with dashes."""

    model: str = option(None, "model folder or Hugging Face hub id (a router reads its tokenizer and processor "
                        "config only)", MODEL_ROLES | {ROUTER})
    dtype: str = option("auto", "weights/activations dtype: auto (the checkpoint's where this device computes it "
                        "natively, else float32), float32, bfloat16, float16", MODEL_ROLES,
                        choices=("auto", "float32", "bfloat16", "float16"))
    quantization: str | None = option(
        None, "quantization: int8 (made at load time from a full-precision checkpoint, decoder linears and LM "
        "head; on CPU with vlserve's kernels built a decode step also quantizes its activations per 32 values "
        "for int8 dot products (AVX2, AVX-512 VNNI), a prefill per row where int8 GEMMs are fast; "
        "VLSERVE_INT8_ACTIVATIONS=0 keeps them in the dtype); awq and gptq 4-bit checkpoints are detected from "
        "their quantization_config", LM_ROLES,
        choices=("int8", "awq", "gptq"))
    device: str = option("auto", "auto (cuda when available, else cpu), cpu, cuda, cuda:1, ...",
                         MODEL_ROLES)
    max_model_len: int | None = option(None, "longest prompt + output in tokens (default: the model's, at most "
                                       "32768)", LM_ROLES, bounds=COUNT)
    max_num_seqs: int = option(128, "most requests running at once", LM_ROLES, bounds=COUNT)
    max_num_batched_tokens: int = option(2048, "token budget of one engine step (prefill chunks + decode tokens)",
                                         LM_ROLES, bounds=COUNT)
    block_size: int = option(16, "tokens per KV cache block (a router: the replicas')", LM_ROLES | {ROUTER},
                             bounds=COUNT)
    kv_cache_memory_gb: float | None = option(
        None, "KV cache size in GiB (default: as large as the weights, at least 0.25, at most half the free memory, "
        "never more than max_num_seqs x max_model_len need)", LM_ROLES)
    num_kv_blocks: int | None = option(None, "KV cache size in blocks (overrides --kv-cache-memory-gb)", LM_ROLES,
                                       bounds=COUNT)
    enable_prefix_caching: bool = option(True, "turn off automatic prefix caching", LM_ROLES,
                                         flag="--disable-prefix-caching", negate=True)
    max_state_snapshots: int = option(
        32, "hybrid models (Qwen3.5): linear-attention state snapshots kept for prefix caching (least recently used "
        "evicted; each as large as one sequence's state, taken from the KV cache memory; 0: a prefix hit always "
        "recomputes from token 0)", LM_ROLES)
    kv_events_endpoint: str | None = option(
        None, "publish KV cache events (prefix-cache blocks stored and evicted, by block hash) on a ZeroMQ PUB "
        "socket bound here, for cache-aware routers: tcp://HOST:PORT (default: off)", {SERVE, LANGUAGE, DECODE},
        metavar="tcp://HOST:PORT")
    encoder_cache_size: int | None = option(
        None, "encoder cache capacity in embedding rows: a media token takes one, 1 + levels with DeepStack "
        "features (Qwen3-VL) (0: no reuse across requests; default: 16384, or more when the largest media item "
        "the media bounds allow needs more)", VISION_ROLES)
    max_num_encoder_input_tokens: int | None = option(
        None, "most embedding tokens the encoder runs in one step, also the largest item accepted (default: 16384, "
        "or the largest media item the media bounds allow when that is more)", VISION_ROLES)
    disable_chunked_mm_input: bool = option(False, "never split a picture's tokens across engine steps", LM_ROLES)
    limit_mm_per_prompt: dict[str, int] = option(
        help="most media items per prompt, e.g. image=8,video=1,audio=4", roles=MODEL_ROLES | {ROUTER},
        factory=lambda: dict(DEFAULT_MM_LIMITS), parse=parse_limits, metavar="KIND=N,...")
    max_video_frames: int = option(32, "most frames sampled from one video (a request may ask for fewer)",
                                   VISION_ROLES, bounds=COUNT)
    enable_mm_embeds: bool = option(False, "accept precomputed image embeddings (image_embeds parts)",
                                    {SERVE, LANGUAGE, DECODE, DEMO})
    seed: int = option(0, "engine seed", LM_ROLES, bounds=ANY)
    enforce_eager: bool = option(False, "no CUDA graphs: decode steps and the vision tower run op by op (also "
                                 "set by the environment variable VLSERVE_ENFORCE_EAGER=1)", MODEL_ROLES)
    async_scheduling: bool = option(
        True, "schedule the next step and prepare its inputs while the device runs this one (CUDA, one rank, "
        "no KV connector; steps with structured outputs, penalties or min_tokens still to reach wait for their "
        "tokens): turn it off", LM_ROLES, flag="--no-async-scheduling", negate=True)
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) of this model: on the language model and "
                               "on the media towers and projectors", LORA_ROLES)
    lora_modules: tuple[str, ...] = option(
        (), "adapters served from the start, as NAME=PATH (a folder with adapter_config.json and "
        "adapter_model.safetensors); a request picks one with \"model\": NAME. Disaggregated, every role applying "
        "adapters takes the same list: encoders and prefill instances apply only adapters listed here",
        LORA_ROLES - {DEMO}, nargs="+", metavar="NAME=PATH")
    max_loras: int = option(1, "most adapters one engine step runs (each one a slot on the device)", LORA_ROLES,
                            bounds=(1, 64))
    max_lora_rank: int = option(16, "highest LoRA rank an adapter may have", LORA_ROLES, bounds=(1, 512))
    max_cpu_loras: int | None = option(
        None, f"adapters kept read in host memory, so requests taking turns between them do not read them again "
        f"(default: twice max_loras, at least {DEFAULT_MAX_CPU_LORAS}; at least max_loras)", LORA_ROLES,
        bounds=(1, 4096))
    max_cpu_lora_memory_gb: float = option(
        4.0, "host memory those adapters may take, in GiB (the least recently used go first; an adapter larger "
        "than this alone is refused)", LORA_ROLES, bounds=(0.001, 1024.0))
    cuda_graph_sizes: tuple[int, ...] | None = option(
        None, "decode batch sizes captured as CUDA graphs; a step of b decode rows replays the smallest size >= b, "
        "padded (default on CUDA: 1, 2, 4, 8, then every multiple of 8 up to min(max_num_seqs, 256); on a CPU "
        "none, since a CPU has no launch cost to save: sizes given there run the same padded path without "
        "capture)", LM_ROLES, nargs="+", parse=int, metavar="N")
    tensor_parallel_size: int = option(
        1, "split the language model (and, with --mm-encoder-tp-mode weights, the vision tower) over this many "
        "ranks: one process each, cores split between them on CPU; several machines: start every rank with "
        "torchrun", {SERVE, LANGUAGE, ENCODE, PREFILL, DECODE, DEMO}, bounds=COUNT)
    cpu_threads: int | None = option(
        None, "CPU threads of this process's model work: torch's threads (a tensor-parallel rank gets its share) and "
        "the most media threads by default; overrides OMP_NUM_THREADS (default: the CPUs this process may use, the "
        "smaller of its affinity mask and the cgroup CPU quota; an explicit OMP_NUM_THREADS sets torch's)",
        MODEL_ROLES, bounds=COUNT, metavar="N")
    mm_encoder_tp_mode: str = option(
        "weights", "vision tower under tensor parallelism: weights (split like the LM) or data (whole on every "
        "rank, each encodes a share of the pictures)", {SERVE, ENCODE, DEMO}, choices=("weights", "data"))
    # Structured outputs: what one constraint may cost, checked before anything compiles it.
    structured_outputs_max_rules: int = option(
        4096, "most rules (and terminals) in a structured_outputs grammar, Lark or GBNF", LM_ROLES)
    structured_outputs_max_choices: int = option(16384, "most strings in structured_outputs.choice", LM_ROLES)
    structured_outputs_max_min_length: int = option(
        16384, "longest text any part of a constraint may force, in characters: a literal, a choice, a minimum "
        "repetition (a{n}, minLength, minItems) times what it repeats", LM_ROLES)
    structured_outputs_compile_timeout: float = option(
        10.0, "seconds one schema, regex or grammar may take to compile; 400 after that", LM_ROLES, bounds=SECONDS)
    structured_outputs_threads: int = option(
        2, "threads compiling constraints (apart from the media threads), in the front end and in the engine",
        LM_ROLES, bounds=COUNT)
    structured_outputs_max_queued: int = option(
        16, "constraints that may wait for a compile thread; more get 503 at once", LM_ROLES)
    structured_outputs_cache_mb: int = option(
        512, "memory for compiled constraints kept for reuse (an LRU, sized by estimate), in MiB", LM_ROLES)
    towers: tuple[str, ...] | None = option(
        None, "the media towers this encoder loads and serves: vision (pictures and videos), audio, or both; it "
        "announces only their media kinds, so language servers send it only prompts it can encode, and refuses "
        "others (default: every tower the model has)", {ENCODE}, nargs="+", choices=TOWERS)
    load_vision: bool = True  # False on a disaggregated language server: set by the role, not a flag
    load_language: bool = True  # False on an encode service (the vision tower only): set by the role

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def mm_limits(self) -> dict[str, int]:
        """Media items per prompt by kind: the user's limits over the defaults."""
        return {**DEFAULT_MM_LIMITS, **self.limit_mm_per_prompt}

    def lora_host_bytes(self) -> int:
        """The host memory LoRA adapters' weights may take (max_cpu_lora_memory_gb), in bytes."""
        return int(self.max_cpu_lora_memory_gb * 2**30)

    def check(self) -> None:
        """Refuses values no engine can run with (the front end before it starts the engine, the engine again)."""
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "num_kv_blocks",
                     "kv_cache_memory_gb", "max_video_frames", "cpu_threads"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not value > 0):
                raise InvalidInputError(f"{name} must be positive, got {value}")
        if self.cpu_threads is not None and not isinstance(self.cpu_threads, int):
            raise InvalidInputError(f"cpu_threads must be a positive integer, got {self.cpu_threads!r}")
        if isinstance(self.max_state_snapshots, bool) or not isinstance(self.max_state_snapshots, int) \
                or self.max_state_snapshots < 0:
            raise InvalidInputError(f"max_state_snapshots must be an integer >= 0, got {self.max_state_snapshots!r}")
        if self.cuda_graph_sizes is not None and (
                isinstance(self.cuda_graph_sizes, (str, int)) or
                not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in self.cuda_graph_sizes)):
            raise InvalidInputError(f"cuda_graph_sizes takes positive batch sizes, got {self.cuda_graph_sizes!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise InvalidInputError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras "
                                    f"({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise InvalidInputError("lora_modules needs enable_lora")
        if (self.encoder_cache_size is not None and self.encoder_cache_size < 0) or (
                self.max_num_encoder_input_tokens is not None and self.max_num_encoder_input_tokens <= 0):
            raise InvalidInputError("encoder_cache_size must be >= 0 and max_num_encoder_input_tokens > 0")
        for kind, limit in self.limit_mm_per_prompt.items():
            if kind not in DEFAULT_MM_LIMITS or isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise InvalidInputError(f"limit_mm_per_prompt takes {', '.join(DEFAULT_MM_LIMITS)} with counts >= 0, "
                                        f"got {kind!r}: {limit!r}")
        if self.towers is not None and (isinstance(self.towers, str) or not self.towers
                                        or not set(self.towers) <= set(TOWERS)):
            raise InvalidInputError(f"towers takes one or more of {', '.join(TOWERS)}, got {self.towers!r}")
        if self.kv_events_endpoint is not None and not self.kv_events_endpoint.startswith("ipc:///"):
            # (ipc:///PATH: a local subscriber only, as a Dynamo worker's relay; not advertised)
            host, _, port = self.kv_events_endpoint.removeprefix("tcp://").rpartition(":")
            if not self.kv_events_endpoint.startswith("tcp://") or not host or not (port.isdigit() or port == "*"):
                raise InvalidInputError("kv_events_endpoint takes tcp://HOST:PORT (PORT * picks a free one), got "
                                        f"{self.kv_events_endpoint!r}")
        if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
            raise InvalidInputError("kv_events_endpoint publishes the prefix cache's events: it needs prefix caching")
        if self.model is None:
            raise InvalidInputError("no model given")


@dataclass
class ServerArgs:
    """HTTP front-end and media options."""

    host: str = option("127.0.0.1", "address to listen on", {SERVE, BOOTSTRAP} | REGISTRY_ROLES)
    port: int = option(8000, "HTTP port", {SERVE, BOOTSTRAP} | REGISTRY_ROLES,
                       role_defaults={ENCODE: 8100, PREFILL: 8200, BOOTSTRAP: 8998, ROUTER: 8080}, bounds=PORT)
    served_model_name: str | None = option(None, "model name in the API (default: --model)", HTTP_ROLES)
    api_key: str | None = option(None, "require 'Authorization: Bearer KEY' on /v1 routes", HTTP_ROLES,
                                 env="VLSERVE_API_KEY", secret=True)
    allowed_local_media_path: Path | None = option(None, "directory file:// media URLs may read from (file:// is "
                                                   "refused without it)", MEDIA_ROLES, parse=Path,
                                                   metavar="DIR")
    allowed_media_domains: tuple[str, ...] = option((), "only fetch media from these domains and their subdomains "
                                                    "(default: any public host)", MEDIA_ROLES, nargs="+")
    allow_private_media_urls: bool = option(False, "allow media URLs resolving to private, loopback or link-local "
                                            "addresses (SSRF risk)", MEDIA_ROLES)
    max_media_bytes: int = option(20 * 2**20, "largest picture or audio clip in bytes (download, data URL or file)",
                                  MEDIA_ROLES, bounds=COUNT)
    max_video_bytes: int = option(200 * 2**20, "largest video in bytes (download, data URL or file)", MEDIA_ROLES,
                                  bounds=COUNT)
    media_fetch_timeout: float = option(10.0, "seconds per media download", MEDIA_ROLES, bounds=SECONDS)
    max_image_pixels: int = option(DEFAULT_MAX_PIXELS_DECODED, "largest picture or video frame in pixels (width x "
                                   "height): a larger one is refused before decoding, and pictures are resized for "
                                   "the encoder to at most this many (under the model's own max_pixels)",
                                   MEDIA_ROLES, bounds=COUNT)
    max_audio_seconds: float = option(
        DEFAULT_MAX_AUDIO_SECONDS, "longest audio clip in seconds, checked from the header before decoding and "
        "again while decoding (413 over it); never above the model's own window (30 s for Qwen2-Audio, 300 s for "
        "Qwen2.5-Omni)", MEDIA_ROLES, bounds=SECONDS)
    max_waiting_requests: int | None = option(None, "answer 503 when this many requests already wait (default: no "
                                              "limit)", ENGINE_HTTP_ROLES)
    media_threads: int | None = option(None, "threads that tokenize, decode and preprocess (default: the CPU "
                                       "budget, at most 4)", {SERVE} | REGISTRY_ROLES, bounds=COUNT)
    mm_processor_cache_gb: float = option(
        1.0, "GiB of processed pictures and videos (resized pixels) kept by a hash of their bytes, so one sent again "
        "(every turn of a chat resends it) is not decoded and resized again; 0 turns it off", MEDIA_ROLES)
    disable_log_requests: bool = option(False, "no info log line per request", ENGINE_HTTP_ROLES)
    max_request_bytes: int = option(64 * 2**20, "largest request body in bytes; a bigger one gets 413 before it is "
                                    "read", HTTP_ROLES, bounds=COUNT)
    max_n: int = option(128, "most samples (n) one request may ask for", HTTP_ROLES, bounds=COUNT)
    header_read_timeout: float = option(10.0, "seconds a client may take to send a request's headers; the "
                                        "connection is closed after that", HTTP_ROLES, bounds=SECONDS)
    body_read_timeout: float = option(60.0, "seconds a client may take to send a request's body; 408 after that",
                                      HTTP_ROLES, bounds=SECONDS)
    shutdown_timeout: float = option(
        0.0, "seconds a stop (SIGINT/SIGTERM) waits for the requests in flight to finish while new ones get 503; "
        "then the rest end (a stream with an error event). 0, as vLLM: they end at once. A second signal ends them "
        "at once", HTTP_ROLES, bounds=(0, SECONDS[1]))
    max_stop_strings: int = option(64, "most stop strings one request may give (and most stop_token_ids)",
                                   HTTP_ROLES)
    max_stop_string_chars: int = option(1024, "longest stop string, in characters", HTTP_ROLES)
    max_logprob_entries: int = option(
        2**19, "most log-probabilities one request may ask for: sequences (n x prompts) x max_tokens x "
        "(top_logprobs + 1)", HTTP_ROLES)
    chat_template: str | None = option(None, "chat template replacing the checkpoint's: a file, or the template "
                                       "text itself", HTTP_ROLES, metavar="FILE")
    trust_request_chat_template: bool = option(False, "accept a chat_template sent in a request (refused "
                                               "otherwise: a template is code)", HTTP_ROLES)
    enable_api_docs: bool = option(False, "serve /docs, /redoc and /openapi.json (behind --api-key when set)",
                                   ENGINE_HTTP_ROLES)
    allow_runtime_lora: bool = option(
        False, "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (with --enable-lora): an API client "
        "then names a folder under --lora-dir for the server to read, so keep it off unless every client with the "
        "API key may choose among those", LORA_API_ROLES)
    lora_dir: tuple[str, ...] = option(
        (), "folders runtime loads (--allow-runtime-lora) may read adapters from, symlinks resolved: a path "
        "outside them is refused (default: none, so every runtime load is refused)", LORA_API_ROLES, nargs="+",
        metavar="DIR")
    engine_heartbeat_timeout: float = option(10.0, "seconds without an answer from the engine process before it "
                                             "counts as unresponsive (503 on /health and for waiting requests)",
                                             ENGINE_HTTP_ROLES | {PREFILL}, bounds=SECONDS)
    playground: bool = option(True, "do not serve the browser playground page (GET / and /playground; 404 then)",
                              HTTP_ROLES, flag="--no-playground", negate=True)
    allowed_hosts: tuple[str, ...] = option(
        (), "Host header names this server answers to besides its own (default: loopback names and addresses when "
        "--host is a loopback address; else also any IP address, this machine's host name and --host): NAME, .DOMAIN "
        "(it and its subdomains), an IP address, or * for any. Others get 400: a page that rebinds its own name to "
        "this address (DNS rebinding) cannot reach it", HTTP_ROLES, nargs="+", metavar="HOST")


    def media_bounds(self) -> dict:
        """What bounds one media item in prompt processing (`InputProcessor.for_model` keywords)."""
        if not self.mm_processor_cache_gb >= 0:
            raise InvalidInputError(f"mm_processor_cache_gb must be >= 0, got {self.mm_processor_cache_gb}")
        return {"max_image_pixels": self.max_image_pixels, "max_audio_seconds": self.max_audio_seconds,
                "max_media_bytes": self.max_media_bytes, "max_video_bytes": self.max_video_bytes,
                "processed_cache_bytes": int(self.mm_processor_cache_gb * 2**30)}

@dataclass
class DisaggArgs:
    """Disaggregation (E->PD, E->P->D): the registry, receive buffers, heartbeats, transfers."""

    disagg: bool = option(False, "run a bootstrap, --num-encoders encoders and a language server here, each its "
                          "own process (with --num-prefill/--num-decode: prefill and decode instances instead of "
                          "the language server)", {SERVE})
    num_encoders: int = option(1, "encoder processes for --disagg", {SERVE})
    num_prefill: int = option(0, "prefill instances for --disagg (E->P->D; needs --num-decode too)", {SERVE})
    num_decode: int = option(0, "decode instances for --disagg (E->P->D); the first answers on --port, the others "
                             "on the ports after it", {SERVE})
    prefill_tensor_parallel_size: int | None = option(
        None, "ranks of each prefill instance --disagg starts (default: --tensor-parallel-size); the KV is re-sharded "
        "by heads when it differs from the decode instances'", {SERVE}, bounds=COUNT, metavar="N")
    decode_tensor_parallel_size: int | None = option(
        None, "ranks of each decode instance --disagg starts (default: --tensor-parallel-size)", {SERVE},
        bounds=COUNT, metavar="N")
    disagg_base_port: int | None = option(
        None, "ports for the roles --disagg starts, from this one up, in this order: the bootstrap registry (none "
        "with --registry), each encoder's HTTP then data port, each prefill instance's HTTP then data port "
        "(the API stays on --port; default or 0: free ports picked at start)", {SERVE}, bounds=PORT,
        metavar="PORT")
    bootstrap: str = option("127.0.0.1:8998", "host:port of `vlserve bootstrap` (the embedded registry; "
                            "--registry names another)", REGISTRY_ROLES, metavar="HOST:PORT")
    registry: str | None = option(
        None, "where the roles meet instead of --bootstrap: etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS), or "
        "http://HOST:PORT of `vlserve bootstrap`; with serve --disagg no bootstrap is started; serve without "
        "--disagg registers there as a replica for `vlserve router`", {SERVE} | REGISTRY_ROLES,
        metavar="URL")
    registry_namespace: str | None = option(
        None, "etcd key prefix of this deployment (/vlserve/NAME/...); default: --model as given, so every role of "
        "one deployment must name the model alike", {SERVE} | REGISTRY_ROLES, metavar="NAME")
    registry_user: str | None = option(None, "etcd user (its password in VLSERVE_REGISTRY_PASSWORD)",
                                       {SERVE} | REGISTRY_ROLES, metavar="USER")
    registry_password: str | None = option(None, "etcd password of --registry-user", {SERVE} | REGISTRY_ROLES,
                                           env="VLSERVE_REGISTRY_PASSWORD", secret=True)
    registry_ca: str | None = option(None, "CA file that signed etcd's server certificate (etcds://)",
                                     {SERVE} | REGISTRY_ROLES, metavar="FILE")
    registry_cert: str | None = option(None, "client certificate for etcd (with --registry-key)",
                                       {SERVE} | REGISTRY_ROLES, metavar="FILE")
    registry_key: str | None = option(None, "private key of --registry-cert", {SERVE} | REGISTRY_ROLES,
                                      metavar="FILE")
    advertise_host: str | None = option(
        None, "the address peers reach this instance by (a pod IP, say); default: --host, or for a wildcard --host "
        "the address of the interface toward the registry", {SERVE} | DISAGG_ROLES, env="VLSERVE_ADVERTISE_HOST",
        metavar="HOST")
    # Receive buffers, named by what they hold: media rows (from encoders: a language server, a prefill
    # instance) and KV rows (from prefill instances: a decode instance).
    media_buffer_blocks: int = option(
        4096, "blocks in the media receive buffer pool: embedding rows of media tokens sent by encoders "
        "(--embedding-buffer-blocks: deprecated alias)", {SERVE, LANGUAGE, PREFILL},
        aliases=("--embedding-buffer-blocks",))
    media_allocate_rows: int = option(
        8192, "media receive rows pre-allocated per request (a bigger picture resumes into more; what a request "
        "does not fill is freed when its transfer ends) (--embedding-default-allocate-tokens: deprecated alias)",
        {SERVE, LANGUAGE, PREFILL}, aliases=("--embedding-default-allocate-tokens",))
    kv_buffer_blocks: int = option(1024, "blocks in the KV receive buffer pool of a decode instance on a GPU or "
                                   "whose ranks torchrun started: every prompt token's KV row, held only until "
                                   "copied into the KV cache (on the CPU peers write into every rank's KV cache "
                                   "itself)",
                                   {SERVE, DECODE})
    kv_send_by_layer: bool = option(
        True, "a prefill instance writes each layer's KV into the decode instance's blocks after its prompt is "
        "computed, not as each layer is (over shm, Mooncake and NIXL; zmq writes after the prompt anyway)",
        {SERVE, PREFILL}, flag="--no-kv-send-by-layer", negate=True)
    kv_allocate_tokens: int = option(
        2048, "KV rows (prompt tokens) reserved per request on a decode instance before its prefill says how many "
        "(a longer prompt's prefill asks for the rest before computing it; what a prompt did not fill is freed when "
        "its transfer ends)", {SERVE, DECODE})
    receive_block_rows: int = option(16, "rows per receive buffer block (media and KV) (--embedding-block-tokens: "
                                     "deprecated alias)", {SERVE, LANGUAGE, PREFILL, DECODE},
                                     aliases=("--embedding-block-tokens",), bounds=COUNT)
    heartbeat_interval: float = option(1.0, "seconds between heartbeats (registry and peers; a router lists the "
                                       "registry and scrapes replicas this often)", {SERVE, BOOTSTRAP} | REGISTRY_ROLES,
                                       bounds=SECONDS)
    heartbeat_failure_threshold: int = option(3, "missed heartbeats before an instance is dropped (with etcd: the "
                                              "lease TTL is interval x threshold)", {SERVE, BOOTSTRAP} | DISAGG_ROLES,
                                              bounds=COUNT)
    peer_wait_timeout: float = option(
        5.0, "seconds a request waits for a peer to pair (an encoder, or a prefill instance) when none is, before "
        "it is refused with 503: a restart or a start-up race costs latency, not errors",
        {SERVE, LANGUAGE, PREFILL, DECODE}, bounds=SECONDS)
    transfer_timeout: float = option(120.0, "seconds one transfer may take before it fails (and, on a sender, "
                                     "before staged output nobody resumes is dropped)", {SERVE} | DISAGG_ROLES,
                                     bounds=SECONDS)
    transfer_backend: str = option("zmq", "how embeddings and KV move between roles", {SERVE} | DISAGG_ROLES,
                                   choices=("zmq", "shm", "mooncake", "nixl"))
    data_port: int | None = option(None, "ZeroMQ port receivers connect to (default: --port + 1)", {ENCODE, PREFILL},
                                   bounds=PORT)
    transfer_failure_prob: float = option(0.0, "fail this share of transfers on purpose (fault injection)",
                                          {ENCODE, PREFILL}, env="VLSERVE_TRANSFER_FAILURE_PROB", bounds=SHARE)
    disagg_secret: str | None = option(None, "shared secret of every role: signs registry calls and encrypts the "
                                       "data channel (encode, prefill, language and decode need it; serve --disagg "
                                       "makes one)",
                                       {SERVE, BOOTSTRAP} | REGISTRY_ROLES, env="VLSERVE_DISAGG_SECRET", secret=True)
    # The router (`vlserve router`): which replicas, and how it picks one.
    replica_role: tuple[str, ...] = option(("serve", "language", "decode"), "registry roles the router sends "
                                           "requests to", {ROUTER}, nargs="+", choices=("serve", "language", "decode"))
    routing: str = option("cache-aware", "how the router picks a replica: cache-aware (most cached leading tokens "
                          "of the request, weighed against its prefill queue), least-load, round-robin", {ROUTER},
                          choices=("cache-aware", "least-load", "round-robin"))
    routing_cache_weight: float = option(
        1.0, "cache-aware: what a prompt token cached on a replica is worth against a prompt token queued there "
        "for prefill (score = weight x cached leading tokens of the request - the replica's prefill queue in "
        "tokens); 0 routes by the shortest prefill queue", {ROUTER})
    replica_api_key: str | None = option(
        None, "the key the router sends replicas as 'Authorization: Bearer KEY' (their --api-key); a client's own "
        "Authorization never goes upstream (default: the router's --api-key, unless --allow-unsigned-replicas)",
        {ROUTER},
        env="VLSERVE_REPLICA_API_KEY", secret=True)
    allow_unsigned_replicas: bool = option(
        False, "route to replicas found in a registry anyone who reaches it can register in (a bootstrap without "
        "--disagg-secret, etcd without --registry-user or --registry-cert): refused by default, since such a "
        "replica would receive clients' prompts", {ROUTER})
    replica_read_timeout: float = option(
        600.0, "seconds the router waits for a replica's next bytes: its answer's headers (a stream's come once the "
        "prompt is prefilled, a whole answer's once it is generated) and then each chunk; past it the client gets "
        "504 (mid-stream: an error event) and the replica is avoided for a while", {ROUTER}, bounds=SECONDS)
    max_replica_response_bytes: int = option(
        256 * 2**20, "largest answer the router takes whole from a replica (one not streamed), in bytes; a longer "
        "one is cut off there with 502. Streams pass through chunk by chunk whatever their length", {ROUTER},
        bounds=COUNT)


def encode_args(args: EngineArgs) -> bytes:
    """Engine options as JSON, for the processes that resolve them again (the engine core, tensor-parallel ranks)."""
    return msgspec.json.encode(dataclasses.asdict(args))


def decode_args(data: bytes) -> EngineArgs:
    return EngineArgs(**msgspec.json.decode(data))


OPTION_GROUPS = (("engine", EngineArgs), ("server", ServerArgs), ("disaggregation", DisaggArgs))


@dataclass
class Options:
    """One role's options: the engine, server and disaggregation parts, each at its defaults unless set."""

    engine: EngineArgs = field(default_factory=EngineArgs)
    server: ServerArgs = field(default_factory=ServerArgs)
    disagg: DisaggArgs = field(default_factory=DisaggArgs)

    def parts(self) -> dict[type, Any]:
        return {EngineArgs: self.engine, ServerArgs: self.server, DisaggArgs: self.disagg}


def kv_cache_shared(role: str | None, tensor_parallel_size: int, device_type: str) -> bool:
    """Whether an engine keeps its KV cache in shared files, on the CPU, every rank its own (its heads; rank 0 maps
    them all, engine.ranked_kv) when the ranks are the processes rank 0 starts on this machine:
    - a decode engine's, which peers (prefill instances) write the KV they computed straight into. Otherwise (ranks
      that torchrun started, perhaps on other machines; a GPU) the KV lands in receive blocks and is copied into
      the cache when the request is admitted;
    - a prefill engine's at several ranks, which its writer thread reads every rank's heads out of (one rank
      reads its own cache without a file)."""
    if device_type != "cpu" or (tensor_parallel_size > 1 and under_torchrun()):
        return False
    return role == DECODE or (role == PREFILL and tensor_parallel_size > 1)


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def under_torchrun() -> bool:
    """torchrun (or the same variables) started this process: its ranks may be on several machines."""
    return all(v in os.environ for v in TORCHRUN_VARS)
