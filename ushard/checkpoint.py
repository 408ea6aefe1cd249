"""Orbax checkpoints in DIR/checkpoints/<step>/: training state, data-iterator state and the config.

Saves are sharded (each process writes its own shards) and, by default, asynchronous: the call
returns once the arrays are copied off the devices. Orbax writes into a temporary directory and
renames it when complete, so a save killed half-way leaves a `*.orbax-checkpoint-tmp*` directory that
is never mistaken for a checkpoint; ushard warns about it. Restoring takes the *current* shardings, so a
run resumes on any mesh and any number of devices. One restore path (`Checkpoints.restore_newest`)
serves training (the whole state) and `ushard sample` / `ushard.load_model` (the parameters alone);
whether a checkpoint fits is decided by comparing its parameter tree on disk with the one expected.
"""

from __future__ import annotations

import json
import logging
import os
import warnings

import jax
import orbax.checkpoint as ocp

from ushard.errors import UserError
from ushard.models.config import ModelConfig
from ushard.models.definition import tree_paths

logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO


class Checkpoints:
    """DIR/checkpoints of one workdir; `create=False` opens an existing one for reading only."""

    def __init__(self, workdir: str, keep: int = 3, async_save: bool = True, create: bool = True):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        if not create and not os.path.isdir(self.directory):
            raise UserError(f"{self.directory} does not exist; train a model first with `ushard train --workdir {workdir}`.")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=create)
        # The state as a PyTree: its metadata can be read, and it can be restored in part.
        handlers = {"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
                    "config": ocp.JsonCheckpointHandler()}
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def save(self, step: int, state: dict, data_state: dict, config) -> None:
        """Starts saving; returns once the device arrays are safe to overwrite (donate) again."""
        items = ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(data_state),
                                   config=ocp.args.JsonSave(json.loads(config.to_json())))
        self.manager.save(step, args=items, force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore_newest(self, target, log=print):
        """(step, state, data_state, saved config) from the newest checkpoint that can be read, or None
        when there is none. `target(saved_config)` gives (abstract state, ModelConfig) to restore into:
        a dict with at least "params", leaves ShapeDtypeStructs carrying the shardings wanted. An
        unreadable checkpoint is reported and the one before it tried; a checkpoint of another model
        stops at once with a UserError."""
        for name in sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else ():
            if "orbax-checkpoint-tmp" in name:
                log(f"ushard: warning: skipping {os.path.join(self.directory, name)}, a save that never finished.")
        self.manager.reload()
        steps = sorted(self.manager.all_steps())
        for step in reversed(steps):
            try:
                return (step, *self._restore(step, target))
            except UserError:
                raise
            except Exception as e:  # unreadable or missing files
                log(f"ushard: warning: checkpoint {step} cannot be read ({type(e).__name__}: {e}); trying an older one.")
        if steps:
            raise UserError(f"no checkpoint in {self.directory} can be read; move the directory away to start afresh.")
        return None

    def _restore(self, step: int, target):
        saved_config = self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))["config"]
        abstract, model_cfg = target(saved_config)
        on_disk = self.manager.item_metadata(step)["state"].tree["params"]
        check_compatible(on_disk, abstract["params"], saved_config, model_cfg, step)
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract)
        items = ocp.args.Composite(
            state=ocp.args.PyTreeRestore(item=abstract, restore_args=restore_args, partial_restore=True),
            data=ocp.args.JsonRestore(),
        )
        restored = self.manager.restore(step, args=items)
        return restored["state"], restored["data"], saved_config

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def saved_model_config(saved_config: dict) -> ModelConfig:
    """The model settings of a checkpoint's saved config (JSON): defaults fill keys the checkpoint
    predates; keys this version does not know are ignored."""
    return ModelConfig.from_config(saved_config.get("model", {}), ignore_unknown=True)


def check_compatible(on_disk, expected, saved_config: dict, model_cfg: ModelConfig, step: int) -> None:
    """Raises UserError naming what differs when the checkpoint holds another model: other parameters
    on disk than the expected tree, or another setting that defines the model's function (e.g.
    rope_theta). Settings of how it is computed (remat, dtypes of compute, kernels) may change."""
    there, here = (
        {path: f"{tuple(x.shape)} {jax.numpy.dtype(x.dtype).name}" for path, x in tree_paths(tree).items()}
        for tree in (on_disk, expected)
    )
    diffs = [f"{p} is missing there" for p in here if p not in there]
    diffs += [f"{p} is not expected here" for p in there if p not in here]
    diffs += [f"{p} is {there[p]} there but {here[p]} here" for p in here if p in there and there[p] != here[p]]
    saved = saved_model_config(saved_config)
    function = saved.differences(model_cfg, function_only=True)
    if not diffs and not function:
        return
    if diffs:
        shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
        settings = saved.differences(model_cfg)
        because = f" (its settings differ: {'; '.join(settings)})" if settings else ""
        what = f"holds another model's parameters ({shown}){because}"
    else:
        what = f"holds another model: {'; '.join(function)}"
    raise UserError(f"the checkpoint at step {step} {what}; use the same model settings or another --workdir.")


warnings.filterwarnings("ignore", message=".*Couldn't find sharding info under RestoreArgs.*")
