"""Front end + engine core in one process: the offline `LLM` drives this step by step."""

from __future__ import annotations

import itertools

from vlserve.core.config import EngineArgs
from vlserve.engine.config import VlserveConfig, resolve_config
from vlserve.engine.core import EngineCore
from vlserve.frontend.output_processor import OutputProcessor
from vlserve.core.request import Request
from vlserve.core.errors import InvalidInputError
from vlserve.frontend.media.image import ImageProcessorConfig
from vlserve.core.outputs import RequestOutput
from vlserve.frontend.input_processor import InputProcessor
from vlserve.frontend.tokenizer import load_tokenizer
from vlserve.core.sampling_params import SamplingParams


def child_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n samples become n engine requests; seeded ones get seed, seed+1, ... so they differ but reproduce."""
    import msgspec

    one = msgspec.structs.replace(params, n=1)
    if n == 1:
        return [one]
    return [msgspec.structs.replace(one, seed=None if params.seed is None else params.seed + i) for i in range(n)]


def fan_out(template: Request, params: SamplingParams, request_id: str) -> tuple[list[Request], dict[str, SamplingParams]]:
    """One processed prompt -> the engine requests for its n samples (ids "i_<id>" when n > 1)."""
    children = child_params(params, params.n)
    child_ids = [request_id if params.n == 1 else f"{i}_{request_id}" for i in range(params.n)]
    reqs = [template.fork(cid, cp) for cid, cp in zip(child_ids, children)]
    return reqs, dict(zip(child_ids, children))


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.cfg: VlserveConfig = resolve_config(args)
        self.tokenizer = load_tokenizer(self.cfg.model_path)
        image_cfg = ImageProcessorConfig.from_pretrained(self.cfg.model_path)
        self.input_processor = InputProcessor(self.cfg, self.tokenizer, image_cfg)
        self.core = EngineCore(self.cfg)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def add_request(self, prompt, params: SamplingParams, request_id: str | None = None,
                    mm_processor_kwargs: dict | None = None) -> str:
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        request_id = request_id or str(next(self._ids))
        text, template = self.input_processor.process(request_id, prompt, params, mm_processor_kwargs)
        reqs, children = fan_out(template, params, request_id)
        added = []
        try:
            for req in reqs:
                self.core.add_request(req)
                added.append(req.request_id)
        except Exception:
            self.core.abort_requests(added)
            raise
        self.output_processor.add(request_id, text, template.prompt_token_ids, children)
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.output_processor.abort(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        outputs, stop_now = self.output_processor.process(self.core.step())
        if stop_now:
            self.core.stop_requests(stop_now)
        return outputs
