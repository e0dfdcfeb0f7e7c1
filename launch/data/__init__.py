"""Training data: the sample sources (:mod:`.datasets`), Megatron indexed datasets
(:mod:`.indexed_dataset`, written by :mod:`.make_dataset`) and the run's tokenizer
(:mod:`.tokenizer`)."""
