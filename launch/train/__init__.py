"""Training: ``torchrun -m hla_sp.launch.train <flags>`` (:mod:`.main`), the
:class:`~.trainer.Trainer` and its components, mixed precision, the non-finite check,
progress and records (:mod:`.metrics`), throughput and ``--profile``."""
