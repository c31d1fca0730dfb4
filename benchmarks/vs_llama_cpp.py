"""vlserve against llama.cpp's `llama-server` (the CPU peer many users pick), both driven by vLLM's own benchmark
client in one run: the same random Qwen2-VL (medium by default), 8-bit weights on both sides (llama.cpp's Q8_0,
vlserve's `--quantization int8`), the vision projector as an f32 mmproj and vlserve in fp32 (`--dtype auto
--mmproj-type f16`: each side as it runs by default, vlserve bf16 where its measurement picks it); batch-1
(concurrency 1) and concurrency 8, one 336x336 picture + 48 prompt tokens, 48 output tokens. Prints both, the
ratios and the int8 decode bound.

Quality beside it, each side against its own unquantized model on the same text (this file's docs, teacher-forced
in 48 chunks of 128 tokens, the second half of each scored as llama.cpp's `llama-perplexity --kl-divergence` does):
mean KL divergence of the next-token distributions and top-1 agreement; llama.cpp: Q8_0 against the f32 GGUF,
vlserve: `--quantization int8` against the fp32 checkpoint, each chunk in one prefill (int8 GEMMs, activations
quantized per row) and again in 8-token passes (the decode kernels: activations quantized per 32 values).

    .venv/bin/python benchmarks/vs_llama_cpp.py --vllm-venv /path/peer/venv [--llama-cpp DIR] [--model DIR]

llama.cpp comes from the source package of `llama-cpp-python` on the package index (it vendors llama.cpp; nothing
is fetched from elsewhere): downloaded with pip, `llama-server` built with cmake (about 10 minutes on 2 cores), or
an already built tree given with --llama-cpp. The checkpoint is converted with that tree's convert_hf_to_gguf.py;
a random checkpoint's freshly trained byte-level BPE tokenizer is not one it knows by hash, so it is declared
Qwen2's (the pre-tokenizer the Qwen tokenizers use).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from machine_bounds import QUANTIZED_WEIGHT_BYTES, decode_bytes_per_token, head_bytes, read_bandwidth  # noqa: E402
from vs_vllm_client import Load, checkpoint, measure, print_rows  # noqa: E402

from tests.server_utils import free_port  # noqa: E402
from vlserve.core.cpu_budget import cpu_budget  # noqa: E402

SERVER = "build/bin/llama-server"
PERPLEXITY = "build/bin/llama-perplexity"
QUALITY_CONTEXT = 128  # tokens per chunk; the second half of each is scored
DECODE_ROWS = 8  # tokens a pass for the decode kernels' quality line (a decode step of a few rows)
QUALITY_CHUNKS = 48  # chunks scored (~3,000 positions; every one keeps a vocabulary of log-probabilities)
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


# ggml's AMX matmul crashed (SIGSEGV in ggml_backend_amx_mul_mat at the first batch) on a 2-core Xeon with AMX,
# 2026-11-29; built without it, llama.cpp keeps its repacked AVX-512 VNNI Q8_0 kernels.
WITHOUT_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_llama_cpp(work: Path, without_amx: bool = False) -> Path:
    """llama.cpp from the llama-cpp-python source package, `llama-server` built; returns the tree."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", str(work),
                    "llama-cpp-python"], check=True)
    [sdist] = work.glob("llama_cpp_python-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    tree = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
    print(f"building llama-server in {tree} (about 10 minutes on 2 cores)", flush=True)
    flags = [f"-DCMAKE_C_FLAGS={WITHOUT_AMX}", f"-DCMAKE_CXX_FLAGS={WITHOUT_AMX}"] if without_amx else []
    subprocess.run(["cmake", "-B", "build", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DCMAKE_BUILD_TYPE=Release", *flags], cwd=tree, check=True, stdout=subprocess.DEVNULL)
    build_targets(tree)
    return tree


def build_targets(tree: Path) -> None:
    """llama-server and llama-perplexity (only what is missing is built)."""
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "llama-perplexity", "-j"], cwd=tree,
                   check=True, stdout=subprocess.DEVNULL)


def to_gguf(tree: Path, model: str, out: Path, mmproj_type: str = "f32") -> tuple[Path, Path]:
    """The language model as Q8_0 and the vision tower + projector as an mmproj of `mmproj_type`."""
    weights, projector = out / "model-q8_0.gguf", out / f"mmproj-{mmproj_type}.gguf"
    for extra, path, kind in (([], weights, "q8_0"), (["--mmproj"], projector, mmproj_type)):
        subprocess.run([sys.executable, "-c", CONVERT, str(tree), model, *extra, "--outfile", str(path), "--outtype",
                        kind], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return weights, projector


def llama_cpp_quality(tree: Path, model: str, work: Path, q8: Path, text: Path) -> tuple[float, float]:
    """(mean KLD, same top-1 share) of Q8_0 against the f32 GGUF, as llama-perplexity reports them."""
    f32 = work / "model-f32.gguf"
    subprocess.run([sys.executable, "-c", CONVERT, str(tree), model, "--outfile", str(f32), "--outtype", "f32"],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = work / "f32.kld"
    common = ["-f", str(text), "-c", str(QUALITY_CONTEXT), "-b", str(QUALITY_CONTEXT), "--chunks", str(QUALITY_CHUNKS),
              "-t", str(cpu_budget().cpus)]
    subprocess.run([str(tree / PERPLEXITY), "-m", str(f32), "--kl-divergence-base", str(base), *common], check=True,
                   capture_output=True)
    out = subprocess.run([str(tree / PERPLEXITY), "-m", str(q8), "--kl-divergence-base", str(base),
                          "--kl-divergence", *common], check=True, capture_output=True, text=True)
    log = out.stdout + out.stderr
    kld = re.search(r"Mean\s+KLD:\s+([-\d.]+)", log)
    same = re.search(r"Same top p:\s+([\d.]+)", log)
    if not (kld and same):
        raise RuntimeError(f"llama-perplexity printed no KLD summary:\n{log[-2000:]}")
    return float(kld.group(1)), float(same.group(1)) / 100


def vlserve_quality(model: str, text: Path, rows_per_pass: int | None = None) -> tuple[float, float]:
    """(mean KLD, same top-1 share) of `--quantization int8` against the fp32 model, scored like llama-perplexity:
    each chunk in one prefill (int8 GEMMs, activations per row), or `rows_per_pass` tokens a pass (the decode
    kernels' int8 dot products, activations per 32 values)."""
    from transformers import AutoTokenizer

    from vlserve.tools.logit_quality import deviation, teacher_forced_logits

    ids = torch.tensor(AutoTokenizer.from_pretrained(model)(text.read_text())["input_ids"])
    chunks = list(ids[: len(ids) // QUALITY_CONTEXT * QUALITY_CONTEXT].split(QUALITY_CONTEXT))[:QUALITY_CHUNKS]
    half = QUALITY_CONTEXT // 2
    # the logits at positions half .. end-2 of each chunk (each predicting a token of the chunk), as llama-perplexity
    scored = [c * QUALITY_CONTEXT + p for c in range(len(chunks)) for p in range(half, QUALITY_CONTEXT - 1)]
    ref = teacher_forced_logits(model, None, "float32", chunks)[scored]
    d = deviation(teacher_forced_logits(model, "int8", "float32", chunks, rows_per_pass)[scored], ref)
    return d.kl_mean, d.top1_agreement


def quality_text(work: Path) -> Path:
    text = work / "quality.txt"
    text.write_text("\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))))
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm-venv", type=Path, required=True, help="DIR/venv of ../shared/peers/vllm_cpu/setup_venv.sh")
    ap.add_argument("--llama-cpp", type=Path, help="a llama.cpp tree with build/bin/llama-server (default: build one)")
    ap.add_argument("--model", default="medium", help="small, medium or a Qwen2-VL checkpoint folder")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--dtype", default="float32",
                    help="vlserve's --dtype (auto: what it picks on this CPU, bf16 where measured faster)")
    ap.add_argument("--mmproj-type", default="f32", choices=("f32", "f16", "q8_0"),
                    help="llama.cpp's vision tower + projector file (f16 is what its converter writes by default)")
    ap.add_argument("--baseline-env", default="",
                    help="also run vlserve with these variables (KEY=VALUE,...), e.g. what turns a change off, and "
                         "print it beside llama.cpp too")
    ap.add_argument("--without-amx", action="store_true",
                    help="build llama.cpp without its AMX matmul (it crashed on an AMX Xeon; see WITHOUT_AMX)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vs-llama-cpp-"))
    tree = args.llama_cpp or build_llama_cpp(work, args.without_amx)
    if not (tree / PERPLEXITY).exists():
        build_targets(tree)
    model = checkpoint(args.model, work)
    weights, projector = to_gguf(tree, model, work, args.mmproj_type)
    loads = [Load(c, max(16, 2 * c)) for c in (int(x) for x in args.concurrency.split(","))]
    port, slots = free_port(), max(load.concurrency for load in loads)
    # Threads: one per core, as vlserve's budget gives; a slot per request in flight.
    peer = measure("llama.cpp", [str(tree / SERVER), "-m", str(weights), "--mmproj", str(projector), "--port",
                                 str(port), "-t", str(cpu_budget().cpus), "-c", "16384", "--parallel", str(slots),
                                 "--jinja", "--no-webui"], None, port, args.vllm_venv, model, loads)
    port = free_port()
    ours = measure("vlserve", [sys.executable, "-m", "vlserve", "serve", "--model", model, "--dtype", args.dtype,
                               "--quantization", "int8", "--port", str(port), "--max-model-len", "4096",
                               "--disable-log-requests"], None, port, args.vllm_venv, model, loads)
    baseline = None
    if args.baseline_env:
        port = free_port()
        env = {**os.environ, **dict(kv.split("=", 1) for kv in args.baseline_env.split(","))}
        baseline = measure("vlserve-baseline", [sys.executable, "-m", "vlserve", "serve", "--model", model, "--dtype",
                                                args.dtype, "--quantization", "int8", "--port", str(port),
                                                "--max-model-len", "4096", "--disable-log-requests"], env, port,
                           args.vllm_venv, model, loads)
    bound = read_bandwidth() / decode_bytes_per_token(model, QUANTIZED_WEIGHT_BYTES["int8"], head_bytes("int8", 4))
    text = quality_text(work)
    theirs_q = llama_cpp_quality(tree, model, work, weights, text)
    ours_q, ours_decode_q = vlserve_quality(model, text), vlserve_quality(model, text, DECODE_ROWS)
    print(f"\nvlserve --dtype {args.dtype}, llama.cpp mmproj {args.mmproj_type}")
    print(f"{Path(model).name} Qwen2-VL, 8-bit weights (Q8_0 / int8), 8-bit activations (Q8_0: per 32 values; "
          f"int8: per row in prefill, per 32 values in decode); batch-1 decode bound {bound:.0f} tok/s from memory "
          "bandwidth")
    for i, (load, a, b) in enumerate(zip(loads, ours, peer)):
        print(f"\nconcurrency {load.concurrency}")
        print_rows(a, b, "llama.cpp")
        if baseline is not None:
            print(f"  vlserve with {args.baseline_env}:")
            print_rows(baseline[i], b, "llama.cpp")
    print(f"\nquality against the unquantized model, {QUALITY_CONTEXT}-token chunks of {text.name}:")
    print(f"{'':<28}{'mean KLD':>10}{'same top-1':>12}")
    for name, (kld, same) in (("vlserve int8 vs fp32", ours_q), (f"  in {DECODE_ROWS}-token passes", ours_decode_q),
                              ("llama.cpp Q8_0 vs f32", theirs_q)):
        print(f"{name:<28}{kld:>10.5f}{100 * same:>11.1f}%")


if __name__ == "__main__":
    main()
