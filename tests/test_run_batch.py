"""`vlserve run-batch` end to end, in one run of the command over a file that holds every kind of line: good
requests (text, a picture, /v1/responses) answered as the offline API answers them, a request the endpoint
refuses (its status and error body), lines refused before any endpoint (one error line each, with its line
number), and lines an earlier run already answered (skipped, kept, not repeated; a result line cut short by a
killed run dropped). Configuration mistakes end the command at once with a clear message."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import noise_image
from tests.server_utils import log_file, start_vlserve, stop
from tests.test_request_validation import names_field
from tests.test_server_api import data_url
from vlserve import LLM, SamplingParams
from vlserve.core.errors import EXIT_CONFIG
from vlserve.server.batch_files import InputLines, read_done

MAX_TOKENS = 8
LINE_LIMIT = 20_000
CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Hello there!"}]
PICTURE = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(noise_image(64, 48, 1))}},
                                        {"type": "text", "text": "What is in this picture?"}]}]
# Written by an "earlier run": an answer, a refused line (line 14 of the input) and a line cut short by a kill.
EARLIER = (b'{"id":"batch_req_old1","custom_id":"done-before","response":{"status_code":200,"request_id":"req_old",'
           b'"body":{"marker":"kept"}},"error":null}\n'
           b'{"id":"batch_req_old2","custom_id":null,"response":null,"error":{"code":"invalid_json_line",'
           b'"message":"marker","param":null,"line":14}}\n')
CUT_SHORT = b'{"id":"batch_req_cut","custom_id":"text","respo'


def request(custom_id, body: dict, url: str = CHAT, method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def chat_body(messages, **extra) -> dict:
    return {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}


INPUT = [
    request("text", chat_body(HELLO)),  # 1
    request("picture", chat_body(PICTURE)),  # 2
    "   ",  # 3: blank, skipped
    "{not json",  # 4
    "[1, 2]",  # 5
    request("web", chat_body(HELLO), url="/v1/embeddings"),  # 6
    request("streamed", chat_body(HELLO, stream=True)),  # 7
    request("too-hot", chat_body(HELLO, temperature=-1)),  # 8: the endpoint's 400
    request("text", chat_body(HELLO)),  # 9: duplicate
    request("get", chat_body(HELLO), method="GET"),  # 10
    json.dumps({"method": "POST", "url": CHAT, "body": chat_body(HELLO)}),  # 11: no custom_id
    request("huge", chat_body([{"role": "user", "content": "a" * LINE_LIMIT}])),  # 12: over the line limit
    request("done-before", chat_body(HELLO)),  # 13: answered by the earlier run
    "refused by the earlier run",  # 14
    request("response", {"input": "Hello there!", "max_output_tokens": MAX_TOKENS, "temperature": 0},
            url="/v1/responses"),  # 15
    request("wrong-seed", {"input": "Hello there!", "seed": "abc"}, url="/v1/responses"),  # 16: was a 500
    request("wrong-n", chat_body(HELLO, n="2")),  # 17
]
WRONGLY_TYPED = {"wrong-seed": "seed", "wrong-n": "n"}  # the endpoint's 400, naming the field
LINE_ERRORS = {4: ("invalid_json_line", None), 5: ("invalid_line", None), 6: ("invalid_url", "web"),
               7: ("stream_not_supported", "streamed"), 9: ("duplicate_custom_id", "text"),
               10: ("invalid_method", "get"), 11: ("invalid_custom_id", None), 12: ("line_too_long", None)}


def run_batch(*args: str, timeout: float) -> tuple[int, str]:
    """`vlserve run-batch ARGS` to its end: (exit code, its log)."""
    log = log_file("vlserve-run-batch-")
    proc = start_vlserve(["run-batch", *args], stdout=log, stderr=subprocess.STDOUT,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        code = proc.wait(timeout)
    finally:
        stop(proc)
    return code, Path(log.name).read_text()


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen2_vl")


def test_every_kind_of_line_and_resuming(ckpt, tmp_path):
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    requests.write_text("\n".join(INPUT) + "\n")
    results.write_bytes(EARLIER + CUT_SHORT)
    code, log = run_batch("-i", str(requests), "-o", str(results), "--model", str(ckpt), "--dtype", "float32",
                          "--max-model-len", "2048", "--max-batch-line-bytes", str(LINE_LIMIT), timeout=300)
    assert code == 0, log
    assert "3 answered, 11 failed" in log and "2 skipped" in log, log
    written = results.read_bytes()
    assert written.startswith(EARLIER) and CUT_SHORT not in written  # kept as they were; the cut line dropped
    records = [json.loads(line) for line in written[len(EARLIER):].splitlines()]
    assert len(records) == 14  # one per line: not the blank one, nor the two answered before
    for r in records:
        assert r["id"].startswith("batch_req_") and (r["response"] is None) != (r["error"] is None), r

    answers = {r["custom_id"]: r["response"] for r in records if r["response"] is not None}
    assert sorted(answers) == ["picture", "response", "text", "too-hot", *sorted(WRONGLY_TYPED)]
    for custom_id, field in WRONGLY_TYPED.items():
        error = answers[custom_id]["body"]["error"]
        assert answers[custom_id]["status_code"] == 400 and names_field(error["message"], field), error
    assert "Traceback" not in log
    assert answers["too-hot"]["status_code"] == 400
    assert answers["too-hot"]["body"]["error"]["code"] == 400 and "temperature" in answers["too-hot"]["body"][
        "error"]["message"]
    for name in ("text", "picture", "response"):
        assert answers[name]["status_code"] == 200 and answers[name]["request_id"] == answers[name]["body"]["id"]

    errors = {r["error"]["line"]: r for r in records if r["error"] is not None}
    assert {n: (r["error"]["code"], r["custom_id"]) for n, r in errors.items()} == LINE_ERRORS
    assert all(f"line {n}" in r["error"]["message"] for n, r in errors.items())

    # The answers are the offline API's, token for token (greedy).
    offline = LLM(str(ckpt), dtype="float32", max_model_len=2048)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    hello, picture = offline.chat([HELLO, PICTURE], greedy, use_tqdm=False)
    for out, body in ((hello, answers["text"]["body"]), (picture, answers["picture"]["body"])):
        assert body["choices"][0]["message"]["content"] == out.outputs[0].text
        assert body["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
    response = answers["response"]["body"]
    texts = [part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"]]
    assert "".join(texts) == hello.outputs[0].text

    # A run on this output now would send nothing: every non-blank input line is in it.
    done = read_done(str(results))
    with requests.open("rb") as f:
        assert all(item is None or done.has(item) for item in InputLines(f, LINE_LIMIT))


def test_configuration_mistakes_end_the_command_at_once(tmp_path):
    requests, foreign = tmp_path / "requests.jsonl", tmp_path / "notes.txt"
    requests.write_text(request("a", chat_body(HELLO)) + "\n")
    foreign.write_text("my notes\nmore notes\n")
    fifo, busy = tmp_path / "fifo", tmp_path / "busy.jsonl"
    os.mkfifo(fifo)
    cases = [
        (["-i", str(requests), "-o", str(fifo)], f"the output {fifo} is not a regular file (a FIFO)"),  # it hung
        (["-i", str(requests), "-o", str(busy)], f"the output file {busy} is being written by another run"),
        (["-i", str(tmp_path / "missing.jsonl"), "-o", str(tmp_path / "out.jsonl")],
         f"cannot read the input file {tmp_path / 'missing.jsonl'}"),
        (["-i", str(requests), "-o", str(tmp_path / "out.jsonl"), "--max-concurrency", "0"],
         "--max-concurrency must be at least 1"),
        (["-i", str(requests), "-o", str(foreign)], "line 1 of"),
        (["-i", str(requests), "-o", str(tmp_path / "out.jsonl"), "--disagg"], "--disagg"),
    ]
    with open(busy, "ab") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a run in progress holds it
        for args, message in cases:
            code, log = run_batch(*args, timeout=60)
            assert code == EXIT_CONFIG and message in log, (args, log)
    assert foreign.read_text() == "my notes\nmore notes\n"  # not someone else's file to append to


def test_a_full_disk_ends_the_run_with_one_line_and_the_summary(ckpt, tmp_path):
    """It ended with an ExceptionGroup traceback and no summary. /dev/full: every write fails with ENOSPC."""
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(request(f"r{i}", chat_body(HELLO)) + "\n" for i in range(3)))
    code, log = run_batch("-i", str(requests), "-o", "/dev/full", "--model", str(ckpt), "--dtype", "float32",
                          "--max-model-len", "2048", timeout=300)
    assert code == 1, log
    assert "cannot write to the output /dev/full: No space left on device" in log, log
    assert "run-batch stopped: 0 answered, 0 failed" in log, log
    assert "Traceback" not in log and "ExceptionGroup" not in log, log
