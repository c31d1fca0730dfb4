"""The front end's memory over many large transcription uploads: bounded, or growing with every upload?

Starts `vlserve serve` on a tiny random Qwen2-Audio (made in a temp dir unless --model), uploads --uploads clips of
about 17 MB each (WAV, 48 kHz, 6 channels, 16-bit, 29 s: within the model's 30 s window), each one different, one
after another, alternating the json and verbose_json formats, and prints the serving process's resident memory
(VmRSS; its high-water mark VmHWM) after each. A leak grows by about an upload each time, without end; an
allocator that keeps freed memory grows in steps and levels off. Not a test: numbers to read.

    .venv/bin/python benchmarks/transcription_rss.py [--uploads 56] [--model DIR] [-- extra serve flags]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlserve.core.processes import free_port  # noqa: E402

RATE, CHANNELS, SECONDS = 48000, 6, 29.0


def clip(seed: int) -> bytes:
    """A 16-bit multichannel WAV of noise, different for every seed (the standard library writes it)."""
    import wave

    samples = np.random.default_rng(seed).integers(-3000, 3000, (int(RATE * SECONDS), CHANNELS), dtype=np.int16)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(CHANNELS)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(samples.tobytes())
    return buf.getvalue()


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) of a process, in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--uploads", type=int, default=56)
    p.add_argument("--concurrency", type=int, default=1, help="uploads in flight at once")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="in the server's environment "
                   "(e.g. MALLOC_ARENA_MAX=1, to tell allocator retention from a leak)")
    p.add_argument("--model", default=None, help="a Qwen2-Audio checkpoint (default: a tiny random one)")
    p.add_argument("serve_flags", nargs="*", help="more `vlserve serve` flags (after --)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from vlserve.tools.tiny_model import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "qwen2-audio", arch="qwen2_audio"))
        port = free_port()
        log = open(Path(tmp) / "server.log", "w+")
        server = subprocess.Popen([sys.executable, "-m", "vlserve", "serve", "--model", model, "--port", str(port),
                                   "--dtype", "float32", *args.serve_flags], stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "OMP_NUM_THREADS": "1",
                                       **dict(kv.split("=", 1) for kv in args.env)})
        url = f"http://127.0.0.1:{port}"
        try:
            with httpx.Client(timeout=600) as http:
                for _ in range(600):
                    try:
                        if http.get(url + "/health").status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    if server.poll() is not None:
                        sys.exit("the server exited:\n" + Path(log.name).read_text())
                    time.sleep(0.5)
                start = memory_mb(server.pid)[0]
                print(f"upload size {len(clip(0)) / 1e6:.1f} MB, {args.concurrency} at once; front end at start "
                      f"{start:.0f} MB RSS ({' '.join(args.env) or 'no allocator settings in its environment'})")
                print(f"{'uploads':>7} {'RSS MB':>8} {'HWM MB':>8} {'growth MB':>10} {'seconds':>8}")

                def upload(i: int) -> None:
                    fmt = ("json", "verbose_json")[i % 2]
                    r = http.post(url + "/v1/audio/transcriptions", files={"file": ("clip.wav", clip(i + 1))},
                                  data={"model": model, "response_format": fmt, "max_completion_tokens": "2"})
                    if r.status_code != 200:
                        raise RuntimeError(f"upload {i + 1}: {r.status_code} {r.text[:300]}")

                with ThreadPoolExecutor(args.concurrency) as pool:
                    for first in range(0, args.uploads, args.concurrency):
                        t0 = time.perf_counter()
                        list(pool.map(upload, range(first, min(first + args.concurrency, args.uploads))))
                        rss, hwm = memory_mb(server.pid)
                        print(f"{min(first + args.concurrency, args.uploads):>7} {rss:>8.0f} {hwm:>8.0f} "
                              f"{rss - start:>10.0f} {time.perf_counter() - t0:>8.2f}", flush=True)
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    main()
