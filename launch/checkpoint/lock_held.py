"""Whether the ``--save`` lock a run took is still its own, checked at each save.

A run holds ``SAVE/save.lock`` (:mod:`.lock`) from its start; another run that broke
it, or a person who deleted it, leaves this run writing without one, and a third run
could then start on the same directory. Before each checkpoint is written, global rank
0 reads the lock back (:func:`check_held`); if it was removed or holds another run's
record, every rank stops in one line before writing anything.
"""

from __future__ import annotations

import os

from hla_sp.launch.checkpoint.lock import (
    MalformedLock,
    SaveLock,
    SaveLockError,
    _guard,
    _held,
    _read,
    describe,
)


def _lost_how(lock: SaveLock) -> str | None:
    """How ``lock``'s file is no longer its own ("was removed", "now holds ..."); None
    while it is."""
    try:
        found = _read(lock.path)
    except MalformedLock:
        return "was replaced by something that is not a lock"
    if found is None:
        return "was removed"
    if found[1] is not None and found[1].get("token") == lock.token:
        return None
    return (f"now holds {describe(found[1])}" if found[1] is not None
            else "was replaced by a file that is not this run's lock")


def _locks_of(save: str) -> list[SaveLock]:
    """The locks this process took on ``save`` (the same directory, however named)."""
    return [lock for lock in list(_held.values())
            if os.path.isdir(save) and os.path.isdir(lock.save)
            and os.path.samefile(lock.save, save)]


def lost(save: str, iteration: int) -> str | None:
    """Why a lock this process took on ``save`` is no longer its own (removed, or
    replaced by another run's), in one line; None while it holds it, or when it holds
    none there (ranks other than 0, tools writing a checkpoint without a run)."""
    for lock in _locks_of(save):
        how = _lost_how(lock)
        if how is not None:
            return (f"--save {save}: this run's lock {lock.path} {how} (another run or a "
                    f"person took the directory); stopped before writing iteration "
                    f"{iteration}'s checkpoint, so that two runs never write one --save; "
                    f"make sure no other run uses it, then resume with --load {save}")
    return None


def check_held(save: str, iteration: int, rank: int) -> None:
    """Collective, at each save before anything is written: rank 0 checks that the lock
    of ``save`` is still this run's (:func:`lost`); every rank raises the same
    :class:`SaveLockError` if not."""
    import torch.distributed as dist

    why = lost(save, iteration) if rank == 0 else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [why]
        dist.broadcast_object_list(box, src=0)
        why = box[0]
    if why is not None:
        gone = [lock for lock in _locks_of(save) if _lost_how(lock) is not None]
        with _guard:  # those files are not ours any more: nothing of them to release
            for lock in gone:
                lock.held = False
                _held.pop(lock.token, None)
        raise SaveLockError(why)
