"""kvoffload: KV-cache offloading for vLLM + LMCache on Kubernetes."""

__version__ = "0.1.0"
