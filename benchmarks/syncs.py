"""Host syncs of a step, counted on the CPU: the device-to-host reads it would make on a GPU.

On a GPU each of these stops the host until the device has caught up (and copies to the host):

* a tensor's value read into Python: ``.item()``, ``float(t)``, ``int(t)``, ``bool(t)`` and ``if t:``
  (a tensor's truth value, ``is_nonzero``): all reach ``aten::_local_scalar_dense``; ``torch.equal``;
* ``.tolist()``, ``.numpy()``, ``.cpu()``, ``.to("cpu")``, and a ``copy_`` into a host tensor;
* ops whose output size lives on the device: ``nonzero``, indexing with a boolean mask (``x[mask]``,
  ``x[mask] = v``), ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``.

On the CPU nothing syncs, so :class:`HostSyncs` counts the ops that WOULD. Why a
``TorchDispatchMode`` and not the profiler's op names: the mode sees every aten op after autograd,
the backward's included, with its arguments, so it tells a boolean-mask index from an integer one and
a read of a host tensor from a read of a device tensor; the profiler names the op only. Neither sees
``.tolist()`` / ``.cpu()`` / ``.numpy()`` of a CPU tensor (no op is dispatched: the data is already on
the host), so the counter also wraps those ``torch.Tensor`` methods while it is active.

Host or device: on the CPU every tensor is on the CPU. The counter takes every tensor to be on the
device except those it knows are host tensors: what a counted read returned (``.cpu()``, ``.to("cpu")``),
what ``torch.tensor``, ``torch.as_tensor`` of Python data and the factories (``zeros``, ``arange``, ...) make
without a ``device`` argument
or with the string ``"cpu"`` (the host on a GPU too), the outputs of ops whose tensor inputs are all
host tensors, and the tensors the caller marks (``mark_host``: a non-capturable optimizer's step
counters, made on the host before the counted step). A read of a host tensor is not a sync. ``.to(device)``
counts only for the string ``"cpu"``: on the CPU
``t.to(x.device)`` names the same device as a move to the host would, so a ``torch.device("cpu")``
argument is read as "the device".

What it misses: a read inside a C++ op that is not dispatched again (none of the ops above), CUDA's own
syncs (``torch.cuda.synchronize``, allocator and cuBLAS workspace syncs, pageable host-to-device
copies), and a host tensor made by ``torch.tensor(data, device=torch.device("cpu"))`` (taken as on the
device, as ``device=x.device`` must be).
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

aten = torch.ops.aten
READ_OPS = {aten._local_scalar_dense.default: "item / truth value", aten.equal.default: "equal"}
SIZE_OPS = {  # the output size is computed on the device and read back
    aten.nonzero.default: "nonzero", aten.masked_select.default: "masked_select",
    aten._unique.default: "unique", aten._unique2.default: "unique", aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
}
MASK_INDEX_OPS = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default)
FACTORIES = ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint", "linspace",
             "eye")
HERE = os.path.abspath(__file__)
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _names_host(dev) -> bool:
    """A device argument that names the host: the string "cpu" (see the module docstring)."""
    return isinstance(dev, str) and dev.split(":")[0] == "cpu"


class HostSyncs(TorchDispatchMode):
    """Count the device-to-host reads of the code run inside ``with HostSyncs() as s:``.

    ``s.count``: reads; ``s.kinds``: by kind; ``s.where``: by the first caller outside torch
    (``file:line function``). Copies a GPU would make with ``cudaMemcpyAsync`` but no kernel (a copy
    between same-dtype contiguous tensors, a ``clone`` of a contiguous one) are counted apart in
    ``s.memcpys``: not syncs, but what a CUDA profile lists beside them, and no kernel launch.
    ``memcpy_here``: whether a copy at this moment counts there (default: always).
    """

    def __init__(self, memcpy_here=lambda: True):
        super().__init__()
        self.memcpy_here = memcpy_here
        self.count = 0
        self.kinds: Counter = Counter()
        self.where: Counter = Counter()
        self.memcpys = 0
        self.host = WeakTensorKeyDictionary()
        self._saved: dict = {}
        self._quiet = False  # the counter's own ops (the copy a counted .cpu() returns) count nothing

    # ------------------------------------------------------------ bookkeeping

    def mark_host(self, *tensors) -> None:
        """Take ``tensors`` (any nesting of lists, tuples, dicts) as host tensors: reading them is free."""
        for t in pytree.tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self.host[t] = True

    def on_host(self, t: torch.Tensor) -> bool:
        return t in self.host

    def _record(self, kind: str) -> None:
        self.count += 1
        self.kinds[kind] += 1
        self.where[_caller()] += 1

    # ------------------------------------------------------------ aten ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._quiet:
            return func(*args, **kwargs)
        ins = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        host_only = bool(ins) and all(self.on_host(t) for t in ins)
        kind = None if host_only else self._sync_kind(func, args, kwargs)
        self._memcpy(func, args)
        out = func(*args, **kwargs)
        if kind:
            self._record(kind)
        if host_only:
            self.mark_host(out)
        return out

    def _sync_kind(self, func, args, kwargs):
        if func in READ_OPS:
            return READ_OPS[func]
        if func in SIZE_OPS:
            return SIZE_OPS[func]
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            return "repeat_interleave"
        if func in MASK_INDEX_OPS and len(args) > 1 and any(_is_mask(i) for i in args[1] if i is not None):
            return "boolean-mask index"
        if func is aten.copy_.default and self.on_host(args[0]) and not self.on_host(args[1]):
            return "copy to host"
        return None

    def _memcpy(self, func, args) -> None:
        if not self.memcpy_here():
            return
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.dtype == src.dtype and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous():
                self.memcpys += 1
        elif func is aten.clone.default and args[0].is_contiguous():
            self.memcpys += 1

    # ------------------------------------------------------------ Tensor methods no op is dispatched for

    def _wrap(self):
        mode = self
        cpu, to, tolist, numpy = torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.tolist, torch.Tensor.numpy
        as_tensor = torch.as_tensor

        def read_to_host(t: torch.Tensor, kind: str) -> torch.Tensor:
            if mode.on_host(t):
                return t
            mode._record(kind)
            mode._quiet = True
            try:
                out = t.detach().clone()  # a new tensor: the device one stays on the device
            finally:
                mode._quiet = False
            mode.mark_host(out)
            return out

        def cpu_(self, *a, **k):
            return read_to_host(cpu(self, *a, **k), ".cpu()")

        def to_(self, *a, **k):
            out = to(self, *a, **k)
            if not _names_host(k.get("device", a[0] if a else None)):
                return out
            return read_to_host(out, '.to("cpu")')

        def tolist_(self):
            if not mode.on_host(self):
                mode._record(".tolist()")
            return tolist(self)

        def numpy_(self, *a, **k):
            if not mode.on_host(self):
                mode._record(".numpy()")
            return numpy(self, *a, **k)

        def factory(make):
            def made(*a, **k):
                out = make(*a, **k)
                dev = k.get("device")
                # the host on a GPU too; as_tensor of a tensor is that tensor, wherever it lives
                if (dev is None or _names_host(dev)) and not (make is as_tensor and isinstance(a[0], torch.Tensor)):
                    mode.mark_host(out)
                return out
            return made

        self._saved = {(torch.Tensor, "cpu"): cpu, (torch.Tensor, "to"): to, (torch.Tensor, "tolist"): tolist,
                       (torch.Tensor, "numpy"): numpy}
        self._saved.update({(torch, name): getattr(torch, name) for name in FACTORIES})
        torch.Tensor.cpu, torch.Tensor.to, torch.Tensor.tolist, torch.Tensor.numpy = cpu_, to_, tolist_, numpy_
        for name in FACTORIES:
            setattr(torch, name, factory(getattr(torch, name)))

    def _unwrap(self):
        for (owner, name), fn in self._saved.items():
            setattr(owner, name, fn)
        self._saved = {}

    def __enter__(self):
        self._wrap()
        try:
            return super().__enter__()
        except BaseException:
            self._unwrap()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._unwrap()


def _caller() -> str:
    """The innermost frame outside torch and this file: where the read is written."""
    for fr in reversed(traceback.extract_stack()[:-2]):
        path = os.path.abspath(fr.filename)
        if path != HERE and not path.startswith(TORCH_DIR):
            return f"{os.path.basename(path)}:{fr.lineno} {fr.name}"
    return "?"


@contextlib.contextmanager
def counting(*host_tensors):
    """``with counting(...) as s:`` = ``HostSyncs`` with ``host_tensors`` marked as host tensors."""
    mode = HostSyncs()
    mode.mark_host(host_tensors)
    with mode:
        yield mode
