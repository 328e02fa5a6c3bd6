"""The decision rules of a DDPJob, one module per policy; pure functions of observations."""
