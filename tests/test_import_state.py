"""`import ushard` leaves the process's global state alone: logging handlers, filters and levels,
warnings filters and `sys.unraisablehook` are the same before and after. (ushard quiets orbax when
it first opens checkpoints, not when it is imported.)"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# In a fresh interpreter: the libraries ushard imports are imported first (what they change is theirs),
# then the state is recorded before and after `import ushard`.
SCRIPT = """
import json, logging, sys, warnings

import flax.nnx
import jax
import ml_collections
import numpy
import optax
import orbax.checkpoint
import safetensors.numpy

def state():
    recorded = {f"logger {name or 'root'}": {"level": log.level, "handlers": [repr(h) for h in log.handlers],
                                             "filters": [repr(f) for f in log.filters]}
                for name, log in ((name, logging.getLogger(name)) for name in ("", "absl", "asyncio", "orbax", "jax"))}
    recorded["warnings.filters"] = [repr(f) for f in warnings.filters]
    recorded["sys.unraisablehook"] = repr(sys.unraisablehook)
    return recorded

before = state()
import ushard
print(json.dumps({"before": before, "after": state()}))
"""


def test_importing_ushard_changes_no_global_state():
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    recorded = json.loads(proc.stdout.strip().splitlines()[-1])
    before, after = recorded["before"], recorded["after"]
    changed = {what: {"before": before[what], "after": after[what]} for what in before if before[what] != after[what]}
    assert not changed, json.dumps(changed, indent=1)
