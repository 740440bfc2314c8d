"""Shared hook logic of the capture scripts: forward hooks on named modules -> one safetensors file per rank.

Naming convention read by `nvfp4-probe compare`: a tensor output is stored under the module path; the i-th
element of a tuple output as `PATH:i` (element 0 also as `PATH`); a module's first input as `PATH:input`
when asked for. Token ids go in `input_ids` (I64), positions in `positions`, the real token count in the
metadata `num_tokens` (engines pad batches), the kept rows in `rows` when --rows subsets them.
"""
import torch
from safetensors.torch import save_file


class Recorder:
    def __init__(self, model, include=None, inputs_of=(), rows=None, dtype=None):
        """include: callable(name, module) -> bool choosing modules; inputs_of: name suffixes whose first
        input is kept too (e.g. "attn.wo_a" gives the attention core); rows: token rows to keep."""
        self.out, self.hooks, self.rows, self.dtype = {}, [], rows, dtype
        self.num_tokens = None
        for name, mod in model.named_modules():
            if not name or (include and not include(name, mod)):
                continue
            self.hooks.append(mod.register_forward_hook(self._fwd(name)))
            if any(name.endswith(s) for s in inputs_of):
                self.hooks.append(mod.register_forward_pre_hook(self._pre(name + ":input")))

    def _keep(self, name, t):
        if not torch.is_tensor(t) or not t.is_floating_point() and t.dtype not in (torch.int32, torch.int64):
            return
        t = t.detach()
        if self.dtype is not None and t.is_floating_point():
            t = t.to(self.dtype)
        # token rows are the leading dim in engines that flatten the batch ([num_tokens, ...])
        if self.rows is not None and self.num_tokens and t.dim() >= 1 and t.shape[0] >= self.num_tokens:
            t = t[self.rows]
        self.out[name] = t.cpu().contiguous()

    def _fwd(self, name):
        def hook(mod, args, res):
            if isinstance(res, (tuple, list)):
                for i, r in enumerate(res):
                    self._keep(f"{name}:{i}", r)
                if res and torch.is_tensor(res[0]):
                    self._keep(name, res[0])
            else:
                self._keep(name, res)
        return hook

    def _pre(self, name):
        def hook(mod, args):
            if args:
                self._keep(name, args[0])
        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def save(self, path, input_ids, positions=None, extra_meta=None):
        t = dict(self.out)
        t["input_ids"] = torch.as_tensor(input_ids, dtype=torch.int64).flatten().cpu()
        if positions is not None:
            t["positions"] = torch.as_tensor(positions, dtype=torch.int64).flatten().cpu()
        meta = {"num_tokens": str(self.num_tokens or t["input_ids"].numel())}
        if self.rows is not None:
            meta["rows"] = ",".join(map(str, self.rows))
        meta.update(extra_meta or {})
        save_file(t, path, metadata=meta)
        return len(t)
