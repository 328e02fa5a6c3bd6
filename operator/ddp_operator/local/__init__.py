"""`ddpjob run`: a DDPJob manifest run as local processes.

Pure parts (``plan``, ``promtext``, ``progress``) turn a parsed job and the operator's own pod
manifests into process specs and render what the processes report; impure parts (``supervisor``,
``scrape``, ``runner``) start, watch and stop those processes.
"""
