"""Knowledge of the serving engine's contract (bottom layer): known vLLM/LMCache image pairs and the like."""
