"""Counting where code makes the host wait for an accelerator, on any device (the CPU included).

On CUDA, ``torch.cuda.set_sync_debug_mode`` reports synchronisations, but only on a GPU. ``HostSyncs``
counts, on whatever device the code runs, the operations that force one there:

* reads of device values into Python: ``aten._local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``,
  ``float(t)``), ``aten.equal`` and ``aten.allclose`` (they return a Python bool), and the Python
  ``Tensor.tolist``, ``Tensor.numpy`` and ``Tensor.cpu`` (a device-to-host copy the host must wait for);
* operations whose output size depends on the data, so the host must read a count before it can allocate:
  ``aten.nonzero``, ``aten.masked_select``, ``aten.unique*``, ``aten.repeat_interleave.Tensor`` (without
  ``output_size``), ``aten.bincount``, and ``aten.index.Tensor`` / ``aten.index_put_`` with a boolean
  index (which run ``nonzero``);
* host-to-device copies that are not ``non_blocking``: torch then waits for the copy (``Tensor.to``,
  ``Tensor.cuda`` or ``Tensor.copy_`` of a tensor made on the host inside the counted code: by a factory
  function called without ``device=``, by ``.cpu()``, or computed from such tensors only).

Tensors that exist when counting starts (weights, inputs) count as device tensors. On the CPU the copies are
no-ops, yet they are counted where they would be copies on an accelerator; ``.to("cpu")`` with a string is
counted as a device-to-host copy, ``.to(device)`` with a device object is not (it cannot be told apart from
a no-op there).
"""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

aten = torch.ops.aten
#: aten ops that read a device value on the host (see the module docstring for why each waits).
READS = {aten._local_scalar_dense.default, aten.equal.default, aten.allclose.default}
#: aten ops whose output size depends on the data.
DATA_SIZED = {
    aten.nonzero.default, aten.masked_select.default, aten._unique.default, aten._unique2.default,
    aten.unique_dim.default, aten.unique_consecutive.default, aten.bincount.default,
}  # fmt: skip
BOOL_INDEXED = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
FACTORIES = {torch.tensor, torch.as_tensor, torch.full, torch.zeros, torch.ones, torch.empty, torch.arange,
             torch.full_like, torch.zeros_like, torch.ones_like, torch.empty_like}  # fmt: skip
T = torch.Tensor


def _tensors(*trees) -> list[torch.Tensor]:
    return [x for x in tree_flatten(list(trees))[0] if isinstance(x, torch.Tensor)]


def _arguments(args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments of an aten call (tensors, and lists of them, one level deep: aten's signatures)."""
    out = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _names_device(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names a target device (not only a dtype)."""
    candidates = [*args[1:], kwargs.get("device")]
    return any(isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) for a in candidates
               if a is not None) or any(isinstance(a, torch.Tensor) for a in args[1:])  # fmt: skip


def _names_cpu(args, kwargs) -> bool:
    """Whether a ``Tensor.to`` call names the host by the string "cpu" (a device-to-host copy)."""
    return any(isinstance(a, str) and a.startswith("cpu") for a in (*args[1:], kwargs.get("device")))


class HostSyncs:
    """``with HostSyncs() as syncs: ...``; then ``syncs.count`` and ``syncs.sites`` (call site -> count)."""

    def __init__(self, skip: tuple[str, ...] = ()):
        self.sites: collections.Counter[str] = collections.Counter()
        self.host: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensors made on the host in the counted code
        self.skip = skip
        outer = self

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                inputs = _arguments(args, kwargs)
                on_device = [t for t in inputs if t not in outer.host]
                sized = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
                waits = func in READS or func in DATA_SIZED or sized or (func in BOOL_INDEXED and _bool_index(args))
                if on_device and waits:
                    outer._record(str(func))
                out = func(*args, **kwargs)
                if inputs and not on_device:  # computed from host tensors only: a host tensor
                    for t in _tensors(out) if not isinstance(out, torch.Tensor) else [out]:
                        outer.host[t] = True
                return out

        class Function(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                first = args[0] if args and isinstance(args[0], torch.Tensor) else None
                if func in FACTORIES and "device" not in kwargs:
                    for t in _tensors(out):
                        outer.host[t] = True
                elif first is None:
                    return out
                elif func in (T.tolist, T.numpy) and first not in outer.host:
                    outer._record(f"Tensor.{func.__name__}")
                elif func is T.cpu or (func is T.to and _names_cpu(args, kwargs)):
                    if first not in outer.host:
                        outer._record("Tensor.cpu")
                        out = out.clone() if out is first else out  # a copy on an accelerator
                    outer.host[out] = True
                elif func in (T.to, T.cuda) and first in outer.host and _names_device(args, kwargs):
                    if not kwargs.get("non_blocking", False):
                        outer._record("host-to-device copy")
                    outer.host.pop(out, None)
                elif func is T.copy_ and len(args) > 1 and args[1] in outer.host and first not in outer.host:
                    if not (args[2:] or kwargs.get("non_blocking", False)):
                        outer._record("host-to-device copy")
                return out

        self._modes = (Function(), Dispatch())

    def _record(self, what: str) -> None:
        stack = traceback.extract_stack()[:-3]
        ours = ("diffusion_embedder", "transformers", "peft")
        mine = [f for f in stack if any(o in f.filename for o in ours) and not f.filename.endswith("host_syncs.py")]
        frame = (mine or stack)[-1]
        site = f"{Path(frame.filename).name}:{frame.lineno}"
        if not any(s in site for s in self.skip):
            self.sites[f"{site} {what}"] += 1

    @property
    def count(self) -> int:
        return sum(self.sites.values())

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
