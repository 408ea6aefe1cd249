"""ushard: SPMD training of transformer language models with JAX, from one CPU to pods and clusters."""

__version__ = "0.1.0"
