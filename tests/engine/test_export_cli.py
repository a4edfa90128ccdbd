"""`hstu export` (engine/export_cli.py): cache sizes that cannot work are refused before the model
is built, with the offending values named. (A full export: tests/conftest.py's aoti_package.)"""

from __future__ import annotations

import pytest

from hstu.cli import main


def test_chunk_tokens_not_a_multiple_of_the_page_size_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="chunk_tokens 12 must be a positive multiple of page_size 8"):
        main(["export", "--out", str(tmp_path / "m.pt2"), "--page-size", "8", "--chunk-tokens", "12"])
    assert not (tmp_path / "m.pt2").exists()


def test_zero_pages_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="page_size and num_pages must be positive, got 8, 0"):
        main(["export", "--out", str(tmp_path / "m.pt2"), "--page-size", "8", "--num-pages", "0"])
