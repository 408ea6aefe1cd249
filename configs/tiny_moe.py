"""configs/tiny.py with mixture-of-experts layers: 8 experts, each token routed to 2.

Every layer's MLP is an MoE block (ushard/models/moe.py) whose experts are half as wide as tiny's
MLP, so a token's two experts cost what tiny's MLP costs: 5.3M parameters, 1.8M of them active per
token. float32 compute on CPUs. The experts are split over all devices (expert parallelism with
all-to-all dispatch; 8 devices: one expert each), which also act as a batch axis elsewhere.

A capacity factor of 1.25 keeps the dispatch buffers small: dropless (`model.moe.capacity_factor=0`)
is exact too, but its buffers hold every token for every expert, which on CPUs costs about twice
the step time.
"""

from ushard.configs.tiny import get_config as tiny_config


def get_config():
    c = tiny_config()
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.expert_d_ff = 256
    c.model.moe.capacity_factor = 1.25
    c.mesh.expert = -1
    c.mesh.fsdp = 1
    return c
