"""How far apart two setups are, in numbers: the pair metrics, every pair of a model's runs,
their teacher-forced passes, op by op, and each setup against the exact answer or another
model."""
