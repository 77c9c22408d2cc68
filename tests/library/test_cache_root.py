"""cache_root's file replacement: whole or not at all, nothing left behind."""

import pytest

from ostinato.cache_root import replace_file


def test_a_file_is_replaced_whole_in_a_folder_made_for_it(tmp_path):
    path = tmp_path / "new" / "plans.json"
    replace_file(path, "one")
    replace_file(path, "two")
    assert path.read_text() == "two" and [p.name for p in path.parent.iterdir()] == ["plans.json"]


def test_a_write_that_fails_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "plans.json"
    replace_file(path, "old")

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr("ostinato.cache_root.os.replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        replace_file(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["plans.json"]
