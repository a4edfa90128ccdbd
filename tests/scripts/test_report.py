"""One table formatter, one cell format, the environment and the JSON writer of every script."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hstu.ops.attention import use_attention_backend
from hstu.scripts import report


@pytest.mark.parametrize(
    "value, spec, text",
    [(None, None, "-"), (math.nan, None, "-"), (0.12345, None, "0.123"), (12345.6, None, "12,346"),
     (1234567, None, "1,234,567"), (1.5, ".2f", "1.50"), (None, ".2f", "-"), ("x", None, "x")],
)
def test_cells_are_formatted_for_reading(value, spec, text):
    assert report.fmt(value, spec) == text


def test_text_table_aligns_labels_left_and_numbers_right_under_a_rule():
    rows = [["metric", "batch", "ms"], ["block", "1", "2.50"], ["end-to-end", "8", "12.00"]]
    lines = report.format_table(rows, left=2).splitlines()
    assert lines[1] == "-" * len(lines[0])
    assert lines[2].startswith("block       1 ") and lines[2].endswith(" 2.50")
    assert len({len(line) for line in lines}) == 1


def test_rows_of_another_width_are_rejected():
    with pytest.raises(ValueError, match="every row needs 2 cells"):
        report.format_table([["a", "b"], ["only one"]])


def test_markdown_table_has_a_header_separator_and_one_line_per_row():
    text = report.markdown_table([["measure", "batch"], ["block", "1"]])
    assert text.splitlines() == ["| measure | batch |", "|---|---|", "| block | 1 |"]


def test_cpu_environment_names_the_device_and_the_torch_attention():
    env = report.environment(torch.device("cpu"))
    assert env["device"] == "cpu" and env["attention"] == "torch" and env["torch"] == torch.__version__
    with use_attention_backend("torch"):
        assert report.environment(torch.device("cpu"))["attention"] == "torch"


def test_the_device_tier_is_named_after_its_device():
    assert report.device_tier("cpu") == "device-tier (cpu)"
    assert report.device_tier("cuda:0") == "device-tier (cuda:0)"


def test_json_is_written_with_its_folder(tmp_path):
    path = tmp_path / "a" / "b.json"
    report.write_json(path, {"x": [1, 2]})
    assert json.loads(path.read_text()) == {"x": [1, 2]}
