"""Test helper: lets Megatron-LM's own ``pretrain()`` run on a CPU-only machine (gloo).

Not part of hla_sp. The tests put this directory on PYTHONPATH and set
``HLA_SP_MEGATRON_CPU_SHIM=1``, so that ``python -m hla_sp.megatron_patch.pretrain_gpt``
(and every torchrun worker) starts with these patches, and nothing else changes:

* ``initialize_megatron(allow_no_cuda=True)``, and the model-parallel groups built after
  ``torch.distributed`` starts (Megatron skips them when ``device_count() == 0``);
* the dataset helpers' compile step and the jit-fusion warm-up are no-ops (both need
  a compiler or CUDA; the wheel ships the compiled helpers);
* ``device="cuda"`` (a string, a ``torch.device`` or an index) becomes the CPU, through a
  ``TorchFunctionMode``; ``Tensor.cuda()`` returns the tensor;
* CUDA streams and events are no-ops; ``torch.cuda.current_device``, ``synchronize``,
  ``get_device_properties`` and the memory counters answer as for one idle device;
* Megatron's RNG tracker is seeded as on a GPU and keeps its states in a CPU generator.

With ``HLA_SP_TEST_LOGITS=<dir>`` the first training forward of each rank also writes
its micro-batch's tokens, positions and logits to ``<dir>/rank<r>.pt`` (one more
forward, without gradient), for tests that compare logits across runs.

Megatron also needs the flags ``--distributed-backend gloo --rerun-mode disabled
--use-cpu-initialization --transformer-impl local --clip-grad 0`` (clipping asks
``Tensor.type()`` for a CUDA type name).
"""

from __future__ import annotations

import os

if os.environ.get("HLA_SP_MEGATRON_CPU_SHIM") == "1":
    import functools
    import inspect
    from typing import Any

    import torch
    from torch.overrides import TorchFunctionMode

    def _is_cuda(device: Any) -> bool:
        if isinstance(device, str):
            return device.startswith("cuda")
        if isinstance(device, torch.device):
            return device.type == "cuda"
        return isinstance(device, int) and not isinstance(device, bool)

    class _CudaToCpu(TorchFunctionMode):
        """Every ``device=cuda`` of a torch call, and ``.to(cuda)``, lands on the CPU."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func in (torch.Tensor.cuda, torch.Tensor.pin_memory):
                return args[0]
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    _CudaToCpu().__enter__()  # for the whole process, never left

    _rng = torch.Generator()

    def _rng_state(*_: Any, **__: Any) -> torch.Tensor:
        return _rng.get_state()

    def _set_rng_state(state: torch.Tensor, *_: Any, **__: Any) -> None:
        _rng.set_state(state)

    class _Props:
        name, major, minor = "cpu (test shim)", 9, 0
        total_memory, multi_processor_count = 1 << 34, 1

    class _Stream:
        """A CUDA stream or event that has nothing to order: every call is a no-op."""

        def __init__(self, *_: Any, **__: Any) -> None:
            pass

        def __getattr__(self, name: str) -> Any:
            return lambda *_, **__: 0.0 if name == "elapsed_time" else True

        def __enter__(self) -> _Stream:
            return self

        def __exit__(self, *_: Any) -> None:
            return None

    cuda = torch.cuda
    cuda.Stream = cuda.Event = _Stream
    cuda.stream = _Stream
    cuda.current_stream = cuda.default_stream = lambda *_, **__: _Stream()
    cuda.current_device = lambda: 0
    cuda.set_device = lambda *_: None
    cuda.synchronize = lambda *_, **__: None
    cuda.get_device_properties = lambda *_: _Props()
    cuda.get_device_capability = lambda *_: (9, 0)
    cuda.get_rng_state = _rng_state
    cuda.set_rng_state = _set_rng_state
    cuda.manual_seed = lambda seed: _rng.manual_seed(seed)
    cuda.manual_seed_all = cuda.manual_seed
    for _name in ("memory_allocated", "max_memory_allocated", "memory_reserved",
                  "max_memory_reserved"):
        setattr(cuda, _name, lambda *_, **__: 0)
    cuda.reset_peak_memory_stats = lambda *_, **__: None
    cuda.empty_cache = lambda: None

    import megatron.core.tensor_parallel.random as _mrandom
    import megatron.training.initialize as _minit
    import megatron.training.training as _mtraining
    from megatron.core import parallel_state as _mpu

    _mrandom._get_cuda_rng_state = _rng_state
    _mrandom._set_cuda_rng_state = _set_rng_state

    _original_init = _minit.initialize_megatron

    @functools.wraps(_original_init)
    def _initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return _original_init(*args, **kwargs)

    _minit.initialize_megatron = _initialize_megatron
    _mtraining.initialize_megatron = _initialize_megatron

    _original_dist = _minit._initialize_distributed

    @functools.wraps(_original_dist)
    def _initialize_distributed(*args: Any, **kwargs: Any) -> Any:
        out = _original_dist(*args, **kwargs)
        if not _mpu.model_parallel_is_initialized():
            a = _minit.get_args()
            wanted = dict(
                tensor_model_parallel_size=a.tensor_model_parallel_size,
                pipeline_model_parallel_size=a.pipeline_model_parallel_size,
                virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
                context_parallel_size=a.context_parallel_size,
                expert_model_parallel_size=a.expert_model_parallel_size,
                expert_tensor_parallel_size=a.expert_tensor_parallel_size,
                distributed_timeout_minutes=a.distributed_timeout_minutes,
                order="tp-cp-ep-dp-pp",
            )
            params = inspect.signature(_mpu.initialize_model_parallel).parameters
            _mpu.initialize_model_parallel(**{k: v for k, v in wanted.items() if k in params})
        return out

    _minit._initialize_distributed = _initialize_distributed

    _original_seed = _minit._set_random_seed

    @functools.wraps(_original_seed)
    def _set_random_seed(seed_: int, *args: Any, **kwargs: Any) -> Any:
        # Megatron seeds its RNG tracker only when device_count() > 0; softmax layers
        # fork it (even at dropout 0), so seed it as Megatron would (per pipeline stage).
        out = _original_seed(seed_, *args, **kwargs)
        if seed_ is not None and not _mrandom.get_cuda_rng_tracker().is_initialized():
            pp_rank = _mpu.get_pipeline_model_parallel_rank()
            _mrandom.model_parallel_cuda_manual_seed(seed_ + 100 * pp_rank)
        return out

    _minit._set_random_seed = _set_random_seed
    for _name in ("_compile_dependencies", "set_jit_fusion_options"):
        if hasattr(_minit, _name):
            setattr(_minit, _name, lambda *_, **__: None)
    if hasattr(_mtraining, "set_jit_fusion_options"):
        _mtraining.set_jit_fusion_options = lambda *_, **__: None

    if os.environ.get("HLA_SP_TEST_LOGITS"):
        from megatron.core.models.gpt.gpt_model import GPTModel as _GPTModel

        _gpt_forward = _GPTModel.forward
        _dumped: list[bool] = []

        @functools.wraps(_gpt_forward)
        def _forward(self: Any, input_ids: Any, position_ids: Any, attention_mask: Any,
                     *args: Any, **kwargs: Any) -> Any:
            out = _gpt_forward(self, input_ids, position_ids, attention_mask, *args, **kwargs)
            if kwargs.get("labels") is not None and not _dumped:
                _dumped.append(True)
                with torch.no_grad():  # the same call, logits instead of the loss
                    logits = _gpt_forward(self, input_ids, position_ids, attention_mask,
                                          *args, **dict(kwargs, labels=None))
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                torch.save({"tokens": input_ids, "position_ids": position_ids,
                            "logits": logits.float()},
                           os.path.join(os.environ["HLA_SP_TEST_LOGITS"], f"rank{rank}.pt"))
            return out

        _GPTModel.forward = _forward
