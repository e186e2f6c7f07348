"""The sharding simulation at small N: parameter values read from the FSDP2 + EP-sharded module on the
meta device (fake process group) equal the planner's per-rank figure, rank by rank."""

import json
import subprocess
import sys
from pathlib import Path

from k3.models import get_config
from k3.plan.shapes import Layout, model_shapes, rank_values

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
from k3.models import get_config
from k3.plan.simulate import simulate
config = get_config(sys.argv[1])
n, ep = int(sys.argv[2]), int(sys.argv[3])
print(json.dumps([simulate(config, n, ep, r)["values"] for r in map(int, sys.argv[4:])]))
"""


def _simulated(name: str, n: int, ep: int, ranks: list[int]) -> list[int]:
    # its own process: torch allows one default process group per process
    out = subprocess.run([sys.executable, "-c", SCRIPT, name, str(n), str(ep), *map(str, ranks)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_simulation_equals_planner_per_rank():
    config = get_config("kimi-k3-tiny")
    n, ep, ranks = 8, 4, [0, 5, 7]
    planned = [sum(rank_values(model_shapes(config), Layout(n, 1, n, ep), r).values()) for r in ranks]
    assert _simulated("kimi-k3-tiny", n, ep, ranks) == planned
