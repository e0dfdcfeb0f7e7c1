"""The trainer's configuration: the flags (:mod:`.flags`), the sections
(:mod:`.sections`, :mod:`.sections_run`) and :class:`~.train_config.TrainConfig`, which
holds one of each and parses ``hla-sp train``'s command line."""
