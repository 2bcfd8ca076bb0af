"""The paged cache's second tier (model/serving/tiers.py, Engine with `offload`): a preempted request's blocks
moved out to a file and back, its tokens and logits its solo run's; a tier that cannot be made is one
sentence before any step; a tier too full, or a block that comes back damaged, has its request computed again and
the step says so; a reset and a close delete the file; the crossover is the fewest positions from which a round
trip beats the recompute at every larger point."""

import dataclasses
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from test_batch import EXACT, row_tol
from test_paged import MB, least_budget, queue, serve_and_check, wide_gemma3  # noqa: F401  (wide_gemma3: the fixture)

from model.errors import InputError
from model.serving.crossover import Crossover, CrossoverPoint, measure_crossover
from model.serving.engine import Engine, EngineSettings
from model.serving.paged import PagedLayout
from model.serving.tiers import TIER_FILE_PREFIX, disk_tier


def tight(model, folder, **settings) -> tuple[list, EngineSettings]:
    """Four requests to their budgets under a pool of 1.3 × the smallest budget: growing decodes preempt."""
    requests = [dataclasses.replace(r, ignore_eos=True)
                for r in queue(model, [5, 30, 12, 20], min(40, model.info.context_length - 31))]
    budget = int(least_budget(model, requests, 4) * 1.3)
    return requests, EngineSettings(block_size=4, budget_bytes=budget, offload="disk", tier_folder=str(folder),
                                   **settings)


def events(server: Engine) -> list[str]:
    return [what for step in server.steps for _, what in step.tier]


def tier_files(folder) -> list[Path]:
    return sorted(Path(folder).glob(TIER_FILE_PREFIX + "*"))


def scribbled_after_preemption(monkeypatch) -> None:
    """Every free block's keys and values set to NaN after each preemption: a request moved back in reads only what
    came back from the tier (a block the pool hands out again could otherwise hold its old bytes still)."""
    preempt = Engine._preempt

    def scribbled(self, seq, tier):
        preempt(self, seq, tier)
        free = torch.tensor(list(self.cache.pool.free_ids), dtype=torch.long)
        self.cache.keys[:, :, free] = float("nan")
        self.cache.values[:, :, free] = float("nan")

    monkeypatch.setattr(Engine, "_preempt", scribbled)


@pytest.mark.parametrize("name", ["small", "wide_gemma3"])
def test_a_request_moved_out_and_back_is_its_solo_run(name, request, tmp_path, monkeypatch):
    """wide_gemma3's sliding groups let blocks go (None places in its tables), which stay None through the tier."""
    model = request.getfixturevalue(name)
    requests, settings = tight(model, tmp_path)
    scribbled_after_preemption(monkeypatch)
    server = serve_and_check(model, requests, settings, monkeypatch, row_tol(model))
    moved = events(server)
    assert moved.count("out") >= 2 and moved.count("in") == moved.count("out") and "damaged" not in moved
    # a request moved back in goes on from where it stopped: no span recomputes its positions
    came_back = {rid for step in server.steps for rid, what in step.tier if what == "in"}
    assert all(s.kind == "decode" for step in server.steps for s in step.spans if s.request in came_back
               and step.index > min(t.index for t in server.steps if (s.request, "in") in t.tier))
    assert server.offload.moves.blocks_in == server.offload.moves.blocks_out > 0
    server.close()
    assert tier_files(tmp_path) == []


def test_a_tier_too_small_has_its_victims_computed_again_and_says_so(small, tmp_path, monkeypatch):
    """A tier of one block: every victim holds more, so each is computed again ("full"), tokens still solo."""
    requests, settings = tight(small, tmp_path)
    layout = PagedLayout.of(small.info, 4)
    settings = dataclasses.replace(settings, tier_bytes=layout.block_bytes)
    server = serve_and_check(small, requests, settings, monkeypatch, EXACT)
    assert set(events(server)) == {"full"} and server.offload.moves.blocks_out == 0
    assert any(s.kind == "recompute" for step in server.steps for s in step.spans)
    with pytest.raises(InputError) as refused:
        Engine(small, requests, dataclasses.replace(settings, tier_bytes=layout.block_bytes - 1))
    assert refused.value.code == "tier_budget" and "is 0.01 MiB" in refused.value.message("en")


def test_a_victim_shorter_than_swap_from_is_computed_again(small, tmp_path, monkeypatch):
    requests, settings = tight(small, tmp_path, swap_from=10**6)
    server = serve_and_check(small, requests, settings, monkeypatch, EXACT)
    assert set(events(server)) == {"short"}


def test_a_block_damaged_in_the_file_is_found_and_its_request_computed_again(small, tmp_path, monkeypatch):
    requests, settings = tight(small, tmp_path)
    seen = {}

    def flip_once(server: Engine, step) -> None:
        out = [rid for rid, what in step.tier if what == "out"]
        if out and not seen:
            slot = next(s for table in server.offload.out[out[0]] for s in table if s is not None)
            with open(server.offload.tier.path, "r+b") as file:
                file.seek(slot * server.layout.block_bytes + 5)
                byte = file.read(1)
                file.seek(-1, os.SEEK_CUR)
                file.write(bytes([byte[0] ^ 0x40]))
            seen["request"] = out[0]

    original = Engine.step

    def stepped(self, report=None):
        step = original(self, report)
        flip_once(self, step)
        return step

    monkeypatch.setattr(Engine, "step", stepped)
    server = serve_and_check(small, requests, settings, monkeypatch, EXACT)
    damaged = [(step.index, rid) for step in server.steps for rid, what in step.tier if what == "damaged"]
    assert [rid for _, rid in damaged] == [seen["request"]]
    # the same step computes its positions again from its first
    step = server.steps[damaged[0][0]]
    assert any(s.request == seen["request"] and s.start == 0 and s.kind == "recompute" for s in step.spans)


def test_a_tier_file_cut_short_is_a_damaged_block_not_a_signal(small, tmp_path, monkeypatch):
    """The file truncated to 0 bytes while blocks are out (faults 2026-12-04 #1: through a memory mapping, SIGBUS
    ended the whole server): the blocks come back damaged and their request is computed again, tokens still solo."""
    requests, settings = tight(small, tmp_path)
    original = Engine.step

    def stepped(self, report=None):
        step = original(self, report)
        if any(what == "out" for _, what in step.tier):
            os.truncate(self.offload.tier.path, 0)
        return step

    monkeypatch.setattr(Engine, "step", stepped)
    server = serve_and_check(small, requests, settings, monkeypatch, EXACT)
    assert "damaged" in events(server) and "in" not in events(server)
    server.close()
    assert tier_files(tmp_path) == []


def test_reset_in_a_folder_made_read_only_succeeds_and_the_next_start_sweeps_the_file(small, tmp_path, caplog):
    """faults #5: Reset with the tier's folder read-only raised, broke the run and left the file for good."""
    with tempfile.TemporaryDirectory() as parent:
        os.chmod(parent, 0o755)
        folder = Path(parent) / "tier"
        folder.mkdir()
        requests, settings = tight(small, folder)
        server = Engine(small, requests, settings)
        while "out" not in events(server):
            server.step()
        back = read_only(folder)
        try:
            server.reset()  # the file cannot go: logged, not raised
        finally:
            back()
            folder.chmod(0o755)
        assert server.offload.tier is None and "could not be deleted" in caplog.text
        left = tier_files(folder)
        assert len(left) == 1
        stale = folder / left[0].name.replace(f"-{os.getpid()}-", "-999999999-")
        left[0].rename(stale)  # as a server that ended would leave it
        server.step()  # the run goes on; its next tier is made at its first move out, which sweeps the stale one
        while not server.finished and "out" not in events(server):
            server.step()
        assert not stale.exists()
        server.close()
        assert tier_files(folder) == []


def test_the_tiers_of_one_process_have_a_cap(small, tmp_path, monkeypatch):
    """faults #12: one tier file per tab, with no cap on tabs, could fill the server's disk."""
    layout = PagedLayout.of(small.info, 16)
    dtype = small.module.lm_head.weight.dtype
    first = disk_tier(str(tmp_path), 16, layout, dtype)
    monkeypatch.setenv("DECODE_LAB_TIER_MB", str(first.nbytes * 1.5 / MB))
    with pytest.raises(InputError) as refused:
        disk_tier(str(tmp_path), 16, layout, dtype)
    assert refused.value.code == "tier_cap" and "DECODE_LAB_TIER_MB" in refused.value.message("en")
    assert "DECODE_LAB_TIER_MB" in refused.value.message("vi") and len(tier_files(tmp_path)) == 1
    first.close()
    disk_tier(str(tmp_path), 16, layout, dtype).close()  # room again once the first is gone
    assert tier_files(tmp_path) == []


def test_a_file_given_as_the_tier_folder_is_said_so(small, tmp_path):
    """faults #15: a file given as the folder was 'this folder does not exist'."""
    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(InputError) as refused:
        disk_tier(str(file), 16, PagedLayout.of(small.info, 16), small.module.lm_head.weight.dtype)
    assert "this is a file, not a folder" in refused.value.message("en")


def test_a_folder_that_takes_no_file_is_said_so_not_missing(small):
    """faults 2026-12-04 #15: `--tier-dir /proc` (open gives ENOENT there) was 'this folder does not exist'."""
    with pytest.raises(InputError) as refused:
        disk_tier("/proc", 16, PagedLayout.of(small.info, 16), small.module.lm_head.weight.dtype)
    assert refused.value.message("en").endswith("cannot be made in /proc: this folder cannot hold a file (a system "
                                                "folder such as /proc).")
    assert "không chứa được tệp" in refused.value.message("vi")


def test_reset_and_close_delete_the_tier_s_file(small, tmp_path):
    requests, settings = tight(small, tmp_path)
    server = Engine(small, requests, settings)
    assert len(tier_files(tmp_path)) == 1
    while "out" not in events(server):
        server.step()
    server.reset()
    assert tier_files(tmp_path) == [] and server.offload.out == {}
    while "out" not in events(server):  # made again at the first move out after the reset
        server.step()
    assert len(tier_files(tmp_path)) == 1
    server.close()
    assert tier_files(tmp_path) == []


def read_only(folder: Path):
    """`folder` made read-only, mode 0o555; as root (whom modes do not stop) the check then runs under the `nobody`
    user's effective id: the returned function gives root back."""
    folder.chmod(0o555)
    if os.geteuid() != 0:
        return lambda: None
    os.seteuid(65534)
    return lambda: os.seteuid(0)


@pytest.mark.parametrize("kind", ["missing", "read_only"])
def test_a_tier_folder_that_cannot_take_the_file_is_one_sentence_and_leaves_nothing(kind, small, tmp_path):
    # in /tmp itself (pytest's tmp_path is under a folder only root may enter)
    with tempfile.TemporaryDirectory() as parent:
        folder = Path(parent) / "tier"
        requests, settings = tight(small, folder)
        back = lambda: None  # noqa: E731
        if kind == "read_only":
            folder.mkdir()
            os.chmod(parent, 0o755)
            back = read_only(folder)
        try:
            with pytest.raises(InputError) as refused:
                Engine(small, requests, settings)
        finally:
            back()
        said = refused.value.message("en")
        assert refused.value.code == "tier_unwritable" and said.count(". ") == 0 and str(folder) in said
        assert {"missing": "this folder does not exist", "read_only": "this folder cannot be written"}[kind] in said
        assert "thư mục" in refused.value.message("vi")
        assert not folder.exists() or list(folder.iterdir()) == []
        if folder.exists():
            folder.chmod(0o755)


def test_a_disk_too_full_for_the_tier_is_one_sentence(small, tmp_path):
    """A 64 KiB tmpfs: the tier's file (the pool's blocks, about 0.3 MiB) cannot be reserved."""
    folder = tmp_path / "full"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        layout = PagedLayout.of(small.info, 16)
        with pytest.raises(InputError) as refused:
            disk_tier(str(folder), 16, layout, small.module.lm_head.weight.dtype)
        assert "the disk has too little free space" in refused.value.message("en")
        assert list(folder.iterdir()) == []
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_host_memory_is_not_a_tier_below_a_cpu_pool(small, tmp_path):
    requests, settings = tight(small, tmp_path)
    with pytest.raises(InputError) as refused:
        Engine(small, requests, dataclasses.replace(settings, offload="host"))
    assert refused.value.code == "offload_host_on_cpu"


def point(positions: int, round_trip: float, recompute: float) -> CrossoverPoint:
    return CrossoverPoint(positions, positions // 16, round_trip / 2, round_trip / 2, recompute)


def test_the_crossover_is_where_the_round_trip_wins_from_there_on():
    def crossover(*points):
        return Crossover(tuple(points), "disk", 1, 16).positions

    assert crossover(point(16, 2, 1), point(32, 2, 3), point(64, 2, 4)) == 32
    assert crossover(point(16, 1, 2), point(32, 3, 2), point(64, 2, 4)) == 64  # a win below a loss does not count
    assert crossover(point(16, 1, 2), point(32, 1, 2), point(64, 5, 4)) is None
    assert crossover(point(16, 1, 2), point(32, 1, 3)) == 16


def test_measure_crossover_times_each_point_and_deletes_its_file(small, tmp_path):
    layout = PagedLayout.of(small.info, 16)
    measured = measure_crossover(small, layout, "disk", str(tmp_path))
    # small's context of 128: one block, two, four, and 127 positions (8 blocks of its one group)
    assert [(p.positions, p.blocks) for p in measured.points] == [(16, 1), (32, 2), (64, 4), (127, 8)]
    assert all(p.out_ms > 0 and p.in_ms > 0 and p.recompute_ms > 0 for p in measured.points)
    assert measured.block_bytes == 16 * 4 * 2 * 2 * 32 * 4 == 0.03125 * MB
    assert tier_files(tmp_path) == []
