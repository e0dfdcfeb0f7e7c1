"""Shared fixtures: a cache of gloo worlds, reused across the whole session; the
thread counts of tolerance tests; a one-rank gloo group; the launch tests' tiny model
(``tiny_flags``) and an in-memory store for the failure handling (``FakeStore``), which
tests import from here; and the durations of every run, kept."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from hla_sp.testing import World


@pytest.fixture(scope="session")
def world() -> Iterator[Callable[[int], World]]:
    """``world(P)`` returns a live P-rank gloo world, started once per session."""
    cache: dict[int, World] = {}

    def get(world_size: int) -> World:
        if world_size not in cache:
            cache[world_size] = World(world_size)
        return cache[world_size]

    yield get
    for w in cache.values():
        w.close()


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def num_threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """Run a tolerance test at 1 and at 2 intra-op threads (sums split differently)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The Triton kernels runnable here: on the GPU with CUDA, else under Triton's
    interpreter (``TRITON_INTERPRET=1``, which the kernels read at launch)."""
    pytest.importorskip("triton")
    import torch

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def group(tmp_path) -> Iterator[None]:
    """A one-rank gloo group in this process (file:// rendezvous, no port)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0,
                            world_size=1)  # fmt: skip
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_flags(layers: int | str, seq: int | str, *more: str) -> list[str]:
    """The launch tests' tiny model, as trainer flags: ``layers`` layers of hidden size 32
    with 4 heads over ``seq`` tokens, then ``more`` (a test's own flags) as given."""
    return ["--num-layers", str(layers), "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", str(seq), *more]


class FakeStore:
    """The few store calls hla_sp.launch.distributed.faults uses, in memory (the
    rendezvous store's semantics)."""

    def __init__(self) -> None:
        self.d: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.d[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.d[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.d for k in keys)

    def set_timeout(self, t: object) -> None:
        pass


@pytest.fixture
def fake_store(monkeypatch: pytest.MonkeyPatch) -> FakeStore:
    """A :class:`FakeStore` in place of the job's store, for faults' heartbeats and
    failure reports (the test sets faults.BEAT_S to the pace it needs)."""
    from hla_sp.launch.distributed import faults

    s = FakeStore()
    monkeypatch.setattr(faults, "_store", lambda: s)
    return s


# --- test durations, kept -----------------------------------------------------------------
# Every run writes each test's wall time (setup + call + teardown) to DURATIONS, slowest
# first, so the slowest tests of a CI run can be read after it (pytest's --durations only
# prints them). HLA_SP_TEST_DURATIONS names another file; an empty value turns it off.
DURATIONS = "runs/test-durations.json"
_durations: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    import json
    import os

    path = os.environ.get("HLA_SP_TEST_DURATIONS", str(session.config.rootpath / DURATIONS))
    if not path or not _durations:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    rows = sorted(_durations.items(), key=lambda kv: -kv[1])
    with open(path, "w") as f:
        json.dump({"exitstatus": int(exitstatus), "total_s": round(sum(_durations.values()), 2),
                   "tests": [{"nodeid": k, "seconds": round(v, 3)} for k, v in rows]}, f,
                  indent=1)
