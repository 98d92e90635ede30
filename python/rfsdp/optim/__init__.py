"""rfsdp.optim: AdamW, AdamW8bit, Muon, NorMuon, Shampoo and SOAP as torch.optim.Optimizer
subclasses over the C++ optimizers (optimizers/). Parameters are the shards
fully_shard made, FSDP2's DTensors, or plain tensors (replicated on every rank
under DDP); float32, bfloat16 or float16 (states and the update in float32,
written back rounded: rounding="nearest" or "stochastic"). Python keeps what is
Python's: param groups (each step hands every parameter its group's
hyperparameters), LR schedulers, and state_dict / load_state_dict in torch's
format, whose tensors are the C++ optimizer's own."""
from .adamw import AdamW, AdamW8bit
from .muon import Muon, NorMuon
from .qk_clip import QKPair, qk_clip_, qk_clip_many_
from .shampoo import Shampoo
from .soap import SOAP

__all__ = ["AdamW", "AdamW8bit", "Muon", "NorMuon", "Shampoo", "SOAP", "QKPair", "qk_clip_",
           "qk_clip_many_"]
