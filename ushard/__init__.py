"""ushard: SPMD training of transformer language models with JAX, from one CPU to pods and clusters.

The public API: `load_config`, `train`, `build`, `load_model`, `from_hf`, `to_hf`, `compile_for` and
`UserError` (see README, "Python").
"""

__version__ = "0.1.0"

from ushard import xla_flags  # noqa: E402

# Before JAX starts: on a machine without an accelerator, JAX's TPU backend stays untried (libtpu's
# start-up errors otherwise open every command where the tpu extra is installed).
xla_flags.skip_an_absent_tpu()

from ushard.aot import compile_for  # noqa: E402
from ushard.api import load_config, train  # noqa: E402
from ushard.build import Setup, build  # noqa: E402
from ushard.errors import UserError  # noqa: E402
from ushard.hf_convert import from_hf, to_hf  # noqa: E402
from ushard.trained import TrainedModel, load_model  # noqa: E402

__all__ = ["Setup", "TrainedModel", "UserError", "build", "compile_for", "from_hf", "load_config", "load_model",
           "to_hf", "train"]
