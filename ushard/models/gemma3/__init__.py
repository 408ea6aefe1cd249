"""The gemma3 family: Gemma 3's text model (transformers' Gemma3ForCausalLM, model_type gemma3_text):
sliding-window layers with a global one every sliding_window_pattern-th, QK-norm, four norms a block,
GeGLU, a scaled embedding; modules in model.py, the Hugging Face map in hf.py."""

from ushard.models.family import Family
from ushard.models.gemma3 import hf, model

FAMILY = Family(name="gemma3", build=model.build, hf=hf.HF, check=model.check, attention_shape=model.attention_shape)
