"""A DeepSpeed op build killed midway leaves torch's build lock behind, and every later build would wait
for it forever: `make deepspeed-op` removes a lock older than any real build, and leaves a fresh one."""

from __future__ import annotations

import os
import time

from distlab.strategies import deepspeed_runtime as ds


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, capsys):
    lock = tmp_path / ds.SHM_OP / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert ds.remove_stale_build_lock(tmp_path) is None and lock.exists()  # a build may hold it right now
    old = time.time() - ds.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert ds.remove_stale_build_lock(tmp_path) == lock and not lock.exists()
    assert "stale build lock" in capsys.readouterr().out
    assert ds.remove_stale_build_lock(tmp_path) is None  # nothing to remove
