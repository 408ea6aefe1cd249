"""Kernels: one contract per operation, one implementation per platform, one place that picks.

- Attention (`attention.py`): causal attention with segment ids (documents), in two forms. The
  whole-sequence form (`whole_sequence`) is what a layer calls when its sequence is on one device;
  the block form (`BlockKernel` and `xla_block`: a block of queries against a block of keys from
  anywhere in the sequence, returning the log-sum-exp beside the output) is what context
  parallelism combines across devices. Implementations: XLA (every platform, both forms), cuDNN
  (`cudnn.py`, GPUs), Pallas splash (`splash.py`, TPUs). `resolve` is the one place that turns
  `model.attention_impl` into the kernel that runs, with `why`; the `ParallelPlan` records it.
- Grouped matmul (`grouped_matmul.py`): rows sorted by group times one weight matrix per group, the
  routed experts' matmul; XLA's `ragged_dot` today, JAX's Pallas grouped matmuls behind the same
  contract next.

Kernels know no layer and no mesh axis: parallel code (ushard/parallel) runs them on each device's
blocks; the model calls them through its attention and MoE layers.
"""
