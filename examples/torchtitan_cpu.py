"""TorchTitan's own trainer on CPU (gloo) with zephon's data loader: a tiny Llama 3 for a few steps.

Run (1 or 2 ranks; the tokenizer folder holds a ``tokenizer.json`` of at most 2048 ids, the debug
model's vocabulary, and a ``tokenizer_config.json`` naming its ``eos_token``)::

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \\
        examples/torchtitan_cpu.py --module torchtitan_cpu --config tiny_zephon \\
        --hf_assets_path TOKENIZER_DIR --dump_folder OUT [--training.steps 4 --checkpoint.interval 2]

Run again with the same ``--dump_folder`` (on any number of ranks dividing the 2 lanes) and the
trainer resumes from its latest checkpoint, data included.

``tiny_zephon()`` is an ordinary TorchTitan config function: ``llama3_debugmodel`` cut to one
layer, ``seq_len`` 32, 2 lanes of 2-row microbatches, and ``use_zephon`` for the data (the JSONL
folder in ``$ZEPHON_TITAN_DATA``, default ``../shared/data/corpus``). What makes CPU work is all
here, and each item exists because TorchTitan 0.3.0 (with torch 2.13.0) has no CPU mode:

- ``triton`` must be installed (``pip install -c <(echo torch==2.13.0) triton==3.9.0``):
  ``import torchtitan.trainer`` imports it unconditionally (MoE kernels), although nothing here
  runs a triton kernel;
- before torchtitan is imported, :func:`use_cpu` makes torch report ``"cpu"`` as the available
  accelerator (TorchTitan picks ``torch._utils._get_available_device_type() or "cuda"`` at import,
  and its process group is then gloo), gives ``torch.cpu`` the CUDA memory-statistics functions
  TorchTitan's metrics call (reporting nothing), makes ``torch.cpu.current_device()`` an index
  (its barrier passes ``device_ids=[current_device()]``), and adds ``torch.distributed.set_timeout``,
  which TorchTitan calls after the first step and torch 2.13.0 lacks (it is a newer API);
- the config uses SDPA attention, causal over the whole row (FlexAttention has no backward on CPU
  and varlen attention is CUDA-only), ``parallelism.spmd_backend = "partial_dtensor"`` (on 2
  ranks, FSDP under the default ``"spmd_types"`` fails here with torch 2.13.0), no activation
  checkpointing, no compile, no CUDA graphs, and a ``post_optimizer_build_fn`` that makes FSDP reduce gradients with SUM (gloo has
  no ``PREMUL_SUM``; TorchTitan scales gradients by the token count itself).
"""

from __future__ import annotations

import os
import types
from pathlib import Path

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus"


def use_cpu() -> None:
    """Make torch look to TorchTitan like a CPU accelerator; call before importing torchtitan."""
    import torch
    import torch._utils

    torch._utils._get_available_device_type = lambda: "cpu"
    for name, fn in {
        "get_device_name": lambda device=None: "CPU",
        "get_device_properties": lambda device=None: types.SimpleNamespace(total_memory=1 << 30),
        "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
    }.items():
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, fn)
    torch.cpu.current_device = lambda: 0
    if not hasattr(torch.distributed, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        torch.distributed.set_timeout = lambda timeout, group=None: _set_pg_timeout(timeout, group)


def sum_gradient_reductions(optimizers, model_parts, parallel_dims) -> None:
    """FSDP reduces gradients with SUM (gloo has no PREMUL_SUM); TorchTitan divides them itself."""
    from torch.distributed.fsdp import FSDPModule

    for part in model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)


def tiny_zephon():
    """``llama3_debugmodel`` shrunk to run on CPU, loading its data with zephon."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from zephon.integrations.torchtitan import ZephonDataLoader, ZephonDataset, ZephonProcessing, use_zephon

    config = llama3_debugmodel()
    config.model_spec.post_optimizer_build_fn = sum_gradient_reductions
    model = config.model_spec.model
    model.layers = model.layers[:1]
    for layer in model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.parallelism.spmd_backend = "partial_dtensor"
    config.activation_checkpoint = None
    config.compile.enable = False
    config.training.disable_cuda_graphs = True
    config.training.seq_len = 32
    config.training.local_batch_size = 2
    config.training.global_batch_size = 4  # one zephon step: 2 lanes x 2 rows
    config.training.steps = 4
    config.validator.enable = False
    config.debug.seed = 0
    config.checkpoint.enable = True
    config.checkpoint.interval = 2
    return use_zephon(config, ZephonDataLoader.Config(
        datasets=[ZephonDataset(name="corpus", path=os.environ.get("ZEPHON_TITAN_DATA", str(DEFAULT_DATA)))],
        processing=ZephonProcessing(shuffle_buffer=16),  # the trainer's own tokenizer (hf_assets_path)
        canonical_replicas=2,
    ))


if __name__ == "__main__":
    use_cpu()
    from torchtitan.train import main

    main()
