"""Run by test_user_flows.py: transformers' Trainer with rfsdp's optimizers.

  trainer_worker.py make DIR        a tiny random Llama saved to DIR (nothing downloaded)
  trainer_worker.py train DIR OUT   every rfsdp optimizer through Trainer(optimizers=(opt,
                                    None)) on the model from DIR: one process, or under
                                    torchrun sharded at load by transformers' FSDP2
                                    (DistributedConfig(fsdp_size=world)); rank 0 saves the
                                    losses and full parameters to OUT.

The same 4 steps either way: a sequential sampler (each step's global batch is
the next 4 examples, split over the ranks), a constant learning rate, gradient
clipping at 1.0 (the Trainer's default). On the CPU accelerate wraps every
multi-process model in DistributedDataParallel (its FSDP path is for GPU-like
devices), which a model of DTensors cannot take: here a model that is already
sharded is passed through unwrapped, as accelerate does for FSDP2 models on a GPU."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import OPTIMIZERS, full_params  # noqa: E402


def make(model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)


def pass_sharded_models_through_accelerate():
    import accelerate
    from torch.distributed.tensor import DTensor
    prepare = accelerate.Accelerator.prepare_model

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if any(isinstance(p, DTensor) for p in model.parameters()):
            return model
        return prepare(self, model, device_placement, evaluation_mode)
    accelerate.Accelerator.prepare_model = prepare_model


def build(name, model):
    import rfsdp
    named = list(model.named_parameters())
    if name == "Muon":  # hidden matrices; embeddings, the head and norms with AdamW
        hidden = [p for n, p in named if p.dim() >= 2 and "embed" not in n and "lm_head" not in n]
        rest = [p for n, p in named if not any(p is q for q in hidden)]
        return rfsdp.optim.Muon([dict(params=hidden), dict(params=rest, use_muon=False)], lr=0.02)
    params = [p for _, p in named]
    if name == "AdamW8bit":
        return rfsdp.optim.AdamW8bit(params, lr=1e-3, min_8bit_size=1024)
    if name == "Shampoo":  # (epsilon 1e-6: roots of these tiny factors amplify rounding less)
        return rfsdp.optim.Shampoo(params, lr=1e-3, precondition_frequency=2,
                                   start_preconditioning_step=2, epsilon=1e-6)
    if name == "SOAP":  # tiles of 8 rows: FSDP2's chunk rows of this model never cut them
        return rfsdp.optim.SOAP(params, lr=1e-3, precondition_frequency=2,
                                max_preconditioner_dim=8, eps=1e-6)
    return rfsdp.optim.AdamW(params, lr=1e-3)


def train(model_dir, out):
    import torch.distributed as dist
    from torch.utils.data import SequentialSampler
    from transformers import LlamaForCausalLM, Trainer, TrainingArguments
    from transformers.distributed import DistributedConfig

    class SequentialTrainer(Trainer):
        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
        pass_sharded_models_through_accelerate()
    g = torch.Generator().manual_seed(0)
    data = [dict(input_ids=t, labels=t) for t in torch.randint(0, 128, (16, 16), generator=g)]
    results = {}
    for name in OPTIMIZERS:
        kw = dict(distributed_config=DistributedConfig(fsdp_size=world)) if world > 1 else {}
        model = LlamaForCausalLM.from_pretrained(model_dir, **kw)
        start = full_params(model)
        opt = build(name, model)
        args = TrainingArguments(output_dir=os.path.join(os.path.dirname(out), "trainer"),
                                 use_cpu=True, per_device_train_batch_size=4 // world, max_steps=4,
                                 report_to=[], save_strategy="no", logging_steps=1,
                                 lr_scheduler_type="constant", dataloader_drop_last=True,
                                 disable_tqdm=True)
        trainer = SequentialTrainer(model=model, args=args, train_dataset=data,
                                    optimizers=(opt, None))
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        results[name] = dict(losses=losses, params=full_params(model), start=start)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save(results, out)
    if world > 1:
        dist.barrier()
        os._exit(0)  # (torch's Gloo threads may abort a normal exit: see rfsdp._comm)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        train(sys.argv[2], sys.argv[3])
