"""Integrations with training frameworks; each module imports its framework lazily, on use."""
