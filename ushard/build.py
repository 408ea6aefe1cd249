"""`build(config)`: the mesh, layout, model definition, optimizer and step functions of a config, and no data.

Everything that trains, measures or inspects a model starts here: the Trainer, `tools/`, tests,
notebooks and the planner. Nothing is compiled until a step function is first called or lowered.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import optax

from ushard.config import validate
from ushard.kernels import attention as attention_kernels
from ushard.kernels import grouped_matmul as grouped_kernels
from ushard.mesh import build_mesh
from ushard.models.config import ModelConfig
from ushard.models.definition import ModelDef, model_definition
from ushard.parallel import SEAMS
from ushard.plan import ParallelPlan
from ushard.sharding import Layout, format_rules
from ushard.training.lora import Adapters
from ushard.training.objectives import objective_for
from ushard.training.optim import make_optimizer, plan_optimizer
from ushard.training.step import Steps
from ushard.xla_flags import ignored_settings


@dataclass
class Setup:
    """A validated config laid out on devices: what `build` returns."""

    config: object  # the ml_collections ConfigDict it was built from
    model_config: ModelConfig
    plan: ParallelPlan  # every layout decision of the run, and the kernels chosen
    layout: Layout
    model: ModelDef
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    steps: Steps  # jitted init / train_step / loss_and_grads / eval_step for this layout
    notes: tuple[str, ...] = ()  # settings this platform ignores, one line each (printed by describe)
    adapters: Adapters | None = None  # with LoRA (model.lora.rank > 0): which weights carry adapters

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.layout.mesh

    @property
    def mesh_shape(self) -> dict[str, int]:
        return self.plan.shape

    @property
    def flops_per_token(self) -> float:
        """Training FLOPs per token as ushard/metrics.py counts them."""
        return self.model.flops_per_token(self.config.train.seq_len)

    def describe(self) -> str:
        """The start-up report: the model's size, the plan's decisions, the parameter layout."""
        size = f"{self.model.num_params() / 1e6:.1f}M params"
        if self.model_config.moe.num_experts:  # what FLOPs and MFU count: a token's share of the experts
            size += f" ({self.model.num_matmul_params() / 1e6:.1f}M active in a token's matmuls)"
        if self.adapters:
            lora = self.model_config.lora
            size += (f", frozen, with LoRA adapters of rank {lora.rank} on {len(self.adapters.weights)} weights "
                     f"({self.adapters.num_params() / 1e6:.2f}M trained)")
        return (f"ushard: {size} on {self.mesh.size} {self.plan.platform} device(s), {self.plan.describe()}"
                f"parameter layout (logical axis -> mesh axes):\n{format_rules(self.layout.zero.params)}"
                + "".join(f"\nnote: {line}" for line in self.notes))


def build(config, devices=None, platform: str | None = None, device_kind: str | None = None) -> Setup:
    """Validates `config` for `devices` (default: all) and composes its parts; raises UserError if invalid.
    `platform` and `device_kind` (default: the devices') choose the kernels for other chips than the
    devices: the planner lays a GPU cluster out on simulated CPU devices to trace it, never to run it."""
    devices = jax.devices() if devices is None else list(devices)
    mesh_shape = validate(config, len(devices))
    model_cfg = ModelConfig.from_config(config.model)
    model = model_definition(model_cfg)
    platform = platform or devices[0].platform
    attention_kernels.check(model_cfg.attention_impl, platform, config.train.seq_len, mesh_shape["pipeline"])
    if model_cfg.moe.num_experts:
        grouped_kernels.check(model_cfg.moe.grouped_matmul_impl, platform)
    plan = ParallelPlan.create(config, mesh_shape, platform, model_cfg, device_kind or devices[0].device_kind)
    layout = Layout.from_plan(build_mesh(mesh_shape, dict(config.mesh.dcn), devices), plan, SEAMS)
    # What the optimizer trains: the model's parameters, or with LoRA only the adapters (both have
    # `logical` and `shapes`).
    adapters = Adapters(model, model_cfg.lora) if model_cfg.lora.rank else None
    trained = adapters or model
    plan = dataclasses.replace(plan, **plan_optimizer(config, trained, layout))  # needs the layout's state shardings
    layout = dataclasses.replace(layout, plan=plan)
    tx, schedule = make_optimizer(config, trained.logical, layout)
    t = config.train
    steps = Steps(model, tx, schedule, layout, t.grad_accum, skip_nonfinite=t.on_nonfinite == "skip", adapters=adapters,
                  objective=objective_for(t, model_cfg))
    return Setup(config, model_cfg, plan, layout, model, tx, schedule, steps, tuple(ignored_settings(config, platform)),
                 adapters)
