"""The deepseek family: DeepSeek-V2 (V2-Lite too) and DeepSeek-V3 (transformers' DeepseekV2ForCausalLM,
DeepseekV3ForCausalLM): Llama's pre-norm blocks with multi-head latent attention (ushard/models/mla.py)
and, after the leading dense layers, MoE blocks with shared experts; modules in model.py, the Hugging
Face map in hf.py."""

from ushard.models.deepseek import hf, model
from ushard.models.family import Family

FAMILY = Family(name="deepseek", build=model.build, hf=hf.HF, check=model.check, attention_shape=model.attention_shape)
