"""Video decode + preprocessing cost: time per second of video, and how it scales with the sampled frame count.

For clips of several lengths (640x360, 30 fps, h264, made here), prints the bare PyAV decode of every frame
(the floor any pipeline pays) next to vlserve's whole path (decode, smart_nframes sampling, RGB conversion,
per-frame resize and temporal patchify), and then the whole path at several max_frames settings.

    .venv/bin/python benchmarks/video_preprocessing.py [--seconds 2,5,10] [--frames 4,8,16,32,64]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

import av
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vlserve.media.video import load_video  # noqa: E402
from vlserve.model.families.qwen.pixels import ImageProcessorConfig  # noqa: E402
from vlserve.model.families.qwen.video_rules import QwenVideoOptions as VideoOptions  # noqa: E402
from vlserve.model.families.qwen.video_rules import preprocess_video  # noqa: E402

CFG = ImageProcessorConfig(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)  # Qwen2-VL's video defaults


def make_clip(seconds: float, fps: int = 30, size=(640, 360)) -> bytes:
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        for i in range(int(seconds * fps)):
            frame = np.stack([(x + 4 * i) % 256, (y + 2 * i) % 256, (x + y + i) % 256], -1).astype(np.uint8)
            for p in s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bare_decode(data: bytes) -> None:
    with av.open(io.BytesIO(data)) as c:
        for _ in c.decode(c.streams.video[0]):
            pass


def full_path(data: bytes, opts: VideoOptions):
    video = load_video(data, opts)
    return preprocess_video(video, CFG, opts, CFG.min_pixels, CFG.max_pixels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", default="2,5,10")
    ap.add_argument("--frames", default="4,8,16,32,64")
    args = ap.parse_args()

    print(f"{'clip':>6} {'frames':>7} {'decode only':>12} {'vlserve':>9} {'ratio':>6} {'per video second':>17} {'grid':>12}")
    for seconds in (float(s) for s in args.seconds.split(",")):
        data = make_clip(seconds)
        opts = VideoOptions(fps=2.0, max_frames=64)
        base = best_of(lambda: bare_decode(data))
        ours = best_of(lambda: full_path(data, opts))
        out = full_path(data, opts)
        print(f"{seconds:>5.0f}s {out.layout[0] * 2:>7} {base * 1e3:>10.0f}ms {ours * 1e3:>7.0f}ms "
              f"{ours / base:>5.2f}x {ours / seconds * 1e3:>14.0f}ms {str(out.layout):>12}")

    data = make_clip(10.0)
    print("\nscaling with the sampled frame count (10 s clip, fps high enough to reach max_frames):")
    print(f"{'max_frames':>10} {'time':>8} {'per frame':>10} {'tokens':>7}")
    for n in (int(f) for f in args.frames.split(",")):
        opts = VideoOptions(fps=30.0, max_frames=n)
        t = best_of(lambda: full_path(data, opts))
        out = full_path(data, opts)
        print(f"{n:>10} {t * 1e3:>6.0f}ms {t / n * 1e3:>8.1f}ms {out.num_embed_tokens:>7}")


if __name__ == "__main__":
    main()
