"""hla-sp models for Hugging Face ``transformers`` (elsewhere: ``make wheel``, docs/eval.md).

``import hla_sp.hf`` registers the ``hla_sp`` model type, so that a directory written by
``save_pretrained`` (or ``hla-sp export``) loads with ``AutoConfig`` and
``AutoModelForCausalLM``. The model needs no megatron-core: it is plain PyTorch around
the same :class:`hla_sp.nn.HLAHeads` the trainer runs.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from hla_sp.hf.cache import HLASPCache
from hla_sp.hf.configuration import HLASPConfig
from hla_sp.hf.modeling import HLASPForCausalLM, HLASPModel
from hla_sp.hf.tokenization import HLASPByteTokenizer

AutoConfig.register(HLASPConfig.model_type, HLASPConfig, exist_ok=True)
AutoModel.register(HLASPConfig, HLASPModel, exist_ok=True)
AutoModelForCausalLM.register(HLASPConfig, HLASPForCausalLM, exist_ok=True)

# the byte-level tokenizer of the trainer's default data (tokenizer_class in its files)
AutoTokenizer.register(HLASPConfig, tokenizer_class=HLASPByteTokenizer, exist_ok=True)

__all__ = ["HLASPByteTokenizer", "HLASPCache", "HLASPConfig", "HLASPForCausalLM", "HLASPModel"]
