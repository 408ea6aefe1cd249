"""Orbax checkpoints in DIR/checkpoints/<step>/: training state, data-iterator state and the config.

Saves are sharded (each process writes its own shards) and, by default, asynchronous: the call
returns once the arrays are copied off the devices, and the files are written in the background.
Orbax writes into a temporary directory and renames it when complete, so a save killed half-way
leaves a `*.orbax-checkpoint-tmp*` directory that is never mistaken for a checkpoint; ushard warns
about it and resumes from the newest complete one. Restoring takes the *current* shardings, so a
run resumes on any mesh and any number of devices.
"""

from __future__ import annotations

import json
import logging
import os
import warnings

import jax
import orbax.checkpoint as ocp

from ushard.config import default_config
from ushard.errors import UserError

# The model settings that decide the parameter tree (names, shapes, dtypes): any difference makes a
# checkpoint unusable.
SHAPE_KEYS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "tie_embeddings", "param_dtype",
    "fused_qkv", "fused_mlp",
)

# The items of every checkpoint directory (ushard sample reads them too).
ITEMS = ("state", "data", "config")

logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO


class Checkpoints:
    def __init__(self, workdir: str, checkpoint_cfg):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        options = ocp.CheckpointManagerOptions(
            max_to_keep=checkpoint_cfg.keep,
            enable_async_checkpointing=checkpoint_cfg.async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    def save(self, step: int, state, data_state: dict, config) -> None:
        """Starts saving; returns once the device arrays are safe to overwrite (donate) again."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave(data_state),
                config=ocp.args.JsonSave(json.loads(config.to_json())),
            ),
            force=True,
        )

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def partial_saves(self) -> list[str]:
        if not os.path.isdir(self.directory):
            return []
        return sorted(n for n in os.listdir(self.directory) if "orbax-checkpoint-tmp" in n)

    def restore_latest(self, abstract_state, model_cfg, log=print):
        """(step, state, data_state) from the newest complete checkpoint, or None if there is none."""
        for partial in self.partial_saves():
            log(f"ushard: warning: skipping {os.path.join(self.directory, partial)}, a save that never finished.")
        self.manager.reload()

        def restore(step):
            saved_config = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
            check_compatible(saved_config, model_cfg, step)
            items = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
            restored = self.manager.restore(step, args=items)
            return restored["state"], restored["data"]

        found = restore_newest(self.manager, restore, log)
        return None if found is None else (found[0], *found[1])

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def restore_newest(manager: ocp.CheckpointManager, restore, log):
    """(step, restore(step)) for the newest complete checkpoint that `restore` can read, or None if
    there are none. An unreadable one is reported and the one before it tried; a `UserError` (such as
    an incompatible model) stops at once."""
    steps = sorted(manager.all_steps())
    for step in reversed(steps):
        try:
            return step, restore(step)
        except UserError:
            raise
        except Exception as e:  # unreadable or missing files
            log(f"ushard: warning: checkpoint {step} cannot be read ({type(e).__name__}: {e}); trying an older one.")
    if steps:
        raise UserError(f"no checkpoint in {manager.directory} can be read; move the directory away to start afresh.")
    return None


def saved_model_config(saved_config: dict):
    """The model settings of a checkpoint's saved config (JSON) as a model ConfigDict: defaults fill
    keys the checkpoint predates; keys this version does not know are ignored."""
    model_cfg = default_config().model
    for key, value in saved_config.get("model", {}).items():
        if key in model_cfg:
            with model_cfg.ignore_type():
                model_cfg[key] = value
    return model_cfg


def check_compatible(saved_config: dict, model_cfg, step: int) -> None:
    saved = saved_model_config(saved_config)
    diffs = [f"model.{k}={saved[k]!r} there but {model_cfg[k]!r} here" for k in SHAPE_KEYS if saved[k] != model_cfg[k]]
    if diffs:
        raise UserError(
            f"the checkpoint at step {step} was saved for another model shape ({'; '.join(diffs)}); "
            f"use the same model settings or another --workdir."
        )


warnings.filterwarnings("ignore", message=".*Couldn't find sharding info under RestoreArgs.*")
