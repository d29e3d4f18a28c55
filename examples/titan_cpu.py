"""addnorm inside torchtitan, on the CPU: torchtitan's debug-size Llama 3 built through addnorm's model
converter, against the untouched model (the README's torchtitan example; needs ``addnorm[torchtitan]``).

    python examples/titan_cpu.py
"""

import torch
from torchtitan.models.llama3 import model_registry

from addnorm.titan import AddNormConverter, on_cpu


def build(spec):
    """A model as torchtitan's trainer makes it: built on the meta device, then initialised by its
    init_weights (the same seed, so both models start from the same weights)."""
    with torch.device("meta"):
        model = on_cpu(spec.model).build()  # on_cpu: causal SDPA, as FlexAttention has no CPU backward
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


untouched = build(model_registry("debugmodel"))
fused = build(model_registry("debugmodel", converters=[AddNormConverter.Config()]))
sandwich = build(model_registry("debugmodel", converters=[AddNormConverter.Config(placement="sandwich")]))

tokens = torch.randint(0, 2048, (2, 65), generator=torch.Generator().manual_seed(1))
inputs, labels = tokens[:, :-1], tokens[:, 1:]


def step(model):
    """The logits and the gradient of every parameter, for one batch."""
    logits = model(inputs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


(logits, grads), (fused_logits, fused_grads) = step(untouched), step(fused)
same_state = untouched.state_dict().keys() == fused.state_dict().keys()
logit_difference = (fused_logits - logits).abs().max().item()
grad_difference = max((fused_grads[n] - g).abs().max().item() for n, g in grads.items())
print(f"fused: same state dict keys {same_state}, largest logit difference {logit_difference:.2e}, "
      f"largest gradient difference {grad_difference:.2e}")  # fmt: skip
assert same_state and logit_difference <= 1e-5 and grad_difference <= 1e-5

loss = torch.nn.functional.cross_entropy(sandwich(inputs).flatten(0, 1), labels.flatten())
new = sorted(set(sandwich.state_dict()) - set(untouched.state_dict()))
print(f"sandwich: loss {loss:.3f}, {len(new)} new norms, e.g. {new[0]}")
