import os
from pathlib import Path

import pytest

from extproc.filewatch import FileWatcher


def replace_atomically(path: Path, text: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def bump_mtime(path: Path) -> None:
    """Move the mtime forward explicitly, so the test never depends on clock granularity."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text("concurrency_threshold: 8\n")
    return path


def test_nothing_changed(config: Path) -> None:
    watcher = FileWatcher(config)
    assert watcher.path == config
    assert watcher.changed() is False
    assert watcher.changed() is False


def test_touch_without_content_change_is_not_a_change(config: Path) -> None:
    watcher = FileWatcher(config)
    before = config.stat().st_mtime_ns
    bump_mtime(config)
    assert config.stat().st_mtime_ns != before
    assert watcher.changed() is False
    config.touch()
    assert watcher.changed() is False
    # Rewriting the same bytes is not a change either.
    replace_atomically(config, "concurrency_threshold: 8\n")
    bump_mtime(config)
    assert watcher.changed() is False


def test_content_change_is_reported_once(config: Path) -> None:
    watcher = FileWatcher(config)
    replace_atomically(config, "concurrency_threshold: 16\n")
    bump_mtime(config)
    assert watcher.changed() is True
    assert watcher.changed() is False
    assert watcher.changed() is False


def test_each_change_is_reported(config: Path) -> None:
    watcher = FileWatcher(config)
    seen = 0
    for value in range(10, 15):
        config.write_text(f"concurrency_threshold: {value}\n")
        bump_mtime(config)
        seen += watcher.changed()
        assert watcher.changed() is False
    assert seen == 5


def test_size_change_is_noticed_even_with_the_same_mtime(config: Path) -> None:
    watcher = FileWatcher(config)
    stat = config.stat()
    config.write_text("concurrency_threshold: 1024\n")
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert watcher.changed() is True


def test_deleted_file_does_not_crash_and_recreation_is_noticed(config: Path) -> None:
    watcher = FileWatcher(config)
    config.unlink()
    # Deletion is reported as a change (the caller's reload then fails and is rejected).
    assert watcher.changed() is True
    assert watcher.changed() is False
    config.write_text("concurrency_threshold: 8\n")
    assert watcher.changed() is True
    assert watcher.changed() is False


def test_missing_at_start_then_created(tmp_path: Path) -> None:
    path = tmp_path / "later.yaml"
    watcher = FileWatcher(path)
    assert watcher.changed() is False
    path.write_text("a: 1\n")
    assert watcher.changed() is True
    assert watcher.changed() is False


def test_directory_instead_of_a_file_does_not_crash(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.mkdir()
    watcher = FileWatcher(path)
    assert watcher.changed() is False


def test_same_size_change_with_the_same_mtime_is_noticed(config: Path) -> None:
    watcher = FileWatcher(config)
    stat = config.stat()
    replace_atomically(config, "concurrency_threshold: 9\n")
    os.utime(config, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert config.stat().st_size == stat.st_size
    assert watcher.changed() is True
