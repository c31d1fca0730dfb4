"""How many CPUs this process may really use, and how vlserve sizes its threads from that.

os.cpu_count() is the node's cores: in a pod limited to 2 CPUs on a 64-core node torch would start 64 threads,
which the CFS quota then throttles in turn (oneDNN's threads wait on each other: TPOT 4 ms -> 240 ms). The budget
is the smallest of the affinity mask and every cgroup CPU quota above this process (v2 `cpu.max`, v1
`cpu.cfs_quota_us` / `cpu.cfs_period_us`; nested limits all apply, so each level up to the root counts). A
fractional quota rounds up (1.5 CPUs -> 2 threads). A file that is missing or unreadable sets no limit.

Precedence of torch's thread count: `--cpu-threads` > an explicit OMP_NUM_THREADS > the budget. Standard library
only: `--help` and every layer may use it.
"""

from __future__ import annotations

import asyncio
import math
import os
from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

OMP_ENV = "OMP_NUM_THREADS"
WAIT_POLICY_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")  # a user's choice of how threads wait
# How long an OpenMP thread waiting at a barrier spins before it sleeps (see short_spin_waits): GNU OpenMP (torch's
# wheels) in spins, Intel's (when preloaded) in milliseconds.
SHORT_SPIN = {"GOMP_SPINCOUNT": "10000", "KMP_BLOCKTIME": "1"}
MEDIA_POOL_MAX = 4  # media threads when not set: what the pool had before, fewer under a smaller budget
V2_DEFAULT_MOUNT, V1_DEFAULT_MOUNT = "/sys/fs/cgroup", "/sys/fs/cgroup/cpu"


@dataclass(frozen=True)
class Quota:
    quota_us: int
    period_us: int
    source: str  # "cgroup v2 cpu.max" or "cgroup v1 cpu.cfs_quota_us/cpu.cfs_period_us"
    cgroup: str  # the cgroup that sets it, as /proc/self/cgroup names it
    own: bool  # this process's own cgroup (not a parent's)

    @property
    def cpus(self) -> int:
        return max(1, math.ceil(self.quota_us / self.period_us))

    def describe(self) -> str:
        where = "" if self.own else f" of parent cgroup {self.cgroup}"
        return f"{self.source} {self.quota_us}/{self.period_us}{where}"


@dataclass(frozen=True)
class CpuBudget:
    cpus: int  # threads this process may keep busy at once
    affinity: int  # cores in its affinity mask
    quota: Quota | None  # the tightest cgroup quota, None without one

    def reason(self) -> str:
        cores = f"{self.affinity} cores in affinity"
        if self.quota is None:
            return f"{cores}, no CPU quota"
        if self.quota.cpus < self.affinity:
            return f"{self.quota.describe()} on {cores}"
        return f"{cores}, within {self.quota.describe()}"


def cpu_budget(root: str | os.PathLike = "/", affinity: int | None = None) -> CpuBudget:
    """This process's CPU budget. `root`: where /proc and /sys are (tests pass a fake tree); `affinity`: the
    affinity mask's size (default: this process's)."""
    root = Path(root)
    cores = _affinity() if affinity is None else max(1, affinity)
    quotas = [q for q in (_v2_quota(root), _v1_quota(root)) if q is not None]
    tightest = min(quotas, key=lambda q: q.quota_us / q.period_us, default=None)
    return CpuBudget(min(cores, tightest.cpus) if tightest else cores, cores, tightest)


@dataclass(frozen=True)
class ThreadPlan:
    budget: CpuBudget
    total: int  # CPUs this process works with: --cpu-threads, else the budget
    torch_threads: int  # torch's intra-op threads of this process (a tensor-parallel rank: its share)
    ranks: int
    cpu_threads: int | None  # --cpu-threads as given
    omp: int | None  # OMP_NUM_THREADS when it set torch_threads
    waits: str = ""  # how OpenMP threads wait, as set in the environment (short_spin_waits, or the user)

    def describe(self, media_pool: int | None = None) -> str:
        why = self.budget.reason()
        if self.cpu_threads is not None:
            why = f"--cpu-threads {self.cpu_threads}; derived {self.budget.cpus}: {why}"
        torch = f"torch {self.torch_threads} thread{'s' if self.torch_threads != 1 else ''}"
        if self.ranks > 1:
            torch += f" per rank of {self.ranks}"
        if self.omp is not None:
            torch += f" ({OMP_ENV}={self.omp} in the environment wins over the budget)"
        pool = "" if media_pool is None else f", media pool {media_pool}"
        waits = f"; OpenMP waits: {self.waits}" if self.waits else ""
        return f"CPU budget: {self.total} threads ({why}); {torch}{pool}{waits}"


def plan_threads(cpu_threads: int | None = None, ranks: int = 1, budget: CpuBudget | None = None,
                 env: Mapping[str, str] | None = None) -> ThreadPlan:
    """Torch's threads for one process of `ranks` sharing this machine's budget (tensor parallelism): each rank a
    share of --cpu-threads, else OMP_NUM_THREADS as set (it is per process already), else a share of the budget."""
    budget = budget or cpu_budget()
    env = os.environ if env is None else env
    ranks = max(1, ranks)
    total = cpu_threads if cpu_threads is not None else budget.cpus
    omp = None if cpu_threads is not None else omp_threads(env)
    threads = omp if omp is not None else max(1, total // ranks)
    waits = ", ".join(f"{name}={env[name]}" for name in WAIT_POLICY_ENV if name in env)
    return ThreadPlan(budget, total, threads, ranks, cpu_threads, omp, waits)


def short_spin_waits(env: MutableMapping[str, str] | None = None) -> bool:
    """OpenMP threads that wait at a barrier spin briefly, then sleep (GOMP_SPINCOUNT=10000; KMP_BLOCKTIME=1 for
    Intel's runtime), unless the user chose how they wait (OMP_WAIT_POLICY, GOMP_SPINCOUNT or KMP_BLOCKTIME set).
    Both ends cost: GNU OpenMP's default ~300,000 spins burn, on cores something else also wants (other
    processes, the front end beside the engine, a CFS quota), the time slice of the thread they wait for, once per
    parallel region (small model, 2 busy processes beside the server: TPOT 208 ms spinning, 19 ms sleeping); not
    spinning at all (OMP_WAIT_POLICY=PASSIVE) puts a futex wake-up, tens of microseconds on a VM, on each of a
    decode step's ~60 regions (medium model int8, quiet 2-core Intel: TPOT 24 ms passive, 15 ms with the short
    spin; busy, 44 and 32). Set before torch is imported (OpenMP reads it when it loads): the CLI does it first,
    and the engine process, tensor-parallel ranks and roles inherit it. Returns whether it set anything."""
    env = os.environ if env is None else env
    if any(name in env for name in WAIT_POLICY_ENV):
        return False
    env.update(SHORT_SPIN)
    return True


def omp_threads(env: Mapping[str, str]) -> int | None:
    """A positive OMP_NUM_THREADS (its first level, as OpenMP reads "8,2"); None when unset or not a number."""
    text = env.get(OMP_ENV, "").split(",")[0].strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def media_pool_size(media_threads: int | None, total: int) -> int:
    """--media-threads when given; else the budget, at most MEDIA_POOL_MAX."""
    return media_threads if media_threads is not None else max(1, min(MEDIA_POOL_MAX, total))


def default_pool_size(total: int) -> int:
    """asyncio's default executor (run_in_executor(None, ...)): Python's min(32, cpu_count + 4), from the budget."""
    return min(32, total + 4)


def size_default_executor(cpu_threads: int | None = None) -> int:
    """Replaces the running loop's default executor (sized from os.cpu_count(): 32 threads on a big node whatever
    the quota) with one sized from the budget; call before anything uses it. Returns its size."""
    workers = default_pool_size(cpu_threads if cpu_threads is not None else cpu_budget().cpus)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(workers, thread_name_prefix="vlserve-io"))
    return workers


# ---- reading the system ----------------------------------------------------------------------------------------
def _affinity() -> int:
    if hasattr(os, "sched_getaffinity"):
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except OSError:
            pass
    return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read(4096)
    except (OSError, ValueError):  # missing, unreadable, not text
        return None


def _own_cgroups(root: Path) -> dict[str, str]:
    """/proc/self/cgroup: hierarchy -> path; "" is the v2 hierarchy ("0::/path"), else v1 controller names."""
    found = {}
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[2].startswith("/"):
            if parts[1] == "":
                found[""] = parts[2]
            for controller in filter(None, parts[1].split(",")):
                found[controller] = parts[2]
    return found


def _mounts(root: Path) -> list[tuple[str, str, str, set[str]]]:
    """/proc/self/mountinfo's cgroup mounts: (root in the hierarchy, mount point, fstype, super options)."""
    mounts = []
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and len(tail) >= 3 and tail[0] in ("cgroup", "cgroup2"):
            mounts.append((_unescape(fields[3]), _unescape(fields[4]), tail[0], set(tail[2].split(","))))
    return mounts


def _unescape(text: str) -> str:  # mountinfo writes space, tab, newline and backslash as \ooo
    try:
        return text.encode("ascii").decode("unicode_escape") if "\\" in text else text
    except (UnicodeError, ValueError):
        return text


def _levels(root: Path, own: str, mount_root: str, mount_point: str) -> list[tuple[Path, str]]:
    """The directories of this process's cgroup and each parent up to the mount's top, with their cgroup names.
    A path outside what is mounted here (another cgroup namespace) leaves only the mount's top."""
    top = root / mount_point.lstrip("/")
    rel = own[len(mount_root):] if own == mount_root or own.startswith(mount_root.rstrip("/") + "/") else None
    parts = [p for p in (rel or "").split("/") if p]
    if rel is None or ".." in parts or not (top.joinpath(*parts)).is_dir():
        return [(top, mount_root)]
    levels = []
    for n in range(len(parts), -1, -1):
        name = mount_root.rstrip("/") + "/" + "/".join(parts[:n])
        levels.append((top.joinpath(*parts[:n]), name.rstrip("/") or "/"))
    return levels


def _tightest(levels: list[tuple[Path, str]], read, source: str) -> Quota | None:
    best = None
    for i, (folder, name) in enumerate(levels):
        q = read(folder)
        if q is not None and (best is None or q[0] / q[1] < best.quota_us / best.period_us):
            best = Quota(q[0], q[1], source, name, i == 0)
    return best


def _v2_quota(root: Path) -> Quota | None:
    own = _own_cgroups(root).get("")
    if own is None:
        return None
    mount = next(((r, p) for r, p, kind, _ in _mounts(root) if kind == "cgroup2"), ("/", V2_DEFAULT_MOUNT))
    return _tightest(_levels(root, own, *mount), _read_cpu_max, "cgroup v2 cpu.max")


def _v1_quota(root: Path) -> Quota | None:
    own = _own_cgroups(root).get("cpu")
    if own is None:
        return None
    mount = next(((r, p) for r, p, kind, opts in _mounts(root) if kind == "cgroup" and "cpu" in opts),
                 ("/", V1_DEFAULT_MOUNT))
    return _tightest(_levels(root, own, *mount), _read_cfs, "cgroup v1 cpu.cfs_quota_us/cfs_period_us")


def _read_cpu_max(folder: Path) -> tuple[int, int] | None:
    """`cpu.max`: "QUOTA PERIOD" in microseconds, "max PERIOD" without a limit."""
    fields = (_read(folder / "cpu.max") or "").split()
    return _positive(fields[0], fields[1]) if len(fields) == 2 else None


def _read_cfs(folder: Path) -> tuple[int, int] | None:
    """v1: `cpu.cfs_quota_us` (-1 without a limit) over `cpu.cfs_period_us`."""
    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
    return None if quota is None or period is None else _positive(quota.strip(), period.strip())


def _positive(quota: str, period: str) -> tuple[int, int] | None:
    if not (quota.isdigit() and period.isdigit()) or int(quota) <= 0 or int(period) <= 0:
        return None  # "max", -1, garbage: no limit from here
    return int(quota), int(period)
