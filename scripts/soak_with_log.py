"""`qgemm soak` keeping the server's log: the report plus the log's error lines (what a 5xx was), for a GPU run
whose scratch directory is gone afterwards.  usage: python scripts/soak_with_log.py OUT.json [backend clients secs]"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tools.soak import SoakPlan, passed, soak

out = Path(sys.argv[1])
backend, clients, seconds = (sys.argv[2:5] + ["cuda", "32", "30"][len(sys.argv[2:5]):])
with tempfile.TemporaryDirectory(prefix="qgemm-soak-") as tmp:
    report = soak(SoakPlan(backend=backend, clients=int(clients), seconds=float(seconds), rewrite_every_s=2.0),
                  Path(tmp))
    lines = [line for p in Path(tmp).rglob("*.log") for line in p.read_text(errors="replace").splitlines()]
report["verdict"] = passed(report) or "pass"
report["log_tail"] = lines[-40:]
out.write_text(json.dumps(report, indent=1))
print(report["verdict"], report["answers"], report["errors_5xx"])
