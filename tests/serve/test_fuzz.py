"""Property-based fuzzing of the OpenAPI document with schemathesis: no input may cause a 5xx, and every
response (status, media type, body, each streamed event) is one the document describes."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def test_fuzzing_finds_no_server_error(server, tmp_path):
    st = Path(sys.executable).with_name("st")
    result = subprocess.run(
        [str(st), "run", server.base_url + "/openapi.json", "--checks",
         "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
         "--max-examples", "25", "--max-time", "45", "--workers", "1", "--request-timeout", "60", "--seed", "1",
         "--phases", "examples,coverage,fuzzing", "--generation-database", "none", "--no-color",
         "--report-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    generated = re.search(r"(\d+) generated", result.stdout)
    assert generated and int(generated.group(1)) >= 100, result.stdout[-3000:]
