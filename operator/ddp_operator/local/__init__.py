"""`ddpjob run`: a DDPJob manifest run as local processes.

Pure parts (``plan``, ``run_policy``) turn a parsed job and the operator's own pod manifests into
process specs and say which runPolicy fields apply here; impure parts (``supervisor``, ``scrape``,
``runner``) start, watch and stop those processes. What the processes report is read and shown by
the operator's own ``ddp_operator.progress``.
"""
