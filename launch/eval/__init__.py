"""``hla-sp eval``: the command (:mod:`.command`), its torchrun workers (:mod:`.run`),
what they feed the model (:mod:`.tasks`) and what they write (:mod:`.report`)."""
