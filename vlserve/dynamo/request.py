"""Dynamo's preprocessed request (the dict its frontend sends a backend's `generate`) as a vlserve prompt and
`SamplingParams`. Dynamo's frontend has already rendered the chat template and tokenized; a picture arrives as its
URL (`multi_modal_data`) and one unexpanded placeholder token, which the prompt encoder expands as it does for
`prompt_token_ids` prompts. Every field with a value we cannot honour is refused by name, never dropped.

Nothing here imports Dynamo: the mapping is tested without its wheels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlserve.core.errors import InvalidInputError
from vlserve.core.sampling_params import SamplingParams

# Dynamo's media keys -> ours; each entry is {"Url": url} (a data: URL, http(s) or file under the server's policy)
MEDIA_KEYS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}

# Fields Dynamo sends and what we do with them. A name missing here with a value other than None (or the neutral
# value listed) is refused: a newer frontend's field is never silently dropped.
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "seed": "seed",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "repetition_penalty": "repetition_penalty", "include_stop_str_in_output": "include_stop_str_in_output"}
NEUTRAL_SAMPLING = {"n": (None, 1), "best_of": (None, 1), "use_beam_search": (None, False),
                    "length_penalty": (None,)}
STOPS = {"max_tokens", "stop", "stop_token_ids", "stop_token_ids_visible", "stop_token_ids_hidden", "min_tokens",
         "ignore_eos"}
NEUTRAL_STOPS = {"max_thinking_tokens": (None,)}
# The frontend detokenizes and formats; these change nothing the engine does.
FRONTEND_OUTPUT = {"skip_special_tokens", "formatted_prompt", "return_tokens_as_token_ids"}
NEUTRAL_OUTPUT = {"prompt_logprobs": (None,)}  # 0 asks for them too
# Dynamo's encode step's result (encode_worker): {ENCODER_RESULT_KEY: the vlserve encoder's instance id, "items": n}
ENCODER_RESULT_KEY = "vlserve_encoder"
# Parts of a request for roles this worker does not play (disaggregated prefill/decode, an encoder before it)
UNSUPPORTED_PARTS = ("prefill_result", "bootstrap_info", "encoder_result")
GUIDED = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
GUIDED_NEUTRAL = {"backend"}  # which grammar engine: ours is the one there is


@dataclass
class DynamoPrompt:
    prompt: dict  # {"prompt_token_ids": [...], "multi_modal_data": {kind: [url, ...]}}
    params: SamplingParams
    max_tokens: int | None  # as asked (None: what the context leaves)
    mm_hashes: list[str]  # the frontend's per-item content hashes (hex), in prompt order, for KV routing
    mm_processor_kwargs: dict | None = None  # checked against the family's processor by the prompt encoder
    text: str | None = None  # the rendered chat template the frontend tokenized (extra_args.formatted_prompt)


def _group(request: dict, name: str) -> dict:
    value = request.get(name) or {}
    if not isinstance(value, dict):
        raise InvalidInputError(f"{name} must be an object, got {type(value).__name__}")
    return value


def _refuse_unknown(group: str, values: dict, known: set, neutral: dict) -> None:
    for key, value in values.items():
        if key in known:
            continue
        if value in neutral.get(key, (None,)):
            continue
        raise InvalidInputError(f"{group}.{key}={value!r} is not supported by the vlserve backend")


def _int_list(value: Any, name: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise InvalidInputError(f"{name} must be a list of token ids")
    return value


def media_of(request: dict) -> dict[str, list[str]]:
    data = _group(request, "multi_modal_data")
    media: dict[str, list[str]] = {}
    for key, entries in data.items():
        kind = MEDIA_KEYS.get(key)
        if kind is None:
            raise InvalidInputError(f"multi_modal_data.{key} is not supported by the vlserve backend "
                                    f"(it takes {', '.join(MEDIA_KEYS)})")
        if not isinstance(entries, list):
            raise InvalidInputError(f"multi_modal_data.{key} must be a list")
        urls = []
        for entry in entries:
            url = entry.get("Url") if isinstance(entry, dict) else None
            if not isinstance(url, str):
                raise InvalidInputError(f"multi_modal_data.{key} entries must be {{\"Url\": ...}} (the vlserve "
                                        "backend fetches and decodes media itself; register no media decoder)")
            urls.append(url)
        if urls:
            media[kind] = urls
    return media


def structured_outputs_of(guided: dict | None) -> dict | None:
    if not guided:
        return None
    if not isinstance(guided, dict):
        raise InvalidInputError("sampling_options.guided_decoding must be an object")
    spec = {GUIDED[k]: v for k, v in guided.items() if k in GUIDED and v is not None}
    for key, value in guided.items():
        if key not in GUIDED and key not in GUIDED_NEUTRAL and value is not None:
            raise InvalidInputError(f"sampling_options.guided_decoding.{key} is not supported by the vlserve backend")
    if "json" in spec and isinstance(spec["json"], str):
        import json

        try:
            spec["json"] = json.loads(spec["json"])
        except ValueError as e:
            raise InvalidInputError(f"sampling_options.guided_decoding.json is not valid JSON: {e}") from None
    return spec or None


def dynamo_prompt(request: dict, eos_token_ids: set[int]) -> DynamoPrompt:
    """Raises InvalidInputError naming the field for anything it cannot honour."""
    for part in UNSUPPORTED_PARTS:
        if request.get(part):
            raise InvalidInputError(f"{part} is not supported by the vlserve backend (it serves aggregated "
                                    "requests: no --disaggregation-mode, no --route-to-encoder)")
    token_ids = _int_list(request.get("token_ids"), "token_ids")
    if not token_ids:
        raise InvalidInputError("token_ids is empty")
    sampling, stops, output = (_group(request, g) for g in ("sampling_options", "stop_conditions", "output_options"))
    _refuse_unknown("sampling_options", sampling, set(SAMPLING) | {"guided_decoding"}, NEUTRAL_SAMPLING)
    _refuse_unknown("stop_conditions", stops, STOPS, NEUTRAL_STOPS)
    _refuse_unknown("output_options", output, FRONTEND_OUTPUT | {"logprobs"}, NEUTRAL_OUTPUT)
    values: dict[str, Any] = {ours: sampling[theirs] for theirs, ours in SAMPLING.items()
                              if sampling.get(theirs) is not None}
    max_tokens = stops.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise InvalidInputError(f"stop_conditions.max_tokens must be a positive integer, got {max_tokens!r}")
    # Hidden stop tokens are the model's end-of-sequence ids (the engine stops on its own); visible ones are kept
    # in the output like any stop token id of ours.
    extra_stops = [t for t in _int_list(stops.get("stop_token_ids_hidden"), "stop_token_ids_hidden")
                   if t not in eos_token_ids]
    stop_ids = (_int_list(stops.get("stop_token_ids"), "stop_token_ids")
                + _int_list(stops.get("stop_token_ids_visible"), "stop_token_ids_visible") + extra_stops)
    if stop_ids:
        values["stop_token_ids"] = list(dict.fromkeys(stop_ids))
    for name in ("stop", "min_tokens", "ignore_eos"):
        if stops.get(name) is not None:
            values[name] = stops[name]
    if output.get("logprobs") is not None:
        values["logprobs"] = output["logprobs"]
    structured = structured_outputs_of(sampling.get("guided_decoding"))
    if structured is not None:
        values["structured_outputs"] = structured
    try:
        params = SamplingParams(max_tokens=max_tokens, **values)
    except (TypeError, ValueError) as e:
        raise InvalidInputError(str(e)) from None
    prompt: dict[str, Any] = {"prompt_token_ids": token_ids}
    media = media_of(request)
    if media:
        prompt["multi_modal_data"] = media
    hashes = (_group(request, "extra_args").get("mm_hashes") or []) if media else []
    if not isinstance(hashes, list) or not all(isinstance(h, str) for h in hashes):
        raise InvalidInputError("extra_args.mm_hashes must be a list of strings")
    text = _group(request, "extra_args").get("formatted_prompt")
    return DynamoPrompt(prompt, params, max_tokens, hashes, _group(request, "mm_processor_kwargs") or None,
                        text if isinstance(text, str) else None)
