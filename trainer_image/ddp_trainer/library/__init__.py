"""The library a user imports into their own DDP script: ``instrument()`` and the recorders behind it.

Its public names are re-exported from ``ddp_trainer``; nothing here imports the supervisor or the
built-in trainer, so a user's script that imports the library loads neither.
"""
