"""The suite's own disk check (tests/conftest.py): one line before any test, instead of ninety failures."""

from __future__ import annotations

import shutil
from collections import namedtuple

from conftest import SUITE_DISK_GIB, disk_shortfall

Usage = namedtuple("Usage", "total used free")


def test_enough_disk_says_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * 2**30, 0, int(SUITE_DISK_GIB * 2**30)))
    assert disk_shortfall(str(tmp_path)) is None  # exactly the need is enough


def test_too_little_disk_names_the_folder_the_free_space_and_the_need(monkeypatch, tmp_path):
    # 1.5 GiB free of a 4 GiB need: "only 1.5 GiB free in <folder> ... up to 4.0 GiB"
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 * 2**30, 0, int(1.5 * 2**30)))
    reason = disk_shortfall(str(tmp_path), need_gib=4.0)
    assert reason.startswith(f"only 1.5 GiB free in {tmp_path}, ")
    assert "up to 4.0 GiB" in reason and "TMPDIR" in reason and "\n" not in reason


def test_a_folder_not_made_yet_is_measured_on_its_nearest_existing_parent(monkeypatch, tmp_path):
    seen = []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: seen.append(p) or Usage(1, 0, 2**40))
    assert disk_shortfall(str(tmp_path / "not" / "yet")) is None
    assert seen == [tmp_path]
