"""The held-out split: by file, disjoint, deterministic, test suites excluded."""

from __future__ import annotations

import pytest
from baton.train.corpus import END_OF_TEXT, is_held_out, read_documents, split_corpus, stdlib_root


def test_stdlib_split_is_disjoint_deterministic_and_skips_test_suites():
    first = split_corpus()
    second = split_corpus(stdlib_root())
    assert first == second
    assert set(first.train_files).isdisjoint(first.held_out_files)
    assert len(first.train_files) > 300 and len(first.held_out_files) > 10
    everything = first.train_files + first.held_out_files
    assert not any(part in ("test", "tests", "idle_test", "site-packages")
                   for path in everything for part in path.split("/")[:-1])
    assert "os.py" in everything and "json/decoder.py" in everything


def test_membership_depends_only_on_the_relative_path(tmp_path):
    names = [f"pkg/mod_{i:02d}.py" for i in range(40)]
    for name in names:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(f"X = {name!r}\n")
    split = split_corpus(tmp_path, held_out_percent=20)
    assert split.held_out_files == tuple(n for n in names if is_held_out(n, 20))
    assert split.train_files == tuple(n for n in names if not is_held_out(n, 20))
    assert 0 < len(split.held_out_files) < len(names)
    assert read_documents(split, split.held_out_files[:1]) == [f"X = {split.held_out_files[0]!r}\n"]


def test_held_out_text_joins_the_held_out_files(tmp_path):
    from baton.train.corpus import held_out_text

    for i in range(30):
        (tmp_path / f"m{i}.py").write_text(f"VALUE = {i}\n")
    split = split_corpus(tmp_path, 30)
    text = held_out_text(tmp_path, 30)
    assert text.split(END_OF_TEXT) == read_documents(split, split.held_out_files)


@pytest.mark.parametrize("percent", [0, 100])
def test_bad_held_out_percent_is_named(tmp_path, percent):
    with pytest.raises(ValueError, match=str(percent)):
        split_corpus(tmp_path, percent)


def test_empty_corpus_is_named(tmp_path):
    with pytest.raises(ValueError, match="no \\*.py files"):
        split_corpus(tmp_path)
