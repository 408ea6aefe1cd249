"""Kernels: one contract per operation, one implementation per platform, one place that picks.

- Attention (`attention.py`): causal attention with segment ids (documents), in two forms. The
  whole-sequence form (`whole_sequence`) is what a layer calls when its sequence is on one device;
  the block form (`BlockKernel` and `xla_block`: a block of queries against a block of keys from
  anywhere in the sequence, returning the log-sum-exp beside the output) is what context
  parallelism combines across devices. Implementations: XLA (every platform, both forms), cuDNN
  (`cudnn.py`, GPUs), ushard's flash attention (`flash.py` on Pallas Triton, with the Mosaic GPU
  kernels of `flash_hopper.py` and `flash_hopper_backward.py` on Hopper), Pallas splash (`splash.py`,
  TPUs). `resolve` turns `model.attention_impl` into the kernel that runs, with `why`; the
  `ParallelPlan` records it.
- Grouped matmul (`grouped_matmul.py`): rows sorted by group times one weight matrix per group, the
  routed experts' matmul: XLA's `ragged_dot`, and JAX's Pallas kernels (Mosaic GPU on Hopper,
  megablox on TPUs) under one custom VJP (`sealed.py` types their products for `shard_map`).

Kernels know no layer: the model calls them through its attention and MoE layers, and parallel code
(ushard/parallel) runs them on each device's blocks. One exception knows the mesh: a whole-sequence
Pallas kernel is not partitioned by XLA, so `attention.by_halves` maps its halves over the active
layout's mesh itself.
"""
