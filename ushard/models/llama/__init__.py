"""The llama family: Llama 2/3, Mistral (without a sliding window), Mixtral; modules in model.py, the
Hugging Face map in hf.py."""

from ushard.models.family import Family
from ushard.models.llama import hf, model

FAMILY = Family(name="llama", build=model.build, hf=hf.HF, check=model.check)
