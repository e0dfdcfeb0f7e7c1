"""The megatron-core GPT the trainer trains (:mod:`.build`), its loss (:mod:`.loss`),
``--compile`` (:mod:`.compiling`) and what it costs before it runs (:mod:`.estimate`)."""
