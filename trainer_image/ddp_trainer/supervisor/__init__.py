"""The pod's supervisor: its workers, the launchers' rounds rendezvous, restarts and the state's hand-off.

``python -m ddp_trainer`` runs it on every pod of an InPlace job (docs/trainer.md, "The pod's
supervisor"); it is built on torch's public API only.
"""
