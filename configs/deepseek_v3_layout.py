"""DeepSeek-V3 (configs/deepseek_v3.py: latent attention, 256 routed experts, a multi-token prediction
module) laid out as it was trained: pipeline x expert x ZeRO-1 data parallelism.

The layout is the DeepSeek-V3 technical report's (section 3.2, "Training Framework"): 16-way pipeline
parallelism, 64-way expert parallelism spanning 8 nodes, and ZeRO-1 data parallelism, on 2048 H800s.
Here: mesh.pipeline=16, mesh.expert=64 (4 of the 256 routed experts a device; outside the MoE layers
`expert` is one more data-parallel axis, as DeepSeek's expert-parallel ranks are data-parallel ranks
for attention), mesh.fsdp=-1 with parallel.zero_stage=1 (only the optimizer state is split over it).
1024 devices a replica; 2048 (DeepSeek's count, v5p:8x16x16) gives fsdp=2.

What differs, and why:
- Schedule: DeepSeek ran DualPipe (two pipelines in opposite directions, overlapping the expert
  all-to-alls with computation), which ushard does not have. The nearest it has is the circular
  (interleaved) schedule: 4 rounds of one layer each, 16 microbatches (the fewest it takes), bubble
  15 / (4·16 + 15) = 19%. 1F1B does not take DeepSeek-V3's 3 dense layers (a second stack) and is
  not used. Circular keeps every tick's layer inputs (4·16 + 15 ticks of one layer here); until
  2026-12-02 it kept each tick's bf16 chunk of weights too, and then 24 microbatches needed 103 GiB
  of temporaries a chip (docs/benchmarks.md).
- Layers: 64 MoE layers where DeepSeek-V3 has 61 (3 dense, then 58 MoE). ushard's stages are equal,
  and each stack of layers (the leading dense ones, the MoE ones) is split over the stages on its
  own, so both counts must be multiples of mesh.pipeline x parallel.pipeline_repeats; 61 is prime.
  The report does not say how its 61 layers sat on the 16 stages. The nearest equal split keeps
  every layer an MoE layer: 64, 6 more MoE layers and 3 fewer dense ones than DeepSeek-V3. The
  multi-token prediction module runs after the stages with the head, the pipeline's microbatches
  one after another (under 1F1B it would run inside the last stage's ticks).
- Batch: 16384 sequences of 4096 (67M tokens) in 8 gradient-accumulation parts of 2048, each in 16
  microbatches of 128 sequences, one a device over expert x fsdp at 2048 devices. DeepSeek-V3's batch
  was 15360 (after a ramp from 3072 over the first 469B tokens; ushard has no batch schedule), which
  does not split into parts of 16 x 128 sequences.
- Routing: dropless, as DeepSeek-V3 trained, through the ragged dispatch (deepseek_v3_like's): each
  device's receive buffer holds twice an even load (`model.moe.dispatch_headroom`), and a step whose
  routing needs more stops the run with a sentence. The first draft of this layout had capacity 1.25,
  because the dispatch then sized its buffers for the worst case (every local token at every expert,
  14 GiB a layer at 4096 tokens a device) and did not fit.

Compiled for TPU without a TPU in docs/benchmarks.md ("DeepSeek-V3's layout fits 2,048 v5p chips"):
68.77 GiB a chip (16.88 GiB of arguments, 51.89 of temporaries) of the v5p's 95.74; `ushard plan`
estimates 64.74 (0.94). At 1024 devices each holds two sequences of a microbatch, not compiled.
"""

from ushard.configs.deepseek_v3 import get_config as deepseek_v3_config


def get_config():
    c = deepseek_v3_config()
    c.model.n_layers = 64  # DeepSeek-V3: 61, the first 3 dense; see the docstring
    c.model.moe.first_dense_layers = 0
    c.model.compute_dtype = "bfloat16"
    c.model.remat = "full"
    c.mesh.pipeline = 16
    c.mesh.expert = 64
    c.mesh.fsdp = -1
    c.parallel.zero_stage = 1
    c.parallel.pipeline_schedule = "circular"
    c.parallel.pipeline_repeats = 4
    c.parallel.pipeline_microbatches = 16
    c.train.batch_size = 16384
    c.train.grad_accum = 8
    return c
