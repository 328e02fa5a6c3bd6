"""The containerized DDP trainer that every rank pod of a DDPJob runs."""

__version__ = "0.1.0"
