"""The qwen3 family: Qwen3 dense and MoE (transformers' Qwen3ForCausalLM, Qwen3MoeForCausalLM): the
Llama layers with QK-norm and a head size of its own; the Hugging Face map in hf.py."""

from ushard.models.family import Family
from ushard.models.qwen3 import hf, model

FAMILY = Family(name="qwen3", build=model.build, hf=hf.HF, check=model.check)
