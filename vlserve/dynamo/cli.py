"""`vlserve dynamo-worker` (also `python -m vlserve.dynamo`): a vlserve engine serving a model behind NVIDIA
Dynamo's frontend. The engine's and media's flags are `vlserve serve`'s; Dynamo's runtime flags follow its own
backends' names (and its DYN_* environment variables keep working: the runtime reads them itself)."""

from __future__ import annotations

import argparse

from vlserve.core.config import DYNAMO
from vlserve.core.errors import ConfigurationError
from vlserve.core.options import options_from
from vlserve.dynamo.flags import add_worker_flags

INSTALL_HINT = "the Dynamo runtime is not installed: `make install-dynamo` (ai-dynamo and ai-dynamo-runtime 1.6.1)"


def build_worker(ns: argparse.Namespace, log_level: str = "INFO"):
    try:
        if ns.disaggregation_mode == "encode":
            from vlserve.dynamo.encode_worker import VlserveEncodeEngine as engine_class
        else:
            from vlserve.dynamo.worker import VlserveEngine as engine_class
    except ImportError as e:
        raise ConfigurationError(f"{INSTALL_HINT} ({e})") from None
    return engine_class.from_namespace(ns, log_level)


def run_worker(ns: argparse.Namespace) -> int:
    from vlserve.server.cli import tensor_parallel_worker

    opts = options_from(ns, DYNAMO)
    if (code := tensor_parallel_worker(opts.engine)) is not None:
        return code
    engine, worker = build_worker(ns, ns.log_level)
    from dynamo.common.backend.run import run

    async def factory(_argv):
        return engine, worker

    run(type(engine), engine_factory=factory)
    return 0


def register_cli(sub) -> None:
    p = sub.add_parser("dynamo-worker", help="serve a model as a backend of NVIDIA Dynamo's frontend",
                       description=__doc__)
    add_worker_flags(p)
    p.set_defaults(func=run_worker)
