"""Orbax checkpoints in DIR/checkpoints/<step>/: training state, data-iterator state and the config.

Saves are sharded (each process writes its own shards) and, by default, asynchronous: the call
returns once the arrays are copied off the devices, and the files are written in the background.
Orbax writes into a temporary directory and renames it when complete, so a save killed half-way
leaves a `*.orbax-checkpoint-tmp*` directory that is never mistaken for a checkpoint; ushard warns
about it and resumes from the newest complete one. Restoring takes the *current* shardings, so a
run resumes on any mesh and any number of devices.

There is one restore path, `Checkpoints.restore_newest`: training asks it for the whole state,
`ushard sample` and `ushard.load_model` for the parameters alone. Whether a checkpoint fits is
decided by comparing the parameter tree saved on disk with the one expected (names, shapes, dtypes).
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
from ushard.models.config import ModelConfig
from ushard.models.definition import tree_paths

logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save at INFO


def _item_handlers() -> dict:
    # The state as a PyTree: it can be restored in part (the parameters without the optimizer state).
    return {"state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler(),
            "config": ocp.JsonCheckpointHandler()}


class Checkpoints:
    """DIR/checkpoints of one workdir; `create=False` opens an existing one for reading only."""

    def __init__(self, workdir: str, keep: int = 3, async_save: bool = True, create: bool = True):
        self.directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
        if not create and not os.path.isdir(self.directory):
            raise UserError(f"{self.directory} does not exist; train a model first with `ushard train --workdir {workdir}`.")
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=create)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=_item_handlers())

    def save(self, step: int, state: dict, data_state: dict, config) -> None:
        """Starts saving; returns once the device arrays are safe to overwrite (donate) again."""
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(state),
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

    def restore_newest(self, target, log=print):
        """(step, state, data_state, saved config) from the newest checkpoint that can be read, or None
        when there is none. `target(saved_config)` gives (abstract state, ModelConfig) to restore into:
        a dict with at least "params", leaves ShapeDtypeStructs carrying the shardings wanted. An
        unreadable checkpoint is reported and the one before it tried; a checkpoint of another model
        stops at once with a UserError."""
        for partial in self.partial_saves():
            log(f"ushard: warning: skipping {os.path.join(self.directory, partial)}, a save that never finished.")
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
    model_cfg = default_config().model
    for key, value in saved_config.get("model", {}).items():
        if key in model_cfg:
            with model_cfg.ignore_type():
                model_cfg[key] = value
    return ModelConfig.from_config(model_cfg)


def _describe(leaf) -> str:
    return f"{tuple(leaf.shape)} {jax.numpy.dtype(leaf.dtype).name}"


def check_compatible(on_disk, expected, saved_config: dict, model_cfg: ModelConfig, step: int) -> None:
    """Raises UserError naming what differs when the parameters on disk are not the expected tree."""
    there, here = tree_paths(on_disk), tree_paths(expected)
    diffs = [f"{p} is missing there" for p in here if p not in there]
    diffs += [f"{p} is not expected here" for p in there if p not in here]
    diffs += [f"{p} is {_describe(there[p])} there but {_describe(here[p])} here"
              for p in here if p in there and _describe(there[p]) != _describe(here[p])]
    if not diffs:
        return
    saved = saved_model_config(saved_config)
    settings = [f"model.{k}={getattr(saved, k)!r} there but {getattr(model_cfg, k)!r} here"
                for k in model_cfg.__dataclass_fields__ if getattr(saved, k) != getattr(model_cfg, k)]
    shown = "; ".join(diffs[:3]) + (f"; and {len(diffs) - 3} more" if len(diffs) > 3 else "")
    because = f" (its settings differ: {'; '.join(settings)})" if settings else ""
    raise UserError(
        f"the checkpoint at step {step} holds another model's parameters ({shown}){because}; "
        f"use the same model settings or another --workdir."
    )


warnings.filterwarnings("ignore", message=".*Couldn't find sharding info under RestoreArgs.*")
