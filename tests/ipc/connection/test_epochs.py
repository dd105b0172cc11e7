from pathlib import Path

from ipc.connection.epochs import EpochCounter


def test_epochs_rise_across_restarts_through_the_file(tmp_path: Path) -> None:
    first = EpochCounter(tmp_path / "epoch")
    assert [first.next(), first.next(), first.next(at_least=10)] == [1, 2, 10]
    again = EpochCounter(tmp_path / "epoch")  # a restarted daemon
    assert again.next() == 11
    assert again.next(at_least=3) == 12  # a low proposal never goes back


def test_without_a_usable_file_it_counts_in_memory(tmp_path: Path) -> None:
    (tmp_path / "epoch").write_text("garbage")
    assert EpochCounter(tmp_path / "epoch").next() == 1
    missing_dir = EpochCounter(tmp_path / "no" / "such" / "dir" / "epoch")
    assert [missing_dir.next(), missing_dir.next()] == [1, 2] and missing_dir.path is None
    assert EpochCounter(None).next(at_least=5) == 5
