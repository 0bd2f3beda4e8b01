"""The reusable training loop behind ``examples/pretrain_gpt.py`` (data, model, logging)."""
