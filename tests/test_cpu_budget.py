"""The CPU budget (affinity and cgroup quotas, read from fake /proc and /sys trees), the precedence of
--cpu-threads / OMP_NUM_THREADS / the budget, and where the budget is applied. Starts no engine."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from vlserve.core.cpu_budget import CpuBudget, cpu_budget, media_pool_size, plan_threads, short_spin_waits

V2_MOUNT = "29 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate"
V1_MOUNT = "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct"
POD = "/kubepods/burstable/pod1/c1"


def tree(root, cgroup: str | None = None, mountinfo: list[str] | None = None, **files: str):
    """A fake root: /proc/self/cgroup, /proc/self/mountinfo and files by path (`sys/fs/cgroup/...`)."""
    (root / "proc/self").mkdir(parents=True, exist_ok=True)
    if cgroup is not None:
        (root / "proc/self/cgroup").write_text(cgroup)
    if mountinfo is not None:
        (root / "proc/self/mountinfo").write_text("\n".join(mountinfo) + "\n")
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def v2(root, own: str = POD, **cpu_max: str):
    """cgroup v2 with `cpu.max` at the given levels (keyword: a path under /sys/fs/cgroup, `__` for `/`)."""
    files = {f"sys/fs/cgroup/{k.replace('__', '/')}/cpu.max".replace("//", "/"): v for k, v in cpu_max.items()}
    (root / "sys/fs/cgroup" / own.lstrip("/")).mkdir(parents=True, exist_ok=True)
    return tree(root, f"0::{own}\n", [V2_MOUNT], **files)


def test_a_fractional_v2_quota_rounds_up(tmp_path):
    b = cpu_budget(v2(tmp_path, kubepods__burstable__pod1__c1="150000 100000"), affinity=64)
    assert (b.cpus, b.affinity) == (2, 64)
    assert b.reason() == "cgroup v2 cpu.max 150000/100000 on 64 cores in affinity"
    half = cpu_budget(v2(tmp_path / "half", kubepods__burstable__pod1__c1="50000 100000"), affinity=64)
    assert half.cpus == 1  # never below one


def test_no_v2_limit_leaves_the_affinity(tmp_path):
    b = cpu_budget(v2(tmp_path, kubepods__burstable__pod1__c1="max 100000"), affinity=8)
    assert (b.cpus, b.quota) == (8, None)
    assert b.reason() == "8 cores in affinity, no CPU quota"
    roomy = cpu_budget(v2(tmp_path / "roomy", kubepods__burstable__pod1__c1="1600000 100000"), affinity=8)
    assert roomy.cpus == 8 and "within cgroup v2 cpu.max 1600000/100000" in roomy.reason()


def test_a_parent_limit_smaller_than_the_childs_wins(tmp_path):
    root = v2(tmp_path, kubepods__burstable__pod1__c1="400000 100000", kubepods__burstable__pod1="200000 100000",
              kubepods="max 100000")
    b = cpu_budget(root, affinity=64)
    assert b.cpus == 2
    assert b.quota.cgroup == "/kubepods/burstable/pod1" and not b.quota.own
    assert "of parent cgroup /kubepods/burstable/pod1" in b.reason()


def test_cgroup_v1_quota(tmp_path):
    d = "sys/fs/cgroup/cpu,cpuacct/docker/abc"
    root = tree(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n",
                [V1_MOUNT], **{f"{d}/cpu.cfs_quota_us": "300000\n", f"{d}/cpu.cfs_period_us": "100000\n",
                               "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "-1\n",
                               "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    b = cpu_budget(root, affinity=64)
    assert b.cpus == 3 and b.quota.source.startswith("cgroup v1") and b.quota.own
    # Docker without a cgroup namespace: the container's own cgroup is mounted as the top, named by its path
    inside = tree(tmp_path / "ns", "4:cpu,cpuacct:/docker/abc\n",
                  ["32 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct"],
                  **{"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "100000", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"})
    assert cpu_budget(inside, affinity=64).cpus == 1


def test_hybrid_v1_and_v2_take_the_smaller(tmp_path):
    root = tree(tmp_path, "4:cpu,cpuacct:/\n0::/\n",
                [V1_MOUNT, "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw"],
                **{"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "500000",
                   "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000",
                   "sys/fs/cgroup/unified/cpu.max": "300000 100000"})
    assert cpu_budget(root, affinity=64).cpus == 3


def test_missing_files_leave_the_affinity(tmp_path):
    assert cpu_budget(tmp_path, affinity=6) == CpuBudget(6, 6, None)
    no_files = tree(tmp_path / "dirs", "0::/a/b\n", [V2_MOUNT])  # the cgroup is named, its folder is not there
    assert cpu_budget(no_files, affinity=6).cpus == 6
    assert cpu_budget(affinity=3).cpus <= 3  # this machine's real files, whatever they say


@pytest.mark.parametrize("cpu_max", ["garbage", "", "-5 100000", "100000 0", "1e5 1e5", "max", "\x00\xff 7"])
def test_garbage_sets_no_limit_and_never_raises(tmp_path, cpu_max):
    assert cpu_budget(v2(tmp_path, kubepods__burstable__pod1__c1=cpu_max), affinity=4).cpus == 4


def test_garbage_proc_files_never_raise(tmp_path):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_bytes(b"\xff\xfe::/../../x\n0::relative\n::\n")
    (tmp_path / "proc/self/mountinfo").write_bytes(b"1 2 - cgroup2\nnot a mount line\n\xff\n")
    assert cpu_budget(tmp_path, affinity=5).cpus == 5
    escape = tree(tmp_path / "escape", "0::/../../etc\n", [V2_MOUNT], **{"sys/fs/cgroup/cpu.max": "100000 100000"})
    assert cpu_budget(escape, affinity=5).cpus == 1  # a path outside the mount counts as its top, never ../


TWO_OF_64 = CpuBudget(2, 64, None)


def test_precedence_cpu_threads_then_omp_then_budget():
    assert plan_threads(None, budget=TWO_OF_64, env={}).torch_threads == 2
    omp = plan_threads(None, budget=TWO_OF_64, env={"OMP_NUM_THREADS": "8"})
    assert (omp.torch_threads, omp.total, omp.omp) == (8, 2, 8)
    assert "OMP_NUM_THREADS=8 in the environment wins" in omp.describe()
    flag = plan_threads(3, budget=TWO_OF_64, env={"OMP_NUM_THREADS": "8"})
    assert (flag.torch_threads, flag.total, flag.omp) == (3, 3, None)
    assert flag.describe(3).startswith("CPU budget: 3 threads (--cpu-threads 3; derived 2: ")
    for junk in ("", "zero", "0", "-2"):  # not a count OpenMP would take: the budget
        assert plan_threads(None, budget=TWO_OF_64, env={"OMP_NUM_THREADS": junk}).torch_threads == 2
    assert plan_threads(None, budget=TWO_OF_64, env={"OMP_NUM_THREADS": "4,2"}).torch_threads == 4


def test_tensor_parallel_ranks_share_the_budget():
    assert plan_threads(None, ranks=2, budget=CpuBudget(4, 64, None), env={}).torch_threads == 2
    assert plan_threads(None, ranks=4, budget=TWO_OF_64, env={}).torch_threads == 1
    assert plan_threads(6, ranks=2, budget=TWO_OF_64, env={}).torch_threads == 3
    assert plan_threads(None, ranks=2, budget=TWO_OF_64, env={"OMP_NUM_THREADS": "5"}).torch_threads == 5  # per rank


def test_the_media_pool_follows_the_budget_unless_set():
    assert [media_pool_size(None, n) for n in (1, 2, 4, 64)] == [1, 2, 4, 4]
    assert media_pool_size(7, 2) == 7


def test_the_log_line(tmp_path):
    budget = cpu_budget(v2(tmp_path, kubepods__burstable__pod1__c1="200000 100000"), affinity=64)
    assert plan_threads(None, budget=budget, env={}).describe(2) == (
        "CPU budget: 2 threads (cgroup v2 cpu.max 200000/100000 on 64 cores in affinity); torch 2 threads, "
        "media pool 2")
    assert plan_threads(None, budget=budget, env={"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}).describe().endswith(
        "torch 2 threads; OpenMP waits: GOMP_SPINCOUNT=10000, KMP_BLOCKTIME=1")


def test_waiting_threads_spin_briefly_unless_the_user_chose_how_they_wait():
    env: dict[str, str] = {}
    assert short_spin_waits(env) and env == {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}
    for name, value in (("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "0")):
        chosen = {name: value}
        assert not short_spin_waits(chosen) and chosen == {name: value}


def test_the_cli_sets_it_before_torch_loads_and_children_inherit_it():
    """OpenMP reads the policy when torch loads it: the CLI must set it first, and the engine process (spawned)
    inherits the environment."""
    code = ("import os, sys; from vlserve.cli import main; "
            "sys.argv = ['vlserve', 'make-tiny-model', '--help']\n"
            "try: main()\nexcept SystemExit: pass\n"
            "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split()[-2:] == ["10000", "False"], out.stdout + out.stderr


def test_the_offline_api_sets_it_too_when_it_comes_before_torch():
    """`from vlserve import LLM` waits as the server does (before torch loads OpenMP); a user's own choice stays,
    and after torch nothing can change it (LLM says so in its log)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}

    def run(code: str, **extra) -> list[str]:
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()

    show = "import os, sys; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"
    assert run(f"from vlserve import LLM; {show}") == ["10000", "None"]
    assert run(f"from vlserve import LLM; {show}", OMP_WAIT_POLICY="PASSIVE") == ["None", "PASSIVE"]
    assert run(f"import torch; from vlserve import LLM; {show}") == ["None", "None"]


def test_the_engine_thread_setup_applies_the_plan(monkeypatch, caplog):
    import torch

    from vlserve.core import cpu_budget as budget_module
    from vlserve.engine.cpu_threads import apply_cpu_threads

    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(budget_module, "cpu_budget", lambda: CpuBudget(target, 64, None))
    try:
        with caplog.at_level(logging.INFO, logger="vlserve.hardware"):
            undo = apply_cpu_threads(None, media_pool=3)
        assert torch.get_num_threads() == target
        assert f"CPU budget: {target} threads (64 cores in affinity, no CPU quota)" in caplog.text
        assert "media pool 3" in caplog.text
        undo()
        assert torch.get_num_threads() == before
        apply_cpu_threads(target, ranks=1)()  # --cpu-threads, and its undo
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_tensor_parallel_pinning_uses_the_budget(monkeypatch):
    import torch

    from vlserve.engine.tp import placement

    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores in the affinity mask")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(placement, "plan_threads", lambda n, ranks: plan_threads(n, ranks, CpuBudget(2, 64, None)))
    before = torch.get_num_threads()
    undo = placement.pin_cores(0, 2)
    try:
        assert torch.get_num_threads() == 1  # a share of the 2-CPU budget, not of the cores
    finally:
        undo()
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("role", ["serve", "language", "decode", "prefill", "encode", "demo"])
def test_the_flag_is_in_every_model_roles_help(role, capsys):
    from vlserve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([role, "--help"])
    assert "--cpu-threads N" in capsys.readouterr().out


@pytest.mark.parametrize("role", ["router", "bootstrap"])
def test_roles_without_a_model_have_no_flag(role, capsys):
    from vlserve.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args([role, "--help"])
    assert "--cpu-threads" not in capsys.readouterr().out


def test_zero_threads_is_refused_at_start(caplog):
    from vlserve.cli import main
    from vlserve.core.config import EngineArgs
    from vlserve.core.errors import EXIT_CONFIG, InvalidInputError

    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--model", "/no/such/model", "--cpu-threads", "0"]) == EXIT_CONFIG
    assert "--cpu-threads must be at least 1, got 0" in caplog.text
    with pytest.raises(InvalidInputError, match="cpu_threads"):  # the Python API: LLM(cpu_threads=0)
        EngineArgs(model="m", cpu_threads=0).check()
    with pytest.raises(InvalidInputError, match="cpu_threads"):
        EngineArgs(model="m", cpu_threads=1.5).check()


def test_serve_disagg_splits_the_budget_between_roles(monkeypatch):
    from vlserve.core.config import Options
    from vlserve.disagg import launcher

    opts = Options()
    opts.engine.model = "/m"
    opts.disagg.num_encoders, opts.disagg.num_prefill, opts.disagg.num_decode = 1, 1, 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(launcher, "cpu_budget", lambda: CpuBudget(6, 64, None))  # a 6-CPU quota on 64 cores
    children = {c.name: c for c in launcher.plan_children(opts, "INFO")}
    assert {n: c.env.get("OMP_NUM_THREADS") for n, c in children.items()} == {
        "bootstrap": None, "encoder-0": "2", "prefill-0": "2", "decode-0": "2"}
    opts.engine.cpu_threads = 9  # the machine's, split: each role gets --cpu-threads 3 (which wins over OMP there)
    children = {c.name: c for c in launcher.plan_children(opts, "INFO")}
    for name in ("encoder-0", "prefill-0", "decode-0"):
        argv = children[name].argv
        assert argv[argv.index("--cpu-threads") + 1] == "3" and "OMP_NUM_THREADS" not in children[name].env
    assert "--cpu-threads" not in children["bootstrap"].argv
    opts.disagg.num_prefill = opts.disagg.num_decode = 0  # E->PD: every role keeps all of it
    for child in launcher.plan_children(opts, "INFO")[1:]:
        assert child.argv[child.argv.index("--cpu-threads") + 1] == "9"
