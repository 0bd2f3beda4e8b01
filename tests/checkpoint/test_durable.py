"""The commit's filesystem steps, recorded in order (``checkpoint.durable``, ``save.commit_files``),
and the launches' leftovers. One process, no process group."""

import fcntl
import os
from pathlib import Path

import pytest

from higgs_megatron.checkpoint import durable, save
from higgs_megatron.checkpoint.manifest import LATEST, MANIFEST_NAME, Layout, Manifest, RankRecord
from higgs_megatron.checkpoint.save import PendingCheckpoint, commit_files, hash_files, remove_leftovers

LAYOUT = Layout(world_size=2, tensor_model_parallel_size=1, pipeline_model_parallel_size=1, data_parallel_size=2)


@pytest.fixture
def trace(monkeypatch):
    """Every fsync (by the path its descriptor names), rename, exchange and removal, in order."""
    calls: list[tuple[str, str, ...]] = []
    fsync, replace, exchange, remove = os.fsync, os.replace, durable.exchange, durable.remove_tree

    def recorded_fsync(fd):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def recorded_replace(source, target):
        calls.append(("rename", str(Path(source).resolve()), str(Path(target).resolve())))
        replace(source, target)

    def recorded_exchange(first, second):
        done = exchange(first, second)
        if done:
            calls.append(("exchange", str(Path(first).resolve()), str(Path(second).resolve())))
        return done

    def recorded_remove(path):
        calls.append(("remove", str(Path(path).resolve())))
        remove(path)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    monkeypatch.setattr(durable, "exchange", recorded_exchange)
    monkeypatch.setattr(durable, "remove_tree", recorded_remove)
    monkeypatch.setattr(save, "remove_tree", recorded_remove)
    return calls


def exposures(calls: list[tuple], save_dir: Path, tmp: Path, final: Path, files: list[str]) -> list[str]:
    """Each way the recorded order could let a crash expose a partial or lost checkpoint."""
    save_dir, tmp, final = (str(p.resolve()) for p in (save_dir, tmp, final))

    def first(*wanted) -> int:
        for index, call in enumerate(calls):
            if call[:len(wanted)] == wanted:
                return index
        return len(calls)

    problems = []
    published = min(first("rename", tmp, final), first("exchange", tmp, final))
    if published == len(calls):
        return [f"{tmp} never reached {final}"]
    for name in files:
        if not first("fsync", f"{tmp}/{name}") < published:
            problems.append(f"{name} not fsynced before the directory is published")
    rank_map = first("rename", f"{tmp}/{MANIFEST_NAME}.tmp", f"{tmp}/{MANIFEST_NAME}")
    if not first("fsync", f"{tmp}/{MANIFEST_NAME}.tmp") < rank_map:
        problems.append("the rank map's bytes not fsynced before its rename")
    if not rank_map < first("fsync", tmp) < published:
        problems.append("the rank map's entry not fsynced (the directory) before it is published")
    if any(call[0] == "remove" and call[1] == final for call in calls[:published]):
        problems.append(f"{final} removed before the new one is in place")
    latest = first("rename", f"{save_dir}/{LATEST}.tmp", f"{save_dir}/{LATEST}")
    if not published < first("fsync", save_dir) < latest:
        problems.append("latest moved before the directory's rename is durable")
    if not first("fsync", f"{save_dir}/{LATEST}.tmp") < latest:
        problems.append("latest's bytes not fsynced before its rename")
    if not any(call == ("fsync", save_dir) for call in calls[latest:]):
        problems.append("latest's rename never made durable")
    return problems


def _written(save_dir: Path, iteration: int, save_id: str, files: dict[str, bytes]) -> PendingCheckpoint:
    pending = PendingCheckpoint(iteration=iteration, consumed_samples=8 * iteration, use_distributed_optimizer=False,
                                higgs=None, save_dir=save_dir, save_id=save_id)
    pending.directory.mkdir(parents=True)
    for name, data in files.items():
        (pending.directory / name).write_bytes(data)
    return pending


def _commit(pending: PendingCheckpoint, files: list[str]) -> None:
    records = hash_files([pending.directory / name for name in files])
    commit_files(pending, [RankRecord(rank=0, host="h", coords={}, files=records)], LAYOUT)


@pytest.mark.parametrize("existing", [False, True], ids=["new", "replacing"])
@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "no-exchange"])
def test_a_commit_makes_each_step_durable_before_the_next_depends_on_it(tmp_path, trace, monkeypatch, existing,
                                                                       swap):
    files = ["__0_0.distcp", ".metadata", "common.pt"]
    if existing:  # the iteration was committed before (a run sent back by a fallback, saving it again)
        old = _written(tmp_path, 4, "old-0000", {"__0_0.distcp": b"old"})
        _commit(old, ["__0_0.distcp"])
    if not swap:  # NFS: no renameat2 exchange
        monkeypatch.setattr(durable, "exchange", lambda first, second: False)
    trace.clear()
    pending = _written(tmp_path, 4, "abcd1234-0001", {name: name.encode() * 3 for name in files})
    _commit(pending, files)
    assert exposures(trace, tmp_path, pending.directory, pending.final, files) == []
    manifest = Manifest.read(pending.final)
    assert manifest.save_id == "abcd1234-0001" and [f.path for f in manifest.ranks[0].files] == files
    assert (pending.final / "common.pt").read_bytes() == b"common.pt" * 3
    assert (tmp_path / LATEST).read_text() == "4\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000004", LATEST]
    if existing and swap:  # the final name was never absent: swapped, then the old one removed
        assert ("remove", str(pending.directory.resolve())) in trace


def test_the_order_check_finds_an_order_that_exposes_a_partial_checkpoint(tmp_path, trace, monkeypatch):
    """The check above can fail: a commit that publishes before the rank map's entry is durable,
    and removes the old checkpoint first, is named twice."""
    old = _written(tmp_path, 4, "old-0000", {"__0_0.distcp": b"old"})
    _commit(old, ["__0_0.distcp"])
    monkeypatch.setattr(durable, "fsync_dir", lambda path: None)  # no directory fsyncs at all
    monkeypatch.setattr(durable, "exchange", lambda first, second: False)
    trace.clear()
    pending = _written(tmp_path, 4, "abcd1234-0002", {"__0_0.distcp": b"new"})
    _commit(pending, ["__0_0.distcp"])
    problems = exposures(trace, tmp_path, pending.directory, pending.final, ["__0_0.distcp"])
    assert "the rank map's entry not fsynced (the directory) before it is published" in problems
    assert "latest moved before the directory's rename is durable" in problems


def test_a_launch_removes_its_own_and_ended_launches_leftovers_never_a_live_ones(tmp_path):
    ours, ended, live = "aaaa0000", "bbbb1111", "cccc2222"
    for launch in (ended, live):
        (tmp_path / save._LOCK.format(launch)).touch()
    held = os.open(tmp_path / save._LOCK.format(live), os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another job, alive, holds its launch's lock
    try:
        for name in (f"iter_0000002.{ours}-0001.tmp", f"iter_0000004.{ended}-0002.tmp",
                     f"iter_0000004.{live}-0003.tmp", "iter_0000006.tmp"):
            (tmp_path / name).mkdir()
        assert remove_leftovers(tmp_path, ours) == [f"iter_0000004.{live}-0003.tmp"]
        assert sorted(p.name for p in tmp_path.iterdir()) == [save._LOCK.format(live),
                                                              f"iter_0000004.{live}-0003.tmp"]
    finally:
        os.close(held)
    assert remove_leftovers(tmp_path, ours) == []  # its lock released: an ended launch now
    assert list(tmp_path.iterdir()) == []


def test_a_launch_holds_its_lock_while_it_lives(tmp_path):
    name = save.launch_name(tmp_path)
    assert save.launch_name(tmp_path) == name  # drawn once per directory
    assert not save._ended(tmp_path, name)
    assert (tmp_path / save._LOCK.format(name)).exists()


class Crash(Exception):
    """The process dies here."""


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "no-exchange"])
def test_a_crash_at_any_step_of_a_commit_leaves_a_whole_checkpoint_to_load(tmp_path, monkeypatch, swap):
    """A commit of iteration 4, saved again over a committed 4, after a committed 2, stopped
    at each of its filesystem steps in turn (each fsync, rename, exchange and removal): the
    checkpoint a load then chooses is whole (its files verify against its rank map) and is 4
    or 2, never a partial one; with an exchange, never 2 (iteration 4 is never absent)."""
    from higgs_megatron.checkpoint.load import choose_checkpoint
    from higgs_megatron.checkpoint.manifest import verify_files

    if not swap:
        monkeypatch.setattr(durable, "exchange", lambda first, second: False)
    fsync, replace, exchange, remove = os.fsync, os.replace, durable.exchange, durable.remove_tree
    steps, crash_at = [0], [None]

    def step(original):
        def run(*args):
            steps[0] += 1
            if steps[0] == crash_at[0]:
                raise Crash(f"step {steps[0]}")
            return original(*args)
        return run

    for attempt in range(1, 100):
        save_dir = tmp_path / f"attempt{attempt}"
        for iteration, data in ((2, b"two"), (4, b"old four")):
            _commit(_written(save_dir, iteration, f"old-{iteration}", {"__0_0.distcp": data}), ["__0_0.distcp"])
        pending = _written(save_dir, 4, "abcd1234-0001", {"__0_0.distcp": b"new four", "common.pt": b"c"})
        steps[0], crash_at[0] = 0, attempt
        with monkeypatch.context() as patched:
            patched.setattr(os, "fsync", step(fsync))
            patched.setattr(os, "replace", step(replace))
            patched.setattr(durable, "exchange", step(exchange))
            patched.setattr(durable, "remove_tree", step(remove))
            patched.setattr(save, "remove_tree", step(remove))
            try:
                _commit(pending, ["__0_0.distcp", "common.pt"])
                crashed = False
            except Crash:
                crashed = True
        chosen, _ = choose_checkpoint(save_dir)
        manifest = Manifest.read(chosen)
        assert verify_files(chosen, manifest, 0, 1) == [], (attempt, chosen)
        assert manifest.iteration in (2, 4) and (swap is False or manifest.iteration == 4), (attempt, chosen)
        if not crashed:
            assert manifest.save_id == "abcd1234-0001" and attempt > 8, attempt  # stopped at every step before
            break
    else:
        raise AssertionError("the commit never finished")
