"""configs/tiny.py with mixture-of-experts layers: 8 experts, each token routed to 2 (dropless).

Every layer's MLP is an MoE block (ushard/models/moe.py) whose experts are half as wide as tiny's
MLP, so a token's two experts cost what tiny's MLP costs: 5.3M parameters, 1.8M of them active per
token.
float32 compute on CPUs. Expert parallelism over 8 devices:
`--config.mesh.expert=8 --config.mesh.fsdp=1` (the default lays everything out ZeRO-3 over fsdp).
"""

from ushard.configs.tiny import get_config as tiny_config


def get_config():
    c = tiny_config()
    c.model.moe.num_experts = 8
    c.model.moe.top_k = 2
    c.model.moe.expert_d_ff = 256
    return c
