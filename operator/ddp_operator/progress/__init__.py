"""Training progress read from the trainer's /metrics: one package for the operator and `ddpjob run`.

``series`` (the names read), ``exposition`` (one pod's endpoint, parsed and reduced), ``histogram``
(PromQL's quantile over buckets), ``tracker`` (reads over time: rates, percent done, the straggler,
the step a stall is measured from), ``render`` (status.progress, the live line, the summary) and
``pull`` (the operator's fetch). `ddpjob run` fetches in ``ddp_operator.local.scrape``; the two
differ only in how they fetch (docs/architecture.md, "Progress").
"""
