"""`ostinato bench` on CPU: the quick eager table, the JSON document, the plot."""

import json

import pytest

from ostinato.bench import main


def test_quick_bench_on_cpu_writes_json_and_says_why_graphs_are_off(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--quick", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "graphs are off" in text and "eager" in text
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "decode_step"
    assert {"device", "torch", "commit", "date"} <= set(doc["provenance"])
    rows = doc["rows"]
    assert [r["batch"] for r in rows] == [1, 8] and all(r["step_ms"] > 0 for r in rows)


def test_plot_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.json"
    main(["--quick", "--out", str(out)])
    png = tmp_path / "r.png"
    assert main(["--plot-from", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_unknown_variant_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["--variants", "turbo"])
    assert "unknown" in capsys.readouterr().err
