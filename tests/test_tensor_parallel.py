"""Tensor parallelism: the split weights, the data-parallel encoder's load balance, token-exact parity at two
ranks (gloo, one process per rank), refused configurations, and a rank that dies."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from tests.conftest import ARCHES, assert_pool_full
from tests.hf_reference import HFReference
from tests.test_parity import _prompts  # the parity suite's mixed workload
from vlserve import LLM, SamplingParams
from vlserve.core.errors import InvalidInputError, TensorParallelError
from vlserve.engine.model_shard import balance
from vlserve.model.layers.parallel import Column, OnFirstRank, Row, TPGroup, Vocab, rule_for
from vlserve.model.loader import load_model

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


# ---- the data-parallel encoder's load balance ---------------------------------------------------------------
def test_balance_gives_the_largest_first_to_the_least_loaded_rank():
    assert balance([1000, 100, 200, 50], 2) == [[0], [2, 1, 3]]
    assert balance([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]  # ties: the lower rank, items in their order
    assert balance([7], 3) == [[0], [], []]  # more ranks than pictures: some encode nothing
    assert balance([], 2) == [[], []]


def test_balance_covers_every_item_once_within_one_item_of_even():
    rng = random.Random(0)
    for _ in range(200):
        sizes = [rng.choice([64, 256, 1024, 1296, 4096]) * rng.randint(1, 3) for _ in range(rng.randint(1, 12))]
        ranks = rng.randint(1, 4)
        shares = balance(sizes, ranks)
        assert sorted(i for s in shares for i in s) == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in s) for s in shares]
        # greedy largest-first: the busiest rank got its last item while it was the least loaded
        assert max(loads) - min(loads) <= max(sizes)


# ---- same-machine collectives --------------------------------------------------------------------------------
def _pair(tmp_path, monkeypatch, slot_bytes: int):
    from vlserve.model.layers import shm_collectives as shm

    monkeypatch.setattr(shm, "SLOT_BYTES", slot_bytes)
    path = tmp_path / "collectives"
    path.write_bytes(b"\0" * shm.file_size(2))
    return [shm.ShmCollectives(str(path), r, 2, timeout_s=30) for r in range(2)]


def _both(ranks, fn):
    """Runs fn(rank object, rank) on two threads (two ranks of one process) and returns both results."""
    out = [None, None]

    def run(r):
        out[r] = fn(ranks[r], r)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a collective hung"
    return out


@pytest.mark.parametrize("slot_bytes", [4 * 2**20, 256])  # one slot, or chunks through small slots
def test_shared_memory_collectives_sum_and_gather_in_rank_order(tmp_path, monkeypatch, slot_bytes):
    ranks = _pair(tmp_path, monkeypatch, slot_bytes)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(37, 19, generator=gen) for _ in range(2)]
    for _ in range(3):  # calls in a row alternate the two sets of slots
        sums = _both(ranks, lambda c, r: c.all_reduce(inputs[r].clone()))
        assert torch.equal(sums[0], sums[1]) and torch.equal(sums[0], inputs[0] + inputs[1])
        gathered = _both(ranks, lambda c, r: c.all_gather(inputs[r].to(torch.bfloat16), dim=1))
        assert torch.equal(gathered[0], torch.cat([inputs[0], inputs[1]], dim=1).to(torch.bfloat16))
        assert torch.equal(gathered[0], gathered[1])


def test_shared_memory_collectives_notice_a_dead_rank(tmp_path, monkeypatch):
    from vlserve.model.layers.shm_collectives import LINE

    ranks = _pair(tmp_path, monkeypatch, 4096)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    ranks[0].control[1 * LINE + 1] = gone.pid  # rank 1's process, now dead, never answers
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 .* is gone"):
        ranks[0].all_reduce(torch.ones(4))
    assert time.monotonic() - t0 < 5


# ---- every rank's share, put back together, is the checkpoint ------------------------------------------------
def _check_shards(path, ranks: int, vision_tp=None):
    whole = dict(load_model(path, dtype="float32").named_parameters())
    models = [load_model(path, dtype="float32", tp=TPGroup(r, ranks), vision_tp=vision_tp) for r in range(ranks)]
    split = 0
    for name, full in whole.items():
        parts = [dict(m.named_parameters())[name].detach() for m in models]
        rules = [rule_for(m, name) for m in models]
        if rules[0] is None:
            assert all(torch.equal(p, full) for p in parts), f"{name}: a replicated tensor differs"
            continue
        split += 1
        rebuilt = torch.full_like(full, float("nan"))
        for rule, part in zip(rules, parts):
            if isinstance(rule, Column):
                offset = 0
                for piece_full_start, s in zip(_starts(rule), rule.pieces.values()):
                    dst = rebuilt.narrow(rule.dim, piece_full_start + s.start, s.size)
                    dst.copy_(part.narrow(rule.dim, offset, s.size))
                    offset += s.size
            elif isinstance(rule, Row):
                rebuilt.narrow(rule.dim, rule.split.start, rule.split.size).copy_(part)
            elif isinstance(rule, Vocab):
                s = rule.split
                rows = min(s.size, s.full - s.start)
                rebuilt[s.start : s.start + rows] = part[:rows]
                assert torch.count_nonzero(part[rows:]) == 0, f"{name}: vocabulary padding must be zero rows"
            else:
                assert isinstance(rule, OnFirstRank)
                rebuilt = parts[0] if rule.rank == 0 else rebuilt
                if rule.rank:
                    assert torch.count_nonzero(part) == 0, f"{name}: a row-parallel bias would count twice"
        assert torch.equal(rebuilt, full), f"{name}: the ranks' shares do not make up the checkpoint"
    return models, split


def _starts(rule: Column) -> list[int]:
    starts, at = [], 0
    for s in rule.pieces.values():
        starts.append(at)
        at += s.full
    return starts


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl_moe"])
def test_two_ranks_shares_make_up_the_checkpoint(tiny_ckpt, arch):
    models, split = _check_shards(tiny_ckpt(arch), 2)
    assert split > 20
    attn = models[1].language_model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # 4 query and 2 key/value heads, halved


def test_more_ranks_than_key_value_heads_copy_them(tiny_ckpt):
    """Four ranks, two key/value heads: ranks 0-1 hold head 0, ranks 2-3 head 1 (the vision tower, whose two
    heads four ranks cannot split, stays whole: the data-parallel encoder's layout)."""
    models, _ = _check_shards(tiny_ckpt("qwen2_vl"), 4, vision_tp=TPGroup())
    qkv = [m.language_model.layers[0].self_attn.qkv_proj.weight for m in models]
    q, kv = models[0].language_model.layers[0].self_attn.q_size, models[0].language_model.layers[0].self_attn.kv_size
    keys = [w[q : q + kv] for w in qkv]
    assert torch.equal(keys[0], keys[1]) and torch.equal(keys[2], keys[3]) and not torch.equal(keys[1], keys[2])


# ---- refused configurations ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel_size": 3}, "does not divide the model's attention heads"),
    ({"tensor_parallel_size": 0}, "positive integer"),
    ({"tensor_parallel_size": 2, "mm_encoder_tp_mode": "pipeline"}, "mm_encoder_tp_mode"),
    ({"tensor_parallel_size": 4}, "vision attention heads .try mm_encoder_tp_mode data"),
])
def test_unsplittable_configurations_are_refused_before_any_rank_starts(tiny_ckpt, kwargs, match):
    with pytest.raises(InvalidInputError, match=match):
        LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", **kwargs)


def test_a_4bit_checkpoint_is_not_split(tiny_ckpt, tmp_path):
    from vlserve.tools.int4_export import export_int4

    path = export_int4(tiny_ckpt("qwen2_vl"), tmp_path / "awq", "awq", 32)
    with pytest.raises(InvalidInputError, match="AWQ 4-bit checkpoints cannot be split"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2)


# ---- two ranks, token for token -----------------------------------------------------------------------------
def _requests(prompts):
    return [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in prompts]


@pytest.fixture(scope="module")
def expected(tiny_ckpt):
    made = {}

    def get(arch):
        if arch not in made:
            hf = HFReference(arch, tiny_ckpt(arch))
            made[arch] = [hf.greedy(p, imgs, MAX_NEW) for p, imgs in _prompts()]
        return made[arch]

    return get


@pytest.mark.parametrize("arch, mode, collectives", [(arch, mode, "shm") for arch in ARCHES for mode in
                                                     ("weights", "data")] + [("qwen2_vl", "weights", "gloo")])
def test_two_ranks_match_transformers_batched_chunked_and_preempted(tiny_ckpt, expected, monkeypatch, arch, mode,
                                                                     collectives):
    """Two ranks, every prompt in one batch: a 16-token step budget splits pictures across steps, a pool of 40
    four-token blocks forces preemptions; then again in another order, with prefix-cache hits. Collectives
    through shared memory (ranks on one machine), and once through gloo (as between machines)."""
    if collectives == "gloo":
        monkeypatch.setenv("VLSERVE_TP_SHM", "0")
    want = expected(arch)
    llm = LLM(str(tiny_ckpt(arch)), dtype="float32", tensor_parallel_size=2, mm_encoder_tp_mode=mode,
              num_kv_blocks=40, block_size=4, max_num_batched_tokens=16)
    try:
        outs = llm.generate(_requests(_prompts()), GREEDY, use_tqdm=False)
        for i, out in enumerate(outs):
            assert out.prompt_token_ids == want[i][0]
            assert out.outputs[0].token_ids == want[i][1], f"prompt {i} differs at two ranks ({mode})"
        assert llm.engine.core.scheduler.num_preemptions > 0
        order = [5, 2, 8, 0, 6, 1, 7, 4, 3]
        outs = llm.generate(_requests([_prompts()[i] for i in order]), GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [want[i][1] for i in order]
        assert llm.engine.core.scheduler.kv.prefix_hits > 0
        assert_pool_full(llm)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch, mode", [("qwen3_vl", "data"), ("qwen3_5_moe", "weights")])
def test_two_ranks_match_one_for_qwen3(tiny_ckpt, arch, mode):
    """DeepStack features, and (Qwen3.5-MoE) MoE experts with a shared expert and the linear attention's heads,
    states and conv channels, split over ranks give the single-device tokens (which test_qwen3_vl /
    test_qwen3_5_parity check against transformers). Qwen3-VL-MoE at two ranks: test_lora_parity's
    two-rank test (its base-model rows included)."""
    path = str(tiny_ckpt(arch))
    one = LLM(path, dtype="float32", num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in one.generate(_requests(_prompts()), GREEDY, use_tqdm=False)]
    two = LLM(path, dtype="float32", num_kv_blocks=256, tensor_parallel_size=2, mm_encoder_tp_mode=mode,
              max_num_batched_tokens=32)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(_requests(_prompts()), GREEDY, use_tqdm=False)]
        assert got == want
        assert_pool_full(two)
    finally:
        two.shutdown()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL); the CPU tests above run "
                    "the same model code through gloo and shared memory")
def test_two_gpus_match_one(tiny_ckpt):
    path = str(tiny_ckpt("qwen2_5_vl"))
    one = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256)
    want = [o.outputs[0].token_ids for o in one.generate(_requests(_prompts()), GREEDY, use_tqdm=False)]
    del one
    for mode in ("weights", "data"):
        two = LLM(path, dtype="float32", device="cuda", num_kv_blocks=256, tensor_parallel_size=2,
                  mm_encoder_tp_mode=mode)
        try:
            assert [o.outputs[0].token_ids for o in two.generate(_requests(_prompts()), GREEDY, use_tqdm=False)] == want
        finally:
            two.shutdown()


# ---- a rank that dies ---------------------------------------------------------------------------------------
def _collective_files() -> list[str]:
    """The same-machine collectives' files of engines this process ran (tests in other workers run their own)."""
    from vlserve.engine.transfer_buffers import shm_dir

    folder = shm_dir()
    return sorted(f for f in os.listdir(folder) if f.startswith(f"vlserve-tp-{os.getpid()}-")) if folder else []


def test_a_dead_rank_stops_the_engine_with_a_clear_error(tiny_ckpt):
    llm = LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", tensor_parallel_size=2, num_kv_blocks=512)
    leader = llm.engine.core.runner.executor
    worker = leader.procs[0]
    try:
        assert llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        # killed in the middle of a long generation: the step in flight fails, nothing waits
        errors = []

        def long_run():
            try:
                llm.generate(["a long one"] * 4, SamplingParams(max_tokens=1000, ignore_eos=True), use_tqdm=False)
            except Exception as e:  # noqa: BLE001 - what the test inspects
                errors.append(e)

        t = threading.Thread(target=long_run)
        t.start()
        time.sleep(1.0)
        worker.kill()
        t.join(30)
        assert not t.is_alive(), "generation hung after a rank died"
        assert len(errors) == 1 and isinstance(errors[0], TensorParallelError), errors
        assert "rank 1" in str(errors[0])
        with pytest.raises(TensorParallelError, match="rank 1 exited"):  # and every later call says so at once
            llm.generate(["Hello"], GREEDY, use_tqdm=False)
    finally:
        t0 = time.monotonic()
        llm.shutdown()
        assert time.monotonic() - t0 < 15
    assert _collective_files() == []
    assert torch.get_num_threads() == int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))


def _children_running(module: str) -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            children = open(f"/proc/self/task/{task}/children").read().split()
        except OSError:
            continue
        for pid in children:
            try:
                if module in open(f"/proc/{pid}/cmdline").read():
                    pids.append(int(pid))
            except OSError:
                pass
    return pids


def test_a_rank_that_dies_while_starting_fails_the_start_at_once(tiny_ckpt):
    errors = []

    def start():
        try:
            LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)
        except Exception as e:  # noqa: BLE001 - what the test inspects
            errors.append(e)

    t = threading.Thread(target=start)
    t.start()
    deadline = time.monotonic() + 20
    while not (workers := _children_running("vlserve.engine.tp.worker")):
        assert time.monotonic() < deadline, "no rank process was started"
        time.sleep(0.01)
    os.kill(workers[0], signal.SIGKILL)
    t.join(30)
    assert not t.is_alive(), "the start hung on a dead rank"
    assert len(errors) == 1 and isinstance(errors[0], TensorParallelError) and "rank 1 exited" in str(errors[0])
    assert _collective_files() == [], "the shared file of a failed start was left behind"
    assert _children_running("vlserve.engine.tp.worker") == []


def test_torchrun_ranks_meet_through_env(tiny_ckpt, tmp_path):
    """torchrun starts both ranks (`env://`); rank 0 runs the demo, rank 1 becomes a worker by itself, and the
    answer is the single-device one."""
    path = str(tiny_ckpt("qwen2_vl"))
    demo = ["-m", "vlserve", "demo", "--model", path, "--dtype", "float32", "--max-tokens", "8",
            "--num-kv-blocks", "64"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, *demo], capture_output=True, text=True, timeout=120, env=env)
    assert one.returncode == 0, one.stderr[-2000:]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *demo, "--tensor-parallel-size", "2"]
    two = subprocess.run(run, capture_output=True, text=True, timeout=120, env=env,
                         start_new_session=True)
    assert two.returncode == 0, two.stderr[-3000:]
    assert one.stdout.splitlines()[-1] == two.stdout.splitlines()[-1]
    assert "running as a tensor-parallel worker" in two.stderr


def test_server_with_two_ranks_answers_then_reports_a_dead_rank(tiny_ckpt):
    from tests.server_utils import RemoteServer

    with RemoteServer(tiny_ckpt("qwen2_vl"), "--dtype", "float32", "--tensor-parallel-size", "2",
                      "--num-kv-blocks", "64") as server:
        body = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        first = server.post("/v1/completions", json=body)
        assert first.status_code == 200, first.text
        engine = server.engine_pid()
        ranks = [int(p) for p in open(f"/proc/{engine}/task/{engine}/children").read().split()]
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        assert server.proc.wait(30) == 1, "the server kept running after a rank died"  # its supervisor restarts it
        assert "tensor-parallel rank 1" in server.read_log()
        for _ in range(100):  # the engine process exits
            if not os.path.exists(f"/proc/{engine}") or open(f"/proc/{engine}/stat").read().split()[2] == "Z":
                break
            time.sleep(0.1)
        else:
            raise AssertionError("the engine process did not exit")


def test_serve_disagg_hands_the_tensor_parallel_flags_to_every_model_role():
    """The encode role honours them too (its tower loads like the engine's model), and so do prefill and decode
    instances (their KV rows hold every head, tests/test_pd_handoff.py): none is dropped."""
    from vlserve.core.config import Options
    from vlserve.disagg.launcher import plan_children

    opts = Options()
    opts.engine.model, opts.engine.tensor_parallel_size, opts.engine.mm_encoder_tp_mode = "/m", 2, "data"
    argv = {c.name: c.argv for c in plan_children(opts, "INFO")}
    assert "--mm-encoder-tp-mode" in argv["encoder-0"] and "--mm-encoder-tp-mode" not in argv["language"]
    for role in ("encoder-0", "language"):
        assert argv[role][argv[role].index("--tensor-parallel-size") + 1] == "2"
    opts.disagg.num_prefill = opts.disagg.num_decode = 1
    argv = {c.name: c.argv for c in plan_children(opts, "INFO")}
    for role in ("encoder-0", "prefill-0", "decode-0"):
        assert argv[role][argv[role].index("--tensor-parallel-size") + 1] == "2", role
    # each instance kind at a size of its own (the KV is re-sharded by heads between them)
    opts.disagg.prefill_tensor_parallel_size, opts.disagg.decode_tensor_parallel_size = 1, 3
    argv = {c.name: c.argv for c in plan_children(opts, "INFO")}
    for role, ranks in (("encoder-0", "2"), ("prefill-0", "1"), ("decode-0", "3")):
        assert argv[role].count("--tensor-parallel-size") == 1, role
        assert argv[role][argv[role].index("--tensor-parallel-size") + 1] == ranks, role
    opts.engine.tensor_parallel_size = 1  # not written out at its default: the role's own size still is
    argv = {c.name: c.argv for c in plan_children(opts, "INFO")}
    assert argv["decode-0"][argv["decode-0"].index("--tensor-parallel-size") + 1] == "3"
    assert "--tensor-parallel-size" not in argv["encoder-0"]
    opts.disagg.num_prefill = opts.disagg.num_decode = 0  # E->PD has no such instances: refused, not ignored
    with pytest.raises(InvalidInputError, match="--num-prefill P --num-decode D"):
        plan_children(opts, "INFO")


def test_language_server_with_two_ranks_takes_pictures_from_an_encoder(tiny_ckpt):
    """E->PD with a tensor-parallel language server: rank 0 reads the encoder's rows from its receive blocks and
    hands them to every rank with the step; the answers are the aggregated single-device ones."""
    from tests.test_disagg import CASES, Cluster, ask, expected_text, wait_language_blocks_free

    offline = LLM(str(tiny_ckpt("qwen2_vl")), dtype="float32", max_model_len=2048, limit_mm_per_prompt={"image": 4})
    cluster = Cluster(tiny_ckpt("qwen2_vl"), {"tp": ["--tensor-parallel-size", "2"]})
    try:
        cluster.wait_encoders("tp", 1)
        for name, messages in CASES.items():
            assert ask(cluster.client("tp"), messages) == expected_text(offline, messages), name
        wait_language_blocks_free(lambda: cluster.metrics("tp"))
    finally:
        cluster.close()
