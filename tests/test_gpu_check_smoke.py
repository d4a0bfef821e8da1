"""The GPU check's engine sections run end to end at tiny sizes on CPU (--smoke), so that a
lent GPU's few minutes are not lost to a script that no longer runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pageserve.loadtest.gpu_profile import MODES

pytestmark = pytest.mark.engine


def _smoke(tmp_path, sections: str) -> dict:
    """gpu_check --smoke on these sections under the interpreter: its report, no section failed."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pageserve.loadtest.gpu_check", "--smoke", "--sections", sections,
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["failed"] == []
    return report


def test_profile_nano_prefill_and_serve_sections_smoke(tmp_path):
    report = _smoke(tmp_path, "profile,nano,prefill,serve")
    assert len(MODES) == 5
    for mode in MODES:
        entry = report["profile"][mode]
        assert entry["step_ms"] > 0 and (tmp_path / entry["trace"]).stat().st_size > 1000
    nano = report["nano"]
    assert nano["sync"]["async_scheduling"] is False and nano["async"]["async_scheduling"] is True
    assert nano["sync"]["output_tokens"] == nano["async"]["output_tokens"] > 0
    assert nano["async_over_sync"] > 0
    assert [r["max_abs_err"] < 3e-2 and r["paged_us"] > 0 for r in report["prefill"]] == [True, True]
    serve = report["serve"]["rounds"][0]  # every stream's every token through the real server
    assert serve["tokens"] == 8 * 16 and serve["server_tok_s"] > 0 and serve["offline_tok_s"] > 0


def test_quant_and_lora_sections_smoke(tmp_path):
    """The quantized GEMMs' and LoRA kernels' sections, launched and replayed (a graph on CUDA),
    at the smoke shapes under the interpreter: every case within its error bound."""
    report = _smoke(tmp_path, "quant,lora")
    cases = report["quant"]["cases"]
    assert {c["method"] for c in cases} == {"int4", "fp8 block", "nvfp4", "fp8", "fp8 triton", "int8", "int8 triton"}
    assert all(c["ok"] for c in cases)
    assert all(c["us"] > 0 and c["graph_us"] > 0 for c in cases)
    tiles = report["quant"]["int4_tiles"]  # the sweep: the default and one tile per shape
    assert [(t["batch"], len(t["all"]), t["default"]["default"]) for t in tiles] == [(1, 2, True)]
    assert tiles[0]["best_us"] == min(c["us"] for c in tiles[0]["all"]) and tiles[0]["max_rel_err_worst"] < 2e-2
    assert report["lora"]["cases"] and all(c["ok"] for c in report["lora"]["cases"])
