"""vlserve against llama.cpp's `llama-server` (the CPU peer many users pick), both driven by vLLM's own benchmark
client in one run: the same random Qwen2-VL (medium by default), 8-bit weights on both sides (llama.cpp's Q8_0,
vlserve's `--quantization int8`), the vision projector as an f32 mmproj; batch-1 (concurrency 1) and concurrency 8,
one 336x336 picture + 48 prompt tokens, 48 output tokens. Prints both, the ratios and the int8 decode bound.

    .venv/bin/python benchmarks/vs_llama_cpp.py --vllm-venv /path/peer/venv [--llama-cpp DIR] [--model DIR]

llama.cpp comes from the source package of `llama-cpp-python` on the package index (it vendors llama.cpp; nothing
is fetched from elsewhere): downloaded with pip, `llama-server` built with cmake (about 10 minutes on 2 cores), or
an already built tree given with --llama-cpp. The checkpoint is converted with that tree's convert_hf_to_gguf.py;
a random checkpoint's freshly trained byte-level BPE tokenizer is not one it knows by hash, so it is declared
Qwen2's (the pre-tokenizer the Qwen tokenizers use).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine_bounds import QUANTIZED_WEIGHT_BYTES, decode_bytes_per_token, head_bytes, read_bandwidth  # noqa: E402
from vs_vllm_client import Load, checkpoint, measure, print_rows  # noqa: E402

from tests.server_utils import free_port  # noqa: E402
from vlserve.core.cpu_budget import cpu_budget  # noqa: E402

SERVER = "build/bin/llama-server"
# Run inside the llama.cpp tree's converter: a fresh BPE tokenizer declared Qwen2's, and no sentencepiece model
# looked for (byte-level BPE; the converter would need the sentencepiece package just to find none).
CONVERT = """import sys
sys.path[:0] = [sys.argv[1] + "/gguf-py", sys.argv[1]]
import convert_hf_to_gguf
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
def no_sentencepiece(self, *args, **kwargs):
    raise FileNotFoundError("a byte-level BPE tokenizer")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert_hf_to_gguf.main()
"""


def build_llama_cpp(work: Path) -> Path:
    """llama.cpp from the llama-cpp-python source package, `llama-server` built; returns the tree."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(work),
                    "llama-cpp-python"], check=True)
    [sdist] = work.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    tree = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    print(f"building llama-server in {tree} (about 10 minutes on 2 cores)", flush=True)
    subprocess.run(["cmake", "-B", "build", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DCMAKE_BUILD_TYPE=Release"], cwd=tree, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "-j"], cwd=tree, check=True,
                   stdout=subprocess.DEVNULL)
    return tree


def to_gguf(tree: Path, model: str, out: Path) -> tuple[Path, Path]:
    """The language model as Q8_0 and the vision tower + projector as an f32 mmproj."""
    weights, projector = out / "model-q8_0.gguf", out / "mmproj-f32.gguf"
    for extra, path, kind in (([], weights, "q8_0"), (["--mmproj"], projector, "f32")):
        subprocess.run([sys.executable, "-c", CONVERT, str(tree), model, *extra, "--outfile", str(path), "--outtype",
                        kind], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return weights, projector


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", type=Path, required=True, help="DIR/venv of ../shared/peers/vllm_cpu/setup_venv.sh")
    ap.add_argument("--llama-cpp", type=Path, help="a llama.cpp tree with build/bin/llama-server (default: build one)")
    ap.add_argument("--model", default="medium", help="small, medium or a Qwen2-VL checkpoint folder")
    ap.add_argument("--concurrency", default="1,8")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vs-llama-cpp-"))
    tree = args.llama_cpp or build_llama_cpp(work)
    model = checkpoint(args.model, work)
    weights, projector = to_gguf(tree, model, work)
    loads = [Load(c, max(16, 2 * c)) for c in (int(x) for x in args.concurrency.split(","))]
    port, slots = free_port(), max(load.concurrency for load in loads)
    # Threads: one per core, as vlserve's budget gives; a slot per request in flight.
    peer = measure("llama.cpp", [str(tree / SERVER), "-m", str(weights), "--mmproj", str(projector), "--port",
                                 str(port), "-t", str(cpu_budget().cpus), "-c", "16384", "--parallel", str(slots),
                                 "--jinja", "--no-webui"], None, port, args.vllm_venv, model, loads)
    port = free_port()
    ours = measure("vlserve", [sys.executable, "-m", "vlserve", "serve", "--model", model, "--dtype", "float32",
                               "--quantization", "int8", "--port", str(port), "--max-model-len", "4096",
                               "--disable-log-requests"], None, port, args.vllm_venv, model, loads)
    bound = read_bandwidth() / decode_bytes_per_token(model, QUANTIZED_WEIGHT_BYTES["int8"], head_bytes("int8", 4))
    print(f"\n{Path(model).name} Qwen2-VL, 8-bit weights (Q8_0 / int8), fp32 activations; batch-1 decode bound "
          f"{bound:.0f} tok/s from memory bandwidth")
    for load, a, b in zip(loads, ours, peer):
        print(f"\nconcurrency {load.concurrency}")
        print_rows(a, b, "llama.cpp")


if __name__ == "__main__":
    main()
