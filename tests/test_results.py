"""Benchmark result tables (compiled_attn.results)."""

from __future__ import annotations

import json

from compiled_attn.results import ResultRow, format_table, write_results

ENV = {"date": "2026-11-30", "gpu": "cpu", "torch": "t", "triton": "tr"}


def test_table_gives_ratios_against_anchors_and_blanks_without_one():
    rows = [ResultRow("a", "ms", 2.0, "peer", 4.0, "<= 0.6"), ResultRow("b", "tokens/s", 1234.5, "", 0.0)]
    table = format_table(rows, "title", ENV)
    assert "## title: 2026-11-30, cpu, torch t, triton tr" in table
    assert "| a | ms | 2 | peer | 4 | 0.500 | <= 0.6 | yes |" in table
    assert "| b | tokens/s | 1234 |  |  |  |  |  |" in table  # no anchor: no "nan" ratio


def test_write_results_appends_markdown_and_json_lines(tmp_path):
    rows = [ResultRow("a", "ms", 3.0, "peer", 2.0, ">= 1.0")]
    write_results(rows, tmp_path, "x", "first")
    write_results(rows, tmp_path, "x", "second")
    assert (tmp_path / "x.md").read_text().count("| a | ms | 3 | peer | 2 | 1.500 | >= 1.0 | yes |") == 2
    records = [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()]
    assert len(records) == 2 and records[0]["ratio"] == 1.5 and records[0]["met"] is True
