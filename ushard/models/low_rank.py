"""A frozen weight with a trained low-rank update (LoRA): W x + scale * B (A dropout(x)).

`LowRankAdapted` stands where a weight array stands in a model's parameters (ushard/training/lora.py
puts it there for the weights `model.lora.targets` names), so model code needs no LoRA branch of its
own: `project` computes the update from the activations, and the few places that use a weight other
than through `project` take `merged()`. The base is behind `stop_gradient`: differentiated with the
rest (a 1F1B pipeline differentiates the whole stack it is handed), it gets zeros, never a product.

Shapes: the base [*lead, *ins, *outs], A [*lead, *ins, rank], B [*lead, rank, *outs], where `lead` are
the `lead` leading axes (the experts' axis; a stack's `layers` axis comes on top of them and goes with
the layer scan), `ins` the axes an activation is contracted with, `outs` the rest.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

RANK_LETTER = "z"  # the rank's letter in the einsum specs below: no projection's spec uses it


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowRankAdapted:
    base: jax.Array
    a: jax.Array
    b: jax.Array
    # What `dropout` draws its mask from: float32 numbers (one per layer when stacked), made a key
    # inside; zero gradient, and a float leaf keeps every weight pytree differentiable.
    seed: jax.Array
    # A float8 base's per-output-channel scales [*lead, *outs] (`quantized`): the weight is base * scale.
    base_scale: jax.Array | None = None
    scale: float = dataclasses.field(metadata=dict(static=True), default=1.0)
    lead: int = dataclasses.field(metadata=dict(static=True), default=0)
    dropout: float = dataclasses.field(metadata=dict(static=True), default=0.0)

    # ----------------------------------------------------------------- what array-using code asks of a weight

    @property
    def shape(self):
        return self.base.shape

    @property
    def dtype(self):
        return self.base.dtype

    @property
    def ndim(self):
        return self.base.ndim

    def __getitem__(self, index):
        # `variable[...]` (NNX's way to read a parameter) gives the weight itself.
        if index is not Ellipsis:
            raise TypeError("a LoRA-adapted weight is read whole; slice `merged()` instead")
        return self

    def astype(self, dtype) -> "LowRankAdapted":
        # A float8 base stays float8 (cast where it is multiplied: `project`), its scales float32.
        return dataclasses.replace(self, base=self.base if self.float8 else self.base.astype(dtype),
                                   a=self.a.astype(dtype), b=self.b.astype(dtype))

    @property
    def float8(self) -> bool:
        return self.base_scale is not None

    def map_arrays(self, fn, base_fn=None, b_fn=None, scale_fn=None) -> "LowRankAdapted":
        """The same weight with `fn` applied to base, A and B (`base_fn` / `b_fn` instead where given;
        a float8 base's scales by `scale_fn`)."""
        scale = self.base_scale if self.base_scale is None else (scale_fn or (lambda s: s))(self.base_scale)
        return dataclasses.replace(self, base=(base_fn or fn)(self.base), a=fn(self.a), b=(b_fn or fn)(self.b),
                                   base_scale=scale)

    # ----------------------------------------------------------------- the two ways of computing with it

    def merged(self) -> jax.Array:
        """base + scale * A B, in the base's dtype (without dropout: the weight as inference uses it)."""
        letters = "abcdefghijklmnopqrstuvwxy"
        lead = letters[:self.lead]
        ins = letters[self.lead:self.a.ndim - 1]
        outs = letters[len(lead) + len(ins):len(lead) + len(ins) + self.b.ndim - 1 - self.lead]
        z = RANK_LETTER
        update = jnp.einsum(f"{lead}{ins}{z},{lead}{z}{outs}->{lead}{ins}{outs}", self.a.astype(jnp.float32),
                            self.b.astype(jnp.float32))
        base = jax.lax.stop_gradient(self.base).astype(jnp.float32)
        if self.float8:  # the scales broadcast over the input axes
            scale = jax.lax.stop_gradient(self.base_scale)
            base = base * scale.reshape(*scale.shape[:len(lead)], *[1] * len(ins), *scale.shape[len(lead):])
        dtype = jnp.float32 if self.float8 else self.base.dtype
        return (base + self.scale * update).astype(dtype)

    def project(self, spec: str, x, base_product):
        """`einsum(spec, x, W)` with W this weight (no lead axes: one expert's or a dense one), the base's
        part by `base_product(spec, x, base)`, the update's from the activations: two thin products."""
        operands, out = spec.split("->")
        x_spec, w_spec = operands.split(",")
        ins = w_spec[:self.a.ndim - 1]
        outs = w_spec[len(ins):]
        between = "".join(c for c in out if c not in outs)  # the activation's axes that stay (batch, length)
        z = RANK_LETTER
        assert z not in spec and self.lead == 0, (spec, self.lead)
        y = base_product(spec, x, jax.lax.stop_gradient(self.base))
        if self.float8:  # the output axes come last in every projection's spec
            y = (y.astype(jnp.float32) * jax.lax.stop_gradient(self.base_scale)).astype(y.dtype)
        h = jnp.einsum(f"{x_spec},{ins}{z}->{between}{z}", self._dropped(x), self.a.astype(x.dtype))
        update = jnp.einsum(f"{between}{z},{z}{outs}->{out}", h, self.b.astype(x.dtype))
        return y + (self.scale * update).astype(y.dtype)

    def _dropped(self, x):
        if not self.dropout:
            return x
        seed = jax.lax.stop_gradient(self.seed).astype(jnp.uint32)
        keep = jax.random.bernoulli(jax.random.key(seed), 1.0 - self.dropout, x.shape)
        return jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)


def input_axes(names: tuple, lead: int) -> int:
    """How many of a weight's axes after its `lead` ones an activation is contracted with: two for an
    output projection from the heads ([heads, head_dim, embed]), else one."""
    return 2 if names[lead] == "heads" else 1


def adapter_names(names: tuple, lead: int, ins: int) -> tuple[tuple, tuple]:
    """The logical names of A and B from their base's `names` ([*lead, *ins, *outs]): the layout shards
    them by the base's rules, with the rank unnamed (whole on every device)."""
    return (*names[:lead + ins], None), (*names[:lead], None, *names[lead + ins:])


def scale_names(names: tuple, lead: int, ins: int) -> tuple:
    """The logical names of a float8 base's scales: the base's without its input axes."""
    return (*names[:lead], *names[lead + ins:])


FLOAT8 = jnp.float8_e4m3fn


def quantized(w, lead: int, ins: int) -> tuple[jax.Array, jax.Array]:
    """(w in float8 e4m3, float32 scales [*lead, *outs]) with w ~ q * scale: each output channel's
    largest magnitude over the input axes maps to float8's largest (448)."""
    axes = tuple(range(lead, lead + ins))
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=axes)
    scale = jnp.maximum(amax, 1e-30) / float(jnp.finfo(FLOAT8).max)
    expanded = scale.reshape(*scale.shape[:lead], *[1] * ins, *scale.shape[lead:])
    return (w32 / expanded).astype(FLOAT8), scale


def merged(w):
    """A weight as an array: a LoRA-adapted one merged, any other as it is."""
    return w.merged() if isinstance(w, LowRankAdapted) else w
