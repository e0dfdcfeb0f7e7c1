"""A checkpoint out of the trainer: ``hla-sp export`` to a Hugging Face directory
(:mod:`.command`, converted by :mod:`.hf_convert`) and ``hla-sp generate`` (:mod:`.generate`)."""
