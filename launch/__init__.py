"""hla_sp.launch: the torchrun trainer, its data, checkpoints and logs, Ray sweeps, the CLI.

Entry points:

- ``torchrun ... -m hla_sp.launch.train <flags>`` (or ``hla-sp train``): train a
  megatron-core GPT whose core attention is HLA, with context parallelism.
- ``python -m hla_sp.launch.make_dataset`` (or ``hla-sp make-dataset``): text files
  to a Megatron indexed dataset (``.bin``/``.idx``).
- ``python -m hla_sp.launch.ray_sweep CONFIG`` (or ``hla-sp sweep``): a Ray Train grid
  over world sizes and sequence lengths.

Modules import megatron-core, Ray and matplotlib lazily where they can, so that
``import hla_sp.launch`` stays cheap.
"""
