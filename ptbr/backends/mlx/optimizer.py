"""AdamW on MLX with torch.optim.AdamW's arithmetic, applied one decoder layer at a time.

The same update as the torch backend's optimizer (decoupled weight decay, bias correction, eps
added after the square root; no weight decay on 1-D parameters, the norms and biases). MLX writes
a parameter's update to new buffers before the old ones are freed: updated all at once, the new
weights and AdamW state of the whole model (12 B per parameter) sit beside the old ones. Layer by
layer, only one layer's do. One compiled function serves every decoder layer (their parameters
have the same names within the layer and the same shapes).

The state is one flat dictionary of arrays by parameter name (m.NAME, v.NAME) and the step count:
a checkpoint stores it as safetensors.
"""

from __future__ import annotations

import math
import re
from functools import partial

LAYER = re.compile(r"^(.*\.layers\.\d+)\.(.+)$")


def _adamw(params: dict, grads: dict, m: dict, v: dict, clip, decay, step_size, bias2_sqrt, *, beta1: float,
           beta2: float, eps: float):
    """New (params, m, v) for one group: torch's AdamW step on gradients scaled by `clip`."""
    import mlx.core as mx

    new_params, new_m, new_v = {}, {}, {}
    for name, param in params.items():
        grad = grads[name] * clip
        first = beta1 * m[name] + (1 - beta1) * grad
        second = beta2 * v[name] + (1 - beta2) * mx.square(grad)
        if param.ndim >= 2:  # decoupled weight decay, not on norms and biases
            param = param * decay
        new_params[name] = param - step_size * first / (mx.sqrt(second) / bias2_sqrt + eps)
        new_m[name], new_v[name] = first, second
    return new_params, new_m, new_v


def groups(names: list[str]) -> dict[str, list[str]]:
    """Parameter names by decoder layer ("model.layers.N"), the others under ""."""
    found: dict[str, list[str]] = {}
    for name in names:
        match = LAYER.match(name)
        found.setdefault(match.group(1) if match else "", []).append(name)
    return found


class AdamW:
    def __init__(self, params: dict, learning_rate: float, betas: tuple[float, float], eps: float,
                 weight_decay: float):
        import mlx.core as mx

        self.learning_rate, self.beta1, self.beta2 = learning_rate, betas[0], betas[1]
        self.eps, self.weight_decay = eps, weight_decay
        self.step = 0
        self.m = {name: mx.zeros_like(value) for name, value in params.items()}
        self.v = {name: mx.zeros_like(value) for name, value in params.items()}
        self.groups = groups(sorted(params))
        self._update = mx.compile(partial(_adamw, beta1=self.beta1, beta2=self.beta2, eps=eps))

    def update(self, model, grads: dict, lr: float, clip: float) -> None:
        """One step: the model's trainable weights (flat `grads` names them) updated layer by layer,
        each layer's new weights and state evaluated before the next, and its old weights, state
        and gradients let go (`grads` is emptied as it goes: the caller keeps no other reference)."""
        import mlx.core as mx
        from mlx.utils import tree_flatten, tree_unflatten

        self.step += 1
        scalars = [mx.array(value, mx.float32) for value in (
            clip, 1 - lr * self.weight_decay, lr / (1 - self.beta1 ** self.step), math.sqrt(1 - self.beta2 ** self.step))]
        params = dict(tree_flatten(model.trainable_parameters()))
        for prefix, names in self.groups.items():
            cut = len(prefix) + 1 if prefix else 0  # names within the layer: one trace for every layer
            local = {name[cut:]: name for name in names}
            new_params, new_m, new_v = self._update(
                {k: params.pop(n) for k, n in local.items()}, {k: grads.pop(n) for k, n in local.items()},
                {k: self.m[n] for k, n in local.items()}, {k: self.v[n] for k, n in local.items()}, *scalars)
            for key, name in local.items():
                self.m[name], self.v[name] = new_m[key], new_v[key]
            model.update(tree_unflatten([(local_name, new_params[k]) for k, local_name in local.items()]))
            mx.eval(new_params, new_m, new_v)

    def state(self) -> dict:
        """The arrays a checkpoint stores (safetensors: names -> arrays)."""
        import mlx.core as mx

        return ({f"m.{name}": value for name, value in self.m.items()}
                | {f"v.{name}": value for name, value in self.v.items()} | {"step": mx.array(self.step, mx.int64)})

    def load(self, state: dict) -> None:
        expected = set(self.state())
        if set(state) != expected:
            missing = sorted(expected - set(state))[:3] or sorted(set(state) - expected)[:3]
            raise ValueError(f"the optimizer state does not match this model ({', '.join(missing)})")
        self.step = int(state["step"].item())
        self.m = {name: state[f"m.{name}"] for name in self.m}
        self.v = {name: state[f"v.{name}"] for name in self.v}

    def arrays(self) -> list:
        return [*self.m.values(), *self.v.values()]
