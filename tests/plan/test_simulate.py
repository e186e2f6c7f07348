"""The sharding simulation at small N: parameter values read from the FSDP2 + EP-sharded module on the
meta device (fake process group) equal the planner's per-rank figure, rank by rank."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, name, str(n), str(ep), *map(str, ranks)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_simulation_equals_planner_per_rank():
    config = get_config("kimi-k3-tiny")
    n, ep, ranks = 8, 4, [0, 5, 7]
    planned = [sum(rank_values(model_shapes(config), Layout(n, 1, n, ep), r).values()) for r in ranks]
    assert _simulated("kimi-k3-tiny", n, ep, ranks) == planned


@pytest.mark.slow
@pytest.mark.parametrize("n,ep,values", [(64, 64, 43_431_016_938), (1024, 64, 2_717_140_515)])
def test_full_kimi_k3_sharded_by_the_training_code_holds_the_planned_values(n, ep, values):
    """Kimi K3 on the meta device, sharded on a fake process group by what `k3 train --parallel fsdp --ep`
    runs (k3.training.parallel.apply_fsdp): rank 0 holds the planner's 43.4B (N = 64) and 2.72B (N = 1,024)."""
    config = get_config("kimi-k3")
    assert sum(rank_values(model_shapes(config), Layout(n, 1, n, ep), 0).values()) == values
    assert _simulated("kimi-k3", n, ep, [0]) == [values]
