"""hla-sp models for Hugging Face ``transformers`` (``pip install hla-sp[hf]``).

``import hla_sp.hf`` registers the ``hla_sp`` model type, so that a directory written by
``save_pretrained`` (or ``hla-sp export``) loads with ``AutoConfig`` and
``AutoModelForCausalLM``. The model needs no megatron-core: it is plain PyTorch around
the same :class:`hla_sp.nn.HLAHeads` the trainer runs.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from hla_sp.hf.cache import HLASPCache
from hla_sp.hf.configuration import HLASPConfig
from hla_sp.hf.modeling import HLASPForCausalLM, HLASPModel

AutoConfig.register(HLASPConfig.model_type, HLASPConfig, exist_ok=True)
AutoModel.register(HLASPConfig, HLASPModel, exist_ok=True)
AutoModelForCausalLM.register(HLASPConfig, HLASPForCausalLM, exist_ok=True)

# --- tokenizer registration (hla_sp/hf/tokenization.py) goes here ---

__all__ = ["HLASPCache", "HLASPConfig", "HLASPForCausalLM", "HLASPModel"]
